"""trial23 harness: one way of consuming a loader, run through torch's DataLoader and
ArenaLoader, and the two transcripts compared.

A case is a function ``case(ctx)``: it builds its loaders with ``ctx.loader(...)`` (the
run's class, ``num_workers`` and ``persistent_workers``, a seeded ``torch.Generator`` for the
shuffle) and consumes them as a user's loop does, recording what the loop sees with
``ctx.got(batch)`` (the batch's content, as plain Python), ``ctx.value(x)`` and
``ctx.error(e)``. ``ctx.got(batch, keep=True)`` also holds the batch: at the end of the
case (and at each ``ctx.check()``) every held batch is compared with what it was when it
came, so a batch the user keeps must not change later (``MUTATED``).

Every run is a forked child leading its own process group (trial22's scheme: a hang, a
crash or a stray process takes only that run down); what it saw streams back through a pipe.
After the case the child drops its loaders and iterators (torch's persistent workers are shut
down first: dropped, they take ~10 s in the collection, trial19/21), collects, and reports
children still alive 5 s later; the parent reports processes of the run's group alive 3 s
after it exited and new ``/dev/shm`` names of ours (``NAME_PREFIX``) or torch's.

``compare`` prints per config ``SAME`` or ``DIFF <first difference>`` (errors: the class must
be torch's or a subclass; both messages are printed), then ``MUTATED``, ``LEAK`` and
``SLOW`` (ours over 3x torch's wall time, and 0.3 s more) flags; ``report`` prints the rows
of the README's table.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import gc
import importlib.util
import os
import pickle
import signal
import struct
import sys
import time
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from arena_loader import ArenaLoader

_spec = importlib.util.spec_from_file_location(
    "trial22_common", Path(__file__).resolve().parent.parent / "trial22" / "common.py")
t22 = sys.modules["trial22_common"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(t22)  # its dataset, plain(), error() and process / shm helpers
Plain, plain, error, N = t22.Plain, t22.plain, t22.error, t22.N  # 20 samples {"x", "y"}

warnings.resetwarnings()
ONLY = sys.argv[1] if len(sys.argv) > 1 else ""
BS = 4                                              # 20 samples: 5 batches an epoch
CONFIGS = ((0, False), (2, False), (2, True))
HARD_S = float(os.environ.get("TRIAL_HARD_S", 40))
ROWS: list[tuple] = []


@dataclasses.dataclass
class Case:
    name: str
    fn: Callable[[Ctx], None]
    configs: tuple = CONFIGS
    known: str = ""                                 # a difference docs/migrating.md lists
    hard_s: float = HARD_S


class Sized(Plain):
    """``n`` samples of trial22's kind (``x`` float32[3] of i, ``y`` i)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n


class Ctx:
    """What a case gets in the child: loaders of the run's kind, and the transcript."""

    def __init__(self, cls: type, nw: int, pw: bool, send: Callable[[str, Any], None]):
        self.cls, self.nw, self.pw, self.send = cls, nw, pw, send
        self.is_torch = cls is DataLoader
        self.kept: list[tuple[str, Any, Any]] = []  # (tag, batch, its content when it came)
        self.loaders: list[weakref.ref] = []
        self.mutated: list[str] = []
        self.t0 = time.monotonic()

    def loader(self, n: int = N, batch_size: int = BS, shuffle: bool = True, seed: int = 0,
               dataset: Any = None, cls: type | None = None, **options: Any) -> Any:
        kw: dict = {"batch_size": batch_size, "shuffle": shuffle, "num_workers": self.nw,
                    "persistent_workers": self.pw}
        if shuffle:
            kw["generator"] = torch.Generator().manual_seed(seed)
        kw.update(options)
        loader = (cls or self.cls)(Sized(n) if dataset is None else dataset, **kw)
        self.loaders.append(weakref.ref(loader))
        return loader

    def got(self, batch: Any, tag: str = "", keep: bool = False) -> None:
        content = plain(batch)
        self.send("before", ("batch", tag, content))
        if keep:
            self.kept.append((tag, batch, content))

    def epoch(self, iterable: Any, tag: str, keep: bool = False) -> None:
        """Every batch of ``iterable`` (a loader: one epoch) recorded."""
        for batch in iterable:
            self.got(batch, tag, keep)

    def value(self, x: Any, tag: str = "") -> None:
        self.send("before", ("value", tag, plain(x) if not isinstance(x, str) else x))

    def error(self, e: BaseException, tag: str = "") -> None:
        self.send("before", ("error", tag, error(e)))

    def check(self, tag: str = "end") -> None:
        """Every held batch against what it was when it came."""
        changed = [f"{t}#{i}" for i, (t, b, c) in enumerate(self.kept) if plain(b) != c]
        if changed:
            self.mutated.append(f"{tag}: {changed[:6]}{'...' if len(changed) > 6 else ''}")
            self.send("mutated", self.mutated)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def shutdown(self) -> None:
        """torch's persistent workers stopped (dropped, they take ~10 s in the collection);
        ArenaLoaders are only dropped, as a user's are."""
        for ref in self.loaders:
            loader = ref()
            if isinstance(loader, DataLoader) and getattr(loader, "_iterator", None) is not None:
                loader._iterator._shutdown_workers()
        self.kept.clear()
        self.loaders.clear()


def child(case: Case, cls: type, nw: int, pw: bool, fd: int) -> None:
    os.setpgid(0, 0)
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    def send(key: str, value: Any) -> None:
        try:
            data = pickle.dumps((key, value))
        except Exception:
            data = pickle.dumps((key, repr(value)[:300]))
        os.write(fd, struct.pack("I", len(data)) + data)

    ctx = Ctx(cls, nw, pw, send)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            case.fn(ctx)
        except BaseException as e:
            ctx.error(e, "case raised")
        send("wall", ctx.elapsed())
        ctx.check()
    send("warnings", sorted({f"{w.category.__name__}: {str(w.message).splitlines()[0][:80]}"
                             for w in caught}))
    ctx.shutdown()
    sys.exc_info()
    gc.collect()
    deadline = time.monotonic() + 5
    while t22.loader_kids(os.getpid()) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.1)
    send("children", t22.loader_kids(os.getpid()))


def run(case: Case, cls: type, nw: int, pw: bool) -> dict:
    """trial22's ``run`` (the fork, the stream, the hard timeout, orphans and ``/dev/shm``
    names) with this trial's child, whose events come back as trial22's ``before``."""
    t22.child = child  # (t22.run calls the child by its module global)
    res = t22.run(case, cls, nw, pw)
    res["events"] = res.pop("before")
    return res


# -- comparing -------------------------------------------------------------------------------

def same_event(t: tuple, a: tuple) -> bool:
    if t[0] == a[0] == "error":
        te, ae = t[2], a[2]
        return t[1] == a[1] and (te["cls"] == ae["cls"] or te["cls"] in ae["mro"])
    return t == a


def short(event: tuple | None) -> str:
    if event is None:
        return "(nothing)"
    kind, tag, body = event
    if kind == "error":
        line = (body["msg"].splitlines() or [""])[0]
        return f"{tag} {body['cls'].replace('builtins.', '')}: {line[:150]}"
    text = str(body)
    return f"{kind} {tag} {text[:150]}"


def summary(res: dict) -> str:
    if res.get("hang"):
        return "HANG"
    if "died" in res:
        return f"died({res['died']})"
    events = res["events"]
    batches = sum(e[0] == "batch" for e in events)
    errors = [e[2]["cls"].rsplit(".", 1)[-1] for e in events if e[0] == "error"]
    return f"{batches} b" + (f", {'/'.join(errors)}" if errors else "")


def compare(case: Case) -> None:
    if ONLY and ONLY not in case.name:
        return
    for nw, pw in case.configs:
        config = f"nw={nw}" + (" pw" if pw else "")
        t = run(case, DataLoader, nw, pw)
        a = run(case, ArenaLoader, nw, pw)
        te, ae = t["events"], a["events"]
        diff = next((i for i, (x, y) in enumerate(zip(te, ae)) if not same_event(x, y)),
                    None if len(te) == len(ae) else min(len(te), len(ae)))
        verdict = "SAME" if diff is None and not (t["hang"] or a["hang"]) else "DIFF"
        flags = []
        if a.get("mutated"):
            flags.append(f"MUTATED({a['mutated']})")
        if t.get("mutated"):
            flags.append(f"torch-mutated({t['mutated']})")
        if t22.leftovers(a):
            flags.append(f"LEAK({t22.leftovers(a)})")
        if t22.leftovers(t):
            flags.append(f"torch-leak({t22.leftovers(t)})")
        if a["wall"] > 3 * t["wall"] and a["wall"] - t["wall"] > 0.3:
            flags.append("SLOW")
        if "died" in a or a["hang"]:
            flags.append(summary(a))
        print(f"[{case.name} {config}] {verdict} torch={summary(t)} ours={summary(a)} "
              f"{' '.join(flags)} ({t['wall']:.2f}s/{a['wall']:.2f}s)", flush=True)
        if diff is not None:
            print(f"    event {diff}: torch {short(te[diff] if diff < len(te) else None)}\n"
                  f"    {' ' * len(str(diff))}       ours  "
                  f"{short(ae[diff] if diff < len(ae) else None)}", flush=True)
        if "timing" in t or "timing" in a:
            print(f"    timing: torch {t.get('timing', 0):.3f}s ours {a.get('timing', 0):.3f}s")
        for side, res in (("torch", t), ("ours", a)):
            for e in [e for e in res["events"] if e[0] == "error"][:4]:
                print(f"    {side} {short(e)}", flush=True)
            if res.get("warnings"):
                print(f"    {side} warnings: {res['warnings']}", flush=True)
        flag_names = " ".join(f.split("(")[0] for f in flags)
        ROWS.append((case.name, config, summary(t), summary(a),
                     f"{t['wall']:.2f} / {a['wall']:.2f}",
                     (verdict + (" " + flag_names if flag_names else ""))
                     + (f" ({case.known})" if case.known else "")))


def main(cases: list[Case]) -> None:
    for case in cases:
        compare(case)
    print("RESULTS")
    for row in ROWS:
        print("| " + " | ".join(row) + " |")
