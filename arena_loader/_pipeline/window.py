"""The read-ahead window: how many batches are sent ahead of the consumer (torch's
``prefetch_factor * num_workers``, or fewer when ``slots`` is smaller), and the slot each one
gets. A batch gets a free slot; a one-off segment (``NO_SLOT``) before the slab exists or
while the consumer holds every slot; nothing while it holds ``held_batch_limit`` batches.
The session calls it under its lock; what only the session can do (fail, diagnose a dead
worker) comes back as ``UnsendableBatchError`` / ``WorkerGoneError``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._arena import Arena, ArenaSource
from .._messages import NO_SLOT
from .._pool import SlotState, Waker
from .crew import Crew
from .feed import NO_PENDING, Feed
from .handout import Handout
from .reorder import Reorderer

# What Window.publish leaves to its caller (TopUp.fill): nothing, a draw and a send, a draw.
SENT, DRAW, DRAW_ONLY = 0, 1, 2


class UnsendableBatchError(Exception):
    """Publishing the batch raised (its indices do not pickle): no worker can load it."""


class WorkerGoneError(Exception):
    """The worker's order pipe is closed: it is dead."""

    def __init__(self, worker: int):
        super().__init__(worker)
        self.worker = worker


class StageStoppedError(Exception):
    """The stage's thread waited for room that only its consumer makes, and the stage was
    closed (an epoch abandoned): its ``next()`` of the host ends."""


class StageLag:
    """Batches this iterator handed to a stage (the pin or device thread) that the stage's
    consumer has not received yet. They count against the window as the batches torch's pin
    thread holds count against torch's (its main thread sends the next indices only as it
    receives a batch), so the sampler is drawn no further ahead than torch's."""

    __slots__ = ("_handout", "_waker", "asked_at", "received", "stopped")

    def __init__(self, handout: Handout, waker: Waker):
        self._handout = handout  # its position moves as each batch is handed out
        self._waker = waker
        self.received = handout.position.yielded  # where the consumer is
        self.stopped = False  # the stage closed: no consumer will receive
        # When the consumer's next() began (None: it is not in one). The stage's thread waits
        # on the host with no timeout of its own, as torch's pin thread does: the host's
        # timeout runs only while the consumer waits, as torch's next() times its own wait.
        self.asked_at: float | None = None

    def stop(self) -> None:
        """The stage is closing: its thread's wait for room in the window ends now
        (``StageStoppedError``), as its wait for a batch in flight would."""
        self.stopped = True
        self._waker.wake()

    def count(self) -> int:
        handout = self._handout  # (a batch taken and not yet handed over is the stage's)
        return handout.position.yielded + (handout.taken is not None) - self.received

    def receive(self, yielded: int) -> None:
        """The consumer has the batch that left the iterator at ``yielded`` (the same again
        when its ``next()`` is repeated after an interrupt)."""
        if yielded > self.received:
            self.received = yielded


class Window:
    __slots__ = ("held_blocked", "held_overflow", "lag", "settling", "size")

    def __init__(self, size: int):
        self.size = size
        # Batches in one-off segments may live (the first window's, sent before the slab
        # existed): publish counts them against the slots until none does.
        self.settling = True
        self.held_blocked = False  # the consumer holds held_batch_limit batches
        self.held_overflow = False  # a batch went to a segment: every slot is held
        self.lag: StageLag | None = None  # a stage takes the batches: TopUp.follow_stage

    def has_room(self, order: Reorderer) -> bool:
        lag = self.lag
        return (len(order.in_flight) + len(order.done)
                + (lag.count() if lag is not None else 0)) < self.size

    def held_by_stage(self, order: Reorderer) -> bool:
        """Nothing in flight, and the batches a stage took fill the window: a wait now is for
        the stage's consumer to receive one, not for a worker."""
        lag = self.lag
        return lag is not None and not order.in_flight and lag.count() >= self.size

    def publish(self, feed: Feed, order: Reorderer, crew: Crew, arena: Arena | None,
                source: ArenaSource, reconcile: Callable[[], int], taken: Any) -> int:
        """Send the drawn batches the window allows. Returns ``SENT`` (done), ``DRAW`` (the
        next needs a draw, then a send) or ``DRAW_ONLY``: the next needs a draw, and its
        send would wait for the slot of the batch a ``for`` loop still holds (with the
        default slots, at every ``next()``), so it goes out at the next ``next()`` without
        a failed try now. ``taken``: the batch ``next()`` has taken to return, if any."""
        in_flight, done, lag = order.in_flight, order.done, self.lag
        size = self.size - (lag.count() if lag is not None else 0)
        while not feed.exhausted and len(in_flight) + len(done) < size:
            if feed.pending is NO_PENDING:
                if in_flight and arena is not None and source.holds_the_last_slot(arena):
                    return DRAW_ONLY  # (in flight: next() has a batch without this one)
                return DRAW
            worker = feed.pick_worker()
            if worker is None:
                return SENT
            if self.settling and arena is not None and self._segments_fill_slots(
                    order, arena, source, taken, taken is not None or bool(in_flight or done)):
                return SENT  # sent by the next next(), as when no slot is free
            # (A free slot, the common case, without a call more.)
            slot = arena.pool.acquire(worker, wake=False) if arena is not None else None
            if slot is None:
                slot = self._choose_slot(arena, source, reconcile, worker,
                                         taken is not None or bool(in_flight or done))
                if slot is None:
                    return SENT  # a freed slot wakes the waiting next()
            else:
                self.held_blocked = False
            try:
                sent = feed.send(crew, order, worker, slot)
            except BaseException as exc:
                _reclaim_unsent(order, arena, slot)
                if isinstance(exc, KeyboardInterrupt):
                    raise
                raise UnsendableBatchError() from exc
            if not sent:
                _reclaim_unsent(order, arena, slot)
                raise WorkerGoneError(worker)
        return SENT

    def _segments_fill_slots(self, order: Reorderer, arena: Arena, source: ArenaSource,
                             taken: Any, pending: bool) -> bool:
        """True when the slab's batches and those in one-off segments fill ``slots`` and this
        send can wait (as ``_choose_slot`` waits for a slot): each segment counts as a slot
        would, so the first epoch holds no more batches than later ones. Without it a `for`
        loop with ``slots=5`` held 6 batches for a moment (the first window's 4 segments and
        2 slots: 192 MB against the steady 160 with 32 MB batches). Once no segment lives
        it is not asked again (one test per send after that)."""
        held = source.held(arena)
        segments = (held - arena.pool.held()  # (the held batches in segments)
                    + sum(1 for entry in order.in_flight.values() if entry[1] == NO_SLOT)
                    + sum(1 for ready in order.done.values() if ready.storage is not None)
                    + (taken is not None and taken.storage is not None))
        if not segments:
            self.settling = False
            return False
        return pending and held <= 1 and (
            segments >= arena.pool.counts()[SlotState.FREE])  # (no free slot left for them)

    def _choose_slot(self, arena: Arena | None, source: ArenaSource,
                     reconcile: Callable[[], int], worker: int, pending: bool) -> int | None:
        """No free slot (``publish`` just asked the pool), or no slab yet. ``pending``:
        ``next()`` has a batch to return without this one (taken, ready or in flight)."""
        if arena is None:
            return NO_SLOT
        if pending and source.held(arena) <= 1 and not source.over_limit(arena):
            # The one batch held is a `for` loop's last, dropped once this next() returns:
            # the batch goes out at the next next(), in that slot. (A segment here, at every
            # next() of a loop with fewer than window + 2 slots, made image batches 3x
            # slower: docs/benchmarks.md, "Fewer slots".) With the default slots this is
            # every next() of a `for` loop, so nothing more is done here: no slot lost to
            # a Ctrl-C is looked for (one is found once nothing is pending, or at the
            # epoch's end) and no wake-up armed (next() has a batch without this one).
            return None
        reconcile()
        slot = arena.pool.acquire(worker)  # (arms the wake-up for a next() that waits)
        if slot is not None:
            self.held_blocked = False
            return slot
        if source.over_limit(arena):
            self.held_blocked = True
            return None
        # Nothing pending, or the consumer keeps batches: a segment (next() would otherwise
        # wait for a slot that only its caller can free).
        self.held_overflow = True
        return NO_SLOT

    def starved(self, order: Reorderer, feed: Feed, arena: Arena | None,
                source: ArenaSource) -> bool:
        """Nothing in flight or ready, a batch's indices waiting, and the consumer holds
        ``held_batch_limit`` batches."""
        if (order.in_flight or order.done or feed.needs_draw or feed.exhausted
                or arena is None or not self.held_blocked):
            return False
        return source.over_limit(arena)


def _reclaim_unsent(order: Reorderer, arena: Arena | None, slot: int) -> None:
    if slot != NO_SLOT and all(entry[1] != slot for entry in order.in_flight.values()):
        arena.pool.reclaim(slot)
