"""The worker-process pipeline behind ``iter(loader)`` when ``num_workers > 0``.

A ``_Session`` owns the workers and a dispatch thread. The thread sends
``Task(idx, slot, indices)`` round-robin, waits on every result pipe, every worker's sentinel
and a wake-up pipe at once, and files results by ``idx``; the consumer's ``next_batch`` takes
them in order (or completion order) and leases the slot (docs/design.md, "Data flow").

Locking: ``_cv`` guards the epoch state shared with the consumer. The thread never holds it
while running user code (the sampler) or writing a pipe, so neither ``next()`` nor ``close()``
can be held up by a slow sampler. ``_batches`` belongs to the thread while it runs (the
consumer reads it only in ``_begin``, before starting it); ``_pending`` is written under
``_cv`` so that ``next()`` can tell held slots from a busy sampler.
The object user code holds (``MultiProcessIterator``) is separate from the session the thread
references, so an abandoned iterator is collected and its ``weakref.finalize`` shuts it down.
"""

from __future__ import annotations

import os
import pickle
import selectors
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler
from typing import Any

from ._arena import Arena, ArenaSource
from ._fetch import BatchFiller
from ._messages import (
    NO_SLOT,
    Attach,
    BatchFailed,
    BatchReady,
    LayoutFound,
    StreamEnd,
    Task,
    WorkerFailed,
    fresh_copy,
    rebuild_worker_error,
)
from ._options import LoaderOptions
from ._pool import SlotState, Waker, collect_unlocked
from ._process import JOIN_TIMEOUT_S, WorkerGroup, is_main_thread
from ._slab import Slab
from ._threads import ThreadWorkerGroup
from ._worker import WorkerSetup
from .errors import LoaderClosedError, LoaderTimeoutError, forked_iterator_error

# The dispatch thread's longest sleep; results, worker exits, wanted slots and stop requests
# all wake it at once, so this is only a backstop.
THREAD_POLL_S = 1.0
# The consumer's longest sleep between checks that the dispatch thread is alive.
CONSUMER_POLL_S = 0.5
# Only a sampler stuck in user code can keep the thread from stopping this long. A new epoch
# waits for it (the sampler is shared); close() waits CLOSE_JOIN_TIMEOUT_S, then leaves the
# daemon thread to exit by itself when the sampler returns (it checks the stop flag first).
THREAD_JOIN_TIMEOUT_S = 10.0
CLOSE_JOIN_TIMEOUT_S = 0.5
_NO_PENDING = object()


class _Session:
    def __init__(self, options: LoaderOptions, filler: BatchFiller, source: ArenaSource,
                 base_seed: int):
        self._options = options
        self._filler = filler
        self._source = source
        self._base_seed = base_seed
        self._pid = os.getpid()
        self._cv = threading.Condition()
        self._waker = Waker()
        self.arena: Arena | None = None
        self._arena_claimed = False
        # Before the layout is known: the slab the workers are started with, given its size
        # when the first worker reports the first batch's layout (docs/design.md, "Data flow").
        self._reserve: Slab | None = None
        self._epoch = -1  # iterable-style datasets: tasks carry it, workers restart on a change
        self.workers: WorkerGroup | ThreadWorkerGroup | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._finished = False  # closed because the epoch ended: next() is StopIteration
        self.result_bytes = 0  # pickled bytes received from workers (no arrays: tests check)
        self.results_received = 0
        self._reset_epoch_state(iter(()))

    # -- epoch lifecycle (consumer thread) ------------------------------------------------

    def start_epoch(self, batches: Iterator) -> None:
        """Prepare an epoch; workers start now if the layout is known, else at next()."""
        if self._closed:
            raise LoaderClosedError("this iterator was closed; call iter(loader) for a new one")
        self._finish_epoch()
        self._reset_epoch_state(batches)
        self._epoch += 1
        self._begin()

    def _reset_epoch_state(self, batches: Iterator) -> None:
        self._batches = batches
        # Indices taken from the sampler, waiting for a slot. A sentinel, not None: an
        # iterable-style dataset's "indices" are None.
        self._pending: Any = _NO_PENDING
        self._started = False
        self._send_idx = 0
        self._rcvd_idx = 0
        self._in_flight: dict[int, tuple[int, int, Any]] = {}  # idx -> (worker, slot, indices)
        self._done: dict[int, tuple[BatchReady | BatchFailed, Any]] = {}  # idx -> (msg, indices)
        self._completion_order: deque[int] = deque()  # in_order=False only
        self._exhausted = False
        self._sampler_error: BaseException | None = None
        self._worker_failure: BaseException | None = None  # a WorkerFailed, thread-side
        self._failing = False
        self._fatal: BaseException | None = None
        self._stop_requested = False
        # Iterable-style datasets: workers whose iterator has not ended, and who is next.
        self._active = [True] * self._options.num_workers
        self._next_worker = 0

    def _begin(self) -> None:
        """Claim the arena if the layout is known (else reserve a slab for it), start workers
        if there are none, and start the dispatch thread.

        ``close()`` may run meanwhile on another thread: each result is published under
        ``_cv`` only while the session is open, and undone otherwise.
        """
        if self.arena is None and self._reserve is None:
            layout = self._source.layout
            arena = self._source.claim(layout) if layout is not None else None
            reserve = Slab.reserve() if arena is None else None
            with self._cv:
                published = not self._closed
                if published:
                    self.arena, self._reserve = arena, reserve
                    self._arena_claimed = arena is not None
                    if arena is not None:
                        arena.pool.waker = self._waker
            if not published:
                if arena is not None:
                    self._source.unclaim(arena)
                if reserve is not None:
                    reserve.close()
                raise LoaderClosedError("this iterator was closed")
        if self.workers is None:
            workers = self._start_workers()
            with self._cv:
                if not self._closed:
                    self.workers = workers
            if self.workers is not workers:
                workers.shutdown(graceful=False)
                raise LoaderClosedError("this iterator was closed")
        thread = threading.Thread(target=self._run, name="arena_loader-dispatch", daemon=True)
        with self._cv:
            if self._closed:
                raise LoaderClosedError("this iterator was closed")
            # Started under _cv, so close() never sees a thread it cannot join yet.
            thread.start()
            self._thread = thread
            self._started = True

    def _start_workers(self) -> WorkerGroup | ThreadWorkerGroup:
        options, arena = self._options, self.arena
        layout = arena.layout if arena is not None else None
        slab = arena.slab if arena is not None else self._reserve
        setups = [
            WorkerSetup(worker_id=i, num_workers=options.num_workers, filler=self._filler,
                        layout=layout, slab=slab.handle(), slots=options.slots,
                        base_seed=self._base_seed, worker_init_fn=options.worker_init_fn,
                        arm_parent_death_signal=is_main_thread(),
                        publish_to_torch="torch" in sys.modules)
            for i in range(options.num_workers)
        ]
        if options.worker_mode == "thread":
            return ThreadWorkerGroup(setups, slab)
        if options.context.get_start_method() == "fork":
            self._filler.warm_up()
        return WorkerGroup(options.context, setups)

    def _finish_epoch(self) -> None:
        """Stop the thread and take back every slot the old epoch had not delivered."""
        if self._thread is None:
            return
        with self._cv:
            self._stop_requested = True
        self._waker.wake()
        try:
            self._join_thread(raise_on_timeout=True)
        except RuntimeError as exc:
            with self._cv:  # the old thread may still dispatch: this session is done for
                self._fatal = fresh_copy(exc)
            raise
        if self._in_flight and self.workers is not None and not self.workers.closed:
            try:
                self._drain_in_flight()
            except BaseException as exc:
                # E.g. the first batch's layout arrived during the drain and the slab could
                # not be sized: the workers may hold a stale slab, so this session is over
                # (broken: the next iter() starts a new one).
                self._kill_workers(graceful=False)
                with self._cv:
                    self._fatal = fresh_copy(exc)
                raise
        self._reclaim_done()
        if self.workers is not None and self.workers.closed:
            self.workers = None  # stopped after a crash or a stuck drain: start afresh

    def _join_thread(self, raise_on_timeout: bool) -> None:
        thread, self._thread = self._thread, None
        if thread is None or thread is threading.current_thread():
            return
        thread.join(timeout=THREAD_JOIN_TIMEOUT_S if raise_on_timeout else CLOSE_JOIN_TIMEOUT_S)
        if thread.is_alive() and raise_on_timeout:
            raise RuntimeError(
                f"the arena_loader dispatch thread did not stop within {THREAD_JOIN_TIMEOUT_S} s; "
                "it is blocked inside the sampler or batch_sampler")

    def _drain_in_flight(self) -> None:
        """Persistent workers: wait out the old epoch's tasks so their slots can be reused.
        A worker that dies or does not answer in time gets the whole group stopped, after
        which its slots are safe to reuse."""
        deadline = time.monotonic() + max(JOIN_TIMEOUT_S, self._options.timeout or 0) * 5
        while self._in_flight and time.monotonic() < deadline:
            for ready in wait(self.workers.waitables, timeout=THREAD_POLL_S):
                if self._receive(ready) is not None:
                    self._kill_workers()
                    return
        if self._in_flight:
            self._kill_workers()

    # -- the dispatch thread --------------------------------------------------------------

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        try:
            for waitable in (*self.workers.waitables, self._waker):
                selector.register(waitable, selectors.EVENT_READ)
            while self._dispatch():
                for key, _ in selector.select(THREAD_POLL_S):
                    if key.fileobj is self._waker:
                        self._waker.drain()
                        continue
                    crash = self._receive(key.fileobj) or self._worker_failure
                    if crash is not None:
                        self._fail(crash)
                        return
        except BaseException as exc:  # a dead worker found while sending, or a bug
            self._fail(exc)
        finally:
            selector.close()
            with self._cv:
                self._cv.notify_all()

    def _dispatch(self) -> bool:
        """Send tasks while the prefetch window and free slots allow. False: stop the thread
        (asked to, failed, or every batch of the epoch has come back)."""
        options = self._options
        while True:
            with self._cv:
                if self._stop_requested or self._fatal is not None:
                    return False
                if self._exhausted:
                    return bool(self._in_flight)
                if len(self._in_flight) >= options.max_in_flight:
                    return True
                if self.arena is None and self._in_flight:
                    return True  # learning the layout: one batch at a time until it is known
            indices = self._pending
            if indices is _NO_PENDING:
                # Indices before a slot: the end of the epoch is StopIteration even while the
                # consumer holds every slot, and indices waiting for a slot are never lost.
                try:
                    indices = next(self._batches)
                except BaseException as exc:
                    with self._cv:
                        self._exhausted = True
                        if not isinstance(exc, StopIteration):
                            # Raised at this batch's turn, after the batches before it.
                            self._sampler_error = exc
                        self._cv.notify_all()
                    continue
            with self._cv:
                if self._stop_requested:
                    return False
                # Round-robin as torch does, so which worker (and so which seed) loads a batch
                # is reproducible; iterable-style datasets skip workers whose iterator ended.
                worker_id = self._pick_worker(self._send_idx)
                if worker_id is None:
                    self._exhausted = True
                    self._cv.notify_all()
                    continue
                # Published under _cv: next() tells "slots held" from "sampler busy" by it.
                self._pending = indices
                slot = NO_SLOT if self.arena is None else self.arena.pool.acquire()
                if slot is None:
                    self._cv.notify_all()  # next() may be deciding whether it starves
                    return True  # the waker fires when a slot comes back
                idx, indices, self._pending = self._send_idx, self._pending, _NO_PENDING
                self._send_idx += 1
                if self._filler.iterable:
                    indices = None
                    self._next_worker = worker_id + 1
                self._in_flight[idx] = (worker_id, slot, indices)
            try:
                self.workers.send(worker_id, Task(idx, slot, indices, self._epoch))
            except OSError:  # its task pipe is closed: the worker is dead
                crash = self._crash_error(worker_id)
                # Not `from None`: a WorkerFailed error returned here keeps its cause.
                raise crash from crash.__cause__

    def _pick_worker(self, idx: int) -> int | None:
        """The worker for batch ``idx``; None when every iterable's iterator has ended."""
        workers = self._options.num_workers
        if not self._filler.iterable:
            return idx % workers
        for step in range(workers):
            worker_id = (self._next_worker + step) % workers
            if self._active[worker_id]:
                return worker_id
        return None

    def _receive(self, ready: Any) -> BaseException | None:
        """Handle one readable object from a wait; returns an error if a worker died."""
        worker_id, is_pipe = self.workers.worker_of(ready)
        if not is_pipe:
            return self._crash_error(worker_id)
        try:
            payload = ready.recv_bytes()
        except (EOFError, OSError):
            return self._crash_error(worker_id)
        self._handle(payload)
        return None

    def _crash_error(self, worker_id: int) -> BaseException:
        """The error for a dead worker, after taking in what it sent before dying: its last
        results, or the ``WorkerFailed`` that explains the exit (which then wins)."""
        conn = self.workers.result_conns[worker_id]
        try:
            while conn.poll(0):
                self._handle(conn.recv_bytes())
        except (EOFError, OSError):
            pass
        if self._worker_failure is not None:
            return self._worker_failure
        with self._cv:
            owed = [(idx, indices) for idx, (worker, _, indices) in self._in_flight.items()
                    if worker == worker_id]
        return self.workers.crash_error(worker_id, owed)

    def _handle(self, payload: bytes) -> None:
        message = ForkingPickler.loads(payload)
        if isinstance(message, LayoutFound):
            self._attach(message)
            return
        with self._cv:
            self.result_bytes += len(payload)
            self.results_received += 1
            if isinstance(message, WorkerFailed):
                # Not _fatal yet: next() raises it only once the workers are stopped (_fail).
                self._worker_failure = self._worker_failure or rebuild_worker_error(message)
            else:
                _, slot, indices = self._in_flight.pop(message.idx)
                if isinstance(message, StreamEnd):
                    self._active[message.worker_id] = False
                if slot == NO_SLOT:
                    pass
                elif not isinstance(message, BatchReady) or self._stop_requested:
                    self.arena.pool.reclaim(slot)
                else:
                    self.arena.pool.mark_filled(slot)
                if not self._stop_requested:
                    self._done[message.idx] = (message, indices)
                    if not self._options.in_order:
                        self._completion_order.append(message.idx)
            self._cv.notify_all()

    def _attach(self, found: LayoutFound) -> None:
        """The first batch's layout, from the worker holding that batch: size the reserved
        slab for it, tell that worker which slot to write the batch into, and every other
        worker to map the slab. A full /dev/shm raises ShmCapacityError here (-> next())."""
        with self._cv:  # whoever takes the reserve (this or close()) owns it
            reserve, self._reserve = self._reserve, None
            if self._closed or reserve is None:
                if reserve is not None:
                    reserve.close()
                raise LoaderClosedError("this iterator was closed")
        arena = self._source.claim(found.layout, slab=reserve)
        with self._cv:
            if self._closed:
                self._source.unclaim(arena)
                raise LoaderClosedError("this iterator was closed")
            self.arena, self._arena_claimed = arena, True
            arena.pool.waker = self._waker
            slot = arena.pool.acquire()  # a new arena: every slot is free
            worker_id, _, indices = self._in_flight[found.idx]
            self._in_flight[found.idx] = (worker_id, slot, indices)
        for other in range(self._options.num_workers):
            try:
                self.workers.send(other, Attach(found.layout,
                                                slot if other == worker_id else None))
            except OSError:  # its task pipe is closed: that worker is dead
                crash = self._crash_error(other)
                raise crash from crash.__cause__

    def _fail(self, exc: BaseException) -> None:
        """A fatal error: stop the workers, then hand next() the error, so that when it is
        raised no worker of this session is left running. Batches already received are still
        delivered first, as torch does; the arena is released when the error is raised."""
        with self._cv:
            self._stop_requested = True  # results still in the pipes are reclaimed, not filed
            self._failing = True  # next() waits for _fatal instead of reading the state below
        self._kill_workers(graceful=False)
        with self._cv:
            self._fatal = self._fatal or exc
            self._cv.notify_all()

    def _kill_workers(self, graceful: bool = True) -> None:
        """Stop the group; then every slot it was writing is safe to reuse."""
        self.workers.shutdown(graceful)
        # A thread worker left stuck in user code may still write the slot of the task it is on
        # (its oldest): that slot stays ASSIGNED for good, so it is never handed out again.
        stuck = set(getattr(self.workers, "stuck_ids", ()))
        with self._cv:
            for idx in sorted(self._in_flight):
                worker, slot, _ = self._in_flight[idx]
                if worker in stuck:
                    stuck.discard(worker)
                elif slot != NO_SLOT:
                    self.arena.pool.reclaim(slot)
            self._in_flight.clear()

    def _reclaim_done(self) -> None:
        with self._cv:
            for message, _ in self._done.values() if self.arena is not None else ():
                if isinstance(message, BatchReady):
                    self.arena.pool.reclaim(message.slot)
            self._done.clear()
            self._completion_order.clear()

    def _release_arena(self) -> None:
        """Give the arena back to the loader (idempotent); in-flight slots must be reclaimed."""
        with self._cv:
            if not self._arena_claimed:
                return
            self._arena_claimed = False
        self._reclaim_done()
        self.arena.pool.waker = None
        self._source.unclaim(self.arena)

    # -- the consumer ---------------------------------------------------------------------

    def next_batch(self) -> Any:
        if os.getpid() != self._pid:
            raise forked_iterator_error(self._pid)
        if not self._started and not self._closed:
            self._begin()
        timeout = self._options.timeout
        deadline = time.monotonic() + timeout if timeout > 0 else None
        collected = False
        with self._cv:
            while True:
                if self._closed:
                    if self._finished:
                        raise StopIteration
                    raise LoaderClosedError("this iterator was closed; call iter(loader) for "
                                            "a new one")
                if self._failing and self._fatal is None:
                    self._cv.wait(CONSUMER_POLL_S)
                    continue
                entry = self._take_locked()
                if entry is not None:
                    break
                if self._fatal is not None:
                    self._release_arena()  # a broken session keeps no slot of the loader's
                    raise fresh_copy(self._fatal)
                if self._exhausted and not self._in_flight:
                    error, self._sampler_error = self._sampler_error, None
                    if error is not None:
                        raise error
                    raise StopIteration
                if self._starved_locked():
                    if collected:
                        raise self.arena.exhausted_error()
                    collect_unlocked(self._cv)
                    collected = True
                    self._cv.wait(0.05)  # let the thread dispatch into freed slots
                    continue
                wait_s = CONSUMER_POLL_S
                if deadline is not None:
                    wait_s = min(wait_s, deadline - time.monotonic())
                    if wait_s <= 0:
                        raise LoaderTimeoutError(self._timeout_message(timeout))
                if not self._cv.wait(wait_s) and not self._thread_alive():
                    if self._fatal is None and not (self._exhausted and not self._in_flight):
                        raise RuntimeError("the arena_loader dispatch thread stopped unexpectedly")
        message, indices = entry
        if isinstance(message, BatchFailed):
            raise rebuild_worker_error(message, indices, message.idx)
        try:
            return self._hand_out(message, indices)
        except BaseException:
            # Not delivered (a bad object leaf, close() from another thread, or Ctrl-C right
            # here): the slot would otherwise stay FILLED, lost to every later epoch.
            if self.arena.pool.state(message.slot) is SlotState.FILLED:
                self.arena.pool.reclaim(message.slot)
            raise

    def _hand_out(self, message: BatchReady, indices: Any) -> Any:
        objects = None
        if message.objects is not None:
            try:
                objects = pickle.loads(message.objects)
            except Exception as exc:
                raise RuntimeError(
                    f"the non-array values of batch idx={message.idx} (indices {indices!r}) "
                    f"did not unpickle in the main process: {exc!r}; return only numbers, "
                    "arrays, str or bytes from the dataset, or objects that unpickle") from exc
        with self._cv:
            if self._closed:  # closed by another thread while this batch was unpickled
                raise LoaderClosedError("this iterator was closed; call iter(loader) for a new one")
        return self.arena.deliver(message.slot, message.rows, message.lengths, objects)

    def _take_locked(self) -> tuple[BatchReady | BatchFailed, Any] | None:
        """The next batch to hand out; skips the batches an ended iterator did not make."""
        while True:
            if self._options.in_order:
                entry = self._done.pop(self._rcvd_idx, None)
                if entry is not None:
                    self._rcvd_idx += 1
            else:
                entry = None
                while entry is None and self._completion_order:
                    entry = self._done.pop(self._completion_order.popleft(), None)
            if entry is None or not isinstance(entry[0], StreamEnd):
                return entry

    def _starved_locked(self) -> bool:
        """Nothing in flight or ready, a batch's indices waiting for a slot, and the consumer
        holds every slot. (While the sampler is still producing those indices, or ends the
        epoch, this is not starvation.)"""
        if (self._in_flight or self._done or self._pending is _NO_PENDING
                or self.arena is None):
            return False
        return self.arena.pool.counts()[SlotState.FREE] == 0

    def _timeout_message(self, timeout: float) -> str:
        message = f"DataLoader timed out after {timeout} seconds"
        owed = ([self._rcvd_idx] if self._options.in_order else sorted(self._in_flight))
        waiting = [f"batch idx={idx} (indices {self._in_flight[idx][2]!r}) from worker "
                   f"{self._in_flight[idx][0]} (pid {self.workers.pids[self._in_flight[idx][0]]})"
                   for idx in owed if idx in self._in_flight]
        if waiting:
            message += (f" waiting for {', '.join(waiting)}, which is still running; raise "
                        "`timeout` if loading is this slow")
        return message

    def _thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def broken(self) -> bool:
        """Closed, or a fatal error: the next epoch needs a new session."""
        return self._closed or self._fatal is not None

    # -- teardown -------------------------------------------------------------------------

    def finish(self) -> None:
        """The epoch ended and no epoch follows on these workers: shut them down."""
        self._finished = True
        self.close()

    def close(self) -> None:
        """Idempotent; safe from a finalizer. Workers joined, undelivered slots reclaimed."""
        if os.getpid() != self._pid:
            return  # a finalizer copied into a forked worker: this session is not its own
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._stop_requested = True
            self._cv.notify_all()
        self._waker.wake()
        try:
            self._join_thread(raise_on_timeout=False)
        finally:
            if self.workers is not None:
                self._kill_workers()
            if self.arena is not None:
                self._release_arena()
            with self._cv:
                reserve, self._reserve = self._reserve, None
            if reserve is not None:
                reserve.close()
            self._waker.close()


class MultiProcessIterator:
    """What ``iter(loader)`` returns when ``num_workers > 0``."""

    def __init__(self, owner: Any, options: LoaderOptions, filler: BatchFiller,
                 source: ArenaSource, batches: Iterator, base_seed: int,
                 convert: Callable[[Any], Any] | None = None):
        self._owner = owner  # the loader: `for b in ArenaLoader(...)` must keep it alive
        self._convert = convert
        self._persistent = options.persistent_workers
        self._session = _Session(options, filler, source, base_seed)
        self._finalizer = weakref.finalize(self, self._session.close)
        try:
            self._session.start_epoch(batches)
        except BaseException:
            self.close()
            raise

    def __iter__(self) -> MultiProcessIterator:
        return self

    def __next__(self) -> Any:
        try:
            batch = self._session.next_batch()
        except StopIteration:
            if not self._persistent:
                self._session.finish()
            raise
        return batch if self._convert is None else self._convert(batch)

    def reset(self, batches: Iterator) -> None:
        """Persistent workers: begin a new epoch on the same workers and slab."""
        self._session.start_epoch(batches)

    @property
    def broken(self) -> bool:
        return self._session.broken

    @property
    def worker_pids(self) -> list[int]:
        """Pids of the workers; empty until they start (at the first next() of a loader's
        first epoch, at iter() afterwards)."""
        workers = self._session.workers
        return list(workers.pids) if workers is not None else []

    @property
    def stats(self) -> dict[str, int]:
        return {"results_received": self._session.results_received,
                "result_bytes": self._session.result_bytes}

    def close(self) -> None:
        self._finalizer()
