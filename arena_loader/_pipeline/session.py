"""The worker pipeline behind ``iter(loader)`` when ``num_workers > 0``.

A ``Session`` wires one iterator's parts together and runs on the consumer's thread: the
``Crew`` (workers, order ring, completion pipes), the ``SlabClaim`` (its hold on the loader's
slab), and per epoch the ``Feed`` (sampler -> ring), the ``Window`` (how far ahead, which
slot), the ``Reorderer`` (in flight -> arrived -> handed out) and the ``Handout`` (the batch
being handed out). ``next()`` tops up the read-ahead window, reads completion records from
the worker that owes the next batch, and leases its slot; no thread relays batches
(docs/design.md, "Data flow").

Locking: ``_lock`` is held for short steps by ``next()`` and ``close()``, never while
waiting for workers or running the sampler, so ``close()`` from another thread (or a
finalizer) never waits on user code; whoever retakes it checks the phase first. ``consumer_lock``
is held for a whole ``next()``: one consumer at a time.
"""

from __future__ import annotations

import os
import threading

from .. import _forksafe
from .._arena import ArenaSource
from .._fetch import BatchFiller
from .._messages import NO_SLOT, fresh_copy
from .._options import LoaderOptions
from .._pool import SlotState, Waker
from .._resume_stream import EpochPlan, EpochPosition
from ..errors import LoaderClosedError
from .claim import SlabClaim
from .completions import LOADED
from .consumer import Consumer
from .crew import Crew
from .feed import Feed
from .handout import Handout
from .intake import Intake
from .phase import MOVES, Phase
from .reorder import Reorderer
from .top_up import TopUp
from .window import Window


class Session:
    def __init__(self, options: LoaderOptions, filler: BatchFiller, source: ArenaSource,
                 base_seed: int):
        self.options = options
        self._filler = filler
        self.source = source
        self._base_seed = base_seed
        self.pid = os.getpid()
        self.generation = _forksafe.generation()  # a fork since: this session is not its own
        self.lock = threading.RLock()
        self.consumer_lock = threading.RLock()
        self._closing = threading.RLock()  # one close() at a time (re-entrant: finalizers)
        self.waker = Waker()
        self.phase = Phase.STARTING
        self.ended = False  # FINISHED or CLOSED: next() raises (the hot path reads this)
        self.claim = SlabClaim(source, self.waker)
        # Sent-but-not-taken batches are at most this: torch's prefetch_factor * num_workers,
        # or fewer when `slots` is smaller (one slot stays out of the window for the batch
        # being taken; a `for` loop's last batch waits for its slot: Window._choose_slot).
        self._window_size = max(1, min(options.max_in_flight, options.slots_or_default - 1))
        self.crew: Crew | None = None
        self.attached: list[bool] = []  # which workers were told the slab's size
        # Records and bytes received by crews already dropped (MultiProcessIterator.stats)
        self.dropped_stats = {"results_received": 0, "result_bytes": 0}
        self.stuck_slots: set[int] = set()  # written by thread workers stuck in user code
        self.fatal: BaseException | None = None
        self.epoch = -1
        self._reset_epoch_state(EpochPlan(EpochPosition(0, None, None)))
        self.intake = Intake(self)
        self.top_up = TopUp(self)
        self.fill_window = self.top_up.fill  # (bound once: no extra call per batch)
        self.next_batch = Consumer(self).next_batch  # (bound once: no extra call per batch)

    # -- phases -----------------------------------------------------------------------

    def enter(self, phase: Phase) -> None:
        if phase is not self.phase and phase not in MOVES[self.phase]:
            raise RuntimeError(f"session cannot go from {self.phase.value} to {phase.value} "
                               "(arena_loader bug: please report it)")
        self.phase = phase
        self.ended = phase is Phase.FINISHED or phase is Phase.CLOSED

    @property
    def broken(self) -> bool:
        """Closed, or a fatal error: the next epoch needs a new session."""
        return self.phase in (Phase.FAILED, Phase.FINISHED, Phase.CLOSED)

    def check_open(self) -> None:
        if self.phase is Phase.FINISHED:
            raise StopIteration
        if self.phase is Phase.CLOSED:
            raise _closed_error()

    # -- epochs -----------------------------------------------------------------------

    def start_epoch(self, plan: EpochPlan) -> None:
        """Begin an epoch: workers start (first epoch) and the read-ahead window is sent."""
        with self.consumer_lock:
            with self.lock:
                self.check_open()
                if self.phase is Phase.FAILED:
                    raise fresh_copy(self.fatal)
                # (DRAINING: a drain that an interrupt cut short is done again.)
                draining = self.phase is Phase.RUNNING or self.phase is Phase.DRAINING
                if draining:
                    self.enter(Phase.DRAINING)
            if draining:
                self.intake.drain()
            with self.lock:
                self.check_open()
                self._reset_epoch_state(plan)
                arena = self.claim.arena
                if arena is not None and self.crew is not None and self.source.outgrown(arena):
                    self._regrow()
                self.begin()
            self.fill_window()

    def _reset_epoch_state(self, plan: EpochPlan) -> None:
        if self.crew is not None:
            self.crew.reader.drop_filed()  # nothing of the last epoch is in flight (drained)
        self.epoch += 1
        self.feed = Feed(plan, self.options.num_workers, self._filler.iterable, self.epoch)
        self.order = Reorderer(self.options.in_order, plan.first_idx)
        self.window = Window(self._window_size)
        self.position = plan.position  # the consumer's place (state_dict)
        self.handout = Handout(plan.position)
        # How a resumed epoch's new workers start. A worker whose iterator had ended is not
        # asked in that epoch: its first iterator is the next epoch's, which starts afresh.
        self._streams = plan.streams if plan.streams is None else [
            stream if active else None for stream, active in zip(plan.streams, plan.active)]
        self.started = False

    def _regrow(self) -> None:
        """A batch outgrew its slot last epoch: the arena is given back (the next claim grows
        it), and ``begin`` hands the grown slab to the workers, which go on (their seeds,
        what worker_init_fn did and their dataset replicas stay, as torch's persistent
        workers' do). Once: the grown slots fit the largest batch seen, with headroom."""
        self.release_arena()
        self.claim.let_go()

    def begin(self) -> None:
        """Claim the arena if the layout is known (else reserve a slab) and start workers if
        there are none."""
        self.claim.begin()
        arena = self.claim.arena
        if self.crew is None:
            slab, slot_nbytes = self.claim.for_workers()
            # Workers started with a sized slab map it at once; else an ATTACH entry says when.
            self.attached = [slot_nbytes > 0] * self.options.num_workers
            self.crew = Crew(self.options, self._filler, slab, slot_nbytes,
                              self.source.slots, self._base_seed, self._window_size,
                              self._filler.batch_size or 1, self.waker.fileno(), self._streams)
        elif arena is not None and arena.slab is not self.crew.slab:
            self.crew.hand_slab(arena.slab, arena.slot_nbytes)  # a grown slab (_regrow)
        self.enter(Phase.RUNNING)
        self.started = True

    def reconcile_slots(self) -> int:
        """Recover slots no batch owns (a Ctrl-C between taking a slot and recording its
        batch, or between filing and handing out): run only when no slot is free, and at
        teardown. A stuck thread worker's slot stays owned for good. Returns how many."""
        order = self.order
        owned = {entry[1] for entry in order.in_flight.values()} | self.stuck_slots
        owned.update(ready.slot for ready in order.done.values() if ready.storage is None)
        taken = self.handout.slot()
        if taken is not None:
            owned.add(taken)
        return self.claim.arena.pool.reconcile(owned)

    # -- failures -----------------------------------------------------------------------

    def fail(self, error: BaseException) -> None:
        """A fatal error: stop the workers first, so that when next() raises it no worker of
        this session runs. Batches already received are still handed out first, as torch."""
        if self.phase is Phase.FAILED:
            return
        self.fatal = error
        self.enter(Phase.FAILED)
        self.stop_workers(graceful=False)
        if self.crew is not None:
            self.crew.close_channels()

    def stop_workers(self, graceful: bool) -> None:
        """Stop the crew (idempotent); then every slot it was writing is safe to reuse."""
        crew = self.crew
        if crew is None:
            return
        crew.shutdown(graceful)
        # A thread worker left stuck in user code may still write the slot of the entry it is
        # on (its oldest): that slot stays ASSIGNED for good, so it is never handed out again.
        stuck = set(crew.stuck)
        in_flight = self.order.in_flight
        pool = self.claim.arena.pool if self.claim.arena is not None else None
        for idx in sorted(in_flight):
            worker, slot, _ = in_flight[idx]
            if worker in stuck:
                stuck.discard(worker)
                self.stuck_slots.add(slot)
            elif slot != NO_SLOT and pool.state(slot) is not SlotState.FREE:
                pool.reclaim(slot)
            del in_flight[idx]

    def drop_crew(self) -> None:
        crew, self.crew = self.crew, None
        if crew is not None:
            crew.close_channels()
            for key, value in crew.stats.items():
                self.dropped_stats[key] += value

    # -- teardown ---------------------------------------------------------------------

    def end_epoch(self) -> None:
        """``next()`` raised StopIteration: ``state_dict()`` now names the next epoch, and
        without persistent workers no epoch follows on these workers."""
        self.position.finished = True
        if not self.options.persistent_workers:
            self.finish()

    def finish(self) -> None:
        """The epoch ended and no epoch follows on these workers: shut them down."""
        with self.lock:
            if self.phase is Phase.RUNNING:
                self.enter(Phase.FINISHED)
        self.close()

    def close(self) -> None:
        """Idempotent; safe from a finalizer and from another thread. Workers joined,
        undelivered slots reclaimed. A close that Ctrl-C interrupted is finished by the next
        call."""
        if os.getpid() != self.pid:
            return  # a finalizer copied into a forked worker: this session is not its own
        with self._closing:
            self.waker.wake()  # a next() waiting for workers returns and finds the phase
            with self.lock:
                if self.phase is not Phase.FINISHED:
                    self.enter(Phase.CLOSED)
                crew = self.crew
                if crew is not None:
                    crew.ask_to_stop()
            if crew is not None:
                # Not under the lock: a next() waiting in another thread raises meanwhile.
                crew.shutdown(graceful=True)
            with self.lock:
                self.stop_workers(graceful=True)  # the group is down: reclaims its slots
                self.drop_crew()
                self.release_arena()
                self.claim.close()
                self.waker.close()
                self.feed.let_go()

    def reclaim_done(self) -> None:
        """Drop the batches that arrived and were not handed out; their slots are free."""
        arena = self.claim.arena
        for ready in self.order.clear_done():
            if ready.storage is None and ready.status == LOADED and arena is not None:
                arena.pool.reclaim(ready.slot)

    def release_arena(self) -> None:
        """Give the arena back to the loader (idempotent); in-flight slots must be reclaimed."""
        if not self.claim.claimed:
            return
        self.reclaim_done()
        self.reconcile_slots()
        self.claim.release()


def _closed_error() -> BaseException:
    """``LoaderClosedError``; but ``SystemExit`` in a daemon thread once the interpreter is
    exiting (its main thread is done, and at exit the loader closed): that thread then ends
    quietly (threading prints no SystemExit) rather than with a traceback on the way out."""
    main = threading.main_thread()
    if threading.current_thread() is not main and not main.is_alive():
        return SystemExit()
    return LoaderClosedError("this iterator was closed; call iter(loader) for a new one")
