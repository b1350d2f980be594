"""One epoch's batch order on its way to the workers: the sampler's next indices (drawn without
the session's lock, as torch draws them, inside ``next()``), which worker loads each batch
(torch's round robin), and the send itself, written so that a ``KeyboardInterrupt`` between
any two lines leaves the batch either sent and owed, or pending."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._epoch_batches import ChunkedBatches, SlicedBatches
from .._messages import add_note, formatted
from .._resume_stream import EpochPlan, draw_into
from .crew import Crew
from .order import EntryKind
from .reorder import Reorderer

NO_PENDING = object()  # not None: an iterable-style dataset's "indices" are None


class Feed:
    def __init__(self, plan: EpochPlan, num_workers: int, iterable: bool, epoch: int):
        self._batches = plan.batches
        # Index arrays of our samplers' epoch array travel as int64 (the worker hands the
        # dataset ints, as torch's BatchSampler does); a batch_sampler's own arrays pickled,
        # so the dataset gets their numpy scalars, as torch's fetcher gives them.
        self._own_arrays = type(plan.batches) in (SlicedBatches, ChunkedBatches)
        self._workers = num_workers
        self._iterable = iterable
        self.epoch = epoch
        self.pending: Any = NO_PENDING  # indices drawn, waiting for a slot
        self._drawn: list = []  # indices a Ctrl-C kept from pending (draw_into)
        self.send_idx = plan.first_idx  # (a resumed epoch: past the batches handed out)
        self.exhausted = False
        self.sampler_error: BaseException | None = None
        # Iterable-style datasets: which workers' iterators have not ended, who is next.
        self.active = list(plan.active) if plan.active is not None else [True] * num_workers
        self._next_worker = plan.next_worker

    @property
    def needs_draw(self) -> bool:
        return self.pending is NO_PENDING and not self.exhausted

    def draw(self) -> None:
        """The sampler's next indices into ``pending``. Its error is kept for its batch's turn,
        after the batches before it (``Consumer`` stashes it then, for next() to raise)."""
        try:
            if not draw_into(self._drawn, self._batches):
                self.exhausted = True
                return
            self.pending, self._drawn = self._drawn[0], []  # (one statement)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            self.sampler_error, self.exhausted = _detached(exc), True

    def let_go(self) -> None:
        """The session closed: the sampler's iterator is let go now, as torch's iterator lets
        go of its own when dropped (a generator's ``finally`` runs then; not when the cyclic
        GC frees the session, which the session's parts reference)."""
        self._batches = iter(())

    def pick_worker(self) -> int | None:
        """The worker for the next batch; iterable-style datasets skip workers whose iterator
        ended; None (and the epoch is exhausted) when all have."""
        if not self._iterable:
            return self.send_idx % self._workers
        for step in range(self._workers):
            worker = (self._next_worker + step) % self._workers
            if self.active[worker]:
                return worker
        self.exhausted = True
        return None

    def send(self, crew: Crew, order: Reorderer, worker: int, slot: int) -> bool:
        """Publish the pending batch to ``worker`` in ``slot``. Its in-flight entry is written
        first and taken back unless the ring took the entry; False (taken back) when the
        worker's pipe is closed. Raises what publishing raised, taken back likewise."""
        idx, indices = self.send_idx, self.pending
        published = crew.ring.published
        seq = published[worker]
        try:
            order.in_flight[idx], self.pending, self.send_idx = (
                (worker, slot, None if self._iterable else indices), NO_PENDING, idx + 1)
            kind = EntryKind.STREAM if self._iterable else EntryKind.PICKLED if (
                type(indices) is np.ndarray and not self._own_arrays) else EntryKind.INDICES
            sent = crew.publish(worker, kind, idx, slot, self.epoch, indices)
            if not sent:
                self._unsend(order, idx, indices)
            elif self._iterable:
                self._next_worker = worker + 1
        except BaseException:
            if published[worker] <= seq:  # the ring did not take it
                self._unsend(order, idx, indices)
            elif self._iterable:  # it did (a Ctrl-C at the doorbell): the next worker's turn
                self._next_worker = worker + 1
            raise
        return sent

    def _unsend(self, order: Reorderer, idx: int, indices: Any) -> None:
        order.in_flight.pop(idx, None)
        self.pending, self.send_idx = indices, idx


def _detached(error: BaseException) -> BaseException:
    """``error`` kept to raise later, without its traceback: the traceback's frames lead back
    (``f_back``) to ``next()``'s and so to the iterator, which could then only be freed by the
    cyclic garbage collector, and its workers would outlive a dropped iterator. The sampler's
    traceback text stays with it as a note."""
    text = formatted(error)
    error = error.with_traceback(None)
    error.__context__ = None
    add_note(error, f"Raised by the sampler while the next batches were drawn ahead:\n{text}")
    return error
