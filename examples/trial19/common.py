"""trial19 harness: the same training run through torch's DataLoader and ArenaLoader inside a
framework nobody on the team wrote, and what a user would notice compared (batches: values,
types and order; losses; leftovers: children of this process, /dev/shm names with the
loader's prefix).

Each run seeds torch's, numpy's and Python's global RNGs alike first and builds its model
anew, so two runs that see the same batches in the same order give the same losses.
"""

from __future__ import annotations

import collections
import faulthandler
import gc
import os
import random
import sys
import time
import warnings
from typing import Any

import numpy as np
import psutil
import torch
from torch.utils.data import Dataset

from arena_loader._slab import NAME_PREFIX

faulthandler.dump_traceback_later(float(os.environ.get("TRIAL_TIMEOUT", 900)), exit=True)
warnings.filterwarnings("ignore", message=".*pin_memory.*")
SEED = 1234
ONLY = sys.argv[1] if len(sys.argv) > 1 else ""
N = 40  # samples


def seed_all(seed: int = SEED) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def wants(name: str) -> bool:
    return ONLY in name


class Tensors(Dataset):
    """Sample ``i``: ``{"i": tensor(i), "x": 4 floats from i, "y": class}``, torch tensors."""

    def __init__(self, n: int = N):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        i = int(i)
        x = torch.tensor([i / self.n, (i % 7) / 7, (i % 3) / 3, 1.0])
        return {"i": torch.tensor(i), "x": x, "y": torch.tensor(i % 3)}


class Arrays(Tensors):
    """The same samples as numpy arrays and Python ints (a user's dataset before torch)."""

    def __getitem__(self, i):
        s = super().__getitem__(i)
        return {"i": int(s["i"]), "x": s["x"].numpy(), "y": int(s["y"])}


def model() -> torch.nn.Module:
    torch.manual_seed(SEED)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def describe(batch: Any) -> Any:
    """A batch as plain Python: structure, leaf type names, dtypes and values."""
    if isinstance(batch, torch.Tensor):
        return ("tensor", str(batch.dtype), batch.tolist())
    if isinstance(batch, np.ndarray):
        return ("ndarray", str(batch.dtype), batch.tolist())
    if isinstance(batch, dict):
        return {k: describe(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return (type(batch).__name__, [describe(v) for v in batch])
    return (type(batch).__name__, batch)


def untyped(described: Any) -> Any:
    """``describe``'s output without type names: values and structure only."""
    if isinstance(described, dict):
        return {k: untyped(v) for k, v in described.items()}
    if isinstance(described, tuple) and len(described) == 3 and described[0] in ("tensor",
                                                                               "ndarray"):
        return described[2]
    if isinstance(described, tuple) and len(described) == 2 and described[0] in ("list",
                                                                               "tuple"):
        return [untyped(v) for v in described[1]]
    if isinstance(described, (list, tuple)):
        return [untyped(v) for v in described]
    return described


def first_difference(want: Any, got: Any, path: str = "") -> str:
    if type(want) is not type(got):
        return (f"{path}: torch {type(want).__name__} {str(want)[:80]} "
                f"arena {type(got).__name__} {str(got)[:80]}")
    if isinstance(want, dict):
        if want.keys() != got.keys():
            return f"{path}: keys torch {list(want)} arena {list(got)}"
        for k in want:
            if want[k] != got[k]:
                return first_difference(want[k], got[k], f"{path}.{k}")
    if isinstance(want, (list, tuple)):
        if len(want) != len(got):
            return f"{path}: length torch {len(want)} arena {len(got)}"
        for j, (w, g) in enumerate(zip(want, got)):
            if w != g:
                return first_difference(w, g, f"{path}[{j}]")
    return f"{path}: torch {str(want)[:100]} arena {str(got)[:100]}"


# --- leftovers and tally -----------------------------------------------------------------------
def shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(NAME_PREFIX)}


def ours(proc) -> bool:
    try:
        line = " ".join(proc.cmdline())
    except psutil.Error:
        return False
    return "forkserver" not in line and "resource_tracker" not in line


def leftovers(before: set[str], seconds: float = 5.0) -> list[str]:
    """Our children (not multiprocessing's forkserver or resource tracker) and new slab
    names, polled until none is left or ``seconds`` pass (after a collection: a loader the
    framework dropped without close() is cleaned up when collected)."""
    found: list[str] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        gc.collect()
        kids = [p.pid for p in psutil.Process().children(recursive=True) if ours(p)]
        new = sorted(shm_names() - before)
        found = [f"children {kids}"] * bool(kids) + [f"/dev/shm {new}"] * bool(new)
        if not found:
            break
        time.sleep(0.05)
    return found


class Tally:
    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self.started = time.monotonic()

    def add(self, verdict: str, name: str, detail: str = "") -> None:
        self.counts[verdict] += 1
        print(f"{verdict:9} {name}  {detail}  [{time.monotonic() - self.started:.0f} s]"
              .rstrip(), flush=True)

    def check(self, name: str, want: Any, got: Any, before: set[str], note: str = "") -> None:
        """ok for ``want == got``; ``types`` where only the batches' container and leaf types
        differ (numpy for tensors, tuple for list: the documented default without
        ``output="torch"``), values and losses equal; else MISMATCH. Then LEAK for each
        leftover."""
        if want == got:
            self.add("ok", name, note)
        elif untyped(want) == untyped(got):
            self.add("types", name, first_difference(want, got))
        else:
            self.add("MISMATCH", name, first_difference(untyped(want), untyped(got)))
        for found in leftovers(before):
            self.add("LEAK", name, found)

    def done(self) -> None:
        parts = " ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))
        print(f"RESULTS {parts} seconds={time.monotonic() - self.started:.0f}", flush=True)


def error(exc: BaseException) -> str:
    return f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:150] if str(exc) else ''}"


CONFIGS = {
    "nw0": dict(num_workers=0),
    "nw2": dict(num_workers=2),
    "nw2-persist": dict(num_workers=2, persistent_workers=True),
}
