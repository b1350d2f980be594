"""``num_workers=0``: the consumer's thread fetches each batch and writes it into a slot, with
the same layout, slot lifecycle and errors as worker processes."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

from ._arena import Arena, ArenaSource, claim_arena
from ._fetch import BatchFiller


class InProcessIterator:
    def __init__(self, owner: Any, filler: BatchFiller, source: ArenaSource,
                 batches: Iterator):
        self._owner = owner  # the loader: `for b in ArenaLoader(...)` must keep it alive
        self._filler = filler
        self._source = source
        self._batches = batches
        self._arena: Arena | None = None
        self._done = False
        self._pending: Any = None  # the next batch's indices, taken before its slot
        self._finalizer: weakref.finalize | None = None

    def __iter__(self) -> InProcessIterator:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        if self._arena is None:
            # Claimed at the first next(), so an error loading the first batch is raised here
            # and the following next() goes on with the next batch, as for any other batch.
            arena, first = claim_arena(self._filler, self._source, self._batches)
            if arena is None:
                self._done = True
                raise StopIteration
            self._arena = arena
            self._finalizer = weakref.finalize(self, self._source.unclaim, arena)
            if first is not None:
                return arena.deliver(first.slot, first.rows, first.lengths, first.objects)
        arena = self._arena
        # Indices first, so the end of the epoch is StopIteration even while the consumer holds
        # every slot; kept in _pending if no slot is free, so no batch is lost.
        if self._pending is None:
            try:
                self._pending = next(self._batches)
            except StopIteration:
                self.close()
                raise
        slot = arena.acquire_or_raise()
        indices, self._pending = self._pending, None
        try:
            fetched = self._filler.fetch(indices)
        except BaseException:
            arena.pool.reclaim(slot)
            raise
        filled = arena.fill(slot, self._filler, fetched, indices)
        return arena.deliver(slot, filled.rows, filled.lengths, filled.objects)

    def close(self) -> None:
        self._done = True
        if self._finalizer is not None:
            self._finalizer()
