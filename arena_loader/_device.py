"""The GPU leg: page-locking the slab and copying batches to a CUDA device on a numba stream.

Every ``numba.cuda`` call of arena_loader is in this module. It is imported only by a loader
with ``pin_memory=True`` or ``device`` set, so ``import arena_loader`` needs no GPU and never
imports ``numba.cuda``. Under numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) the same code
runs on host arrays; the simulator has no ``mempin`` (so it takes the staging path) and no
``__cuda_array_interface__`` (so no torch output). See docs/design.md, "Device copies".
"""

from __future__ import annotations

import ctypes
import sys
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import cuda

from ._arena import LeasedSlot
from ._inprocess import InProcessIterator
from ._pool import collect_unlocked
from .errors import LoaderClosedError, SlotsExhaustedError

SIMULATED = ".simulator" in type(cuda.gpus).__module__
# Copied batches waiting for the consumer: enough to hide one copy behind the consumer's step.
DEVICE_PREFETCH = 2
# Pinned staging buffers when the slab cannot be page-locked: the one being copied from while
# the next batch is staged into the other.
STAGING_BUFFERS = 2
# The longest sleep of either side between checks that the other is alive or closed.
POLL_S = 0.5
# How long close() lets the device thread finish the batch it is waiting for before closing
# the host iterator under it: short when that iterator is ours to close, long when it is a
# persistent one (closing it costs the workers) or runs user code in this process.
OWNED_JOIN_S = 0.5
SHARED_JOIN_S = 10.0
CU_STREAM_NON_BLOCKING = 1


def cuda_unavailable_reason() -> str | None:
    """None when a CUDA GPU (or the simulator) can be used, else why not."""
    try:
        if cuda.is_available() and len(cuda.gpus) > 0:
            return None
    except Exception as exc:  # a broken driver install raises instead of answering False
        return repr(exc)
    # is_available() also wants NVVM, which compiles kernels; copies need only the driver.
    try:
        from numba.cuda.cudadrv.driver import driver

        if driver.is_available and len(cuda.gpus) > 0:
            return None
    except Exception:
        pass
    error = cuda.cuda_error()
    return " ".join(str(error).split()) if error else "no CUDA GPU was found"


def resolve_gpu(index: int | None) -> int:
    """The GPU a loader uses: ``index``, or for ``device="cuda"`` torch's current GPU if torch
    is in use (else GPU 0). A ValueError names ``device`` if there is no such GPU."""
    count = len(cuda.gpus)
    if index is None:
        torch = sys.modules.get("torch")
        use_torch = torch is not None and not SIMULATED and torch.cuda.is_available()
        index = torch.cuda.current_device() if use_torch else 0
    if index >= count:
        raise ValueError(f"device must name one of the {count} GPUs (cuda:0 to "
                         f"cuda:{count - 1}), got 'cuda:{index}'; pass device='cuda' for the "
                         "current GPU")
    return index


# -- page-locking ---------------------------------------------------------------------------

def _register(array: np.ndarray) -> Any:
    """cuMemHostRegister over ``array``'s bytes; the returned object unregisters when freed."""
    return cuda.current_context().mempin(array, array.ctypes.data, array.nbytes)


class PinnedSlab:
    """One slab page-locked in place; ``close`` unregisters it (before the slab is unmapped)."""

    def __init__(self, memory: Any, gpu: int):
        self._memory = memory  # numba's PinnedMemory: its finalizer unregisters at once
        self._gpu = gpu

    def close(self) -> None:
        memory, self._memory = self._memory, None
        if memory is None:
            return
        try:
            with cuda.gpus[self._gpu]:
                del memory
        except Exception:
            if not sys.is_finalizing():  # at exit the driver may already be gone
                raise


class HostPinner:
    """Page-locks each slab of a loader once, in place; warns once if that fails.

    Called by ``Arena`` with the slab array, on whichever thread makes the arena.
    """

    def __init__(self, gpu: int, staging: bool):
        self.gpu = gpu
        self._staging = staging  # a device stage copies through staging buffers on failure
        self._warned = False

    def __call__(self, array: np.ndarray) -> PinnedSlab | None:
        try:
            with cuda.gpus[self.gpu]:
                return PinnedSlab(_register(array), self.gpu)
        except Exception as exc:
            if not self._warned:
                self._warned = True
                then = (f"batches are copied to the GPU through {STAGING_BUFFERS} pinned "
                        "staging buffers instead (one more host copy per batch)"
                        if self._staging else "batches stay in pageable host memory")
                warnings.warn(f"pin_memory=True: page-locking the {array.nbytes}-byte slab in "
                              f"place failed ({exc!r}); {then}", stacklevel=2)
            return None


# -- streams, events, device arrays ---------------------------------------------------------

def _new_event() -> Any:
    try:
        return cuda.event(timing=False)
    except TypeError:  # numba-cuda's simulator takes no arguments
        return cuda.event()


def _new_stream() -> tuple[Any, Callable[[], None] | None]:
    """The copy stream and how to destroy it. Non-blocking, so that copies do not wait for
    (or hold up) work on the legacy default stream, where torch and numba queue by default;
    numba only makes blocking streams, so it is created through numba's driver binding."""
    if SIMULATED:
        return cuda.stream(), None
    try:
        from numba.cuda.cudadrv import driver as drv

        if getattr(drv, "USE_NV_BINDING", True):
            handle = drv.driver.cuStreamCreate(CU_STREAM_NON_BLOCKING)
            pointer = int(handle)
        else:
            handle = drv.drvapi.cu_stream()
            drv.driver.cuStreamCreate(ctypes.byref(handle), CU_STREAM_NON_BLOCKING)
            pointer = handle.value
    except Exception:  # an unexpected binding: a blocking stream still gives right results
        return cuda.stream(), None
    return cuda.external_stream(pointer), lambda: drv.driver.cuStreamDestroy(handle)


def _default_stream() -> Any:
    return 0 if SIMULATED else cuda.default_stream()


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


def _owned_array(lease: DeviceLease) -> Any:
    """A device array over the lease's buffer that keeps the lease alive (so do its views)."""
    if SIMULATED:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return FakeCUDAArray(np.asarray(lease))
    return cuda.as_cuda_array(lease, sync=False)


class DeviceRing:
    """Device buffers, one batch each, allocated on demand up to ``limit``, and beyond it
    while the consumer holds the others (``take(grow=True)``: GPU memory grows with the
    batches kept, as in torch).

    A buffer is FREE, in use (copied into, queued, or held by the consumer), or released (its
    lease died). Released buffers become FREE at the consumer's next ``next()``, together with a
    fence event recorded on the consumer's stream there: work the consumer queued on a batch
    was queued before it dropped the batch, so a copy into the buffer waits on that fence.
    Guarded by the stage's condition, except ``_release`` (lock-free, for finalizers).
    """

    def __init__(self, limit: int):
        self.limit = limit
        self._buffers: list[Any] = []
        self._free: deque[tuple[int, Any]] = deque()  # (index, fence event or None)
        self._released: deque[int] = deque()
        self.starved = False  # the device thread waits for a buffer and may allocate no more

    def take(self, nbytes: int, grow: bool = False) -> tuple[int, Any] | None:
        """A free buffer (allocating one if allowed) and its fence; None if none can be had."""
        if self._free:
            self.starved = False
            index, fence = self._free.popleft()
            if self._buffers[index].nbytes < nbytes:  # a larger batch than this buffer holds
                if fence is not None:
                    fence.synchronize()  # the consumer's reads of it are done: replace it
                self._buffers[index] = cuda.device_array(nbytes, dtype=np.uint8)
                fence = None
            return index, fence
        if len(self._buffers) < self.limit or grow:
            self.starved = False
            self._buffers.append(cuda.device_array(nbytes, dtype=np.uint8))
            return len(self._buffers) - 1, None
        self.starved = True
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
        fence = _new_event()
        fence.record(stream)
        moved = 0
        while self._released:
            self._free.append((self._released.popleft(), fence))
            moved += 1
        self.starved = False
        return moved

    @property
    def held(self) -> int:
        return len(self._buffers) - len(self._free)


# -- the stage between the host iterator and the consumer ----------------------------------

@dataclass(frozen=True, eq=False)
class Copied:
    """A batch queued for copying into a device buffer; ``event`` completes with the copy."""

    batch: Any
    event: Any


@dataclass(frozen=True, eq=False)
class Raised:
    """The host iterator raised ``error`` for a batch; ``fatal``: it will raise it again."""

    error: BaseException
    fatal: bool


@dataclass(frozen=True, eq=False)
class Ended:
    """The host iterator's epoch ended."""


@dataclass
class _Pending:
    """The last copy: its host slot (``held``, None once staged) goes back when it completes."""

    event: Any
    held: LeasedSlot | None


class _Stage:
    """The state the device thread and the consumer share; the thread references only this,
    so an abandoned ``DeviceIterator`` is collected and its finalizer closes the stage."""

    def __init__(self, host: Iterator, gpu: int, slots: int, pin_memory: bool,
                 to_torch: bool, owns_host: bool, held_limit: int | None = None,
                 auto_torch: bool = False):
        self._host = host
        self._gpu = gpu
        self._slots = slots
        self._held_limit = held_limit
        self._in_copy = 0  # buffers the thread took and has not queued yet (not held)
        self._auto_torch = auto_torch
        self._pin_memory = pin_memory
        self._to_torch = to_torch
        self._convert = torch_converter(gpu) if to_torch else None
        self._owns_host = owns_host
        self._cv = threading.Condition()
        self._ready: deque[Copied | Raised | Ended] = deque()
        self._ring = DeviceRing(slots)
        self._pending: _Pending | None = None
        self._stream: Any = None  # the copy stream, while the thread runs
        self._stop = False
        self._closed = False
        self._finished = False
        self._thread: threading.Thread | None = None
        self._consumer_streams: dict[int, Any] = {}

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
            with cuda.gpus[self._gpu]:
                self._copy_all()
        except BaseException as exc:  # a CUDA error: the consumer raises it from next()
            self._publish(Raised(exc, fatal=True))

    def _copy_all(self) -> None:
        item: Any
        item, self._first = self._first, None  # no other frame may keep the first batch
        stream, destroy = _new_stream()
        with self._cv:
            self._stream = stream
        staging: list[Any] = []
        copies = 0
        try:
            while True:
                if item is None:
                    item = self._next_host()
                    if item is None:
                        return
                if isinstance(item, (Raised, Ended)):
                    self._retire()
                    if not self._publish(item) or isinstance(item, Ended) or item.fatal:
                        return
                    self._wait_taken(item)  # the next batch is loaded once this error is seen
                    item = None
                    continue
                taken = self._take_buffer(item.nbytes)
                if taken is None or self._stop:
                    return
                copied, held = self._copy(item, taken, stream, staging, copies)
                item = None  # staged: the host slot goes back now, not after the copy
                copies += 1
                self._retire()
                with self._cv:
                    self._pending = _Pending(copied.event, held)
                del held
                if not self._publish(copied):
                    return
        finally:
            self._retire()
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
                    self._in_copy += 1  # taken by this thread until published
                    return taken
                self._cv.notify_all()  # a consumer waiting in next() may have to raise
                self._cv.wait(POLL_S)
        return None

    def _copy(self, leased: LeasedSlot, taken: tuple[int, Any], stream: Any,
              staging: list[Any], copies: int) -> tuple[Copied, LeasedSlot | None]:
        """Queue the copy of the slot into the device buffer; (the batch, what to hold)."""
        index, fence = taken
        # Only the batch's bytes: batches vary in size, a slot or segment may be larger.
        source = np.asarray(leased.lease)[: leased.nbytes]
        held: LeasedSlot | None = leased
        if self._pin_memory and not leased.pinned:
            if len(staging) < STAGING_BUFFERS:
                staging.append(cuda.pinned_array(source.nbytes, dtype=np.uint8))
            # The buffer used two copies ago: that copy was retired before this one.
            which = copies % STAGING_BUFFERS
            if staging[which].nbytes < source.nbytes:  # a larger batch than any before
                staging[which] = cuda.pinned_array(source.nbytes, dtype=np.uint8)
            buffer = staging[which][: source.nbytes]
            np.copyto(buffer, source)
            source, held = buffer, None
        if fence is not None:
            fence.wait(stream)
        self._ring.buffer(index)[: source.nbytes].copy_to_device(source, stream=stream)
        event = _new_event()
        event.record(stream)
        lease = self._ring.lease(index)
        convert = self._convert
        if convert is None and leased.plan.torch and self._auto_torch:
            convert = torch_converter(self._gpu)  # output=None: a torch dataset's batches
        batch = leased.assemble(_owned_array(lease), convert)
        return Copied(batch, event), held

    def _retire(self) -> None:
        """Wait for the last copy; its host slot (if still held) is released when it is done."""
        with self._cv:
            pending, self._pending = self._pending, None
        if pending is not None:
            pending.event.synchronize()

    def _publish(self, item: Copied | Raised | Ended) -> bool:
        """Queue ``item`` for the consumer, waiting for room; False when stopping."""
        with self._cv:
            while len(self._ready) >= DEVICE_PREFETCH and not self._stop:
                self._cv.wait(POLL_S)
            if self._stop:
                return False
            self._ready.append(item)
            if isinstance(item, Copied):
                self._in_copy -= 1
            self._cv.notify_all()
            return True

    def _wait_taken(self, item: Raised) -> None:
        with self._cv:
            while item in self._ready and not self._stop:
                self._cv.wait(POLL_S)

    # -- the consumer ---------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._thread is not None

    def next_batch(self) -> Any:
        with cuda.gpus[self._gpu]:
            stream = self._consumer_stream()
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
        collected = False
        with self._cv:
            while True:
                if self._ring.fence_released(stream):
                    self._cv.notify_all()
                if self._held_limit is not None and self._held() >= self._held_limit:
                    if collected:
                        raise self._exhausted_error()
                    collect_unlocked(self._cv)
                    collected = True
                    continue
                if self._ready:
                    item = self._ready[0]
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

    def _consumer_stream(self) -> Any:
        """The stream the consumer queues its work on: torch's current stream for torch
        output, else numba's default stream."""
        if not self._to_torch:
            return _default_stream()
        torch = sys.modules["torch"]
        pointer = torch.cuda.current_stream(self._gpu).cuda_stream
        stream = self._consumer_streams.get(pointer)
        if stream is None:
            stream = self._consumer_streams[pointer] = cuda.external_stream(pointer)
        return stream

    def _held(self) -> int:
        """Device batches the consumer holds: buffers in use and not queued for it."""
        return self._ring.held - len(self._ready) - self._in_copy

    def _exhausted_error(self) -> SlotsExhaustedError:
        return SlotsExhaustedError(
            f"your code holds {self._held()} batches on the GPU from this loader, the "
            f"held_batch_limit={self._held_limit} you set, so no next batch is made; drop "
            "references to old batches (copy one if you need to keep it), or raise or remove "
            "held_batch_limit")

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
            with cuda.gpus[self._gpu]:
                stream.synchronize()
        except Exception:
            # The context is gone (interpreter exit) or broken: no copy can be running, and
            # the next CUDA call of the consumer reports a broken one.
            pass


class DeviceIterator:
    """What ``iter(loader)`` returns with ``device`` set: batches whose arrays are on the GPU
    (numba device arrays, or torch CUDA tensors with ``output="torch"``)."""

    def __init__(self, owner: Any, host: Iterator, gpu: int, slots: int, pin_memory: bool,
                 to_torch: bool, owns_host: bool, held_limit: int | None = None,
                 auto_torch: bool = False):
        self._owner = owner  # the loader: `for b in ArenaLoader(...)` must keep it alive
        self._host = host
        self._stage = _Stage(host, gpu, slots, pin_memory, to_torch, owns_host, held_limit,
                             auto_torch)
        self._finalizer = weakref.finalize(self, self._stage.close)

    def __iter__(self) -> DeviceIterator:
        return self

    def __next__(self) -> Any:
        stage = self._stage
        if not stage.started and not stage._closed:
            # The first batch is taken here, in the consumer's thread, so that whatever the
            # host iterator does at its first next() (claim the arena, pin the slab) happens
            # here; its errors are this next()'s, and the following next() tries again.
            stage.start(next(self._host))  # no local: the thread alone holds that slot
        return stage.next_batch()

    def close(self) -> None:
        self._finalizer()


class DeviceCopier:
    """The loader's device leg: a ``DeviceIterator`` around each host iterator."""

    def __init__(self, gpu: int, slots: int, pin_memory: bool, output: str | None,
                 held_limit: int | None = None):
        self.gpu = gpu
        self._slots = slots
        self._held_limit = held_limit
        self._pin_memory = pin_memory
        self._to_torch = output == "torch"
        # output=None: batches of a torch dataset become CUDA tensors (not in the simulator,
        # which has no __cuda_array_interface__ for torch to read).
        self._auto_torch = output is None and not SIMULATED
        if self._to_torch:
            torch_converter(gpu)  # the simulator cannot: say so at construction
        self._shared: weakref.ref | None = None  # the iterator reading a persistent host one

    def wrap(self, owner: Any, host: Iterator, owns_host: bool) -> DeviceIterator:
        """``owns_host``: close ``host`` with the device iterator (it is not persistent)."""
        iterator = DeviceIterator(owner, host, self.gpu, self._slots, self._pin_memory,
                                  self._to_torch, owns_host, self._held_limit, self._auto_torch)
        if not owns_host:
            self._shared = weakref.ref(iterator)
        return iterator

    def detach(self) -> None:
        """Stop the device iterator still reading the persistent host iterator (an abandoned
        epoch) before that one starts a new epoch."""
        previous = self._shared() if self._shared is not None else None
        self._shared = None
        if previous is not None:
            previous.close()


def torch_converter(gpu: int) -> Callable[[Any], Any]:
    """Device array -> torch CUDA tensor, zero-copy through ``__cuda_array_interface__``."""
    if SIMULATED:
        raise ValueError("output='torch' with device='cuda' needs a real GPU: the numba CUDA "
                         "simulator has no __cuda_array_interface__; use output='numpy' there")
    import torch

    device = torch.device("cuda", gpu)

    def to_tensor(array: Any) -> Any:
        return torch.as_tensor(array, device=device)

    return to_tensor
