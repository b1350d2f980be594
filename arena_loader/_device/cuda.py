"""Every ``numba.cuda`` call of arena_loader: device resolution, availability, streams,
events, page-locking, device and pinned buffers, device arrays over a lease.

The other modules of ``_device`` call these through the module (``cuda.new_event()``), so a
test that replaces one here (``monkeypatch.setattr(cuda, "new_event", ...)``) replaces it for
all of them. Under numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) the same calls run on
host arrays; the simulator has no ``mempin`` and no ``__cuda_array_interface__``.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
from numba import cuda

SIMULATED = ".simulator" in type(cuda.gpus).__module__
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


def on_gpu(gpu: int) -> Any:
    """A context manager that makes ``gpu``'s context current in this thread."""
    return cuda.gpus[gpu]


def register(array: np.ndarray) -> Any:
    """cuMemHostRegister over ``array``'s bytes; the returned object unregisters when freed."""
    return cuda.current_context().mempin(array, array.ctypes.data, array.nbytes)


# -- streams and events ---------------------------------------------------------------------

def new_event() -> Any:
    try:
        return cuda.event(timing=False)
    except TypeError:  # numba-cuda's simulator takes no arguments
        return cuda.event()


def new_stream() -> tuple[Any, Callable[[], None] | None]:
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


class ConsumerStreams:
    """The stream the consumer queues its work on: torch's current stream for torch output
    (one numba wrapper per torch stream, made once), else numba's default stream."""

    def __init__(self, gpu: int, to_torch: bool):
        self._gpu = gpu
        self._to_torch = to_torch
        self._wrapped: dict[int, Any] = {}
        # numba's default stream, wrapped once: cuda.default_stream() makes a new object in
        # ~5.5 us (H200), two driver calls that let the device thread's GIL go.
        self._default: Any = None

    def current(self) -> Any:
        if not self._to_torch:
            if self._default is None:
                self._default = 0 if SIMULATED else cuda.default_stream()
            return self._default
        torch = sys.modules["torch"]
        pointer = torch.cuda.current_stream(self._gpu).cuda_stream
        stream = self._wrapped.get(pointer)
        if stream is None:
            stream = self._wrapped[pointer] = cuda.external_stream(pointer)
        return stream


# -- buffers and device arrays --------------------------------------------------------------

def device_bytes(nbytes: int) -> Any:
    """A device buffer of ``nbytes`` bytes."""
    return cuda.device_array(nbytes, dtype=np.uint8)


def pinned_bytes(nbytes: int) -> Any:
    """A page-locked host buffer of ``nbytes`` bytes."""
    return cuda.pinned_array(nbytes, dtype=np.uint8)


def copy_to_buffer(buffer: Any, source: np.ndarray, stream: Any) -> None:
    """Queue the copy of host ``source`` into the start of device ``buffer`` on ``stream``.

    One driver call: on an H100, numba's ``buffer[:n]`` and ``copy_to_device`` cost about 25
    and 100 us of Python a call (their checks), a third of a 16 MiB copy's 306 us."""
    if SIMULATED:
        buffer[: source.nbytes].copy_to_device(source, stream=stream)
    elif source.nbytes:
        from numba.cuda.cudadrv import driver

        driver.host_to_device(buffer, source, source.nbytes, stream=stream)


class _Interface:
    """A field's ``__cuda_array_interface__`` and the lease it keeps alive (for torch)."""

    __slots__ = ("__cuda_array_interface__", "lease")

    def __init__(self, interface: dict, lease: Any):
        self.__cuda_array_interface__ = interface
        self.lease = lease


class DeviceFields:
    """The fields of a batch in a ``DeviceLease``'s buffer, each one array that keeps the
    lease alive: a numba device array, or for ``raw`` (a converter follows, e.g. to torch)
    an object with the field's ``__cuda_array_interface__``.

    Each is made in one call: numba's slice, view and reshape of the whole buffer cost about
    25 us each a field on an H100."""

    __slots__ = ("_lease", "_memory", "_raw")

    def __init__(self, lease: Any, raw: bool = False):
        self._lease = lease
        self._raw = raw
        self._memory = None if SIMULATED else lease.memory  # the buffer's MemoryPointer

    def field(self, offset: int, nbytes: int, dtype: np.dtype, shape: tuple) -> Any:
        """The device array of ``shape`` and ``dtype`` at byte ``offset`` of the buffer."""
        if SIMULATED:
            from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

            # np.asarray(lease) has the lease as its base: the view keeps it alive
            return FakeCUDAArray(np.ndarray(shape, dtype, np.asarray(self._lease), offset))
        if dtype.names is not None or dtype.subdtype is not None:  # a record: numba's views
            whole = cuda.as_cuda_array(self._lease, sync=False)
            return whole[offset: offset + nbytes].view(dtype).reshape(shape)
        if self._raw:
            return _Interface(_interface(self._memory, offset, nbytes, dtype, shape),
                              self._lease)
        return device_array(self._memory, offset, nbytes, dtype, shape, self._lease)


def _interface(memory: Any, offset: int, nbytes: int, dtype: np.dtype, shape: tuple) -> dict:
    return {"shape": tuple(shape), "strides": None, "typestr": dtype.str, "version": 3,
            "data": (memory.device_pointer_value + offset if nbytes else 0, False)}


_direct = True  # numba's classes take the arguments device_array gives them


def device_array(memory: Any, offset: int, nbytes: int, dtype: np.dtype, shape: tuple,
                 owner: Any) -> Any:
    """A numba device array over bytes ``[offset, offset + nbytes)`` of ``memory`` (a numba
    ``MemoryPointer`` of the current context) that keeps ``owner`` alive, as its slices do
    (numba's views carry their base's owner).

    What ``cuda.from_cuda_array_interface`` makes, from numba's public classes, without its
    two driver calls (the current context; the context of the pointer, known here): each is a
    ctypes call that lets the GIL go, so the consumer thread takes it in between, and the
    call cost the device thread 27 us a field in the loader against 9 alone (H200, 4 MiB
    batches: docs/benchmarks.md, "The GPU checks again"). A numba whose classes take other
    arguments gets the public call from the first failure on."""
    global _direct
    if _direct and nbytes:
        try:
            from numba.cuda.cudadrv.devicearray import DeviceNDArray
            from numba.cuda.cudadrv.driver import MemoryPointer

            base = memory.device_pointer
            pointer = type(base)(memory.device_pointer_value + offset)  # ctypes or binding
            data = MemoryPointer(memory.context, pointer, nbytes, owner=owner)
            strides, step = [], dtype.itemsize
            for extent in reversed(shape):
                strides.append(step)
                step *= extent
            return DeviceNDArray(shape, tuple(reversed(strides)), dtype, gpu_data=data)
        except Exception:
            _direct = False
    return cuda.from_cuda_array_interface(_interface(memory, offset, nbytes, dtype, shape),
                                          owner=owner, sync=False)


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
