"""``ArenaLoader.snapshot()``: a read-only picture of a loader's slab, slots and live iterators,
for tests, debugging and monitoring (docs/design.md, "Introspection").

A snapshot is a copy: it does not change as the loader goes on, and taking one changes
nothing in the loader (no batch is loaded, no slot moves, no worker is asked anything).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._pool import SlotState

# The slot lifecycle, as the values of ``LoaderSnapshot.slot_states`` (docs/design.md, "Slot
# lifecycle"): free -> assigned (a worker loads into it) -> filled -> leased (the consumer
# holds its batch) -> free once every view of the batch has died.
SLOT_STATES = tuple(state.value for state in SlotState)


@dataclass(frozen=True)
class IteratorSnapshot:
    """One live iterator of the loader (with persistent workers: the one iterator that every
    epoch reuses)."""

    # "starting" (no epoch begun), "running", "draining" (taking back the last epoch's
    # batches), "failed" (a fatal error: every next() raises it), "finished" (the epoch
    # ended and the workers were stopped) or "closed". num_workers=0: "running" or "finished".
    phase: str
    # One per worker, in worker id order; empty with num_workers=0 and before workers start.
    # Thread workers all report this process's pid.
    worker_pids: tuple[int, ...]
    # Batches sent to workers and not yet back, by idx (sorted).
    in_flight: tuple[int, ...]
    # Batches back from workers and not yet handed out, by idx (sorted).
    ready: tuple[int, ...]


@dataclass(frozen=True)
class LoaderSnapshot:
    """The loader's own slab and its slots, the batches the consumer holds, and its live
    iterators. A second iterator used while the first still runs gets a private slab, which
    is not described here."""

    closed: bool  # close() was called
    slots: int  # the slot count the slab has (or will have)
    # Each slot's byte budget, learned from the first batch; None until then.
    slot_nbytes: int | None
    # The slab's size and start address; None while no slab exists (before the first batch,
    # after close(), or when /dev/shm had no room and every batch gets a segment).
    slab_nbytes: int | None
    slab_address: int | None
    pinned: bool  # the slab is page-locked in place (pin_memory=True with device="cuda")
    in_use: bool  # an iterator is using the loader's slab now
    # Each slot's state, one of SLOT_STATES, by slot number; empty while no slab exists.
    slot_states: tuple[str, ...]
    # Batches the consumer still references: leased slots plus batches in one-off segments
    # (made while every slot was held).
    held_batches: int
    held_segments: int  # of which in segments
    iterators: tuple[IteratorSnapshot, ...]  # in the order they were made
    # Slots whose pages are reserved in /dev/shm: a slot's are reserved when it is first
    # handed out (all of them at once for a page-locked slab); 0 while no slab exists.
    backed_slots: int = 0
    # How many batches each slot has carried to the consumer, by slot number.
    slot_leases: tuple[int, ...] = ()

    @property
    def free_slots(self) -> int:
        return self.slot_states.count("free")

    @property
    def assigned_slots(self) -> int:
        return self.slot_states.count("assigned")

    @property
    def filled_slots(self) -> int:
        return self.slot_states.count("filled")

    @property
    def leased_slots(self) -> int:
        return self.slot_states.count("leased")
