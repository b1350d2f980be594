"""s3: a wrong ``__len__``, and samplers / batch samplers that yield what the dataset cannot
take (20 samples, batches of 4).

    python s3_len_samplers.py [substring]
"""

from __future__ import annotations

import numpy as np
import torch
from common import Case, N, compare, report
from torch.utils.data import Dataset, Sampler


class Items(Dataset):
    """A list-backed dataset (``self.items[i]``: negative indices work, as for a list)."""

    def __init__(self, length=N):
        self.length = length
        self.items = [{"x": torch.full((3,), float(i)), "y": i} for i in range(N)]

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        return self.items[i]


class Keyed(Dataset):
    """A dict-backed dataset keyed by file name: the sampler yields the keys (legal in torch)."""

    def __init__(self):
        self.items = {f"img_{i:04d}": {"x": torch.full((3,), float(i)), "y": i} for i in range(N)}

    def __len__(self):
        return N

    def __getitem__(self, key):
        return self.items[key]


class Scaled(Items):
    """Multi-scale training: the sampler yields ``(index, scale)`` pairs."""

    def __getitem__(self, pair):
        i, scale = pair
        return {"x": self.items[i]["x"] * scale, "y": i}


class Listed(Sampler):
    def __init__(self, indices):
        self.indices = indices

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


class FloatIndexed(Items):
    """A dataset that takes float indices (``int(i)``), as many hand-written ones do."""

    def __getitem__(self, i):
        return self.items[int(i)]


def seq(*extra):
    return list(range(8)) + list(extra) + list(range(8, 20))


def keyed_sampler():
    return Listed([f"img_{i:04d}" for i in range(N)])


SAMPLER = r"sampler|index"
CASES = [
    Case("len-too-short", lambda: Items(N - 6)),
    Case("len-negative", lambda: Items(-1), names=(r"__len__",)),
    Case("len-float", lambda: Items(20.0), names=(r"__len__",),
         known="torch's text alone (Python's len()), neither names __len__"),
    Case("len-numpy-int", lambda: Items(np.int64(N))),
    Case("len-zero-shuffle", lambda: Items(0), options={"shuffle": True}),
    Case("sampler-out-of-range", Items, options={"sampler": Listed(seq(25))},
         names=(r"\b25\b", r"len\(dataset\)"), fix=r"fix the sampler|range\(len"),
    Case("sampler-negative", Items, options={"sampler": Listed(seq(-1))}),
    Case("sampler-float", Items, options={"sampler": Listed(seq(3.0))}),
    Case("sampler-float-taken", FloatIndexed, options={"sampler": Listed(seq(3.0))}),
    Case("sampler-numpy-float", FloatIndexed, options={"sampler": Listed(seq(np.float32(3)))}),
    Case("sampler-str", Items, options={"sampler": Listed(seq("3"))}),
    Case("sampler-none", Items, options={"sampler": Listed(seq(None))}),
    Case("sampler-str-keys", Keyed, options={"sampler": keyed_sampler()}),
    Case("sampler-tuples", Scaled, options={"sampler": Listed([(i, 2.0) for i in range(N)])}),
    Case("sampler-tensor-indices", Items, options={"sampler": Listed(list(torch.arange(N)))}),
    Case("sampler-not-iterable", Items, options={"sampler": 10}),
    Case("batch-sampler-empty", Items,
         options={"batch_size": 1, "batch_sampler": Listed([[0, 1], [], [2, 3]])},
         names=(r"batch_sampler|empty",)),
    Case("batch-sampler-ints", Items,
         options={"batch_size": 1, "batch_sampler": Listed([0, 1, 2])}),
    Case("batch-sampler-out-of-range", Items,
         options={"batch_size": 1, "batch_sampler": Listed([[0, 1], [2, 30], [4, 5]])},
         names=(r"\b30\b",)),
    Case("batch-sampler-with-batch-size", Items,
         options={"batch_size": 4, "batch_sampler": Listed([[0, 1]])}, configs=((0, False),),
         names=(r"batch_sampler",)),
    Case("sampler-and-shuffle", Items, options={"sampler": Listed(seq()), "shuffle": True},
         configs=((0, False),), names=(r"shuffle",)),
]

if __name__ == "__main__":
    for case in CASES:
        compare(case)
    report()
