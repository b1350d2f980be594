"""t2: ranks started by ``torch.multiprocessing.spawn`` (start method spawn: whatever a rank
gets is pickled into it; the loaders' workers use the default, fork), DDP (gloo) training,
torch's DataLoader against ArenaLoader:

- ``build``: the dataset and the loader's arguments go to each rank, which builds its
  DistributedSampler (torch's / ours) and loader;
- ``passed``: the parent builds one loader per rank (``DistributedSampler(num_replicas=2,
  rank=r)``) and passes both to every rank, each takes its own;
- ``passed-used``: the same, after the parent has iterated each loader for one epoch;
- ``shared``: one loader without a sampler passed to both ranks (each trains on all of it);
- ``passed-pipe``: one loader over a sharded ``IterDataPipe`` built in the parent (no
  process group there) passed to both ranks, which shard it by their rank at ``iter()``.

num_workers 0 / 2 / 2 persistent. Per rank: batches, losses, final weights, the warnings the
loader gave, leftovers in the rank after the loader is dropped, and in the parent afterwards.

    python t2_spawn.py [substring]
"""

from __future__ import annotations

import gc
import json
import os
import pickle
import socket
import sys
import tempfile
import warnings

import torch
import torch.multiprocessing as mp
from common import (
    ONLY,
    N,
    Tally,
    Tensors,
    init,
    leftovers_here,
    loader_class,
    public,
    rank_leftovers,
    sampler_class,
    train,
)
from torch.utils.data.datapipes.iter import IterableWrapper

CONFIGS = {"nw0": dict(num_workers=0), "nw2": dict(num_workers=2),
           "nw2-persist": dict(num_workers=2, persistent_workers=True)}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_fn(rank: int, port: int, how: str, pickled: bytes, out: str) -> None:
    # Unpickled here rather than by spawn, so that no frame of torch's outside this function
    # keeps the loaders alive (the leftover check below drops them).
    payload = pickle.loads(pickled)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2")
    init()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if how == "build":
                kind, sampler_kind, dataset, options = payload
                sampler = sampler_class(sampler_kind)(dataset, shuffle=True, seed=3)
                loader = loader_class(kind)(dataset, batch_size=4, sampler=sampler, **options)
            elif how in ("shared", "passed-pipe"):
                loader, sampler = payload, None
            else:
                loader = payload[rank]
                sampler = loader.sampler
            got = public(train(loader, sampler))
        except Exception as exc:
            got = {"error": f"{type(exc).__name__}: {exc}"}
        got["warnings"] = sorted({str(w.message)[:120] for w in caught
                                  if "pin_memory" not in str(w.message)
                                  and "requires_grad" not in str(w.message)})
    loader = payload = None
    gc.collect()
    got["leftovers"] = rank_leftovers()
    import torch.distributed as dist
    dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(got, f)


def run(how: str, kind: str, sampler_kind: str, options: dict) -> list:
    dataset = Tensors()
    if how == "build":
        payload = (kind, sampler_kind, dataset, options)
    elif how == "shared":
        payload = loader_class(kind)(dataset, batch_size=4, **options)
    elif how == "passed-pipe":
        torch.manual_seed(5)
        pipe = IterableWrapper(range(N)).shuffle().sharding_filter().map(dataset.__getitem__)
        payload = loader_class(kind)(pipe, batch_size=4, shuffle=True, **options)
    else:
        payload = [loader_class(kind)(dataset, batch_size=4, **options,
                                      sampler=sampler_class(sampler_kind)(
                                          dataset, num_replicas=2, rank=r, shuffle=True, seed=3))
                   for r in range(2)]
        if how == "passed-used":
            for loader in payload:
                for _ in loader:
                    pass
    out = tempfile.mkdtemp(prefix="trial20_spawn_")
    try:
        mp.spawn(rank_fn, args=(free_port(), how, pickle.dumps(payload), out), nprocs=2,
                 join=True)
    except Exception as exc:
        return [{"error": f"spawn: {type(exc).__name__}: {str(exc)[-300:]}"}] * 2
    finally:
        payload = None
        gc.collect()
    results = []
    for rank in range(2):
        with open(os.path.join(out, f"rank{rank}.json")) as f:
            results.append(json.load(f))
    return results


def main() -> None:
    tally = Tally()
    for how in ("build", "passed", "passed-used", "shared", "passed-pipe"):
        for sampler_kind in (("torch", "ours") if how.startswith(("build", "passed"))
                             and how != "passed-pipe" else ("none",)):
            for config, options in CONFIGS.items():
                if how != "build" and config == "nw2":
                    continue  # (for time: 30 s a case, most of it starting processes)
                name = f"{how} sampler={sampler_kind} {config}"
                if ONLY not in name:
                    continue
                got = {}
                for kind in ("torch", "arena"):
                    got[kind] = run(how, kind, sampler_kind, options)
                    tally.leaks(f"{name} {kind} parent", leftovers_here())
                for rank in range(2):
                    t, a = got["torch"][rank], got["arena"][rank]
                    tally.leaks(f"{name} rank{rank} torch", t.pop("leftovers", []))
                    tally.leaks(f"{name} rank{rank} arena", a.pop("leftovers", []))
                    tw, aw = t.pop("warnings", []), a.pop("warnings", [])
                    if tw != aw:
                        tally.add("info", f"{name} rank{rank} warnings",
                                  f"torch {tw} arena {aw}")
                    if "error" in t or "error" in a:
                        tally.add("info", f"{name} rank{rank} errors",
                                  f"torch {t.get('error')} arena {a.get('error')}")
                    if "cannot be pickled" in t.get("error", "") and "error" not in a:
                        # docs/migrating.md: a loader whose persistent workers run is copied
                        # without them, where torch refuses.
                        tally.add("known", f"{name} rank{rank}", "torch refuses to pickle it")
                        continue
                    tally.check(f"{name} rank{rank}", t, a,
                                f"{sum(map(len, t.get('losses', [])))} steps")
    tally.done()


if __name__ == "__main__":
    sys.exit(main())
