"""The batches of one epoch between being sent to a worker and being handed out: which worker
owes which ``idx``, which have arrived, and which one ``next()`` takes (in ``idx`` order, or in
completion order with ``in_order=False``). No threads, no I/O: the session calls it under its
lock, and each change is one statement, so an interrupt between two leaves it consistent."""

from __future__ import annotations

from collections import deque
from typing import Any


class Ready:
    """A batch a worker reported (or an ended iterator's mark), waiting to be handed out."""

    __slots__ = ("completion", "idx", "indices", "storage")

    def __init__(self, completion: Any, indices: Any, storage: Any):
        self.completion = completion
        self.idx = completion.idx
        self.indices = indices
        self.storage = storage  # a segment's bytes; None: the batch is in its slot


class Reorderer:
    def __init__(self, in_order: bool):
        self.in_order = in_order
        self.in_flight: dict[int, tuple[int, int, Any]] = {}  # idx -> (worker, slot, indices)
        self.done: dict[int, Ready] = {}
        self._arrival: deque[int] = deque()  # in_order=False: idx in completion order
        self.next_idx = 0  # in_order: the idx next() hands out next

    def __len__(self) -> int:
        """Batches sent and not yet taken: what the read-ahead window counts."""
        return len(self.in_flight) + len(self.done)

    def owed_by(self, idx: int) -> int | None:
        """The worker that owes batch ``idx``, if it is in flight."""
        entry = self.in_flight.get(idx)
        return None if entry is None else entry[0]

    def arrive(self, ready: Ready) -> None:
        """Batch ``ready.idx`` is loaded (it was in flight)."""
        self.done[ready.idx] = ready
        if not self.in_order:
            self._arrival.append(ready.idx)
        self.in_flight.pop(ready.idx, None)

    def take(self) -> Ready | None:
        """The next batch to hand out, removed (one statement: the caller keeps it in the
        same one); None if it has not arrived. Then ``taken(ready)``."""
        if self.in_order:
            return self.done.pop(self.next_idx, None)
        return self.done.pop(self._arrival.popleft()) if self._arrival else None

    def taken(self, ready: Ready) -> None:
        """The caller holds ``ready``: the batch after it is next (``unget`` undoes this)."""
        if self.in_order:
            self.next_idx = ready.idx + 1

    def unget(self, ready: Ready) -> None:
        """Put back a batch taken but not handed out: it is next again."""
        self.done[ready.idx] = ready
        if self.in_order:
            self.next_idx = min(self.next_idx, ready.idx)
        else:
            self._arrival.appendleft(ready.idx)

    def owed(self) -> list[int]:
        """The idx whose absence holds up next(), for error messages."""
        return [self.next_idx] if self.in_order else sorted(self.in_flight)

    def clear_done(self) -> list[Ready]:
        """Drop every arrived batch; returns them (their slots are the caller's to reclaim)."""
        dropped = list(self.done.values())
        self.done.clear()
        self._arrival.clear()
        return dropped
