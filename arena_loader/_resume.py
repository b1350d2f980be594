"""Mid-epoch resume: ``ArenaLoader.state_dict()`` and ``load_state_dict()``, with the names
and meaning of torchdata's ``StatefulDataLoader`` (docs/design.md, "Resuming").

A state says where the consumer is, never what workers prefetched: the epoch, the batches
handed out, the state of every random generator the epoch draws from *as of the epoch's
start* (with the base seed it gave), the samplers' own state or ``set_epoch`` value, and for
iterable-style datasets each worker's dataset state as of the last batch handed out from it.
Resuming replays the epoch's draws from those generator states (so the base seed, the
permutation and every later epoch's draws equal an uninterrupted run's) and skips the batches
already handed out by index, without loading them.
"""

from __future__ import annotations

import base64
import sys
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from ._forksafe import ProcessLock
from ._resume_stream import (
    DrawnStates,
    EpochPlan,
    EpochPosition,
    SamplerStates,
    StreamResume,
    WorkerPosition,
    drawn_epochs,
    is_stateful,
)
from .samplers import is_torch_generator, may_draw_globally, numpy_stream, seeded_by_epoch

FORMAT = "arena_loader.resume/1"

__all__ = ["FORMAT", "EpochPlan", "LoaderResume", "StreamResume"]


def _replicas_live_on(loader: Any) -> bool:
    """``num_workers=0``: the main process's own dataset object starts the next epoch, and a
    state carries its state there, as torchdata's StatefulDataLoader does. Worker replicas,
    persistent ones too, are resumed afresh at an epoch's start, as torchdata's are: loading
    the end-of-epoch state into them made the first epoch after a resume empty for the
    Stateful pattern torchdata documents (a resume point that ``__iter__`` consumes), where
    the uninterrupted run's persistent replica starts over. (A stream that never starts
    over, continuing across epochs, resumes from its start instead: torchdata does too.)"""
    return loader.num_workers == 0


def _samplers(loader: Any) -> list[tuple[str, Any]]:
    """The loader's samplers by role, each object once."""
    batch_sampler = loader.batch_sampler
    found: list[tuple[str, Any]] = []
    for role, sampler in (("sampler", loader.sampler), ("batch_sampler", batch_sampler),
                          ("batch_sampler.sampler", getattr(batch_sampler, "sampler", None))):
        if sampler is not None and all(sampler is not known for _, known in found):
            found.append((role, sampler))
    return found


def random_streams(loader: Any, seeds: Any) -> dict[str, Any]:
    """Every generator one epoch of ``loader`` draws from, by role: torch's global RNG (the
    workers' base seed and torch's samplers draw from it when no generator is given), the
    loader's ``generator``, its numpy seed stream (``seeds``: its ``EpochSeeds``), and each
    sampler's own generator."""
    torch = sys.modules.get("torch")
    streams: dict[str, Any] = {}
    candidates: list[tuple[str, Any]] = [("generator", loader.generator),
                                         ("seeds", seeds.stream)]
    uses_global = loader.generator is None
    for role, sampler in _samplers(loader):
        uses_global = uses_global or may_draw_globally(sampler)
        candidates += [(f"{role}.generator", getattr(sampler, "generator", None)),
                       (f"{role}.rng", numpy_stream(sampler))]
    if torch is not None and uses_global:
        candidates.insert(0, ("torch", torch.default_generator))
    for role, generator in candidates:
        if (is_torch_generator(generator) or isinstance(generator, np.random.Generator)) \
                and all(generator is not known for known in streams.values()):
            streams[role] = generator
    return streams


def _generator_state(generator: Any) -> Any:
    if isinstance(generator, np.random.Generator):
        return generator.bit_generator.state  # a fresh dict of ints: plain data
    return base64.b64encode(generator.get_state().numpy().tobytes()).decode("ascii")


def _set_generator_state(generator: Any, state: Any) -> None:
    if isinstance(generator, np.random.Generator):
        generator.bit_generator.state = state
        return
    torch = sys.modules["torch"]
    generator.set_state(torch.frombuffer(bytearray(base64.b64decode(state)),
                                         dtype=torch.uint8))


def position_samplers(loader: Any) -> list[tuple[str, Any]]:
    """The samplers that state their own position (torchdata's ``Stateful``, not resumed by
    a ``set_epoch`` value): saved as of the last batch received, and they go on from it."""
    if loader.options.iterable:
        return []
    return [(role, sampler) for role, sampler in _samplers(loader)
            if not seeded_by_epoch(sampler) and is_stateful(sampler)]


def epoch_start(loader: Any, seeds: Any) -> dict[str, Any]:
    """What the next epoch draws from, now: generator states and the samplers' states.

    A sampler with ``set_epoch`` and an int ``epoch`` (DistributedSampler, torch's, ours or
    torchdata's ``StatefulDistributedSampler``) draws its epoch from its seed and ``epoch``:
    that is what is kept, never its ``state_dict()``. torchdata's is a position (indices
    yielded), and here, before the epoch's first draw, it is the last epoch's end, so loaded
    it made the resumed epoch empty; the index skip already gives the position."""
    samplers: dict[str, Any] = {}
    for role, sampler in _samplers(loader):
        if seeded_by_epoch(sampler):
            samplers[role] = {"epoch": sampler.epoch}
        elif is_stateful(sampler):
            samplers[role] = {"state": sampler.state_dict()}
    return {"generators": {role: _generator_state(g)
                           for role, g in random_streams(loader, seeds).items()},
            "samplers": samplers}


def restore_generators(loader: Any, seeds: Any, start: dict[str, Any]) -> None:
    streams = random_streams(loader, seeds)
    for role, state in start["generators"].items():
        _set_generator_state(streams[role], state)


def restore_samplers(loader: Any, start: dict[str, Any]) -> None:
    """At ``load_state_dict()``: a ``set_epoch`` call before ``iter()``, as a training loop
    makes for DistributedSampler, still has the last word."""
    for role, sampler in _samplers(loader):
        saved = start["samplers"].get(role)
        if saved is None:
            continue
        if "state" in saved:
            sampler.load_state_dict(saved["state"])
        else:
            sampler.set_epoch(saved["epoch"])


def fingerprint(loader: Any, seeds: Any) -> dict[str, Any]:
    """What must be equal for a state to fit a loader: what shapes the batch order (and, for
    iterable-style datasets, whose per-worker states it holds, the worker count)."""
    iterable = loader.options.iterable
    sampler = loader.sampler
    length = None
    if not iterable or hasattr(loader.dataset, "__len__"):
        try:
            length = len(loader.dataset)
        except TypeError:
            length = None
    found = {"dataset_length": length, "batch_size": loader.batch_size,
             "drop_last": loader.drop_last,
             "sampler": type(sampler).__name__,
             "batch_sampler": type(loader.batch_sampler).__name__,
             "num_workers": loader.num_workers if iterable else None,
             "generators": sorted(random_streams(loader, seeds))}
    for name in ("num_replicas", "rank"):  # DistributedSampler: which share of the data
        if isinstance(getattr(sampler, name, None), int):
            found[name] = getattr(sampler, name)
    return found


class LoaderResume:
    """A loader's resume bookkeeping: the current epoch's start (what it drew from), its
    base seed, the consumer's position (``EpochPosition``, moved by the iterators), and a
    loaded state waiting for the next ``iter()``."""

    def __init__(self, seeds: Any) -> None:
        self._seeds = seeds  # the loader's EpochSeeds
        self.epoch = -1  # epochs begun (iter() calls that drew an epoch)
        self._start: dict[str, Any] | None = None
        self._base_seed: int | None = None  # the workers' base seed (kept by persistent ones)
        self.drew_seed = False  # whether this epoch's iter() drew a base seed
        self.position: EpochPosition | None = None
        self._pending: dict[str, Any] | None = None
        self._begun = False  # an iter() began the loaded state's epoch (self.position)
        self._follower: object | None = None  # the epoch whose stage moves the position
        # Held by state_dict(), load_state_dict() and by iter() from begin_epoch until the
        # epoch's draws are made: a state taken by another thread in between (the epoch's
        # start recorded, its base seed not yet) held the last epoch's seed, and resuming it
        # raised ValueError. (Re-entrant: user code iter() runs may call state_dict().)
        self.lock = ProcessLock()  # (a forked child's is its own)
        self._drawn: SamplerStates | None = None  # position samplers' states per batch drawn

    # -- iter() ------------------------------------------------------------------------------

    def begin_epoch(self, loader: Any) -> EpochPlan:
        """At the start of ``iter(loader)``, before any draw: a loaded state's generators and
        samplers restored (its epoch is replayed), else their state now recorded."""
        pending = self.loaded()
        if pending is None:
            self.epoch += 1
            self._start = epoch_start(loader, self._seeds)
            return EpochPlan(position=self._new_position(loader, None), first_idx=0)
        restore_generators(loader, self._seeds, pending["epoch_start"])
        self.epoch = pending["epoch"]
        self._start = drawn_epochs(_samplers(loader), pending["epoch_start"])
        position = self._new_position(loader, pending)
        self._begun = True
        at = pending.get("samplers_at")  # their state as of the last batch received
        for role, sampler in position_samplers(loader) if at is not None else ():
            sampler.load_state_dict(at[role])
        plan = EpochPlan(position=position, first_idx=pending["next_idx"], resumed=True,
                         skip=0 if at is not None else pending["next_idx"])
        workers = position.workers
        if workers is not None:
            plan.active = [not w.ended for w in workers]
            plan.next_worker = (pending["last_worker"] + 1) % len(workers) \
                if pending["last_worker"] is not None else 0
            plan.streams = [StreamResume(w.state, 0 if w.state is not None else w.batches)
                            for w in workers]
        return plan

    def base_seed(self, seeds: Any, reuse: bool) -> int | None:
        """The epoch's workers' base seed, drawn as torch draws it (None: persistent workers
        keep theirs). Resuming, the draw is replayed and must give the saved seed; an epoch
        that drew none (persistent workers) starts its new workers with the saved one."""
        pending = self._pending  # (begin_epoch has just checked it)
        if pending is not None and not pending["drew_base_seed"] \
                and pending["base_seed"] is not None:
            self.drew_seed, self._base_seed = False, pending["base_seed"]
            return self._base_seed
        if reuse:
            self.drew_seed = False
            return None
        seed = seeds.base_seed()
        if pending is not None and pending["base_seed"] is not None \
                and seed != pending["base_seed"]:
            raise ValueError(
                f"state_dict's base seed must be replayed, got {seed} instead of "
                f"{pending['base_seed']}: something drew from the loader's generators between "
                "load_state_dict() and iter(); call iter() right after load_state_dict()")
        self.drew_seed, self._base_seed = True, seed
        return seed

    def loaded(self) -> dict[str, Any] | None:
        """The loaded state, until its epoch hands out a batch (or ends): an ``iter()`` cut
        short by Ctrl-C, or an iterator dropped unused (Lightning probes a loader so), leaves
        it to the next ``iter()``, which replays it (the generators restored again)."""
        pending = self._pending
        if pending is not None and self._begun:
            position = self.position
            if position is None or position.finished or position.next_idx != pending["next_idx"]:
                self._pending = pending = None
        return pending

    def drawn(self, loader: Any, plan: EpochPlan, batches: Any) -> Any:
        """The epoch's batch order, with the position samplers' states noted per batch."""
        samplers = position_samplers(loader)
        if not samplers:
            self._drawn = None
            return batches
        resume = weakref.ref(self)  # (the iterator must not keep the loader's parts alive)

        def consumer_idx() -> int:
            live = resume()
            return live.position.next_idx if live is not None and live.position else 0

        self._drawn = SamplerStates(consumer_idx)
        return DrawnStates(batches, samplers, plan.first_idx, self._drawn)

    def follower(self, plan: EpochPlan) -> tuple[Callable[[], EpochPosition],
                                                  Callable[[EpochPosition], None]]:
        """For a stage that takes batches ahead of the consumer (pin or device): the host
        iterator now moves a copy of the epoch's position; ``track()`` copies that after each
        batch the stage takes, and ``follow(copy)`` makes it the consumer's position (what
        ``state_dict()`` reads) once the consumer has that batch. Only the latest epoch's
        stage moves it."""
        host = plan.position = plan.position.copy()
        token = self._follower = object()

        def follow(position: EpochPosition) -> None:
            if self._follower is token:
                self.position = position

        return host.copy, follow

    def _new_position(self, loader: Any, pending: dict[str, Any] | None) -> EpochPosition:
        workers = None
        if loader.options.iterable:
            count = max(loader.num_workers, 1)
            if pending is not None:
                workers = [WorkerPosition.from_state(w) for w in pending["workers"]]
            else:
                lives_on = _replicas_live_on(loader)
                last = self.position.workers if self.position is not None else None
                workers = [last[w].carried() if lives_on and last else WorkerPosition()
                           for w in range(count)]
        if pending is None:
            self.position = EpochPosition(0, workers, None)
        else:
            self.position = EpochPosition(pending["next_idx"], workers, pending["last_worker"],
                                          pending["batches_yielded"])
        return self.position

    # -- state_dict() / load_state_dict() -------------------------------------------------

    def state_dict(self, loader: Any) -> dict[str, Any]:
        pending = self.loaded()
        if pending is not None:
            return pending  # loaded, and nothing of its epoch handed out: still where it was
        # The consumer's next() (in another thread: no lock of ours on its per-batch path)
        # may hand a batch out while the state is read: read again until it did not, or the
        # state held one worker's replica as of one batch and the position as of the next.
        while True:
            position = self.position
            moves = _moves(position)
            state = self._state_at(loader, position)
            if self.position is position and _moves(position) == moves:
                return state

    def _state_at(self, loader: Any, position: EpochPosition | None) -> dict[str, Any]:
        if position is None or position.finished:
            # Between epochs: the next iter() begins the next epoch from the generators'
            # states now, its workers' replicas where this epoch left them.
            carried = None
            if position is not None and position.workers is not None:
                lives_on = _replicas_live_on(loader)
                carried = [(w.carried() if lives_on else WorkerPosition()).as_state()
                           for w in position.workers]
            elif loader.options.iterable:
                carried = [WorkerPosition().as_state()
                           for _ in range(max(loader.num_workers, 1))]
            # Persistent workers keep their base seed into the next epoch, drawing none.
            kept = self._base_seed if loader.persistent_workers and loader.num_workers else None
            return self._state(loader, self.epoch + 1, epoch_start(loader, self._seeds), 0, 0,
                               kept, False, carried, None)
        workers = None if position.workers is None else [w.as_state()
                                                          for w in position.workers]
        at = self._drawn.after(position.next_idx - 1) if self._drawn is not None else None
        return self._state(loader, self.epoch, self._start, position.yielded, position.next_idx,
                           self._base_seed, self.drew_seed, workers, position.last_worker, at)

    def _state(self, loader: Any, epoch: int, start: Any, yielded: int, next_idx: int,
               base_seed: Any, drew: bool, workers: Any, last_worker: Any,
               samplers_at: Any = None) -> dict[str, Any]:
        return {"format": FORMAT, "epoch": epoch, "batches_yielded": yielded,
                "next_idx": next_idx, "samplers_at": samplers_at,
                "base_seed": base_seed, "drew_base_seed": drew, "epoch_start": start,
                "workers": workers, "last_worker": last_worker,
                "fingerprint": fingerprint(loader, self._seeds)}

    def load_state_dict(self, loader: Any, state: dict[str, Any]) -> None:
        if not state:
            return  # torchdata's rule: an empty state changes nothing
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"state_dict must come from ArenaLoader.state_dict() (format "
                             f"{FORMAT!r}), got format {found!r}")
        saved, here = state["fingerprint"], fingerprint(loader, self._seeds)
        differ = [f"{key} is {saved.get(key)!r} in the state and {here.get(key)!r} here"
                  for key in sorted(set(saved) | set(here)) if saved.get(key) != here.get(key)]
        if differ:
            raise ValueError("state_dict must come from a loader built like this one, but "
                             + "; ".join(differ) + "; build the loader with the arguments "
                             "of the one that saved the state")
        self._pending = {**state, "workers": [dict(w) for w in state["workers"]]
                         if state["workers"] is not None else None}
        self._begun = False
        restore_samplers(loader, state["epoch_start"])


def _moves(position: EpochPosition | None) -> tuple[int, bool] | None:
    """What changes as the consumer is handed a batch (or passes an ended worker's mark)."""
    return None if position is None else (position.next_idx, position.finished)


class Resumable:
    """``state_dict()`` / ``load_state_dict()`` on ``ArenaLoader``: torchdata's
    ``StatefulDataLoader`` methods, same names and meaning, so code written for it switches
    by one import (README, "Resuming")."""

    _resume: LoaderResume

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is, as of the batches your code has received (not what workers
        prefetched): a plain, picklable dict (JSON-serialisable where the datasets' and
        samplers' own states are). Cheap: nothing is drawn, loaded or asked of workers."""
        with self._resume.lock:
            return self._resume.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Make the next ``iter()`` yield exactly the rest of the epoch ``state_dict`` was
        taken in, then the following epochs as an uninterrupted run would. ``{}`` changes
        nothing. A state from a loader built otherwise (dataset length, batch size, sampler,
        generators, worker count for iterable-style datasets) is a ValueError naming what
        differs."""
        with self._resume.lock:
            self._resume.load_state_dict(self, state_dict)
        # Its workers were seeded for another position: the next iter() starts new ones.
        self._iterators.let_go_persistent()  # type: ignore[attr-defined]
