"""Epoch iterators: in-process (``num_workers=0``) and the worker-process pipeline.

The multi-process pipeline (docs/design.md, "Data flow"): a ``_Session`` owns the workers
and a thread that dispatches ``Task(idx, slot, indices)`` round-robin, waits on every result
pipe, every worker's sentinel and a wake-up pipe at once, and files results by ``idx``. The
consumer's ``__next__`` takes them in order (or completion order) and leases the slot.
The outer iterator object is what user code holds; the thread references only the session,
so an abandoned iterator is garbage-collected and its ``weakref.finalize`` shuts it down.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler
from typing import Any

from ._arena import Arena
from ._fetch import BatchFiller
from ._messages import BatchFailed, BatchReady, Task, WorkerFailed
from ._options import LoaderOptions
from ._pool import SlotState, Waker
from ._process import JOIN_TIMEOUT_S, WorkerGroup, is_main_thread
from ._worker import WorkerSetup
from .errors import LoaderClosedError, LoaderTimeoutError

# The dispatch thread's longest sleep; it is woken at once by results, worker exits and
# released slots, so this only bounds how stale a stop request can get.
THREAD_POLL_S = 1.0
# The consumer's longest sleep between checks that the dispatch thread is alive.
CONSUMER_POLL_S = 0.5
THREAD_JOIN_TIMEOUT_S = 10.0


class ArenaSource:
    """The loader's arena, made from the first batch's layout and kept across epochs.

    One iterator at a time uses it; a second live iterator of the same loader gets a private
    arena of its own, closed with that iterator.
    """

    def __init__(self, slots: int):
        self.slots = slots
        self.layout = None
        self._arena: Arena | None = None
        self._claimed = False
        self._lock = threading.Lock()

    def claim(self, layout: Any) -> Arena:
        with self._lock:
            if self._arena is None:
                self._arena, self.layout = Arena(layout, self.slots), layout
            if not self._claimed:
                self._claimed = True
                return self._arena
        return Arena(layout, self.slots)

    def unclaim(self, arena: Arena) -> None:
        with self._lock:
            if arena is self._arena:
                self._claimed = False
                return
        arena.close()

    def close(self) -> None:
        with self._lock:
            if self._arena is not None:
                self._arena.close()
                self._arena = None


def start_epoch(filler: BatchFiller, source: ArenaSource,
                batches: Iterator) -> tuple[Arena | None, BatchReady | None, int]:
    """Claim an arena; on a loader's first epoch, load batch 0 here to learn the layout.

    Returns (arena, batch 0 if it was loaded here, idx of the next batch to load); the arena is
    None when the epoch is empty and no layout is known yet.
    """
    if source.layout is not None:
        return source.claim(source.layout), None, 0
    indices = next(batches, None)
    if indices is None:
        return None, None, 0
    fetched = filler.fetch(indices)
    layout = filler.layout_for(fetched, indices)
    arena = source.claim(layout)
    try:
        slot = arena.acquire_or_raise()
        try:
            rows, lengths, objects = filler.write(layout, arena.arrays(slot), fetched, indices)
        except BaseException:
            arena.pool.reclaim(slot)
            raise
    except BaseException:
        source.unclaim(arena)
        raise
    arena.pool.mark_filled(slot)
    return arena, BatchReady(0, slot, rows, lengths, objects), 1


def rebuild_worker_error(failure: BatchFailed | WorkerFailed, indices: Any = None,
                         idx: int | None = None) -> BaseException:
    """The worker's exception, re-created with its type, tagged with worker, idx and indices."""
    error = failure.error
    where = (f"while loading batch idx={idx} (indices {indices!r})" if idx is not None
             else "while starting (slab attach, seeding or worker_init_fn)")
    message = (f"Caught {error.type_name} in DataLoader worker {failure.worker_id} {where}.\n"
               f"Original traceback in the worker:\n{error.traceback}")
    original = error.original()
    exc_type = type(original) if original is not None else RuntimeError
    if issubclass(exc_type, KeyError):
        message = _ReadableMessage(message)  # KeyError's str() is the repr of its argument
    try:
        exc = exc_type(message)
    except Exception:  # an exception type whose constructor wants other arguments
        exc = RuntimeError(message)
    exc.__cause__ = original
    exc.worker_id = failure.worker_id  # type: ignore[attr-defined]
    exc.batch_idx = idx  # type: ignore[attr-defined]
    exc.indices = indices  # type: ignore[attr-defined]
    return exc


class _ReadableMessage(str):
    """A str whose repr is itself, so ``str(KeyError(msg))`` shows the traceback readably."""

    def __repr__(self) -> str:
        return str(self)


class InProcessIterator:
    """``num_workers=0``: the consumer's thread fetches and writes each batch into a slot."""

    def __init__(self, owner: Any, filler: BatchFiller, source: ArenaSource,
                 batches: Iterator):
        self._owner = owner  # the loader: `for b in ArenaLoader(...)` must keep it alive
        self._filler = filler
        self._batches = batches
        self._arena, first, _ = start_epoch(filler, source, batches)
        # Batch 0 when this iterator loaded it and has not delivered it yet; the finalizer
        # reclaims its slot if the iterator is abandoned first.
        self._undelivered: list[BatchReady] = [first] if first is not None else []
        self._done = self._arena is None
        self._pending: Any = None  # the next batch's indices, taken before its slot
        self._finalizer = (
            weakref.finalize(self, _release_in_process, source, self._arena, self._undelivered)
            if self._arena is not None else None)

    def __iter__(self) -> InProcessIterator:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        arena = self._arena
        if self._undelivered:
            first = self._undelivered.pop()
            return arena.deliver(first.slot, first.rows, first.lengths, first.objects)
        # Indices first, so the end of the epoch is StopIteration even while the consumer holds
        # every slot; kept in _pending if no slot is free, so no batch is lost.
        if self._pending is None:
            try:
                self._pending = next(self._batches)
            except StopIteration:
                self.close()
                raise
        slot = arena.acquire_or_raise()
        indices, self._pending = self._pending, None
        try:
            fetched = self._filler.fetch(indices)
            rows, lengths, objects = self._filler.write(arena.layout, arena.arrays(slot),
                                                        fetched, indices)
        except BaseException:
            arena.pool.reclaim(slot)
            raise
        arena.pool.mark_filled(slot)
        return arena.deliver(slot, rows, lengths, objects)

    def close(self) -> None:
        self._done = True
        if self._finalizer is not None:
            self._finalizer()


def _release_in_process(source: ArenaSource, arena: Arena, undelivered: list) -> None:
    while undelivered:
        arena.pool.reclaim(undelivered.pop().slot)
    source.unclaim(arena)


class _Session:
    """Workers, dispatch thread and epoch state of a multi-process iterator.

    Everything below ``_cv`` is shared between the dispatch thread and the consumer; the
    worker processes are touched only by the thread while it runs, and by ``close`` after it
    has been joined.
    """

    def __init__(self, options: LoaderOptions, filler: BatchFiller, source: ArenaSource,
                 base_seed: int):
        self._options = options
        self._filler = filler
        self._source = source
        self._base_seed = base_seed
        self._cv = threading.Condition()
        self._waker = Waker()
        self.arena: Arena | None = None
        self.workers: WorkerGroup | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._finished = False  # closed because the epoch ended: next() is StopIteration
        self.result_bytes = 0  # pickled bytes received from workers (no arrays: tests check)
        self.results_received = 0
        self._reset_epoch_state(iter(()), 0)
        self._exhausted = True

    # -- epoch lifecycle (consumer thread) ------------------------------------------------

    def start_epoch(self, batches: Iterator) -> None:
        if self._closed:
            raise LoaderClosedError("this iterator was closed; call iter(loader) for a new one")
        self._finish_epoch()
        if self.arena is None:
            self.arena, first, next_idx = start_epoch(self._filler, self._source, batches)
            if self.arena is None:  # an empty first epoch
                self._reset_epoch_state(batches, 0)
                self._exhausted = True
                return
            self.arena.pool.waker = self._waker
        else:
            first, next_idx = None, 0
        self._reset_epoch_state(batches, next_idx)
        if first is not None:
            self._done[0] = first
            self._completion_order.append(0)
        if self.workers is None:
            self.workers = self._start_workers()
        self._thread = threading.Thread(target=self._run, name="arena_loader-dispatch",
                                        daemon=True)
        self._thread.start()

    def _reset_epoch_state(self, batches: Iterator, next_idx: int) -> None:
        self._batches = batches
        self._send_idx = next_idx
        self._rcvd_idx = 0
        self._in_flight: dict[int, tuple[int, int, Any]] = {}  # idx -> (worker, slot, indices)
        self._done: dict[int, BatchReady | BatchFailed] = {}
        self._indices: dict[int, Any] = {}  # idx -> indices, for error messages
        self._completion_order: deque[int] = deque()
        self._pending: Any = None
        self._exhausted = False
        self._fatal: BaseException | None = None
        self._stop_requested = False

    def _start_workers(self) -> WorkerGroup:
        options, arena = self._options, self.arena
        setups = [
            WorkerSetup(worker_id=i, num_workers=options.num_workers, filler=self._filler,
                        layout=arena.layout, slab=arena.slab.handle(), slots=arena.slots,
                        base_seed=self._base_seed, worker_init_fn=options.worker_init_fn,
                        arm_parent_death_signal=is_main_thread())
            for i in range(options.num_workers)
        ]
        return WorkerGroup(options.context, setups)

    def _finish_epoch(self) -> None:
        """Stop the thread and take back every slot the old epoch had not delivered."""
        thread = self._thread
        if thread is None:
            return
        with self._cv:
            self._stop_requested = True
        self._waker.wake()
        self._join_thread()
        if self._in_flight and self.workers is not None:
            self._drain_in_flight()
        with self._cv:
            for msg in self._done.values():
                if isinstance(msg, BatchReady):
                    self.arena.pool.reclaim(msg.slot)
            self._done.clear()
        if self.workers is not None and self.workers.closed:
            self.workers = None  # killed after a crash or a stuck drain: start afresh

    def _join_thread(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None or thread is threading.current_thread():
            return
        # The thread wakes within THREAD_POLL_S; only a sampler stuck in user code holds it.
        thread.join(timeout=THREAD_JOIN_TIMEOUT_S)
        if thread.is_alive():
            raise RuntimeError(
                f"the arena_loader dispatch thread did not stop within {THREAD_JOIN_TIMEOUT_S} s; "
                "it is probably blocked inside the sampler or batch_sampler")

    def _drain_in_flight(self) -> None:
        """Persistent workers: wait out the old epoch's tasks so their slots can be reused.

        A worker that dies or does not answer in time gets the whole group stopped, after
        which its slots are safe to reuse.
        """
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
        waitables = [*self.workers.waitables, self._waker]
        try:
            while True:
                with self._cv:
                    if self._stop_requested or self._fatal is not None:
                        return
                    self._dispatch_locked()
                    if self._exhausted and not self._in_flight:
                        return
                for ready in wait(waitables, timeout=THREAD_POLL_S):
                    if ready is self._waker:
                        self._waker.drain()
                        continue
                    crash = self._receive(ready)
                    with self._cv:
                        if crash is not None and self._fatal is None:
                            self._fatal = crash
                        failed = self._fatal is not None
                        self._cv.notify_all()
                    if failed:
                        self._kill_workers()
                        return
        except BaseException as exc:  # a dead worker, a sampler error or a bug
            with self._cv:
                self._fatal = self._fatal or exc
                self._cv.notify_all()  # never leave next() waiting
            self._kill_workers()
        finally:
            with self._cv:
                self._cv.notify_all()

    def _dispatch_locked(self) -> None:
        options, pool = self._options, self.arena.pool
        while not self._exhausted and len(self._in_flight) < options.max_in_flight:
            # Indices before the slot (see InProcessIterator.__next__).
            if self._pending is None:
                try:
                    self._pending = next(self._batches)
                except StopIteration:
                    self._exhausted = True
                    self._cv.notify_all()
                    return
            slot = pool.acquire()
            if slot is None:
                return
            indices, self._pending = self._pending, None
            idx = self._send_idx
            # Round-robin as torch does, so which worker (and so which seed) loads a batch
            # is reproducible.
            worker_id = idx % options.num_workers
            try:
                self.workers.send(worker_id, Task(idx, slot, indices))
            except OSError:  # its task pipe is closed: the worker is dead
                pool.reclaim(slot)
                raise self._crash_error(worker_id) from None
            self._in_flight[idx] = (worker_id, slot, indices)
            self._indices[idx] = indices
            self._send_idx += 1

    def _receive(self, ready: Any) -> BaseException | None:
        """Handle one readable object from ``wait``; returns an error if a worker died."""
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
        return self._fatal or self.workers.crash_error(worker_id)

    def _handle(self, payload: bytes) -> None:
        message = ForkingPickler.loads(payload)
        with self._cv:
            self.result_bytes += len(payload)
            self.results_received += 1
            if isinstance(message, WorkerFailed):
                self._fatal = self._fatal or rebuild_worker_error(message)
            else:
                self._in_flight.pop(message.idx)
                if isinstance(message, BatchReady):
                    self.arena.pool.mark_filled(message.slot)
                else:
                    self.arena.pool.reclaim(message.slot)
                if not self._stop_requested:
                    self._done[message.idx] = message
                    self._completion_order.append(message.idx)
                elif isinstance(message, BatchReady):
                    self.arena.pool.reclaim(message.slot)
            self._cv.notify_all()

    def _kill_workers(self) -> None:
        """After a crash: stop the group, then every slot it held is safe to reuse."""
        self.workers.shutdown()
        with self._cv:
            for _, slot, _ in self._in_flight.values():
                self.arena.pool.reclaim(slot)
            self._in_flight.clear()

    # -- the consumer ---------------------------------------------------------------------

    def next_batch(self) -> Any:
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
                if self._fatal is not None:
                    raise self._fatal
                message = self._take_locked()
                if message is not None:
                    break
                if self._exhausted and not self._in_flight:
                    raise StopIteration
                if self._starved_locked():
                    if collected:
                        raise self.arena.exhausted_error()
                    self._cv.release()
                    try:
                        gc.collect()  # batches caught in cycles release their slots here
                    finally:
                        self._cv.acquire()
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
        if isinstance(message, BatchFailed):
            raise rebuild_worker_error(message, self._indices.pop(message.idx, None),
                                       message.idx)
        self._indices.pop(message.idx, None)
        return self.arena.deliver(message.slot, message.rows, message.lengths, message.objects)

    def _timeout_message(self, timeout: float) -> str:
        message = f"DataLoader timed out after {timeout} seconds"
        owed = self._in_flight.get(self._rcvd_idx) if self._options.in_order else None
        if owed is not None and self.workers is not None:
            worker_id, _, indices = owed
            message += (f" waiting for batch idx={self._rcvd_idx} (indices {indices!r}) from "
                        f"worker {worker_id} (pid {self.workers.pids[worker_id]}), which is "
                        "still running; raise `timeout` if loading is this slow")
        return message

    def _take_locked(self) -> BatchReady | BatchFailed | None:
        if self._options.in_order:
            message = self._done.pop(self._rcvd_idx, None)
            if message is not None:
                self._rcvd_idx += 1
            return message
        while self._completion_order:
            message = self._done.pop(self._completion_order.popleft(), None)
            if message is not None:
                return message
        return None

    def _starved_locked(self) -> bool:
        """Nothing in flight or ready, batches left, and the consumer holds every slot."""
        if self._in_flight or self._done or self._exhausted or self.arena is None:
            return False
        return self.arena.pool.counts()[SlotState.FREE] == 0

    @property
    def broken(self) -> bool:
        """A worker died or failed to start: the next epoch needs new workers."""
        return self._closed or self._fatal is not None

    def finish(self) -> None:
        """The epoch ended and no epoch follows on these workers: shut them down."""
        self._finished = True
        self.close()

    def _thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- teardown -------------------------------------------------------------------------

    def close(self) -> None:
        """Idempotent; safe from a finalizer. Workers joined, undelivered slots reclaimed."""
        if self._closed:
            return
        self._closed = True
        with self._cv:
            self._stop_requested = True
            self._cv.notify_all()
        self._waker.wake()
        try:
            self._join_thread()
        finally:
            self._release()

    def _release(self) -> None:
        if self.workers is not None:
            self.workers.shutdown()
        if self.arena is not None:
            with self._cv:
                for _, slot, _ in self._in_flight.values():
                    self.arena.pool.reclaim(slot)
                self._in_flight.clear()
                for message in self._done.values():
                    if isinstance(message, BatchReady):
                        self.arena.pool.reclaim(message.slot)
                self._done.clear()
            self.arena.pool.waker = None
            self._source.unclaim(self.arena)
        self._waker.close()


class MultiProcessIterator:
    """What ``iter(loader)`` returns when ``num_workers > 0``."""

    def __init__(self, owner: Any, options: LoaderOptions, filler: BatchFiller,
                 source: ArenaSource, batches: Iterator, base_seed: int):
        self._owner = owner  # the loader: `for b in ArenaLoader(...)` must keep it alive
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
        workers = self._session.workers
        return list(workers.pids) if workers is not None else []

    @property
    def stats(self) -> dict[str, int]:
        return {"results_received": self._session.results_received,
                "result_bytes": self._session.result_bytes}

    def close(self) -> None:
        self._finalizer()

