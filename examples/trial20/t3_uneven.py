"""t3: uneven inputs under ``torchrun --nproc_per_node 2``, torch's DataLoader against
ArenaLoader, per rank (batches, losses, final weights, leftovers):

- ``pad``: DistributedSampler (torch's / ours) over 1, 3 and 21 samples, drop_last off
  (padding repeats indices from the start; 1 sample: rank 1 gets index 0 again) and on (1
  sample: both ranks get an empty epoch), shuffle on and off;
- ``join``: a sampler giving the ranks different counts (10 and 6 samples; 5 and 0), the loop
  under DDP's ``join()`` context manager, which shadows the collectives of the rank that
  runs out first.

num_workers 0 / 2 / 2 persistent.

    python t3_uneven.py [substring]
"""

from __future__ import annotations

import itertools
import os

from common import PerRank, Tensors, compare_cases, loader_class, rank_cases, sampler_class, train

WORKERS = {"nw0": dict(num_workers=0), "nw2": dict(num_workers=2),
           "nw2-persist": dict(num_workers=2, persistent_workers=True)}


def cases():
    for n, drop_last, shuffle, sampler, nw in itertools.product(
            (1, 3, 21), (False, True), (True, False), ("torch", "ours"), WORKERS):
        yield (f"pad n={n} drop_last={drop_last} shuffle={shuffle} sampler={sampler} {nw}",
               dict(n=n, drop_last=drop_last, shuffle=shuffle, sampler=sampler, nw=nw))
    for counts, nw in itertools.product(((10, 6), (5, 0)), WORKERS):
        yield f"join counts={counts} {nw}", dict(counts=list(counts), nw=nw)


def one(kind: str, cfg: dict, rank: int) -> dict:
    if "counts" in cfg:
        dataset = Tensors(n=2 * max(cfg["counts"]))
        sampler = PerRank(cfg["counts"], rank, 2, seed=9)
    else:
        dataset = Tensors(n=cfg["n"])
        sampler = sampler_class(cfg["sampler"])(dataset, shuffle=cfg["shuffle"], seed=4,
                                                drop_last=cfg["drop_last"])
    loader = loader_class(kind)(dataset, batch_size=2, sampler=sampler, **WORKERS[cfg["nw"]])
    return train(loader, sampler, join="counts" in cfg)


def indices(result: dict) -> str:
    return f"indices {[[b['i'][2] for b in e] for e in result.get('batches', [])]}"[:90]


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:
        rank_cases("t3", cases(), one)
    else:
        compare_cases(os.path.basename(__file__), "t3", cases(), indices)
