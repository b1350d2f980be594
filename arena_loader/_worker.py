"""The worker process: attach the slab, then turn tasks into filled slots until told to stop.

Everything a worker needs arrives in one ``WorkerSetup`` (pickled under spawn/forkserver,
inherited under fork), and it talks to the main process over two private pipes, so a worker
that dies cannot corrupt a channel another worker uses (docs/design.md, "Workers").
"""

from __future__ import annotations

import ctypes
import os
import pickle
import random
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np

from ._fetch import BatchFiller
from ._layout import BatchLayout
from ._messages import BatchFailed, BatchReady, RemoteError, Stop, Task, WorkerFailed
from ._slab import SlabHandle

# How often an idle worker checks that its parent is still alive, in case the parent-death
# signal could not be armed (see _arm_parent_death_signal).
PARENT_CHECK_S = 0.5
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class WorkerInfo:
    """What ``get_worker_info()`` returns inside a worker (torch's fields)."""

    id: int
    num_workers: int
    seed: int
    dataset: Any


_worker_info: WorkerInfo | None = None


def get_worker_info() -> WorkerInfo | None:
    """This worker's ``WorkerInfo``, or ``None`` in the main process."""
    return _worker_info


@dataclass(frozen=True)
class WorkerSetup:
    worker_id: int
    num_workers: int
    filler: BatchFiller
    layout: BatchLayout
    slab: SlabHandle
    slots: int
    base_seed: int
    worker_init_fn: Callable[[int], None] | None
    arm_parent_death_signal: bool


def seed_worker(base_seed: int, worker_id: int) -> int:
    """Seed ``random``, numpy's global RNG and torch (if loaded) for one worker."""
    seed = (base_seed + worker_id) % 2**64
    random.seed(seed)
    np.random.seed(np.random.SeedSequence([worker_id, base_seed % 2**63]).generate_state(4))
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed)
    return seed


def worker_main(setup: WorkerSetup, task_conn: Connection, result_conn: Connection) -> None:
    # Ctrl-C reaches the whole process group; the main process handles it and stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Our parent is the main process (fork, spawn) or the forkserver, which exits with it.
    parent_pid = os.getppid()
    if setup.arm_parent_death_signal:
        _arm_parent_death_signal()
    if parent_pid == 1 or not _alive(parent_pid):
        return  # the parent died before the signal was armed
    global _worker_info
    try:
        slab_mmap = setup.slab.map()
        os.close(setup.slab.fd)
        slab = np.frombuffer(slab_mmap, dtype=np.uint8)
        slot_arrays = [setup.layout.slot_arrays(slab, slot) for slot in range(setup.slots)]
        seed = seed_worker(setup.base_seed, setup.worker_id)
        _worker_info = WorkerInfo(setup.worker_id, setup.num_workers, seed,
                                  setup.filler.dataset)
        if setup.worker_init_fn is not None:
            setup.worker_init_fn(setup.worker_id)
    except Exception as exc:
        result_conn.send(WorkerFailed(setup.worker_id, RemoteError.capture(exc)))
        return
    _serve(setup, slot_arrays, task_conn, result_conn, parent_pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _serve(setup: WorkerSetup, slot_arrays: list, task_conn: Connection,
           result_conn: Connection, parent_pid: int) -> None:
    filler, layout = setup.filler, setup.layout
    while True:
        if not task_conn.poll(PARENT_CHECK_S):
            if os.getppid() != parent_pid:
                return  # reparented: the parent is gone
            continue
        try:
            task = task_conn.recv()
        except EOFError:
            return
        if isinstance(task, Stop):
            return
        assert isinstance(task, Task), task
        try:
            fetched = filler.fetch(task.indices)
            rows, lengths, objects = filler.write(layout, slot_arrays[task.slot], fetched,
                                                  task.indices)
            # Pickled here, not in send(), so an object leaf that does not pickle becomes this
            # batch's error instead of killing the worker.
            pickled_objects = None if objects is None else pickle.dumps(objects, protocol=-1)
            payload = ForkingPickler.dumps(
                BatchReady(task.idx, task.slot, rows, lengths, pickled_objects))
        except Exception as exc:
            payload = ForkingPickler.dumps(
                BatchFailed(task.idx, task.slot, setup.worker_id, RemoteError.capture(exc)))
        result_conn.send_bytes(payload)


def _arm_parent_death_signal() -> None:
    """Ask Linux to SIGKILL this worker when the thread that started it exits."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the idle loop's getppid() check still notices
