"""Large rows copied by numpy's cast loop instead of ``memmove``.

numpy copies an array into one of the same dtype with ``memmove``. glibc's ``memmove``
copies blocks from a few KB up to about the L2 size with ``rep movsb``, which on AMD Zen
runs at ~0.7x its speed when source and destination sit at different offsets from a cache
line: a sample 16 bytes past one (where glibc's ``malloc`` puts many arrays) copied into a
slot's row (on one). Written into a view of the rows as the integer type of the same size
and the other signedness, the same bytes go through numpy's cast loop (vector loads and
stores; a cast between integers of one size keeps every bit), whose speed does not depend
on alignment: 150 KB rows 14.9 against 10.3 GB/s 16 bytes off, 15.6 against 14.5 aligned;
1 MB rows 14.0 against 10.3 and 15.1 against 12.4 (docs/benchmarks.md, "Rows copied by the
cast loop"). Below ``ROW_MIN`` bytes a row ``memmove`` is as fast or faster (it stays in
cache).

``CastRows.of(out)`` says how to write rows into ``out``: ``target`` is ``out`` seen as
those integers, and a sample goes in as it is (integer dtypes: a cast from any integer or
bool dtype that promotes to ``out``'s is modular, so its bits are the plain copy's) or seen
as the unsigned integers of its size (floats, complex64, bools, datetimes: only a sample of
exactly ``out``'s dtype; ``sources`` says None for any other, and the caller copies the
plain way). Any error from the cast path is answered by the plain path, which raises what
it raises."""

from __future__ import annotations

from typing import Any

import numpy as np

ROW_MIN = 32 * 1024  # bytes per row from which the cast loop is the faster copy
_VIEWED = frozenset("fcbmM")  # kinds copied through an unsigned view of each sample


class CastRows:
    __slots__ = ("dtype", "source_dtype", "target")

    def __init__(self, target: np.ndarray, dtype: np.dtype, source_dtype: np.dtype | None):
        self.target = target
        self.dtype = dtype  # ``out``'s dtype
        self.source_dtype = source_dtype  # None: samples go in as they are

    @classmethod
    def of(cls, out: np.ndarray) -> CastRows | None:
        """How to write rows of ``out`` (shape ``(rows, *row_shape)``) by the cast loop;
        None where its rows are small or its dtype has no integer type of its size."""
        dtype = out.dtype
        size = dtype.itemsize
        if (out.ndim < 2 or not out.shape[0] or out.nbytes < ROW_MIN * out.shape[0]
                or not dtype.isnative or size not in (1, 2, 4, 8) or dtype.fields is not None):
            return None
        if dtype.kind in "iu":
            flipped = np.dtype(f"{'u' if dtype.kind == 'i' else 'i'}{size}")
            return cls(out.view(flipped), dtype, None)
        if dtype.kind in _VIEWED:
            return cls(out.view(np.dtype(f"i{size}")), dtype, np.dtype(f"u{size}"))
        return None

    def sources(self, samples: list) -> list | None:
        """``samples`` as the cast path writes them; None: one of them must go the plain
        way (it is not an array of exactly ``out``'s dtype)."""
        viewed = self.source_dtype
        if viewed is None:
            return samples
        dtype, out = self.dtype, []
        for sample in samples:
            if not isinstance(sample, np.ndarray) or sample.dtype != dtype:
                return None
            out.append(sample.view(viewed))
        return out

    def write(self, samples: list) -> bool:
        """Write ``samples`` as the target's rows; False (nothing promised about what was
        written) where the plain path must do it."""
        sources = self.sources(samples)
        if sources is None:
            return False
        try:
            self.target[...] = sources
        except (ValueError, TypeError, OverflowError):
            return False
        return True

    def write_row(self, row: int, sample: Any) -> bool:
        """Write ``sample`` as row ``row`` of the target; False as ``write`` says."""
        sources = self.sources([sample])
        if sources is None:
            return False
        try:
            self.target[row] = sources[0]
        except (ValueError, TypeError, OverflowError):
            return False
        return True
