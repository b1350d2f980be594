"""The device copy stage: an ``arena_loader-device`` thread copies each leased host slot to
the GPU while the consumer takes the device batches copied before it (docs/design.md, "Device
copies")."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

from .._arena import LeasedSlot
from .._leases import HeldLimit, collect_unlocked
from .._stage import POLL_S, Ended, HostStage, Raised
from . import cuda
from .ring import DeviceRing
from .upload import Copied, SlotUploader

# Copied batches waiting for the consumer: enough to hide one copy behind the consumer's step.
DEVICE_PREFETCH = 2


class DeviceStage(HostStage):
    """The ``arena_loader-device`` thread (``_stage.HostStage``) and the consumer's side of
    it: each host slot copied to a device buffer, handed out as device arrays."""

    thread_name = "arena_loader-device"

    def __init__(self, host: Iterator, gpu: int, slots: int, pin_memory: bool,
                 to_torch: bool, owns_host: bool, held_limit: int | None = None,
                 auto_torch: bool = False, positions: Any = None):
        super().__init__(host, owns_host, DEVICE_PREFETCH, positions)
        self._gpu = gpu
        self._slots = slots
        self._limit = HeldLimit(held_limit, " on the GPU", " (copy one if you need to keep it)")
        self._ring = DeviceRing(slots)
        self._uploader = SlotUploader(self._ring, gpu, pin_memory, to_torch, auto_torch)
        self._consumer_streams = cuda.ConsumerStreams(gpu, to_torch)
        self._stream: Any = None  # the copy stream, while the thread runs

    # -- the device thread ----------------------------------------------------------------

    def _work(self) -> None:
        with cuda.on_gpu(self._gpu):
            self._copy_all()

    def _copy_all(self) -> None:
        item: Any
        item, self._first = self._first, None  # no other frame may keep the first batch
        stream, destroy = cuda.new_stream()
        with self._cv:
            self._stream = stream
        try:
            while True:
                if item is None:
                    item = self._next_host()
                    if item is None:
                        return
                if isinstance(item, (Raised, Ended)):
                    self._uploader.retire()
                    if not self._publish(item) or isinstance(item, Ended) or item.fatal:
                        return
                    self._wait_taken(item)  # the next batch is loaded once this error is seen
                    item = None
                    continue
                taken = self._take_buffer(item.nbytes)
                if taken is None or self._stop:
                    return
                copied = self._uploader.copy(item, taken, stream, self._position())
                item = None  # staged: the host slot goes back now, not after the copy
                # At most one copy outstanding while the next host batch is fetched: the
                # previous one is waited for, and its host slot goes back.
                self._uploader.retire(keep=1)
                # No reference stays here once published: the consumer's drop of the batch
                # must return its buffer while this thread loads the next one.
                published, copied = self._publish(copied), None
                if not published:
                    return
        finally:
            self._uploader.close()
            with self._cv:
                self._stream = None
            stream.synchronize()
            if destroy is not None:
                destroy()

    def _next_host(self) -> LeasedSlot | Raised | Ended | None:
        item = super()._next_host()
        if item is not None and not isinstance(item, (LeasedSlot, Raised, Ended)):
            raise RuntimeError(f"arena_loader bug: the device stage got {type(item).__name__}, "
                               "not a LeasedSlot")
        return item

    def _take_buffer(self, nbytes: int) -> tuple[int, Any] | None:
        with self._cv:
            while not self._stop:
                # Fewer batches queued than the read-ahead allows: the consumer holds the
                # other buffers, so a new one is allocated rather than waiting for them.
                taken = self._ring.take(nbytes,
                                        grow=len(self._ready) < max(1, self._slots - 1))
                if taken is not None:
                    return taken
                self._cv.notify_all()  # a consumer waiting in next() may have to raise
                self._cv.wait(POLL_S)
        return None

    # -- the consumer ---------------------------------------------------------------------

    def next_batch(self) -> Any:
        with self._consumer_lock:
            with cuda.on_gpu(self._gpu):
                stream = self._consumer_streams.current()
                item = self._take(stream)  # left queued: an interrupt before the end keeps it
                self._received(item)
                if isinstance(item, Copied):
                    item.event.wait(stream)  # the consumer's work follows the copy
                    return self._hand_over(item).batch
            self._hand_on(item)

    def _hand_over(self, item: Copied) -> Copied:
        with self._cv:
            self._ring.hand_out(item.index)  # the consumer's now: held
        return self._remove(item)

    def _take(self, stream: Any) -> Copied | Raised | Ended:
        with self._cv:
            # (Checked once: while this next() waits, the consumer can only hold fewer.)
            self._limit.check(functools.partial(self._held, stream),
                              functools.partial(collect_unlocked, self._cv))
            # No buffer free is never final here: with nothing queued the thread may always
            # allocate one (_take_buffer), so the consumer waits for that copy.
            return self._first_queued(functools.partial(self._fence, stream))

    def _fence(self, stream: Any) -> None:
        """Released buffers become free (behind a fence on ``stream``): the thread may wait."""
        if self._ring.fence_released(stream):
            self._cv.notify_all()

    def _held(self, stream: Any) -> int:
        """Device batches the consumer holds: buffers it took whose lease lives."""
        self._fence(stream)
        return self._ring.held()

    # -- teardown -------------------------------------------------------------------------

    def _before_host_close(self) -> None:
        # The thread may still wait in the host iterator (or on the GPU) with copies queued:
        # they complete before the host iterator, which may unpin its slab, is closed.
        self._sync_copies()

    def _sync_copies(self) -> None:
        """Wait, from another thread, for every copy queued so far."""
        with self._cv:
            stream = self._stream
        if stream is None:
            return
        try:
            with cuda.on_gpu(self._gpu):
                stream.synchronize()
        except Exception:
            # The context is gone (interpreter exit) or broken: no copy can be running, and
            # the next CUDA call of the consumer reports a broken one.
            pass
