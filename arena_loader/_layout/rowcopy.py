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
plain way). A ValueError, TypeError or OverflowError on the cast path is answered by the
plain path, which raises what it raises.

Which loop is faster is the CPU's and the C library's business (measured on AMD EPYC with
glibc 2.36; on Intel, ``rep movsb`` writes whole lines without reading them first, which a
loop of vector stores does not), may differ by row size, and shows only where the copy
streams to memory as a batch's does, not in a short timing of buffers in cache. So each
process learns it, per power-of-two class of row size, from its own first large writes
(``LoopChoice``): the class's writes alternate between the two loops, timed, until each has
``TRIES`` timings, and the faster by median keeps the class's later writes (a forked worker
inherits what its parent learned). A write into memory not written before is not timed (its
page faults, as a slot's pages are made on first use, would outweigh the loop); writes by a
worker's threads are not timed either (their copies run side by side and wait for the GIL:
they use ``memmove`` until a single-threaded write has learned). A class whose samples the
cast loop cannot take keeps ``memmove`` after ``GIVE_UP`` timed writes."""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

ROW_MIN = 32 * 1024  # bytes per row from which the cast loop can be the faster copy


def large_rows(nbytes: int, rows: int) -> bool:
    """Whether ``rows`` rows of ``nbytes`` in all are rows the cast loop may copy."""
    return rows > 0 and nbytes >= ROW_MIN * rows
_VIEWED = frozenset("fcbmM")  # kinds copied through an unsigned view of each sample


class RowClass:
    """What one class of row sizes has learned: None until then, then True (the cast loop)
    or False (``memmove``)."""

    __slots__ = ("cast", "next_cast", "rates", "written")

    def __init__(self) -> None:
        self.cast: bool | None = None
        self.rates: dict[bool, list[float]] = {True: [], False: []}
        self.written: set[int] = set()  # addresses written to while learning
        self.next_cast = True  # the loop the next timed write uses

    def written_before(self, address: int) -> bool:
        """Whether a write while learning went to ``address`` before (now it has)."""
        if address in self.written:
            return True
        self.written.add(address)
        return False

    def record(self, cast: bool, nbytes: int, seconds: float) -> None:
        """A timed write of ``nbytes`` by the cast loop (or ``memmove``) took ``seconds``."""
        if self.cast is not None:
            return
        rates = self.rates
        rates[cast].append(nbytes / max(seconds, 1e-9))
        self.next_cast = not cast
        if min(len(rates[True]), len(rates[False])) >= LoopChoice.TRIES:
            self.cast = statistics.median(rates[True]) > statistics.median(rates[False])
        elif len(rates[False]) >= LoopChoice.GIVE_UP:  # the cast loop could not be timed
            self.cast = False
        if self.cast is not None:
            self.written.clear()


class LoopChoice:
    """This process's choice between the cast loop and ``memmove`` for large rows, per
    power-of-two class of row size (``of``)."""

    TRIES = 4  # timed writes per loop before choosing
    GIVE_UP = 4 * TRIES  # timed memmove writes without enough cast ones: memmove

    def __init__(self) -> None:
        self._classes: dict[int, RowClass] = {}

    def of(self, row_nbytes: int) -> RowClass:
        size_class = row_nbytes.bit_length()
        found = self._classes.get(size_class)
        if found is None:
            found = self._classes.setdefault(size_class, RowClass())
        return found


CHOICE = LoopChoice()


class CastRows:
    """How rows of one array (``out``) are written by the cast loop: ``target`` is ``out``
    seen as the integer type of its dtype's size and the other signedness, and ``sources``
    says what each sample is written as. ``write`` / ``write_row`` return False where the
    caller's plain path must do the write (nothing promised about what was written then)."""

    __slots__ = ("dtype", "out", "row_class", "source_dtype", "target")

    def __init__(self, out: np.ndarray, target: np.ndarray, source_dtype: np.dtype | None,
                 row_class: RowClass):
        self.out = out
        self.target = target
        self.dtype = out.dtype
        self.source_dtype = source_dtype  # None: integer samples go in as they are
        self.row_class = row_class

    @classmethod
    def of(cls, out: np.ndarray) -> CastRows | None:
        """How to write rows of ``out`` (shape ``(rows, *row_shape)``) by the cast loop;
        None where its rows are small, its dtype has no integer type of its size, or this
        process chose ``memmove`` for rows of that size."""
        dtype = out.dtype
        size = dtype.itemsize
        if (out.ndim < 2 or not large_rows(out.nbytes, out.shape[0]) or not dtype.isnative
                or size not in (1, 2, 4, 8) or dtype.fields is not None):
            return None
        row_class = CHOICE.of(out.nbytes // out.shape[0])
        if row_class.cast is False:
            return None
        if dtype.kind in "iu":
            flipped = np.dtype(f"{'u' if dtype.kind == 'i' else 'i'}{size}")
            return cls(out, out.view(flipped), None, row_class)
        if dtype.kind in _VIEWED:
            return cls(out, out.view(np.dtype(f"i{size}")), np.dtype(f"u{size}"), row_class)
        return None

    def sources(self, samples: list) -> list | None:
        """``samples`` as the cast path writes them; None: one of them must go the plain
        way. Integer batches take arrays of integer or bool dtypes (the cast is modular: the
        bits of what promotion gives); the others, arrays of exactly ``out``'s dtype, seen as
        unsigned integers of its size."""
        viewed = self.source_dtype
        if viewed is None:
            for sample in samples:
                if not isinstance(sample, np.ndarray) or sample.dtype.kind not in "biu":
                    return None
            return samples
        dtype, out = self.dtype, []
        for sample in samples:
            if not isinstance(sample, np.ndarray) or sample.dtype != dtype:
                return None
            out.append(sample.view(viewed))
        return out

    def write(self, samples: list) -> bool:
        """Write ``samples`` as the rows of ``out`` (a single-threaded writer: it may time
        the write to learn the loop)."""
        return self._write(samples, Ellipsis, learn=True)

    def write_row(self, row: int, sample: Any) -> bool:
        """Write ``sample`` as row ``row`` of ``out`` (one of a worker's threads: it never
        times, and uses the cast loop only once it was learned)."""
        return self._write([sample], row, learn=False)

    def _write(self, samples: list, where: Any, learn: bool) -> bool:
        row_class = self.row_class
        cast = row_class.cast
        if cast is False or (cast is None and not learn):
            return False
        sources = self.sources(samples)
        if cast:
            return sources is not None and self._assign(True, sources, where)
        # Learning: timed, by the loop whose turn it is (memmove where the cast loop cannot
        # take these samples: the class learns that too, ``GIVE_UP``).
        use_cast = row_class.next_cast and sources is not None
        into = self.out[where]
        timed = row_class.written_before(into.ctypes.data)
        began = time.perf_counter()
        done = self._assign(use_cast, sources if use_cast else samples, where)
        if done and timed:
            row_class.record(use_cast, into.nbytes, time.perf_counter() - began)
        return done

    def _assign(self, cast: bool, values: list, where: Any) -> bool:
        """Assign ``values`` (rows, or the row at ``where``) by the cast loop or memmove;
        False on the errors the caller's plain path answers (ValueError, TypeError,
        OverflowError: a shape that does not fit, a value out of range)."""
        array = self.target if cast else self.out
        try:
            array[where] = values if where is Ellipsis else values[0]
        except (ValueError, TypeError, OverflowError):
            return False
        return True
