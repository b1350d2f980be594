"""Measure one loader on one workload for one round: a warm-up epoch, then whole epochs for
at least a time and a batch count (a ``Budget``), CPU per GB, and peak memory sampled by a
background thread. The CLI runs every case of a workload once per round, in a rotated
order, and reports medians over rounds (``CaseResult``)."""

from __future__ import annotations

import gc
import importlib.metadata
import json
import os
import platform
import signal
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import numpy as np
import psutil

SHM_DIR = "/dev/shm"
SAMPLE_INTERVAL_S = 0.01
CHILDREN_EVERY = 10  # samples: psutil lists children by scanning /proc
PSS_EVERY = 5  # samples: the shortest interval between proportional samples
# A proportional sample walks the page tables of every process (smaps_rollup): in the full
# bench, whose process holds every workload's data (~700 MB), the walks took 20% of a core
# at one per 50 ms, taken from the loader measured (tiny: 11.2k batches/s against 14.7k in a
# bench process of one workload; docs/benchmarks.md, "Engine v3, sixth stage"). So the next
# one waits until the sampler's walks stay within this share of one core, up to the longest
# interval.
PSS_DUTY = 0.03
PSS_MAX_INTERVAL_S = 0.25
LIBRARIES = ("arena-loader", "numpy", "torch", "spdl", "grain", "torchdata", "pillow",
             "posix_ipc", "numba", "psutil", "matplotlib")

# Every metric a measured case reports (the JSON test checks each one is present).
METRICS = ("steady_gbps", "steady_batches_per_s", "first_epoch_s", "first_batch_s",
           "cpu_s_per_gb", "peak_rss_main_mb", "peak_rss_workers_mb", "peak_shm_mb",
           "peak_memory_mb", "peak_added_mb", "others_cores", "sampler_cores")


def environment() -> dict[str, Any]:
    """The machine and library versions the figures were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            names = [line.split(":", 1)[1].strip() for line in info
                     if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    shm = os.statvfs(SHM_DIR)
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return {
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": cpu,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "dev_shm_gib": round(shm.f_blocks * shm.f_frsize / 2**30, 1),
        "dev_shm_huge": shm_huge_pages(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": versions,
    }


def shm_huge_pages(mounts: str = "/proc/mounts") -> str:
    """The ``huge=`` option /dev/shm is mounted with ("never" when absent, the default): the
    slab gets 2 MB pages only with ``within_size`` or ``always`` (its slots are reserved with
    ``posix_fallocate``, which ``advise`` serves with 4 KB pages), and copies rows into
    them ~1.25x as fast (docs/design.md, "Known limits"); "unknown" without /proc/mounts."""
    try:
        with open(mounts) as table:
            lines = table.read().splitlines()
    except OSError:
        return "unknown"
    for line in reversed(lines):  # the last mount on a path is the one in effect
        fields = line.split()
        if len(fields) >= 4 and fields[1] == SHM_DIR:
            options = dict(option.partition("=")[::2] for option in fields[3].split(","))
            return options.get("huge", "never")
    return "unknown"


ANON_SHARED = "/dev/zero (deleted)"  # how /proc/<pid>/maps names a MAP_SHARED|MAP_ANONYMOUS map


def shm_objects(pid: int) -> dict[int | tuple[str, int], int]:
    """Bytes of each /dev/shm object ``pid`` maps or holds open (unlinked ones too, as
    torch's are), keyed by inode, and of each anonymous shared mapping (``mmap(-1, n)``: the
    floor's slab, the copy limit's shared ring; memory that is neither private nor under
    /dev/shm, which smaps_rollup's ``Pss_Anon`` leaves out), keyed by ``("anon", inode)``:
    shared memory that this run's processes hold, whatever other programs on the machine do
    with /dev/shm. An object's bytes are the pages it has
    (``st_blocks``, what ``df /dev/shm`` counts), not the size mapped: a slab whose slots are
    reserved as they are first used holds only those (read through ``/proc/<pid>/map_files``;
    where that cannot be read, the size mapped; a mapping of a process exiting meanwhile is
    left out: its objects count through whoever still holds them). Objects held by a file
    descriptor only count too: a batch torch's worker has put in its queue is an fd that the
    worker keeps (multiprocessing's resource sharer) until the main process takes the batch,
    mapped by no process meanwhile; counting mappings alone left out 38.5 of torch's 48 MB of
    image batches with a consumer slower than its workers (docs/benchmarks.md, "Shared
    memory held by a file descriptor")."""
    sizes: dict[int | tuple[str, int], int] = {}
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            if SHM_DIR + "/" not in line and ANON_SHARED not in line:
                continue
            parts = line.split(maxsplit=5)
            if len(parts) < 6:
                continue
            name = parts[5].rstrip("\n")
            if name == ANON_SHARED:
                inode: int | tuple[str, int] = ("anon", int(parts[4]))
            elif name.startswith(SHM_DIR + "/"):
                inode = int(parts[4])
            else:
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            try:
                nbytes = os.stat(f"/proc/{pid}/map_files/{parts[0]}").st_blocks * 512
            except (ProcessLookupError, FileNotFoundError):
                # The process is exiting (a loader's close) or unmapped it since: going. At
                # the size mapped, a slab with 4 of 5 slots reserved read as 5 (mem26).
                continue
            except OSError:
                nbytes = sizes.get(inode, 0) + end - start
            sizes[inode] = nbytes
    fds = f"/proc/{pid}/fd"
    for fd in os.listdir(fds):
        try:
            if not os.readlink(f"{fds}/{fd}").startswith(SHM_DIR + "/"):
                continue
            stat = os.stat(f"{fds}/{fd}")
        except OSError:
            continue  # closed between listing and reading
        sizes.setdefault(stat.st_ino, stat.st_blocks * 512)
    return sizes


def proportional_bytes(pid: int) -> int:
    """Pss_Anon + Pss_File of ``pid``: its memory with each page shared by k processes
    counted 1/k (so fork-shared pages and libraries are not counted once per worker);
    shared memory (Pss_Shmem) is left out and counted once from /dev/shm instead."""
    total = 0
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith(("Pss_Anon:", "Pss_File:")):
                total += int(line.split()[1]) * 1024
    return total


class MemorySampler:
    """A daemon thread that keeps peaks of the RSS of this process and the summed RSS of its
    descendants (every 10 ms, from statm), and every 50 ms (smaps_rollup and maps cost
    ~1 ms a process) of: the /dev/shm objects those processes map or hold open (each counted
    once), and ``peak_memory``, their proportional set sizes plus that shared memory at the same
    instant, so memory shared by several processes is counted once. ``also``: more
    processes whose proportional memory counts in ``peak_memory`` (the bench process a
    case was forked from, which shares its pages with the case's processes)."""

    def __init__(self, also: tuple[int, ...] = ()) -> None:
        self._me = psutil.Process()
        self._also = also
        self.peak_main = self.peak_workers = self.peak_shm = self.peak_memory = 0
        self.cores = 0.0  # the sampler thread's own CPU, in cores: what it took from the case
        # The proportional memory before the loader was built: what peak_added_mb leaves
        # out (the program's own, the same for every loader).
        self.baseline = sum(proportional_bytes(pid) for pid in (os.getpid(), *also))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-memory-sampler",
                                        daemon=True)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        children: list[psutil.Process] = []
        ticks = 0
        next_proportional = 0.0
        start_cpu, start = time.thread_time(), time.monotonic()
        while not self._stop.wait(SAMPLE_INTERVAL_S):
            if ticks % CHILDREN_EVERY == 0:
                children = self._me.children(recursive=True)
            now = time.monotonic()
            proportional = now >= next_proportional
            self.sample(children, proportional=proportional)
            if proportional:
                next_proportional = now + pss_interval_s(time.monotonic() - now)
            ticks += 1
            self.cores = (time.thread_time() - start_cpu) / max(time.monotonic() - start, 1e-9)

    def sample_now(self) -> None:
        """One full sample from the caller's thread (cases shorter than the interval)."""
        self.sample(self._me.children(recursive=True), proportional=True)

    def sample(self, children: list[psutil.Process], proportional: bool) -> None:
        workers = 0
        for child in children:
            try:
                workers += child.memory_info().rss
            except psutil.Error:
                continue
        self.peak_main = max(self.peak_main, self._me.memory_info().rss)
        self.peak_workers = max(self.peak_workers, workers)
        if not proportional:
            return
        private, shm = 0, {}
        for pid in [*self._also, self._me.pid, *(child.pid for child in children)]:
            try:
                private += proportional_bytes(pid)
                for inode, nbytes in shm_objects(pid).items():
                    shm[inode] = max(shm.get(inode, 0), nbytes)
            except (OSError, ValueError):
                continue  # the process exited between listing and reading
        shm_bytes = sum(shm.values())
        self.peak_shm = max(self.peak_shm, shm_bytes)
        self.peak_memory = max(self.peak_memory, private + shm_bytes)


def pss_interval_s(sample_s: float) -> float:
    """The wait before the next proportional sample, after one that took ``sample_s``."""
    return min(PSS_MAX_INTERVAL_S, max(PSS_EVERY * SAMPLE_INTERVAL_S, sample_s / PSS_DUTY))


# Helpers the standard library starts once per interpreter and keeps; not a loader's.
STDLIB_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def stray_processes(wait_s: float = 5.0) -> list[int]:
    """Kill the child processes a closed loader left alive after ``wait_s``; return their
    pids. A stray would be counted in every later case's memory and CPU, and outlive the
    bench."""
    me = psutil.Process()
    deadline = time.monotonic() + wait_s
    while True:
        alive = []
        for child in me.children(recursive=True):
            try:
                if child.status() == psutil.STATUS_ZOMBIE:
                    continue
                if not any(h in " ".join(child.cmdline()) for h in STDLIB_HELPERS):
                    alive.append(child)
            except psutil.Error:
                continue
        if not alive or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    for child in alive:
        try:
            child.kill()
            child.wait(timeout=5)
        except psutil.Error:
            pass
    return [child.pid for child in alive]


def cpu_seconds() -> float:
    """CPU time (user + system) of this process and its live descendants."""
    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.Error:
            continue
    return total


def tree_cpu_seconds() -> float:
    """CPU time of this process, its live descendants and the descendants they have reaped
    (a loader that restarts its workers each epoch, torchdata nodes, leaves no live trace of
    the old ones)."""
    me = psutil.Process()
    total = 0.0
    for process in (me, *me.children(recursive=True)):
        try:
            total += sum(process.cpu_times()[:4])  # user, system, reaped children's both
        except psutil.Error:
            continue
    return total


def machine_cpu_seconds() -> float:
    """CPU time every process of the machine has used (user, nice, system, irq, softirq)
    plus what the hypervisor took from this VM (steal), from /proc/stat."""
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def consume(batch: Any) -> int:
    """Bytes in ``batch``, reading one element of each array so the data must be there."""
    if isinstance(batch, dict):
        return sum(consume(value) for value in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(consume(value) for value in batch)
    array = batch.numpy() if hasattr(batch, "numpy") else np.asarray(batch)
    if array.size:
        array.reshape(-1)[-1].item()
    return int(array.nbytes)


def spread(values: list[float]) -> dict[str, Any]:
    """Median, min and max of one figure over rounds, and the per-round values."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "rounds": list(values)}


@dataclass(frozen=True)
class Budget:
    """How long one measurement runs: batches until both minimums are reached."""

    min_seconds: float = 1.0
    min_batches: int = 50


@dataclass
class CaseResult:
    """The figures of one (workload, loader, workers) case: one dict per round."""

    workload: str
    loader: str
    workers: int
    available: bool = True
    reason: str = ""
    rounds: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """Every metric as its median, min, max and per-round values."""
        out: dict[str, Any] = {"workload": self.workload, "loader": self.loader,
                               "workers": self.workers, "available": self.available,
                               "reason": self.reason}
        if self.available and self.rounds:
            first = self.rounds[0]
            out["batches_per_epoch"] = first["batches_per_epoch"]
            out["bytes_per_epoch"] = first["bytes_per_epoch"]
            for metric in (*METRICS, "epochs", "seconds"):
                out[metric] = spread([r[metric] for r in self.rounds])
            # Times a round's measurement was taken again (the CLI's disturbed ones).
            out["retries"] = spread([r.get("retries", 0) for r in self.rounds])
        return out


def measure(build: Callable[[], Any], budget: Budget,
            also: tuple[int, ...] = ()) -> dict[str, Any]:
    """One round of one case: build a loader, run one warm-up epoch (timed from
    construction: start-up included), then batches until ``budget`` is met (stopping
    mid-epoch; ``epochs`` counts the epochs begun); return every figure in ``METRICS``.
    ``also``: see ``MemorySampler``."""
    with MemorySampler(also) as memory:
        start = time.perf_counter()
        loader = build()
        try:
            first_batch_s = float("nan")
            nbytes = batches = 0
            for batch in loader:
                if batches == 0:
                    first_batch_s = time.perf_counter() - start
                nbytes += consume(batch)
                batches += 1
                del batch
            first_epoch_s = time.perf_counter() - start
            memory.sample_now()
            cpu_start = cpu_seconds()
            tree_start, machine_start = tree_cpu_seconds(), machine_cpu_seconds()
            steady_start = time.perf_counter()
            epochs = delivered = steady_bytes = 0
            done = False
            while not done:
                for batch in loader:
                    steady_bytes += consume(batch)
                    delivered += 1
                    del batch
                    seconds = time.perf_counter() - steady_start
                    if seconds >= budget.min_seconds and delivered >= budget.min_batches:
                        done = True  # mid-epoch is fine: the loader is closed next
                        break
                epochs += 1
                if not delivered:
                    raise RuntimeError("the loader's epoch after the warm-up had no batch")
            cpu_s = cpu_seconds() - cpu_start
            others_s = (machine_cpu_seconds() - machine_start) - (tree_cpu_seconds() - tree_start)
            memory.sample_now()
        finally:
            loader.close()
            del loader
            # Garbage of this case (torchdata's iterators sit in reference cycles) must not
            # reach the next case's forked workers, where its finalizers fail.
            gc.collect()
    return {
        "batches_per_epoch": batches,
        "bytes_per_epoch": nbytes,
        "epochs": epochs,
        "seconds": seconds,
        "steady_gbps": steady_bytes / seconds / 1e9,
        "steady_batches_per_s": delivered / seconds,
        "first_epoch_s": first_epoch_s,
        "first_batch_s": first_batch_s,
        "cpu_s_per_gb": cpu_s / (steady_bytes / 1e9) if steady_bytes else float("nan"),
        "peak_rss_main_mb": memory.peak_main / 1e6,
        "peak_rss_workers_mb": memory.peak_workers / 1e6,
        "peak_shm_mb": memory.peak_shm / 1e6,
        "peak_memory_mb": memory.peak_memory / 1e6,
        # What the loader adds: its workers, its shared memory and its growth of this process.
        "peak_added_mb": max(0, memory.peak_memory - memory.baseline) / 1e6,
        # Cores that other processes (and the hypervisor) took while the batches were timed:
        # ~0 when the machine was the bench's alone.
        "others_cores": max(0.0, others_s / seconds),
        "sampler_cores": memory.cores,
    }


def measure_apart(build: Callable[[], Any], budget: Budget) -> dict[str, Any]:
    """``measure()`` in a child forked for this one case, which exits after it: whatever a
    loader leaves behind in its process once closed (caches, thread pools, allocator
    arenas a peer library keeps) goes with the child, so every case starts from the same
    bench process. Measured in one process, the bench grew with every case of a round and
    never shrank (dict, round 1: +58 MB after Grain, +115 MB after torchdata nodes), and a
    case's peak memory depended on which cases ran before it (docs/benchmarks.md, "Engine v3,
    seventh stage"). The child's memory figures count this process's proportional memory
    too (it shares its pages with the child), so they are the same sum as in one process.
    Also returns, under ``"strays"``, the processes the loader left alive after close(),
    killed in the child (an orphan of an exited child would escape the parent's check).
    Where there is no fork, ``measure()`` in this process."""
    if not hasattr(os, "fork"):
        return {**measure(build, budget), "strays": stray_processes()}
    # What is alive now stays alive for the run: out of the collector's reach, a collection
    # in the child neither walks nor copies (by writing their headers) the parent's objects.
    gc.collect()
    gc.freeze()
    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: measure, report, exit without running the parent's exit code
        code = 1
        try:
            os.close(read_fd)
            try:
                out: dict[str, Any] = {"figures": measure(build, budget, also=(parent,))}
            except BaseException:  # every failure goes back to the parent
                out = {"error": traceback.format_exc()}
            strays = stray_processes()  # a failed case's too: orphans once this child exits
            if "figures" in out:
                out["figures"]["strays"] = strays
            data = json.dumps(out).encode()
            with os.fdopen(write_fd, "wb") as pipe:
                pipe.write(data)
            code = 0
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(write_fd)
    try:
        with os.fdopen(read_fd, "rb") as pipe:
            data = pipe.read()
    except BaseException:
        os.kill(pid, signal.SIGKILL)  # Ctrl-C here: the child (told too) must not outlive it
        os.waitpid(pid, 0)
        raise
    _, status = os.waitpid(pid, 0)
    if not data:
        raise RuntimeError(f"the bench's case process {pid} died without a result "
                           f"(wait status {status})")
    out = json.loads(data)
    if "error" in out:
        raise RuntimeError("the case failed in its own process:\n" + out["error"])
    return out["figures"]
