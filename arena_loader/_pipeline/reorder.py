"""The batches of one epoch between being sent to a worker and being handed out: which worker
owes which ``idx``, which have arrived, and which one ``next()`` takes (in ``idx`` order, or in
completion order with ``in_order=False``). No threads, no I/O: the session calls it under its
lock, and each change is one statement, so an interrupt between two leaves it consistent."""

from __future__ import annotations

from collections import deque
from typing import Any


class Reorderer:
    def __init__(self, in_order: bool, first_idx: int = 0):
        self.in_order = in_order
        self.in_flight: dict[int, tuple[int, int, Any]] = {}  # idx -> (worker, slot, indices)
        # idx -> its filed Completion, in the order they arrived (in_order=False takes the
        # first: completion order, with no call to record it)
        self.done: dict[int, Any] = {}
        self._again: deque[int] = deque()  # in_order=False: idx put back, taken first
        self.next_idx = first_idx  # in_order: the idx next() hands out next
        # idx -> the worker's replica state sent before that batch's record (datasets with
        # state_dict only: empty, and never looked into, otherwise)
        self.states: dict[int, bytes] = {}

    def arrive(self, ready: Any) -> None:
        """Batch ``ready.idx`` is loaded (it was in flight). Filed in ``done`` first, then out
        of flight, on one line: CPython handles a signal as a call into C returns, so a
        Ctrl-C can land only after the pop, when the move is done (``pop`` first, it landed
        between the two, and the batch was in neither: its record, filed again, passed for
        one taken already and was dropped); a trace function's line event, before both.
        ``settle`` finishes an interrupted arrival."""
        self.done[ready.idx] = ready; self.in_flight.pop(ready.idx, None)  # noqa: E702

    def settle(self, idx: int) -> None:
        """An arrived batch filed again: make sure it is out of flight."""
        self.in_flight.pop(idx, None)

    def take(self) -> Any | None:
        """The next batch to hand out, removed; None if it has not arrived. Then
        ``taken(ready)``. Looked up, then removed by ``del`` and returned on one line: a
        signal is handled as a call into C returns, and ``done.pop`` returning lost the
        batch to it (in neither ``done`` nor the caller's hands: the epoch waited for it);
        ``del`` is no call, and the caller keeps the return in the statement that calls."""
        done = self.done
        if self.in_order:
            idx = self.next_idx
        else:
            again = self._again
            while again and again[0] not in done:
                again.popleft()  # taken already (left in line: dropped once taken)
            idx = again[0] if again else next(iter(done), None)
        ready = done.get(idx)
        if ready is not None:
            del done[idx]; return ready  # noqa: E702 (one line: no call, no line event)
        return None

    def taken(self, ready: Any) -> None:
        """The caller holds ``ready``: the batch after it is next (``unget`` undoes this)."""
        if self.in_order:
            self.next_idx = ready.idx + 1

    def unget(self, ready: Any) -> None:
        """Put back a batch taken but not handed out: it is next again."""
        self.done[ready.idx] = ready
        if self.in_order:
            self.next_idx = min(self.next_idx, ready.idx)
        else:
            self._again.appendleft(ready.idx)  # (interrupted before: taken in its turn)

    def owed(self) -> list[int]:
        """The idx whose absence holds up next(), for error messages."""
        return [self.next_idx] if self.in_order else sorted(self.in_flight)

    def clear_done(self) -> list[Any]:
        """Drop every arrived batch; returns them (their slots are the caller's to reclaim)."""
        dropped = list(self.done.values())
        self.done.clear()
        self._again.clear()
        return dropped
