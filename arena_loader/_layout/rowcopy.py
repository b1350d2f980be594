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
it raises.

Which loop is faster is the CPU's and the C library's business (measured on AMD EPYC with
glibc 2.36; on Intel, ``rep movsb`` writes whole lines without reading them first, which a
loop of vector stores does not), and it shows only where the copy streams to memory as a
batch's does, not in a short timing of buffers in cache. So each process learns it from its
own first large writes (``LoopChoice``): they alternate between the two loops, timed, until
each has ``TRIES`` timings, and the faster by median keeps the rest of the process's writes
(a forked worker inherits what its parent learned). A write into memory not written before
is not timed: its page faults (a slot's pages are made on first use) would outweigh the
loop."""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

ROW_MIN = 32 * 1024  # bytes per row from which the cast loop can be the faster copy
_VIEWED = frozenset("fcbmM")  # kinds copied through an unsigned view of each sample


class LoopChoice:
    """This process's choice between the cast loop and ``memmove`` for large rows: None
    until learned (writes alternate and are timed), then True (cast) or False."""

    TRIES = 4  # timed writes per loop before choosing

    def __init__(self) -> None:
        self.cast: bool | None = None
        self._rates: dict[bool, list[float]] = {True: [], False: []}
        self._written: set[int] = set()  # addresses written to while learning
        self.next_cast = True  # the loop the next timed write uses

    def written_before(self, address: int) -> bool:
        """Whether a write while learning went to ``address`` before (now it has)."""
        if address in self._written:
            return True
        self._written.add(address)
        return False

    def record(self, cast: bool, nbytes: int, seconds: float) -> None:
        """A timed write of ``nbytes`` by the cast loop (or ``memmove``) took ``seconds``."""
        if self.cast is not None:
            return
        rates = self._rates
        rates[cast].append(nbytes / max(seconds, 1e-9))
        self.next_cast = not cast
        if min(len(rates[True]), len(rates[False])) >= self.TRIES:
            self.cast = statistics.median(rates[True]) > statistics.median(rates[False])
            self._written.clear()


CHOICE = LoopChoice()


class CastRows:
    __slots__ = ("dtype", "out", "source_dtype", "target")

    def __init__(self, out: np.ndarray, target: np.ndarray, source_dtype: np.dtype | None):
        self.out = out
        self.target = target
        self.dtype = out.dtype
        self.source_dtype = source_dtype  # None: samples go in as they are

    @classmethod
    def of(cls, out: np.ndarray) -> CastRows | None:
        """How to write rows of ``out`` (shape ``(rows, *row_shape)``) by the cast loop;
        None where its rows are small, its dtype has no integer type of its size, or this
        process chose ``memmove``."""
        dtype = out.dtype
        size = dtype.itemsize
        if (CHOICE.cast is False or out.ndim < 2 or not out.shape[0]
                or out.nbytes < ROW_MIN * out.shape[0] or not dtype.isnative
                or size not in (1, 2, 4, 8) or dtype.fields is not None):
            return None
        if dtype.kind in "iu":
            flipped = np.dtype(f"{'u' if dtype.kind == 'i' else 'i'}{size}")
            return cls(out, out.view(flipped), None)
        if dtype.kind in _VIEWED:
            return cls(out, out.view(np.dtype(f"i{size}")), np.dtype(f"u{size}"))
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
        """Write ``samples`` as the rows of ``out``; False (nothing promised about what was
        written) where the caller's plain path must do it."""
        return self._write(samples, Ellipsis, samples)

    def write_row(self, row: int, sample: Any) -> bool:
        """Write ``sample`` as row ``row`` of ``out``; False as ``write`` says."""
        return self._write([sample], row, sample)

    def _write(self, samples: list, where: Any, value: Any) -> bool:
        choice = CHOICE
        cast = choice.cast
        if cast is None:  # learning: this write is timed, by the loop whose turn it is
            cast = choice.next_cast
            into = self.out[where]
            timed = choice.written_before(into.ctypes.data)
            began = time.perf_counter()
            done = self._write_by(cast, samples, where, value)
            if done and timed:
                choice.record(cast, into.nbytes, time.perf_counter() - began)
            return done
        return cast and self._write_by(True, samples, where, value)

    def _write_by(self, cast: bool, samples: list, where: Any, value: Any) -> bool:
        try:
            if not cast:
                self.out[where] = value
                return True
            sources = self.sources(samples)
            if sources is None:
                return False
            self.target[where] = sources if where is Ellipsis else sources[0]
        except (ValueError, TypeError, OverflowError):
            return False
        return True
