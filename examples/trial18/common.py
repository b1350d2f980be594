"""trial18 harness: one sampler (or batch sampler) factory, run through torch's DataLoader and
ArenaLoader with the same options, and everything a user would notice compared:

* ``order``: each epoch's batches (the sample indices, as the batch's ``i`` column);
* ``len``: ``len(loader)`` before each epoch (its value, or the exception type);
* ``draws``: how many indices (sampler) or batches (batch sampler) the loader has taken from
  the sampler after ``iter()`` and after each ``next()``, and how many ``iter()`` calls the
  sampler saw (``Recording``, a pass-through wrapper);
* ``resume``: ArenaLoader's ``state_dict()`` taken mid-epoch, loaded into a new loader over a
  new sampler after every global RNG was reseeded elsewhere (a restarted process); the rest of
  that epoch and the following epochs must equal the uninterrupted run.

Each run seeds torch's, numpy's and Python's global RNGs alike first, and makes the sampler
anew. The user's loop calls ``sampler.set_epoch(e)`` before each epoch where it exists.
After every ArenaLoader run, leftovers (children, /dev/shm names) are looked for.
"""

from __future__ import annotations

import collections
import faulthandler
import gc
import os
import random
import sys
import time
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psutil
import torch
from torch.utils.data import DataLoader, Dataset

from arena_loader import ArenaLoader
from arena_loader._slab import NAME_PREFIX

faulthandler.dump_traceback_later(float(os.environ.get("TRIAL_TIMEOUT", 600)), exit=True)
warnings.filterwarnings("ignore", category=UserWarning, message=".*pin_memory.*")
SEED = 1234
ONLY = sys.argv[1] if len(sys.argv) > 1 else ""
N = 30  # samples


# --- stand-ins for imports the samplers' modules make but never use here ---------------------
def stub_modules() -> None:
    """torchsampler imports torchvision (for isinstance checks on its datasets), pytorch-nlp
    imports torch._six (gone since torch 2.0), speechbrain imports torchaudio (only its audio
    I/O uses it). None of them is installable beside torch 2.13 CPU; empty modules stand in.
    Called after transformers is imported (it looks for torchvision's spec)."""
    if "torchvision" not in sys.modules:
        tv = types.ModuleType("torchvision")
        tv.datasets = types.SimpleNamespace(MNIST=type("MNIST", (), {}),
                                            ImageFolder=type("ImageFolder", (), {}),
                                            DatasetFolder=type("DatasetFolder", (), {}))
        sys.modules["torchvision"] = tv
    if "torch._six" not in sys.modules:
        six = types.ModuleType("torch._six")
        six.int_classes, six.string_classes = int, str
        sys.modules["torch._six"] = six
    if "torchaudio" not in sys.modules:
        ta = types.ModuleType("torchaudio")
        ta.__version__ = "2.9.0"
        sys.modules["torchaudio"] = ta


# --- data --------------------------------------------------------------------------------------
LENGTHS = [3 + (i * 7) % 11 for i in range(N)]  # token counts, for length-grouped samplers
LABELS = [0 if i % 5 else 1 for i in range(N)]  # imbalanced: class 1 is a fifth


class Items(Dataset):
    """Sample ``i``: its index (``i``) and a row encoding it (``x``), torch tensors."""

    def __init__(self, n: int = N):
        self.n = n
        self.lengths = LENGTHS[:n]
        self.labels = LABELS[:n]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        i = int(i)
        return {"i": torch.tensor(i), "x": torch.full((3,), float(i))}

    def get_labels(self):  # torchsampler's ImbalancedDatasetSampler asks for this
        return self.labels


class Recording:
    """Passes ``inner`` through, counting what the loader takes from it: ``given`` items
    (indices or batches) and ``iters`` calls of ``iter()``. Attributes the loader or the user
    reads (``set_epoch``, ``state_dict``, ``batch_size``, ``__len__``) reach ``inner``."""

    def __init__(self, inner: Any):
        self.inner, self.given, self.iters = inner, 0, 0

    def __iter__(self):
        self.iters += 1
        for item in self.inner:
            self.given += 1
            yield item

    def __len__(self) -> int:
        return len(self.inner)  # TypeError where the inner one has none, as torch sees it

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def seed_all(seed: int = SEED) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


@dataclass
class Case:
    """``make(dataset)``: ``(loader kwargs, the sampler object the user holds)``; the kwargs
    give either ``sampler`` (with ``batch_size``) or ``batch_sampler``. ``steps``: batches
    taken per epoch (infinite samplers), else whole epochs. ``resumable``: False where the
    sampler keeps state the loader cannot know (a documented limit: noted, not counted)."""

    name: str
    make: Callable[[Dataset], tuple[dict, Any]]
    steps: int | None = None
    epochs: int = 3
    resumable: bool | str = True
    configs: tuple = ()


def rows(batch) -> list[int]:
    return [int(v) for v in batch["i"]]


def length_of(loader) -> Any:
    try:
        return len(loader)
    except Exception as exc:
        return type(exc).__name__


def set_epoch(held: Any, epoch: int) -> None:
    if callable(getattr(held, "set_epoch", None)):
        held.set_epoch(epoch)


def wrap(kwargs: dict) -> tuple[dict, Recording]:
    key = "batch_sampler" if "batch_sampler" in kwargs else "sampler"
    rec = Recording(kwargs[key])
    return {**kwargs, key: rec}, rec


@dataclass
class Run:
    order: list = field(default_factory=list)  # per epoch, the batches' rows
    lens: list = field(default_factory=list)
    draws: list = field(default_factory=list)  # per epoch, given after iter() and each next()
    iters: list = field(default_factory=list)  # the sampler's iter() calls after each epoch
    error: str | None = None


def run(loader_cls, case: Case, options: dict, record: bool, settle: float = 0.0,
        loader_kw: dict | None = None) -> Run:
    seed_all()
    dataset = Items()
    kwargs, held = case.make(dataset)
    rec = None
    if record:
        kwargs, rec = wrap(kwargs)
    extra = dict(loader_kw or {})
    if loader_cls is ArenaLoader:
        extra.setdefault("output", "torch")
    options = dict(options)
    arena_only = options.pop("arena", {})  # pin_memory=True: ArenaLoader only (torch's pin
    if loader_cls is ArenaLoader:          # thread needs a real GPU; its draws are the same)
        extra.update(arena_only)
        settle = settle or (0.02 if arena_only else 0.0)
    out = Run()
    loader = loader_cls(dataset, **kwargs, **options, **extra)
    try:
        for epoch in range(case.epochs):
            set_epoch(held, epoch)
            out.lens.append(length_of(loader))
            iterator = iter(loader)
            time.sleep(settle)
            counts = [rec.given] if rec else []
            batches = []
            for batch in iterator:
                batches.append(rows(batch))
                del batch
                time.sleep(settle)
                if rec:
                    counts.append(rec.given)
                if case.steps is not None and len(batches) == case.steps:
                    break
            del iterator
            out.order.append(batches)
            out.draws.append(counts)
            out.iters.append(rec.iters if rec else None)
    except Exception as exc:
        out.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    finally:
        if loader_cls is ArenaLoader:
            loader.close()
        del loader
        gc.collect()
    return out


def resume(case: Case, options: dict, cut_epoch: int, cut_batch: int,
           loader_cls: Any = ArenaLoader) -> list:
    """The batches of a run cut after ``cut_batch`` batches of ``cut_epoch``, resumed by a
    new loader (new sampler, RNGs reseeded elsewhere) from its state_dict. ``loader_cls``:
    ArenaLoader, or torchdata's StatefulDataLoader (s4)."""
    seed_all()
    dataset = Items()
    kwargs, held = case.make(dataset)
    order: list = []
    options = dict(options)
    options.update(options.pop("arena", {}))
    if loader_cls is ArenaLoader:
        options["output"] = "torch"
    with Closing(loader_cls(dataset, **kwargs, **options)) as loader:
        for epoch in range(cut_epoch + 1):
            set_epoch(held, epoch)
            batches = []
            iterator = iter(loader)
            for batch in iterator:
                batches.append(rows(batch))
                if epoch == cut_epoch and len(batches) == cut_batch:
                    break
                if case.steps is not None and len(batches) == case.steps:
                    break
            del iterator
            order.append(batches)
        state = loader.state_dict()
    seed_all(SEED + 99)  # a new process: its RNGs are wherever its start-up left them
    kwargs, held = case.make(dataset)
    with Closing(loader_cls(dataset, **kwargs, **options)) as loader:
        loader.load_state_dict(state)
        for epoch in range(cut_epoch, case.epochs):
            set_epoch(held, epoch)
            batches = []
            for batch in loader:
                batches.append(rows(batch))
                want = case.steps if epoch > cut_epoch else (case.steps or 0) - cut_batch
                if case.steps is not None and len(batches) == want:
                    break
            if epoch == cut_epoch:
                order[-1] += batches
            else:
                order.append(batches)
    return order


class Closing:
    """``with`` for both loaders (torchdata's has no close())."""

    def __init__(self, loader):
        self.loader = loader

    def __enter__(self):
        return self.loader

    def __exit__(self, *exc_info):
        if hasattr(self.loader, "close"):
            self.loader.close()


# --- leftovers and tally -----------------------------------------------------------------------
def shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(NAME_PREFIX)}


def leftovers(before: set[str], seconds: float = 5.0) -> list[str]:
    """Our children (not multiprocessing's forkserver or resource tracker) and new slab
    names, polled until none is left or ``seconds`` pass."""
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


def ours(proc) -> bool:
    try:
        line = " ".join(proc.cmdline())
    except psutil.Error:
        return False
    return "forkserver" not in line and "resource_tracker" not in line


class Tally:
    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self.started = time.monotonic()

    def add(self, verdict: str, name: str, detail: str = "") -> None:
        self.counts[verdict] += 1
        print(f"{verdict:9} {name}  {detail}  [{time.monotonic() - self.started:.0f} s]"
              .rstrip(), flush=True)

    def done(self) -> None:
        parts = " ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))
        print(f"RESULTS {parts} seconds={time.monotonic() - self.started:.0f}", flush=True)


CONFIGS = {  # name: (loader options, settle seconds before reading draws)
    "nw0": dict(num_workers=0),
    "nw2": dict(num_workers=2),
    "nw2-persist": dict(num_workers=2, persistent_workers=True),
    "nw0-pin": dict(num_workers=0, arena=dict(pin_memory=True)),
    "nw2-pin": dict(num_workers=2, arena=dict(pin_memory=True)),
    "nw2-persist-pin": dict(num_workers=2, persistent_workers=True, arena=dict(pin_memory=True)),
}
PIN_CONFIGS = ("nw0-pin", "nw2-pin", "nw2-persist-pin")


def fake_pinning() -> list:
    """tests/conftest.py's fake_pinning: torch sees a GPU, and Tensor.pin_memory() is a copy
    (torch's CPU build has no page-locked memory); returns the shapes it copied."""
    copied: list = []

    def pin_memory(tensor, device=None):
        copied.append(tuple(tensor.shape))
        return tensor.clone()

    torch.cuda.is_available = lambda: True
    torch.Tensor.pin_memory = pin_memory
    return copied


def compare(case: Case, tally: Tally, configs: tuple[str, ...] = ("nw0", "nw2", "nw2-persist"),
            resume_at: tuple[int, int] = (1, 2),
            resume_configs: tuple[str, ...] = ("nw0", "nw2")) -> None:
    """torch against ArenaLoader: plain samplers (order, len) and recorded ones (order, len,
    draws, iter() calls), then the mid-epoch resume with 0 and 2 workers."""
    for config in configs:
        options = CONFIGS[config]
        for record in (False, True):
            name = f"{case.name}/{config}/{'recorded' if record else 'plain'}"
            if not wants(name):
                continue
            before = shm_names()
            try:
                case.make(Items())
            except Exception as exc:
                tally.add("BROKEN", name, f"{type(exc).__name__}: {exc}")
                continue
            want = run(DataLoader, case, options, record)
            got = run(ArenaLoader, case, options, record)
            detail = differences(want, got)
            tally.add("MISMATCH" if detail else "ok", name,
                      detail or f"{sum(map(len, got.order))} batches"
                      + (f" error={got.error}" if got.error else ""))
            for found in leftovers(before):
                tally.add("LEAK", name, found)
    cut = resume_at if case.epochs > resume_at[0] else (0, min(7, (case.steps or 8) - 1))
    for config in resume_configs:
        name = f"{case.name}/{config}/resume"
        if not wants(name) or case.resumable is not True:
            if case.resumable is not True and wants(name):
                tally.add("skipped", name, str(case.resumable))
            continue
        before = shm_names()
        whole = run(ArenaLoader, case, CONFIGS[config], record=False)
        try:
            got = resume(case, CONFIGS[config], *cut)
            detail = "" if got == whole.order else first_difference(whole.order, got)
        except Exception as exc:
            detail = f"raised {type(exc).__name__}: {exc}"
        tally.add("MISMATCH" if detail else "ok", name, detail)
        for found in leftovers(before):
            tally.add("LEAK", name, found)


def differences(want: Run, got: Run) -> str:
    out = []
    if want.error != got.error and (want.error or got.error):
        w = want.error.split(":")[0] if want.error else None
        g = got.error.split(":")[0] if got.error else None
        if w != g:
            out.append(f"error torch={want.error} arena={got.error}")
    if want.order != got.order:
        out.append("order " + first_difference(want.order, got.order))
    if want.lens != got.lens:
        out.append(f"len torch={want.lens} arena={got.lens}")
    if want.draws != got.draws:
        for e, (w, g) in enumerate(zip(want.draws, got.draws)):
            if w != g:
                out.append(f"draws epoch {e} torch={w} arena={g}")
                break
    if want.iters != got.iters:
        out.append(f"iter() calls torch={want.iters} arena={got.iters}")
    return "; ".join(out)


def first_difference(want: list, got: list) -> str:
    for e, (w, g) in enumerate(zip(want, got)):
        if w != g:
            for b, (wb, gb) in enumerate(zip(w, g)):
                if wb != gb:
                    return f"epoch {e} batch {b}: want {wb} got {gb}"
            return f"epoch {e}: {len(w)} batches wanted, {len(g)} got"
    return f"{len(want)} epochs wanted, {len(got)} got"


def wants(name: str) -> bool:
    return ONLY in name
