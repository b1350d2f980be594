"""Thread workers (``worker_mode="thread"``): the worker loop run by threads of the main
process, reading the same order ring and writing the same slab and completion records as
worker processes.

``ThreadWorkerGroup`` offers the session the interface of ``_process.WorkerGroup``
(``WorkerGroupLike``: pids, channels, crash_error, shutdown), so ordering, prefetching, slot
handling and errors are the session's, unchanged. Each thread runs ``_worker.serve`` over a
private pair of OS pipes; when a thread ends for any reason it closes its ends, so the
session reads EOF exactly as for a dead process (docs/design.md, "Thread workers").
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from . import _thread_start
from ._forksafe import register_descriptor
from ._messages import without_tracebacks
from ._pipeline.order import OrderReader
from ._process import JOIN_TIMEOUT_S, fd_socket_pair, worker_pipes
from ._slab import Slab
from ._worker import WorkerSetup, WorkerState, report_worker_failure, serve, worker_infos
from .errors import WorkerCrashedError
from .worker_info import set_thread_worker_info

logger = logging.getLogger("arena_loader")


class _ThreadWorkerState(WorkerState):
    """A worker's state, writing through the main process's own mapping of the slab (no
    descriptor to map or close: the thread shares the process's)."""

    def __init__(self, setup: WorkerSetup, group: ThreadWorkerGroup):
        super().__init__(setup)
        self._group = group

    def attach(self, slot_nbytes: int, generation: int = 0) -> None:
        # ATTACH comes after the main process allocated the slab; one naming a generation,
        # after it set the grown slab on the group (Crew.hand_slab).
        self.slab = self._group.slab.array
        self.slot_nbytes = slot_nbytes
        if generation:
            self._same_shape.forget()


class ThreadWorkerGroup:
    """``num_workers`` daemon threads named ``arena_loader-worker-<id>``, each with a private
    task pipe and result pipe."""

    def __init__(self, setups: list[WorkerSetup], slab: Slab, ring: Any):
        """``slab``: the main process's slab (reserved, or allocated for a known layout);
        ``ring``: the main process's mapping of the order ring."""
        self.slab = slab  # what the threads write (a grown one: Crew.hand_slab)
        self.threads: list[threading.Thread] = []
        self.task_conns: list[Connection] = []
        self.result_conns: list[Connection] = []
        self.fd_sockets: list[Any] = []  # main ends; the worker ends close with their thread
        # Threads still in user code after shutdown gave up on them (names, worker ids).
        self.stuck: list[str] = []
        self.stuck_ids: list[int] = []
        self._exits: dict[int, BaseException] = {}  # why a thread ended, if not asked to
        self.closed = False
        self._shutdown_lock = threading.Lock()
        try:
            for setup in setups:
                task_reader, task_writer, result_reader, result_writer = worker_pipes(
                    multiprocessing)
                # Both ends are ours: a child forked meanwhile must not hold them open, or a
                # thread that ends (or whose pipes shutdown closes) is never read as gone,
                # nor the sockets, or one-off segments queued there outlive close().
                for conn in (task_reader, task_writer, result_reader, result_writer):
                    register_descriptor(conn, conn.fileno())
                fd_main, fd_worker = fd_socket_pair()
                for sock in (fd_main, fd_worker):  # (segments queued there: shared memory)
                    register_descriptor(sock, sock.fileno())
                self.fd_sockets.append(fd_main)
                setup = dataclasses.replace(setup, fd_socket=fd_worker)
                thread = _thread_start.Thread(
                    target=self._main, args=(setup, ring, task_reader, result_writer),
                    name=f"arena_loader-worker-{setup.worker_id}", daemon=True)
                self.task_conns.append(task_writer)
                self.result_conns.append(result_reader)
                self.threads.append(thread)
                try:
                    _thread_start.start(thread)
                except BaseException:
                    task_reader.close()
                    result_writer.close()
                    fd_worker.close()
                    raise
        except BaseException:
            self.shutdown(graceful=False)
            raise
        # Thread workers live in this process: every "worker pid" is ours.
        self.pids = [os.getpid()] * len(self.threads)
        self.sentinels: list[int] = []  # a thread that ends closes its result pipe instead

    def _main(self, setup: WorkerSetup, ring: Any, task_conn: Connection,
              result_conn: Connection) -> None:
        try:
            try:
                reader = OrderReader(setup.worker_id, setup.num_workers, setup.order_depth,
                                     setup.order_entry_nbytes, task_conn.fileno(), ring,
                                     setup.filler.reads_index_arrays)
                state = _ThreadWorkerState(setup, self)
                if setup.slot_nbytes:
                    state.attach(setup.slot_nbytes)
                # No global RNG is reseeded: random, numpy and torch state belong to the whole
                # process. WorkerInfo.seed, thread_seed and rng are there per thread.
                infos = worker_infos(setup, (setup.base_seed + setup.worker_id) % 2**64)
                set_thread_worker_info(infos[0])
                if setup.worker_init_fn is not None:
                    setup.worker_init_fn(setup.worker_id)
                state.start_threads(infos)
            except Exception as exc:
                report_worker_failure(result_conn.fileno(), setup.worker_id, exc)
                return
            serve(state, reader, result_conn.fileno(), parent_pid=None)
        except BaseException as exc:  # SystemExit from user code, or its result pipe closed
            # Without tracebacks, its own nor those of the errors it was raised from or while
            # handling: their frames hold slot arrays, which keep the slab mapped.
            self._exits[setup.worker_id] = without_tracebacks(exc)
        finally:
            set_thread_worker_info(None)
            # EOF on the result pipe is how the dispatch thread learns this worker is gone.
            task_conn.close()
            result_conn.close()
            setup.fd_socket.close()


    def crash_error(self, worker_id: int, owed: list[tuple[int, Any]]) -> WorkerCrashedError:
        """The error for a thread that ended unasked; ``owed``: (idx, indices) it had."""
        self.threads[worker_id].join(timeout=JOIN_TIMEOUT_S)  # it is closing its pipes
        cause = self._exits.get(worker_id)
        how = f"ended by {cause!r}" if cause is not None else "ended"
        loading = (" while loading " + ", ".join(f"batch idx={idx} (indices {indices!r})"
                                                  for idx, indices in owed)
                   if owed else " while idle")
        error = WorkerCrashedError(
            f"DataLoader worker thread {worker_id} (pid {os.getpid()}) {how}{loading}; a "
            "BaseException such as SystemExit in the dataset ends a thread worker: raise an "
            "Exception instead", worker_id=worker_id, pid=os.getpid(), exitcode=None)
        error.__cause__ = cause
        return error

    def exited(self) -> list[int]:
        """The threads that ended (only a crash ends one before shutdown): a child forked by
        another thread before a thread's pipes were registered with ``_forksafe`` holds its
        result pipe open, which then never reads as EOF."""
        return [worker for worker, thread in enumerate(self.threads) if not thread.is_alive()]

    def shutdown(self, graceful: bool = True) -> None:
        """Stop every thread: wait for those asked to stop (``graceful``), then close the
        pipes, each step bounded by ``JOIN_TIMEOUT_S``. Idempotent. A thread stuck in user
        code cannot be killed: it is left running as a daemon, named in ``stuck`` and in a
        warning of the ``arena_loader`` logger."""
        with self._shutdown_lock:
            if self.closed:
                return
            try:
                self._shutdown(graceful)
            finally:
                self.closed = True

    def _shutdown(self, graceful: bool) -> None:
        if graceful:
            self._join_until(time.monotonic() + JOIN_TIMEOUT_S)
        # EOF on the task pipe ends an idle thread; a closed result pipe ends one that finishes
        # its batch (its send fails), before it can take another task.
        for conn in (*self.task_conns, *self.result_conns, *self.fd_sockets):
            conn.close()
        self._join_until(time.monotonic() + JOIN_TIMEOUT_S)
        self.stuck_ids = [i for i, thread in enumerate(self.threads) if thread.is_alive()]
        self.stuck = [self.threads[i].name for i in self.stuck_ids]
        if self.stuck:
            logger.warning("thread worker(s) %s still in user code after being asked to stop; "
                           "left running as daemon thread(s) until the dataset returns (a "
                           "thread cannot be killed)", ", ".join(self.stuck))

    def _join_until(self, deadline: float) -> None:
        for thread in self.threads:
            if thread.ident is not None and thread is not threading.current_thread():
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
