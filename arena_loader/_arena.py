"""An arena: one layout, the slab sized for it, and the pool that owns its slots; plus the
loader-level source that keeps one arena across epochs."""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ._fetch import BatchFiller, Fetched
from ._layout import BatchLayout
from ._pool import SlotPool, SlotState
from ._slab import Slab
from .errors import LoaderClosedError, SlotsExhaustedError, forked_iterator_error


@dataclass(frozen=True)
class Filled:
    """A slot the main process filled itself (``num_workers=0``)."""

    slot: int
    indices: Any
    rows: int
    lengths: tuple[int, ...] | None
    objects: list | None


class PinnedRegion(Protocol):
    """Page-locking of a slab (``_device.HostPinner``); ``close`` lifts it."""

    def close(self) -> None: ...


# Page-locks a whole slab array in place; None when that failed (docs/design.md, "Device copies").
Pinner = Callable[[np.ndarray], "PinnedRegion | None"]


@dataclass(frozen=True)
class LeasedSlot:
    """A delivered batch before assembly, for the device copy stage: the lease on its slot
    (``np.asarray(lease)`` is the slot's bytes) and what ``BatchLayout.assemble`` needs."""

    lease: Any
    layout: BatchLayout
    rows: int
    lengths: tuple[int, ...] | None
    objects: list | None
    pinned: bool  # the slab is page-locked in place

    def assemble(self, slot_bytes: Any, convert: Callable[[Any], Any] | None = None) -> Any:
        """The batch as views of ``slot_bytes`` (a copy of the slot, e.g. on a GPU)."""
        return self.layout.assemble(slot_bytes, self.rows, self.lengths, self.objects, convert,
                                    host_bytes=np.asarray(self.lease))


class Arena:
    def __init__(self, layout: BatchLayout, slots: int, slab: Slab | None = None,
                 pinner: Pinner | None = None, lease_only: bool = False):
        """``slab``: a reserved slab that workers already hold, allocated here for ``layout``
        (closed if that fails); by default a new one. ``pinner`` page-locks the slab;
        ``lease_only``: deliver ``LeasedSlot``s for a device stage instead of views."""
        self.layout = layout
        self.slots = slots
        if slab is None:
            slab = Slab(slots * layout.slot_nbytes, slots=slots)
        else:
            slab.allocate(slots * layout.slot_nbytes, slots=slots)
        self.slab = slab
        self.pool = SlotPool(self.slab.array, layout.slot_nbytes, slots)
        self._main_arrays: dict[int, list[np.ndarray]] = {}
        self._lease_only = lease_only
        try:
            self._pinned = pinner(self.slab.array) if pinner is not None else None
        except BaseException:
            self.close()
            raise

    def acquire_or_raise(self) -> int:
        """A free slot; if the consumer holds them all, collect garbage once, then raise."""
        slot = self.pool.acquire()
        if slot is None:
            gc.collect()  # views caught in reference cycles are released only by the collector
            slot = self.pool.acquire()
        if slot is None:
            raise self.exhausted_error()
        return slot

    def exhausted_error(self) -> SlotsExhaustedError:
        held = self.pool.counts()[SlotState.LEASED]
        return SlotsExhaustedError(
            f"all {self.slots} slots are in use: your code still references {held} batches "
            f"from this loader, so no slot is free for the next one; pass slots={self.slots * 2} "
            "(or more) to ArenaLoader, or drop references to old batches (keep a copy with "
            "np.array(batch) if you need one)"
        )

    def fill(self, slot: int, filler: BatchFiller, fetched: Fetched, indices: Any) -> Filled:
        """Write ``fetched`` into an ASSIGNED ``slot`` from the main process."""
        arrays = self._main_arrays.get(slot)
        if arrays is None:
            arrays = self._main_arrays[slot] = self.layout.slot_arrays(self.slab.array, slot)
        try:
            rows, lengths, objects = filler.write(self.layout, arrays, fetched, indices)
        except BaseException:
            self.pool.reclaim(slot)
            raise
        self.pool.mark_filled(slot)
        return Filled(slot, indices, rows, lengths, objects)

    def deliver(self, slot: int, rows: int, lengths: tuple[int, ...] | None,
                objects: list | None) -> Any:
        """Lease a FILLED slot to the consumer and return the batch as views of it."""
        lease = self.pool.lease(slot)
        if self._lease_only:
            return LeasedSlot(lease, self.layout, rows, lengths, objects, self._pinned is not None)
        return self.layout.assemble(np.asarray(lease), rows, lengths, objects)

    def close(self) -> None:
        """No new batch can be made; the mapping lives on only in views still referenced."""
        # Unpin before the slab may be unmapped. Copies from it have completed: the device
        # stage synchronizes its copies before its thread ends, and it ends before this runs.
        pinned, self._pinned = getattr(self, "_pinned", None), None
        if pinned is not None:
            pinned.close()
        self._main_arrays.clear()
        self.pool.close()
        self.slab.close()


class ArenaSource:
    """The loader's arena, made from the first batch's layout and kept across epochs.

    One iterator at a time uses it; a second live iterator of the same loader gets a private
    arena of its own, closed when that iterator gives it back.
    """

    def __init__(self, slots: int, pinner: Pinner | None = None, lease_only: bool = False):
        self.slots = slots
        self._arena_options: dict[str, Any] = dict(pinner=pinner, lease_only=lease_only)
        self.layout: BatchLayout | None = None
        self._arena: Arena | None = None
        self._claimed = False
        self._closed = False
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def claim(self, layout: BatchLayout, slab: Slab | None = None) -> Arena:
        """The loader's arena, or a private one if it is in use. ``slab``: the reserved slab
        the caller's workers hold, which the arena must then use."""
        if os.getpid() != self._pid:  # this arena's slots are the parent's (its lock, too)
            raise forked_iterator_error(self._pid)
        with self._lock:
            if self._closed:
                if slab is not None:
                    slab.close()
                raise LoaderClosedError("this ArenaLoader was closed; create a new one")
            if self._arena is None:
                self._arena = Arena(layout, self.slots, slab, **self._arena_options)
                self.layout = layout
                self._claimed = True
                return self._arena
            if not self._claimed and slab is None:
                self._claimed = True
                return self._arena
        return Arena(layout, self.slots, slab, **self._arena_options)

    def unclaim(self, arena: Arena) -> None:
        with self._lock:
            if arena is self._arena:
                self._claimed = False
                return
        arena.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._arena is not None:
                self._arena.close()
                self._arena = None
