"""The worker pipeline behind ``iter(loader)`` when ``num_workers > 0``.

A ``Session`` owns the workers, the order ring and the completion reader of one iterator,
and runs on the consumer's thread: ``next()`` tops up the read-ahead window (the sampler is
drawn there, as torch draws it), reads completion records from the worker that owes the next
batch, and leases its slot. No thread relays batches (docs/design.md, "Data flow").

Locking: one re-entrant lock, held by ``next()`` and ``close()``, released only while
``next()`` waits for a worker or runs the sampler, so ``close()`` from another thread (or a
finalizer) never waits on user code; whoever retakes the lock checks the phase first.
"""

from __future__ import annotations

import enum
import gc
import os
import select
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any

from .. import _forksafe
from .._arena import Arena, ArenaSource, slot_budget
from .._fetch import BatchFiller
from .._messages import NO_SLOT, fresh_copy, rebuild_worker_error
from .._options import LoaderOptions
from .._pool import SlotState, Waker
from .._process import JOIN_TIMEOUT_S, WorkerGroup, is_main_thread
from .._slab import Slab, receive_segment
from .._threads import ThreadWorkerGroup
from .._worker import WorkerSetup
from ..errors import LoaderClosedError, LoaderTimeoutError, ShmCapacityError, forked_iterator_error
from .completions import ENDED, FAILED, LOADED, SEGMENT, WORKER_FAILED, Completion, CompletionReader
from .order import EntryKind, OrderRing
from .reorder import Reorderer

# The longest single wait; results, worker exits, freed slots and close() all end it at once.
POLL_S = 0.5
_NO_PENDING = object()  # not None: an iterable-style dataset's "indices" are None


class Phase(enum.Enum):
    STARTING = "starting"  # no epoch begun yet (workers start at the first begin)
    RUNNING = "running"
    DRAINING = "draining"  # taking back the last epoch's batches (persistent workers)
    FAILED = "failed"  # a fatal error: raised by every next(); a new epoch needs a new session
    FINISHED = "finished"  # the epoch ended and the session shut down: next() stops
    CLOSED = "closed"


_MOVES = {
    Phase.STARTING: {Phase.RUNNING, Phase.FAILED, Phase.CLOSED},
    Phase.RUNNING: {Phase.DRAINING, Phase.FAILED, Phase.FINISHED, Phase.CLOSED},
    Phase.DRAINING: {Phase.RUNNING, Phase.FAILED, Phase.CLOSED},
    Phase.FAILED: {Phase.CLOSED},
    Phase.FINISHED: set(),
    Phase.CLOSED: set(),
}


class Session:
    def __init__(self, options: LoaderOptions, filler: BatchFiller, source: ArenaSource,
                 base_seed: int):
        self._options = options
        self._filler = filler
        self._source = source
        self._base_seed = base_seed
        self._pid = os.getpid()
        self._generation = _forksafe.generation()
        # Held for short steps by next() and close(), never while waiting or in user code.
        self._lock = threading.RLock()
        # Held for a whole next() or epoch start: one consumer at a time. close() never
        # takes it, so it never waits for a next() that waits.
        self._consumer = threading.RLock()
        self._closing = threading.RLock()  # one close() at a time (re-entrant: finalizers)
        self._waker = Waker()
        self.phase = Phase.STARTING
        self.arena: Arena | None = None
        self._arena_claimed = False
        # Before the slot budget is known: the slab the workers are started with, given its
        # size when the first batch arrives (docs/design.md, "Slot budget").
        self._reserve: Slab | None = None
        self._slabless = False  # /dev/shm had no room for the slab: a segment per batch
        # Loaded-but-not-taken batches are at most this: torch's prefetch_factor *
        # num_workers, or fewer when `slots` is smaller.
        self._window = max(1, min(options.max_in_flight, options.slots_or_default - 1))
        self.workers: WorkerGroup | ThreadWorkerGroup | None = None
        self._ring: OrderRing | None = None
        self._reader: CompletionReader | None = None
        self._last_reader: CompletionReader | None = None
        self._stuck_slots: set[int] = set()  # written by thread workers stuck in user code
        self._poller: Any = None
        self._fd_owner: dict[int, tuple[int, bool]] = {}  # fd -> (worker, is sentinel)
        self._epoch = -1
        self._fatal: BaseException | None = None
        self._reset_epoch_state(iter(()))

    # -- phases -----------------------------------------------------------------------

    def _enter(self, phase: Phase) -> None:
        if phase is not self.phase and phase not in _MOVES[self.phase]:
            raise RuntimeError(f"session cannot go from {self.phase.value} to {phase.value} "
                               "(arena_loader bug: please report it)")
        self.phase = phase

    @property
    def broken(self) -> bool:
        """Closed, or a fatal error: the next epoch needs a new session."""
        return self.phase in (Phase.FAILED, Phase.FINISHED, Phase.CLOSED)

    def _check_open(self) -> None:
        if self.phase is Phase.FINISHED:
            raise StopIteration
        if self.phase is Phase.CLOSED:
            raise LoaderClosedError("this iterator was closed; call iter(loader) for a new one")

    # -- epochs -----------------------------------------------------------------------

    def start_epoch(self, batches: Iterator) -> None:
        """Begin an epoch: workers start (first epoch) and the read-ahead window is sent."""
        with self._consumer:
            with self._lock:
                self._check_open()
                if self.phase is Phase.FAILED:
                    raise fresh_copy(self._fatal)
                draining = self.phase is Phase.RUNNING
                if draining:
                    self._enter(Phase.DRAINING)
            if draining:
                self._drain()
            with self._lock:
                self._check_open()
                self._reset_epoch_state(batches)
                self._epoch += 1
                self._begin()
            self._fill_window()

    def _reset_epoch_state(self, batches: Iterator) -> None:
        self._batches = batches
        self._pending: Any = _NO_PENDING  # indices drawn, waiting for a slot
        self._started = False
        self._send_idx = 0
        self._order = Reorderer(self._options.in_order)
        self._exhausted = False
        self._sampler_error: BaseException | None = None
        self._held_blocked = False  # the consumer holds held_batch_limit batches
        self._held_overflow = False  # a batch went to a segment: every slot is held
        self._stash: Any = None  # a batch built for a next() that Ctrl-C interrupted
        self._taken: Completion | None = None  # taken, not yet handed over (see next_batch)
        self._active = [True] * self._options.num_workers  # iterables: iterator not ended
        self._next_worker = 0

    def _begin(self) -> None:
        """Claim the arena if the layout is known (else reserve a slab) and start workers if
        there are none."""
        if self.arena is None and self._reserve is None:
            try:
                arena = self._source.claim()  # None until the first batch sets the budget
            except ShmCapacityError:
                arena, self._slabless = None, True
            if arena is not None:
                self.arena, self._arena_claimed = arena, True
                arena.pool.waker = self._waker
            else:
                self._reserve = Slab.reserve()
        if self.workers is None:
            self._start_workers()
        self._enter(Phase.RUNNING)
        self._started = True

    def _start_workers(self) -> None:
        options, arena = self._options, self.arena
        slab = arena.slab if arena is not None else self._reserve
        ring = self._ring = OrderRing(options.num_workers, self._window + 2,
                                      self._filler.batch_size or 1)
        setups = [
            WorkerSetup(worker_id=i, num_workers=options.num_workers, filler=self._filler,
                        slot_nbytes=arena.slot_nbytes if arena is not None else 0,
                        slab=slab.handle(), slots=self._source.slots, fd_socket=None,
                        base_seed=self._base_seed, worker_init_fn=options.worker_init_fn,
                        arm_parent_death_signal=is_main_thread(),
                        publish_to_torch="torch" in sys.modules,
                        order=ring.handle() if options.worker_mode != "thread" else None,
                        order_depth=ring.depth, order_entry_nbytes=ring.entry_nbytes)
            for i in range(options.num_workers)
        ]
        if options.worker_mode == "thread":
            workers: Any = ThreadWorkerGroup(setups, slab, ring.mapping)
        else:
            context = options.start_context()
            if context.get_start_method() == "fork":
                self._filler.warm_up()
            workers = WorkerGroup(context, setups)
        self.workers = workers
        ring.connect([conn.fileno() for conn in workers.task_conns])
        self._reader = CompletionReader([conn.fileno() for conn in workers.result_conns])
        poller = select.poll()
        self._fd_owner = {}
        for worker, fd in enumerate(self._reader.fds):
            poller.register(fd, select.POLLIN)
            self._fd_owner[fd] = (worker, False)
        for worker, fd in enumerate(workers.sentinels):
            poller.register(fd, select.POLLIN)
            self._fd_owner[fd] = (worker, True)
        poller.register(self._waker.fileno(), select.POLLIN)
        self._poller = poller

    def _drain(self) -> None:
        """Persistent workers: take back the last epoch's batches (in flight: wait for them;
        arrived: reclaim their slots), so every slot is free for the next epoch. A worker that
        dies or does not answer in time gets the whole group stopped (new ones start)."""
        deadline = time.monotonic() + max(JOIN_TIMEOUT_S, self._options.timeout or 0) * 5
        try:
            while True:
                with self._lock:
                    self._check_open()
                    if not self._order.in_flight or self.phase is not Phase.DRAINING:
                        break
                    if time.monotonic() >= deadline:
                        self._stop_workers(graceful=False)
                        break
                self._wait(min(POLL_S, max(0.0, deadline - time.monotonic())))
        except BaseException:
            with self._lock:
                if self.phase is Phase.DRAINING:
                    self._stop_workers(graceful=False)
                    self._enter(Phase.RUNNING)
            raise
        with self._lock:
            self._check_open()
            self._reclaim_done()
            if self.phase is Phase.FAILED:
                raise fresh_copy(self._fatal)
            self._enter(Phase.RUNNING)
            if self.workers is not None and self.workers.closed:
                self.workers = None  # stopped after a crash or a stuck drain: start afresh
                self._close_channels()

    # -- publishing the batch order ------------------------------------------------------

    def _fill_window(self) -> None:
        """Send batches while the window, free slots and the sampler allow; the sampler runs
        outside the lock (a slow one must not hold up close())."""
        while True:
            with self._lock:
                self._check_open()
                if not self._publish():
                    return
            self._draw()

    def _publish(self) -> bool:
        """Send the drawn batches the window allows; True when the next needs a draw."""
        order = self._order
        while (not self._exhausted and self.phase is Phase.RUNNING
               and len(order.in_flight) + len(order.done) < self._window):
            if self._pending is _NO_PENDING:
                return True
            worker = self._pick_worker()
            if worker is None:
                self._exhausted = True
                return False
            slot = self._choose_slot()
            if slot is None:
                return False  # a freed slot wakes the waiting next()
            if not self._send(worker, slot):
                return False
        return False

    def _send(self, worker: int, slot: int) -> bool:
        """Publish the pending batch to ``worker`` in ``slot``. Its in-flight entry is written
        first and taken back unless the ring took the entry, so an interrupt anywhere leaves
        the batch either sent and owed, or pending."""
        idx, indices, ring = self._send_idx, self._pending, self._ring
        seq = ring.next_seq(worker)
        owed = None if self._filler.iterable else indices
        try:
            self._order.in_flight[idx], self._pending, self._send_idx = (
                (worker, slot, owed), _NO_PENDING, idx + 1)
            kind = EntryKind.STREAM if self._filler.iterable else EntryKind.INDICES
            sent = ring.publish(worker, kind, idx, slot, self._epoch, indices)
        except BaseException as exc:
            if not ring.is_published(worker, seq):
                self._unsend(idx, indices, slot)
            if isinstance(exc, KeyboardInterrupt):
                raise
            self._fail(exc)  # e.g. indices that do not pickle: no worker can load them
            return False
        if not sent:  # its pipe is closed: that worker is dead
            self._unsend(idx, indices, slot)
            self._crash(worker)
            return False
        if self._filler.iterable:
            self._next_worker = worker + 1
        return True

    def _unsend(self, idx: int, indices: Any, slot: int) -> None:
        self._order.in_flight.pop(idx, None)
        self._pending, self._send_idx = indices, idx
        if slot != NO_SLOT:
            self.arena.pool.reclaim(slot)

    def _draw(self) -> None:
        """The sampler's next indices into ``_pending`` (lock not held). Its error is raised
        at its batch's turn, after the batches before it."""
        try:
            self._pending = next(self._batches)
        except StopIteration:
            self._exhausted = True
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            self._sampler_error, self._exhausted = _detached(exc), True

    def _choose_slot(self) -> int | None:
        """A free slot; NO_SLOT (a one-off segment) before the slab exists or while the
        consumer holds every slot; None while it holds ``held_batch_limit`` batches."""
        if self.arena is None:
            return NO_SLOT
        slot = self.arena.pool.acquire()
        if slot is None and self._reconcile_slots():
            slot = self.arena.pool.acquire()
        if slot is not None:
            self._held_blocked = False
            return slot
        if self._source.over_limit(self.arena):
            self._held_blocked = True
            return None
        self._held_overflow = True
        return NO_SLOT

    def _reconcile_slots(self) -> int:
        """Recover slots no batch owns (a Ctrl-C between taking a slot and recording its
        batch, or between filing and handing out): run only when no slot is free, and at
        teardown. A stuck thread worker's slot stays owned for good. Returns how many."""
        order = self._order
        owned = {entry[1] for entry in order.in_flight.values()} | self._stuck_slots
        owned.update(ready.slot for ready in order.done.values() if ready.storage is None)
        if self._taken is not None and self._taken.storage is None:
            owned.add(self._taken.slot)
        return self.arena.pool.reconcile(owned)

    def _pick_worker(self) -> int | None:
        """The worker for the next batch (torch's round robin); iterable-style datasets skip
        workers whose iterator ended; None when all have."""
        workers = self._options.num_workers
        if not self._filler.iterable:
            return self._send_idx % workers
        for step in range(workers):
            worker = (self._next_worker + step) % workers
            if self._active[worker]:
                return worker
        return None

    # -- receiving completions --------------------------------------------------------

    def _wait(self, timeout_s: float) -> None:
        """Take in what workers have sent; if nothing, wait up to ``timeout_s`` (lock not
        held) for a record, a worker's exit, a freed slot or close()."""
        with self._lock:
            self._check_open()
            owed = self._order.owed_by(self._order.next_idx) if self._options.in_order else None
            if owed is not None and self._receive(owed):
                return
            poller = self._poller
        events = poller.poll(max(0, int(timeout_s * 1000))) if poller is not None else []
        with self._lock:
            self._check_open()
            for fd, _ in events:
                owner = self._fd_owner.get(fd)
                if owner is None:
                    self._waker.drain()
                elif self.phase not in (Phase.RUNNING, Phase.DRAINING):
                    return
                elif owner[1]:
                    self._crash(owner[0])
                else:
                    self._receive(owner[0])

    def _receive(self, worker: int) -> bool:
        """File what ``worker`` has sent; True if anything came."""
        got = self._reader.fill(worker) if self._reader is not None else False
        self._file_arrived()
        if got is None:
            self._crash(worker)
            return True
        return got

    def _file_arrived(self) -> None:
        """File the parsed records in order; each leaves the queue only once filed."""
        reader = self._reader
        while reader is not None and reader.arrived:
            self._file(reader.arrived[0])
            if reader.arrived:  # a failure filed on the way may have emptied it
                reader.arrived.popleft()

    def _file(self, completion: Completion) -> None:
        """One record: check it answers a batch in flight, then file it for the consumer (or,
        while draining, take its slot back). Filing the same record twice is a no-op."""
        status, idx, worker, slot = (completion.status, completion.idx, completion.worker,
                                     completion.slot)
        if self.phase not in (Phase.RUNNING, Phase.DRAINING):
            return  # failed: the workers are stopped and every slot they had is reclaimed
        if status == WORKER_FAILED:
            error = rebuild_worker_error(ForkingPickler.loads(completion.body))
            if self.phase is Phase.DRAINING:
                self._stop_workers(graceful=False)  # the next epoch starts new workers
            else:
                self._fail(error)
            return
        order = self._order
        if idx in order.done:  # filed already (interrupted right after)
            order.in_flight.pop(idx, None)
            return
        entry = order.in_flight.get(idx)
        if entry is None and idx < self._send_idx:
            return  # filed and taken already: a record parsed twice
        if entry is None or entry[0] != worker or entry[1] != slot:
            raise RuntimeError(
                f"arena_loader worker {worker} reported batch idx={idx} in slot {slot}, but "
                f"that is not a batch it was loading ({entry and entry[:2]}); the worker "
                "process is corrupt")
        if status == SEGMENT and completion.storage is None:
            completion.storage = receive_segment(self.workers.fd_sockets[worker], idx,
                                                 completion.plan.nbytes)
        draining = self.phase is Phase.DRAINING
        if slot != NO_SLOT:
            if status == LOADED and not draining:
                if completion.plan.nbytes > self.arena.slot_nbytes:
                    raise RuntimeError(f"arena_loader worker {worker} wrote batch idx={idx} "
                                       f"of {completion.plan.nbytes} bytes into a slot of "
                                       f"{self.arena.slot_nbytes}")
                self.arena.pool.mark_filled(slot)
            else:
                self.arena.pool.reclaim(slot)  # not used (segment, ended, failed), not wanted
        if draining:
            order.in_flight.pop(idx, None)
            return
        if status == ENDED:
            self._active[worker] = False
        elif self.arena is None and completion.plan is not None and not self._slabless:
            self._attach(completion.plan.nbytes)
        completion.indices = entry[2]
        order.arrive(completion)

    def _attach(self, first_nbytes: int) -> None:
        """The session's first batch sets the slot budget: size the reserved slab for it and
        tell every worker to map it. A full /dev/shm raises ShmCapacityError (-> next())."""
        reserve, self._reserve = self._reserve, None
        try:
            arena = self._source.claim(slot_budget(first_nbytes), slab=reserve)
        except ShmCapacityError:
            # No room for `slots` batches at once: go on with a segment per batch, which is
            # all torch needs; a batch that does not fit either is that batch's error.
            self._slabless = True
            return
        self.arena, self._arena_claimed = arena, True
        arena.pool.waker = self._waker
        for worker in range(self._options.num_workers):
            if not self._ring.publish(worker, EntryKind.ATTACH, idx=arena.slot_nbytes):
                self._crash(worker)
                return

    def _crash(self, worker: int) -> None:
        """``worker`` is gone: take in what it sent before, then fail the session with the
        error that explains it (its own report, if it sent one, wins)."""
        while self.phase is Phase.RUNNING and self._reader is not None \
                and self._reader.fill(worker):
            self._file_arrived()
        self._file_arrived()
        if self.phase is Phase.DRAINING:  # the old epoch's batches are not wanted anyway
            self._stop_workers(graceful=False)
        if self.phase is not Phase.RUNNING:
            return
        owed = [(idx, indices) for idx, (owner, _, indices) in self._order.in_flight.items()
                if owner == worker]
        self._fail(self.workers.crash_error(worker, owed))

    def _fail(self, error: BaseException) -> None:
        """A fatal error: stop the workers first, so that when next() raises it no worker of
        this session runs. Batches already received are still handed out first, as torch."""
        if self.phase is Phase.FAILED:
            return
        self._fatal = error
        self._enter(Phase.FAILED)
        self._stop_workers(graceful=False)
        self._close_channels()

    def _stop_workers(self, graceful: bool) -> None:
        """Stop the group; then every slot it was writing is safe to reuse."""
        workers = self.workers
        if workers is None:
            return
        workers.shutdown(graceful)
        # A thread worker left stuck in user code may still write the slot of the entry it is
        # on (its oldest): that slot stays ASSIGNED for good, so it is never handed out again.
        stuck = set(getattr(workers, "stuck_ids", ()))
        in_flight = self._order.in_flight
        for idx in sorted(in_flight):
            worker, slot, _ = in_flight[idx]
            if worker in stuck:
                stuck.discard(worker)
                self._stuck_slots.add(slot)
            elif slot != NO_SLOT and self.arena.pool.state(slot) is not SlotState.FREE:
                self.arena.pool.reclaim(slot)
            del in_flight[idx]

    # -- the consumer -----------------------------------------------------------------

    def next_batch(self) -> Any:
        if _forksafe.generation() != self._generation:
            raise forked_iterator_error(self._pid)
        with self._consumer:
            try:
                return self._next_batch()
            except KeyboardInterrupt:
                with self._lock:
                    taken, self._taken = self._taken, None
                    if taken is not None:  # taken, not handed over: back to the front
                        self._order.unget(taken)
                raise

    def _next_batch(self) -> Any:
        with self._lock:
            if self._stash is not None:  # built by a next() that Ctrl-C interrupted
                batch, self._stash = self._stash, None
                return batch
            self._check_open()
            if not self._started and self.phase is Phase.STARTING:
                self._begin()
            if self.arena is not None:
                self._source.check_limit(self.arena)
        batch = None
        try:
            batch = self._wait_for_batch()
            # The window has room for the batch just taken: send the next one now, as torch
            # does, so workers go on while the training step runs.
            self._fill_window()
            return batch
        except BaseException:
            if batch is not None:
                self._stash = batch  # handed out by the next next()
            raise

    def _wait_for_batch(self) -> Any:
        timeout = self._options.timeout
        deadline = time.monotonic() + timeout if timeout > 0 else None
        collected = False
        while True:
            with self._lock:
                self._check_open()
                if self._take():
                    return self._hand_over()
                if self.phase is Phase.FAILED:
                    self._release_arena()  # a broken session keeps no slot of the loader's
                    raise fresh_copy(self._fatal)
                if self._exhausted and not self._order.in_flight:
                    error, self._sampler_error = self._sampler_error, None
                    if error is not None:
                        raise error
                    raise StopIteration
                starved = self._starved()
                if starved and collected:
                    raise self._source.limit_error(self.arena)
                wait_s = POLL_S
                if deadline is not None:
                    wait_s = min(wait_s, deadline - time.monotonic())
                    if wait_s <= 0:
                        raise LoaderTimeoutError(self._timeout_message(timeout))
            if starved:
                gc.collect()  # views in reference cycles give their slots back
                collected = True
                continue
            self._fill_window()  # a slot freed since, or a draw left pending
            self._wait(wait_s)

    def _take(self) -> bool:
        """Move the next batch to hand out into ``_taken`` (so Ctrl-C from here on puts it
        back: next_batch); skips ended iterators' marks. False: none is ready."""
        while True:
            self._taken = ready = self._order.take()
            if ready is None:
                return False
            self._order.taken(ready)
            if ready.status != ENDED:
                return True
            self._taken = None

    def _hand_over(self) -> Any:
        """The taken batch as the consumer's (or its error raised). Ctrl-C in here: a built
        batch is stashed for the next next(), an unbuilt one stays in ``_taken``."""
        ready = completion = self._taken
        batch = None
        try:
            if completion.status == FAILED:
                self._taken = None  # handed out: raised on the next line
                raise rebuild_worker_error(ForkingPickler.loads(completion.body),
                                           ready.indices, ready.idx)
            if self._held_overflow:
                self._held_overflow = False
                self._source.note_overflow(self.arena)
            in_slot = ready.storage is None
            batch = self._source.deliver(self.arena, completion.slot if in_slot else None,
                                         ready.storage, completion.plan, ready.idx,
                                         ready.indices)
            self._taken = None
            return batch
        except KeyboardInterrupt:
            if batch is not None:
                self._stash, self._taken = batch, None
            elif ready.storage is None and completion.status == LOADED and \
                    self.arena.pool.state(completion.slot) is not SlotState.FILLED:
                self._taken = None  # leased and lost mid-assembly: nothing to put back
            raise
        except BaseException:
            self._taken = None
            # Not delivered (a bad object leaf): the slot would otherwise stay FILLED.
            if completion.status == LOADED and ready.storage is None and \
                    self.arena.pool.state(completion.slot) is SlotState.FILLED:
                self.arena.pool.reclaim(completion.slot)
            raise

    def _starved(self) -> bool:
        """Nothing in flight or ready, a batch's indices waiting, and the consumer holds
        ``held_batch_limit`` batches."""
        if (self._order.in_flight or self._order.done or self._pending is _NO_PENDING
                or self.arena is None or not self._held_blocked):
            return False
        return self._source.over_limit(self.arena)

    def _timeout_message(self, timeout: float) -> str:
        message = f"DataLoader timed out after {timeout} seconds"
        in_flight = self._order.in_flight
        waiting = [f"batch idx={idx} (indices {in_flight[idx][2]!r}) from worker "
                   f"{in_flight[idx][0]} (pid {self.workers.pids[in_flight[idx][0]]})"
                   for idx in self._order.owed() if idx in in_flight]
        if waiting:
            message += (f" waiting for {', '.join(waiting)}, which is still running; raise "
                        "`timeout` if loading is this slow")
        return message

    # -- teardown ---------------------------------------------------------------------

    def finish(self) -> None:
        """The epoch ended and no epoch follows on these workers: shut them down."""
        with self._lock:
            if self.phase is Phase.RUNNING:
                self._enter(Phase.FINISHED)
        self.close()

    def close(self) -> None:
        """Idempotent; safe from a finalizer and from another thread. Workers joined,
        undelivered slots reclaimed. A close that Ctrl-C interrupted is finished by the next
        call."""
        if os.getpid() != self._pid:
            return  # a finalizer copied into a forked worker: this session is not its own
        with self._closing:
            self._waker.wake()  # a next() waiting for workers returns and finds the phase
            with self._lock:
                if self.phase is not Phase.FINISHED:
                    self._enter(Phase.CLOSED)
                workers = self.workers
                if workers is not None and self._ring is not None and not workers.closed:
                    for worker in range(self._options.num_workers):
                        self._ring.publish(worker, EntryKind.STOP)
            if workers is not None:
                # Not under the lock: a next() waiting in another thread raises meanwhile.
                workers.shutdown(graceful=True)
            with self._lock:
                self._stop_workers(graceful=True)  # the group is down: reclaims its slots
                self.workers = None
                self._close_channels()
                self._release_arena()
                if self._reserve is not None:
                    self._reserve.close()
                    self._reserve = None
                self._waker.close()

    @property
    def closed(self) -> bool:
        return self.phase in (Phase.CLOSED, Phase.FINISHED)

    @property
    def stats(self) -> dict[str, int]:
        reader = self._reader or self._last_reader
        return {"results_received": reader.records if reader else 0,
                "result_bytes": reader.nbytes if reader else 0}

    def _close_channels(self) -> None:
        if self._reader is not None:
            self._reader.arrived.clear()  # not filed: their slots are reclaimed with the rest
        if self._ring is not None:
            self._ring.close()
            self._ring = None
        if self._reader is not None:
            self._last_reader = self._reader  # its counts stay readable (stats)
        self._poller, self._fd_owner, self._reader = None, {}, None

    def _reclaim_done(self) -> None:
        for ready in self._order.clear_done():
            if ready.storage is None and ready.status == LOADED and self.arena is not None:
                self.arena.pool.reclaim(ready.slot)

    def _release_arena(self) -> None:
        """Give the arena back to the loader (idempotent); in-flight slots must be reclaimed."""
        if not self._arena_claimed:
            return
        self._reclaim_done()
        self._reconcile_slots()
        self._arena_claimed = False
        self.arena.pool.waker = None
        self._source.unclaim(self.arena)


def _detached(error: BaseException) -> BaseException:
    """``error`` kept to raise later, without its traceback: the traceback's frames lead back
    (``f_back``) to ``next()``'s and so to the iterator, which could then only be freed by the
    cyclic garbage collector, and its workers would outlive a dropped iterator. The sampler's
    traceback text stays with it as a note."""
    text = "".join(traceback.format_exception(error))
    error = error.with_traceback(None)
    error.__context__ = None
    if hasattr(error, "add_note"):
        error.add_note(f"Raised by the sampler while the next batches were drawn ahead:\n{text}")
    return error


class MultiProcessIterator:
    """What ``iter(loader)`` returns when ``num_workers > 0``."""

    def __init__(self, owner: Any, options: LoaderOptions, filler: BatchFiller,
                 source: ArenaSource, batches: Iterator, base_seed: int):
        # The loader: `for b in ArenaLoader(...)` must keep it alive. Batches come converted
        # (to tensors, or leases for a device stage) from ArenaSource.deliver.
        self._owner = owner
        self._persistent = options.persistent_workers
        self._session = Session(options, filler, source, base_seed)
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
        """Pids of the workers; empty until they start."""
        workers = self._session.workers
        return list(workers.pids) if workers is not None else []

    @property
    def stats(self) -> dict[str, int]:
        """Completion records received and their bytes (no array travels in them)."""
        return self._session.stats

    def close(self) -> None:
        self._finalizer()
        self._session.close()  # finishes a close that Ctrl-C interrupted; else a no-op
