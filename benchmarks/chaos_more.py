"""Parts of benchmarks/chaos.py that spawned workers must import by name (samplers, the
``worker_init_fn``) and the references and checks that go with them: user samplers' epochs as
torch's DataLoader yields them, torch's worker-seed rule, a user ``os.fork()`` mid-epoch.

Kept out of chaos.py, which runs as ``__main__``: importing it from here would make a second
copy of its module state (the fault switches)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

SAMPLER_KINDS = ("batch_list", "gen", "subset", "weighted", "distributed")


def draw_sampler(rng: random.Random, n: int) -> dict[str, Any]:
    """A user sampler's recipe (plain data: a scenario is printed as JSON)."""
    kind = rng.choice(SAMPLER_KINDS)
    spec: dict[str, Any] = {"kind": kind, "seed": rng.randrange(2 ** 31)}
    if kind == "batch_list":  # uneven index lists, some indices twice, some never
        order = [rng.randrange(n) for _ in range(rng.randint(1, 2 * n))]
        batches, at = [], 0
        while at < len(order):
            size = rng.randint(1, 7)
            batches.append(order[at:at + size])
            at += size
        spec["batches"] = batches
    elif kind == "subset":
        spec["indices"] = rng.sample(range(n), rng.randint(1, n))
    elif kind == "weighted":
        spec.update(weights=[rng.uniform(0.05, 3.0) for _ in range(n)],
                    num_samples=rng.randint(1, 2 * n), replacement=rng.random() < 0.7)
        if not spec["replacement"]:
            spec["num_samples"] = min(spec["num_samples"], n)
    elif kind == "distributed":
        replicas = rng.randint(1, 4)
        spec.update(num_replicas=replicas, rank=rng.randrange(replicas),
                    shuffle=rng.random() < 0.7, drop_last=rng.random() < 0.4)
    return spec


class GenSampler:
    """A sampler whose ``__iter__`` is a generator (the common hand-written kind)."""

    def __init__(self, n: int, seed: int):
        import torch

        self.n = n
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        import torch

        yield from torch.randperm(self.n, generator=self.generator).tolist()


def make_sampler(spec: dict[str, Any] | None, n: int) -> Any:
    """The sampler (or, for ``batch_list``, the batch sampler) of ``spec``; None for none."""
    if spec is None:
        return None
    import torch
    from torch.utils.data import DistributedSampler, SubsetRandomSampler, WeightedRandomSampler

    kind = spec["kind"]
    if kind == "batch_list":
        return [list(b) for b in spec["batches"]]
    if kind == "gen":
        return GenSampler(n, spec["seed"])
    if kind == "distributed":
        return DistributedSampler(range(n), num_replicas=spec["num_replicas"],
                                  rank=spec["rank"], shuffle=spec["shuffle"], seed=spec["seed"],
                                  drop_last=spec["drop_last"])
    generator = torch.Generator().manual_seed(spec["seed"])
    if kind == "subset":
        return SubsetRandomSampler(spec["indices"], generator=generator)
    return WeightedRandomSampler(spec["weights"], spec["num_samples"],
                                 replacement=spec["replacement"], generator=generator)


def sampler_state(sampler: Any) -> Any:
    """What the sampler's next epoch depends on, now (before ``iter()``)."""
    generator = getattr(sampler, "generator", None)
    return (generator.get_state() if generator is not None else None,
            getattr(sampler, "epoch", None))


def sampler_reference(spec: dict[str, Any], n: int, batch_size: int, drop_last: bool,
                      state: Any) -> list[tuple[int, ...]]:
    """The epoch torch's DataLoader (num_workers=0, an index-only dataset) yields from a twin
    of the sampler in ``state``. Leaves torch's global RNG as it found it (that DataLoader
    draws its base seed there)."""
    import torch
    from torch.utils.data import DataLoader

    twin = make_sampler(spec, n)
    generator_state, epoch = state
    if generator_state is not None:
        twin.generator.set_state(generator_state)
    if epoch is not None:
        twin.set_epoch(epoch)
    saved = torch.get_rng_state()
    try:
        if spec["kind"] == "batch_list":
            loader = DataLoader(range(n), batch_sampler=twin, collate_fn=tuple)
        else:
            loader = DataLoader(range(n), sampler=twin, batch_size=batch_size,
                                drop_last=drop_last, collate_fn=tuple)
        return [tuple(int(i) for i in batch) for batch in loader]
    finally:
        torch.set_rng_state(saved)


# -- worker_init_fn: torch's seed rule, and the documented outcome of one that raises ----------


def record_seeds(directory: str, worker_id: int) -> None:
    """A ``worker_init_fn``: records the worker's seeds as it finds them (one file a call),
    raises while ``directory``/fail exists, then seeds numpy and random from its info."""
    import torch

    from arena_loader import get_worker_info

    info = get_worker_info()
    if os.path.exists(os.path.join(directory, "fail")):
        raise ValueError(f"chaos: worker_init_fn of worker {worker_id} fails")
    record = {"worker_id": worker_id, "id": info.id, "num_workers": info.num_workers,
              "seed": info.seed, "torch": torch.initial_seed(), "random": random.random(),
              "pid": os.getpid()}
    name = f"{os.getpid()}_{threading.get_ident()}_{worker_id}.json"
    Path(directory, name).write_text(json.dumps(record))
    random.seed(info.seed)
    np.random.seed(info.seed % 2 ** 32)


def init_fn(directory: str) -> Any:
    return functools.partial(record_seeds, directory)


def read_seeds(directory: str) -> list[dict[str, Any]]:
    out = []
    for path in sorted(Path(directory).glob("*.json")):
        with contextlib.suppress(ValueError):  # (a worker killed while writing)
            out.append(json.loads(path.read_text()))
        path.unlink()
    return out


def torch_base_seed(generator_state: Any) -> int:
    """torch's workers' base seed: its draw from the loader's generator (or, for None, torch's
    global RNG) in the state it was in at ``iter()``."""
    import torch

    g = torch.Generator()
    g.set_state(generator_state)
    return int(torch.empty((), dtype=torch.int64).random_(generator=g).item())


def check_seeds(records: list[dict[str, Any]], base_seeds: list[int], num_workers: int,
                processes: bool) -> str | None:
    """Why the recorded worker seeds break torch's rule (seed = base + id; in a process
    worker also torch.initial_seed() and random's first draw follow it), or None."""
    if not records:
        return None
    for base in base_seeds:
        problems = []
        for r in records:
            seed = (base + r["worker_id"]) % 2 ** 64
            if r["id"] != r["worker_id"] or r["num_workers"] != num_workers:
                problems.append(f"worker {r['worker_id']}: info {r['id']}/{r['num_workers']}")
            if r["seed"] != seed:
                problems.append(f"worker {r['worker_id']}: seed {r['seed']}, torch's {seed}")
            if processes and r["torch"] != seed:
                problems.append(f"worker {r['worker_id']}: torch.initial_seed() {r['torch']}")
            if processes and r["random"] != random.Random(seed).random():
                problems.append(f"worker {r['worker_id']}: random not seeded with {seed}")
        if not problems:
            return None
    return f"worker seeds against base seeds {base_seeds}: {problems}"


# -- a user's os.fork() mid-epoch ---------------------------------------------------------------


def fork_reader(kept: list[tuple[Any, Any]], same: Any) -> int:
    """Fork; the child compares every kept batch with its copy and leaves by ``os._exit``
    (0: all equal, 3: one changed, 4: an error). Returns the child's pid."""
    pid = os.fork()
    if pid:
        return pid
    code = 4
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        code = 0 if all(same(batch, copy) for batch, copy in kept) else 3
    finally:
        os._exit(code)


def reap(pid: int, seconds: float = 10.0) -> str | None:
    """Why the forked child failed (hung, changed batches, an error), or None."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            return None if code == 0 else f"the forked child exited with {code}"
        time.sleep(0.02)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return f"the forked child hung over {seconds} s"


def pids_gone(pids: list[int], seconds: float = 5.0) -> list[int]:
    """Those of ``pids`` still running (not zombies) after up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        alive = []
        for pid in pids:
            with contextlib.suppress(OSError, IndexError):
                with open(f"/proc/{pid}/stat") as stat:
                    if stat.read().rsplit(")", 1)[1].split()[0] != "Z":
                        alive.append(pid)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)
