"""t1: ``torchrun --nproc_per_node 2``, DDP (gloo) training over a DistributedSampler (torch's
and ours), ``set_epoch`` each epoch, shuffle on/off, drop_last on/off (sampler and loader),
num_workers 0/1/2, persistent workers on/off: torch's DataLoader against ArenaLoader, per
rank: batches, losses, final weights, leftovers after each loader is dropped.

    python t1_torchrun.py [substring]      # the driver: starts torchrun on this file
"""

from __future__ import annotations

import itertools
import os

from common import Tensors, compare_cases, loader_class, rank_cases, sampler_class, train


def configs():
    for sampler, drop_last, (nw, persist) in itertools.product(
            ("torch", "ours"), (False, True), ((0, False), (1, False), (1, True), (2, False),
                                               (2, True))):
        shuffles = (True, False) if nw == 2 and not persist else (True,)
        for shuffle in shuffles:
            name = (f"sampler={sampler} shuffle={shuffle} drop_last={drop_last} nw={nw}"
                    f"{' persistent' if persist else ''}")
            yield name, dict(sampler=sampler, drop_last=drop_last, num_workers=nw,
                             persistent_workers=persist, shuffle=shuffle)


def one(kind: str, cfg: dict, rank: int) -> dict:
    dataset = Tensors()
    sampler = sampler_class(cfg["sampler"])(dataset, shuffle=cfg["shuffle"], seed=3,
                                            drop_last=cfg["drop_last"])
    loader = loader_class(kind)(dataset, batch_size=4, sampler=sampler,
                                drop_last=cfg["drop_last"], num_workers=cfg["num_workers"],
                                persistent_workers=cfg["persistent_workers"], pin_memory=False)
    return train(loader, sampler)


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:
        rank_cases("t1", configs(), one)
    else:
        compare_cases(os.path.basename(__file__), "t1", configs(),
                      lambda t: f"{sum(map(len, t.get('losses', [])))} steps")
