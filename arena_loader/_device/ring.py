"""Device buffers leased to the consumer like host slots (docs/design.md, "Device copies")."""

from __future__ import annotations

import itertools
from typing import Any

from .._leases import ASSIGNED, FILLED, FREE, LEASED, LeaseRing
from . import cuda


class DeviceLease:
    """The consumer's claim on one device buffer: the owner of every device view of a batch.

    When the last view (or torch tensor over one) dies, this object dies and its ring's weak
    reference returns the buffer.
    """

    __slots__ = ("__weakref__", "_buffer", "index")

    def __init__(self, index: int, buffer: Any):
        self.index = index
        self._buffer = buffer

    @property
    def __cuda_array_interface__(self) -> dict:
        return self._buffer.__cuda_array_interface__

    @property
    def memory(self) -> Any:
        """The buffer's numba ``MemoryPointer`` (its context, pointer and size)."""
        return self._buffer.gpu_data

    @property
    def __array_interface__(self) -> dict:
        # The simulator's device arrays wrap numpy arrays and answer for them.
        return self._buffer.__array_interface__

    def __repr__(self) -> str:
        return f"DeviceLease(buffer={self.index})"


class DeviceRing(LeaseRing):
    """Device buffers, one batch each, allocated on demand up to ``limit``, and beyond it
    while the consumer holds the others (``take(grow=True)``: GPU memory grows with the
    batches kept, as in torch).

    A buffer is FREE, ASSIGNED (taken by the device thread, being copied into), FILLED (its
    lease made: the batch is queued for the consumer), LEASED (the consumer took it), then
    released (its lease died). Released buffers become FREE at the consumer's next ``next()``,
    together with a fence event recorded on the consumer's stream there: work the consumer
    queued on a batch was queued before it dropped the batch, so a copy into the buffer waits
    on that fence. Guarded by the stage's condition, except the device thread's ``lease``
    (of a buffer it alone has taken) and the leases' deaths (lock-free, ``LeaseRing``).
    """

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit
        self._buffers: list[Any] = []
        self._fences: list[Any] = []  # per buffer: the fence of its last release, or None

    def take(self, nbytes: int, grow: bool = False) -> tuple[int, Any] | None:
        """A free buffer (allocating one if allowed), now ASSIGNED, and its fence; None if
        none can be had."""
        if self._free:
            index = self._free[0]
            self._move(index, FREE, ASSIGNED)
            self._free.popleft()
            fence = self._fences[index]
            if self._buffers[index].nbytes < nbytes:  # a larger batch than this buffer holds
                if fence is not None:
                    fence.synchronize()  # the consumer's reads of it are done: replace it
                self._buffers[index] = cuda.device_bytes(nbytes)
                fence = None
            return index, fence
        if len(self._buffers) < self.limit or grow:
            buffer = cuda.device_bytes(nbytes)
            self._buffers.append(buffer)
            self._fences.append(None)
            return self._add(ASSIGNED), None
        return None

    def buffer(self, index: int) -> Any:
        return self._buffers[index]

    def lease(self, index: int) -> DeviceLease:
        """The lease of an ASSIGNED buffer, now FILLED (its batch queued for the consumer)."""
        lease = DeviceLease(index, self._buffers[index])
        self._move(index, ASSIGNED, FILLED)
        self._track(index, lease)
        return lease

    def hand_out(self, index: int) -> None:
        """The consumer took the batch of buffer ``index``: it is held (LEASED). Again after
        a next() that Ctrl-C cut short before returning the batch: it stays LEASED."""
        if self._states[index] is not LEASED:
            self._move(index, FILLED, LEASED)

    def fence_released(self, stream: Any) -> int:
        """Make released buffers FREE behind a fence on the consumer's ``stream``."""
        if not self._released:
            return 0
        moved = self._collect_released()  # appended to the free list's end
        for index in itertools.islice(self._free, len(self._free) - moved, None):
            # One fence per buffer, made once (numba takes ~20 us to make an event) and
            # recorded at each release: the copy that waits on it is queued before the buffer
            # can be released again.
            fence = self._fences[index]
            if fence is None:
                fence = self._fences[index] = cuda.new_event()
            fence.record(stream)
        return moved
