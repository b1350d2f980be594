"""Keeping the read-ahead window full: the sampler's next batches drawn and sent to workers
while the window, free slots and the sampler allow (``fill``). The sampler runs outside the
session's lock (a slow one must not hold up ``close()``), one at a time: ``next()``
fills, and with a stage (pin or device thread) so does the stage's consumer (``refill``), as
torch's main thread sends the next indices as it receives each batch."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from .._messages import without_tracebacks
from ..errors import LoaderClosedError
from .feed import NO_PENDING
from .phase import Phase
from .window import DRAW, DRAW_ONLY, SENT, StageLag, UnsendableBatchError, WorkerGoneError

if TYPE_CHECKING:
    from .session import Session


class TopUp:
    def __init__(self, session: Session):
        self.session = session
        # Held while filling, once a stage follows: the session's ``fill_window`` is ``fill``
        # while only next() fills (no lock per batch on the hot path), then ``fill_locked``.
        self._filling = threading.RLock()

    def fill_locked(self) -> None:
        with self._filling:
            self.fill()

    def fill(self) -> None:
        """Send batches while the window, free slots and the sampler allow."""
        session = self.session
        feed, order, window = session.feed, session.order, session.window
        step = DRAW
        while True:
            if (feed.pending is NO_PENDING and not feed.exhausted
                    and session.phase is Phase.RUNNING and window.has_room(order)):
                feed.draw()  # (one fill at a time; close() only ends the order)
            if step == DRAW_ONLY:
                return  # (its send waits for the slot a `for` loop drops: the next next())
            with session.lock:
                if session.ended:
                    session.check_open()
                if session.phase is not Phase.RUNNING:
                    return
                try:
                    step = window.publish(feed, order, session.crew, session.claim.arena,
                                          session.source, session.reconcile_slots,
                                          session.handout.taken)
                    if step == SENT:
                        return
                except UnsendableBatchError as unsendable:
                    # e.g. indices that do not pickle (kept frameless: its frames hold the iterator)
                    session.fail(without_tracebacks(unsendable.__cause__))
                    return
                except WorkerGoneError as gone:
                    session.intake.crash(gone.worker)
                    return

    def follow_stage(self) -> StageLag:
        """A stage takes this epoch's batches ahead of its consumer: they count against the
        window until the consumer receives them (``refill``)."""
        session = self.session
        # (Before the stage can refill: from now on every fill of this session is locked.)
        session.fill_window = self.fill_locked
        with session.lock:
            lag = session.window.lag = StageLag(session.handout, session.waker)
        return lag

    def refill(self) -> None:
        """The stage's consumer received a batch: the window is topped up now, in its
        thread. Quiet once the epoch is over: the stage hands the end on in order."""
        session = self.session
        if session.ended or session.phase is not Phase.RUNNING:
            return
        try:
            self.fill_locked()
        except (StopIteration, LoaderClosedError):
            return
        if session.feed.exhausted or session.phase is not Phase.RUNNING:
            # A next() waiting in the stage's thread with nothing in flight ends the epoch
            # now, or raises what failed here (a worker gone, indices that do not pickle).
            session.waker.wake()
