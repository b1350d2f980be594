"""Scenario 4: collate_fn returning custom objects (PyG Batch, own class, dataclass, namedtuple)."""

import collections
import dataclasses
import os
import sys

import numpy as np
import torch
from torch_geometric.data import Batch, Data
from torch_geometric.loader.dataloader import Collater

sys.path.insert(0, os.path.dirname(__file__))
from common import compare, plain, report_end, seeded, shm, variants  # noqa: E402

N = 21


class Graphs:
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.items = []
        for i in range(N):
            n = 3 + i % 4
            self.items.append(Data(x=torch.randn(n, 5, generator=g),
                                   edge_index=torch.randint(0, n, (2, 2 * n), generator=g),
                                   y=torch.tensor([i % 3]), name=f"g{i}"))

    def __len__(self):
        return N

    def __getitem__(self, i):
        return self.items[i]


def pyg_plain(b):
    return plain({k: b[k] for k in sorted(b.keys())}) + (type(b).__name__, b.num_graphs,
                                                          [plain(d.x) for d in b.to_data_list()])


class MyBatch:
    def __init__(self, x, y, meta):
        self.x, self.y, self.meta = x, y, meta

    def pin_memory(self):
        self.x = self.x.pin_memory()
        return self


@dataclasses.dataclass
class DC:
    x: torch.Tensor
    y: np.ndarray
    names: list


NT = collections.namedtuple("NT", "x y")


class Simple:
    def __len__(self):
        return N

    def __getitem__(self, i):
        return np.full((3,), i, np.float32), i


def my_collate(b):
    return MyBatch(torch.stack([torch.from_numpy(x) for x, _ in b]), torch.tensor([y for _, y in b]),
                   {"n": len(b)})


def dc_collate(b):
    return DC(torch.stack([torch.from_numpy(x) for x, _ in b]), np.array([y for _, y in b]),
              [f"s{y}" for _, y in b])


def nt_collate(b):
    return NT(torch.stack([torch.from_numpy(x) for x, _ in b]), torch.tensor([y for _, y in b]))


class NTSamples(Simple):
    def __getitem__(self, i):
        return NT(np.full((3,), i, np.float32), i)


class DCSamples(Simple):
    def __getitem__(self, i):
        return DC(torch.full((3,), float(i)), np.int64(i), [f"s{i}"])


if __name__ == "__main__":
    before = shm()
    import common
    orig_plain = common.plain

    def plain2(x):
        return pyg_plain(x) if isinstance(x, Batch) else orig_plain(x)
    common.plain = plain2
    g = Graphs()
    base = dict(batch_size=5, shuffle=True)
    for tag, kw in variants(base):
        compare(f"4 pyg Collater {tag}", g, seeded(dict(kw, collate_fn=Collater(g))))
        compare(f"4 pyg from_data_list {tag}", g, seeded(dict(kw, collate_fn=Batch.from_data_list)))
        compare(f"4 own class {tag}", Simple(), seeded(dict(kw, collate_fn=my_collate)))
        compare(f"4 dataclass collate {tag}", Simple(), seeded(dict(kw, collate_fn=dc_collate)))
        compare(f"4 namedtuple collate {tag}", Simple(), seeded(dict(kw, collate_fn=nt_collate)))
        compare(f"4 namedtuple samples default {tag}", NTSamples(), seeded(kw), extra={"output": "torch"})
        compare(f"4 dataclass samples default {tag}", DCSamples(), seeded(kw), extra={"output": "torch"})
    compare("4 own class pin_memory nw=2", Simple(), seeded(dict(base, num_workers=2, collate_fn=my_collate,
                                                                 pin_memory=True)))
    compare("4 pyg default collate nw=0", g, seeded(dict(base, num_workers=0)))
    report_end(before)
