"""One epoch of our samplers' batches, as iterator objects, not generators.

CPython raises a Ctrl-C where it next looks for signals: as a call into C returns, at a
function's entry, at a backward jump. Inside a generator that finishes the generator, and the
rest of the epoch was lost, silently. Here every step that draws keeps what it drew (in C:
``list.extend`` over ``map``), and the position moves on the line that returns the batch, so
an interrupted ``next()`` moves nothing and the next one gives the same batch.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np


class SlicedBatches:
    """The indices drawn as one array at the first next() (when torch's BatchSampler draws
    them), then a slice per next()."""

    __slots__ = ("_array", "_draw", "_drop_last", "_lists", "_size", "_start")

    def __init__(self, draw: Any, size: int, drop_last: bool, first: int, lists: bool):
        self._draw, self._size, self._drop_last, self._lists = draw, size, drop_last, lists
        self._array: np.ndarray | None = None
        self._start = first * size

    def __iter__(self) -> SlicedBatches:
        return self

    def __next__(self) -> list[int] | np.ndarray:
        array = self._array
        if array is None:
            try:
                array = self._array = self._draw()
            except KeyboardInterrupt:
                raise  # (nothing drawn: the next next() draws)
            except BaseException:
                # len(dataset) raised: the epoch ends there, as torch's BatchSampler (a
                # generator) ends once its sampler raised (ListedBatches._take).
                self._array = np.empty(0, np.int64)
                raise
        start, end, n = self._start, self._start + self._size, len(array)
        if start >= (n - n % self._size if self._drop_last else n):
            raise StopIteration
        batch = array[start: end].tolist() if self._lists else array[start: end]
        # One line: a trace function's line event (the suite's Ctrl-C at every line) lands
        # before both; CPython itself handles no signal between them.
        self._start = end; return batch  # noqa: E702


class ChunkedBatches:
    """A RandomSampler drawing from the caller's torch generator: torch's sampler draws its
    chunks (``randperm`` / ``randint`` tensors, ``sizes[k]`` indices of chunk ``k`` used) as the
    epoch reaches them, index by index, so these are drawn at the same moments: a chunk when an
    index of it is first needed, and the last ones when a batch asks past the end (torch's
    exhausting pull). ``draws[k]`` is a C callable and its argument iterables, so
    ``list.extend(map(...))`` keeps each tensor drawn (a redraw would move the generator
    again)."""

    __slots__ = ("_drawn", "_draws", "_drop_last", "_ends", "_lists", "_size", "_start")

    def __init__(self, draws: list[tuple[Callable, tuple]], sizes: list[int], size: int,
                 drop_last: bool, first: int, lists: bool):
        self._draws, self._size, self._drop_last, self._lists = draws, size, drop_last, lists
        self._ends = list(itertools.accumulate(sizes))  # chunk k covers [ends[k-1], ends[k])
        self._drawn: list[Any] = []  # the tensors drawn so far, in order
        self._start = first * size

    def __iter__(self) -> ChunkedBatches:
        return self

    def __next__(self) -> list[int] | np.ndarray:
        start, ends, drawn = self._start, self._ends, self._drawn
        total = ends[-1] if ends else 0
        want = start + self._size
        # Drawn: every chunk an index of [start, want) is in, or all when that passes the end.
        while len(drawn) < len(self._draws) and (
                not drawn or want > total or ends[len(drawn) - 1] < want):
            call, args = self._draws[len(drawn)]
            drawn.extend(map(call, *args))  # kept by C, interrupted or not
        end = min(want, total)
        if start >= end or (self._drop_last and end - start < self._size):
            raise StopIteration
        parts, k = [], bisect.bisect_right(ends, start)
        while k < len(ends) and (ends[k - 1] if k else 0) < end:
            lo = ends[k - 1] if k else 0
            parts.append(drawn[k].numpy()[max(start, lo) - lo: min(end, ends[k]) - lo])
            k += 1
        batch = parts[0] if len(parts) == 1 else np.concatenate(parts)
        batch = batch.tolist() if self._lists else batch.astype(np.int64, copy=False)
        self._start = end; return batch  # noqa: E702 (as SlicedBatches.__next__)


class ListedBatches:
    """A user sampler's indices in lists of ``size``, as torch's BatchSampler groups them (the
    sampler iterated at the first ``next()``; ``first`` batches drawn and dropped). Each batch
    is taken by ``list.extend`` (kept by C, interrupted or not) into ``_held``, which the line
    that returns it forgets; a skipped one is dropped in the statement that counts it."""

    __slots__ = ("_drop_last", "_held", "_indices", "_sampler", "_size", "_skip")

    def __init__(self, sampler: Iterable, size: int, drop_last: bool, first: int):
        self._sampler, self._size, self._drop_last, self._skip = sampler, size, drop_last, first
        self._indices: Iterator | None = None
        self._held: list = []

    def __iter__(self) -> ListedBatches:
        return self

    def __next__(self) -> list:
        indices = self._indices
        if indices is None:
            try:
                indices = self._indices = iter(self._sampler)
            except KeyboardInterrupt:
                raise
            except BaseException:
                self._indices = iter(())  # ends the epoch after this error (as _take)
                raise
        while self._skip:
            if not self._held:
                self._take(indices)
            self._held, self._skip = [], self._skip - 1  # (one statement)
        held = self._held
        if not held:
            self._take(indices)
        if not held or (self._drop_last and len(held) < self._size):
            raise StopIteration
        self._held = []; return held  # noqa: E702 (as SlicedBatches.__next__)

    def _take(self, indices: Iterator) -> None:
        try:
            self._held.extend(itertools.islice(indices, self._size))
        except KeyboardInterrupt:
            raise  # (what the sampler gave is kept; a sampler of ours goes on)
        except BaseException:
            # The sampler raised: the epoch ends there, its batch's indices dropped, as
            # torch's BatchSampler (a generator) ends once its sampler raised.
            self._indices, self._held, self._skip = iter(()), [], 0
            raise
