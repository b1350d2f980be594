"""The lease ring: numbered buffers (a slab's slots, device buffers) lent to the consumer, one
lease object per batch whose death returns its buffer; and ``held_batch_limit``, met by
what the rings count as held (docs/design.md, "Slot lifecycle" and "Device copies").

``SlotPool`` (host slots) and ``DeviceRing`` (device buffers) are both a ``LeaseRing``: each
index is in one ``LeaseState``, moved by checked transitions; a free list; a weak reference
to each live lease, whose callback appends its index to a lock-free release queue; the
count of LEASED indices, which is what the consumer holds.
"""

from __future__ import annotations

import enum
import functools
import gc
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from .errors import SlotsExhaustedError


class LeaseState(enum.Enum):
    FREE = "free"
    ASSIGNED = "assigned"  # being written (a host slot's task; a device buffer's copy)
    FILLED = "filled"  # written, not yet the consumer's
    LEASED = "leased"  # the consumer's, until its lease dies


FREE, ASSIGNED, FILLED, LEASED = LeaseState


class LeaseRing:
    """The indices of one set of buffers, each in one ``LeaseState``.

    ``FREE -> ASSIGNED -> FILLED -> LEASED -> FREE``: the owner makes the first moves (with
    ``_move``, which raises on any other, or with inline checks on its hot path), ``_track``
    ties an index to its lease object, and when the lease dies its index is appended to
    ``_released`` (by a weak reference's callback, in whatever thread drops the last view:
    ``deque.append`` is atomic, so a release takes no lock the dropping thread might hold).
    ``_collect_released`` then makes those indices FREE. Not thread-safe otherwise: the owner
    guards it (``SlotPool``'s lock, ``DeviceStage``'s condition).
    """

    def __init__(self, count: int = 0):
        self._states = [FREE] * count
        self._free: deque[int] = deque(range(count))
        self._released: deque[int] = deque()
        # The weak reference to each LEASED index's lease, and the callback per index
        # (through a weak reference to the ring: a bound method here would be a cycle).
        self._refs: dict[int, weakref.ref] = {}
        self._on_death = [functools.partial(_lease_died, weakref.ref(self), index)
                          for index in range(count)]
        self.waker: Any = None  # its wake() is called by a release while _wanted is set
        # Set while a waiter found no free index: only then does a release wake it.
        self._wanted = False

    def _add(self, state: LeaseState) -> int:
        """A new index (buffers made on demand), in ``state``."""
        index = len(self._states)
        self._on_death.append(functools.partial(_lease_died, weakref.ref(self), index))
        self._states.append(state)
        return index

    def _track(self, index: int, lease: Any) -> None:
        """``lease``'s death releases ``index``. A plain weak reference (``weakref.finalize``
        costs twice as much)."""
        self._refs[index] = weakref.ref(lease, self._on_death[index])

    def _untrack(self, index: int) -> bool:
        """Forget the lease of ``index``: its death no longer releases it. True if it had one
        (its reference dies here, so its callback never runs)."""
        return self._refs.pop(index, None) is not None

    def tracks(self, index: int, lease: Any) -> bool:
        """``lease`` is the live lease of ``index``."""
        ref = self._refs.get(index)
        return ref is not None and ref() is lease

    def _lease_died(self, index: int, ref: weakref.ref) -> None:
        if self._refs.get(index) is ref:
            del self._refs[index]
            self._released.append(index)
            waker = self.waker
            if waker is not None and self._wanted:
                waker.wake()

    def _collect_released(self) -> int:
        """Released LEASED indices become FREE (appended to the free list); returns how many."""
        # Each step may be redone: a Ctrl-C between two leaves the index at the head of
        # _released (moved again as a no-op) or FREE and unlisted (SlotPool.reconcile lists it).
        released, free, states = self._released, self._free, self._states
        moved = 0
        while released:
            index = released[0]
            if states[index] is LEASED:
                states[index] = FREE
                free.append(index)
                moved += 1
            released.popleft()
        while free and states[free[0]] is not FREE:
            free.popleft()  # moved to ASSIGNED by a take that Ctrl-C cut short
        return moved

    def held(self) -> int:
        """Batches the consumer holds: LEASED indices (collect released ones first)."""
        return self._states.count(LEASED)

    def _move(self, index: int, expected: LeaseState, new: LeaseState) -> None:
        if self._states[index] is not expected:
            raise RuntimeError(
                f"{self._kind} {index} is {self._states[index].value}, expected "
                f"{expected.value} before becoming {new.value} (arena_loader bug: please "
                "report it)")
        self._states[index] = new

    _kind = "buffer"  # how errors name an index


def _lease_died(ring_ref: weakref.ref, index: int, ref: weakref.ref) -> None:
    ring = ring_ref()
    if ring is not None:
        ring._lease_died(index, ref)


class HeldLimit:
    """``held_batch_limit``, one rule for host and device batches: the consumer holds what its
    ring counts as held (``LeaseRing.held``, plus a host's batches in segments); at ``limit``
    the next batch is an error (after collecting garbage once: views in reference cycles)."""

    __slots__ = ("_keep", "_where", "limit")

    def __init__(self, limit: int | None, where: str = "", keep: str = ""):
        self.limit = limit
        self._where = where  # e.g. " on the GPU"
        self._keep = keep  # how to keep a batch without holding it

    def reached(self, count: Callable[[], int]) -> bool:
        limit = self.limit
        return limit is not None and count() >= limit

    def error(self, held: int) -> SlotsExhaustedError:
        return SlotsExhaustedError(
            f"your code holds {held} batches{self._where} from this loader, the "
            f"held_batch_limit={self.limit} you set, so no next batch is made; drop references "
            f"to old batches{self._keep}, or raise or remove held_batch_limit")

    def check(self, count: Callable[[], int],
              collect: Callable[[], object] | None = None) -> None:
        """Raise ``error`` if the limit is reached, and still is after ``collect``
        (``gc.collect`` by default)."""
        if self.reached(count):
            (collect or gc.collect)()
            held = count()
            if held >= self.limit:
                raise self.error(held)


def collect_unlocked(cv: threading.Condition) -> None:
    """Run the garbage collector with ``cv`` (held by the caller) released: views caught in
    reference cycles give their slot or buffer back only then, and their finalizers may need
    locks that the waiting side holds."""
    cv.release()
    try:
        gc.collect()
    finally:
        cv.acquire()
