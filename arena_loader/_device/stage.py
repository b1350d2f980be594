"""The device copy stage: an ``arena_loader-device`` thread copies each leased host slot to
the GPU while the consumer takes the device batches copied before it (docs/design.md, "Device
copies")."""

from __future__ import annotations

import functools
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .._arena import LeasedSlot
from .._inprocess import InProcessIterator
from .._leases import HeldLimit, collect_unlocked
from ..errors import LoaderClosedError
from . import cuda
from .ring import DeviceRing
from .upload import Copied, SlotUploader

# Copied batches waiting for the consumer: enough to hide one copy behind the consumer's step.
DEVICE_PREFETCH = 2
# The longest sleep of either side between checks that the other is alive or closed.
POLL_S = 0.5
# How long close() lets the device thread finish the batch it is waiting for before closing
# the host iterator under it: short when that iterator is ours to close, long when it is a
# persistent one (closing it costs the workers) or runs user code in this process.
OWNED_JOIN_S = 0.5
SHARED_JOIN_S = 10.0


@dataclass(frozen=True, eq=False)
class Raised:
    """The host iterator raised ``error`` for a batch; ``fatal``: it will raise it again."""

    error: BaseException
    fatal: bool


@dataclass(frozen=True, eq=False)
class Ended:
    """The host iterator's epoch ended."""


class DeviceStage:
    """The state the device thread and the consumer share; the thread references only this,
    so an abandoned ``DeviceIterator`` is collected and its finalizer closes the stage."""

    def __init__(self, host: Iterator, gpu: int, slots: int, pin_memory: bool,
                 to_torch: bool, owns_host: bool, held_limit: int | None = None,
                 auto_torch: bool = False):
        self._host = host
        self._gpu = gpu
        self._slots = slots
        self._limit = HeldLimit(held_limit, " on the GPU", " (copy one if you need to keep it)")
        self._owns_host = owns_host
        self._cv = threading.Condition()
        self._ready: deque[Copied | Raised | Ended] = deque()
        self._ring = DeviceRing(slots)
        self._uploader = SlotUploader(self._ring, gpu, pin_memory, to_torch, auto_torch)
        self._consumer_streams = cuda.ConsumerStreams(gpu, to_torch)
        self._stream: Any = None  # the copy stream, while the thread runs
        self._stop = False
        self._closed = False
        self._finished = False
        self._thread: threading.Thread | None = None

    # -- the device thread ----------------------------------------------------------------

    def start(self, first: LeasedSlot) -> None:
        # Handed over in an attribute, not as a thread argument: Thread keeps its arguments
        # until run() returns, which would hold the first batch's slot for the whole epoch.
        self._first: LeasedSlot | None = first
        thread = threading.Thread(target=self._run, daemon=True, name="arena_loader-device")
        with self._cv:
            if self._closed:
                raise LoaderClosedError("this iterator was closed; call iter(loader) for a new one")
            self._thread = thread
        thread.start()

    def _run(self) -> None:
        try:
            with cuda.on_gpu(self._gpu):
                self._copy_all()
        except BaseException as exc:  # a CUDA error: the consumer raises it from next()
            self._publish(Raised(exc, fatal=True))

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
                copied = self._uploader.copy(item, taken, stream)
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
        """The host iterator's next batch; None when stopping."""
        try:
            item = next(self._host)
        except StopIteration:
            return Ended()
        except BaseException as exc:
            if self._stop:
                return None
            return Raised(exc, fatal=bool(getattr(self._host, "broken", False)))
        if self._stop:
            return None
        if not isinstance(item, LeasedSlot):
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

    def _publish(self, item: Copied | Raised | Ended) -> bool:
        """Queue ``item`` for the consumer, waiting for room; False when stopping."""
        with self._cv:
            while len(self._ready) >= DEVICE_PREFETCH and not self._stop:
                self._cv.wait(POLL_S)
            if self._stop:
                return False
            self._ready.append(item)
            self._cv.notify_all()
            return True

    def _wait_taken(self, item: Raised) -> None:
        with self._cv:
            while item in self._ready and not self._stop:
                self._cv.wait(POLL_S)

    # -- the consumer ---------------------------------------------------------------------

    @property
    def awaits_first(self) -> bool:
        """Neither started nor closed: ``start`` may be called."""
        return self._thread is None and not self._closed

    def next_batch(self) -> Any:
        with cuda.on_gpu(self._gpu):
            stream = self._consumer_streams.current()
            item = self._take(stream)
            if isinstance(item, Copied):
                item.event.wait(stream)  # the consumer's work on the batch follows the copy
                return item.batch
        if isinstance(item, Raised):
            raise item.error
        self._finished = True
        self.close()
        raise StopIteration

    def _take(self, stream: Any) -> Copied | Raised | Ended:
        with self._cv:
            # (Checked once: while this next() waits, the consumer can only hold fewer.)
            self._limit.check(functools.partial(self._held, stream),
                              functools.partial(collect_unlocked, self._cv))
            while True:
                self._fence(stream)
                if self._ready:
                    item = self._ready[0]
                    if isinstance(item, Copied):
                        self._ring.hand_out(item.index)  # the consumer's now: held
                    if not (isinstance(item, Raised) and item.fatal):
                        self._ready.popleft()  # a fatal error is raised again by every next()
                    self._cv.notify_all()
                    return item
                if self._closed:
                    if self._finished:
                        return Ended()
                    raise LoaderClosedError("this iterator was closed; call iter(loader) for "
                                            "a new one")
                # No buffer free is never final here: with nothing queued the thread may always
                # allocate one (_take_buffer), so the consumer waits for that copy.
                if not self._cv.wait(POLL_S) and not self._thread.is_alive():
                    raise RuntimeError("the arena_loader device thread stopped unexpectedly")

    def _fence(self, stream: Any) -> None:
        """Released buffers become free (behind a fence on ``stream``): the thread may wait."""
        if self._ring.fence_released(stream):
            self._cv.notify_all()

    def _held(self, stream: Any) -> int:
        """Device batches the consumer holds: buffers it took whose lease lives."""
        self._fence(stream)
        return self._ring.held()

    # -- teardown -------------------------------------------------------------------------

    def close(self) -> None:
        """Idempotent; safe from a finalizer. Stops and joins the thread; closes the host
        iterator if this stage owns it (or if the thread is stuck in it)."""
        with self._cv:
            if self._closed:
                return
            self._closed = self._stop = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            # A multi-process host iterator it owns is closed soon; one that runs user code in
            # this process, or a persistent one, is given time to finish its batch.
            quick = self._owns_host and not isinstance(self._host, InProcessIterator)
            thread.join(OWNED_JOIN_S if quick else SHARED_JOIN_S)
            if self._owns_host or thread.is_alive():
                # The thread may still wait in the host iterator (or on the GPU) with copies
                # queued: they complete before the host iterator, which may unpin its slab,
                # is closed.
                self._sync_copies()
                self._host.close()
            thread.join(SHARED_JOIN_S)
        elif self._owns_host:
            self._host.close()
        with self._cv:
            self._ready.clear()  # batches never taken: their buffers and leases go too

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
