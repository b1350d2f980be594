"""Scenario 6: strings, None, ragged, big samples, pin_memory without GPU, drop_last, batch_size=None."""

import os
import sys

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

sys.path.insert(0, os.path.dirname(__file__))
from common import compare, report_end, seeded, shm, variants  # noqa: E402

N = 19


class Mixed:
    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"s": f"str{i}", "b": f"b{i}".encode(), "npstr": np.str_(f"n{i}"), "f": i / 3, "flag": i % 2 == 0,
                "nested": {"a": np.arange(2) + i, "t": (i, float(i))}, "i64": np.int64(i), "f16": np.float16(i),
                "arr0d": np.array(i, np.int32), "list": [i, i + 1]}


class WithNone:
    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"x": i, "mask": None if i % 5 else np.ones(2)}


class Ragged:
    def __len__(self):
        return N

    def __getitem__(self, i):
        return np.arange(i % 4 + 1, dtype=np.float32), i


def list_collate(b):
    return [x for x, _ in b], torch.tensor([y for _, y in b])


def np_list_collate(b):
    return [x for x, _ in b], np.array([y for _, y in b])


class Big:
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return np.full((6_000_000,), i, np.float32)  # 24 MB a sample


class Stream(IterableDataset):
    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        for i in range(wid, 23, nw):
            yield {"x": np.full(3, i, np.float32), "name": f"item{i}"}


class TensorDS:
    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.full((2, 3), float(i)), torch.tensor(i)


def tensor_list_collate(b):
    return b


if __name__ == "__main__":
    before = shm()
    base = dict(batch_size=4, shuffle=True)
    for tag, kw in variants(base):
        compare(f"6 mixed leaves {tag}", Mixed(), seeded(kw), extra={"output": "torch"})
        compare(f"6 ragged list collate {tag}", Ragged(), seeded(dict(kw, collate_fn=list_collate)))
        compare(f"6 ragged np list collate {tag}", Ragged(), seeded(dict(kw, collate_fn=np_list_collate)))
        compare(f"6 iterable strings {tag}", Stream(), lambda kw=kw: dict(kw, shuffle=False, batch_size=5),
                extra={"output": "torch"})
        compare(f"6 tensors drop_last {tag}", TensorDS(), seeded(dict(kw, drop_last=True)))
        compare(f"6 tensors batch_size=None {tag}", TensorDS(), seeded(dict(kw, batch_size=None)))
        compare(f"6 tensors list passthrough {tag}", TensorDS(), seeded(dict(kw, collate_fn=tensor_list_collate)))
        compare(f"6 pin_memory tensors {tag}", TensorDS(), seeded(dict(kw, pin_memory=True)))
        compare(f"6 mixed batch_size=None {tag}", Mixed(), seeded(dict(kw, batch_size=None)),
                extra={"output": "torch"})
    compare("6 None field nw=0", WithNone(), seeded(dict(base, num_workers=0)), extra={"output": "torch"})
    compare("6 None field nw=2", WithNone(), seeded(dict(base, num_workers=2)), extra={"output": "torch"})
    compare("6 big samples nw=2", Big(), lambda: dict(batch_size=2, num_workers=2), epochs=2,
            extra={"output": "torch"})
    compare("6 big samples nw=0", Big(), lambda: dict(batch_size=2, num_workers=0), epochs=1,
            extra={"output": "torch"})
    report_end(before)
