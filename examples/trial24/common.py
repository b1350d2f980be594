"""trial24 harness: notebook cells run in a real IPython kernel, once with torch's DataLoader
and once with ArenaLoader, and what the cells printed compared.

A case is a list of steps (``Cell``, ``Interrupt``, ``Restart``, ``Shutdown``, ``Count``). Each
run (one loader class, one ``num_workers`` / ``persistent_workers`` config) starts a fresh
kernel with ``jupyter_client`` (the shared venv's python, ``ipykernel_launcher``), runs the
prelude (``PRELUDE``: the import line that is the only difference between the two runs, the
notebook's dataset class ``Squares`` defined in ``__main__``, and ``make()``, the loader cell's
body), then the steps. Every execution has a hard timeout (``CELL_S``): a cell that does not
finish by then is a ``HANG`` (the kernel is interrupted, then killed).

The transcript of a run is, per step, the cell's stdout and its error (class and first line,
and whether a traceback came): ``SAME`` or ``DIFF`` with the first step that differs. Besides,
per run:

- ``Count`` steps record the kernel's live children (but multiprocessing's resource tracker
  and forkserver) and its ``/dev/shm`` names (ours, ``NAME_PREFIX``, and torch's ``torch_*``
  whose creator pid is the kernel's or a child's): not compared, printed, and ``ACCUM`` when
  the last count of a case is above its first;
- ``LEAK``: at the end the notebook drops its loaders, iterators and batches (``DROP``: torch's
  persistent workers are stopped first, as in trial22), and the kernel's children still alive
  5 s later are flagged; then the kernel is shut down, and every process ever seen under it
  (a thread polls its descendants every 0.1 s) still alive 5 s after the kernel went (or after
  a ``Restart``) is flagged, and so is any new ``/dev/shm`` name of ours or torch's whose
  creator was one of them.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

from jupyter_client import KernelManager

from arena_loader._slab import NAME_PREFIX

ROOT = Path(__file__).resolve().parents[2]
PY = os.environ.get("TRIAL_PY", "/work/main/.venv/bin/python")
SITE = os.environ.get("TRIAL_SITE", "/tmp/trial24-site")
CELL_S = float(os.environ.get("TRIAL_CELL_S", 30))
ONLY = sys.argv[1] if len(sys.argv) > 1 else ""
CONFIGS = ((0, False), (2, False), (2, True))
ROWS: list[tuple] = []
IMPORTS = {"torch": "from torch.utils.data import DataLoader",
           "ours": "from arena_loader import ArenaLoader as DataLoader"}

PRELUDE = '''
import gc, os, time, torch
from torch.utils.data import Dataset
{import_line}
NW, PW = {nw}, {pw}

{squares}

def make(ds=None, seed=0, **kw):
    kw.setdefault("persistent_workers", PW)
    return DataLoader(Squares() if ds is None else ds, batch_size=4, shuffle=True,
                      generator=torch.Generator().manual_seed(seed), num_workers=NW, **kw)

def show(b):
    return f"{{b['y'].tolist()}} x={{b['x'][:, 0].tolist()}} {{b['x'].dtype}}"
'''

# the notebook's own dataset class (defined in the kernel's __main__): nbdata.py's, which the
# cases import where a module file is the point
NBDATA = (Path(__file__).resolve().parent / "nbdata.py").read_text()
SQUARES = NBDATA[NBDATA.index("class Squares"):].strip()

# the notebook drops what it holds; torch's persistent workers are stopped first (dropped,
# they take ~10 s in the collection, trial19/21); ours are only dropped, as a user's are
DROP = '''
for _name, _value in list(globals().items()):
    if isinstance(_value, DataLoader) and getattr(_value, "_iterator", None) is not None \\
            and hasattr(_value._iterator, "_shutdown_workers"):
        _value._iterator._shutdown_workers()
import types
_keep = {"In", "Out", "NW", "PW", "exit", "quit", "get_ipython", "open"}
for _name in [n for n, v in globals().items() if not n.startswith("_") and n not in _keep
              and not isinstance(v, (type, types.ModuleType, types.FunctionType))]:
    del globals()[_name]
get_ipython().run_line_magic("reset", "-f out")  # Out, _oh, _, __, ___ and the _N names
import sys; sys.last_value = sys.last_traceback = sys.last_exc = None
gc.collect()
'''

MRO = """import sys as _sys
print(*[f"{c.__module__}.{c.__qualname__}" for c in type(_sys.last_value).__mro__])"""


@dataclasses.dataclass
class Cell:
    code: str
    timeout_s: float = CELL_S


@dataclasses.dataclass
class Interrupt:
    """Run ``code``, interrupt the kernel (SIGINT to its process group, as the notebook's
    button does) ``after_s`` later, and record what the cell showed."""
    code: str
    after_s: float
    timeout_s: float = CELL_S


@dataclasses.dataclass
class Restart:
    pass


@dataclasses.dataclass
class Shutdown:
    pass


@dataclasses.dataclass
class Count:
    tag: str
    wait_s: float = 0.0


@dataclasses.dataclass
class Case:
    name: str
    steps: list
    configs: tuple = CONFIGS
    known: str = ""
    unordered: bool = False  # stdout compared as a sorted list of tokens (workers' prints)


# -- processes and /dev/shm ------------------------------------------------------------------

def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def descendants(root: int) -> set[int]:
    parents: dict[int, list[int]] = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            fields = _stat(int(p))
            if fields and fields[0] != "Z":
                parents.setdefault(int(fields[1]), []).append(int(p))
    out, todo = set(), [root]
    while todo:
        for kid in parents.get(todo.pop(), []):
            out.add(kid)
            todo.append(kid)
    return out


HELPERS = (b"resource_tracker", b"forkserver")


def loader_kids(kernel: int) -> list[int]:
    """The kernel's live children but multiprocessing's helper processes."""
    out = []
    for pid in sorted(descendants(kernel)):
        fields = _stat(pid)
        if not fields or int(fields[1]) != kernel:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            if any(h in cmdline for h in HELPERS):
                continue
        except OSError:
            continue
        out.append(pid)
    return out


def shm_of(pids: set[int]) -> list[str]:
    out = []
    for name in os.listdir("/dev/shm"):
        if name.startswith((NAME_PREFIX, "torch_")):
            found = re.findall(r"_(\d+)_", name)
            if found and int(found[0]) in pids:
                out.append(name)
    return sorted(out)


class Kernel:
    """One IPython kernel; a thread records every process ever seen under it."""

    def __init__(self):
        here = Path(__file__).resolve().parent  # nbdata.py: the dataset as a module file
        env = dict(os.environ, PYTHONPATH=f"{ROOT}:{SITE}:{here}", PYTHONWARNINGS="ignore")
        self.km = KernelManager(kernel_cmd=[PY, "-m", "ipykernel_launcher", "-f",
                                            "{connection_file}"])
        self.log = open(os.environ.get("TRIAL_LOG", "/tmp/trial24-kernel.log"), "ab")
        self.km.start_kernel(env=env, stdout=self.log, stderr=self.log)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
        self.seen: set[int] = set()
        self.kernels: list[int] = []
        self.stop = threading.Event()
        self.track(self.km.provisioner.pid)
        threading.Thread(target=self._poll, daemon=True).start()

    def track(self, pid: int) -> None:
        self.pid = pid
        self.kernels.append(pid)
        self.seen.add(pid)

    def _poll(self) -> None:
        while not self.stop.is_set():
            for pid in list(self.kernels):
                self.seen |= descendants(pid)
            time.sleep(0.1)

    def execute(self, code: str, timeout_s: float, interrupt_after_s: float | None = None
                ) -> dict:
        """What the cell showed: stdout, display data, the error; ``hang`` past the timeout."""
        out: dict = {"stdout": "", "display": [], "error": None, "hang": False}
        msg_id = self.kc.execute(code)
        t0 = time.monotonic()
        interrupted = interrupt_after_s is None
        while True:
            if not interrupted and time.monotonic() - t0 >= interrupt_after_s:
                self.km.interrupt_kernel()
                interrupted = True
            left = timeout_s - (time.monotonic() - t0)
            if left <= 0:
                out["hang"] = True
                self.km.interrupt_kernel()  # the stuck cell's stack, then a new kernel
                break
            wait = left if interrupted else max(0.005, interrupt_after_s - (time.monotonic() - t0))
            try:
                msg = self.kc.get_iopub_msg(timeout=min(wait, 1.0))
            except Exception:  # queue.Empty
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream" and content["name"] == "stdout":
                out["stdout"] += content["text"]
            elif kind == "stream":
                out.setdefault("stderr", "")
                out["stderr"] += content["text"]
            elif kind in ("display_data", "execute_result"):
                out["display"].append(sorted(content["data"]))
                out["stdout"] += content["data"].get("text/plain", "") + "\n"
            elif kind == "error":
                tb = "\n".join(content.get("traceback", []))
                out["error"] = {"ename": content["ename"],
                                "evalue": (content["evalue"].splitlines() or [""])[0][:200],
                                "traceback": bool(tb), "tb": strip_ansi(tb), "mro": []}
            elif kind == "status" and content["execution_state"] == "idle":
                break
        out["wall"] = time.monotonic() - t0
        if out["error"] and not out["hang"]:
            out["error"]["mro"] = self.mro()
        return out

    def mro(self) -> list[str]:
        """The classes of the cell's exception (IPython keeps it in ``sys.last_value``)."""
        shown = self.execute(MRO, 10)
        return shown["stdout"].split()

    def restart(self) -> None:
        self.km.restart_kernel(now=True)
        self.kc.wait_for_ready(timeout=60)
        self.track(self.km.provisioner.pid)

    def shutdown(self) -> None:
        if self.km.is_alive():
            self.km.shutdown_kernel(now=True)
        self.kc.stop_channels()


def strip_ansi(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


# -- one run ---------------------------------------------------------------------------------

def run(case: Case, which: str, nw: int, pw: bool) -> dict:
    t0 = time.monotonic()
    kernel = Kernel()
    res: dict = {"steps": [], "counts": [], "hang": False, "leak": []}
    prelude = PRELUDE.format(import_line=IMPORTS[which], nw=nw, pw=pw, squares=SQUARES)
    first = kernel.execute(prelude, 60)
    assert first["error"] is None, first
    old_kernels: list[int] = []
    try:
        for step in case.steps:
            if isinstance(step, (Cell, Interrupt)):
                after = step.after_s if isinstance(step, Interrupt) else None
                out = kernel.execute(step.code, step.timeout_s, after)
                res["steps"].append(out)
                if out["hang"]:
                    res["hang"] = True
                    break
            elif isinstance(step, Count):
                time.sleep(step.wait_s)
                res["counts"].append((step.tag, len(loader_kids(kernel.pid)),
                                      len(shm_of(kernel.seen))))
            elif isinstance(step, Restart):
                old_kernels.append(kernel.pid)
                kernel.restart()
                kernel.execute(prelude, 60)
                res["steps"].append({"stdout": "(restarted)", "error": None, "hang": False})
            elif isinstance(step, Shutdown):
                break
        if not res["hang"] and not isinstance(case.steps[-1], Shutdown):
            kernel.execute(DROP, CELL_S)
            deadline = time.monotonic() + 5
            while loader_kids(kernel.pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if loader_kids(kernel.pid):
                res["leak"].append(f"children 5 s after the drop "
                                   f"{cmdlines(loader_kids(kernel.pid))}")
    finally:
        old_kernels.append(kernel.pid)
        seen_before = set(kernel.seen)
        kernel.shutdown()
        kernel.stop.set()
    deadline = time.monotonic() + 5
    left = [p for p in kernel.seen if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [p for p in kernel.seen if alive(p)]
    if left:
        res["leak"].append(f"alive 5 s after the kernel went: {cmdlines(left)}")
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    shm = shm_of(seen_before | kernel.seen)
    if shm:
        res["leak"].append(f"shm {shm}")
    res["wall"] = time.monotonic() - t0
    return res


def cmdlines(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                words = f.read().split(b"\0")
            out.append(f"{pid}:{b' '.join(words).decode()[:60]}")
        except OSError:
            out.append(str(pid))
    return out


# -- comparing -------------------------------------------------------------------------------

def same_step(t: dict, a: dict, unordered: bool = False) -> bool:
    """The same stdout, and the same error class (torch's, or a subclass of it in ours)."""
    te, ae = t.get("error"), a.get("error")
    if (te is None) != (ae is None) or t.get("hang") != a.get("hang"):
        return False
    if te and (not (te["ename"] == ae["ename"] or (te["mro"] and te["mro"][0] in ae["mro"]))
               or te["traceback"] != ae["traceback"]):
        return False
    texts = [normal(x.get("stdout", "")) for x in (t, a)]
    if unordered:  # two processes' lines may interleave mid-line ("load 3load 2")
        texts = [sorted(re.findall(r"\d+|[^\W\d]+|[^\w\s]", x)) for x in texts]
    return texts[0] == texts[1]


def normal(text: str) -> str:
    """Durations (``%time``, ``%timeit``) and object addresses masked; an iterator's repr
    without its class (torch's ``_MultiProcessingDataLoaderIter``, ours)."""
    text = re.sub(r"[0-9.]+ ?(ns|µs|μs|us|ms|s|min)\b", "<t>", text)
    return re.sub(r"<[\w.]+ (object )?at 0x[0-9a-f]+>", "<object>", text)


def short(step: dict | None) -> str:
    if step is None:
        return "(nothing)"
    text = step.get("stdout", "").strip().replace("\n", " | ")[:230]
    e = step.get("error")
    if e:
        text += f" !! {e['ename']}: {e['evalue'][:160]}"
    return text + (" HANG" if step.get("hang") else "")


def summary(res: dict) -> str:
    errors = [s["error"]["ename"] for s in res["steps"] if s.get("error")]
    text = f"{len(res['steps'])} cells" + (f", {'/'.join(errors)}" if errors else "")
    return text + (" HANG" if res["hang"] else "")


def counts_text(res: dict) -> str:
    return " ".join(f"{tag}:{kids}p/{shm}s" for tag, kids, shm in res["counts"])


def accumulates(res: dict) -> bool:
    counts = res["counts"]
    return len(counts) > 1 and (counts[-1][1] > counts[0][1] or counts[-1][2] > counts[0][2])


def compare(case: Case) -> None:
    if ONLY and ONLY not in case.name:
        return
    for nw, pw in case.configs:
        config = f"nw={nw}" + (" pw" if pw else "")
        t = run(case, "torch", nw, pw)
        a = run(case, "ours", nw, pw)
        ts, as_ = t["steps"], a["steps"]
        diff = next((i for i, (x, y) in enumerate(zip(ts, as_))
                     if not same_step(x, y, case.unordered)),
                    None if len(ts) == len(as_) else min(len(ts), len(as_)))
        verdict = "SAME" if diff is None and not (t["hang"] or a["hang"]) else "DIFF"
        flags = []
        if a["hang"]:
            flags.append("HANG")
        if t["hang"]:
            flags.append("torch-hang")
        if a["leak"]:
            flags.append(f"LEAK({'; '.join(a['leak'])})")
        if t["leak"]:
            flags.append(f"torch-leak({'; '.join(t['leak'])})")
        if accumulates(a):
            flags.append("ACCUM")
        if accumulates(t):
            flags.append("torch-accum")
        print(f"[{case.name} {config}] {verdict} torch={summary(t)} ours={summary(a)} "
              f"{' '.join(flags)} ({t['wall']:.1f}s/{a['wall']:.1f}s)", flush=True)
        if t["counts"] or a["counts"]:
            print(f"    counts torch {counts_text(t)}\n    counts ours  {counts_text(a)}")
        if diff is not None:
            print(f"    cell {diff}: torch {short(ts[diff] if diff < len(ts) else None)}\n"
                  f"    {' ' * len(str(diff))}      ours  "
                  f"{short(as_[diff] if diff < len(as_) else None)}", flush=True)
        for side, res in (("torch", t), ("ours", a)):
            for i, s in enumerate(res["steps"]):
                if s.get("error"):
                    print(f"    {side} cell {i} ({s.get('wall', 0):.1f} s) "
                          f"{s['error']['ename']}: {s['error']['evalue']}")
                if s.get("error") and os.environ.get("TRIAL_TB"):
                    print(f"    {side} cell {i} traceback:\n{s['error']['tb'][-1500:]}")
        flag_names = " ".join(f.split("(")[0] for f in flags)
        ROWS.append((case.name, config, summary(t), summary(a),
                     f"{t['wall']:.1f} / {a['wall']:.1f}",
                     (verdict + (" " + flag_names if flag_names else ""))
                     + (f" ({case.known})" if case.known else "")))


def main(cases: list[Case]) -> None:
    for case in filter(lambda c: not ONLY or ONLY in c.name, cases):
        compare(case)
    print("RESULTS", *("| " + " | ".join(row) + " |" for row in ROWS), sep="\n")
