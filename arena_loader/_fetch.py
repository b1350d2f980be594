"""Fetching a batch's samples and writing them into a slot: shared by workers and the
in-process (``num_workers=0``) path, so both behave identically."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._layout import (
    Prepared,
    prepare_batch,
    prepare_rows,
    prepare_samples,
    rows_view,
)
from ._messages import add_note, listed
from ._resume_stream import next_items
from ._rows import RowWriter
from ._sample_threads import FirstFailure, SampleThreads
from .errors import SampleTypeError
from .worker_info import get_worker_info

_END = object()


def _check_getitems(got: Any, indices: list) -> None:
    """What ``__getitems__`` returned must be one sample per index for default collation:
    a dict of columns or a generator is named here, with the fix (torch's default_collate
    fails on both too, with a bare ``KeyError: 0`` or a ``TypeError`` about subscripting)."""
    if type(got) is list:  # (the common case, without the ABC check)
        return
    if isinstance(got, Mapping):
        keys = list(got)
        shown = f"{keys[:8]!r}"[:-1] + ", ...]" if len(keys) > 8 else repr(keys)
        raise SampleTypeError(
            f"dataset.__getitems__ returned a dict (keys {shown}) for indices "
            f"{listed(indices)}; without a collate_fn it must return a list of samples, one "
            "per index, in order. For a batched read that returns one structure for the "
            "whole batch (a dict of columns), pass a collate_fn: it gets what __getitems__ "
            "returned as it is")
    if not hasattr(got, "__len__") or not hasattr(got, "__getitem__"):
        raise SampleTypeError(
            f"dataset.__getitems__ returned a {type(got).__name__} for indices "
            f"{listed(indices)}; it must return a list of samples, one per index, in order "
            "(return list(...) of it)")


@dataclass
class Fetched:
    """What the dataset (and collate_fn) produced for one batch, before it is written."""

    rows: int
    samples: list | None  # default collation: the samples, written row by row
    batch: Any = None  # custom collate_fn or batch_size=None: the whole batch
    direct: bool = False  # the dataset's read_into writes the rows in place (batch protocol)
    # worker_threads > 1: every row already written into the storage this plan was given
    written: Prepared | None = None
    # An iterable's iterator ended while this (partial) batch was taken: as torch's fetcher,
    # the caller calls next() on it no more this epoch.
    ended: bool = False


class BatchFiller:
    """Loads batches: by indices from a map-style dataset, or the next batch from an iterator
    of an iterable-style one (``iterable``: each worker and each epoch makes its own)."""

    def __init__(self, dataset: Any, collate_fn: Callable | None, auto_collation: bool,
                 batch_size: int | None, *, iterable: bool = False, drop_last: bool = False,
                 index_source: str = "the sampler"):
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.auto_collation = auto_collation
        self.batch_size = batch_size
        self.iterable = iterable
        self.drop_last = drop_last
        self.index_source = index_source  # who chose the indices, for error messages
        self._getitems = None if iterable else getattr(dataset, "__getitems__", None)
        # The batch protocol (docs/batch_protocol.md): with default collation the dataset
        # writes a whole batch into the slot itself.
        self._read_into = (getattr(dataset, "read_into", None)
                           if collate_fn is None and auto_collation and not iterable else None)
        self._direct_sample: tuple[Any, Any] | None = None  # read_into: a sample to plan from
        self._direct_plans: dict[int, Prepared] = {}  # read_into: plans by row count

    @property
    def reads_index_arrays(self) -> bool:
        """The dataset's ``read_into`` takes each batch's indices as one int64 array: a batch
        order that holds arrays can hand them over as they are."""
        return self._read_into is not None

    def warm_up(self) -> None:
        """Before forking workers: let a batch-protocol dataset prepare (compile its gather)
        in the main process, so that every forked worker inherits the result."""
        warm_up = getattr(self.dataset, "warm_up", None) if self._read_into else None
        if warm_up is not None:
            warm_up()

    def fetch_next(self, stream: Iterator, partial: list | None = None) -> Fetched | None:
        """The next batch of an iterable-style dataset's ``stream``; None when it has no more
        (a final partial batch is dropped with ``drop_last``, per worker, as in torch).

        Only ``next(stream)``, as torch's fetcher (``next_items``). Once it ends
        (``Fetched.ended`` or None), the caller must not call this again for that stream
        (``ReplicaStream``). ``partial``: the samples an earlier call read before Ctrl-C
        stopped it (``list.extend`` keeps what it appended), completed here; the caller
        empties it once it has kept the batch. An error from the stream drops them, as
        torch's fetcher does."""
        samples = [] if partial is None else partial
        try:
            try:
                samples.extend(next_items(stream, (self.batch_size or 1) - len(samples)))
            except Exception:
                samples.clear()  # that batch's error: its samples go with it
                raise
            if not self.auto_collation:
                if not samples:
                    return None
                sample = samples[0]
                if self.collate_fn is not None:
                    sample = self.collate_fn(sample)
                return Fetched(rows=1, samples=None, batch=sample)
            ended = len(samples) < self.batch_size
            if not samples or (self.drop_last and ended):
                return None
            if self.collate_fn is None:
                return Fetched(rows=len(samples), samples=samples, ended=ended)
            return Fetched(rows=len(samples), samples=None, batch=self.collate_fn(samples),
                           ended=ended)
        except StopIteration as exc:  # raised by collate_fn: it would end the epoch silently
            raise RuntimeError("collate_fn raised StopIteration; raise another error "
                               "instead") from exc

    def fetch(self, indices: Any, threads: SampleThreads | None = None,
              storage_for: Callable[[int], np.ndarray] | None = None) -> Fetched:
        """The batch of ``indices``. With ``threads`` (``worker_threads > 1``, map-style,
        automatic batching) its samples are fetched by all of them at once and, under default
        collation, written row by row into ``storage_for(nbytes)`` as they arrive. Not with
        ``__getitems__`` and a collate_fn: what one call returns goes to the collate_fn as it
        is (a batched read may return one structure for the whole batch, not one sample per
        index), and the lanes' calls could not be put together into it."""
        started = self.begin(indices, threads, storage_for) if threads is not None else None
        return started() if started is not None else self._translated(indices, self._fetch,
                                                                       indices)

    def begin(self, indices: Any, threads: SampleThreads,
              storage_for: Callable[[int], np.ndarray] | None) -> Callable[..., Fetched] | None:
        """The threads start loading the batch of ``indices`` (``fetch``); the call returned
        gives it (``between``, if passed, runs once this thread's own rows are loaded, before
        it waits for the others'). None where the batch is not loaded by the threads."""
        if self._read_into is not None or (self._getitems is not None
                                           and self.collate_fn is not None):
            return None
        try:
            finish = self._begin_concurrently(indices, threads, storage_for)
        except Exception as exc:
            error = exc

            def finish(_between: Callable[[], None] | None = None) -> Fetched:
                raise error
        return lambda between=None: self._translated(indices, finish, between)

    def _translated(self, indices: Any, fetch: Callable[..., Fetched], *args: Any) -> Fetched:
        """``fetch(*args)``, the batch of ``indices``, with its errors made to say so."""
        try:
            return fetch(*args)
        except StopIteration as exc:  # escaping from __next__ it would end the epoch silently
            raise RuntimeError(f"the dataset or collate_fn raised StopIteration while loading "
                               f"indices {indices!r}; raise IndexError or another error "
                               "instead") from exc
        except IndexError as exc:
            explained = _explain_index_error(self, indices, exc)
            if explained is None:
                raise
            raise explained from exc

    def _fetch(self, indices: Any) -> Fetched:
        if self._read_into is not None:
            return Fetched(rows=len(indices), samples=None, direct=True)
        if not self.auto_collation:
            sample = self.dataset[indices]
            if self.collate_fn is not None:
                sample = self.collate_fn(sample)
            return Fetched(rows=1, samples=None, batch=sample)
        if self._getitems is not None:
            samples = self._getitems(list(indices))
            if self.collate_fn is not None:
                # As torch's fetcher: what __getitems__ returns goes to the collate_fn as it
                # is (a batched read may return one structure, not one sample per index).
                return Fetched(rows=len(indices), samples=None,
                               batch=self.collate_fn(samples))
            _check_getitems(samples, indices)
            if len(samples) != len(indices):
                raise ValueError(
                    f"dataset.__getitems__ returned {len(samples)} samples for {len(indices)} "
                    f"indices {list(indices)!r}; it must return one sample per index, in order"
                )
        else:
            dataset = self.dataset
            samples = [dataset[i] for i in indices]
        if self.collate_fn is None:
            return Fetched(rows=len(samples), samples=samples)
        return Fetched(rows=len(samples), samples=None, batch=self.collate_fn(samples))

    def _begin_concurrently(self, indices: Any, threads: SampleThreads,
                            storage_for: Callable[[int], np.ndarray] | None
                            ) -> Callable[..., Fetched]:
        indices = list(indices)
        rows, count = len(indices), threads.count
        # Rows written in place overlap the copies with other threads' waits: with one
        # thread running the lanes there is nothing to overlap, and collation writes them.
        writer = (RowWriter(indices, storage_for) if self.collate_fn is None
                  and storage_for is not None and threads.active > 1 else None)
        samples = writer.samples if writer is not None else [None] * rows
        failure = FirstFailure()
        dataset, getitems = self.dataset, self._getitems

        def load_share(thread: int) -> None:
            share = range(thread, rows, count)
            if not share:
                return  # more lanes than rows: torch never calls __getitems__([])
            taken = None  # the lane's rows of what __getitems__ returned
            if getitems is not None:  # one __getitems__ call per thread, for its rows
                keys = [indices[i] for i in share]
                try:
                    got = getitems(keys)
                    _check_getitems(got, keys)
                    if len(got) != len(share):
                        raise ValueError(
                            f"dataset.__getitems__ returned {len(got)} samples for "
                            f"{len(share)} indices; it must return one sample per index, in "
                            "order")
                    taken = iter(got)
                except BaseException as exc:
                    _note_rows(exc, keys, thread, count)
                    failure.record(share.start, exc)
                    return
            for row in share:
                if row > failure.row:
                    return  # an earlier row failed: that is the batch's error
                try:
                    # A lazy sequence from __getitems__ may fail as its rows are taken:
                    # that row's error, as collation meets it with one thread.
                    sample = dataset[indices[row]] if taken is None else next(taken)
                    if writer is not None:
                        writer.offer(row, sample)
                    else:
                        samples[row] = sample
                except BaseException as exc:
                    _note_rows(exc, [indices[row]], thread, count)
                    failure.record(row, exc)
                    return

        job = threads.submit(load_share)

        def finish(between: Callable[[], None] | None = None) -> Fetched:
            threads.finish(job, between)
            failure.raise_if_any()
            if writer is not None and writer.done():
                return Fetched(rows=rows, samples=None, written=writer.prepared)
            if self.collate_fn is None:
                return Fetched(rows=rows, samples=samples)
            return Fetched(rows=rows, samples=None, batch=self.collate_fn(samples))
        return finish

    def prepare(self, fetched: Fetched, indices: Any, live: bool = False) -> Prepared:
        """The batch's plan (fields, shapes, dtypes, objects) and what to write (``live``:
        for this process, its object leaves kept as they are, not pickled)."""
        if fetched.written is not None:
            return fetched.written
        if fetched.direct:  # planned from one sample; read_into then writes whole batches
            prepared = self._direct_plans.get(fetched.rows)
            if prepared is None:
                if self._direct_sample is None:
                    first = indices[0]  # (an int, as torch gives __getitem__)
                    first = int(first) if isinstance(first, np.integer) else first
                    self._direct_sample = (self.dataset[first], first)
                prepared = prepare_rows(*self._direct_sample[:1], fetched.rows,
                                        self._direct_sample[1])[0]
                self._direct_plans[fetched.rows] = prepared
            return prepared
        if fetched.samples is not None:
            return prepare_samples(fetched.samples, indices, live)
        # (Without a collate_fn, the batch is one sample: batch_size=None.)
        return prepare_batch(fetched.batch, _label(self, indices),
                             converted=self.collate_fn is None, live=live)

    def write(self, prepared: Prepared, fetched: Fetched, storage: np.ndarray,
              indices: Any) -> None:
        """Write the batch into ``storage`` (``prepared.nbytes`` bytes)."""
        if fetched.written is not None:
            return  # written row by row, into this very storage
        if not fetched.direct:
            prepared.write(storage)
            return
        try:
            self._read_into(as_index_array(indices), rows_view(prepared.plan, storage))
        except StopIteration as exc:
            raise RuntimeError(f"the dataset's read_into raised StopIteration for indices "
                               f"{listed(indices)!r}; raise IndexError or another error "
                               "instead") from exc


def _explain_index_error(filler: BatchFiller, indices: Any,
                         exc: IndexError) -> IndexError | None:
    """An IndexError that says whether the sampler left range(len(dataset)) or the
    dataset has fewer samples than its len() claims. Only on this error path: indices
    are never checked up front, since torch lets a dataset accept any key."""
    try:
        length = len(filler.dataset)
    except Exception:
        return None
    wanted = list(indices) if filler.auto_collation else [indices]
    if not all(isinstance(i, (int, np.integer)) for i in wanted):
        return None  # keys that are not positions: nothing to compare with len()
    outside = [int(i) for i in wanted if not 0 <= i < length]
    if outside:
        return IndexError(
            f"{filler.index_source} yielded sample index {outside[0]} (in indices "
            f"{indices!r}), but len(dataset) is {length}; a sampler must yield indices in "
            f"range(len(dataset)): fix the sampler, or the dataset's __len__ ({exc})")
    return IndexError(
        f"the dataset raised IndexError loading indices {indices!r}, which are within "
        f"len(dataset) = {length}; if it holds fewer samples than __len__ says, make "
        f"__len__ agree with __getitem__ ({exc})")


def _note_rows(error: BaseException, indices: list, thread: int, count: int) -> None:
    """Name the sample(s) in the error: with threads, the traceback alone cannot say which
    of the batch's samples failed."""
    which = f"sample index {indices[0]!r}" if len(indices) == 1 else f"sample indices {indices!r}"
    add_note(error, f"(while loading {which} in thread {thread} of worker_threads={count})")


def as_index_array(indices: Any) -> np.ndarray:
    """``indices`` as a contiguous 1-D int64 array (no copy when it already is one)."""
    array = np.asarray(indices)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise TypeError(f"indices must be a 1-D sequence of integers, got {array.dtype} "
                        f"array of shape {list(array.shape)}")
    return np.ascontiguousarray(array, dtype=np.int64)


class StreamPosition(int):
    """A position in a worker's iterator of an iterable-style dataset: what names a sample of
    such a dataset in error messages (it has no index)."""

    def __repr__(self) -> str:
        info = get_worker_info()
        where = "the iterator" if info is None else f"worker {info.id}'s iterator"
        return f"item {int(self)} of {where}"


def _label(filler: BatchFiller, indices: Any) -> str:
    if filler.iterable:
        items = list(indices)
        span = repr(items[0]) if len(items) == 1 else f"{items[0]!r} to {int(items[-1])}"
        what = "collate_fn output for " if filler.collate_fn is not None else ""
        return f"{what}{span}"
    if not filler.auto_collation:
        what = "collate_fn output for " if filler.collate_fn is not None else ""
        return f"{what}dataset[{indices!r}]"
    return f"collate_fn output for indices {list(indices)!r}"
