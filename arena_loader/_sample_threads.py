"""The threads of one worker (``worker_threads=K``): the worker's own thread, which runs the
worker loop, plus ``K - 1`` daemon threads ``arena_loader-worker-<id>-thread-<t>`` that
live as long as the loop.

Per batch, ``run(task)`` calls ``task(t)`` for every lane ``t`` in ``range(K)`` and returns
when all have returned; or in two steps, ``submit(task)`` (the extra threads start their
lanes) then ``finish(job)`` (the caller's lanes, then the wait), so that the worker submits
its next batch before it finishes this one, and the extra threads go on to it without
waiting at this batch's end (docs/design.md, "Threads inside workers").

Lane ``t`` loads rows ``t, t + K, ...`` of the batch, with lane
``t``'s ``get_worker_info()``: a fixed share, so which lane loads a sample, and so what its
seeded ``rng`` draws, is the same in every run. ``active`` threads run the K lanes (thread
``j`` runs lanes ``j, j + active, ...`` in turn), and ``Pace`` sets ``active`` after each
batch from what the threads spent their time on: fewer while they queue for cores that are
full (threads then only take turns, and each turn costs cache), all K while samples wait
(docs/design.md, "Threads inside workers").
"""

from __future__ import annotations

import io
import os
import queue
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from .worker_info import WorkerInfo, set_thread_worker_info, thread_worker_info

# How long close() waits for an extra thread to finish (one stuck in user code is a daemon
# and is left running, as a stuck thread worker is).
CLOSE_WAIT_S = 2.0


class Job:
    """One batch's lanes (``SampleThreads.submit``): ``finished`` is released once by each
    extra thread that ran its lanes of it, ``escaped`` holds what they raised."""

    __slots__ = ("active", "began", "escaped", "finished", "task")

    def __init__(self, task: Callable[[int], None], active: int):
        self.task, self.active = task, active
        self.began = time.perf_counter_ns()
        self.finished = threading.Semaphore(0)
        self.escaped: list[BaseException] = []


class SampleThreads:
    """``len(infos)`` threads of one worker; ``infos[t]``: what ``get_worker_info()`` answers
    in thread ``t`` (thread 0, the caller, sets its own)."""

    def __init__(self, infos: list[WorkerInfo], paced: bool = True):
        self.count = len(infos)  # lanes: row shares, each with its own worker info
        self.active = self.count  # threads that run them (Pace moves it)
        self._infos = infos
        self._pace = Pace(self.count) if paced and self.count > 1 else None
        self._tasks: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in infos[1:]]
        self._outstanding: Job | None = None  # submitted and not yet finished (the last)
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
                job = tasks.get()
                if job is None:
                    return
                try:
                    self._run_lanes(info.thread_id, job.task, job.active)
                except BaseException as exc:  # (tasks catch their own) raised by finish():
                    job.escaped.append(exc)  # a thread that ended would wait for good
                finally:
                    job.finished.release()
        finally:
            set_thread_worker_info(None)
            if self._pace is not None:
                self._pace.forget(info.thread_id)

    def run(self, task: Callable[[int], None]) -> None:
        """``task(t)`` for every lane; returns once every call has returned, even when the
        caller's own call raised, so no thread still writes into the batch's storage. What
        a call in another thread raised is raised here then (the caller's own first)."""
        self.finish(self.submit(task))

    def submit(self, task: Callable[[int], None]) -> Job:
        """The extra threads' lanes of ``task`` start (after those of a job submitted
        before); the caller's own run in ``finish``. A job submitted while another is
        outstanding runs on as many threads as it, so each lane stays with one thread and
        meets its batches in order (its rng draws as without the overlap)."""
        outstanding = self._outstanding
        active = outstanding.active if outstanding is not None else self.active
        job = self._outstanding = Job(task, active)
        for tasks in self._tasks[: active - 1]:
            tasks.put(job)
        return job

    def overlaps(self) -> bool:
        """Whether a job submitted now runs beside the outstanding one on the same threads
        (after a ``Pace`` change it would not: the caller then submits it once the
        outstanding one is finished)."""
        outstanding = self._outstanding
        return outstanding is None or outstanding.active == self.active

    def finish(self, job: Job, between: Callable[[], None] | None = None) -> None:
        """The caller's lanes of ``job``, then ``between()`` if given, then the wait for the
        others' lanes (as ``run``)."""
        try:
            self._run_lanes(0, job.task, job.active)
            if between is not None:
                between()
        finally:
            for _ in range(job.active - 1):
                job.finished.acquire()
            if self._outstanding is job:
                self._outstanding = None
        if job.escaped:
            raise job.escaped[0]
        if self._pace is not None:
            self.active = self._pace.next_active(job.active,
                                                 time.perf_counter_ns() - job.began)

    def _run_lanes(self, thread: int, task: Callable[[int], None], active: int) -> None:
        """Thread ``thread``'s lanes of this batch, each with its lane's worker info."""
        pace = self._pace
        start = pace.start(thread) if pace is not None else None
        own = thread_worker_info()
        try:
            for lane in range(thread, self.count, active):
                if lane == thread:
                    task(lane)
                    continue
                set_thread_worker_info(self._infos[lane])
                try:
                    task(lane)
                finally:
                    set_thread_worker_info(own)
        finally:
            if start is not None:
                pace.stop(thread, start)

    def close(self) -> None:
        """Stop the extra threads: each ends after its current task (bounded wait)."""
        for tasks in self._tasks:
            tasks.put(None)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=CLOSE_WAIT_S)
        self._threads = []
        if self._pace is not None:
            self._pace.forget(0)


class Pace:
    """How many threads a worker's next batch runs on, from how its threads spent the last
    one: time on a core (``thread_time_ns``) and time waiting in a run queue for one
    (Linux's per-thread ``/proc/thread-self/schedstat``). Waiting for a core
    (``SHRINK_QUEUED`` of the threads' time or more): the cores are full, and more threads
    only take turns on them, so halve. Mostly neither on a core nor queued (``GROW_ASLEEP``:
    samples wait for storage, a lock, the GIL) with little queueing (``GROW_QUEUED``), while
    the worker's threads together keep less than ``GROW_BUSY`` of one core busy: double, up
    to every lane (threads that wait for the GIL keep one core busy between them: more
    would only wait too). Where schedstat cannot be read, every lane keeps a thread."""

    SHRINK_QUEUED = 0.25
    GROW_ASLEEP = 0.5
    GROW_QUEUED = 0.1
    GROW_BUSY = 0.75

    def __init__(self, lanes: int):
        self.lanes = lanes
        self._fds: list[int] = [-1] * lanes  # each thread's own schedstat, opened by it
        self._spent = [(0, 0, 0)] * lanes  # per thread: (wall, on a core, queued) ns
        self.usable = True

    def start(self, thread: int) -> tuple[int, int, int] | None:
        queued = self._queued(thread) if self.usable else None
        if queued is None:
            return None
        return time.perf_counter_ns(), time.thread_time_ns(), queued

    def stop(self, thread: int, start: tuple[int, int, int]) -> None:
        queued = self._queued(thread)
        if queued is not None:
            self._spent[thread] = (time.perf_counter_ns() - start[0],
                                   time.thread_time_ns() - start[1], queued - start[2])

    def _queued(self, thread: int) -> int | None:
        """ns the calling thread has waited in a run queue so far (schedstat's second field,
        counted when the thread gets a core: up to date while it runs; its first field, time
        on a core, lags by the slice in progress, so ``thread_time_ns`` gives that). None,
        and no pacing from now on, where it cannot be read."""
        try:
            fd = self._fds[thread]
            if fd < 0:
                fd = self._fds[thread] = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
            return int(os.pread(fd, 64, 0).split()[1])
        except (OSError, ValueError, IndexError):
            self.usable = False
            return None

    def next_active(self, active: int, elapsed: int) -> int:
        """Threads for the next batch, after one of ``elapsed`` ns on ``active`` threads."""
        if not self.usable:
            return self.lanes
        wall = on_core = queued = 0
        for spent in self._spent[:active]:
            wall, on_core, queued = wall + spent[0], on_core + spent[1], queued + spent[2]
        if wall <= 0 or elapsed <= 0:
            return active
        asleep = wall - on_core - queued
        if queued >= self.SHRINK_QUEUED * wall:
            return max(1, active // 2)
        if asleep >= self.GROW_ASLEEP * wall and queued < self.GROW_QUEUED * wall \
                and on_core < self.GROW_BUSY * elapsed:
            return min(self.lanes, active * 2)
        return active

    def forget(self, thread: int) -> None:
        """``thread`` is ending: close its schedstat descriptor."""
        fd, self._fds[thread] = self._fds[thread], -1
        if fd >= 0:
            os.close(fd)


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
        elif isinstance(value, Iterator) and not isinstance(value, io.IOBase):
            # (The type's methods, as next() looks them up: an attribute's own __getattr__,
            # a proxy's that raises or one that answers every name, is not asked.)
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
