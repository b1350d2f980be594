"""The worker pipeline behind ``iter(loader)`` when ``num_workers > 0``.

A ``Session`` wires one iterator's parts together and runs on the consumer's thread: the
``Crew`` (workers, order ring, completion pipes), the epoch's ``Feed`` (sampler -> ring), the
``Reorderer`` (in flight -> arrived -> handed out) and the loader's arena. ``next()`` tops up
the read-ahead window, reads completion records from the worker that owes the next batch, and
leases its slot; no thread relays batches (docs/design.md, "Data flow").

Locking: ``_lock`` is held for short steps by ``next()`` and ``close()``, never while
waiting for workers or running the sampler, so ``close()`` from another thread (or a
finalizer) never waits on user code; whoever retakes it checks the phase first. ``_consumer``
is held for a whole ``next()``: one consumer at a time.
"""

from __future__ import annotations

import enum
import gc
import os
import threading
import time
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any

from .. import _forksafe
from .._arena import Arena, ArenaSource, slot_budget
from .._fetch import BatchFiller
from .._messages import NO_SLOT, fresh_copy, listed, rebuild_worker_error
from .._options import LoaderOptions
from .._pool import SlotState, Waker
from .._process import JOIN_TIMEOUT_S
from .._slab import Slab
from ..errors import LoaderClosedError, LoaderTimeoutError, ShmCapacityError, forked_iterator_error
from ..snapshot import IteratorSnapshot
from .completions import ENDED, FAILED, LOADED, SEGMENT, WORKER_FAILED, Completion
from .crew import WAKER, Crew
from .feed import NO_PENDING, Feed
from .order import EntryKind
from .reorder import Reorderer

# The longest single wait; results, worker exits, freed slots and close() all end it at once.
POLL_S = 0.5


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
        self._lock = threading.RLock()
        self._consumer = threading.RLock()
        self._closing = threading.RLock()  # one close() at a time (re-entrant: finalizers)
        self._waker = Waker()
        self.phase = Phase.STARTING
        self._ended = False  # FINISHED or CLOSED: next() raises (the hot path reads this)
        self.arena: Arena | None = None
        self._arena_claimed = False
        # Before the slot budget is known: the slab the workers are started with, given its
        # size when the first batch arrives (docs/design.md, "Slot budget").
        self._reserve: Slab | None = None
        self._slabless = False  # /dev/shm had no room for the slab: a segment per batch
        # Sent-but-not-taken batches are at most this: torch's prefetch_factor * num_workers,
        # or fewer when `slots` is smaller.
        self._window = max(1, min(options.max_in_flight, options.slots_or_default - 1))
        self._crew: Crew | None = None
        self._attached: list[bool] = []  # which workers were told the slab's size
        self._stats = {"results_received": 0, "result_bytes": 0}
        self._stuck_slots: set[int] = set()  # written by thread workers stuck in user code
        self._fatal: BaseException | None = None
        self._epoch = -1
        self._reset_epoch_state(iter(()))

    # -- phases -----------------------------------------------------------------------

    def _enter(self, phase: Phase) -> None:
        if phase is not self.phase and phase not in _MOVES[self.phase]:
            raise RuntimeError(f"session cannot go from {self.phase.value} to {phase.value} "
                               "(arena_loader bug: please report it)")
        self.phase = phase
        self._ended = phase is Phase.FINISHED or phase is Phase.CLOSED

    @property
    def broken(self) -> bool:
        """Closed, or a fatal error: the next epoch needs a new session."""
        return self.phase in (Phase.FAILED, Phase.FINISHED, Phase.CLOSED)

    @property
    def closed(self) -> bool:
        return self.phase in (Phase.CLOSED, Phase.FINISHED)

    @property
    def workers(self) -> Any:
        """The worker group (processes or threads), or None while none runs."""
        return self._crew.group if self._crew is not None else None

    @property
    def worker_pids(self) -> list[int]:
        return list(self._crew.pids) if self._crew is not None else []

    @property
    def stats(self) -> dict[str, int]:
        """Completion records received and their bytes (no array travels in them)."""
        if self._crew is None:
            return dict(self._stats)
        return {key: self._stats[key] + value for key, value in self._crew.stats.items()}

    def snapshot(self) -> IteratorSnapshot:
        """This session now (``ArenaLoader.snapshot``); changes nothing."""
        with self._lock:
            return IteratorSnapshot(phase=self.phase.value, worker_pids=tuple(self.worker_pids),
                                    in_flight=tuple(sorted(self._order.in_flight)),
                                    ready=tuple(sorted(self._order.done)))

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
                self._begin()
            self._fill_window()

    def _reset_epoch_state(self, batches: Iterator) -> None:
        self._epoch += 1
        self._feed = Feed(batches, self._options.num_workers, self._filler.iterable,
                          self._epoch)
        self._order = Reorderer(self._options.in_order)
        self._started = False
        self._held_blocked = False  # the consumer holds held_batch_limit batches
        self._held_overflow = False  # a batch went to a segment: every slot is held
        self._stash: Any = None  # a batch built for a next() that Ctrl-C interrupted
        self._taken: Completion | None = None  # taken, not yet handed over (next_batch)

    def _begin(self) -> None:
        """Claim the arena if the layout is known (else reserve a slab) and start workers if
        there are none."""
        if self.arena is None and self._reserve is None:
            try:
                # None until the first batch sets the budget. One statement: a claim is
                # never left unrecorded (it would keep the loader's arena from later ones).
                self.arena, self._arena_claimed = (arena := self._source.claim()), (
                    arena is not None)
            except ShmCapacityError:
                arena, self._slabless = None, True
            if arena is not None:
                arena.pool.waker = self._waker
            else:
                self._reserve = Slab.reserve()
        if self._crew is None:
            arena = self.arena
            # Workers started with a sized slab map it at once; else an ATTACH entry says when.
            self._attached = [arena is not None] * self._options.num_workers
            self._crew = Crew(self._options, self._filler,
                              arena.slab if arena is not None else self._reserve,
                              arena.slot_nbytes if arena is not None else 0,
                              self._source.slots, self._base_seed, self._window,
                              self._waker.fileno())
        self._enter(Phase.RUNNING)
        self._started = True

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
            if self._crew is not None and self._crew.stopped:
                self._drop_crew()  # stopped after a crash or a stuck drain: start afresh
            elif self._crew is not None:
                self._crew.forget_segments()

    # -- publishing the batch order ------------------------------------------------------

    def _fill_window(self) -> None:
        """Send batches while the window, free slots and the sampler allow; the sampler runs
        outside the lock (a slow one must not hold up close())."""
        feed, order = self._feed, self._order
        while True:
            if (feed.pending is NO_PENDING and not feed.exhausted and self.phase is Phase.RUNNING
                    and len(order.in_flight) + len(order.done) < self._window):
                feed.draw()  # (only this thread changes the order; close() only ends it)
            with self._lock:
                if self._ended:
                    self._check_open()
                if not self._publish():
                    return

    def _publish(self) -> bool:
        """Send the drawn batches the window allows; True when the next needs a draw."""
        feed, order = self._feed, self._order
        while (not feed.exhausted and self.phase is Phase.RUNNING
               and len(order.in_flight) + len(order.done) < self._window):
            if feed.pending is NO_PENDING:
                return True
            worker = feed.pick_worker()
            if worker is None:
                return False
            slot = self._choose_slot()
            if slot is None:
                return False  # a freed slot wakes the waiting next()
            try:
                sent = feed.send(self._crew, order, worker, slot)
            except BaseException as exc:
                self._reclaim_unsent(slot)
                if isinstance(exc, KeyboardInterrupt):
                    raise
                self._fail(exc)  # e.g. indices that do not pickle: no worker can load them
                return False
            if not sent:  # its pipe is closed: that worker is dead
                self._reclaim_unsent(slot)
                self._crash(worker)
                return False
        return False

    def _reclaim_unsent(self, slot: int) -> None:
        if slot != NO_SLOT and all(entry[1] != slot for entry in self._order.in_flight.values()):
            self.arena.pool.reclaim(slot)

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

    # -- receiving completions --------------------------------------------------------

    def _wait(self, timeout_s: float) -> None:
        """Take in what workers have sent; if nothing, wait up to ``timeout_s`` (lock not
        held) for a record, a worker's exit, a freed slot or close()."""
        with self._lock:
            self._check_open()
            owed = self._order.owed_by(self._order.next_idx) if self._options.in_order else None
            if owed is not None and self._receive(owed):
                return
            crew = self._crew
        ready = crew.poll(timeout_s) if crew is not None else []
        with self._lock:
            self._check_open()
            for worker, sentinel in ready:
                if worker == WAKER:
                    self._waker.drain()
                elif self._crew is not crew or self.phase not in (Phase.RUNNING,
                                                                  Phase.DRAINING):
                    return
                elif sentinel:
                    self._crash(worker)
                else:
                    self._receive(worker)

    def _receive(self, worker: int) -> bool:
        """File what ``worker`` has sent; True if anything came."""
        got = self._crew.fill(worker) if self._crew is not None else False
        self._file_arrived()
        if got is None:
            self._crash(worker)
            return True
        return got

    def _file_arrived(self) -> None:
        """File the parsed records in order; each leaves the queue only once filed."""
        crew = self._crew
        if crew is None:
            return
        arrived = crew.arrived
        while arrived:
            self._file(arrived[0])
            if arrived:  # a failure filed on the way may have emptied it
                arrived.popleft()

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
            order.settle(idx)
            return
        entry = order.in_flight.get(idx)
        if entry is None and idx < self._feed.send_idx:
            return  # filed and taken already: a record parsed twice
        if entry is None or entry[0] != worker or entry[1] != slot:
            raise RuntimeError(
                f"arena_loader worker {worker} reported batch idx={idx} in slot {slot}, but "
                f"that is not a batch it was loading ({entry and entry[:2]}); the worker "
                "process is corrupt")
        if status == SEGMENT and completion.storage is None:
            completion.storage = self._crew.receive_segment(worker, idx, completion.plan.nbytes)
        if status == SEGMENT:
            self._crew.forget_segment(worker, idx)  # the mapping holds it now
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
            self._feed.active[worker] = False
        elif completion.plan is not None and not all(self._attached) and not self._slabless:
            self._attach(completion.plan.nbytes)  # the first batch, or an interrupted attach
        completion.indices = entry[2]
        order.arrive(completion)

    def _attach(self, first_nbytes: int) -> None:
        """The session's first batch sets the slot budget: size the reserved slab for it and
        tell every worker to map it. A full /dev/shm raises ShmCapacityError (-> next())."""
        if self.arena is None:
            try:
                # One statement: the reserve the workers hold becomes the arena's slab, and
                # an interrupt cannot leave the session with neither (or a claim unrecorded).
                self.arena, self._arena_claimed, self._reserve = self._source.claim(
                    slot_budget(first_nbytes), slab=self._reserve), True, None
            except ShmCapacityError:
                # No room for `slots` batches at once: go on with a segment per batch, which
                # is all torch needs; a batch that does not fit either is that batch's error.
                self._slabless = True
                return
        self.arena.pool.waker = self._waker
        for worker, attached in enumerate(self._attached):
            if not attached:
                sent = self._crew.publish(worker, EntryKind.ATTACH, idx=self.arena.slot_nbytes)
                self._attached[worker] = True  # (dead: the crash below is its news)
                if not sent:
                    self._crash(worker)
                    return

    def _crash(self, worker: int) -> None:
        """``worker`` is gone: take in what it sent before, then fail the session with the
        error that explains it (its own report, if it sent one, wins)."""
        while self.phase is Phase.RUNNING and self._crew is not None \
                and self._crew.fill(worker):
            self._file_arrived()
        self._file_arrived()
        if self.phase is Phase.DRAINING:  # the old epoch's batches are not wanted anyway
            self._stop_workers(graceful=False)
        if self.phase is not Phase.RUNNING:
            return
        owed = [(idx, listed(indices)) for idx, (owner, _, indices)
                in self._order.in_flight.items() if owner == worker]
        self._fail(self._crew.crash_error(worker, owed))

    def _fail(self, error: BaseException) -> None:
        """A fatal error: stop the workers first, so that when next() raises it no worker of
        this session runs. Batches already received are still handed out first, as torch."""
        if self.phase is Phase.FAILED:
            return
        self._fatal = error
        self._enter(Phase.FAILED)
        self._stop_workers(graceful=False)
        if self._crew is not None:
            self._crew.close_channels()

    def _stop_workers(self, graceful: bool) -> None:
        """Stop the crew (idempotent); then every slot it was writing is safe to reuse."""
        crew = self._crew
        if crew is None:
            return
        crew.shutdown(graceful)
        # A thread worker left stuck in user code may still write the slot of the entry it is
        # on (its oldest): that slot stays ASSIGNED for good, so it is never handed out again.
        stuck = set(crew.stuck)
        in_flight = self._order.in_flight
        for idx in sorted(in_flight):
            worker, slot, _ = in_flight[idx]
            if worker in stuck:
                stuck.discard(worker)
                self._stuck_slots.add(slot)
            elif slot != NO_SLOT and self.arena.pool.state(slot) is not SlotState.FREE:
                self.arena.pool.reclaim(slot)
            del in_flight[idx]

    def _drop_crew(self) -> None:
        crew, self._crew = self._crew, None
        if crew is not None:
            crew.close_channels()
            for key, value in crew.stats.items():
                self._stats[key] += value

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
            if self.arena is not None and self._source.held_batch_limit is not None:
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
                if self._ended:
                    self._check_open()
                if self._take():
                    return self._hand_over()
                # Not there yet: take in what the worker that owes it has sent, no poll.
                owed = self._order.in_flight.get(self._order.next_idx)
                if owed is not None and self._order.in_order and self.phase is Phase.RUNNING:
                    self._receive(owed[0])  # (files records an interrupted read left, too)
                    if self._take():
                        return self._hand_over()
                if self.phase is Phase.FAILED:
                    self._release_arena()  # a broken session keeps no slot of the loader's
                    raise fresh_copy(self._fatal)
                if self._feed.exhausted and not self._order.in_flight:
                    if self.arena is not None:
                        self._reconcile_slots()  # the epoch's end: no slot is owned now
                    error = self._feed.take_error()
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
                    self.arena.pool.state(completion.slot) is SlotState.LEASED:
                self.arena.pool.take_back(completion.slot)  # leased, never handed out
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
        if (self._order.in_flight or self._order.done or self._feed.needs_draw
                or self._feed.exhausted or self.arena is None or not self._held_blocked):
            return False
        return self._source.over_limit(self.arena)

    def _timeout_message(self, timeout: float) -> str:
        message = f"DataLoader timed out after {timeout} seconds"
        in_flight = self._order.in_flight
        waiting = [f"batch idx={idx} (indices {listed(in_flight[idx][2])!r}) from worker "
                   f"{in_flight[idx][0]} (pid {self._crew.pids[in_flight[idx][0]]})"
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
                crew = self._crew
                if crew is not None:
                    crew.ask_to_stop()
            if crew is not None:
                # Not under the lock: a next() waiting in another thread raises meanwhile.
                crew.shutdown(graceful=True)
            with self._lock:
                self._stop_workers(graceful=True)  # the group is down: reclaims its slots
                self._drop_crew()
                self._release_arena()
                if self._reserve is not None:
                    self._reserve.close()
                    self._reserve = None
                self._waker.close()

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
