"""trial17 repro: a dataclass-like batch from a collate_fn loses state outside its fields.

1. A tensorclass that a collate_fn returns loses its batch_size.

torch's DataLoader hands out the collate_fn's object as it is: ``Step`` with
``batch_size=[4]``. ArenaLoader takes a tensorclass apart as a dataclass (its
``__dataclass_fields__``: obs, reward), writes the fields into the slot and rebuilds it with
``Step(obs=..., reward=...)`` (arena_loader/_layout/plan.py, ``rebuild``), so state outside the
fields is lost: the batch comes back with ``batch_size=[]``, so ``batch[0]`` raises and
``len(batch)`` is 0. The same holds for any dataclass whose instances carry state beyond
their init fields. Default collation of tensorclass samples is not affected (torch's
registered collate function for tensorclasses is used, and its result is kept).

2. The same rebuild, for a plain dataclass with a ``field(init=False)`` (set in
``__post_init__``): ``Batch(**fields)`` raises TypeError, and the fallback hands out the
fields as a plain ``dict``; torch's DataLoader gives the ``Batch``.

    .venv/bin/python examples/trial17/repro_tensorclass_batch_size.py
"""

import dataclasses

import numpy as np
import torch
from tensordict import tensorclass
from torch.utils.data import DataLoader

from arena_loader import ArenaLoader


@tensorclass
class Step:
    obs: torch.Tensor
    reward: torch.Tensor


@dataclasses.dataclass
class Batch:
    x: np.ndarray
    n: int = dataclasses.field(init=False)

    def __post_init__(self):
        self.n = len(self.x)


def batch_of(samples):
    return Batch(np.stack([s.obs.numpy() for s in samples]))


class Steps:
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return Step(obs=torch.full((2, 3), float(i)), reward=torch.tensor(i * 1.5), batch_size=[])


if __name__ == "__main__":
    for num_workers in (0, 2):
        for loader_type in (DataLoader, ArenaLoader):
            loader = loader_type(Steps(), batch_size=4, num_workers=num_workers,
                                 collate_fn=torch.stack)
            batch = next(iter(loader))
            try:
                first = batch[0].reward.item()
            except Exception as exc:  # ArenaLoader: batch_size [] cannot be indexed
                first = f"{type(exc).__name__}: {exc}"
            print(f"{loader_type.__name__:11} num_workers={num_workers} "
                  f"batch_size={list(batch.batch_size)} obs={tuple(batch.obs.shape)} "
                  f"batch[0].reward={first}")
            del batch, loader
    for loader_type in (DataLoader, ArenaLoader):
        batch = next(iter(loader_type(Steps(), batch_size=4, collate_fn=batch_of)))
        print(f"{loader_type.__name__:11} dataclass with init=False field: "
              f"{type(batch).__name__}, n={getattr(batch, 'n', None)}")
