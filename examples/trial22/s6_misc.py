"""s6: spawn-started workers with a dataset that does not pickle, a loader iterated inside a
worker, ``len()`` and options an iterable-style dataset does not take, an iterable dataset
that raises mid-stream, things that are not datasets.

    python s6_misc.py [substring]
"""

from __future__ import annotations

import threading

import torch
from common import BAD, Case, N, Plain, compare, report
from torch.utils.data import DataLoader, IterableDataset

from arena_loader import ArenaLoader


class HoldsLock(Plain):
    """A dataset holding a lock (an open LMDB env, a DB connection): pickled by spawn."""

    def __init__(self):
        self.lock = threading.Lock()


def local_dataset():
    class Local(Plain):
        pass
    return Local()


class Nested(Plain):
    """Each sample iterates a loader of its own (with workers) inside the worker."""

    def __init__(self, loader: str, workers: int):
        self.loader, self.workers = loader, workers

    def __getitem__(self, i):
        cls = DataLoader if self.loader == "torch" else ArenaLoader
        inner = cls(list(range(4)), batch_size=2, num_workers=self.workers)
        total = sum(int(b.sum()) for b in inner)
        if hasattr(inner, "close"):
            inner.close()
        return {"x": torch.full((3,), float(i)), "y": total}


class Stream(IterableDataset):
    def __iter__(self):
        for i in range(N):
            yield {"x": torch.full((3,), float(i)), "y": i}


class StreamRaising(IterableDataset):
    """Raises at its 10th item (a corrupt record in a shard)."""

    def __iter__(self):
        for i in range(N):
            if i == BAD:
                raise ValueError(f"corrupt record {i}")
            yield {"x": torch.full((3,), float(i)), "y": i}


class StreamWithLen(Stream):
    def __len__(self):
        return 3  # fewer than it yields: torch warns


SPAWN = {"multiprocessing_context": "spawn"}
SPAWN_CONFIGS = ((2, False),)
CASES = [
    Case("spawn-dataset-holds-lock", HoldsLock, options=SPAWN, configs=SPAWN_CONFIGS,
         names=(r"lock",), hard_s=60),
    Case("spawn-local-dataset-class", local_dataset, options=SPAWN, configs=SPAWN_CONFIGS,
         names=(r"Local",), hard_s=60),
    Case("forkserver-dataset-holds-lock", HoldsLock,
         options={"multiprocessing_context": "forkserver"}, configs=SPAWN_CONFIGS,
         names=(r"lock",), hard_s=60),
    Case("nested-loader-in-worker-torch", lambda: Nested("torch", 2), configs=((2, False),)),
    Case("nested-loader-in-worker-ours", lambda: Nested("arena", 2), configs=((2, False),)),
    Case("nested-loader-nw0-in-worker", lambda: Nested("arena", 0), configs=((2, False),)),
    Case("len-of-iterable-loader", Stream, action=len, configs=((0, False), (2, False))),
    Case("len-of-iterable-with-len", StreamWithLen, configs=((0, False), (2, False))),
    Case("iterable-with-shuffle", Stream, options={"shuffle": True}, configs=((0, False),),
         names=(r"shuffle",)),
    Case("iterable-with-sampler", Stream, options={"sampler": list(range(N))},
         configs=((0, False),), names=(r"sampler",)),
    Case("iterable-raises-mid-stream", StreamRaising, names=(r"corrupt record 9",)),
    Case("generator-as-dataset", lambda: (i for i in range(N)), configs=((0, False),)),
    Case("int-as-dataset", lambda: 20, configs=((0, False),)),
    Case("dataset-class-not-instance", lambda: Plain, configs=((0, False),)),
]

if __name__ == "__main__":
    for case in CASES:
        compare(case)
    report()
