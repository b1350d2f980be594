"""Queuing the copy of one leased host slot into a device buffer, on the device thread."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._arena import LeasedSlot
from . import cuda
from .ring import DeviceRing

# Pinned staging buffers when the slab cannot be page-locked: the one being copied from while
# the next batch is staged into the other.
STAGING_BUFFERS = 2


@dataclass(frozen=True, eq=False)
class Copied:
    """A batch queued for copying into device buffer ``index``; ``event`` completes with the
    copy."""

    batch: Any
    event: Any
    index: int
    position: Any = None  # the epoch position as of this batch (state_dict), if tracked


@dataclass(frozen=True, eq=False)
class _InFlight:
    """A queued copy: its host slot (``held``, None once staged) goes back when it is done."""

    event: Any
    held: LeasedSlot | None


class SlotUploader:
    """Queues copies of leased host slots into the ring's device buffers on the copy stream,
    through pinned staging buffers when the slot is not page-locked, and holds each slot
    until its copy has completed (``retire``). Used by the device thread alone."""

    def __init__(self, ring: DeviceRing, gpu: int, pin_memory: bool, to_torch: bool,
                 auto_torch: bool):
        self._ring = ring
        self._gpu = gpu
        self._pin_memory = pin_memory
        self._convert = cuda.torch_converter(gpu) if to_torch else None
        self._auto_torch = auto_torch
        self._staging: list[Any] = []
        self._staged = 0  # copies that went through a staging buffer
        self._in_flight: deque[_InFlight] = deque()
        self._events: dict[int, Any] = {}  # per device buffer: the event of its last copy

    def copy(self, leased: LeasedSlot, taken: tuple[int, Any], stream: Any,
             position: Any = None) -> Copied:
        """Queue the copy of ``leased`` into the buffer ``taken`` (index, fence) from the ring;
        the device batch over that buffer, and the copy's event (``position``: the epoch's
        as of this batch, carried to the consumer)."""
        index, fence = taken
        # Only the batch's bytes: batches vary in size, a slot or segment may be larger.
        source = np.asarray(leased.lease)[: leased.nbytes]
        held: LeasedSlot | None = leased
        if self._pin_memory and not leased.pinned:
            source, held = self._stage(source), None
        if fence is not None:
            fence.wait(stream)
        cuda.copy_to_buffer(self._ring.buffer(index), source, stream)
        event = self._events.get(index)
        if event is None:  # one per buffer, made once (numba takes ~20 us to make one)
            event = self._events[index] = cuda.new_event()
        # Recorded again only for the next copy into this buffer, which the ring hands out
        # after the consumer's stream waited on this copy and the batch was dropped.
        event.record(stream)
        self._in_flight.append(_InFlight(event, held))
        lease = self._ring.lease(index)
        convert = self._convert
        if convert is None and leased.plan.torch and self._auto_torch:
            convert = cuda.torch_converter(self._gpu)  # output=None: a torch dataset's batches
        fields = cuda.DeviceFields(lease, raw=convert is not None)
        return Copied(leased.assemble(fields, convert), event, index, position)

    def _stage(self, source: np.ndarray) -> Any:
        """``source`` copied into a pinned staging buffer."""
        staging = self._staging
        # The buffer used two staged copies ago (counted apart from copies straight from a
        # pinned slot, which would otherwise skip a buffer not made yet): that copy was
        # retired before this one.
        which = self._staged % STAGING_BUFFERS
        self._staged += 1
        if which == len(staging):
            staging.append(cuda.pinned_bytes(source.nbytes))
        elif staging[which].nbytes < source.nbytes:  # a larger batch than any before
            staging[which] = cuda.pinned_bytes(source.nbytes)
        buffer = staging[which][: source.nbytes]
        np.copyto(buffer, source)
        return buffer

    def retire(self, keep: int = 0) -> None:
        """Wait for every queued copy but the last ``keep``; the host slots they held go back
        once they are done."""
        while len(self._in_flight) > keep:
            done = self._in_flight.popleft()
            done.event.synchronize()
            del done  # (its slot goes back here, after the copy)

    def close(self) -> None:
        """Wait for every copy; free the staging buffers."""
        self.retire()
        self._staging.clear()
