"""Datasets over numpy arrays and ``.npy`` files that fill a batch's slot in one compiled call.

Both implement the batch protocol (docs/batch_protocol.md): besides ``dataset[i]`` (used once,
to learn the batch layout, and with a custom ``collate_fn``), ``read_into(indices, out)``
gathers every row of a batch straight into the slot with a numba-compiled, GIL-free loop: no
per-sample Python call and no intermediate array.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ._fetch import as_index_array


@runtime_checkable
class BatchReadable(Protocol):
    """What a dataset implements so that workers fill slots a batch at a time.

    ``read_into(indices, out)``: ``indices`` is a 1-D int64 numpy array of sample indices
    (negative ones count from the end, as ``dataset[i]`` allows); ``out`` has the structure of
    one sample (``dataset[indices[0]]``) with every numeric leaf replaced by a writable,
    C-contiguous array of shape ``(len(indices), *leaf_shape)`` and the leaf's dtype, a view of
    the slot. Write row ``r`` of each from sample ``indices[r]``; return nothing. Raise
    ``IndexError`` for an index out of range. The loader calls it only without a custom
    ``collate_fn``, with automatic batching, and when every leaf of a sample is numeric.
    """

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...

    def read_into(self, indices: np.ndarray, out: Any) -> None: ...

    # Optional: ``warm_up()``, called in the main process before fork workers start.


class ArrayDataset:
    """Samples are rows of equally long arrays, like torch's ``TensorDataset``.

    ``ArrayDataset(x, y)``: ``dataset[i]`` is ``(x[i], y[i])``; ``ArrayDataset({"x": x,
    "y": y})``: ``{"x": x[i], "y": y[i]}``. Any array-like works (numpy arrays, memmaps, CPU
    torch tensors share memory through ``.numpy()``); nothing is copied. Batches are gathered
    with a compiled loop (``read_into``), which releases the GIL, so ``worker_mode="thread"``
    runs them in parallel.
    """

    def __init__(self, *arrays: Any) -> None:
        names, values, self._keys = _unpack(arrays, "ArrayDataset")
        self._names = names
        self._arrays = tuple(_as_array(value, name) for name, value in zip(names, values))
        self._length = _common_length(self._names, [a.shape for a in self._arrays])

    @property
    def arrays(self) -> tuple[np.ndarray, ...] | dict[str, np.ndarray]:
        """The arrays, as passed: a tuple, or a dict for the dict form."""
        arrays = self._open()
        return dict(zip(self._keys, arrays)) if self._keys is not None else arrays

    def _open(self) -> tuple[np.ndarray, ...]:
        return self._arrays

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> Any:
        if not -self._length <= index < self._length:
            raise IndexError(f"index {index} is out of range for {type(self).__name__} with "
                             f"{self._length} samples")
        rows = [array[index] for array in self._open()]
        return dict(zip(self._keys, rows)) if self._keys is not None else tuple(rows)

    def warm_up(self) -> None:
        """Compile the gather for these arrays now (the loader calls this in the main process
        before forking workers, which then inherit the machine code instead of each loading
        numba and compiling or reading the on-disk cache)."""
        arrays = self._open()
        if all(len(array) for array in arrays):
            self.read_into(np.zeros(1, np.int64),
                           [np.empty((1, *array.shape[1:]), array.dtype) for array in arrays]
                           if self._keys is None else
                           {key: np.empty((1, *array.shape[1:]), array.dtype)
                            for key, array in zip(self._keys, arrays)})

    def read_into(self, indices: np.ndarray, out: Any) -> None:
        """Gather rows ``indices`` of every array into ``out`` (see ``BatchReadable``)."""
        from ._gather import byte_rows, gather_rows  # numba is imported on the first batch

        indices = as_index_array(indices)
        leaves = [out[key] for key in self._keys] if self._keys is not None else list(out)
        arrays = self._open()
        rows = self.__dict__.get("_rows")
        if rows is None or rows[0] is not arrays:  # byte views, made once per opened arrays
            rows = self._rows = (arrays, [byte_rows(array) for array in arrays])
        for name, array, leaf, array_rows in zip(self._names, arrays, leaves, rows[1]):
            gather_rows(array, indices, leaf, name, array_rows)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("_rows", None)  # views of the arrays: rebuilt on the first batch
        return state


class MemmapDataset(ArrayDataset):
    """An ``ArrayDataset`` over arrays on disk, mapped lazily in each process.

    Sources are paths of ``.npy`` files (``np.save``; C order) or ``numpy.memmap`` objects as
    opened (not slices of one), positionally or in a dict. Only each file's path, dtype, shape
    and offset are kept and pickled, so starting spawn or forkserver workers copies nothing
    large; each process maps a file read-only when it first reads it, and the page cache is
    shared between them.
    """

    def __init__(self, *sources: Any) -> None:
        names, values, self._keys = _unpack(sources, "MemmapDataset")
        self._names = names
        self._files = tuple(_describe_file(value, name) for name, value in zip(names, values))
        self._length = _common_length(self._names, [f[2] for f in self._files])
        self._arrays = None
        self._open_lock = threading.Lock()

    def _open(self) -> tuple[np.ndarray, ...]:
        arrays = self._arrays
        if arrays is None:
            with self._open_lock:  # thread workers may all ask at once
                if self._arrays is None:
                    self._arrays = tuple(
                        np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)
                        for path, dtype, shape, offset in self._files)
                arrays = self._arrays
        return arrays

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_arrays"] = None  # reopened where it is unpickled
        del state["_open_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open_lock = threading.Lock()


def _unpack(arrays: tuple, owner: str) -> tuple[list[str], list[Any], tuple | None]:
    """(names for messages, values, dict keys or None) from ``*arrays`` or one dict."""
    if len(arrays) == 1 and isinstance(arrays[0], Mapping):
        mapping = arrays[0]
        if not mapping:
            raise ValueError(f"{owner} needs at least one array, got an empty dict")
        keys = tuple(mapping)
        return [f"arrays[{k!r}]" for k in keys], [mapping[k] for k in keys], keys
    if not arrays:
        raise ValueError(f"{owner} needs at least one array: {owner}(x, y) or "
                         f"{owner}({{'x': x, 'y': y}})")
    return [f"arrays[{i}]" for i in range(len(arrays))], list(arrays), None


def _as_array(value: Any, name: str) -> np.ndarray:
    if type(value).__module__ == "torch" and type(value).__name__ == "Tensor":
        if value.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU, got a tensor on {value.device}; "
                             "pass tensor.cpu()")
        value = value.detach().numpy()  # shares memory with the tensor
    array = np.asarray(value)
    if array.ndim == 0:
        raise ValueError(f"{name} must have at least one dimension (its rows are the samples), "
                         f"got a 0-d array")
    if array.dtype.hasobject:
        raise TypeError(f"{name} must have a numeric or fixed-width dtype, got {array.dtype}; "
                        "object arrays cannot be stored in shared memory (convert them, or "
                        "keep such values in a dataset of your own)")
    return array


def _common_length(names: list[str], shapes: list[tuple[int, ...]]) -> int:
    length = shapes[0][0]
    for name, shape in zip(names, shapes):
        if shape[0] != length:
            raise ValueError(f"every array must have the same number of rows: {name} has "
                             f"{shape[0]} but {names[0]} has {length}; pass arrays of equal "
                             "length")
    return length


def _describe_file(source: Any, name: str) -> tuple[str, np.dtype, tuple[int, ...], int]:
    """(path, dtype, shape, byte offset) of a ``.npy`` path or a ``numpy.memmap``."""
    if isinstance(source, np.memmap):
        if not isinstance(source.base, mmap.mmap) or source.filename is None:
            raise ValueError(f"{name} must be a numpy.memmap as opened, not a slice or view of "
                             "one (its file offset is unknown); pass the whole memmap and "
                             "select rows with a sampler")
        if not source.flags.c_contiguous:
            raise ValueError(f"{name} must be a C-ordered memmap, got order='F'")
        shape, dtype, offset, path = source.shape, source.dtype, source.offset, source.filename
    elif isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        try:
            opened = np.load(path, mmap_mode="r")  # reads the header; mapped only briefly
        except (OSError, ValueError) as exc:
            raise ValueError(f"{name} must be a readable .npy file (np.save), got {path!r}: "
                             f"{exc}") from exc
        if not isinstance(opened, np.memmap):
            raise ValueError(f"{name} must be a .npy file (np.save), got {path!r}")
        shape, dtype, offset = opened.shape, opened.dtype, opened.offset
        fortran = opened.ndim > 1 and not opened.flags.c_contiguous
        del opened
        if fortran:
            raise ValueError(f"{name} ({path}) is stored in Fortran order; save it as "
                             "np.save(path, np.ascontiguousarray(array))")
    else:
        raise TypeError(f"{name} must be a path to a .npy file or a numpy.memmap, got "
                        f"{type(source).__name__}")
    if len(shape) == 0:
        raise ValueError(f"{name} must have at least one dimension, got a 0-d array")
    if dtype.hasobject:
        raise TypeError(f"{name} must have a numeric dtype, got {dtype}")
    return path, dtype, tuple(shape), offset
