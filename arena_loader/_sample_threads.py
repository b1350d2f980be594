"""The threads of one worker (``worker_threads=K``): the worker's own thread, which runs the
worker loop, plus ``K - 1`` daemon threads ``arena_loader-worker-<id>-thread-<t>`` that
live as long as the loop.

Per batch, ``run(task)`` calls ``task(t)`` in every thread ``t`` at once (0 in the caller)
and returns when all have returned. Thread ``t`` loads rows ``t, t + K, ...`` of the batch:
a fixed share, so which thread loads a sample, and so what its seeded ``rng`` draws, is the
same in every run (docs/design.md, "Threads inside workers").
"""

from __future__ import annotations

import io
import queue
import sys
import threading
import types
import warnings
from collections.abc import Callable
from typing import Any

from .worker_info import WorkerInfo, set_thread_worker_info

# How long close() waits for an extra thread to finish (one stuck in user code is a daemon
# and is left running, as a stuck thread worker is).
CLOSE_WAIT_S = 2.0


class SampleThreads:
    """``len(infos)`` threads of one worker; ``infos[t]``: what ``get_worker_info()`` answers
    in thread ``t`` (thread 0, the caller, sets its own)."""

    def __init__(self, infos: list[WorkerInfo]):
        self.count = len(infos)
        self._tasks: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in infos[1:]]
        self._finished = threading.Semaphore(0)
        self._threads: list[threading.Thread] = []
        try:
            for t, info in enumerate(infos[1:], start=1):
                thread = threading.Thread(
                    target=self._serve, args=(self._tasks[t - 1], info),
                    name=f"arena_loader-worker-{info.id}-thread-{t}", daemon=True)
                thread.start()
                self._threads.append(thread)
        except BaseException:
            self.close()
            raise

    def _serve(self, tasks: queue.SimpleQueue, info: WorkerInfo) -> None:
        set_thread_worker_info(info)
        try:
            while True:
                task = tasks.get()
                if task is None:
                    return
                try:
                    task(info.thread_id)
                finally:  # tasks catch their own errors; whatever happens, the batch goes on
                    self._finished.release()
        finally:
            set_thread_worker_info(None)

    def run(self, task: Callable[[int], None]) -> None:
        """``task(t)`` in every thread; returns once every call has returned, even when the
        caller's own call raised, so no thread still writes into the batch's storage."""
        for tasks in self._tasks:
            tasks.put(task)
        try:
            task(0)
        finally:
            for _ in self._tasks:
                self._finished.acquire()

    def close(self) -> None:
        """Stop the extra threads: each ends after its current task (bounded wait)."""
        for tasks in self._tasks:
            tasks.put(None)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=CLOSE_WAIT_S)
        self._threads = []


class FirstFailure:
    """The failure of the lowest row among a batch's threads. A thread stops at rows above
    the lowest failing row so far, but tries every row below it, so the error raised is the
    one ``worker_threads=1`` raises: that of the batch's first failing row."""

    def __init__(self) -> None:
        self.row = sys.maxsize
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    def record(self, row: int, error: BaseException) -> None:
        with self._lock:
            if row < self.row:
                self.row, self.error = row, error

    def raise_if_any(self) -> None:
        error = self.error
        if error is not None:
            self.error = None  # the batch's frames are not kept by this object
            raise error


def unsafe_attributes(dataset: Any) -> list[tuple[str, str]]:
    """(attribute, what it is) for the dataset's attributes that threads cannot share: an
    open file object (``seek`` then ``read`` from two threads interleave) and a generator or
    iterator (``next`` from two threads fails or splits the items). Only the dataset's own
    ``__dict__`` is looked at: cheap, and where such handles usually are."""
    found = []
    for name, value in getattr(dataset, "__dict__", {}).items():
        if isinstance(value, io.IOBase) and not value.closed and value.seekable():
            found.append((name, f"an open file object ({type(value).__name__})"))
        elif isinstance(value, (types.GeneratorType, map, filter, zip)) or (
                hasattr(value, "__next__") and hasattr(value, "__iter__")
                and not isinstance(value, io.IOBase)):
            found.append((name, f"an iterator ({type(value).__name__})"))
    return found


def warn_thread_unsafe(dataset: Any, worker_threads: int) -> None:
    """One ``UserWarning`` naming each attribute ``unsafe_attributes`` finds."""
    found = unsafe_attributes(dataset)
    if not found:
        return
    names = ", ".join(f"dataset.{name} is {what}" for name, what in found)
    warnings.warn(
        f"{names}, shared by the worker_threads={worker_threads} threads of each worker, "
        "which call the dataset concurrently: a file's seek() and read() from two threads "
        "interleave and return the wrong bytes, and an iterator cannot be advanced by two "
        "threads at once. Open such handles per thread (threading.local(), or read with "
        "os.pread), or pass worker_threads=1 (docs/design.md, \"Threads inside workers\")",
        UserWarning, stacklevel=3)
