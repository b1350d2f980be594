"""``next()``: the next batch in order, taken from what workers have sent (the worker that
owes it is read first, without a poll), its slot leased, and the window refilled before it is
returned, so workers go on while the training step runs. Every wait is bounded (``timeout``,
a dead worker, ``close()`` from another thread); an interrupt at any line loses no batch
(``Handout``)."""

from __future__ import annotations

import gc
import time
from typing import TYPE_CHECKING, Any

from .. import _forksafe
from .._messages import fresh_copy
from ..errors import LoaderTimeoutError, forked_iterator_error
from .handout import timeout_message
from .phase import POLL_S, Phase
from .window import StageStoppedError

if TYPE_CHECKING:
    from .session import Session


_NOTHING = object()  # nothing taken from the stash yet


class Consumer:
    def __init__(self, session: Session):
        self.session = session

    def next_batch(self) -> Any:
        session = self.session
        if _forksafe.generation() != session.generation:
            raise forked_iterator_error(session.pid)
        handout, given = session.handout, _NOTHING
        try:
            with session.consumer_lock:
                try:
                    if session.source.pending_warning is not None:
                        session.source.warn_pending(stacklevel=3)
                    self._next_batch()
                except StopIteration:
                    session.end_epoch()
                    raise
                except BaseException:
                    with session.lock:
                        session.handout.put_back(session.order)  # taken, not handed over
                    raise
                handout = session.handout
                if not handout.failed:
                    # Out of the stash with no call (CPython handles a signal as a call
                    # returns, and a pop's return value was lost to it): an interrupt from
                    # here on, the lock's exit included, puts it back for the next next().
                    (given,), handout.stash = handout.stash, []
                    return given
        except KeyboardInterrupt:
            if given is not _NOTHING:
                handout.stash = [given]
            raise
        # The batch's error, out of the stash with no call and raised on the same line (an
        # interrupt before leaves it for the next next(); one as a pop returned lost it);
        # outside the handler above, whose check an interrupt could replace it in.
        with session.consumer_lock:
            (error,), handout.stash = handout.stash, []; raise error  # noqa: E702 (one line)

    def _next_batch(self) -> None:
        """Leave the next batch (or its error) in the handout's ``stash``."""
        session = self.session
        with session.lock:
            handout = session.handout
            if handout.stash:  # built by a next() that Ctrl-C interrupted: it is next
                return
            if session.ended:
                session.check_open()
            if not session.started and session.phase is Phase.STARTING:
                session.begin()
            arena = session.claim.arena
            if arena is not None and session.source.held_batch_limit is not None:
                session.source.check_limit(arena)
            # Already here (the common case with workers ahead): taken now, no wait loop.
            ready = handout.taken is not None or handout.take(session.order)
        # Taken from here on (an interrupt puts it back).
        if not ready and not self._wait_for_batch():
            return  # none: the sampler's error is stashed in its place
        # The window has room for the batch just taken: send the next one now, as torch does
        # (before the batch is built, so an interrupt in the sampler leaves it untaken and the
        # position where it was), and workers go on while the training step runs.
        session.fill_window()
        with session.lock:
            window, arena = session.window, session.claim.arena
            if window.held_overflow:  # this batch went to a segment: say why, once per loader
                window.held_overflow = False
                session.source.note_overflow(arena)
            session.handout.hand_over(session.source, arena)

    def _wait_for_batch(self) -> bool:
        """True: the next batch is taken; False: none will be, its error is stashed."""
        session = self.session
        timeout = session.options.timeout
        deadline = time.monotonic() + timeout if timeout > 0 else None
        collected = False
        while True:
            with session.lock:
                if session.ended:
                    session.check_open()
                order, handout = session.order, session.handout
                if handout.taken is not None or handout.take(order):
                    return True
                # Not there yet: take in what the worker that owes it has sent, no poll.
                owed = order.in_flight.get(order.next_idx)
                owing = None
                if owed is not None and order.in_order and session.phase is Phase.RUNNING:
                    # (files what an interrupted read left)
                    session.intake.receive(owed[0], speculative=True)
                    if handout.take(order):
                        return True
                    # Who owes it now: filing an ended iterator's mark sends the batch it
                    # stood for to another worker (waiting on the first cost 0.5 s).
                    owed = order.in_flight.get(order.next_idx)
                    owing = owed[0] if owed is not None else None
                if session.phase is Phase.FAILED:
                    session.release_arena()  # a broken session keeps no slot of the loader's
                    raise fresh_copy(session.fatal)
                feed, arena = session.feed, session.claim.arena
                if feed.exhausted and not order.in_flight:
                    if arena is not None:
                        session.reconcile_slots()  # the epoch's end: no slot is owned now
                    if feed.sampler_error is not None:  # raised by next()'s pop, once
                        handout.stash, handout.failed, feed.sampler_error = (
                            [feed.sampler_error], True, None)
                        return False
                    raise StopIteration
                window = session.window
                starved = window.starved(order, feed, arena, session.source)
                if starved and collected:
                    raise session.source.limit_error(arena)
                wait_s = POLL_S
                lag = window.lag
                if lag is not None:
                    if lag.stopped:  # (no consumer will make room, nor ask: timed as is)
                        if window.held_by_stage(order):
                            raise StageStoppedError()
                    elif deadline is not None:  # (timed as the stage's consumer waits)
                        asked = lag.asked_at
                        deadline = (time.monotonic() if asked is None else asked) + timeout
                if deadline is not None:
                    wait_s = min(wait_s, deadline - time.monotonic())
                    if wait_s <= 0:
                        pids = session.crew.pids if session.crew is not None else []
                        raise LoaderTimeoutError(timeout_message(timeout, order, pids))
            if starved:
                gc.collect()  # views in reference cycles give their slots back
                collected = True
                continue
            if not feed.exhausted and window.has_room(order):
                session.fill_window()  # a slot freed since, or a draw left pending
                if feed.exhausted:  # (the last iterator ended: the epoch may end now, with
                    continue  # no wait; a wait here cost every iterable epoch 0.5 s)
            session.intake.wait(wait_s, owing)
