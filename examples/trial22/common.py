"""trial22 harness: one user mistake run through torch's DataLoader and ArenaLoader.

Every run (one loader class, one ``num_workers`` / ``persistent_workers`` config) happens in a
forked child that leads its own process group, so a segfault, an ``os._exit`` or a hang takes
only that run down. The child streams what it sees through a pipe (each batch as plain Python,
each exception as its class, MRO and message) and the parent keeps what came if the child
dies or passes the hard timeout (``HARD_S``: then its stack is dumped to stderr, SIGUSR1 via
``faulthandler``, and its group SIGKILLed).

Per run: the error (class, MRO, message) and where it came (constructor, ``iter()``, a
batch), the batches yielded before it, what the same iterator yields after it (``cont``),
what a new ``iter(loader)`` yields (``again``), warnings, wall time, and leftovers: children
of the run's process still alive 5 s after the loader and its iterators are dropped and
collected, processes of its group alive 3 s after it exited (orphans), new ``/dev/shm`` names
with the loader's prefix or torch's whose creator was the run's (or is dead).

``compare`` prints one line per config and returns the rows ``report`` turns into the
README's table.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import gc
import os
import pickle
import re
import select
import signal
import struct
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from arena_loader import ArenaLoader
from arena_loader._slab import NAME_PREFIX

HARD_S = float(os.environ.get("TRIAL_HARD_S", 25))
ONLY = sys.argv[1] if len(sys.argv) > 1 else ""
CAP = 50                       # batches read at most per drain
N, BAD, BS = 20, 9, 4          # 20 samples, sample 9 bad, batches of 4: the third batch fails
CONFIGS = ((0, False), (2, False), (2, True))
ROWS: list[tuple] = []
warnings.simplefilter("always")


@dataclasses.dataclass
class Case:
    name: str
    dataset: Callable[[], Any]                 # a factory: a fresh dataset per run
    options: dict = dataclasses.field(default_factory=dict)
    configs: tuple = CONFIGS
    names: tuple = ()                          # regexes our message must hold (index, field, param)
    fix: str = ""                              # a regex for the fix our message must say
    arena: dict = dataclasses.field(default_factory=lambda: {"output": "torch"})
    action: Callable[[Any], Any] | None = None  # instead of the epoch protocol
    known: str = ""                            # a difference docs/migrating.md lists
    hard_s: float = HARD_S                     # the run's hard timeout (torch hangs: less)


class Plain(Dataset):
    """Sample i: ``{"x": float32[3] of i, "y": i}``, 20 of them."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"x": torch.full((3,), float(i)), "y": i}


# -- what a child records ---------------------------------------------------------------------

def plain(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", str(x.dtype), tuple(x.shape), str(x.detach().tolist()))  # str: NaN == NaN
    if isinstance(x, np.ndarray):
        return ("A", str(x.dtype), x.shape, str(x.tolist()) if x.dtype != object else repr(x))
    if isinstance(x, dict):
        return ("dict", tuple((k, plain(v)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(plain(v) for v in x))
    if isinstance(x, (int, float, str, bytes, bool, type(None))):
        return (type(x).__name__, x if x == x else "nan")
    return (type(x).__name__,)  # an object: its class (its repr holds an address)


def error(e: BaseException) -> dict:
    try:
        message = str(e)
    except BaseException as inner:
        message = f"<str() raised {type(inner).__name__}>"
    return {"cls": f"{type(e).__module__}.{type(e).__qualname__}",
            "mro": [f"{c.__module__}.{c.__qualname__}" for c in type(e).__mro__], "msg": message}


def drain(it, send, key: str, errors_allowed: int) -> BaseException | None:
    """Batches of ``it`` as ``key`` records; an error is recorded (``key + "_errors"``, and an
    ``("ERR",)`` in the batches) and read past ``errors_allowed`` times, as a loop that catches
    and goes on would. Returns the last error it stopped on."""
    send("phase", key)
    count = 0
    while count < CAP:
        try:
            batch = next(it)
        except StopIteration:
            return None
        except BaseException as e:
            if key == "before":
                send("where", "next")
            send(key + "_errors", error(e))
            send(key, ("ERR",))
            if errors_allowed <= 0:
                return e
            errors_allowed -= 1
            continue
        send(key, plain(batch))
        del batch  # not held by the traceback of a later error
        count += 1
    send(key + "_errors", {"cls": "cap", "mro": [], "msg": f"{CAP} batches"})
    return None


def epoch_protocol(loader, send) -> None:
    """The first epoch up to its first error ("before"), the same iterator after it ("cont"),
    then a new ``iter(loader)`` read to its end past its errors ("again")."""
    try:
        it = iter(loader)
    except BaseException as e:
        send("where", "iter")
        send("before_errors", error(e))
        it = None
    if it is not None and drain(it, send, "before", 0) is not None:
        drain(it, send, "cont", 3)
    del it
    try:
        again = iter(loader)
    except BaseException as e:
        send("again_errors", error(e))
        return
    drain(again, send, "again", 3)


def kwargs(case: Case, cls: type, nw: int, pw: bool) -> dict:
    kw = {"batch_size": BS, **case.options}
    if nw is not None:
        kw["num_workers"] = nw
    if pw:
        kw["persistent_workers"] = True
    if cls is ArenaLoader:
        kw.update(case.arena)
    return kw


def child(case: Case, cls: type, nw: int, pw: bool, fd: int) -> None:
    os.setpgid(0, 0)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    faulthandler.cancel_dump_traceback_later()

    def send(key, value):
        try:
            data = pickle.dumps((key, value))
        except Exception:
            data = pickle.dumps((key, repr(value)[:300]))
        os.write(fd, struct.pack("I", len(data)) + data)

    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            loader = cls(case.dataset(), **kwargs(case, cls, nw, pw))
        except BaseException as e:
            send("where", "construct")
            send("before_errors", error(e))
            loader = None
        if loader is not None:
            if case.action:
                try:
                    send("action", plain(case.action(loader)))
                except BaseException as e:
                    send("where", "action")
                    send("before_errors", error(e))
            else:
                epoch_protocol(loader, send)
    send("wall", time.monotonic() - t0)
    send("warnings", sorted({f"{w.category.__name__}: {str(w.message).splitlines()[0][:90]}"
                             for w in caught}))
    # ArenaLoaders are dropped, not closed (the leftover check is for them); torch's persistent
    # workers are shut down first (dropped, they take ~10 s in the collection: trial19/21)
    if isinstance(loader, DataLoader) and getattr(loader, "_iterator", None) is not None:
        loader._iterator._shutdown_workers()
    del loader
    sys.exc_info()  # nothing held
    gc.collect()
    deadline = time.monotonic() + 5
    while loader_kids(os.getpid()) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.2)
    send("children", loader_kids(os.getpid()))


# -- the parent ------------------------------------------------------------------------------

def processes(field: int, value: int) -> list[int]:
    """Live processes whose ``/proc/<pid>/stat`` field ``field`` (after the name: 0 state,
    1 parent pid, 2 process group) is ``value``."""
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[field]) == value and fields[0] != "Z":
                    out.append(int(p))
            except (OSError, ValueError):
                pass
    return out


def kids(parent: int) -> list[int]:
    return processes(1, parent)


def group(pgid: int) -> list[int]:
    return processes(2, pgid)


HELPERS = ("resource_tracker", "forkserver")  # multiprocessing's own, for the process's life


def loader_kids(parent: int) -> list[int]:
    """Children of ``parent`` but multiprocessing's helper processes (resource tracker,
    forkserver), which spawn / forkserver start once and keep for the process's life."""
    out = []
    for pid in kids(parent):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if any(h.encode() in f.read() for h in HELPERS):
                    continue
        except OSError:
            continue
        out.append(pid)
    return out


def shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith((NAME_PREFIX, "torch_"))}


def alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def run(case: Case, cls: type, nw: int, pw: bool) -> dict:
    before_shm = shm_names()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 0
        try:
            child(case, cls, nw, pw, w)
        except BaseException:
            code = 70
        os.close(w)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    os.close(w)
    t0 = time.monotonic()
    res: dict = {"before": [], "cont": [], "again": [], "hang": False, "before_errors": [],
                 "cont_errors": [], "again_errors": []}
    buf = b""
    while True:
        left = case.hard_s - (time.monotonic() - t0)
        if left <= 0:
            res["hang"] = True
            try:
                os.kill(pid, signal.SIGUSR1)
                time.sleep(1)
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
            break
        ready, _, _ = select.select([r], [], [], left)
        if not ready:
            continue
        data = os.read(r, 1 << 20)
        if not data:
            break
        buf += data
        while len(buf) >= 4:
            (n,) = struct.unpack("I", buf[:4])
            if len(buf) < 4 + n:
                break
            key, value = pickle.loads(buf[4:4 + n])
            buf = buf[4 + n:]
            if key in ("before", "cont", "again") or key.endswith("_errors"):
                res[key].append(value)
            else:
                res[key] = value
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        res["died"] = signal.Signals(os.WTERMSIG(status)).name
    elif os.WEXITSTATUS(status) not in (0,):
        res["died"] = f"exit {os.WEXITSTATUS(status)}"
    res.setdefault("wall", time.monotonic() - t0)
    deadline = time.monotonic() + 3
    while group(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    res["orphans"] = group(pid)
    for orphan in res["orphans"]:  # not left running for the next case
        os.kill(orphan, signal.SIGKILL)
    new = shm_names() - before_shm
    res["shm"] = sorted(n for n in new if not any(alive(int(p)) and int(p) != pid
                                                 for p in re.findall(r"_(\d+)_", n)[:1]))
    res["total"] = time.monotonic() - t0
    res["before_error"] = res["before_errors"][0] if res["before_errors"] else None
    return res


# -- comparing -------------------------------------------------------------------------------

def first_line(msg: str) -> str:
    lines = [x for x in msg.splitlines() if x.strip()]
    return (lines[0] if lines else "")[:160]


def error_text(res: dict) -> str:
    """The message without the worker traceback's frames (its header and its last lines)."""
    e = res.get("before_error") or {}
    head, _, trace = e.get("msg", "").partition("Original Traceback (most recent call last):")
    lines = trace.splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith(" ")]
    return head + "\n".join(lines[frames[-1] + 1:] if frames else lines)


def same_class(t: dict | None, a: dict | None) -> bool:
    if not t or not a:
        return t == a
    return t["cls"] == a["cls"] or t["cls"] in a["mro"]


def same_classes(t: list, a: list) -> bool:
    return len(t) == len(a) and all(same_class(x, y) for x, y in zip(t, a))


def outcome(res: dict) -> str:
    if res.get("hang"):
        return "HANG"
    if "died" in res and not res.get("before_error"):
        return f"died({res['died']})"
    e = res.get("before_error")
    if e:
        return e["cls"].replace("builtins.", "").replace("arena_loader.errors.", "")
    if "action" in res:
        return f"ok {str(res['action'])[:40]}"
    return f"ok({len(res['before'])})"


def leftovers(res: dict) -> str:
    out = []
    if res.get("children"):
        out.append(f"children {res['children']}")
    if res.get("orphans"):
        out.append(f"orphans {res['orphans']}")
    if res.get("shm"):
        out.append(f"shm {res['shm']}")
    return "; ".join(out)


def compare(case: Case) -> None:
    if ONLY and ONLY not in case.name:
        return
    for nw, pw in case.configs:
        config = f"nw={nw}" + (" pw" if pw else "")
        t = run(case, DataLoader, nw, pw)
        a = run(case, ArenaLoader, nw, pw)
        te, ae = t.get("before_error"), a.get("before_error")
        notes = []
        if te and ae:
            cls = "same" if te["cls"] == ae["cls"] else "sub" if te["cls"] in ae["mro"] else "CLASS"
        elif te or ae or t.get("hang") or a.get("hang") or "died" in t or "died" in a:
            cls = "same" if outcome(t) == outcome(a) else "ONE-SIDED"
        else:
            cls = "same"
        text = error_text(a)
        named = all(re.search(p, text) for p in case.names) if ae and case.names else None
        fixed = bool(re.search(case.fix, text, re.I)) if ae and case.fix else None
        if named is False:
            notes.append("NO-NAME")
        if fixed is False:
            notes.append("NO-FIX")
        constructed = "construct" not in (t.get("where"), a.get("where"))
        if t.get("where") != a.get("where") and te and ae and same_class(te, ae) and \
                not (t["before"] + a["before"])[1:]:
            constructed = False  # the same error, one side earlier (construct, iter(), next())
            notes.append(f"(torch at {t.get('where')}, ours at {a.get('where')})")
        for key in ("before", "cont", "again") if constructed else ():
            if t[key] != a[key] or not same_classes(t[key + "_errors"], a[key + "_errors"]):
                if key == "before" or t[key] != a[key]:
                    notes.append(f"{key.upper()}-DIFF({len(t[key])}/{len(a[key])})")
                else:
                    notes.append(f"{key}-err-diff")
        if a.get("hang") or t.get("hang"):
            notes.append(f"phase torch {t.get('phase')} ours {a.get('phase')}")
        if t.get("action") != a.get("action"):
            notes.append("ACTION-DIFF")
        if a.get("hang"):
            notes.append("HANG")
        if leftovers(a):
            notes.append("LEAK")
        failing = [n for n in notes if not n.startswith("(")]
        verdict = ("ok" if cls in ("same", "sub") and not failing
                   else "known" if case.known else "CHECK")
        print(f"[{case.name} {config}] torch={outcome(t)} ours={outcome(a)} class={cls} "
              f"{' '.join(notes)} -> {verdict}  ({t['wall']:.1f}s/{a['wall']:.1f}s; "
              f"{t['total']:.0f}s/{a['total']:.0f}s)", flush=True)
        if te or ae:
            print(f"    torch: {first_line(te['msg']) if te else '-'}\n    ours:  "
                  f"{' '.join(text.split())[:400] if ae else '-'}", flush=True)
        for key in ("before", "cont", "again"):
            if t[key] != a[key]:
                diff = next((i for i, (x, y) in enumerate(zip(t[key], a[key])) if x != y), None)
                if diff is not None:
                    print(f"    {key}[{diff}]: torch {str(t[key][diff])[:200]}\n"
                          f"    {' ' * len(key)}      ours  {str(a[key][diff])[:200]}")
        for key in ("cont", "again"):
            if t[key] != a[key] or not same_classes(t[key + "_errors"], a[key + "_errors"]):
                print(f"    {key}: torch {len(t[key])} batches, "
                      f"{[e['cls'] for e in t[key + '_errors']]}; ours {len(a[key])}, "
                      f"{[e['cls'] for e in a[key + '_errors']]}", flush=True)
        for side, res in (("torch", t), ("ours", a)):
            if leftovers(res):
                print(f"    {side} leftovers: {leftovers(res)}", flush=True)
            if res.get("warnings"):
                print(f"    {side} warnings: {res['warnings']}", flush=True)
        ROWS.append((case.name, config, outcome(t), outcome(a), cls, " ".join(notes),
                     verdict if not case.known else f"{verdict} ({case.known})"))


def report() -> None:
    print("RESULTS")
    for row in ROWS:
        print("| " + " | ".join(row) + " |")
