"""trial20 harness: DDP training (gloo, CPU) over two ranks with torch's DataLoader and with
ArenaLoader, switched by one import, and what a user would notice compared per rank: every
batch (structure, types, values, order), each step's loss, the final weights, errors, and
leftovers (processes started by the run, /dev/shm names with the loader's prefix).

Two halves: the driver (``launch``: starts ``torchrun --nproc_per_node 2`` on a rank script,
then looks for leftovers) and the rank side (``init``, ``train``, ``dump``), which every rank
script imports. A rank writes its results as JSON to ``$TRIAL20_OUT/<name>.rank<r>.json``.
"""

from __future__ import annotations

import faulthandler
import gc
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import psutil
import torch
from torch.utils.data import Dataset, Sampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from arena_loader._slab import NAME_PREFIX

# trial19's harness (its model, tally, first difference and process filter), loaded from
# there, not copied, as trial15 loads trial14's.
_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "trial19", "common.py")
_spec = importlib.util.spec_from_file_location("trial19_common", _path)
trial19 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trial19)
first_difference, model, ours = trial19.first_difference, trial19.model, trial19.ours

faulthandler.dump_traceback_later(float(os.environ.get("TRIAL_TIMEOUT", 300)), exit=True)
warnings.filterwarnings("ignore", message=".*pin_memory.*")
HERE = os.path.dirname(os.path.abspath(__file__))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
SEED = 1234
ONLY = sys.argv[1] if len(sys.argv) > 1 else ""
N = 21  # samples: odd, so two ranks pad (drop_last=False) or cut (drop_last=True)
EPOCHS = 2


def wants(name: str) -> bool:
    return ONLY in name


# --- the user's code ---------------------------------------------------------------------------
class Tensors(Dataset):
    """Sample ``i``: ``{"i": tensor(i), "x": 4 floats from i, "y": class}``. ``fail_at``:
    ``__getitem__`` raises ValueError for that index on rank ``fail_rank``. ``slow_flag``: each
    sample takes a second once that file exists."""

    def __init__(self, n: int = N, fail_at: int | None = None, fail_rank: int = 1,
                 slow_flag: str | None = None):
        self.n, self.fail_at, self.fail_rank = n, fail_at, fail_rank
        self.slow_flag = slow_flag

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        i = int(i)
        if i == self.fail_at and int(os.environ.get("RANK", "0")) == self.fail_rank:
            raise ValueError(f"corrupt record {i}")
        if self.slow_flag and os.path.exists(self.slow_flag):
            if int(os.environ.get("RANK", "0")) == 1:
                with open(self.slow_flag + ".rank1", "w"):
                    pass  # (the driver's cue: rank 1 waits for this sample now)
            time.sleep(1)  # (a slow disk from now on: Ctrl-C lands while next() waits)
        x = torch.tensor([i / self.n, (i % 7) / 7, (i % 3) / 3, 1.0])
        return {"i": torch.tensor(i), "x": x, "y": torch.tensor(i % 3)}


class PerRank(Sampler):
    """A rank-dependent share of unequal length (DDP ``join()`` territory): rank ``r`` takes
    ``counts[r]`` indices, every ``world``-th from ``r``, shuffled per epoch by seed + epoch."""

    def __init__(self, counts: list[int], rank: int, world: int, seed: int = 0):
        self.counts, self.rank, self.world, self.seed, self.epoch = counts, rank, world, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        mine = list(range(self.rank, self.world * max(self.counts), self.world))
        mine = mine[:self.counts[self.rank]]
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter([mine[j] for j in torch.randperm(len(mine), generator=g).tolist()])

    def __len__(self) -> int:
        return self.counts[self.rank]


def describe(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return ["tensor", str(batch.dtype), batch.tolist()]
    if isinstance(batch, dict):
        return {k: describe(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return [type(batch).__name__, [describe(v) for v in batch]]
    return [type(batch).__name__, repr(batch)]


def loader_class(kind: str):
    if kind == "torch":
        from torch.utils.data import DataLoader
    elif kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader as DataLoader
    else:
        from arena_loader import ArenaLoader as DataLoader
    return DataLoader


def sampler_class(kind: str):
    if kind == "torch":
        from torch.utils.data import DistributedSampler
    elif kind == "stateful":
        from torchdata.stateful_dataloader.sampler import (
            StatefulDistributedSampler as DistributedSampler,
        )
    else:
        from arena_loader.samplers import DistributedSampler
    return DistributedSampler


# --- rank side ---------------------------------------------------------------------------------
def init() -> tuple[int, int]:
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def train(loader, sampler, epochs: int = EPOCHS, net=None, opt=None, start_epoch: int = 0,
          stop_after: int | None = None, join: bool = False,
          on_step: Callable[[int], None] | None = None) -> dict[str, Any]:
    """The user's DDP loop: ``set_epoch`` each epoch, SGD on cross-entropy. Batches and
    losses per epoch; ``stop_after`` steps ends it early (a checkpoint's point)."""
    from torch.nn.parallel import DistributedDataParallel
    if net is None:
        net = DistributedDataParallel(model())
        opt = torch.optim.SGD(net.parameters(), lr=0.5)
    out: dict[str, Any] = {"batches": [], "losses": []}
    step = 0
    for epoch in range(start_epoch, epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        batches, losses = [], []
        ctx = net.join() if join else _Null()
        with ctx:
            for batch in loader:
                batches.append(describe(batch))
                loss = torch.nn.functional.cross_entropy(net(batch["x"]), batch["y"])
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(round(float(loss), 6))
                step += 1
                if on_step is not None:
                    on_step(step)
                if stop_after is not None and step == stop_after:
                    break
        out["batches"].append(batches)
        out["losses"].append(losses)
        if stop_after is not None and step == stop_after:
            break
    out["weights"] = [p.detach().tolist() for p in net.module.parameters()]
    out["net"], out["opt"] = net, opt
    return out


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def shm_names(pids: set[int] | None = None) -> set[str]:
    names = {n for n in os.listdir("/dev/shm") if n.startswith(NAME_PREFIX)}
    if pids is None:
        return names
    return {n for n in names if int(n[len(NAME_PREFIX):].split("_")[0]) in pids}


def rank_leftovers(seconds: float = 5.0) -> list[str]:
    """This rank's children and /dev/shm names of this rank or its children, polled after a
    collection until none is left or ``seconds`` pass."""
    found: list[str] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        gc.collect()
        kids = {p.pid for p in psutil.Process().children(recursive=True) if ours(p)}
        names = sorted(shm_names(kids | {os.getpid()}))
        found = [f"children {sorted(kids)}"] * bool(kids) + [f"/dev/shm {names}"] * bool(names)
        if not found:
            break
        time.sleep(0.05)
    return found


def dump(name: str, rank: int, result: Any) -> None:
    path = os.path.join(os.environ["TRIAL20_OUT"], f"{name}.rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


def mark(name: str, rank: int, what: str) -> None:
    """A progress mark the driver waits for (to signal a run mid-epoch)."""
    with open(os.path.join(os.environ["TRIAL20_OUT"], f"{name}.rank{rank}.{what}"), "w"):
        pass


def rank_cases(tag: str, cases, one: Callable[[str, dict, int], dict]) -> None:
    """A rank's side of a matrix script: ``one(kind, cfg, rank)`` (kind "torch", then
    "arena") for each case, its error if it raises, then this rank's leftovers once the
    loader is gone; all dumped as ``tag``."""
    rank, _ = init()
    results: dict[str, Any] = {}
    for name, cfg in cases:
        if ONLY not in name:
            continue
        results[name] = {}
        for kind in ("torch", "arena"):
            try:
                got = public(one(kind, cfg, rank))
            except Exception as exc:
                got = {"error": f"{type(exc).__name__}: {exc}"}
            gc.collect()
            got["leftovers"] = rank_leftovers()
            results[name][kind] = got
    dump(tag, rank, results)


def compare_cases(script: str, tag: str, cases, note: Callable[[dict], str]) -> None:
    """The driver's side: one torchrun run of ``script``, then per case and rank torch's
    result against ArenaLoader's (``note``: what to print beside the verdict), and the
    leftovers of each loader and of the run."""
    tally = Tally()
    run = launch(script, ONLY, timeout=280)
    if run.rc != 0:
        tally.add("ERROR", "torchrun", f"rc={run.rc} {run.err[-2000:]}")
    tally.leaks("torchrun", run.leftovers)
    per_rank = [run.result(tag, r) or {} for r in range(2)]
    for name, _ in cases:
        if ONLY not in name:
            continue
        for rank in range(2):
            got = per_rank[rank].get(name)
            if got is None:
                tally.add("ERROR", f"{name} rank{rank}", "no result")
                continue
            torch_, arena = got["torch"], got["arena"]
            tally.leaks(f"{name} rank{rank} torch", torch_.pop("leftovers"))
            tally.leaks(f"{name} rank{rank} arena", arena.pop("leftovers"))
            tally.check(f"{name} rank{rank}", torch_, arena, note(torch_))
    tally.done()


# --- driver side -------------------------------------------------------------------------------
def tagged(tag: str) -> set[int]:
    """Live processes whose environment carries ``tag`` (every process a run started)."""
    found = set()
    for pid in psutil.pids():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if tag.encode() in f.read():
                    found.add(pid)
        except OSError:
            pass
    return found


class Run:
    def __init__(self, rc: int, out: str, err: str, outdir: str, leftovers: list[str],
                 seconds: float):
        self.rc, self.out, self.err, self.outdir = rc, out, err, outdir
        self.leftovers, self.seconds = leftovers, seconds

    def result(self, name: str, rank: int) -> Any:
        path = os.path.join(self.outdir, f"{name}.rank{rank}.json")
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return json.load(f)


def launch(script: str, *args: str, outdir: str | None = None, timeout: float = 120,
           interrupt_when: str | None = None, interrupt: int = signal.SIGINT,
           env: dict[str, str] | None = None, argv: list[str] | None = None,
           group: bool = True, torchrun_args: list[str] = ()) -> Run:
    """``torchrun --standalone --nproc_per_node 2 script args`` in its own session, every
    process of it tagged by an environment variable. ``interrupt_when``: a mark file name
    (``mark``) after which ``interrupt`` goes to the whole process group (Ctrl-C in a
    terminal), or with ``group=False`` to torchrun alone. Afterwards: tagged processes
    still alive, and /dev/shm names of any pid the run had (polled while it ran), as
    leftovers, polled for 10 s."""
    tag = f"TRIAL20_TAG_{uuid.uuid4().hex}"
    outdir = outdir or tempfile.mkdtemp(prefix="trial20_")
    environ = {**os.environ, "TRIAL20_OUT": outdir, tag: "1", **(env or {})}
    command = argv or [TORCHRUN, "--standalone", "--nproc_per_node", "2", *torchrun_args,
                       os.path.join(HERE, script), *args]
    started = time.monotonic()
    proc = subprocess.Popen(command, env=environ, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    pids: set[int] = {proc.pid}
    sent = False
    out_f, err_f = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    import threading

    def pump(src, dst):
        for line in src:
            dst.write(line)
    threads = [threading.Thread(target=pump, args=(proc.stdout, out_f), daemon=True),
               threading.Thread(target=pump, args=(proc.stderr, err_f), daemon=True)]
    for t in threads:
        t.start()
    while proc.poll() is None:
        pids |= tagged(tag)
        if interrupt_when and not sent and os.path.exists(os.path.join(outdir,
                                                                       interrupt_when)):
            time.sleep(0.1)
            (os.killpg if group else os.kill)(proc.pid, interrupt)
            sent = True
        if time.monotonic() - started > timeout:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            break
        time.sleep(0.1)
    for t in threads:
        t.join(5)
    seconds = time.monotonic() - started
    # Other sessions' test suites on this machine unlink every name with our prefix they
    # see after a second, so a name is looked for at once and remembered once seen.
    found: list[str] = []
    names: set[str] = set()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = sorted(tagged(tag))
        names |= shm_names(pids | set(alive))
        found = [f"processes {[describe_proc(p) for p in alive]}"] * bool(alive)
        if not found:
            break
        time.sleep(0.2)
    found += [f"/dev/shm {sorted(names)}"] * bool(names)
    for pid in tagged(tag):  # don't leave them to the next case
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    out_f.seek(0)
    err_f.seek(0)
    return Run(proc.returncode, out_f.read(), err_f.read(), outdir, found, seconds)


def describe_proc(pid: int) -> str:
    try:
        p = psutil.Process(pid)
        return f"{pid}:{' '.join(p.cmdline())[-60:]}"
    except psutil.Error:
        return str(pid)


# --- tally -------------------------------------------------------------------------------------
class Tally(trial19.Tally):
    """trial19's tally (counts, lines, RESULTS), with this trial's verdicts: SAME or DIFF,
    leftovers counted apart (``leaks``)."""

    def check(self, name: str, want: Any, got: Any, note: str = "") -> bool:  # type: ignore[override]
        if want == got:
            self.add("SAME", name, note)
            return True
        self.add("DIFF", name, first_difference(want, got))
        return False

    def leaks(self, name: str, found: list[str]) -> None:
        for f in found:
            self.add("LEAK", name, f)


def public(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k not in ("net", "opt")}


def leftovers_here(seconds: float = 5.0) -> list[str]:
    """This process's children (not a forkserver or resource tracker) and /dev/shm names of
    this process or its children, polled after a collection."""
    return rank_leftovers(seconds)
