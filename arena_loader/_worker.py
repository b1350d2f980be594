"""The worker process: attach the slab, then turn tasks into filled slots until told to stop.

Everything a worker needs arrives in one ``WorkerSetup`` (pickled under spawn/forkserver,
inherited under fork), and it talks to the main process over two private pipes, so a worker
that dies cannot corrupt a channel another worker uses (docs/design.md, "Workers").
"""

from __future__ import annotations

import ctypes
import os
import random
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np

from ._fetch import BatchFiller, Fetched, StreamPosition
from ._forksafe import close_on_exec_inherited, started_by_fork
from ._layout import PlanEncoder, encode_end
from ._messages import (
    Attach,
    BatchFailed,
    RemoteError,
    Stop,
    Task,
    WorkerFailed,
    decode_message,
)
from ._slab import Segment, SlabHandle, send_segment

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
# Thread workers (worker_mode="thread") share the process: each sets its own info here.
_thread_worker = threading.local()


def get_worker_info() -> WorkerInfo | None:
    """This worker's ``WorkerInfo`` (process or thread worker), or ``None`` elsewhere."""
    return getattr(_thread_worker, "info", None) or _worker_info


def set_thread_worker_info(info: WorkerInfo | None) -> None:
    """Set ``get_worker_info()`` for the calling thread only."""
    _thread_worker.info = info


@dataclass(frozen=True)
class WorkerSetup:
    worker_id: int
    num_workers: int
    filler: BatchFiller
    slot_nbytes: int  # 0: not known yet; an Attach message brings it
    slab: SlabHandle
    slots: int
    fd_socket: Any  # a socket: one-off segments' descriptors go to the main process on it
    base_seed: int
    worker_init_fn: Callable[[int], None] | None
    arm_parent_death_signal: bool
    # The main process uses torch: set torch's worker info too, importing torch if a fresh
    # (spawn / forkserver) interpreter has not yet.
    publish_to_torch: bool = False


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
    if not started_by_fork():  # spawn, forkserver: multiprocessing's fds come inheritable
        close_on_exec_inherited()
    # Our parent is the main process (fork, spawn) or the forkserver, which exits with it.
    parent_pid = os.getppid()
    if setup.arm_parent_death_signal:
        _arm_parent_death_signal()
    if parent_pid == 1 or not pid_exists(parent_pid):
        return  # the parent died before the signal was armed
    global _worker_info
    try:
        state = _WorkerState(setup)
        if setup.slot_nbytes:
            state.attach(setup.slot_nbytes)
        if setup.publish_to_torch:
            # Before seeding: a spawned interpreter imports torch only now, and torch's
            # default seed is the same in every process.
            _import_torch()
        _limit_torch_threads()
        seed = seed_worker(setup.base_seed, setup.worker_id)
        _worker_info = WorkerInfo(setup.worker_id, setup.num_workers, seed,
                                  setup.filler.dataset)
        if setup.publish_to_torch:
            _publish_to_torch(_worker_info)
        if setup.worker_init_fn is not None:
            setup.worker_init_fn(setup.worker_id)
    except Exception as exc:
        result_conn.send(WorkerFailed(setup.worker_id, RemoteError.capture(exc)))
        return
    _serve(state, task_conn, result_conn, parent_pid)


def _import_torch() -> None:
    try:
        import torch.utils.data  # noqa: F401
    except ImportError:
        pass


def _limit_torch_threads() -> None:
    """One intra-op thread per worker, as torch's own workers do: N workers each running
    torch's full thread pool oversubscribe the cores, and an OpenMP pool inherited from a
    parent that used it can hang the first parallel op of a forked child."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def _publish_to_torch(info: WorkerInfo) -> None:
    """Make ``torch.utils.data.get_worker_info()`` answer too, when the program uses torch: a
    dataset written for torch's DataLoader shards by it, and must not see None in a worker
    (every worker would then yield the whole dataset)."""
    try:
        from torch.utils.data._utils import worker as torch_worker

        torch_worker._worker_info = torch_worker.WorkerInfo(
            id=info.id, num_workers=info.num_workers, seed=info.seed, dataset=info.dataset)
    except (ImportError, AttributeError, TypeError):
        pass  # a torch without that private hook: only arena_loader.get_worker_info() answers


def pid_exists(pid: int) -> bool:
    """Whether ``pid`` still exists (a zombie counts: it still holds its exit status)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class _WorkerState:
    """The slab mapping, and for iterable-style datasets this worker's iterator of it."""

    def __init__(self, setup: WorkerSetup):
        self.setup = setup
        self.slab: np.ndarray | None = None  # the slab's bytes, once its size is known
        self.slot_nbytes = 0
        self.encoder = PlanEncoder()
        self._stream: Iterator | None = None
        self._stream_epoch = -1
        self._position = 0  # items taken from the iterator: names samples in errors

    def attach(self, slot_nbytes: int) -> None:
        setup = self.setup
        slab_mmap = setup.slab.map(setup.slots * slot_nbytes)
        os.close(setup.slab.fd)
        self.slab = np.frombuffer(slab_mmap, dtype=np.uint8)
        self.slot_nbytes = slot_nbytes

    def fetch(self, task: Task) -> tuple[Fetched | None, Any]:
        """(the batch, its indices); (None, None) when an iterable's iterator is done."""
        filler = self.setup.filler
        if not filler.iterable:
            return filler.fetch(task.indices), task.indices
        if task.epoch != self._stream_epoch:  # a new epoch (persistent workers): start over
            self._stream, self._stream_epoch, self._position = None, task.epoch, 0
            self._stream = iter(filler.dataset)
        if self._stream is None:
            return None, None  # the iterator raised while being made: nothing this epoch
        fetched = filler.fetch_next(self._stream)
        if fetched is None:
            return None, None
        indices = [StreamPosition(i) for i in range(self._position,
                                                     self._position + fetched.rows)]
        self._position += fetched.rows
        return fetched, indices

    def load(self, task: Task) -> bytes:
        """Load batch ``task.idx``, write it into its slot (or, if it has none or does not
        fit, a one-off segment sent over the descriptor socket) and return its record."""
        fetched, indices = self.fetch(task)
        if fetched is None:
            return encode_end(task.idx, task.slot, self.setup.worker_id)
        filler = self.setup.filler
        prepared = filler.prepare(fetched, indices)
        nbytes = prepared.nbytes
        if task.slot >= 0 and self.slab is not None and nbytes <= self.slot_nbytes:
            start = task.slot * self.slot_nbytes
            filler.write(prepared, fetched, self.slab[start: start + nbytes], indices)
            return self.encoder.encode(prepared.plan, task.idx, task.slot,
                                       self.setup.worker_id, segment=False)
        segment = Segment(nbytes)
        try:
            filler.write(prepared, fetched, segment.array, indices)
            record = self.encoder.encode(prepared.plan, task.idx, -1, self.setup.worker_id,
                                         segment=True)
            send_segment(self.setup.fd_socket, task.idx, segment)
        finally:
            segment.close()
        return record


def _serve(state: _WorkerState, task_conn: Connection, result_conn: Connection,
           parent_pid: int | None) -> None:
    """The task loop; ``parent_pid=None`` (thread workers) skips the reparenting check."""
    worker_id = state.setup.worker_id
    while True:
        if not task_conn.poll(PARENT_CHECK_S):
            if parent_pid is not None and os.getppid() != parent_pid:
                return  # reparented: the parent is gone
            continue
        try:
            message = decode_message(task_conn.recv_bytes())
        except EOFError:
            return
        if isinstance(message, Stop):
            return
        if isinstance(message, Attach):
            try:
                state.attach(message.slot_nbytes)
            except Exception as exc:  # the slab could not be mapped: this worker cannot work
                result_conn.send(WorkerFailed(worker_id, RemoteError.capture(exc)))
                return
            continue
        assert isinstance(message, Task), message
        try:
            payload = state.load(message)
        except Exception as exc:
            payload = ForkingPickler.dumps(
                BatchFailed(message.idx, message.slot, worker_id, RemoteError.capture(exc)))
        result_conn.send_bytes(payload)


def _arm_parent_death_signal() -> None:
    """Ask Linux to SIGKILL this worker when the thread that started it exits."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the idle loop's getppid() check still notices
