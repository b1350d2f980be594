"""The batch ``next()`` is handing out, held so that a ``KeyboardInterrupt`` at any line of
``next()`` loses nothing: a batch taken from the ``Reorderer`` is in ``taken`` until it is
built (an interrupt puts it back at the front: ``put_back``); built, it is in ``stash`` until
``next()``'s last lines take it out, with no call (an interrupt before leaves it for the next
``next()``; a pop's return would lose it). A batch that failed is stashed the same way, as its
error (``failed``), and raised once taken out: an interrupt can neither swallow it nor raise
it twice. One per epoch; the session calls it under its lock."""

from __future__ import annotations

from multiprocessing.reduction import ForkingPickler

from .._arena import Arena, ArenaSource
from .._messages import listed, rebuild_worker_error
from .._pool import SlotState
from .._resume_stream import EpochPosition
from .completions import ENDED, FAILED, LOADED, Completion
from .reorder import Reorderer


class Handout:
    __slots__ = ("failed", "position", "stash", "taken")

    def __init__(self, position: EpochPosition) -> None:
        self.taken: Completion | None = None  # taken, not yet built
        # What the next pop hands out (empty, or one item): the built batch, or with
        # ``failed`` the error to raise in its place. Taken out by ``next()``'s last lines.
        self.stash: list = []
        self.failed = False
        self.position = position  # moved as each batch is handed over (state_dict)

    def take(self, order: Reorderer) -> bool:
        """Move the next batch to hand out into ``taken`` (from here on an interrupt puts it
        back: ``put_back``); skips ended iterators' marks. False: none is ready."""
        while True:
            self.taken = ready = order.take()
            if ready is None:
                return False
            order.taken(ready)
            if ready.status != ENDED:
                return True
            self.position.ended(ready.worker, ready.state)
            self.taken = None

    def put_back(self, order: Reorderer) -> None:
        """``next()`` was interrupted: a batch taken and not handed over is next again."""
        taken, self.taken = self.taken, None
        if taken is not None:
            order.unget(taken)

    def slot(self) -> int | None:
        """The slot the taken batch is in, if any: owned (``Session.reconcile_slots``)."""
        taken = self.taken
        return taken.slot if taken is not None and taken.storage is None else None

    def hand_over(self, source: ArenaSource, arena: Arena | None) -> None:
        """Build the taken batch into ``stash`` (or its error, ``failed``), counted as handed
        out. Ctrl-C in here: a built batch (or error) is stashed all the same, an unbuilt one
        stays taken."""
        ready = self.taken
        batch, failed = None, ready.status == FAILED
        counted = self.position.yielded  # moves when the batch is counted as handed out
        try:
            if failed:
                batch = rebuild_worker_error(ForkingPickler.loads(ready.body), ready.indices,
                                             ready.idx)
                self.position.handed(ready.worker, None)
            else:
                in_slot = ready.storage is None
                batch = source.deliver(arena, ready.slot if in_slot else None, ready.storage,
                                       ready.plan, ready.idx, ready.indices)
                self.position.handed(ready.worker, ready.state)
            # Counted, then stashed and no longer taken (one statement): interrupted before,
            # the handler below stashes it as counted already (state_dict stays exact).
            self.stash, self.failed, self.taken = [batch], failed, None
        except KeyboardInterrupt:
            if batch is not None:
                if self.position.yielded == counted:  # built, not yet counted
                    self.position.handed(ready.worker, None if failed else ready.state)
                self.stash, self.failed, self.taken = [batch], failed, None
            elif not failed and ready.storage is None and ready.status == LOADED and \
                    arena.pool.state(ready.slot) is SlotState.LEASED:
                arena.pool.take_back(ready.slot)  # leased, never handed out
            raise
        except Exception as exc:  # not deliverable (a bad object leaf): its error is its batch
            self.stash, self.failed, self.taken = [exc], True, None
            # The slot would otherwise stay FILLED (interrupted here: reconcile_slots).
            if ready.status == LOADED and ready.storage is None and \
                    arena.pool.state(ready.slot) is SlotState.FILLED:
                arena.pool.reclaim(ready.slot)


def timeout_message(timeout: float, order: Reorderer, pids: list[int]) -> str:
    """torch's timeout text, plus which batch of which worker ``next()`` waits for."""
    message = f"DataLoader timed out after {timeout} seconds"
    in_flight = order.in_flight
    waiting = [f"batch idx={idx} (indices {listed(in_flight[idx][2])!r}) from worker "
               f"{in_flight[idx][0]} (pid {pids[in_flight[idx][0]]})"
               for idx in order.owed() if idx in in_flight]
    if waiting:
        message += (f" waiting for {', '.join(waiting)}, which is still running; raise "
                    "`timeout` if loading is this slow")
    return message
