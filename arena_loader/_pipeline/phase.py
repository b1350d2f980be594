"""A session's lifecycle: one phase at a time, and the moves between them that are legal
(``Session.enter`` raises on any other, as ``SlotPool`` does for slot states)."""

from __future__ import annotations

import enum

# The longest single wait; results, worker exits, freed slots and close() all end it at once.
POLL_S = 0.5


class Phase(enum.Enum):
    STARTING = "starting"  # no epoch begun yet (workers start at the first begin)
    RUNNING = "running"
    DRAINING = "draining"  # taking back the last epoch's batches (persistent workers)
    FAILED = "failed"  # a fatal error: raised by every next(); a new epoch needs a new session
    FINISHED = "finished"  # the epoch ended and the session shut down: next() stops
    CLOSED = "closed"


MOVES = {
    Phase.STARTING: {Phase.RUNNING, Phase.FAILED, Phase.CLOSED},
    Phase.RUNNING: {Phase.DRAINING, Phase.FAILED, Phase.FINISHED, Phase.CLOSED},
    Phase.DRAINING: {Phase.RUNNING, Phase.FAILED, Phase.CLOSED},
    Phase.FAILED: {Phase.CLOSED},
    Phase.FINISHED: set(),
    Phase.CLOSED: set(),
}
