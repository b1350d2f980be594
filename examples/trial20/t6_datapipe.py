"""t6: an ``IterDataPipe`` (``IterableWrapper(range(n)).shuffle().sharding_filter().map(...)``)
under ``torchrun --nproc_per_node 2``: the loader shards it per rank and worker and seeds its
shuffle with a seed broadcast from rank 0 (a collective inside ``iter()``), as torch's
DataLoader does. DDP training under ``join()`` (shards may differ in length), 3 epochs,
shuffle on/off, ``torch.manual_seed`` or a seeded ``generator``, num_workers 0 / 2 / 2
persistent; per rank: batches, losses, final weights, leftovers.

    python t6_datapipe.py [substring]
"""

from __future__ import annotations

import itertools
import os

import torch
from common import Tensors, compare_cases, loader_class, rank_cases, train
from torch.utils.data.datapipes.iter import IterableWrapper

WORKERS = {"nw0": dict(num_workers=0), "nw2": dict(num_workers=2),
           "nw2-persist": dict(num_workers=2, persistent_workers=True)}
SAMPLES = Tensors(n=24)


def sample(i):
    return SAMPLES[i]


def cases():
    for n, shuffle, seeded, nw in itertools.product((24, 21), (True, False), (False, True),
                                                    WORKERS):
        yield (f"n={n} shuffle={shuffle} {'generator' if seeded else 'manual_seed'} {nw}",
               dict(n=n, shuffle=shuffle, seeded=seeded, nw=nw))


def one(kind: str, cfg: dict, rank: int) -> dict:
    torch.manual_seed(11)
    pipe = IterableWrapper(range(cfg["n"])).shuffle().sharding_filter().map(sample)
    generator = torch.Generator().manual_seed(7) if cfg["seeded"] else None
    loader = loader_class(kind)(pipe, batch_size=2, shuffle=cfg["shuffle"], generator=generator,
                                **WORKERS[cfg["nw"]])
    got = train(loader, None, epochs=3, join=True)
    got["rng_after"] = torch.randint(1000, (3,)).tolist()  # (the draws torch's loader made)
    return got


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:
        rank_cases("t6", cases(), one)
    else:
        compare_cases(os.path.basename(__file__), "t6", cases(),
                      lambda t: f"steps {[len(e) for e in t.get('losses', [])]}")
