"""``num_workers=0``: the consumer's thread fetches each batch and writes it into a slot, with
the same layout, slot lifecycle and errors as worker processes."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from ._arena import Arena, ArenaSource
from ._fetch import BatchFiller, Fetched
from .errors import forked_iterator_error


class InProcessIterator:
    def __init__(self, owner: Any, filler: BatchFiller, source: ArenaSource,
                 batches: Iterator, convert: Callable[[Any], Any] | None = None):
        self._pid = os.getpid()
        self._owner = owner  # the loader: `for b in ArenaLoader(...)` must keep it alive
        self._filler = filler
        self._source = source
        self._batches = batches
        self._convert = convert
        self._stream: Iterator | None = None  # iterable-style datasets, made at first next()
        self._position = 0  # items taken from the stream: names samples in errors
        self._arena: Arena | None = None
        self._done = False
        # The next batch, taken but not yet in a slot: (indices, fetched or None). Kept while
        # no slot is free, so no batch is lost.
        self._pending: tuple[Any, Fetched | None] | None = None
        self._finalizer: weakref.finalize | None = None

    def __iter__(self) -> InProcessIterator:
        return self

    def __next__(self) -> Any:
        if os.getpid() != self._pid:
            raise forked_iterator_error(self._pid)  # its slots are the parent's
        if self._done:
            raise StopIteration
        filler = self._filler
        if self._pending is None:
            # Indices before a slot, so the end of the epoch is StopIteration even while the
            # consumer holds every slot.
            try:
                self._pending = self._take()
            except StopIteration:
                self.close()
                raise
        indices, fetched = self._pending
        if fetched is None:
            try:
                fetched = filler.fetch(indices)
            except BaseException:
                self._pending = None  # that batch is consumed; the next next() goes on
                raise
            self._pending = (indices, fetched)
        if self._arena is None:
            # Claimed at the first batch, whose layout sizes the slab.
            try:
                layout = filler.layout_for(fetched, indices)
            except BaseException:
                self._pending = None
                raise
            self._arena = self._source.claim(layout)
            self._finalizer = weakref.finalize(self, self._source.unclaim, self._arena)
        arena = self._arena
        slot = arena.acquire_or_raise()
        self._pending = None
        filled = arena.fill(slot, filler, fetched, indices)
        batch = arena.deliver(slot, filled.rows, filled.lengths, filled.objects)
        return batch if self._convert is None else self._convert(batch)

    def _take(self) -> tuple[Any, Fetched | None]:
        filler = self._filler
        if not filler.iterable:
            return next(self._batches), None
        if self._stream is None:
            self._stream = iter(filler.dataset)
        fetched = filler.fetch_next(self._stream)
        if fetched is None:
            raise StopIteration
        indices = list(range(self._position, self._position + fetched.rows))
        self._position += fetched.rows
        return indices, fetched

    def close(self) -> None:
        self._done = True
        if self._finalizer is not None:
            self._finalizer()
