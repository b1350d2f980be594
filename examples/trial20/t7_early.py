"""t7: loaders built before ``init_process_group`` (a script that builds its data first),
under ``torchrun --nproc_per_node 2``: a map-style dataset with a DistributedSampler given
``num_replicas``/``rank`` from torchrun's environment, and a sharded ``IterDataPipe`` (which
the loader shards by the process group: torch reads the rank at each ``iter()``). DDP
training under ``join()``, num_workers 0 / 2; per rank: batches, losses,
final weights, and for the pipe also a ``copy.deepcopy`` of the loader after training.

    python t7_early.py [substring]
"""

from __future__ import annotations

import copy
import gc
import os

import torch
from common import (
    ONLY,
    Tally,
    Tensors,
    dump,
    init,
    launch,
    loader_class,
    public,
    rank_leftovers,
    sampler_class,
    train,
)
from torch.utils.data.datapipes.iter import IterableWrapper

# (Persistent workers left out: every loader here is made up front, and this script's
# leftover check found both loaders' persistent workers still alive after the case.)
WORKERS = {"nw0": dict(num_workers=0), "nw2": dict(num_workers=2)}
SAMPLES = Tensors(n=24)


def sample(i):
    return SAMPLES[i]


def cases():
    for data in ("map", "pipe"):
        for nw in WORKERS:
            yield f"{data} {nw}", dict(data=data, nw=nw)


def build(kind: str, cfg: dict):
    if cfg["data"] == "map":
        sampler = sampler_class("torch")(SAMPLES, num_replicas=int(os.environ["WORLD_SIZE"]),
                                         rank=int(os.environ["RANK"]), seed=2)
        return sampler, loader_class(kind)(SAMPLES, batch_size=2, sampler=sampler,
                                           **WORKERS[cfg["nw"]])
    pipe = IterableWrapper(range(24)).shuffle().sharding_filter().map(sample)
    return None, loader_class(kind)(pipe, batch_size=2, shuffle=True, **WORKERS[cfg["nw"]])


def rank_main() -> None:
    torch.manual_seed(11)
    made = {(name, kind): build(kind, cfg) for name, cfg in cases() if ONLY in name
            for kind in ("torch", "arena")}
    rank, _ = init()  # only now
    results: dict = {}
    for (name, kind), (sampler, loader) in made.items():
        torch.manual_seed(11)
        try:
            got = public(train(loader, sampler, epochs=2, join=True))
            if sampler is None:
                twin = copy.deepcopy(loader)
                got["copy"] = [[b["i"].tolist() for b in twin]]
                del twin
        except Exception as exc:
            got = {"error": f"{type(exc).__name__}: {exc}"}
        made[name, kind] = loader = sampler = None
        gc.collect()
        got["leftovers"] = rank_leftovers()
        results.setdefault(name, {})[kind] = got
    dump("t7", rank, results)


def main() -> None:
    tally = Tally()
    run = launch(os.path.basename(__file__), ONLY, timeout=200)
    if run.rc != 0:
        tally.add("ERROR", "torchrun", f"rc={run.rc} {run.err[-2000:]}")
    tally.leaks("torchrun", run.leftovers)
    per_rank = [run.result("t7", r) or {} for r in range(2)]
    for name, _ in cases():
        for rank in range(2):
            got = per_rank[rank].get(name)
            if got is None:
                continue
            torch_, arena = got["torch"], got["arena"]
            tally.leaks(f"{name} rank{rank} torch", torch_.pop("leftovers"))
            tally.leaks(f"{name} rank{rank} arena", arena.pop("leftovers"))
            items = sorted(i for e in torch_.get("batches", []) for b in e for i in b["i"][2])
            tally.check(f"{name} rank{rank}", torch_, arena, f"{len(items)} items")
    tally.done()


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:
        rank_main()
    else:
        main()
