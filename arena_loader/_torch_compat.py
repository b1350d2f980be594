"""The parts of torch's DataLoader behaviour that involve torch objects or torch's wording:
DataPipe detection and the rank a DataPipe is sharded by (``_datapipe`` shards it), torch's
seed draws (and giving them back for an iterator that was never used), torch's two warnings,
and the one private attribute torch's own tests use.

torch is never imported here: each function looks at ``sys.modules`` and only acts on what
the program already loaded (a DataPipe or a ``torch.Generator`` cannot exist without it).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from ._iterator_length import NotCopied


def loaded_torch() -> Any:
    """The torch module if the program imported it, else None."""
    return sys.modules.get("torch")


def is_iter_datapipe(dataset: Any) -> bool:
    """True for a torch ``IterDataPipe`` (torch's DataLoader shards and shuffles these)."""
    data = sys.modules.get("torch.utils.data")
    pipe_type = getattr(data, "IterDataPipe", None) if data is not None else None
    return pipe_type is not None and isinstance(dataset, pipe_type)


def draw_torch_seed(generator: Any) -> int:
    """torch's ``torch.empty((), dtype=torch.int64).random_(generator=...)`` draw, from
    ``generator`` (a ``torch.Generator``) or torch's global RNG (``None``)."""
    torch = sys.modules["torch"]
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def initialized_distributed() -> Any:
    """``torch.distributed`` if the program initialised a process group, else None."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist
    return None


def distributed_settings() -> tuple[int, int]:
    """(world size, rank) of the initialised ``torch.distributed`` group, else (1, 0): what
    torch's DataLoader shards DataPipes by."""
    dist = initialized_distributed()
    return (dist.get_world_size(), dist.get_rank()) if dist is not None else (1, 0)


def iterable_length(samples: int, batch_size: int | None, drop_last: bool) -> int:
    """torch's len() of a loader over an iterable-style dataset of len() ``samples``: in
    batches (the last one partial unless ``drop_last``), or samples without batching."""
    if batch_size is None:
        return samples
    return samples // batch_size if drop_last else -(-samples // batch_size)


def check_no_timeout_in_process(options: Any) -> None:
    """torch's ``AssertionError`` at ``iter()`` for a ``timeout`` with ``num_workers=0`` (its
    single-process iterator has nothing to wait for)."""
    if options.num_workers == 0 and options.timeout > 0:
        raise AssertionError(
            f"_SingleProcessDataLoaderIter requires timeout == 0 (torch's words): timeout="
            f"{options.timeout!r} bounds the wait for a worker's batch, and num_workers=0 has "
            "no worker; pass timeout=0, or num_workers > 0")


def warn_pin_memory(pin_memory_device: str, unpinned: str | None) -> None:
    """torch's warnings, word for word, as ``iter()`` makes a new iterator with
    ``pin_memory=True`` (not when persistent workers' iterator is reused): ``pin_memory_device``
    is deprecated; ``unpinned``: why no memory is page-locked (no accelerator)."""
    if pin_memory_device:
        warnings.warn("pin_memory_device is deprecated, the current accelerator will be used "
                      f"as the device,ignore pin_memory_device='{pin_memory_device}'.",
                      UserWarning, stacklevel=3)
    if unpinned is not None:
        warnings.warn("'pin_memory' argument is set as true but no accelerator is found, then "
                      f"device pinned memory won't be used. ({unpinned}; batches stay in "
                      "pageable host memory)", UserWarning, stacklevel=3)


class LengthCheckedIterator(NotCopied):
    """An epoch's iterator that warns, with torch's text, once an iterable-style dataset has
    yielded more batches than the ``len(dataset)`` read by ``len(loader)`` before ``iter()``
    (torch's ``_BaseDataLoaderIter.__next__`` check, which compares batches with samples)."""

    def __init__(self, iterator: Any, dataset: Any, reported_len: int, num_workers: int):
        self._iterator = iterator
        self._dataset = dataset
        self._reported_len = reported_len
        self._num_workers = num_workers
        self._yielded = 0
        self._kept: list = []  # a batch whose warning a filter raised: the next next()'s

    def __iter__(self) -> LengthCheckedIterator:
        return self

    def __next__(self) -> Any:
        if self._kept:
            return self._kept.pop()
        batch = next(self._iterator)
        self._yielded += 1
        if self._yielded > self._reported_len:
            message = (f"Length of IterableDataset {self._dataset} was reported to be "
                       f"{self._reported_len}(when accessing len(dataloader)), but "
                       f"{self._yielded} samples have been fetched. ")
            if self._num_workers > 0:
                message += (
                    "For multiprocessing data-loading, this could be caused by not properly "
                    "configuring the IterableDataset replica at each worker. Please see "
                    "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset "
                    "for examples.")
            try:
                warnings.warn(message, UserWarning, stacklevel=2)
            except BaseException:  # made an error by a filter (-W error): the batch is kept
                self._kept.append(batch)
                raise
        return batch

    def __getattr__(self, name: str) -> Any:
        # worker_pids, stats, close(), ...: the wrapped iterator's.
        return getattr(self._iterator, name)


def check_worker_number(num_workers: int, stacklevel: int) -> None:
    """torch's ``DataLoader.check_worker_number_rationality``: a UserWarning, in torch's
    words, when ``num_workers`` exceeds the CPUs this process may run on."""
    if not num_workers:
        return
    if hasattr(os, "sched_getaffinity"):
        suggested: int | None = len(os.sched_getaffinity(0))
        cpuset_checked = True
    else:
        suggested, cpuset_checked = os.cpu_count(), False
    if suggested is not None and num_workers <= suggested:
        return
    if suggested is None:
        suggestion = ("DataLoader is not able to compute a suggested max number of worker in "
                      "current system.")
    else:
        suggestion = (f"Our suggested max number of worker in current system is {suggested}"
                      f"{'' if cpuset_checked else ' (`cpuset` is not taken into account)'}, "
                      "which is smaller than what this DataLoader is going to create.")
    warnings.warn(
        f"This DataLoader will create {num_workers} worker processes in total. {suggestion} "
        "Please be aware that excessive worker creation might get DataLoader running slow or "
        "even freeze, lower the worker number to avoid potential slowness/freeze if "
        "necessary.", UserWarning, stacklevel=stacklevel + 1)


# Give-backs of iterators that died inside a garbage collection, made by the next iter(): a
# collection can start inside a generator's get_state() or set_state() (the state tensor's
# allocation), which holds that generator's lock, and asking for it again there waits forever.
_deferred: list[Callable[[], None]] = []
# The collection's phase, kept by two C-level callbacks: gc calls each with (phase, info), and
# pop then setdefault move the phase's key to the end, so the last key is the phase now. A
# Python callback would run the handler of any signal that arrived during the collection and
# gc would swallow what it raises (a Ctrl-C in any program that imported us, ignored).
_gc_phases: dict[str, Any] = {"stop": None}
gc.callbacks.extend((_gc_phases.pop, _gc_phases.setdefault))


def _collecting() -> bool:
    return next(reversed(_gc_phases)) == "start"


class UnusedIteratorDraws:
    """The random draws one ``iter(loader)`` makes (DataPipe seed, the workers' base seed,
    the sampler's seed), given back if the iterator is dropped before it hands out a batch and
    nothing drew from those generators since.

    Why: PyTorch Lightning checks that a loader which is not a torch ``DataLoader`` is iterable
    by calling ``iter(loader)`` once and dropping the result. Those draws would shift every
    later one, so a run switched to ArenaLoader would see another order than the same run with
    torch's DataLoader, which Lightning does not probe. Giving them back makes such a probe
    leave no trace; a used iterator, or one after which anything else drew, keeps its draws.
    """

    def __init__(self, generators: list[Any]) -> None:
        self._generators = generators
        self._before = [g.get_state() for g in generators]
        self._after: list[Any] = []

    @classmethod
    def take(cls, loader: Any) -> UnusedIteratorDraws | None:
        """At the start of ``iter(loader)``: the state of every torch generator it may draw
        from (torch's global one, the loader's ``generator``, its sampler's)."""
        torch = sys.modules.get("torch")
        if torch is None:
            return None  # numpy-drawn orders are not torch's anyway
        generators = [torch.default_generator]
        batch_sampler = getattr(loader, "batch_sampler", None)
        for owner in (loader, loader.sampler, getattr(batch_sampler, "sampler", None)):
            generator = getattr(owner, "generator", None)
            if isinstance(generator, torch.Generator) and \
                    all(generator is not known for known in generators):
                generators.append(generator)
        return cls(generators)

    def watch(self, iterator: Any, delivered: Callable[[], int], lock: Any,
              on_give_back: Callable[[], None] | None = None) -> weakref.finalize | None:
        """At the end of ``iter(loader)``: when ``iterator`` dies, give the draws back if
        ``delivered()`` (batches the loader handed out, or a later ``iter()``) has not moved
        and no generator moved, holding ``lock`` (the loader's ``iter()`` lock: not while
        another thread's ``iter()`` runs, which keeps them). ``on_give_back``: what else must
        be undone (a persistent iterator made with the returned base seed). Returns the
        watch (None: nothing drawn), which a later ``iter()`` detaches: it keeps the draws."""
        self._after = [g.get_state() for g in self._generators]
        if all(_equal_states(a, b) for a, b in zip(self._before, self._after)):
            return None  # this iter() drew nothing
        finalizer = weakref.finalize(iterator, self._died, delivered, delivered(), lock,
                                     on_give_back)
        finalizer.atexit = False
        return finalizer

    @staticmethod
    def settle() -> None:
        """At the start of ``iter()``, before anything is drawn or recorded: the give-backs
        of iterators that died inside a garbage collection."""
        while _deferred:
            _deferred.pop(0)()

    def _died(self, delivered: Callable[[], int], delivered_then: int, lock: Any,
              on_give_back: Callable[[], None] | None) -> None:
        if _collecting():
            _deferred.append(lambda: self._give_back(delivered, delivered_then, lock,
                                                     on_give_back))
        else:
            self._give_back(delivered, delivered_then, lock, on_give_back)

    def _give_back(self, delivered: Callable[[], int], delivered_then: int, lock: Any,
                   on_give_back: Callable[[], None] | None) -> None:
        if not lock.acquire(blocking=False):
            return  # another thread's iter() runs: it began after this iterator's draws
        try:
            if delivered() != delivered_then:
                return
            if not all(_equal_states(g.get_state(), after)
                       for g, after in zip(self._generators, self._after)):
                return
            for generator, state in zip(self._generators, self._before):
                generator.set_state(state)
            if on_give_back is not None:
                on_give_back()
        finally:
            lock.release()


def _equal_states(a: Any, b: Any) -> bool:
    return bool(sys.modules["torch"].equal(a, b))


# What shapes the epoch: fixed once the loader exists (torch's DataLoader.__setattr__).
FIXED_ATTRIBUTES = frozenset(
    ("batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers"))
# Read by torch when iter() makes a new iterator, and by ours from the loader's options then:
# set later, they are checked as at construction and used by the next new iterator.
PER_ITERATOR_OPTIONS = frozenset(("timeout", "worker_init_fn", "multiprocessing_context",
                                  "in_order"))
# What the slab, samplers, seeds and collation were built from (torch reads the first five
# at each iter()): a change would be silently ignored, so it is an error.
BUILT_OPTIONS = frozenset(("num_workers", "collate_fn", "prefetch_factor", "pin_memory",
                           "generator", "slots", "held_batch_limit", "output", "device",
                           "worker_mode", "worker_threads"))


class TorchIteratorAttribute:
    """torch's DataLoader members beyond its options, which torch's own tests and some
    training code use: ``_iterator`` (to shut persistent workers down: the persistent
    workers' iterator, or ``None``; setting it to ``None`` drops that iterator, and the next
    ``iter()`` starts new workers), ``_auto_collation``, ``_index_sampler`` and
    ``check_worker_number_rationality``; and torch's rule that ``FIXED_ATTRIBUTES`` cannot
    be set once the loader is made (``_finalizer`` set: the end of ``__init__``), while
    ``PER_ITERATOR_OPTIONS`` can, as torch's (``BUILT_OPTIONS`` cannot, unlike torch's)."""

    _iterators: Any  # the loader's LiveIterators
    options: Any  # the loader's LoaderOptions
    batch_sampler: Any
    sampler: Any
    num_workers: int

    def __setattr__(self, name: str, value: Any) -> None:
        if "_finalizer" in self.__dict__:  # made: an error rather than a setting ignored
            kind = type(self).__name__
            if name in FIXED_ATTRIBUTES:
                raise ValueError(f"{name} attribute should not be set after {kind} is "
                                 f"initialized; create a new {kind} with {name}={value!r}")
            if name in BUILT_OPTIONS and not _same(value, getattr(self, name)):
                raise ValueError(
                    f"{name} cannot be changed after {kind} is initialized: its slab, samplers "
                    f"and workers were made for {name}={getattr(self, name)!r} (torch's "
                    f"DataLoader reads it at the next iter()); create a new {kind} with "
                    f"{name}={value!r}")
            if name in PER_ITERATOR_OPTIONS:
                self.options = dataclasses.replace(self.options, **{name: value})
                if name == "multiprocessing_context" and isinstance(value, str):
                    value = self.options.context  # read as its context, as torch's
        super().__setattr__(name, value)

    @property
    def _iterator(self) -> Any:
        persistent = self._iterators.persistent
        return None if persistent is None else _TorchIteratorView(persistent)

    @_iterator.setter
    def _iterator(self, value: Any) -> None:
        if value is not None:
            raise ValueError(f"_iterator can only be set to None (drop the persistent workers' "
                             f"iterator), got {value!r}")
        self._iterators.let_go_persistent()

    @property
    def _auto_collation(self) -> bool:
        return self.batch_sampler is not None

    @property
    def _index_sampler(self) -> Any:
        """What yields each step's key: ``batch_sampler`` with automatic batching, else
        ``sampler`` (torch's property)."""
        return self.batch_sampler if self._auto_collation else self.sampler

    def check_worker_number_rationality(self) -> None:
        """torch's check, run at construction and when workers start: a UserWarning when
        ``num_workers`` exceeds the CPUs this process may use."""
        check_worker_number(self.num_workers, stacklevel=3)


def _same(value: Any, current: Any) -> bool:
    """Setting an option to the value it has changes nothing."""
    try:
        return value is current or (type(value) is type(current) and bool(value == current))
    except Exception:  # a comparison that raises or gives no truth value
        return False


class _TorchIteratorView:
    """An iterator with the method torch's tests call on ``DataLoader._iterator``."""

    __slots__ = ("_iterator",)

    def __init__(self, iterator: Any) -> None:
        self._iterator = iterator

    def _shutdown_workers(self) -> None:
        self._iterator.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._iterator, name)
