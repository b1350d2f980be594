"""An arena: one layout, the slab sized for it, and the pool that owns its slots."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np

from ._layout import BatchLayout
from ._pool import SlotPool, SlotState
from ._slab import Slab
from .errors import SlotsExhaustedError


class Arena:
    def __init__(self, layout: BatchLayout, slots: int):
        self.layout = layout
        self.slots = slots
        self.slab = Slab(slots * layout.slot_nbytes, slots=slots)
        self.pool = SlotPool(self.slab.array, layout.slot_nbytes, slots)
        self._main_arrays: dict[int, list[np.ndarray]] = {}

    def arrays(self, slot: int) -> list[np.ndarray]:
        """The field arrays of ``slot`` for writing from the main process."""
        arrays = self._main_arrays.get(slot)
        if arrays is None:
            arrays = self._main_arrays[slot] = self.layout.slot_arrays(self.slab.array, slot)
        return arrays

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

    def deliver(self, slot: int, rows: int, lengths: tuple[int, ...] | None,
                objects: list | None) -> Any:
        """Lease a FILLED slot to the consumer and return the batch as views of it."""
        lease = self.pool.lease(slot)
        return self.layout.assemble(np.asarray(lease), rows, lengths, objects)

    def close(self) -> None:
        self._main_arrays.clear()
        self.slab.close()
