"""What the dataset is given as an index, and the batches, when the sampler or batch sampler
yields something other than Python ints: torch tensors, numpy scalars, numpy arrays of
several dtypes (contiguous and strided), tuples, ranges. torch's DataLoader against
ArenaLoader, 0 and 2 workers."""

from __future__ import annotations

import numpy as np
import torch
from common import Tally, leftovers, shm_names, wants
from torch.utils.data import DataLoader

from arena_loader import ArenaLoader


class Kinds:
    def __len__(self) -> int:
        return 20

    def __getitem__(self, index) -> dict:
        return {"i": torch.tensor(int(index)), "kind": type(index).__name__}


class Yields:
    """A sampler or batch sampler yielding ``items`` (made anew per epoch)."""

    def __init__(self, make):
        self.make = make

    def __len__(self) -> int:
        return len(self.make())

    def __iter__(self):
        return iter(self.make())


def arrays(dtype, strided=False):
    order = np.arange(19, -1, -1).astype(dtype)
    return [order[k::3] for k in range(3)] if strided else np.array_split(order, 3)


CASES = {
    "sampler/tensor-scalars": dict(sampler=Yields(lambda: list(torch.randperm(
        20, generator=torch.Generator().manual_seed(0)))), batch_size=4),
    "sampler/numpy-scalars": dict(sampler=Yields(lambda: list(
        np.random.default_rng(0).permutation(20))), batch_size=4),
    "sampler/tensor-scalars-unbatched": dict(sampler=Yields(lambda: list(torch.arange(6))),
                                             batch_size=None),
    "batches/tensors": dict(batch_sampler=Yields(lambda: list(torch.arange(20).split(7)))),
    "batches/tuples": dict(batch_sampler=Yields(lambda: [(0, 1, 2), (3, 4)])),
    "batches/ranges": dict(batch_sampler=Yields(lambda: [range(0, 3), range(3, 5)])),
}
for dtype in (np.int64, np.int32, np.uint8, np.int16, np.uint64):
    CASES[f"batches/numpy-{dtype.__name__}"] = dict(
        batch_sampler=Yields(lambda dtype=dtype: arrays(dtype)))
CASES["batches/numpy-int64-strided"] = dict(
    batch_sampler=Yields(lambda: arrays(np.int64, strided=True)))


def batches(kind, options):
    try:
        loader = kind(Kinds(), **options)
    except Exception as exc:
        return type(exc).__name__
    try:
        return [(b["i"].tolist(), b["kind"]) for b in loader]
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
    finally:
        getattr(loader, "close", lambda: None)()


if __name__ == "__main__":
    tally = Tally()
    for name, options in CASES.items():
        for workers in (0, 2):
            label = f"{name}/nw{workers}"
            if not wants(label):
                continue
            before = shm_names()
            want = batches(DataLoader, dict(options, num_workers=workers))
            got = batches(ArenaLoader, dict(options, num_workers=workers, output="torch"))
            if want == got:
                tally.add("ok", label)
            elif isinstance(want, list) and isinstance(got, list) and \
                    [w[0] for w in want] == [g[0] for g in got]:
                kinds = sorted({k for _, ks in want for k in ks}), \
                    sorted({k for _, ks in got for k in ks})
                tally.add("TYPES", label, f"same batches; index types torch={kinds[0]} "
                          f"arena={kinds[1]}")
            else:
                tally.add("MISMATCH", label, f"torch={str(want)[:150]} arena={str(got)[:150]}")
            for found in leftovers(before):
                tally.add("LEAK", label, found)
    tally.done()
