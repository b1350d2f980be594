"""The trial's datasets and collate functions (module level: both loaders get the same ones)."""

from __future__ import annotations

import itertools
import time

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

N = 400          # samples an epoch: 100 batches of 4


class Plain(Dataset):
    """Sample i: ``{"x": float32[3] of i, "y": i}`` (trial22's), ``n`` of them."""

    def __init__(self, n: int = N):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": torch.full((3,), float(i)), "y": i}


class NumpyPlain(Plain):
    """The same with a numpy array."""

    def __getitem__(self, i):
        return {"x": np.full((3,), i, np.float32), "y": i}


class Tokens(Plain):
    """Sample i: int64 token ids of a length 5..60 that varies with i."""

    def __getitem__(self, i):
        return np.arange((i * 37) % 56 + 5, dtype=np.int64) + i


def pad_collate(batch):
    """A text collate: padded to the batch's longest, with lengths and a mask (torch tensors)."""
    seqs = [torch.from_numpy(s) for s in batch]
    lengths = torch.tensor([len(s) for s in seqs])
    ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)
    mask = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
    return {"input_ids": ids, "attention_mask": mask, "lengths": lengths}


class Detect(Plain):
    """Sample i: ``(image float32[3, 8, 8], boxes float32[k, 4] with k = i % 7, label i)``."""

    def __getitem__(self, i):
        return (np.full((3, 8, 8), i % 251, np.float32),
                np.full((i % 7, 4), i, np.float32), i)


class DetectPooled(Plain):
    """The bench's detect workload: samples drawn from a pool of 6 prepared arrays, so one
    array object comes twice in a batch, in places that vary from batch to batch."""

    def __init__(self, n: int = N):
        super().__init__(n)
        self.images = [np.full((3, 8, 8), k, np.float32) for k in range(6)]
        self.boxes = [np.full((k % 4 + 1, 4), k, np.float32) for k in range(6)]

    def __getitem__(self, i):
        k = (i * 7919) % 6
        return self.images[k], self.boxes[k], i


def detect_collate(batch):
    return tuple(zip(*batch))


class Strings(Plain):
    """Object leaves: a str, bytes, a float."""

    def __getitem__(self, i):
        return {"name": f"sample-{i}", "raw": bytes([i % 256]) * (i % 9 + 1), "w": i / 3}


class DictOfLists(Plain):
    """Dicts of lists of varying lengths (a custom collate keeps them as lists)."""

    def __getitem__(self, i):
        return {"id": i, "tags": list(range(i % 5)), "words": ["w"] * (i % 3), "x": float(i)}


def lists_collate(batch):
    return {"ids": torch.tensor([b["id"] for b in batch]), "tags": [b["tags"] for b in batch],
            "words": [b["words"] for b in batch],
            "x": torch.tensor([b["x"] for b in batch])}


RECORD = np.dtype([("a", np.float32), ("b", np.int64, (2,)), ("c", "S4")])


class Structured(Plain):
    """A numpy structured record per sample."""

    def __getitem__(self, i):
        r = np.zeros((), RECORD)
        r["a"], r["b"], r["c"] = i, (i, -i), str(i % 1000).encode()
        return r


def stack_collate(batch):
    return np.stack(batch)


class Dtypes(Plain):
    """Tensors of several dtypes, bfloat16 among them."""

    def __getitem__(self, i):
        return {"bf16": torch.full((4,), float(i), dtype=torch.bfloat16),
                "f16": torch.full((2,), float(i), dtype=torch.float16),
                "f64": torch.full((2,), float(i), dtype=torch.float64),
                "i8": torch.full((3,), i % 100, dtype=torch.int8),
                "u8": torch.full((3,), i % 256, dtype=torch.uint8),
                "b": torch.tensor([i % 2 == 0]),
                "c64": torch.full((1,), complex(i, 1), dtype=torch.complex64),
                "i32": torch.tensor(i, dtype=torch.int32)}


class Big(Plain):
    """Larger samples: float32[64, 256] (64 KiB), a batch of 8 is 512 KiB."""

    def __getitem__(self, i):
        return torch.full((64, 256), float(i))


class Raising(Plain):
    """Raises ``ValueError`` for 1% of the samples."""

    def __getitem__(self, i):
        if i % 100 == 37:
            raise ValueError(f"bad sample {i}")
        return super().__getitem__(i)


class Stream(IterableDataset):
    """An iterable-style dataset: ``n`` samples, sharded by worker."""

    def __init__(self, n: int = N):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            yield {"x": torch.full((3,), float(i)), "y": i}


class StatefulStream(Stream):
    """The same, with torchdata's Stateful protocol (state_dict / load_state_dict): the
    position it has reached."""

    def __init__(self, n: int = N):
        super().__init__(n)
        self.position = 0

    def __iter__(self):
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        first = self.position
        self.position = 0
        for k, i in enumerate(range(start, self.n, step)):
            if k < first:
                continue
            self.position = k + 1
            yield {"x": torch.full((3,), float(i)), "y": i}
        self.position = 0  # (ended: the next epoch starts from the beginning)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class Novel(Plain):
    """Sample i: float32[(i * 7919) % 997 + 1]: padded, nearly every batch has a new shape."""

    def __getitem__(self, i):
        return np.full(((i * 7919) % 997 + 1,), i, np.float32)


def pad_numpy_collate(batch):
    out = np.zeros((len(batch), max(len(s) for s in batch)), np.float32)
    for row, s in zip(out, batch):
        row[:len(s)] = s
    return out


_batches_made = itertools.count()


def new_keys_collate(batch):
    """Every batch a structure of its own: a key named by a running count (per process)."""
    return {f"b{next(_batches_made)}": torch.stack([b["x"] for b in batch]),
            "y": torch.tensor([b["y"] for b in batch])}


class SlowSome(Plain):
    """Sample i sleeps 0.3 s when i % 200 == 3 (a ``timeout=0.1`` fires there)."""

    def __getitem__(self, i):
        if i % 200 == 3:
            time.sleep(0.3)
        return super().__getitem__(i)
