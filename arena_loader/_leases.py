"""The lease ring: numbered buffers (a slab's slots, device buffers) lent to the consumer, one
lease object per batch whose death returns its buffer; and ``held_batch_limit``, met by
what the rings count as held (docs/design.md, "Slot lifecycle" and "Device copies").

``SlotPool`` (host slots) and ``DeviceRing`` (device buffers) are both a ``LeaseRing``: each
index is in one ``LeaseState``, moved by checked transitions; a free list; a weak reference
to each live lease, whose callback records its index in a release table (a C-level call:
no interrupt can cut it short); the count of LEASED indices, which is what the consumer holds.
"""

from __future__ import annotations

import enum
import functools
import gc
import itertools
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
    ties an index to its lease object, and when the lease dies its index is recorded in
    ``_released`` (index -> the dead lease's weak reference) by the weak reference's callback,
    in whatever thread drops the last view. That callback is ``dict.__setitem__`` itself,
    bound to the index: it takes no lock the dropping thread might hold, and a Ctrl-C cannot
    land inside it (one in a Python callback would be swallowed with the slot still LEASED).
    ``_collect_released`` then makes those indices FREE. Not thread-safe otherwise: the owner
    guards it (``SlotPool``'s lock, ``DeviceStage``'s condition).
    """

    def __init__(self, count: int = 0):
        self._states = [FREE] * count
        self._free: deque[int] = deque(range(count))
        self._released: dict[int, weakref.ref] = {}
        # The weak reference to each LEASED index's lease, and the callback per index.
        self._refs: dict[int, weakref.ref] = {}
        self._on_death = [functools.partial(self._released.__setitem__, index)
                          for index in range(count)]
        self.waker: Any = None  # its wake() is called by a release while _wanted is set
        # Set while a waiter found no free index: only then does a release wake it, through
        # a second weak reference to each lease then alive (``_want``).
        self._wanted = False
        self._wake_refs: list[weakref.ref] = []

    def _add(self, state: LeaseState) -> int:
        """A new index (buffers made on demand), in ``state``."""
        index = len(self._states)
        self._on_death.append(functools.partial(self._released.__setitem__, index))
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

    def _want(self, wanted: bool) -> None:
        """A waiter found no free index (``wanted``), or has one now: while it waits, the
        death of any lease alive now wakes it (a lost wake-up costs it one poll interval)."""
        self._wanted = wanted
        if not wanted:
            self._wake_refs.clear()
        elif self.waker is not None and not self._wake_refs:
            wake = functools.partial(_wake, self.waker)
            self._wake_refs = [weakref.ref(lease, wake) for lease in
                               (ref() for ref in list(self._refs.values())) if lease is not None]

    def _collect_released(self) -> int:
        """Released LEASED indices become FREE (appended to the free list); returns how many."""
        # Each step may be redone: a Ctrl-C between two leaves the index in _released (moved
        # again as a no-op: its lease is no longer the tracked one, or the state not LEASED)
        # or FREE and unlisted (SlotPool.reconcile lists it).
        released, free, states, refs = self._released, self._free, self._states, self._refs
        moved = 0
        while released:
            index = next(iter(released))
            ref = released[index]
            if refs.get(index) is ref:  # (an untracked or re-leased index: a stale record)
                if states[index] is LEASED:
                    states[index] = FREE
                    free.append(index)
                    moved += 1
                del refs[index]
            # Only this record: a newer one for the index (its next lease died since) stays.
            if released.get(index) is ref:
                del released[index]
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


def _wake(waker: Any, ref: weakref.ref) -> None:
    waker.wake()


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


class WeakEntries:
    """Objects held weakly, each with a value, in the order added; an entry leaves when its
    object dies. The weak reference's callback is the dict's pop bound to the entry's number
    (the dead reference it is called with is pop's default): a C-level call, as the leases'.
    A Python callback (``WeakSet``'s, ``weakref.finalize``'s) would run the handler of a
    signal that had just arrived and swallow what it raised: a Ctrl-C ignored (13% of them
    in a tight loop, when the fork registry's ran at every batch's death). A plain dict and no
    lock: dict operations are atomic under the GIL, and a lock held by another thread at a
    fork would stay locked forever in the child."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, Any]] = {}
        self._numbers = itertools.count()

    def add(self, owner: Any, value: Any = None) -> None:
        number = next(self._numbers)
        forget = functools.partial(self._entries.pop, number)
        self._entries[number] = (weakref.ref(owner, forget), value)

    def discard(self, owner: Any) -> None:
        for number, (ref, _) in self._entries.copy().items():
            if ref() is owner:
                self._entries.pop(number, None)

    def items(self) -> list[tuple[Any, Any]]:
        """``(object, value)`` of each entry whose object is alive, in the order added. (A
        copy first: a collection during the walk may run callbacks that drop entries.)"""
        return [(owner, value) for ref, value in self._entries.copy().values()
                if (owner := ref()) is not None]

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
