"""The per-epoch side of resuming (docs/design.md, "Resuming"): what an epoch's iterator is
given (``EpochPlan``), the consumer's position it moves batch by batch (``EpochPosition``),
and, for iterable-style datasets, a worker's replica state taken after each batch and given
back to a resumed worker (``StreamResume``). A dataset without ``state_dict`` costs nothing
here: no state is taken, and a resumed worker skips the batches it had handed out."""

from __future__ import annotations

import inspect
import itertools
import pickle
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any


def is_stateful(value: Any) -> bool:
    """torchdata's ``Stateful`` protocol: ``state_dict()`` and ``load_state_dict()``, with a
    ``state_dict`` that takes no arguments. Methods of the same name with required arguments
    (mosaicml-streaming's ``StreamingDataset.state_dict(num_samples, from_beginning)``,
    litdata's) are another protocol, which torch's DataLoader never calls: such a value is
    treated as stateless (resumed by skipping), not called with no arguments to fail."""
    state_dict = getattr(value, "state_dict", None)
    if not callable(state_dict) or not callable(getattr(value, "load_state_dict", None)):
        return False
    try:
        inspect.signature(state_dict).bind()
    except TypeError:  # required arguments
        return False
    except ValueError:  # no signature to read (a builtin): trust the protocol
        pass
    return True


@dataclass(frozen=True)
class StreamResume:
    """Where a resumed worker's iterator starts: its replica's pickled state (``state``),
    or, for a dataset without one, how many of its batches to skip."""

    state: bytes | None
    skip_batches: int


def open_stream(dataset: Any, resume: StreamResume | None, rows: int) -> Iterator:
    """``iter(dataset)``, resumed as ``resume`` says (torchdata's order: the dataset's state,
    then the iterator, then the iterator's state)."""
    if resume is not None and resume.state is not None:
        saved = pickle.loads(resume.state)
        if saved["dataset"] is not None:
            dataset.load_state_dict(saved["dataset"])
        stream = iter(dataset)
        if saved["iterator"] is not None:
            stream.load_state_dict(saved["iterator"])
        return stream
    stream = iter(dataset)
    if resume is not None and resume.skip_batches:
        # Drawn and dropped, never collated: the only way on through a stream with no state.
        deque(next_items(stream, resume.skip_batches * rows), maxlen=0)
    return stream


def next_items(stream: Iterator, count: int) -> Iterator:
    """Up to ``count`` items of ``stream``, by ``next()`` alone and in C. ``islice(stream,
    count)`` would call ``iter(stream)`` again, which restarts an iterator whose ``__iter__``
    resets and returns itself (litdata's ``StreamingDataset``); torch's fetcher never does."""
    return itertools.islice(map(next, itertools.repeat(stream)), count)


def draw_into(drawn: list, batches: Iterator) -> bool:
    """The sampler's next batch into ``drawn`` unless it holds one already; False when the
    epoch has none left. A Ctrl-C that CPython handles as ``next()`` returns (it looks for
    signals after every call into C) would drop the batch just drawn: ``list.extend`` has
    appended it by then, and the caller takes it from ``drawn`` in the statement that
    records it."""
    if not drawn:
        drawn.extend(itertools.islice(batches, 1))
    return bool(drawn)


class ReplicaStream:
    """One replica's iterator for one epoch (an iterable-style dataset's, in a worker or in
    the main process): opened as ``resume`` says, read by ``filler.fetch_next`` until it
    ends and never after (as torch's fetcher); ``state_of`` reads its state (None: none).
    ``partial``: samples read for a batch that Ctrl-C interrupted (``num_workers=0``), kept
    for the next read; ``read`` leaves them, and the caller that keeps the batch empties them
    (``InProcessIterator._take``: in the statement that keeps it, so neither an interrupt
    before it loses them nor one after it reads them twice)."""

    __slots__ = ("ended", "partial", "state_of", "stream")

    def __init__(self, dataset: Any, resume: StreamResume | None, rows: int):
        self.stream = open_stream(dataset, resume, rows)
        self.state_of = state_reader(dataset, self.stream)
        self.ended = False
        self.partial: list = []

    def next_batch(self, filler: Any) -> Any:
        """The next batch (``Fetched``), or None once the stream has ended."""
        fetched = self.read(filler)
        self.partial = []  # (a worker: no Ctrl-C)
        if fetched is None or fetched.ended:
            self.ended = True
        return fetched

    def read(self, filler: Any) -> Any:
        """``next_batch`` that marks nothing: the samples stay in ``partial``."""
        return None if self.ended else filler.fetch_next(self.stream, self.partial)


def state_reader(dataset: Any, stream: Any) -> Callable[[], bytes] | None:
    """For a replica with state (its dataset's, its iterator's, or both): what reads it after
    each batch, pickled to travel; None for one without (which costs nothing per batch).
    Which parts have state is found once, here. A dataset that is its own iterator gives its
    state as both: torchdata loads it after ``iter()`` (which may start it over: loaded only
    before, the resumed epoch began again), and an epoch's end carries it as a dataset's."""
    of_dataset = is_stateful(dataset)
    own = stream is dataset
    of_stream = not own and is_stateful(stream)
    if not (of_dataset or of_stream):
        return None

    def read() -> bytes:
        state = dataset.state_dict() if of_dataset else None
        return pickle.dumps({"dataset": state, "iterator": state if own else
                             stream.state_dict() if of_stream else None}, protocol=5)
    return read


class WorkerPosition:
    """One worker's replica as of the last batch handed out from it this epoch."""

    __slots__ = ("batches", "ended", "state")

    def __init__(self, state: bytes | None = None, batches: int = 0, ended: bool = False):
        self.state, self.batches, self.ended = state, batches, ended

    def as_state(self) -> dict[str, Any]:
        return {"batches": self.batches, "ended": self.ended,
                "state": None if self.state is None else pickle.loads(self.state)}

    def carried(self) -> WorkerPosition:
        """What the replica carries into its next epoch (``num_workers=0``: the same dataset
        object starts it): its dataset's state, not the ended iterator's (a new iterator
        starts the epoch, as torchdata's does; loaded, it made the epoch empty)."""
        saved = None if self.state is None else pickle.loads(self.state)["dataset"]
        return WorkerPosition(None if saved is None else pickle.dumps(
            {"dataset": saved, "iterator": None}, protocol=5))

    @classmethod
    def from_state(cls, saved: dict[str, Any]) -> WorkerPosition:
        state = None if saved["state"] is None else pickle.dumps(saved["state"], protocol=5)
        return cls(state, saved["batches"], saved["ended"])


class EpochPosition:
    """The consumer's place in one epoch, moved by the iterator as it hands batches out (so
    ``state_dict()`` never counts what workers have only prefetched)."""

    __slots__ = ("finished", "last_worker", "next_idx", "workers", "yielded")

    def __init__(self, first_idx: int, workers: list[WorkerPosition] | None,
                 last_worker: int | None, yielded: int | None = None):
        self.next_idx = first_idx  # idx handed out so far, ended iterators' marks included
        self.yielded = first_idx if yielded is None else yielded  # batches handed out
        self.workers = workers  # iterable-style datasets only
        self.last_worker = last_worker
        self.finished = False  # the iterator raised StopIteration

    def copy(self) -> EpochPosition:
        twin = EpochPosition(self.next_idx, None if self.workers is None else [
            WorkerPosition(w.state, w.batches, w.ended) for w in self.workers],
            self.last_worker, self.yielded)
        twin.finished = self.finished
        return twin

    def handed(self, worker: int, state: bytes | None) -> None:
        """A batch (or its error) of ``worker`` went to the consumer; ``state``: its replica's
        state after it (None: none taken)."""
        # One statement (Handout.hand_over reads ``yielded`` to know whether it ran).
        self.next_idx, self.yielded = self.next_idx + 1, self.yielded + 1
        workers = self.workers
        if workers is not None:
            self.last_worker = worker
            position = workers[worker]
            position.batches += 1
            if state is not None:
                position.state = state

    def ended(self, worker: int, state: bytes | None) -> None:
        """``worker``'s iterator ended, and the consumer has passed that mark."""
        self.next_idx += 1
        self.last_worker = worker
        position = self.workers[worker]
        position.ended = True
        if state is not None:
            position.state = state


class SamplerStates:
    """The state of every sampler that states its own position (torchdata's ``Stateful``
    without ``set_epoch``) after each batch drawn this epoch: ``state_dict()`` saves it for
    the last batch the consumer received, as torchdata's ``StatefulDataLoader`` does (a
    snapshot per batch sent, with workers). Kept from that batch on (``consumer_idx``: the
    consumer's next idx); the batches drawn ahead of it wait here."""

    __slots__ = ("_by_idx", "_consumer_idx")

    def __init__(self, consumer_idx: Callable[[], int]):
        self._consumer_idx = consumer_idx
        self._by_idx: dict[int, dict[str, Any]] = {}

    def note(self, idx: int, states: dict[str, Any]) -> None:
        by_idx = self._by_idx
        by_idx[idx] = states
        oldest = self._consumer_idx() - 1
        for old in [k for k in by_idx if k < oldest]:
            del by_idx[old]

    def after(self, idx: int) -> dict[str, Any] | None:
        """The samplers' states after batch ``idx`` was drawn (None: not drawn)."""
        return self._by_idx.get(idx)


class DrawnStates:
    """The epoch's batch order, noting the samplers' states (``SamplerStates``) after each
    batch. Only the iterator holds it: dropped, the sampler's iterator goes with it."""

    __slots__ = ("_batches", "_drawn", "_idx", "_samplers", "_store")

    def __init__(self, batches: Iterator, samplers: list[tuple[str, Any]], first_idx: int,
                 store: SamplerStates):
        self._batches, self._samplers, self._idx, self._store = (
            batches, samplers, first_idx, store)
        self._drawn: list = []  # the batch drawn and not yet returned (see draw_into)

    def __iter__(self) -> DrawnStates:
        return self

    def __next__(self) -> Any:
        # Interrupted anywhere, the batch drawn stays in ``_drawn`` and its states are noted
        # again (the samplers have not moved since): nothing lost, nothing drawn twice.
        if not draw_into(self._drawn, self._batches):
            raise StopIteration
        idx = self._idx
        self._store.note(idx, {role: sampler.state_dict() for role, sampler in self._samplers})
        (batch,), self._drawn, self._idx = self._drawn, [], idx + 1
        return batch


@dataclass
class EpochPlan:
    """What an epoch's iterator is given: the batch order (already past the batches handed
    out before a resume), where ``idx`` starts, the position to move, and for iterable-style
    datasets which workers still have data, who is next, and how each resumed worker starts."""

    position: EpochPosition
    first_idx: int = 0
    batches: Iterator = field(default_factory=lambda: iter(()))
    active: list[bool] | None = None
    next_worker: int = 0
    streams: list[StreamResume] | None = None
    resumed: bool = False  # made by load_state_dict(): replays an interrupted epoch
    skip: int = 0  # batches of the order to draw and drop (first_idx, unless the samplers
    # were given their state as of the last batch received: they go on from there)


def drawn_epochs(samplers: Any, start: dict[str, Any]) -> dict[str, Any]:
    """A loaded epoch's start as ``iter()`` draws it: a ``set_epoch`` sampler's epoch now (a
    state taken at an epoch's end holds the last one; a later ``set_epoch`` has the last word),
    so a state taken later in this epoch resumes this epoch's order. ``samplers``: (role,
    sampler) pairs."""
    from .samplers import seeded_by_epoch

    epochs = {role: {"epoch": sampler.epoch} for role, sampler in samplers
              if seeded_by_epoch(sampler)}
    return dict(start, samplers={**start["samplers"], **epochs})
