"""``num_workers=0``: the consumer's thread fetches each batch and writes it into a slot, with
the same layout, slot lifecycle and errors as worker processes."""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

from ._arena import Arena, ArenaSource, slot_budget
from ._fetch import BatchFiller, Fetched, StreamPosition
from ._iterator_length import LoaderLength
from ._pool import SlotState
from ._resume_stream import EpochPlan, ReplicaStream, draw_into
from ._slab import map_new_segment
from .errors import LoaderClosedError, ShmCapacityError, forked_iterator_error
from .snapshot import IteratorSnapshot

_NOTHING = object()  # nothing taken from the stash yet
_CLOSED = "this iterator was closed; call iter(loader) for a new one"


class InProcessIterator(LoaderLength):
    def __init__(self, owner: Any, filler: BatchFiller, source: ArenaSource, plan: EpochPlan):
        self._pid = os.getpid()
        self._owner = owner  # the loader: `for b in ArenaLoader(...)` must keep it alive
        self._filler = filler
        self._source = source
        self._batches = plan.batches
        self._drawn: list = []  # indices a Ctrl-C kept from _pending (draw_into)
        self._epoch_position = plan.position  # the consumer's place (state_dict)
        self._resume = plan.streams[0] if plan.streams is not None else None
        self._stream: ReplicaStream | None = None  # iterable-style: made at first next()
        self._stream_state: bytes | None = None  # its state after the pending batch, if any
        self._position = 0  # items taken from the stream: names samples in errors
        self._arena: Arena | None = None
        self._done = False
        # The next batch, taken but not yet in a slot: (indices, fetched or None). Kept while
        # no slot is free, so no batch is lost.
        self._pending: tuple[Any, Fetched | None] | None = None
        self._finalizer: weakref.finalize | None = None
        self._count = plan.first_idx  # batches made (and skipped): names a batch in errors
        self._lock = threading.Lock()
        # The thread inside next(), if any: a close() from another thread leaves the slab to
        # that next() (it may be writing a slot), which gives it back as it returns.
        self._in_next: int | None = None
        self._closing = threading.Lock()  # one give-back at a time
        self._slabless = False
        # What next()'s last line pops (empty, or one item): the batch built, or with
        # ``_failed`` its error, raised by the pop (so Ctrl-C neither loses nor repeats it).
        self._stash: list = []
        self._failed = False

    def __iter__(self) -> InProcessIterator:
        return self

    def follow_stage(self) -> None:
        """(A stage here is the device thread: it runs this iterator, which draws as it loads,
        one batch per next(), in that thread: nothing to count.)"""

    def refill(self) -> None:
        """(Nothing is sent ahead: see ``follow_stage``.)"""

    def __next__(self) -> Any:
        if os.getpid() != self._pid:
            raise forked_iterator_error(self._pid)  # its slots are the parent's
        # One batch at a time, even when several threads share the iterator (as a
        # DataLoader iterator may be): without the lock two threads could take the same
        # pending batch.
        given = _NOTHING
        try:
            with self._lock:
                self._in_next = threading.get_ident()
                try:
                    if self._source.pending_warning is not None:
                        self._source.warn_pending(stacklevel=2)
                    self._next()
                    if not self._failed:
                        # Out of the stash with no call (as Consumer.next_batch): an
                        # interrupt from here on, the lock's exit included, puts it back.
                        (given,), self._stash = self._stash, []
                        return given
                finally:
                    self._in_next = None
                    if self._done:
                        self.close()  # what a close() from another thread left to this one
        except KeyboardInterrupt:
            if given is not _NOTHING:
                self._stash = [given]
            raise
        with self._lock:  # the batch's error, out of the stash with no call (as Consumer's)
            (error,), self._stash = self._stash, []; raise error  # noqa: E702 (one line)

    def _next(self) -> None:
        """Leave the next batch (or its error) in ``_stash``."""
        if self._stash:  # built by a next() that Ctrl-C interrupted: it is next
            return
        if self._done:
            self.close()  # (the end of the epoch may have been interrupted closing)
            raise StopIteration
        if self._arena is not None:
            self._source.check_limit(self._arena)
        filler = self._filler
        if self._pending is None:
            # Indices before a slot, so the end of the epoch is StopIteration even while the
            # consumer holds every slot.
            try:
                self._pending, self._drawn = self._take(), []
            except StopIteration:
                self._epoch_position.finished = True
                self.close()
                raise
        indices, fetched = self._pending
        counted = self._epoch_position.yielded  # moves when the batch is counted
        if fetched is None:
            try:
                fetched = filler.fetch(indices)
            except Exception as exc:  # that batch's error; the next next() goes on
                self._fail(exc, counted)
                return  # (Ctrl-C: retried)
            self._pending = (indices, fetched)
        try:
            prepared = filler.prepare(fetched, indices, live=True)
        except Exception as exc:
            self._fail(exc, counted)
            return
        if self._done:  # closed from another thread while the batch was fetched
            raise LoaderClosedError(_CLOSED)
        source = self._source
        if self._arena is None and not self._slabless:
            # Claimed at the first batch, whose size sets the slot budget; with no room in
            # /dev/shm for the slab, every batch gets a segment of its own instead.
            try:
                self._arena = source.claim(slot_budget(prepared.nbytes))
            except ShmCapacityError:
                self._slabless = True
            else:
                self._finalizer = weakref.finalize(self, source.unclaim, self._arena)
        arena = self._arena
        slot = batch = None
        acquired = False
        try:
            fits = arena is not None and prepared.nbytes <= arena.slot_nbytes
            if arena is not None and not fits:
                source.note_outgrown(prepared.nbytes)  # the next epoch's slab fits it
            slot = source.acquire_or_overflow(arena) if fits else None
            acquired = True
            if slot is None:
                storage = map_new_segment(prepared.nbytes)
            else:
                storage = arena.slot_bytes(slot)
            filler.write(prepared, fetched, storage, indices)
            if self._done:  # closed from another thread while it wrote (a slow read_into)
                raise LoaderClosedError(_CLOSED)  # (its slot is reclaimed below)
            if slot is not None:
                arena.pool.mark_filled(slot)
            batch = source.deliver(arena, slot, storage if slot is None else None,
                                   prepared.plan, self._count, indices, prepared.live_objects)
            self._epoch_position.handed(0, self._stream_state)
            # Counted, then stashed and no longer pending (one statement): interrupted before,
            # the handler below does it (counting only if that did not run).
            self._stash, self._failed, self._pending, self._count = (
                [batch], False, None, self._count + 1)
        except BaseException as exc:
            if batch is not None:  # Ctrl-C after the batch was built: the next next()'s
                if self._epoch_position.yielded == counted:
                    self._epoch_position.handed(0, self._stream_state)
                self._stash, self._failed, self._pending, self._count = (
                    [batch], False, None, self._count + 1)
                raise
            if slot is not None and arena.pool.state(slot) in (SlotState.ASSIGNED,
                                                               SlotState.FILLED):
                arena.pool.reclaim(slot)  # rewritten from the kept batch next time
            if isinstance(exc, KeyboardInterrupt) or not acquired:
                # (not acquired: no slot could be had, e.g. no room in /dev/shm for a slot's
                # pages; nothing is wrong with the batch, which stays pending for next time)
                raise
            self._fail(exc, counted)  # that batch's error (a write error), raised by the pop

    def _fail(self, error: Exception, counted: int) -> None:
        """The pending batch failed: its error takes its place, counted as handed out as a
        worker's failed batch is (``Handout.hand_over``), so a ``state_dict()`` resumes after
        it (an iterable's stream after its samples), where the next ``next()`` goes on.
        Ctrl-C before the count leaves it pending (loaded again), after it stashes the error
        all the same."""
        try:
            if self._epoch_position.yielded == counted:
                self._epoch_position.handed(0, self._stream_state)
            self._stash, self._failed, self._pending = [error], True, None
        except KeyboardInterrupt:
            if self._epoch_position.yielded != counted:
                self._stash, self._failed, self._pending = [error], True, None
            raise

    def _take(self) -> tuple[Any, Fetched | None]:
        filler = self._filler
        if not filler.iterable:
            # (the caller empties _drawn in the statement that keeps the batch: draw_into)
            if not draw_into(self._drawn, self._batches):
                raise StopIteration
            return self._drawn[0], None
        if self._stream is None:
            resume, self._resume = self._resume, None
            self._stream = ReplicaStream(filler.dataset, resume, filler.batch_size or 1)
        stream = self._stream
        fetched = stream.read(filler)  # (interrupted: what it read stays in stream.partial)
        if fetched is None:
            stream.ended = True
            raise StopIteration
        state = stream.state_of() if stream.state_of is not None else self._stream_state
        pending = ([StreamPosition(i) for i in range(self._position,
                                                     self._position + fetched.rows)], fetched)
        # Kept, and its samples taken from the stream, in one statement: a Ctrl-C before it
        # leaves them in stream.partial for the next next(); none can land after it.
        self._pending, stream.partial, stream.ended, self._position, self._stream_state = (
            pending, [], stream.ended or fetched.ended, self._position + fetched.rows, state)
        return pending

    def snapshot(self) -> IteratorSnapshot:
        """This iterator now (``ArenaLoader.snapshot``): no workers, nothing in flight."""
        return IteratorSnapshot(phase="finished" if self._done else "running", worker_pids=(),
                                in_flight=(), ready=())

    def close(self) -> None:
        """Idempotent; called again, it finishes a close that Ctrl-C interrupted. From
        another thread while next() runs, that next() gives the slab back as it returns (it
        may be writing a slot: freed now, the slot went to the loader's next iterator while
        it was still being written), raising LoaderClosedError unless its batch was made."""
        self._done = True
        if self._in_next not in (None, threading.get_ident()):
            return
        with self._closing:
            self._give_back()

    def _give_back(self) -> None:
        finalizer = self._finalizer
        if finalizer is not None and finalizer.alive:
            # A slot an interrupt left ASSIGNED as it was taken is free again (none is this
            # iterator's between batches).
            self._arena.pool.reconcile(set())
            # Not the finalizer's own call, which forgets it before running it: a Ctrl-C in
            # unclaim then left the slab claimed, and so open, for good.
            self._source.unclaim(self._arena)
            finalizer.detach()
