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
import selectors
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler
from typing import Any

from ._arena import Arena, ArenaSource, slot_budget
from ._fetch import BatchFiller
from ._layout import RECORD_MAGIC, PlanDecoder, Record
from ._messages import (
    NO_SLOT,
    Attach,
    BatchFailed,
    WorkerFailed,
    encode_task,
    fresh_copy,
    rebuild_worker_error,
)
from ._options import LoaderOptions
from ._pool import SlotState, Waker, collect_unlocked
from ._process import JOIN_TIMEOUT_S, WorkerGroup, is_main_thread
from ._slab import Slab, receive_segment
from ._threads import ThreadWorkerGroup
from ._worker import WorkerSetup
from .errors import (
    LoaderClosedError,
    LoaderTimeoutError,
    ShmCapacityError,
    forked_iterator_error,
)

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


class _Loaded:
    """A batch a worker reported: its record, and its storage when that is a segment."""

    __slots__ = ("record", "storage")

    def __init__(self, record: Record, storage: Any):
        self.record = record
        self.storage = storage  # None: the batch is in slot record.slot of the arena


class _Session:
    def __init__(self, options: LoaderOptions, filler: BatchFiller, source: ArenaSource,
                 base_seed: int):
        self._options = options
        self._filler = filler
        self._source = source
        self._base_seed = base_seed
        self._pid = os.getpid()
        self._cv = threading.Condition()
        # Held while workers start (they are handed the slab's descriptor) and while close()
        # releases the slab: see _begin. Re-entrant: a finalizer may close during _begin.
        self._starting = threading.RLock()
        self._waker = Waker()
        self.arena: Arena | None = None
        self._arena_claimed = False
        # Before the slot budget is known: the slab the workers are started with, given its
        # size when the first batch arrives (docs/design.md, "Slot budget").
        self._reserve: Slab | None = None
        # Loaded-but-not-consumed batches (in flight or waiting) are at most this: torch's
        # prefetch_factor * num_workers, or fewer when `slots` is smaller.
        self._window = max(1, min(options.max_in_flight, options.slots_or_default - 1))
        self._decoders: list[PlanDecoder] = []
        # /dev/shm had no room for the slab: every batch goes to a segment of its own.
        self._slabless = False
        self._epoch = -1  # iterable-style datasets: tasks carry it, workers restart on a change
        self.workers: WorkerGroup | ThreadWorkerGroup | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._torn_down = False  # close() ran to its end (workers, arena, pipes released)
        self._finished = False  # closed because the epoch ended: next() is StopIteration
        self.result_bytes = 0  # bytes of worker messages (records, no arrays: tests check)
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
        self._done: dict[int, tuple[_Loaded | BatchFailed, Any]] = {}  # idx -> (what, indices)
        # The consumer holds held_batch_limit batches: the dispatch thread waits for one back.
        self._held_blocked = False
        self._held_overflow = False  # a batch went to a segment because every slot is held
        self._stash: Any = None  # a batch built for a next() that Ctrl-C interrupted
        # The entry between being taken and being handed over: an interrupt there puts it
        # back (see next_batch, _take_locked).
        self._taken: Any = None
        self._window_full = False  # the dispatch thread waits for the consumer to take one
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
        ``_cv`` only while the session is open, and undone otherwise; and close() releases the
        slab only once no worker is being started with its descriptor (``_starting``), or a
        forked worker could inherit that number already reused for another file.
        """
        with self._starting:
            self._begin_locked()

    def _begin_locked(self) -> None:
        if self.arena is None and self._reserve is None:
            try:
                arena = self._source.claim()  # None until the first batch sets the budget
            except ShmCapacityError:
                arena, self._slabless = None, True  # a segment per batch (see _attach)
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
        slab = arena.slab if arena is not None else self._reserve
        self._decoders = [PlanDecoder() for _ in range(options.num_workers)]
        setups = [
            WorkerSetup(worker_id=i, num_workers=options.num_workers, filler=self._filler,
                        slot_nbytes=arena.slot_nbytes if arena is not None else 0,
                        slab=slab.handle(), slots=self._source.slots, fd_socket=None,
                        base_seed=self._base_seed, worker_init_fn=options.worker_init_fn,
                        arm_parent_death_signal=is_main_thread(),
                        publish_to_torch="torch" in sys.modules)
            for i in range(options.num_workers)
        ]
        if options.worker_mode == "thread":
            return ThreadWorkerGroup(setups, slab)
        context = options.start_context()
        if context.get_start_method() == "fork":
            self._filler.warm_up()
        return WorkerGroup(context, setups)

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
        while True:
            with self._cv:
                if self._stop_requested or self._fatal is not None:
                    return False
                if self._exhausted:
                    return bool(self._in_flight)
                if len(self._in_flight) + len(self._done) >= self._window:
                    self._window_full = True  # the consumer wakes us when it takes one
                    return True
                self._window_full = False
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
                slot = self._choose_slot_locked()
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
                self.workers.send_bytes(worker_id, encode_task(idx, slot, indices, self._epoch))
            except OSError:  # its task pipe is closed: the worker is dead
                crash = self._crash_error(worker_id)
                # Not `from None`: a WorkerFailed error returned here keeps its cause.
                raise crash from crash.__cause__

    def _choose_slot_locked(self) -> int | None:
        """A free slot; NO_SLOT (a one-off segment) before the slab exists or while the
        consumer holds every slot; None while it holds ``held_batch_limit`` batches."""
        if self.arena is None:
            return NO_SLOT
        slot = self.arena.pool.acquire()
        if slot is not None:
            self._held_blocked = False
            return slot
        if self._source.over_limit(self.arena):
            self._held_blocked = True
            return None
        self._held_overflow = True
        return NO_SLOT

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
        self._handle(worker_id, payload)
        return None

    def _crash_error(self, worker_id: int) -> BaseException:
        """The error for a dead worker, after taking in what it sent before dying: its last
        results, or the ``WorkerFailed`` that explains the exit (which then wins)."""
        conn = self.workers.result_conns[worker_id]
        try:
            while conn.poll(0):
                self._handle(worker_id, conn.recv_bytes())
        except (EOFError, OSError):
            pass
        if self._worker_failure is not None:
            return self._worker_failure
        with self._cv:
            owed = [(idx, indices) for idx, (worker, _, indices) in self._in_flight.items()
                    if worker == worker_id]
        return self.workers.crash_error(worker_id, owed)

    def _handle(self, worker_id: int, payload: bytes) -> None:
        if payload[:1] == RECORD_MAGIC:
            self._file_record(worker_id, self._decoders[worker_id].decode(payload), len(payload))
            return
        message = ForkingPickler.loads(payload)
        with self._cv:
            self.result_bytes += len(payload)
            self.results_received += 1
            if isinstance(message, WorkerFailed):
                # Not _fatal yet: next() raises it only once the workers are stopped (_fail).
                self._worker_failure = self._worker_failure or rebuild_worker_error(message)
            else:
                _, slot, indices = self._check_owed(worker_id, message.idx, message.slot)
                if slot != NO_SLOT:
                    self.arena.pool.reclaim(slot)
                if not self._stop_requested:
                    self._file_locked(message.idx, message, indices)
            self._cv.notify_all()

    def _check_owed(self, worker_id: int, idx: int, slot: int) -> tuple[int, int, Any]:
        """The in-flight entry a worker's message answers; a RuntimeError (fatal: the
        session stops) when the worker names a batch or slot it was not given."""
        entry = self._in_flight.get(idx)
        if entry is None or entry[0] != worker_id or slot not in (entry[1], NO_SLOT):
            raise RuntimeError(
                f"arena_loader worker {worker_id} reported batch idx={idx} in slot {slot}, but "
                f"that is not a batch it was loading ({entry and (entry[0], entry[1])}); the "
                "worker process is corrupt (a dataset writing to its result pipe?)")
        return self._in_flight.pop(idx)

    def _file_locked(self, idx: int, what: Any, indices: Any) -> None:
        self._done[idx] = (what, indices)
        if not self._options.in_order:
            self._completion_order.append(idx)

    def _file_record(self, worker_id: int, record: Record, nbytes: int) -> None:
        """A batch loaded (or an iterator ended): map its segment, size the slab from the
        session's first batch, and file it for the consumer."""
        storage = None
        if record.segment:
            storage = receive_segment(self.workers.fd_sockets[worker_id], record.idx,
                                      record.plan.nbytes)
        if self.arena is None and record.plan is not None and not self._slabless:
            self._attach(record.plan.nbytes)
        with self._cv:
            self.result_bytes += nbytes
            self.results_received += 1
            _, slot, indices = self._check_owed(worker_id, record.idx, record.slot)
            if record.ended:
                self._active[worker_id] = False
            if slot != NO_SLOT and (record.slot == NO_SLOT or self._stop_requested
                                    or record.ended):
                self.arena.pool.reclaim(slot)  # unused (segment, ended) or not wanted now
            elif slot != NO_SLOT:
                if record.plan.nbytes > self.arena.slot_nbytes:
                    raise RuntimeError(f"arena_loader worker {worker_id} wrote batch "
                                       f"idx={record.idx} of {record.plan.nbytes} bytes into a "
                                       f"slot of {self.arena.slot_nbytes}")
                self.arena.pool.mark_filled(slot)
            if not self._stop_requested:
                self._file_locked(record.idx, record if record.ended else
                                  _Loaded(record, storage), indices)
            self._cv.notify_all()

    def _attach(self, first_nbytes: int) -> None:
        """The session's first batch sets the slot budget: size the reserved slab for it and
        tell every worker to map it. A full /dev/shm raises ShmCapacityError here (-> next())."""
        with self._cv:  # whoever takes the reserve (this or close()) owns it
            reserve, self._reserve = self._reserve, None
            if self._closed or reserve is None:
                if reserve is not None:
                    reserve.close()
                raise LoaderClosedError("this iterator was closed")
        try:
            arena = self._source.claim(slot_budget(first_nbytes), slab=reserve)
        except ShmCapacityError:
            # No room for `slots` batches at once: go on with a segment per batch, which is
            # all torch needs; a batch that does not fit either is that batch's error.
            self._slabless = True
            return
        with self._cv:
            if self._closed:
                self._source.unclaim(arena)
                raise LoaderClosedError("this iterator was closed")
            self.arena, self._arena_claimed = arena, True
            arena.pool.waker = self._waker
        for worker_id in range(self._options.num_workers):
            try:
                self.workers.send(worker_id, Attach(arena.slot_nbytes))
            except OSError:  # its task pipe is closed: that worker is dead
                crash = self._crash_error(worker_id)
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
            for what, _ in self._done.values() if self.arena is not None else ():
                if isinstance(what, _Loaded) and what.storage is None:
                    self.arena.pool.reclaim(what.record.slot)
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
        if self._stash is not None:  # built by a next() that Ctrl-C interrupted: it is next
            batch, self._stash = self._stash, None
            return batch
        if not self._started and not self._closed:
            self._begin()
        if self.arena is not None:
            self._source.check_limit(self.arena)
        timeout = self._options.timeout
        deadline = time.monotonic() + timeout if timeout > 0 else None
        collected = False
        try:
            self._wait_for_entry(deadline, timeout, collected)  # sets _taken
            return self._hand_over()
        except KeyboardInterrupt:
            taken, self._taken = self._taken, None
            if taken is not None:  # taken, not handed over: back to the front of the queue
                with self._cv:
                    self._unget_locked(taken)
            raise

    def _wait_for_entry(self, deadline: float | None, timeout: float, collected: bool) -> None:
        """Take the next entry (under ``_cv``) into ``_taken``, or raise the error or
        StopIteration that ends the wait. ``_taken`` holds it until it is handed over, so
        Ctrl-C in between puts it back."""
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
                if self._take_locked() is not None:
                    return  # in self._taken
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
                        raise self._source.limit_error(self.arena)
                    collect_unlocked(self._cv)
                    collected = True
                    self._waker.wake()  # batches freed by the collector: dispatch again
                    self._cv.wait(0.05)
                    continue
                wait_s = CONSUMER_POLL_S
                if deadline is not None:
                    wait_s = min(wait_s, deadline - time.monotonic())
                    if wait_s <= 0:
                        raise LoaderTimeoutError(self._timeout_message(timeout))
                if not self._cv.wait(wait_s) and not self._thread_alive():
                    if self._fatal is None and not (self._exhausted and not self._in_flight):
                        raise RuntimeError("the arena_loader dispatch thread stopped unexpectedly")
    def _hand_over(self) -> Any:
        """The taken entry as the consumer's batch (or its error raised). Ctrl-C in here:
        a built batch is stashed for the next next(), an unbuilt one stays in ``_taken``."""
        batch = None
        entry = self._taken
        try:
            what, indices = entry
            if isinstance(what, BatchFailed):
                error = rebuild_worker_error(what, indices, what.idx)
                self._taken = None  # handed out: raised on the next line
                raise error
            if self._held_overflow:
                self._held_overflow = False
                self._source.note_overflow(self.arena)
            record = what.record
            with self._cv:
                if self._closed:  # closed by another thread while this batch was taken
                    raise LoaderClosedError("this iterator was closed; call iter(loader) for "
                                            "a new one")
            batch = self._source.deliver(self.arena, None if what.storage is not None
                                         else record.slot, what.storage, record.plan,
                                         record.idx, indices)
            self._taken = None
            return batch
        except KeyboardInterrupt:
            # Ctrl-C after the batch was taken: it is not lost. Built, it is handed out by
            # the next next(); not yet leased, it stays in _taken (next_batch puts it back).
            if batch is not None:
                self._stash, self._taken = batch, None
            elif isinstance(entry[0], _Loaded) and entry[0].storage is None and \
                    self.arena.pool.state(entry[0].record.slot) is not SlotState.FILLED:
                self._taken = None  # leased and lost mid-assembly: nothing to put back
            raise
        except BaseException:
            self._taken = None
            what = entry[0] if entry is not None else None
            record = what.record if isinstance(what, _Loaded) else None
            if record is None:
                raise
            # Not delivered (a bad object leaf, close() from another thread): the slot would
            # otherwise stay FILLED, lost to every later epoch.
            if what.storage is None and \
                    self.arena.pool.state(record.slot) is SlotState.FILLED:
                self.arena.pool.reclaim(record.slot)
            raise

    def _unget_locked(self, entry: tuple[Any, Any]) -> None:
        """Put a taken entry back where ``_take_locked`` found it."""
        what = entry[0]
        idx = what.idx if isinstance(what, BatchFailed) else what.record.idx
        self._done[idx] = entry
        if self._options.in_order:
            self._rcvd_idx = min(self._rcvd_idx, idx)
        else:
            self._completion_order.appendleft(idx)

    def _take_locked(self) -> tuple[_Loaded | BatchFailed, Any] | None:
        """The next batch to hand out, also kept in ``_taken`` from the moment it is taken
        (so Ctrl-C anywhere after puts it back: next_batch); skips the batches an ended
        iterator did not make."""
        while True:
            if self._options.in_order:
                idx = self._rcvd_idx
                entry = self._done.get(idx)
                if entry is not None:
                    self._taken = entry  # from here on, an interrupt puts it back
                    self._rcvd_idx = idx + 1
                    del self._done[idx]
            else:
                entry = None
                while entry is None and self._completion_order:
                    idx = self._completion_order[0]
                    entry = self._done.get(idx)
                    self._taken = entry
                    self._completion_order.popleft()
                    self._done.pop(idx, None)
            if entry is not None and self._window_full:
                self._window_full = False
                self._waker.wake()
            if entry is None or not isinstance(entry[0], Record):
                return entry
            self._taken = None  # an ended iterator's record: dropped, not handed out

    def _starved_locked(self) -> bool:
        """Nothing in flight or ready, a batch's indices waiting, and the consumer holds
        ``held_batch_limit`` batches. (While the sampler is still producing those indices, or
        ends the epoch, this is not starvation.)"""
        if (self._in_flight or self._done or self._pending is _NO_PENDING
                or self.arena is None or not self._held_blocked):
            return False
        return self._source.over_limit(self.arena)

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
        """Idempotent; safe from a finalizer. Workers joined, undelivered slots reclaimed.
        A close that Ctrl-C interrupted is finished by the next call."""
        if os.getpid() != self._pid:
            return  # a finalizer copied into a forked worker: this session is not its own
        with self._cv:
            if self._torn_down:
                return
            self._closed = True
            self._stop_requested = True
            self._cv.notify_all()
        self._waker.wake()
        try:
            self._join_thread(raise_on_timeout=False)
        finally:
            self._release_all()

    def _release_all(self) -> None:
        with self._starting:  # not while workers are being started with the slab's descriptor
            if self.workers is not None:
                self._kill_workers()
            if self.arena is not None:
                self._release_arena()
            with self._cv:
                reserve, self._reserve = self._reserve, None
            if reserve is not None:
                reserve.close()
            self._waker.close()
            self._torn_down = True


class MultiProcessIterator:
    """What ``iter(loader)`` returns when ``num_workers > 0``."""

    def __init__(self, owner: Any, options: LoaderOptions, filler: BatchFiller,
                 source: ArenaSource, batches: Iterator, base_seed: int):
        # The loader: `for b in ArenaLoader(...)` must keep it alive. Batches come converted
        # (to tensors, or leases for a device stage) from ArenaSource.deliver.
        self._owner = owner
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
            return self._session.next_batch()
        except StopIteration:
            if not self._persistent:
                self._session.finish()
            raise

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
        self._session.close()  # finishes a close that Ctrl-C interrupted; else a no-op
