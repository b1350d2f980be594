"""trial25 harness: one long loop run through torch's DataLoader and ArenaLoader, sampled as it
goes, to see what creeps up batch after batch or epoch after epoch.

Every run (one case, one loader class, one ``num_workers`` / ``persistent_workers`` config)
happens in a forked child (its own process group, a hard timeout: trial22's pattern). The
child freezes what it inherited (``gc.freeze()``: the object count is of what the run made),
runs the case's loop, and every ``SAMPLE`` batches (``ctx.tick``) records, after a
``gc.collect()``: the main process's RSS and USS (``psutil``'s ``memory_full_info``), its open
descriptors and threads, the gc-tracked objects it made, its ``/dev/shm`` mappings (ours by
``NAME_PREFIX``, torch's ``torch_*``) with their sizes, the ``/dev/shm`` names of ours or torch's
that exist, its workers' summed USS, descriptors and threads (children but multiprocessing's
helpers), the workers' own gc-tracked objects (a map-style dataset is wrapped in ``Counted``,
which counts them in the worker every 100 samples), and the loop's time per batch over the
window (the sampling excluded). The type
histogram of the objects made is taken after the warm-up and at the end (its growth names
what leaks); ``TRIAL_TRACE=1`` adds tracemalloc's top growth lines.

``slopes`` fits a line to each metric after the warm-up (``WARM`` of the samples) and gives
it per 1,000 batches; ``verdict`` calls a metric grown when both its slope and its change
over the run pass a floor (``FLOORS``: noise on the shared 2-core machine), and a case
``GROWS`` only when ours grows on a metric where torch's, on the same loop, does not.
"""

from __future__ import annotations

import collections
import dataclasses
import faulthandler
import gc
import importlib.util
import os
import pickle
import shutil
import signal
import struct
import sys
import time
import tracemalloc
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from arena_loader import ArenaLoader
from arena_loader._slab import NAME_PREFIX

_spec = importlib.util.spec_from_file_location(
    "trial22_common", Path(__file__).resolve().parent.parent / "trial22" / "common.py")
t22 = sys.modules["trial22_common"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(t22)  # its run(): the fork, the stream, the hard timeout, leftovers

ONLY = sys.argv[1] if len(sys.argv) > 1 else ""
CONFIGS = ((0, False), (2, False), (2, True))
SAMPLE = int(os.environ.get("TRIAL_SAMPLE", 50))       # batches between samples
SCALE = float(os.environ.get("TRIAL_SCALE", 1))        # multiplies every case's length
HARD_S = float(os.environ.get("TRIAL_HARD_S", 240))
TRACE = os.environ.get("TRIAL_TRACE") == "1"
CONFIG = os.environ.get("TRIAL_CONFIG")                # only this config ("nw=0", "nw=2 pw")
WARM = 0.25                                            # the first quarter of samples skipped
HELPERS = ("resource_tracker", "forkserver")
COUNTS = "/tmp/trial25-counts"
ROWS: list[tuple] = []
# (metric, unit shown, floor of the slope per 1,000 batches, floor of the change over the run)
FLOORS = {
    "objects": ("obj", 20, 60),
    "w_objects": ("obj", 40, 120),
    "uss": ("KB", 300, 1500),
    "rss": ("KB", 300, 1500),
    "w_uss": ("KB", 600, 3000),
    "fds": ("", 0.5, 2),
    "w_fds": ("", 0.5, 2),
    "threads": ("", 0.5, 2),
    "w_threads": ("", 0.5, 2),
    "maps": ("", 0.5, 2),
    "maps_kb": ("KB", 300, 1500),
    "shm": ("", 0.5, 2),
    "shm_kb": ("KB", 300, 1500),
}
SHOWN = ("objects", "w_objects", "uss", "w_uss", "fds", "threads", "maps", "shm")


@dataclasses.dataclass
class Case:
    name: str
    loop: Callable[[Ctx], None]              # the whole run, calling ctx.tick(batch) per batch
    configs: tuple = CONFIGS
    arena: dict = dataclasses.field(default_factory=dict)  # options only ArenaLoader gets
    torch_cls: type | None = None            # torch's side, when not DataLoader
    sample: int = 0                          # batches between samples (0: SAMPLE)
    hard_s: float = HARD_S                   # the run's hard timeout
    note: str = ""


class Ctx:
    """What a case gets in the child: loaders of the run's kind, the tick, the samples."""

    def __init__(self, case: Case, cls: type, nw: int, pw: bool, send: Callable):
        self.case, self.cls, self.nw, self.pw, self.send = case, cls, nw, pw, send
        self.is_torch = cls is not ArenaLoader
        self.me = psutil.Process()
        self.batches = 0
        self.loop_s = 0.0
        self.window_start = time.perf_counter()
        self.window_batches = 0
        self.types_at_warm: collections.Counter | None = None
        self.types_last: collections.Counter | None = None
        self.trace_at_warm: Any = None
        self.caught = 0
        self.last: Any = None
        self.every = case.sample or SAMPLE

    # -- loaders ---------------------------------------------------------------------------
    def loader(self, dataset: Any, batch_size: int | None = 4, **options: Any) -> Any:
        if not isinstance(dataset, IterableDataset):
            dataset = Counted(dataset)
        kw: dict = {"batch_size": batch_size, "num_workers": self.nw}
        if self.pw:
            kw["persistent_workers"] = True
        kw.update(options)
        if not self.is_torch:
            kw.update(self.case.arena)
        return self.cls(dataset, **kw)

    def n(self, count: int) -> int:
        """``count`` scaled by ``TRIAL_SCALE``."""
        return max(1, int(count * SCALE))

    def next_or_caught(self, it: Any) -> bool:
        """One ``next(it)`` ticked; an exception the loop catches (counted) and goes on from;
        False at the epoch's end."""
        try:
            batch = next(it)
        except StopIteration:
            return False
        except Exception:
            self.caught += 1
            return True
        self.tick(batch)
        return True

    def epoch_range(self, count: int) -> Any:
        """``range(count)`` scaled, the warm-up marked after its first quarter."""
        total = self.n(count)
        for epoch in range(total):
            if epoch == int(total * WARM):
                self.mark_warm()
            yield epoch

    def epochs(self, loader: Any, count: int, each: Callable[[Any], Any] | None = None) -> None:
        """``count`` epochs of ``loader`` (``each(loader)`` after every batch)."""
        for _ in self.epoch_range(count):
            for batch in loader:
                self.tick(batch)
                if each is not None:
                    each(loader)

    def shutdown(self, loader: Any) -> None:
        """Ours closed; torch's persistent workers stopped (dropped, they take seconds)."""
        if isinstance(loader, ArenaLoader):
            loader.close()
        elif getattr(loader, "_iterator", None) is not None:
            shut = getattr(loader._iterator, "_shutdown_workers", None)
            if shut is not None:
                shut()

    # -- sampling --------------------------------------------------------------------------
    def tick(self, batch: Any = None) -> None:
        """One batch the loop got (kept as ``last`` until the next, as a loop variable is)."""
        self.last = batch
        touch(batch)
        self.batches += 1
        self.window_batches += 1
        if self.batches % self.every == 0:
            self.sample()

    def sample(self) -> None:
        now = time.perf_counter()
        per_batch_ms = (now - self.window_start) * 1000 / max(1, self.window_batches)
        gc.collect()
        objects = gc.get_objects()
        s = {"b": self.batches, "ms": per_batch_ms, "objects": len(objects)}
        del objects
        s.update(measure(self.me))
        self.send("sample", s)
        if self.types_at_warm is not None:  # (what the loop holds now, not after it)
            self.types_last = type_counts()
        self.window_start = time.perf_counter()
        self.window_batches = 0

    def mark_warm(self) -> None:
        self.types_at_warm = type_counts()
        if TRACE:
            self.trace_at_warm = tracemalloc.take_snapshot()

    def finish(self) -> None:
        if self.types_at_warm is not None and self.types_last is not None:
            grown = self.types_last
            grown.subtract(self.types_at_warm)
            self.send("types", [(k, v) for k, v in grown.most_common(6) if v > 0])
        if TRACE and self.trace_at_warm is not None:
            stats = tracemalloc.take_snapshot().compare_to(self.trace_at_warm, "lineno")
            self.send("trace", [str(s)[:200] for s in stats[:8]])


class Counted(Dataset):
    """``dataset`` with, in a worker, its gc-tracked objects written every ``COUNT_EVERY``
    samples (after a collection) to a file under ``COUNTS`` named by its pid:
    the workers' object counts (``w_objects``), which the main process cannot take."""

    COUNT_EVERY = 100

    def __init__(self, dataset: Any):
        self.dataset = dataset
        self.calls = 0

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        self.calls += 1
        if self.calls % self.COUNT_EVERY == 0 and get_worker_info() is not None:
            gc.collect()
            with open(f"{COUNTS}/{os.getpid()}", "a") as f:
                f.write(f"{len(gc.get_objects())}\n")
        return self.dataset[i]


def worker_objects(pids: list[int]) -> int:
    """The last count each of ``pids`` wrote (workers that wrote none: 0)."""
    total = 0
    for pid in pids:
        try:
            with open(f"{COUNTS}/{pid}") as f:
                lines = f.read().split()
            total += int(lines[-1]) if lines else 0
        except OSError:
            pass
    return total


def touch(batch: Any) -> None:
    """What a training step does with a batch, at least: read a value of every leaf."""
    if isinstance(batch, torch.Tensor):
        if batch.numel():
            batch.reshape(-1)[0].item()
    elif hasattr(batch, "dtype") and hasattr(batch, "shape"):
        if batch.size and batch.dtype.fields is None and batch.dtype != object:
            batch.reshape(-1)[0].item()
    elif isinstance(batch, dict):
        for v in batch.values():
            touch(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            touch(v)


def type_counts() -> collections.Counter:
    gc.collect()
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects())


def workers(me: psutil.Process) -> list[psutil.Process]:
    out = []
    for kid in me.children(recursive=True):
        try:
            if any(h in " ".join(kid.cmdline()) for h in HELPERS):
                continue
        except psutil.Error:
            continue
        out.append(kid)
    return out


def measure(me: psutil.Process) -> dict:
    full = me.memory_full_info()
    out = {"rss": full.rss / 1024, "uss": full.uss / 1024, "fds": me.num_fds(),
           "threads": me.num_threads()}
    w_uss = w_fds = w_threads = alive = 0
    pids = []
    for kid in workers(me):
        try:
            w_uss += kid.memory_full_info().uss / 1024
            w_fds += kid.num_fds()
            w_threads += kid.num_threads()
            alive += 1
            pids.append(kid.pid)
        except psutil.Error:
            pass
    out.update(w_uss=w_uss, w_fds=w_fds, w_threads=w_threads, workers=alive,
               w_objects=worker_objects(pids))
    maps = maps_kb = 0
    with open("/proc/self/maps") as f:
        for line in f:
            if "/dev/shm/" in line and (NAME_PREFIX in line or "/torch_" in line):
                lo, hi = line.split()[0].split("-")
                maps += 1
                maps_kb += (int(hi, 16) - int(lo, 16)) / 1024
    out.update(maps=maps, maps_kb=maps_kb)
    shm = shm_kb = 0
    for name in os.listdir("/dev/shm"):
        if name.startswith(NAME_PREFIX) or name.startswith("torch_"):
            try:
                shm_kb += os.stat(f"/dev/shm/{name}").st_size / 1024
                shm += 1
            except OSError:
                pass
    out.update(shm=shm, shm_kb=shm_kb)
    return out


# -- the child and the parent -----------------------------------------------------------------

def child(case: Case, cls: type, nw: int, pw: bool, fd: int) -> None:
    os.setpgid(0, 0)
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    def send(key: str, value: Any) -> None:
        data = pickle.dumps(("before" if key == "sample" else key, value))
        os.write(fd, struct.pack("I", len(data)) + data)

    os.makedirs(COUNTS, exist_ok=True)
    gc.collect()
    gc.freeze()
    if TRACE:
        tracemalloc.start(8)
    ctx = Ctx(case, cls, nw, pw, send)
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            case.loop(ctx)
        except BaseException as e:
            send("error", f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    send("wall", time.monotonic() - t0)
    send("caught", ctx.caught)
    send("warnings", sorted({f"{w.category.__name__}: {str(w.message).splitlines()[0][:80]}"
                             for w in caught}))
    ctx.finish()


def run(case: Case, cls: type, nw: int, pw: bool) -> dict:
    """trial22's ``run`` (the fork, the stream, the hard timeout, orphans and ``/dev/shm``
    names left) with this trial's child, whose samples come back as trial22's ``before``."""
    shutil.rmtree(COUNTS, ignore_errors=True)  # (a reused pid reads no old run's counts)
    t22.child = child  # (t22.run calls the child by its module global)
    res = t22.run(case, cls, nw, pw)
    res["samples"] = res.pop("before")
    return res


# -- slopes and verdicts -----------------------------------------------------------------------

def slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def slopes(res: dict) -> dict:
    """Per metric: (slope per 1,000 batches, change from the warm-up's end to the run's end,
    as the medians of the first and last fifths after the warm-up)."""
    samples = res["samples"]
    after = samples[int(len(samples) * WARM):]
    out: dict = {}
    if len(after) < 4:
        return out
    xs = [s["b"] for s in after]
    k = max(1, len(after) // 5)
    for metric in [*FLOORS, "ms"]:
        ys = [s[metric] for s in after]
        first = sorted(ys[:k])[k // 2]
        last = sorted(ys[-k:])[k // 2]
        out[metric] = (slope(xs, ys) * 1000, last - first, first, last)
    out["batches"] = samples[-1]["b"]
    return out


def grown(s: dict, metric: str) -> bool:
    """``metric`` past both its floors. USS counts only with RSS: the run is a fork of the
    harness, and pages it shares with the harness (or with workers it forked, which exit)
    turn private as either side writes them, which moves USS and not RSS."""
    if metric not in s:
        return False
    _, per_k, change = FLOORS[metric]
    if metric == "uss" and not (s["rss"][0] > per_k / 2 and s["rss"][1] > change / 2):
        return False
    return s[metric][0] > per_k and s[metric][1] > change


def slower(s: dict) -> bool:
    """The time per batch of the last fifth 1.5x the first's (advisory: the machine is shared)."""
    if "ms" not in s:
        return False
    first, last = s["ms"][2], s["ms"][3]
    return last > 1.5 * first and last - first > 0.2


def fmt(s: dict, metric: str) -> str:
    if metric not in s:
        return "-"
    unit = FLOORS[metric][0]
    value = s[metric][0]
    text = f"{value:+.0f}" if abs(value) >= 10 else f"{value:+.1f}"
    return f"{text}{unit}" + ("*" if grown(s, metric) else "")


def compare(case: Case) -> None:
    if ONLY and ONLY not in case.name:
        return
    for nw, pw in case.configs:
        config = f"nw={nw}" + (" pw" if pw else "")
        if CONFIG and config != CONFIG:
            continue
        t = run(case, case.torch_cls or DataLoader, nw, pw)
        a = run(case, ArenaLoader, nw, pw)
        ts, as_ = slopes(t), slopes(a)
        ours_only = [m for m in FLOORS if grown(as_, m) and not grown(ts, m)]
        both = [m for m in FLOORS if grown(as_, m) and grown(ts, m)]
        flags = []
        if ours_only:
            flags.append("GROWS(" + ",".join(ours_only) + ")")
        if both:
            flags.append("both(" + ",".join(both) + ")")
        if slower(as_) and not slower(ts):
            flags.append("SLOWER")
        for side, res in (("torch", t), ("ours", a)):
            if t22.leftovers(res):
                flags.append(f"{side}-LEFT({t22.leftovers(res)})")
            if res.get("hang"):
                flags.append(f"{side}-HANG")
            if "died" in res:
                flags.append(f"{side}-died({res['died']})")
            if "error" in res:
                flags.append(f"{side}-error")
        verdict = " ".join(flags) or "flat"
        ms = (f"{ts['ms'][2]:.2f}->{ts['ms'][3]:.2f} / {as_['ms'][2]:.2f}->{as_['ms'][3]:.2f}"
              if "ms" in ts and "ms" in as_ else "-")
        print(f"[{case.name} {config}] {verdict} batches {ts.get('batches')}/{as_.get('batches')}"
              f" wall {t.get('wall', 0):.1f}/{a.get('wall', 0):.1f}s ms/batch {ms}", flush=True)
        for side, s, res in (("torch", ts, t), ("ours ", as_, a)):
            print(f"    {side} " + " ".join(f"{m}={fmt(s, m)}" for m in FLOORS), flush=True)
            if res.get("error"):
                print(f"    {side} error: {res['error']}")
            if res.get("types"):
                print(f"    {side} types grown: {res['types']}")
            if res.get("trace"):
                print(f"    {side} trace: " + "\n        ".join(res["trace"]))
            if res.get("warnings"):
                print(f"    {side} warnings: {res['warnings'][:3]}")
        ROWS.append((case.name, config, f"{ts.get('batches')}",
                     " ".join(f"{fmt(ts, m)}" for m in SHOWN),
                     " ".join(f"{fmt(as_, m)}" for m in SHOWN), ms, verdict))


def main(cases: list[Case]) -> None:
    print(f"columns: {' '.join(SHOWN)} (slope per 1,000 batches after the warm-up; "
          f"* past the floor)", flush=True)
    for case in cases:
        compare(case)
    print("RESULTS")
    for row in ROWS:
        print("| " + " | ".join(row) + " |")
