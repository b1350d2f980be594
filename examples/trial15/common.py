"""trial15's harness: run the same loader options through torch's DataLoader and ArenaLoader
on streaming / iterable-style and storage libraries, and compare every batch.

``plain`` is trial14's (itself trial13's, loaded from there, not copied), extended to PIL
images. ``compare`` is trial13's idea with what these libraries need: a dataset factory per
loader (streaming datasets keep state of their own), an ``on_epoch`` hook (``set_epoch``), and
leaks split into ours (``/dev/shm/arena_loader_*``) and theirs (any other new name), with
child processes counted after each case.

Every script is meant to run under ``timeout 300``; a watchdog (``TRIAL_TIMEOUT``, default
280 s) dumps every thread's stack and exits first, so a hang shows where it is."""

import gc
import importlib.util
import os
import shutil
import sys
import time

os.environ.setdefault("TRIAL_TIMEOUT", "280")

import numpy as np
import torch
from torch.utils.data import DataLoader

from arena_loader import ArenaLoader

_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "trial14", "common.py")
_spec = importlib.util.spec_from_file_location("trial14_common", _path)
t14 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(t14)
_t14_plain = t14.plain

OURS = "arena_loader_"  # arena_loader/_slab.py NAME_PREFIX
DATA = "/tmp/trial15_data"
# samples of Python numbers / numpy arrays only: numpy batches with output=None (documented in
# docs/migrating.md, "Remaining differences"); those cases ask for torch's structure
TORCH_OUT = {"output": "torch"}
# /dev/shm lists the whole machine: another session's benchmark makes Python
# multiprocessing's SharedMemory and semaphore names (psm_*, sem.mp-*) while these scripts
# run, so those are not counted
NOISE = ("psm_", "sem.mp-")
MY_PIDS = {os.getpid()}


def plain(x):
    """trial14's canonical form, plus PIL images (mode, size, pixel bytes)."""
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover
        Image = None  # noqa: N806
    if Image is not None and isinstance(x, Image.Image):
        return ("PIL", x.mode, x.size, x.tobytes())
    if isinstance(x, torch.Tensor) and type(x) is torch.Tensor:
        return _t14_plain(x)
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        return (type(x).__name__, tuple(plain(v) for v in x))
    if isinstance(x, dict):
        return (type(x).__name__, tuple((k, plain(v)) for k, v in x.items()))
    return _t14_plain(x)


t14.plain = t14.base.plain = plain
first_diff, seeded, variants, children, cmdline = (
    t14.first_diff,
    t14.seeded,
    t14.variants,
    t14.children,
    t14.base.cmdline,
)


def shm():
    return set(os.listdir("/dev/shm"))


def fresh_dir(*parts):
    path = os.path.join(DATA, *parts)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def collect(cls, make_kwargs, make_dataset, epochs, extra, on_epoch, steps):
    ours = extra if cls is ArenaLoader and extra else {}  # ArenaLoader-only keywords
    loader = cls(make_dataset(), **make_kwargs(), **ours)
    out = []
    for epoch in range(epochs):
        if on_epoch:
            on_epoch(loader, loader.dataset, epoch)
        batches = []
        for i, b in enumerate(loader):
            if i == 0:
                MY_PIDS.update(children())  # the workers: /dev/shm names carry their pid
            batches.append(plain(b))
            if steps is not None and i + 1 == steps:
                break
        out.append(batches)
    if cls is ArenaLoader:
        loader.close()
    del loader
    return out


RESULTS = {"SAME": 0, "DIFF": 0, "BOTH-ERR": 0, "ONE-ERR": 0, "LEAK": 0}


def leftovers(before_shm):
    """What is left once a loader is gone: new /dev/shm names (ours, theirs) and child
    processes (multiprocessing's resource tracker, started by a library's SharedMemory and
    living until exit under either loader, is theirs)."""
    gc.collect()
    time.sleep(0.2)
    kids = children()
    if kids:
        time.sleep(1.0)
        kids = children()
    tracker = [p for p in kids if "resource_tracker" in cmdline(p)]
    new = {n for n in shm() - before_shm if not n.startswith(NOISE)}
    # arena_loader names carry their creator's pid: one of another session's processes (the
    # other engineer's arena_loader runs) is not this script's leak
    others = {
        n for n in new if n.startswith(OURS) and int(n[len(OURS) :].split("_")[0]) not in MY_PIDS
    }
    new -= others
    return {
        "ours": sorted(n for n in new if n.startswith(OURS)),
        "others": sorted(others),
        "their_shm": sorted(n for n in new if not n.startswith(OURS)),
        "children": [(p, cmdline(p)) for p in kids if p not in tracker],
        "tracker": tracker,
    }


def compare(name, make_dataset, make_kwargs, epochs=2, extra=None, on_epoch=None, steps=None):
    """``make_dataset()`` and ``make_kwargs()`` build fresh ones for each loader; ``steps``
    stops each epoch after that many batches (a ``break``); ``on_epoch(loader, dataset,
    epoch)`` runs before each epoch. A leak is a child process or an ``arena_loader_`` name
    left after either loader, or ArenaLoader leaving a different number of the library's own
    /dev/shm names than torch's DataLoader did (those are reported as "their shm")."""
    t0 = time.time()
    res, left = {}, {}
    for cls in (DataLoader, ArenaLoader):
        before = shm()
        try:
            res[cls.__name__] = (
                "ok",
                collect(cls, make_kwargs, make_dataset, epochs, extra, on_epoch, steps),
            )
        except Exception as e:
            res[cls.__name__] = ("err", f"{type(e).__name__}: {e}")
        left[cls.__name__] = leftovers(before)
    t, a = res["DataLoader"], res["ArenaLoader"]
    lt, la = left["DataLoader"], left["ArenaLoader"]
    leaks, notes = [], []
    for who, lo in left.items():
        if lo["children"]:
            leaks.append(f"{who} children {lo['children']}")
        if lo["ours"]:
            leaks.append(f"{who} OUR shm {lo['ours']}")
    if len(lt["their_shm"]) != len(la["their_shm"]):
        leaks.append(f"their shm torch {lt['their_shm']} arena {la['their_shm']}")
    elif la["their_shm"]:
        notes.append(f"their shm {len(la['their_shm'])} per loader, as torch")
    if others := lt["others"] + la["others"]:
        notes.append(f"another session's arena_loader names {others}")
    if t[0] == "ok" and a[0] == "ok":
        d = first_diff(t[1], a[1])
        status = "SAME" if d is None else f"DIFF {d}"
        nb = sum(map(len, t[1]))
    elif t[0] == a[0] == "err":
        status = f"BOTH-ERR\n    torch: {t[1][:400]}\n    arena: {a[1][:600]}"
        nb = 0
    else:
        status = (
            f"ONE-ERR torch={t[0]} arena={a[0]}\n    torch: {str(t[1])[:400]}"
            f"\n    arena: {str(a[1])[:900]}"
        )
        nb = 0
    RESULTS[status.split()[0]] += 1
    RESULTS["LEAK"] += bool(leaks)
    print(
        f"[{name}] {status} {'LEAK ' + str(leaks) if leaks else ''}"
        f"{' (' + '; '.join(notes) + ')' if notes else ''}"
        f" ({nb} batches, {time.time() - t0:.1f}s)",
        flush=True,
    )
    return res


def resumed_batches(cls, make_kwargs, make_dataset, k, epochs, on_epoch):
    """A ``cls`` loader stopped after k batches of its first epoch, its ``state_dict()``
    loaded into a fresh loader over a fresh dataset: the rest of that epoch, then the others."""
    first = cls(make_dataset(), **make_kwargs())
    if on_epoch:
        on_epoch(first, first.dataset, 0)
    it = iter(first)
    for _ in range(k):
        next(it)
    state = first.state_dict()
    del it
    getattr(first, "close", lambda: None)()
    loader = cls(make_dataset(), **make_kwargs())
    loader.load_state_dict(state)
    out = []
    for epoch in range(epochs):
        if on_epoch:
            on_epoch(loader, loader.dataset, epoch)
        out.append([plain(b) for b in loader])
    getattr(loader, "close", lambda: None)()
    return out


def compare_resume(name, make_dataset, make_kwargs, k, epochs=2, on_epoch=None):
    """ArenaLoader resumed from its ``state_dict()`` after k batches (README, "Resuming")
    against torchdata's ``StatefulDataLoader`` resumed the same way (the protocol ours
    follows), and against torch's DataLoader uninterrupted (its first epoch from batch k)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    t0, before = time.time(), shm()
    runs = {}
    for who, fn in (
        (
            "torch",
            lambda: collect(DataLoader, make_kwargs, make_dataset, epochs, None, on_epoch, None),
        ),
        (
            "torchdata",
            lambda: resumed_batches(
                StatefulDataLoader, make_kwargs, make_dataset, k, epochs, on_epoch
            ),
        ),
        (
            "arena",
            lambda: resumed_batches(ArenaLoader, make_kwargs, make_dataset, k, epochs, on_epoch),
        ),
    ):
        try:
            runs[who] = ("ok", fn())
        except Exception as e:
            runs[who] = ("err", f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}")
    if runs["torch"][0] == "ok":
        runs["torch"][1][0] = runs["torch"][1][0][k:]
    status = []
    for ref in ("torchdata", "torch"):
        (rs, rv), (as_, av) = runs[ref], runs["arena"]
        if rs == as_ == "ok":
            d = first_diff(rv, av)
            status.append(f"vs {ref} " + ("SAME" if d is None else f"DIFF {d[:300]}"))
        elif rs == as_:
            status.append(f"vs {ref} BOTH-ERR (same: {rv == av}) {av}")
        else:
            ref_got, arena_got = rv if rs == "err" else "ok", av if as_ == "err" else "ok"
            status.append(f"vs {ref} ONE-ERR {ref}: {ref_got} arena: {arena_got}")
    lo = leftovers(before)
    leaks = [f"{k_} {v}" for k_, v in lo.items() if v and k_ in ("ours", "children")]
    RESULTS["LEAK"] += bool(leaks)
    print(
        f"[{name}] {'; '.join(status)} {'LEAK ' + str(leaks) if leaks else ''}"
        f" ({time.time() - t0:.1f}s)",
        flush=True,
    )


def report_end(before):
    time.sleep(0.5)
    print("RESULTS", RESULTS, flush=True)
    print(
        "END children:",
        [(p, cmdline(p)) for p in children()],
        "new shm:",
        sorted(shm() - before),
        file=sys.stderr,
    )


def stub_torchvision_for(module):
    """Import ``module`` (mosaicml-streaming) with a placeholder ``torchvision``: its
    ``streaming.vision`` imports ``VisionDataset`` and ``to_tensor`` at import time, and the
    only torchvision wheel here is a CUDA build that fails beside CPU torch. The placeholder
    is removed again once the import is done (transformers probes torchvision by spec)."""
    import types

    import transformers.feature_extraction_utils  # noqa: F401  (imported before the stub)

    tv, tvd, tvt, tvf = (
        types.ModuleType(n)
        for n in (
            "torchvision",
            "torchvision.datasets",
            "torchvision.transforms",
            "torchvision.transforms.functional",
        )
    )
    tvd.VisionDataset = type("VisionDataset", (), {})
    tvf.to_tensor = lambda x: torch.as_tensor(np.asarray(x))
    tv.datasets, tv.transforms, tvt.functional = tvd, tvt, tvf
    stubs = {m.__name__: m for m in (tv, tvd, tvt, tvf)}
    sys.modules.update(stubs)
    try:
        return importlib.import_module(module)
    finally:
        for n in stubs:
            sys.modules.pop(n, None)
