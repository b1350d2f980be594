"""trial16 harness: the same map-style dataset through torch's DataLoader and ArenaLoader,
every batch compared bit for bit (raw bytes, dtype, shape, structure), errors by type, and
after each ArenaLoader run: no surviving child process, nothing new in /dev/shm.

Loop choice (arena_loader/_layout/rowcopy.py CHOICE) is set in this process before each
ArenaLoader run, so forked workers inherit it:
  "cast"  : every class of row sizes decided for the cast loop (``decided(True)``)
  "learn" : a fresh LoopChoice  (alternating, timed, as a new process does)
A counter shared with the workers (fork) records how many large-row writes the cast loop
actually did, so a case that claims to cover the cast path shows it did.
"""

from __future__ import annotations

import faulthandler
import gc
import multiprocessing as mp
import os
import time

import numpy as np
import psutil
import torch
from torch.utils.data import DataLoader

from arena_loader import ArenaLoader
from arena_loader._layout import rowcopy

faulthandler.dump_traceback_later(float(os.environ.get("TRIAL_TIMEOUT", 600)), exit=True)

# --- count cast-loop writes (shared with forked workers) -------------------------------
CAST_WRITES = mp.Value("q", 0, lock=True)
_orig_assign = rowcopy.CastRows._assign


def _counting_assign(self, cast, values, where):
    done = _orig_assign(self, cast, values, where)
    if cast and done:
        with CAST_WRITES.get_lock():
            CAST_WRITES.value += 1
    return done


rowcopy.CastRows._assign = _counting_assign


class Decided(rowcopy.LoopChoice):
    """Every class of row sizes has chosen ``cast`` (True: the cast loop; False: memmove)."""

    def __init__(self, cast: bool):
        super().__init__()
        self.cast = cast

    def of(self, row_nbytes):
        row_class = rowcopy.RowClass()
        row_class.cast = self.cast
        return row_class


def decided(cast: bool) -> rowcopy.LoopChoice:
    return Decided(cast)


def set_choice(mode: str) -> None:
    if mode == "cast":
        rowcopy.CHOICE = decided(True)
    elif mode == "memmove":
        rowcopy.CHOICE = decided(False)
    else:
        rowcopy.CHOICE = rowcopy.LoopChoice()


# --- leak checks -------------------------------------------------------------------------
def shm() -> set:
    return set(os.listdir("/dev/shm"))


def children() -> list[int]:
    """Child processes still alive, but the multiprocessing resource tracker (the Value's
    lock keeps one: not ours to judge)."""
    out = []
    for child in psutil.Process().children():
        try:
            if child.is_running() and child.status() != psutil.STATUS_ZOMBIE and \
                    "resource_tracker" not in " ".join(child.cmdline()):
                out.append(child.pid)
        except psutil.Error:
            continue  # gone meanwhile
    return out


def wait_clean(before: set, seconds: float = 5.0) -> list[str]:
    deadline = time.time() + seconds
    while True:
        gc.collect()
        kids, new = children(), sorted(shm() - before)
        if (not kids and not new) or time.time() > deadline:
            break
        time.sleep(0.05)
    problems = []
    if kids:
        problems.append(f"children alive {kids}")
    if new:
        problems.append(f"/dev/shm left {new}")
    return problems


# --- canonical form of a batch: raw bytes ----------------------------------------------
def _np_of_torch_dtype(dt):
    return {torch.bfloat16: "bfloat16"}.get(dt) or str(torch.empty(0, dtype=dt).numpy().dtype)


def leaf_bytes(x):
    """(dtype name, shape, raw bytes) of a tensor / ndarray leaf."""
    if isinstance(x, torch.Tensor):
        t = x.detach().contiguous()
        raw = t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return (_np_of_torch_dtype(t.dtype), tuple(t.shape), raw)
    a = np.asarray(x)
    return (str(a.dtype), tuple(a.shape), np.ascontiguousarray(a).tobytes())


def canon(x, strict_types: bool):
    if isinstance(x, (torch.Tensor, np.ndarray)):
        kind = type(x).__name__ if strict_types else "array"
        return (kind, *leaf_bytes(x))
    if isinstance(x, np.generic):
        return ("array", *leaf_bytes(x))
    if isinstance(x, dict):
        return ("dict", tuple((k, canon(v, strict_types)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        kind = type(x).__name__ if strict_types else "seq"
        return (kind, tuple(canon(v, strict_types) for v in x))
    return (type(x).__name__, x)


def describe_diff(a, b, path="batch") -> str:
    if type(a) is not tuple or type(b) is not tuple or len(a) != len(b) or a[0] != b[0]:
        return f"{path}: {short(a)} vs {short(b)}"
    if a[0] in ("array", "Tensor", "ndarray"):
        if a[1:3] != b[1:3]:
            return f"{path}: dtype/shape torch {a[1:3]} ours {b[1:3]}"
        ra, rb = np.frombuffer(a[3], np.uint8), np.frombuffer(b[3], np.uint8)
        if len(ra) != len(rb):
            return f"{path}: nbytes {len(ra)} vs {len(rb)}"
        bad = np.flatnonzero(ra != rb)
        return (f"{path}: {len(bad)} bytes differ, first at byte {bad[0]}: "
                f"torch {ra[bad[0]:bad[0] + 8].tolist()} ours {rb[bad[0]:bad[0] + 8].tolist()}")
    if a[0] == "dict":
        for (ka, va), (kb, vb) in zip(a[1], b[1]):
            if ka != kb:
                return f"{path}: keys {ka!r} vs {kb!r}"
            if va != vb:
                return describe_diff(va, vb, f"{path}[{ka!r}]")
    if a[0] in ("seq", "list", "tuple"):
        if len(a[1]) != len(b[1]):
            return f"{path}: len {len(a[1])} vs {len(b[1])}"
        for i, (va, vb) in enumerate(zip(a[1], b[1])):
            if va != vb:
                return describe_diff(va, vb, f"{path}[{i}]")
    return f"{path}: {short(a)} vs {short(b)}"


def short(x) -> str:
    s = repr(x)
    return s if len(s) < 200 else s[:200] + "..."


# --- runs ----------------------------------------------------------------------------------
EPOCHS = 2


def run(loader_cls, dataset, strict_types, **kw):
    """Batches of EPOCHS epochs as canonical tuples, and the error (type name, MRO, message).
    strict_types None: both forms, as {True: (batches, err), False: (batches, err)}."""
    out, loose, err = [], [], None
    loader = loader_cls(dataset, **kw)
    try:
        for _ in range(EPOCHS):
            for batch in loader:
                if strict_types is None:
                    out.append(canon(batch, True))
                    loose.append(canon(batch, False))
                else:
                    out.append(canon(batch, strict_types))
                del batch
    except Exception as exc:
        err = (type(exc).__name__, [c.__name__ for c in type(exc).__mro__],
               str(exc).splitlines()[0][:300] if str(exc) else "")
    finally:
        close = getattr(loader, "close", None)
        if close is not None:
            close()
        del loader
    if strict_types is None:
        return {True: (out, err), False: (loose, err)}
    return out, err


CONFIGS = [  # (num_workers, worker_threads, persistent_workers)
    (0, 1, False), (2, 1, False), (2, 1, True), (2, 3, False), (2, 3, True),
]

LEARN_CONFIGS = [(0, 1, False), (2, 3, True)]

RESULTS: dict[str, int] = dict.fromkeys(
    ("SAME", "TORCH-INCONSISTENT", "DIFF", "BOTH-ERR", "ERR-TYPE", "ONE-ERR", "LEAK", "NO-CAST"), 0)
LOG: list[str] = []


def say(line: str) -> None:
    print(line, flush=True)
    LOG.append(line)


def compare_case(name, make_dataset, *, batch_size=4, collate_fn=None, modes=("cast", "learn"),
                 outputs=("torch", None), expect_cast=True, configs=CONFIGS, torch_kw=None):
    """Run one case over every config x output x loop mode; print a line per difference."""
    torch_ref = {}
    for nw in sorted({c[0] for c in configs}):
        both = run(DataLoader, make_dataset(), None, batch_size=batch_size, num_workers=nw,
                   collate_fn=collate_fn, **(torch_kw or {}))
        for strict in (True, False):
            torch_ref[nw, strict] = both[strict]
    case_lines, casts = [], 0
    runs = [(m, c, o) for m in modes for c in (configs if m == "cast" else LEARN_CONFIGS)
            for o in (outputs if m == "cast" else outputs[:1])]
    for mode, (nw, wt, pw), output in runs:
            if True:
                # output="torch" makes a collate_fn's arrays tensors (documented): compare
                # such batches by dtype/shape/bytes only
                strict = output == "torch" and collate_fn is None
                set_choice(mode)
                before_shm = shm()
                with CAST_WRITES.get_lock():
                    CAST_WRITES.value = 0
                ours = run(ArenaLoader, make_dataset(), strict, batch_size=batch_size,
                           num_workers=nw, collate_fn=collate_fn, persistent_workers=pw,
                           worker_threads=wt, output=output)
                casts += CAST_WRITES.value
                leaks = wait_clean(before_shm)
                tag = f"{name} [{mode} nw={nw} wt={wt} pw={int(pw)} out={output}]"
                verdict = judge(torch_ref[nw, strict], ours)
                other = (2 if nw == 0 else 0, strict)
                if (verdict[0] not in ("SAME", "BOTH-ERR") and other in torch_ref
                        and judge(torch_ref[other], ours)[0] in ("SAME", "BOTH-ERR")):
                    verdict = ("TORCH-INCONSISTENT",
                               f"equals torch's num_workers={other[0]} result; vs torch's "
                               f"num_workers={nw}: {verdict[0]} {verdict[1]}")
                RESULTS[verdict[0]] += 1
                if leaks:
                    RESULTS["LEAK"] += 1
                    case_lines.append(f"  LEAK {tag}: {'; '.join(leaks)}")
                if verdict[0] not in ("SAME", "BOTH-ERR"):
                    case_lines.append(f"  {verdict[0]} {tag}: {verdict[1]}")
    if expect_cast and casts == 0 and "cast" in modes:
        RESULTS["NO-CAST"] += 1
        case_lines.append("  NO-CAST: the cast loop wrote no row in this case")
    ref_err = torch_ref[0, True][1] or torch_ref.get((2, True), ([], None))[1]
    tail = f" (torch: {ref_err[0]}: {ref_err[2][:90]})" if ref_err else ""
    if (0, True) in torch_ref and (2, True) in torch_ref and judge(
            torch_ref[0, True], torch_ref[2, True])[0] not in ("SAME", "BOTH-ERR"):
        t0, t2 = torch_ref[0, True], torch_ref[2, True]
        how = judge(t0, t2)[1][:300].replace("torch", "TORCH0").replace("ours", "TORCH2")
        tail += f" [torch itself: num_workers=0 (TORCH0) vs 2 (TORCH2) differ: {how}]"
    say(f"{name}: {'ok' if not case_lines else 'see below'} (cast-loop writes {casts}){tail}")
    for line in case_lines:
        say(line)


def judge(ref, ours):
    (rb, re_), (ob, oe) = ref, ours
    n = min(len(rb), len(ob))
    for i in range(n):
        if rb[i] != ob[i]:
            return "DIFF", f"batch {i}: {describe_diff(rb[i], ob[i])}"
    if len(rb) != len(ob):
        return ("DIFF" if re_ is None and oe is None else "ONE-ERR" if (re_ is None) != (oe is None)
                else "BOTH-ERR"), (f"{len(rb)} vs {len(ob)} batches; torch err {re_ and re_[0]} "
                                   f"{re_ and re_[2][:120]!r}; ours err {oe and oe[0]} "
                                   f"{oe and oe[2][:160]!r}")
    if re_ is None and oe is None:
        return "SAME", ""
    if (re_ is None) != (oe is None):
        return "ONE-ERR", (f"torch {re_[0] + ': ' + re_[2][:150] if re_ else 'no error'} | "
                           f"ours {oe[0] + ': ' + oe[2][:200] if oe else 'no error'}")
    if re_[0] in oe[1]:
        return "BOTH-ERR", ""
    return "ERR-TYPE", f"torch {re_[0]}: {re_[2][:120]} | ours {oe[0]} {oe[1][:4]}: {oe[2][:160]}"


def run_cases(cases: list, filt: str = "") -> None:
    """Each ``(name, make, options)`` whose name holds ``filt``, then the summary."""
    for name, make, kw in cases:
        if filt and filt not in name:
            continue
        compare_case(name, make, **kw)
    summary()


def summary() -> None:
    say("RESULTS " + " ".join(f"{k}={v}" for k, v in RESULTS.items()))
