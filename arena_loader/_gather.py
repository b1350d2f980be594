"""The compiled gather: ``out[r] = source[indices[r]]`` for every row, without the GIL.

Every field is viewed as rows of bytes (a 2-D ``uint8`` array of shape
``(rows, row_nbytes)``), so one compiled kernel serves every dtype and trailing shape: only
the memory layout (contiguous or strided rows) and read-only-ness of the source pick another
signature. ``cache=True`` writes the machine code next to this module, so spawned workers load
it instead of compiling again; forked workers inherit it when the first batch (loaded in the
main process, docs/design.md "Data flow") compiled it before the fork.

numba is imported here only; this module is imported on the first gather, never at
``import arena_loader``.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from ._fetch import as_index_array


@numba.njit(nogil=True, cache=True)
def _gather_byte_rows(source, indices, out):  # pragma: no cover - compiled
    """Copy rows; returns the position of the first out-of-range index, or -1."""
    n = source.shape[0]
    row_nbytes = source.shape[1]
    for r in range(indices.shape[0]):
        i = indices[r]
        if i < 0:
            i += n
        if i < 0 or i >= n:
            return r
        for b in range(row_nbytes):
            out[r, b] = source[i, b]
    return -1


def gather_rows(source: np.ndarray, indices: np.ndarray, out: np.ndarray,
                name: str = "array", rows: np.ndarray | None = None) -> None:
    """Write ``source[indices]`` into ``out`` (shape ``(len(indices), *source.shape[1:])``).

    Negative indices count from the end, as in numpy and torch; an index outside
    ``[-len(source), len(source))`` raises ``IndexError`` naming it, ``name`` and the length.
    ``out`` must be C-contiguous with ``source``'s dtype (a slot's field rows are).
    ``rows``: ``byte_rows(source)`` if the caller keeps it (it is the same for every batch).
    """
    indices = as_index_array(indices)
    n = source.shape[0]
    expected = (len(indices), *source.shape[1:])
    if out.shape != expected or out.dtype != source.dtype:
        raise ValueError(f"out for {name} must be {source.dtype}{list(expected)}, got "
                         f"{out.dtype}{list(out.shape)}")
    if not out.flags.c_contiguous:
        raise ValueError(f"out for {name} must be C-contiguous")
    if len(indices) == 0:
        return
    if rows is None:
        rows = byte_rows(source)
    if rows is None:  # rows are not contiguous in memory (e.g. Fortran order): numpy's take
        _check_bounds(indices, n, name)
        np.take(source, indices, axis=0, out=out, mode="wrap")  # wrap: negative indices
        return
    if rows.shape[1] == 0:  # empty rows: nothing to copy, but bad indices are still errors
        _check_bounds(indices, n, name)
        return
    bad = _gather_byte_rows(rows, indices, out.reshape(len(indices), -1).view(np.uint8))
    if bad >= 0:
        raise _index_error(int(indices[bad]), n, name)


def byte_rows(source: np.ndarray) -> np.ndarray | None:
    """``source`` as ``(rows, row_nbytes)`` uint8 without copying, or None if a row's bytes
    are not contiguous."""
    n = source.shape[0]
    if source.ndim > 1 and n > 0 and not source[0].flags.c_contiguous:
        return None
    row_size = math.prod(source.shape[1:])
    # With contiguous rows the reshape merges the trailing axes without copying; a row stride
    # other than row_nbytes (a sliced array) stays as the first axis' stride.
    flat = np.lib.stride_tricks.as_strided(
        source, shape=(n, row_size),
        strides=(source.strides[0] if n > 1 else row_size * source.itemsize, source.itemsize),
        writeable=False)
    return flat.view(np.uint8)


def _check_bounds(indices: np.ndarray, n: int, name: str) -> None:
    bad = np.flatnonzero((indices < -n) | (indices >= n))
    if bad.size:
        raise _index_error(int(indices[bad[0]]), n, name)


def _index_error(index: int, n: int, name: str) -> IndexError:
    return IndexError(f"index {index} is out of range for {name} with {n} rows; indices must "
                      f"be in [-{n}, {n})")
