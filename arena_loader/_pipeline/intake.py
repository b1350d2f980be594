"""Taking in what workers send: completion records filed for the consumer (``accept``
checks each against the batches in flight and moves its slot on), a worker's exit diagnosed,
the first batch sizing the slab (``attach``), and, with persistent workers, the last epoch's
batches taken back before the next (``drain``). Each record leaves the reader's queue only
once filed, and filing is idempotent, so an interrupt at any line loses none
(docs/design.md, "Ctrl-C")."""

from __future__ import annotations

import time
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any

from .._arena import Arena
from .._messages import NO_SLOT, fresh_copy, listed, rebuild_worker_error, without_tracebacks
from .._process import JOIN_TIMEOUT_S
from ..errors import LayoutError
from .completions import ENDED, LOADED, SEGMENT, STATE, WORKER_FAILED, Completion
from .crew import WAKER, Crew
from .feed import Feed
from .order import EntryKind
from .phase import POLL_S, Phase
from .reorder import Reorderer

if TYPE_CHECKING:
    from .session import Session


class Intake:
    """The session's receiving side (one per session; called under its lock, except
    ``wait``'s poll)."""

    def __init__(self, session: Session):
        self.session = session

    def drain(self) -> None:
        """Persistent workers: take back the last epoch's batches (in flight: wait for them;
        arrived: reclaim their slots), so every slot is free for the next epoch. A worker that
        dies or does not answer in time gets the whole group stopped (new ones start)."""
        session = self.session
        deadline = time.monotonic() + max(JOIN_TIMEOUT_S, session.options.timeout or 0) * 5
        try:
            while True:
                with session.lock:
                    session.check_open()
                    if session.crew is not None and session.crew.stopped:
                        session.stop_workers(graceful=False)  # a stop cut short: finish it
                    if not session.order.in_flight or session.phase is not Phase.DRAINING:
                        break
                    if time.monotonic() >= deadline:
                        session.stop_workers(graceful=False)
                        break
                self.wait(min(POLL_S, max(0.0, deadline - time.monotonic())))
        except BaseException:
            with session.lock:
                if session.phase is Phase.DRAINING:
                    session.stop_workers(graceful=False)
                    session.enter(Phase.RUNNING)
            raise
        with session.lock:
            session.check_open()
            session.reclaim_done()
            if session.phase is Phase.FAILED:
                raise fresh_copy(session.fatal)
            session.enter(Phase.RUNNING)
            if session.crew is not None and session.crew.stopped:
                session.drop_crew()  # stopped after a crash or a stuck drain: start afresh
            elif session.crew is not None:
                session.crew.forget_segments()

    # -- receiving completions --------------------------------------------------------

    def wait(self, timeout_s: float, owed: int | None = None) -> None:
        """Wait up to ``timeout_s`` (lock not held) for a record (of worker ``owed`` only, if
        given: process workers are given a moment first, spin.py), a worker's exit, a freed
        slot or close(), and take in what came. (``next()`` has read the worker that owes its
        batch just before: a record already there makes the poll return at once.)"""
        session = self.session
        with session.lock:
            session.check_open()
            crew = session.crew
            if crew is not None:
                crew.wake_sleepers()
        if crew is None:
            ready = []
        elif owed is not None and crew.spin_for(owed):  # it sent a record meanwhile
            ready = [(owed, False)]
        else:
            ready = crew.poll(timeout_s, owed)
        with session.lock:
            session.check_open()
            for worker, sentinel in ready:
                if worker == WAKER:
                    session.waker.drain()
                elif session.crew is not crew or session.phase not in (Phase.RUNNING,
                                                                  Phase.DRAINING):
                    return
                elif sentinel:
                    self.crash(worker)
                else:
                    self.receive(worker)

    def receive(self, worker: int, speculative: bool = False) -> bool:
        """File what ``worker`` has sent; True if anything came (``speculative``: no poll
        said so, see ``CompletionReader.fill``)."""
        session = self.session
        got = self._fill(worker, speculative) if session.crew is not None else False
        self.file_arrived()
        if got is None:
            self.crash(worker)
            return True
        return got

    def _fill(self, worker: int, speculative: bool = False) -> bool | None:
        """``crew.fill``; a record this process cannot decode (a structure type it cannot
        import) fails the session: it stays first in the worker's buffer, ahead of every
        later record of that worker, so no later batch of the epoch could come."""
        try:
            return self.session.crew.fill(worker, speculative)
        except LayoutError as error:  # (kept without its frames, which hold the session)
            self.session.fail(without_tracebacks(error))
            return False

    def file_arrived(self) -> None:
        """File the parsed records in order; each leaves the queue only once filed."""
        session = self.session
        crew = session.crew
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
        session = self.session
        if session.phase is not Phase.RUNNING and session.phase is not Phase.DRAINING:
            return  # failed: the workers are stopped and every slot they had is reclaimed
        status = completion.status
        order = session.order
        if status == STATE:  # kept for the record that follows it
            if completion.idx in order.in_flight and session.phase is Phase.RUNNING:
                order.states[completion.idx] = completion.body
            return
        if status == WORKER_FAILED:
            error = rebuild_worker_error(ForkingPickler.loads(completion.body))
            if session.phase is Phase.DRAINING:
                session.stop_workers(graceful=False)  # the next epoch starts new workers
            else:
                session.fail(error)
            return
        arena = session.claim.arena
        if status == SEGMENT and arena is not None and completion.plan.nbytes > arena.slot_nbytes:
            session.source.note_outgrown(completion.plan.nbytes)  # too large for a slot
        entry = accept(completion, session.order, session.feed, session.crew, session.claim.arena,
                       session.phase is Phase.DRAINING)
        if entry is None:
            return
        if status == ENDED:
            session.feed.active[completion.worker] = False
        elif completion.plan is not None and not all(session.attached) \
                and not session.claim.slabless:
            self.attach(completion.plan.nbytes)  # the first batch, or an interrupted attach
        completion.indices = entry[2]
        if order.states:
            completion.state = order.states.pop(completion.idx, None)
        order.arrive(completion)
        if status != LOADED:
            release_unused(completion, session.claim.arena)

    def attach(self, first_nbytes: int) -> None:
        """The session's first batch sets the slot budget: size the reserved slab for it and
        tell every worker to map it. A full /dev/shm raises ShmCapacityError (-> next())."""
        session = self.session
        if not session.claim.attach(first_nbytes):
            return  # no room for the slab: every batch goes to a segment
        slot_nbytes = session.claim.arena.slot_nbytes
        for worker, attached in enumerate(session.attached):
            if not attached:
                sent = session.crew.publish(worker, EntryKind.ATTACH, idx=slot_nbytes)
                session.attached[worker] = True  # (dead: the crash below is its news)
                if not sent:
                    self.crash(worker)
                    return

    def crash(self, worker: int) -> None:
        """``worker`` is gone: take in what it sent before, then fail the session with the
        error that explains it (its own report, if it sent one, wins)."""
        session = self.session
        while session.phase is Phase.RUNNING and session.crew is not None \
                and self._fill(worker):
            self.file_arrived()
        self.file_arrived()
        if session.phase is Phase.DRAINING:  # the old epoch's batches are not wanted anyway
            session.stop_workers(graceful=False)
        if session.phase is not Phase.RUNNING:
            return
        owed = [(idx, listed(indices)) for idx, (owner, _, indices)
                in session.order.in_flight.items() if owner == worker]
        session.fail(session.crew.crash_error(worker, owed))



def accept(completion: Completion, order: Reorderer, feed: Feed, crew: Crew,
           arena: Arena | None, draining: bool) -> tuple[int, int, Any] | None:
    """The in-flight entry ``(worker, slot, indices)`` that ``completion`` answers, its slot
    moved on; None when there is nothing more to do: filed already, or (``draining``) a batch
    of the last epoch, whose slot is free again. Raises when the record answers no batch
    its worker was loading."""
    status, idx, worker, slot = (completion.status, completion.idx, completion.worker,
                                 completion.slot)
    if idx in order.done:  # filed already (interrupted right after)
        order.settle(idx)
        return None
    entry = order.in_flight.get(idx)
    if entry is None and idx < feed.send_idx:
        return None  # filed and taken already: a record parsed twice
    if entry is None or entry[0] != worker or entry[1] != slot:
        raise RuntimeError(
            f"arena_loader worker {worker} reported batch idx={idx} in slot {slot}, but "
            f"that is not a batch it was loading ({entry and entry[:2]}); the worker "
            "process is corrupt")
    if status == SEGMENT:
        if completion.storage is None:
            completion.storage = crew.receive_segment(worker, idx, completion.plan.nbytes)
        crew.forget_segment(worker, idx)  # the mapping holds it now
    if slot != NO_SLOT and status == LOADED and not draining:
        if completion.plan.nbytes > arena.slot_nbytes:
            raise RuntimeError(f"arena_loader worker {worker} wrote batch idx={idx} "
                               f"of {completion.plan.nbytes} bytes into a slot of "
                               f"{arena.slot_nbytes}")
        arena.pool.mark_filled(slot)
    if draining:
        order.in_flight.pop(idx, None)
        release_unused(completion, arena)
        return None
    return entry


def release_unused(completion: Completion, arena: Arena | None) -> None:
    """Free the slot of a filed batch that is not in it (segment, ended, failed) or not
    wanted (draining). Only once the batch has left ``in_flight``: a record filed again after
    an interrupt must not free a slot that a new batch took meanwhile (interrupted before
    this, the slot stays ASSIGNED with no owner, and ``SlotPool.reconcile`` recovers it)."""
    if completion.slot != NO_SLOT:
        arena.pool.reclaim(completion.slot)  # (ASSIGNED: never marked filled)
