"""Device buffers leased to the consumer like host slots (docs/design.md, "Device copies")."""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any

from . import cuda


class DeviceLease:
    """The consumer's claim on one device buffer: the owner of every device view of a batch.

    When the last view (or torch tensor over one) dies, a ``weakref.finalize`` returns the
    buffer to its ring.
    """

    __slots__ = ("__weakref__", "_buffer", "index")

    def __init__(self, index: int, buffer: Any):
        self.index = index
        self._buffer = buffer

    @property
    def __cuda_array_interface__(self) -> dict:
        return self._buffer.__cuda_array_interface__

    @property
    def __array_interface__(self) -> dict:  # the simulator's device arrays are numpy arrays
        return self._buffer._ary.__array_interface__

    def __repr__(self) -> str:
        return f"DeviceLease(buffer={self.index})"


class DeviceRing:
    """Device buffers, one batch each, allocated on demand up to ``limit``, and beyond it
    while the consumer holds the others (``take(grow=True)``: GPU memory grows with the
    batches kept, as in torch).

    A buffer is FREE, in use (copied into, queued, or held by the consumer), or released (its
    lease died). Released buffers become FREE at the consumer's next ``next()``, together with a
    fence event recorded on the consumer's stream there: work the consumer queued on a batch
    was queued before it dropped the batch, so a copy into the buffer waits on that fence.
    Guarded by the stage's condition, except the leases' finalizers, which only append to
    ``_released`` (lock-free: they run in whatever thread drops the last view).
    """

    def __init__(self, limit: int):
        self.limit = limit
        self._buffers: list[Any] = []
        self._free: deque[tuple[int, Any]] = deque()  # (index, fence event or None)
        self._released: deque[int] = deque()

    def take(self, nbytes: int, grow: bool = False) -> tuple[int, Any] | None:
        """A free buffer (allocating one if allowed) and its fence; None if none can be had."""
        if self._free:
            index, fence = self._free.popleft()
            if self._buffers[index].nbytes < nbytes:  # a larger batch than this buffer holds
                if fence is not None:
                    fence.synchronize()  # the consumer's reads of it are done: replace it
                self._buffers[index] = cuda.device_bytes(nbytes)
                fence = None
            return index, fence
        if len(self._buffers) < self.limit or grow:
            self._buffers.append(cuda.device_bytes(nbytes))
            return len(self._buffers) - 1, None
        return None

    def buffer(self, index: int) -> Any:
        return self._buffers[index]

    def lease(self, index: int) -> DeviceLease:
        lease = DeviceLease(index, self._buffers[index])
        finalizer = weakref.finalize(lease, self._released.append, index)
        finalizer.atexit = False
        return lease

    def fence_released(self, stream: Any) -> int:
        """Make released buffers FREE behind a fence on the consumer's ``stream``."""
        if not self._released:
            return 0
        fence = cuda.new_event()
        fence.record(stream)
        moved = 0
        while self._released:
            self._free.append((self._released.popleft(), fence))
            moved += 1
        return moved

    @property
    def held(self) -> int:
        return len(self._buffers) - len(self._free)
