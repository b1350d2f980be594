"""Runs one fault case in a process of its own and prints what happened as one JSON line.

The fault matrix (tests/test_fault_matrix.py) and the soak test (tests/test_soak.py) start
this with ``sys.executable -m tests.fault_driver`` from the repository root, in a new session
(so a Ctrl-C sent to the process group reaches only this driver and its workers)::

    python -m tests.fault_driver matrix <fault> <num_workers> <persistent: 0|1>
    python -m tests.fault_driver capacity <num_workers>
    python -m tests.fault_driver soak <seconds>

Every case runs a clean epoch first, injects the fault in the second epoch (for persistent
workers that epoch runs on the same processes, through the reset path), then checks the
loader delivers a third, complete epoch. The driver measures from inside: when the fault
fired (a stamp the faulting worker writes into shared memory), when the main process saw it,
which worker processes were alive at that moment, and, after ``close()``, whether any child
process, ``/dev/shm`` object or slab mapping of this process is left. The caller asserts on
the report and checks the reported pids again once this process has exited.
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import json
import mmap
import os
import resource
import signal
import sys
import threading
import time
import warnings
from typing import Any

import numpy as np
import psutil

from arena_loader import ArenaLoader
from arena_loader._slab import NAME_PREFIX, SHM_DIR

from .datasets import ImageDataset, Release, make_array

SAMPLES = 24
BATCH_SIZE = 2
BATCHES = SAMPLES // BATCH_SIZE
FAULT_INDEX = 11  # in batch idx 5: worker 0 of 1, worker 2 of 3
FAULT_IDX = FAULT_INDEX // BATCH_SIZE
TIMEOUT_S = 0.3  # the loader's `timeout` in the timeout case
SLOW_S = 1.0  # how long the slow sample of the timeout and Ctrl-C cases sleeps
INTERRUPT_AFTER_S = 0.2  # Ctrl-C this long after next() starts waiting for the slow batch
GONE_WAIT_S = 5.0  # how long the driver watches for workers to exit (the tests bound it)

KINDS = ("raise", "sigkill", "segfault", "exit3", "sleep")


class FaultPlan:
    """A fault armed for one sample index, shared with the workers through an anonymous
    shared mapping (inherited across fork); it fires once, in whichever process loads that
    sample, and stamps the time and pid of the faulting process."""

    def __init__(self) -> None:
        self._mapping = mmap.mmap(-1, 64)  # MAP_SHARED: workers see the parent's writes
        self._floats = np.frombuffer(self._mapping, np.float64, count=2, offset=0)
        self._ints = np.frombuffer(self._mapping, np.int64, count=3, offset=16)
        self._released = Release()

    def arm(self, kind: str, index: int, sleep_s: float = SLOW_S) -> None:
        self._floats[:] = (0.0, sleep_s)
        self._ints[:] = (KINDS.index(kind) + 1, index, 0)
        self._released.clear()

    def release(self) -> None:
        """A "sleep" fault sleeping now returns at once."""
        self._released.set()

    @property
    def fired_at(self) -> float:
        return float(self._floats[0])

    @property
    def fired_pid(self) -> int:
        return int(self._ints[2])

    def fire_if_armed(self, index: int) -> None:
        if self._ints[0] == 0 or index != self._ints[1]:
            return
        kind = KINDS[int(self._ints[0]) - 1]
        self._ints[0] = 0  # disarm first: a retry of this sample loads normally
        self._ints[2] = os.getpid()
        self._floats[0] = time.time()
        if kind == "raise":
            raise ValueError(f"sample {index} is corrupt")
        if kind == "sleep":
            self._released.sleep(float(self._floats[1]))
            return
        faulthandler.disable()
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file for the segfault
        if kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "segfault":
            ctypes.string_at(0)
        else:
            os._exit(3)


class FaultyDataset(ImageDataset):
    """``ImageDataset`` of int64 pairs whose armed sample faults as its ``FaultPlan`` says."""

    def __init__(self, n: int, plan: FaultPlan):
        super().__init__(n, shape=(2,), dtype=np.int64)
        self.plan = plan

    def __getitem__(self, index: int) -> np.ndarray:
        self.plan.fire_if_armed(index)
        return super().__getitem__(index)


# -- observations ---------------------------------------------------------------------------

_BATCH_IDS = {np.stack([make_array(i, (2,), np.int64) for i in range(s, s + BATCH_SIZE)])
              .tobytes(): s // BATCH_SIZE for s in range(0, SAMPLES, BATCH_SIZE)}


def batch_idx_of(batch: Any) -> int:
    """The idx of the reference batch equal to ``batch`` (shape, dtype and bytes), or -1."""
    array = np.asarray(batch)
    if array.dtype != np.int64 or array.shape != (BATCH_SIZE, 2):
        return -1
    return _BATCH_IDS.get(array.tobytes(), -1)


def running(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def seconds_until_gone(pids: list[int], since: float) -> float | None:
    """Seconds from ``since`` until none of ``pids`` runs; None if some outlive GONE_WAIT_S."""
    deadline = time.time() + GONE_WAIT_S
    while running(pids):
        if time.time() > deadline:
            return None
        time.sleep(0.002)
    return time.time() - since


def child_pids() -> list[int]:
    return [c.pid for c in psutil.Process().children(recursive=True)
            if c.status() != psutil.STATUS_ZOMBIE]


def leftovers() -> dict[str, list]:
    """What must be gone once the loader is closed: children, /dev/shm objects, mappings."""
    gc.collect()
    with open("/proc/self/maps") as maps:
        mappings = [line.strip() for line in maps if f"{SHM_DIR}/{NAME_PREFIX}" in line]
    return {"children": child_pids(),
            "shm_objects": sorted(n for n in os.listdir(SHM_DIR)
                                  if n.startswith(f"{NAME_PREFIX}{os.getpid()}_")),
            "slab_mappings": mappings,
            "threads": [t.name for t in threading.enumerate()
                        if t.name.startswith("arena_loader")]}


def describe_error(exc: BaseException, started: float, pids: list[int]) -> dict[str, Any]:
    raised_at = time.time()
    alive = running(pids)  # before anything else can stop the workers
    described = {"type": f"{type(exc).__module__}.{type(exc).__qualname__}",
                 "message": str(exc), "raised_at": raised_at, "waited_s": raised_at - started,
                 "alive_at_raise": alive,
                 "cause_type": type(exc.__cause__).__name__ if exc.__cause__ else None}
    for name in ("worker_id", "batch_idx", "indices", "pid", "exitcode"):
        if hasattr(exc, name):
            value = getattr(exc, name)
            described[name] = list(value) if isinstance(value, (list, tuple)) else value
    return described


def consume(iterator: Any, *, stop_on_error: bool) -> dict[str, Any]:
    """Call next() until StopIteration, recording each batch's idx and each error.

    ``stop_on_error``: after the first error, call next() once more (it must raise the same
    error) and stop.
    """
    delivered: list[int] = []
    errors: list[dict[str, Any]] = []
    pids = list(iterator.worker_pids)
    while len(errors) < 20:
        started = time.time()
        try:
            batch = next(iterator)
        except StopIteration:
            break
        except Exception as exc:
            errors.append(describe_error(exc, started, pids))
            if stop_on_error:
                try:
                    next(iterator)
                except Exception as again:
                    errors[-1]["raised_again"] = (type(again) is type(exc)
                                                  and str(again) == str(exc)
                                                  and vars(again) == vars(exc))
                break
            continue
        delivered.append(batch_idx_of(batch))
        pids = list(iterator.worker_pids) or pids
        del batch
    return {"delivered": delivered, "errors": errors, "pids": pids}


# -- the matrix cases -------------------------------------------------------------------------

def run_matrix_case(fault: str, num_workers: int, persistent: bool) -> dict[str, Any]:
    plan = FaultPlan()
    loader = ArenaLoader(FaultyDataset(SAMPLES, plan), batch_size=BATCH_SIZE,
                         num_workers=num_workers, persistent_workers=persistent,
                         timeout=TIMEOUT_S if fault == "timeout" else 0)
    report: dict[str, Any] = {"fault": fault, "driver_pid": os.getpid()}
    warmup = consume(iter(loader), stop_on_error=True)
    report["warmup"] = warmup
    pids_seen = set(warmup["pids"])
    if fault in ("raise", "sigkill", "segfault", "exit3", "timeout"):
        plan.arm("sleep" if fault == "timeout" else fault, FAULT_INDEX)
        iterator = iter(loader)
        report["faulty"] = consume(iterator, stop_on_error=fault not in ("raise", "timeout"))
        del iterator
    elif fault == "break":
        report["faulty"] = _break_mid_epoch(loader, persistent)
    elif fault == "keyboard_interrupt":
        report["faulty"] = _keyboard_interrupt(loader, plan, persistent)
        pids_seen.update(report["faulty"]["propagated"]["pids"])
    else:
        raise ValueError(f"fault must be one of the matrix faults, got {fault!r}")
    report["fired_at"], report["fired_pid"] = plan.fired_at, plan.fired_pid
    pids_seen.update(report["faulty"]["pids"])
    report["next_epoch"] = consume(iter(loader), stop_on_error=True)
    pids_seen.update(report["next_epoch"]["pids"])
    closing = running(sorted(pids_seen))
    started = time.time()
    loader.close()
    report["close_s"] = time.time() - started
    report["gone_after_close_s"] = seconds_until_gone(closing, started)
    del loader
    report["all_pids"] = sorted(pids_seen)
    report["leftovers"] = leftovers()
    return report


def _break_mid_epoch(loader: ArenaLoader, persistent: bool) -> dict[str, Any]:
    """`for batch in loader: ... break` after 4 batches; how long until its workers exit."""
    delivered, pids = _loop_and_break(loader, after=4)
    broke_at = time.time()
    return {"delivered": delivered, "errors": [], "pids": pids,
            "gone_after_break_s": None if persistent else seconds_until_gone(pids, broke_at),
            "alive_after_break": running(pids)}


def _loop_and_break(loader: ArenaLoader, after: int) -> tuple[list[int], list[int]]:
    delivered: list[int] = []
    for batch in loader:
        delivered.append(batch_idx_of(batch))
        if len(delivered) == after:
            return delivered, child_pids()
    return delivered, child_pids()


def _keyboard_interrupt(loader: ArenaLoader, plan: FaultPlan, persistent: bool
                        ) -> dict[str, Any]:
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) while next() waits
    for a slow batch. First caught around next(): the same iterator then goes on and loses
    no batch. Then left to propagate out of a `for` loop: the abandoned iterator's workers
    exit (non-persistent), or the loader's next epoch runs on them (persistent)."""
    if os.getpgid(0) != os.getpid():
        raise RuntimeError("run the driver in a session of its own (start_new_session=True): "
                           "the Ctrl-C it sends goes to its whole process group")
    plan.arm("sleep", FAULT_INDEX)
    iterator = iter(loader)
    pids = list(iterator.worker_pids)
    delivered: list[int] = []
    interrupted: dict[str, Any] = {}
    for _ in range(BATCHES + 1):
        if len(delivered) == FAULT_IDX and not interrupted:
            threading.Timer(INTERRUPT_AFTER_S, os.killpg, (0, signal.SIGINT)).start()
            sent_at = time.time() + INTERRUPT_AFTER_S
        try:
            batch = next(iterator)
        except StopIteration:
            break
        except KeyboardInterrupt as exc:
            interrupted = describe_error(exc, sent_at, pids)
            interrupted["detect_s"] = interrupted["raised_at"] - sent_at
            # The slow batch is still loading; the next next() gets it, now without the
            # rest of its sleep. (The Ctrl-C that propagates below finds its worker
            # inside the whole of its sample.)
            plan.release()
            continue
        delivered.append(batch_idx_of(batch))
        del batch
    del iterator
    plan.arm("sleep", FAULT_INDEX)
    propagated: dict[str, Any] = {}
    try:
        _loop_until_interrupted(loader, propagated)
    except KeyboardInterrupt:
        propagated["caught_at"] = time.time()
    # The traceback (and with it the loop's iterator) is gone once the except block ends.
    if not persistent:
        propagated["gone_after_s"] = seconds_until_gone(propagated["pids"],
                                                        propagated["caught_at"])
    propagated["alive_after"] = running(propagated["pids"])
    return {"delivered": delivered, "errors": [], "pids": pids, "interrupted": interrupted,
            "propagated": propagated}


def _loop_until_interrupted(loader: ArenaLoader, record: dict[str, Any]) -> None:
    for count, _batch in enumerate(loader, start=1):
        if count == FAULT_IDX:
            record["pids"] = child_pids()
            threading.Timer(INTERRUPT_AFTER_S, os.killpg, (0, signal.SIGINT)).start()
    raise AssertionError("the epoch ended without the KeyboardInterrupt")


def run_main_killed(num_workers: int, persistent: bool) -> None:
    """Print the worker pids once the workers are in the state to test, then block until the
    caller SIGKILLs this process: persistent workers idle between epochs; non-persistent
    ones mid-epoch, one of them inside a 60 s __getitem__."""
    plan = FaultPlan()
    loader = ArenaLoader(FaultyDataset(SAMPLES, plan), batch_size=BATCH_SIZE,
                         num_workers=num_workers, persistent_workers=persistent)
    for _ in loader:
        pass
    if not persistent:
        # Armed before iter() starts the workers: armed after, a worker could load the
        # sample first (a loaded machine) and the wait below would never end.
        plan.arm("sleep", FAULT_INDEX, sleep_s=60.0)
    iterator = iter(loader)
    if persistent:
        for _ in iterator:
            pass
    else:
        for _ in range(FAULT_IDX):
            next(iterator)
        deadline = time.monotonic() + 20.0
        while plan.fired_pid == 0:
            if time.monotonic() > deadline:
                raise SystemExit(f"sample {FAULT_INDEX} was never loaded by a worker")
            time.sleep(0.005)
    print(json.dumps({"driver_pid": os.getpid(), "pids": list(iterator.worker_pids),
                      "busy_pid": plan.fired_pid}), flush=True)
    if not persistent:
        next(iterator)  # waits for the 60 s sample
    time.sleep(60)


HUGE_ROW = 2**19  # int64s a row: 4 MiB
HUGE_BATCH = 2**14  # rows a batch: 64 GiB


class HugeRows:
    """2**15 rows of 4 MiB written by ``read_into``: a batch of 2**14 rows needs 64 GiB of
    shared memory, far more than /dev/shm has, and nothing is ever materialized. (Rows of
    32 KiB made it 2**21 indices a batch, which the worker's error carries back: 1.4 s of
    CPU to rebuild them in the main process, for the same error.)"""

    def __len__(self) -> int:
        return 2 * HUGE_BATCH

    def __getitem__(self, index: int) -> np.ndarray:
        return np.zeros(HUGE_ROW, np.int64)

    def read_into(self, indices: np.ndarray, out: np.ndarray) -> None:
        out[...] = 0


def run_capacity_case(num_workers: int) -> dict[str, Any]:
    """Batches far larger than /dev/shm: 2**14 rows of 4 MiB samples (64 GiB) each."""
    loader = ArenaLoader(HugeRows(), batch_size=HUGE_BATCH, num_workers=num_workers)
    iterator = iter(loader)
    outcomes = []
    for _ in range(2):
        started = time.time()
        try:
            next(iterator)
            outcomes.append({"type": "batch"})
        except StopIteration:
            outcomes.append({"type": "StopIteration"})
        except Exception as exc:
            outcomes.append(describe_error(exc, started, []))
    loader.close()
    del iterator, loader
    return {"outcomes": outcomes, "leftovers": leftovers()}


def main(argv: list[str]) -> int:
    # Three workers on a two-core machine on purpose: torch's warning about it (which
    # ArenaLoader gives too) is not a fault.
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    mode = argv[0]
    if mode == "matrix":
        fault, num_workers, persistent = argv[1], int(argv[2]), argv[3] == "1"
        if fault == "main_sigkill":
            run_main_killed(num_workers, persistent)
            return 0
        print(json.dumps(run_matrix_case(fault, num_workers, persistent)), flush=True)
        return 0
    if mode == "capacity":
        print(json.dumps(run_capacity_case(int(argv[1]))), flush=True)
        return 0
    if mode == "soak":
        from .soak import run_soak

        # The modules' objects out of the collector (as conftest does): the collection before
        # each epoch's measurement walks only what the loaders made (0.017 -> 0.004 s).
        gc.collect()
        gc.freeze()
        print(json.dumps(run_soak(int(argv[1]))), flush=True)
        return 0
    raise SystemExit(f"usage: python -m tests.fault_driver matrix|soak ..., got {argv!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
