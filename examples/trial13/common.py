"""Shared harness for trial13: run the same script on torch's DataLoader and ArenaLoader."""

import dataclasses
import faulthandler
import gc
import os
import sys
import time

import numpy as np
import torch
from torch.utils.data import DataLoader

from arena_loader import ArenaLoader

if os.environ.get("TRIAL_DUMP"):  # periodic stack dumps, to see where time goes
    faulthandler.dump_traceback_later(float(os.environ["TRIAL_DUMP"]), repeat=True)
else:
    faulthandler.dump_traceback_later(float(os.environ.get("TRIAL_TIMEOUT", 120)), exit=True)


def shm():
    return set(os.listdir("/dev/shm"))


def children():
    me = str(os.getpid())
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[1] == me:
                        out.append(int(p))
            except OSError:
                pass
    return out


def plain(x):
    """A canonical, copied form of a batch: type, dtype, shape, values."""
    if isinstance(x, torch.Tensor):
        return ("Tensor", str(x.dtype), tuple(x.shape), x.detach().clone().numpy().tolist())
    if isinstance(x, np.ndarray):
        v = x.tolist() if x.dtype != object else [plain(e) for e in x.ravel()]
        return ("ndarray", str(x.dtype), x.shape, v)
    if isinstance(x, np.generic):
        return (type(x).__name__, x.item())
    if isinstance(x, dict):
        return (type(x).__name__, tuple((k, plain(v)) for k, v in x.items()))
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return (type(x).__name__, tuple(plain(v) for v in x))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(plain(v) for v in x))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (type(x).__name__, tuple((f.name, plain(getattr(x, f.name))) for f in dataclasses.fields(x)))
    if isinstance(x, (int, float, str, bytes, bool, type(None))):
        return (type(x).__name__, x)
    if hasattr(x, "__dict__"):
        return (type(x).__name__, tuple(sorted((k, plain(v)) for k, v in vars(x).items())))
    return (type(x).__name__, repr(x))


def first_diff(a, b, path="batch"):
    if type(a) is not type(b):
        return f"{path}: {a!r:.200} != {b!r:.200}"
    if isinstance(a, tuple):
        if len(a) != len(b):
            return f"{path}: len {len(a)} != {len(b)}: {a!r:.300} vs {b!r:.300}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_diff(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    if a != b and not (isinstance(a, float) and a != a and b != b):
        return f"{path}: {a!r:.200} != {b!r:.200}"
    return None


def collect(cls, make_kwargs, dataset, epochs=2, extra=None):
    if callable(dataset) and not hasattr(dataset, "__getitem__") and not hasattr(dataset, "__iter__"):
        dataset = dataset()  # a factory: a fresh dataset (and RNG state) per loader
    kw = make_kwargs()
    if cls is ArenaLoader and extra:
        kw.update(extra)
    loader = cls(dataset, **kw)
    out = []
    for _ in range(epochs):
        out.append([plain(b) for b in loader])
    if cls is ArenaLoader:
        loader.close()
    del loader
    return out


def compare(name, dataset, make_kwargs, epochs=2, extra=None, expect_error=False):
    """make_kwargs() builds fresh kwargs (fresh generator) for each loader."""
    before_shm, t0 = shm(), time.time()
    res = {}
    for cls in (DataLoader, ArenaLoader):
        try:
            res[cls.__name__] = ("ok", collect(cls, make_kwargs, dataset, epochs, extra))
        except Exception as e:  # noqa: BLE001
            res[cls.__name__] = ("err", f"{type(e).__name__}: {e}")
    t, a = res["DataLoader"], res["ArenaLoader"]
    gc.collect()  # torch's iterator may sit in a cycle after an error; its workers end here
    time.sleep(0.3)
    leaks = []
    kids = children()
    if kids:
        time.sleep(1.0)
        kids = children()
        if kids:
            leaks.append(f"children {[(p, cmdline(p)) for p in kids]}")
    new_shm = shm() - before_shm
    if new_shm:
        leaks.append(f"shm {sorted(new_shm)}")
    if t[0] == "ok" and a[0] == "ok":
        d = first_diff(t[1], a[1])
        status = "SAME" if d is None else f"DIFF {d}"
    elif t[0] == a[0] == "err":
        status = f"BOTH-ERR\n    torch: {t[1][:400]}\n    arena: {a[1][:600]}"
    else:
        status = f"ONE-ERR torch={t[0]} arena={a[0]}\n    torch: {(t[1] if isinstance(t[1], str) else repr(t[1][0][:1]))[:400]}\n    arena: {(a[1] if isinstance(a[1], str) else repr(a[1][0][:1]))[:900]}"
    print(f"[{name}] {status} {'LEAK ' + str(leaks) if leaks else ''} ({time.time() - t0:.1f}s)", flush=True)
    return res


def variants(base, workers=(0, 2), persistent=(False, True)):
    for nw in workers:
        for p in persistent:
            if nw == 0 and p:
                continue
            kw = dict(base, num_workers=nw)
            if nw:
                kw["persistent_workers"] = p
            yield f"nw={nw} pw={p}", kw


def seeded(kw, seed=1234):
    def make():
        k = dict(kw)
        if k.get("shuffle"):
            k["generator"] = torch.Generator().manual_seed(seed)
        return k
    return make


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()[:150]
    except OSError:
        return "?"


def report_end(before):
    time.sleep(0.5)
    print("END children:", [(p, cmdline(p)) for p in children()], "new shm:", sorted(shm() - before),
          file=sys.stderr)
