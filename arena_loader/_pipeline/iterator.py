"""What ``iter(loader)`` returns when ``num_workers > 0``: the object user code holds, apart
from the ``Session`` it drives, so that a dropped iterator is collected (and its session
closed by a finalizer) even while the session is referenced elsewhere."""

from __future__ import annotations

import weakref
from typing import Any

from .._arena import ArenaSource
from .._fetch import BatchFiller
from .._forksafe import interrupts_deferred
from .._iterator_length import LoaderLength
from .._options import LoaderOptions
from .._resume import EpochPlan
from ..snapshot import IteratorSnapshot
from .session import Session
from .window import StageLag


def close_dropped(session: Session) -> None:
    """The finalizer's close: it joins the workers (tens of ms), and a Ctrl-C meanwhile (`it =
    iter(loader)` in a loop drops the last iterator) would be raised inside the finalizer and
    swallowed, the close cut short; it is held until the close is done, then sent again once
    the finalizer has returned (``_forksafe.redeliver``)."""
    with interrupts_deferred(in_finalizer=True):
        session.close()


class MultiProcessIterator(LoaderLength):
    def __init__(self, owner: Any, options: LoaderOptions, filler: BatchFiller,
                 source: ArenaSource, plan: EpochPlan, base_seed: int):
        # The loader: `for b in ArenaLoader(...)` must keep it alive. Batches come converted
        # (to tensors, or leases for a device stage) from ArenaSource.deliver.
        self._owner = owner
        self._session = Session(options, filler, source, base_seed)
        # A persistent iterator's epochs end without finishing the session: its face calls
        # this directly (one call less per batch).
        self.next_batch = self._session.next_batch
        self._finalizer = weakref.finalize(self, close_dropped, self._session)
        try:
            self._session.start_epoch(plan)
        except BaseException:
            self.close()
            raise

    def __iter__(self) -> MultiProcessIterator:
        return self

    def __next__(self) -> Any:
        # No handler here: an error handed out must leave without running a line of ours
        # (the session ends the epoch itself, Consumer.next_batch).
        return self._session.next_batch()

    def follow_stage(self) -> StageLag:
        """A stage takes this epoch's batches ahead of its consumer (``TopUp.follow_stage``)."""
        return self._session.top_up.follow_stage()

    def refill(self) -> None:
        """The stage's consumer received a batch (``TopUp.refill``)."""
        self._session.top_up.refill()

    def reset(self, plan: EpochPlan) -> None:
        """Persistent workers: begin a new epoch on the same workers and slab."""
        self._session.start_epoch(plan)

    @property
    def broken(self) -> bool:
        return self._session.broken

    @property
    def worker_pids(self) -> list[int]:
        """Pids of the workers; empty until they start."""
        crew = self._session.crew
        return list(crew.pids) if crew is not None else []

    @property
    def stats(self) -> dict[str, int]:
        """Completion records received and their bytes (no array travels in them)."""
        session = self._session
        dropped, crew = session.dropped_stats, session.crew
        if crew is None:
            return dict(dropped)
        return {key: dropped[key] + value for key, value in crew.stats.items()}

    def snapshot(self) -> IteratorSnapshot:
        """This iterator's session now (``ArenaLoader.snapshot``); changes nothing."""
        session = self._session
        with session.lock:
            return IteratorSnapshot(phase=session.phase.value,
                                    worker_pids=tuple(self.worker_pids),
                                    in_flight=tuple(sorted(session.order.in_flight)),
                                    ready=tuple(sorted(session.order.done)))

    def close(self) -> None:
        self._finalizer()
        self._session.close()  # finishes a close that Ctrl-C interrupted; else a no-op
