"""The fault matrix: every fault x num_workers {1, 3} x persistent_workers {off, on}, none
skipped (torch's `_test_proper_exit` skips its worker-kill case because it can hang).

Each case runs in its own process (tests/fault_driver.py, forked from a warm interpreter by
tests/zygote.py, in a new session, under a hard timeout) and reports as JSON what the main
process saw: the error's type, message and attributes, how long after the fault it was
raised, which workers were alive at that moment, the batches delivered before and after, and
what was left once the loader was closed. Each test then checks, after the driver exited,
that none of its worker pids runs and that no /dev/shm object of the driver's is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from arena_loader._process import JOIN_TIMEOUT_S
from arena_loader._slab import NAME_PREFIX, SHM_DIR

from . import zygote
from .conftest import wait_until
from .fault_driver import BATCHES, FAULT_IDX, TIMEOUT_S, running

pytestmark = pytest.mark.timeout(60)

REPO_ROOT = Path(__file__).resolve().parent.parent
CASE_TIMEOUT_S = 30.0
# From the fault (the faulting worker's own timestamp) to the error in the main process.
# Measured ~0.003-0.015 s (torch: ~0.05 s); the bound is generous for a shared 2-core VM.
DETECT_BOUND_S = 0.5
# From `break`/close() to the last worker's exit, when no worker is stuck in user code.
SHUTDOWN_BOUND_S = 1.0
# The bound for workers of a SIGKILLed main process.
ORPHAN_BOUND_S = 2.0

MATRIX = pytest.mark.parametrize("num_workers, persistent", [
    pytest.param(1, False, id="nw1"), pytest.param(1, True, id="nw1-persistent"),
    pytest.param(3, False, id="nw3"), pytest.param(3, True, id="nw3-persistent"),
])
EVERY_BATCH = list(range(BATCHES))
FAULT_MESSAGE_BATCH = f"batch idx={FAULT_IDX} (indices [10, 11])"


def run_driver(fault: str, num_workers: int, persistent: bool) -> dict[str, Any]:
    """Run one case; check the common guarantees; return the driver's report."""
    proc = zygote.run(
        ["-m", "tests.fault_driver", "matrix", fault, str(num_workers),
         "1" if persistent else "0"],
        timeout=CASE_TIMEOUT_S, cwd=REPO_ROOT, start_new_session=True)
    assert proc.returncode == 0 and proc.stderr == "", (
        f"driver failed ({proc.returncode}):\n{proc.stderr}")
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["warmup"]["delivered"] == EVERY_BATCH and not report["warmup"]["errors"]
    assert report["leftovers"] == {"children": [], "shm_objects": [], "slab_mappings": [],
                                   "threads": []}
    assert report["gone_after_close_s"] is not None
    assert report["gone_after_close_s"] < SHUTDOWN_BOUND_S
    assert_nothing_left(report["all_pids"], proc.pid)
    return report


def assert_nothing_left(pids: list[int], driver_pid: int) -> None:
    assert pids, "the driver reported no worker pids"
    assert wait_until(lambda: not running(pids), timeout_s=2.0), f"survivors: {running(pids)}"
    leaked = [n for n in os.listdir(SHM_DIR) if n.startswith(f"{NAME_PREFIX}{driver_pid}_")]
    assert not leaked, f"shared-memory objects left: {leaked}"


def faulty_worker(num_workers: int) -> int:
    return FAULT_IDX % num_workers  # round-robin assignment, as torch


def assert_next_epoch_complete(report: dict[str, Any], same_workers: bool) -> None:
    """The loader delivers a whole, correct epoch after the fault; on the same processes
    (persistent workers that survived) or on new ones (after a crash)."""
    following = report["next_epoch"]
    assert following["delivered"] == EVERY_BATCH and not following["errors"]
    if same_workers:
        assert following["pids"] == report["faulty"]["pids"]
    else:
        assert not set(following["pids"]) & set(report["faulty"]["pids"])


@MATRIX
def test_worker_exception_is_reraised_with_its_type_and_iteration_goes_on(num_workers,
                                                                         persistent):
    """ValueError in __getitem__: raised as ValueError naming worker, idx, indices, with the
    worker traceback, right after the fault; every worker lives on, the next next() yields
    the following batch, and the epoch after is complete."""
    report = run_driver("raise", num_workers, persistent)
    faulty = report["faulty"]
    [error] = faulty["errors"]
    worker = faulty_worker(num_workers)
    assert error["type"] == "builtins.ValueError" and error["cause_type"] == "ValueError"
    assert error["message"].startswith(
        f"Caught ValueError in DataLoader worker process {worker}.\nbuiltins.ValueError while "
        f"loading {FAULT_MESSAGE_BATCH}.\nOriginal Traceback (most recent call last):\n")
    assert "in __getitem__" in error["message"]
    assert error["message"].rstrip().endswith("ValueError: sample 11 is corrupt")
    assert (error["worker_id"], error["batch_idx"], error["indices"]) == (worker, 5, [10, 11])
    assert report["fired_pid"] == faulty["pids"][worker]
    assert error["raised_at"] - report["fired_at"] < DETECT_BOUND_S
    assert error["alive_at_raise"] == faulty["pids"]
    assert faulty["delivered"] == [i for i in EVERY_BATCH if i != FAULT_IDX]
    assert_next_epoch_complete(report, same_workers=persistent)


@MATRIX
@pytest.mark.parametrize("fault, exit_text, exitcode", [
    pytest.param("sigkill", "was killed by SIGKILL", -signal.SIGKILL, id="sigkill"),
    pytest.param("segfault", "was killed by SIGSEGV", -signal.SIGSEGV, id="segfault"),
    pytest.param("exit3", "exited with code 3", 3, id="os_exit3"),
])
def test_dead_worker_raises_crash_error_naming_pid_and_exit(fault, exit_text, exitcode,
                                                           num_workers, persistent):
    """A worker killed by SIGKILL, a segfault (ctypes.string_at(0)) or os._exit(3):
    WorkerCrashedError naming worker, pid, signal or exit code and the batch it owed, within
    DETECT_BOUND_S; every worker is already stopped when it is raised, next() raises it
    again, and the next epoch runs complete on new workers."""
    report = run_driver(fault, num_workers, persistent)
    faulty = report["faulty"]
    [error] = faulty["errors"]
    worker, pid = faulty_worker(num_workers), report["fired_pid"]
    assert error["type"] == "arena_loader.errors.WorkerCrashedError"
    assert error["message"].startswith(
        f"DataLoader worker {worker} (pid {pid}) {exit_text} while loading "
        f"{FAULT_MESSAGE_BATCH}")
    assert "load those indices with num_workers=0" in error["message"]
    assert (error["worker_id"], error["pid"], error["exitcode"]) == (worker, pid, exitcode)
    assert pid == faulty["pids"][worker]
    detect_s = error["raised_at"] - report["fired_at"]
    assert detect_s < DETECT_BOUND_S, f"the crash took {detect_s:.3f} s to surface"
    assert error["alive_at_raise"] == []
    assert error["raised_again"] is True
    # Batches received before the crash come first, in order, and nothing wrong.
    assert faulty["delivered"] == list(range(len(faulty["delivered"])))
    assert len(faulty["delivered"]) <= FAULT_IDX
    assert_next_epoch_complete(report, same_workers=False)


@MATRIX
def test_timeout_raises_loader_timeout_error_and_loses_no_batch(num_workers, persistent):
    """timeout=0.3 and a 1 s sample: LoaderTimeoutError (a RuntimeError) naming the batch,
    worker and pid, raised on time; the workers live on and calling next() again delivers
    the slow batch and the rest of the epoch."""
    report = run_driver("timeout", num_workers, persistent)
    faulty = report["faulty"]
    assert faulty["errors"], "no timeout was raised"
    worker, pid = faulty_worker(num_workers), report["fired_pid"]
    for error in faulty["errors"]:
        assert error["type"] == "arena_loader.errors.LoaderTimeoutError"
        assert error["message"].startswith(
            f"DataLoader timed out after {TIMEOUT_S} seconds waiting for "
            f"{FAULT_MESSAGE_BATCH} from worker {worker} (pid {pid}), which is still running")
        assert TIMEOUT_S <= error["waited_s"] < TIMEOUT_S + DETECT_BOUND_S
        assert error["alive_at_raise"] == faulty["pids"]
    assert faulty["delivered"] == EVERY_BATCH
    assert_next_epoch_complete(report, same_workers=persistent)


@MATRIX
def test_break_mid_epoch_stops_workers_promptly(num_workers, persistent):
    """`break` out of a `for` loop: the abandoned iterator's workers exit within
    SHUTDOWN_BOUND_S; persistent workers stay for the next epoch, which is complete."""
    report = run_driver("break", num_workers, persistent)
    faulty = report["faulty"]
    assert faulty["delivered"] == [0, 1, 2, 3]
    assert len(faulty["pids"]) == num_workers
    if persistent:
        assert faulty["alive_after_break"] == faulty["pids"]
    else:
        assert faulty["gone_after_break_s"] is not None
        assert faulty["gone_after_break_s"] < SHUTDOWN_BOUND_S
    assert_next_epoch_complete(report, same_workers=persistent)


@MATRIX
def test_keyboard_interrupt_is_raised_at_once_and_loses_nothing(num_workers, persistent):
    """Ctrl-C (SIGINT to the process group) while next() waits: KeyboardInterrupt within
    DETECT_BOUND_S, the workers ignore it, and the same iterator then delivers every batch.
    Propagating out of a `for` loop, it gets the abandoned workers stopped (bounded by the
    join -> terminate escalation: one is inside a 1 s sample), or, persistent, reused."""
    report = run_driver("keyboard_interrupt", num_workers, persistent)
    faulty = report["faulty"]
    interrupted = faulty["interrupted"]
    assert interrupted["type"] == "builtins.KeyboardInterrupt"
    assert interrupted["detect_s"] < DETECT_BOUND_S
    assert interrupted["alive_at_raise"] == faulty["pids"]
    assert faulty["delivered"] == EVERY_BATCH
    propagated = faulty["propagated"]
    assert len(propagated["pids"]) == num_workers
    if persistent:
        assert propagated["alive_after"] == propagated["pids"]
        assert report["next_epoch"]["pids"] == propagated["pids"]
    else:
        assert propagated["alive_after"] == []
        assert propagated["gone_after_s"] is not None
        assert propagated["gone_after_s"] < JOIN_TIMEOUT_S + 0.5
    assert report["next_epoch"]["delivered"] == EVERY_BATCH


@MATRIX
def test_main_process_sigkill_leaves_no_worker_or_shared_memory(num_workers, persistent):
    """SIGKILL of the main process, with workers idle between persistent epochs or busy
    mid-epoch (one inside a 60 s __getitem__): every worker exits within 2 s, and no
    /dev/shm object of the killed process remains."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fault_driver", "matrix", "main_sigkill",
         str(num_workers), "1" if persistent else "0"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        state = json.loads(line)
        pids = state["pids"]
        assert len(pids) == num_workers and not set(pids) - set(running(pids))
        if not persistent:
            assert state["busy_pid"] in pids
        killed_at = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert wait_until(lambda: not running(pids), timeout_s=ORPHAN_BOUND_S, interval_s=0.005)
        orphaned_s = time.monotonic() - killed_at
        assert orphaned_s < ORPHAN_BOUND_S
        assert_nothing_left(pids, proc.pid)
    finally:
        proc.kill()
        proc.communicate()
