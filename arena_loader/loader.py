"""``ArenaLoader``: torch's DataLoader interface wired to the shared-memory slab engine.

This module only wires parts together; see docs/design.md for how they fit.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from ._arena import CLOSED
from ._datapipe import ShardedDataPipe
from ._distributed import EpochSetter, warn_if_every_rank_loads_all
from ._inprocess import InProcessIterator
from ._options import LoaderOptions, is_iterable_dataset
from ._pickling import Picklable
from ._pipeline.iterator import MultiProcessIterator
from ._resume import LoaderResume, Resumable
from ._sample_threads import warn_thread_unsafe
from ._torch_compat import (
    LengthCheckedIterator,
    TorchIteratorAttribute,
    UnusedIteratorDraws,
    check_no_timeout_in_process,
    distributed_settings,
    is_iter_datapipe,
    iterable_length,
    warn_pin_memory,
)
from ._wiring import (
    EpochSeeds,
    close_all,
    default_samplers,
    epoch_batches,
    make_filler,
)
from .errors import LoaderClosedError, LoaderForkedError
from .snapshot import LoaderSnapshot

T_co = TypeVar("T_co", covariant=True)


def _check_open(loader: Any, made: Any = None) -> None:
    """LoaderClosedError once ``loader`` is closed (``made``: an iterator to close first)."""
    if loader._closed:
        if made is not None:
            made.close()
        raise LoaderClosedError(CLOSED)


def _checked_length(loader: Any, iterator: Any) -> Any:
    """torch's warning for an iterable-style dataset yielding more than len() said."""
    if loader._IterableDataset_len_called is None:
        return iterator
    return LengthCheckedIterator(iterator, loader.dataset, loader._IterableDataset_len_called,
                                 loader.num_workers)


class ArenaLoader(TorchIteratorAttribute, Resumable, EpochSetter, Picklable, Generic[T_co]):
    """Iterate over ``dataset`` in batches that workers write straight into shared memory.

    The options are ``torch.utils.data.DataLoader``'s, with the same defaults and meanings
    (``ArenaLoader[T]`` is generic like ``DataLoader[T]``; an ``IterDataPipe`` is sharded and
    shuffled as torch does). Batches are numpy arrays viewing the slab (or tensors, or GPU
    arrays); a slot is reused only after every view of its batch is gone. Keyword-only
    options of ours: ``slots`` (batches the slab holds), ``held_batch_limit``, ``output``,
    ``device`` (copies to that GPU on the loader's stream), ``worker_mode="thread"``,
    ``worker_threads=K`` (K threads per worker; the dataset must then be thread-safe).
    ``state_dict()`` / ``load_state_dict()`` resume mid-epoch, as torchdata's
    ``StatefulDataLoader``; ``set_epoch(epoch)`` reaches the sampler (trainers call it).
    README ("Quick start", "Resuming") and docs/design.md say more.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Callable[[list], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: Any = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        slots: int | None = None,
        held_batch_limit: int | None = None,
        output: str | None = None,
        device: Any = None,
        worker_mode: str = "process",
        worker_threads: int = 1,
    ) -> None:
        iterable = is_iterable_dataset(dataset)
        datapipe = iterable and is_iter_datapipe(dataset)
        self.options = LoaderOptions(
            batch_size=batch_size, shuffle=shuffle, sampler=sampler, batch_sampler=batch_sampler,
            num_workers=num_workers, collate_fn=collate_fn, pin_memory=pin_memory,
            drop_last=drop_last, timeout=timeout, worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context, generator=generator,
            prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
            in_order=in_order, slots=slots, held_batch_limit=held_batch_limit, output=output,
            iterable=iterable, device=device, worker_mode=worker_mode, datapipe=datapipe,
            worker_threads=worker_threads,
        )
        if worker_threads > 1:
            warn_thread_unsafe(dataset, worker_threads)
        self._open_gpu_parts()
        # The attributes torch's DataLoader exposes, read-only by convention, with torch's
        # values: a batch_sampler takes over batch_size and drop_last, prefetch_factor is 2
        # by default with workers, a start method name reads as its context.
        if batch_sampler is not None:
            batch_size, drop_last = None, False
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_workers = num_workers
        self.collate_fn = collate_fn
        self.pin_memory = pin_memory
        self.pin_memory_device = pin_memory_device
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = (self.options.context if isinstance(
            multiprocessing_context, str) else multiprocessing_context)
        self.generator = generator
        self.prefetch_factor = (self.options.effective_prefetch_factor if num_workers > 0
                                and prefetch_factor is None else prefetch_factor)
        self.persistent_workers = persistent_workers
        self.in_order = in_order
        self.slots = self.options.slots_or_default
        self.held_batch_limit = held_batch_limit
        self.worker_mode = worker_mode
        self.worker_threads = worker_threads
        self.output = output
        self.device = self.options.device
        self._iterable = iterable
        self._IterableDataset_len_called: int | None = None  # torch's name; see __len__
        # torch's rule: a DataPipe's shuffle() steps follow `shuffle` when it is given.
        if datapipe and shuffle is not None:
            from torch.utils.data import graph_settings

            graph_settings.apply_shuffle_settings(dataset, shuffle=shuffle)
        self._datapipe = ShardedDataPipe(dataset) if datapipe else None
        self.sampler, self.batch_sampler = default_samplers(
            dataset, self.options, sampler, batch_sampler, batch_size, drop_last)
        self._seeds = EpochSeeds(generator)
        self._resume = LoaderResume(self._seeds)
        self._filler = make_filler(self._datapipe or dataset, self.options, self.sampler,
                                   self.batch_sampler, batch_size, drop_last)
        self._closed = False
        self._warned_unsharded = False  # torch.distributed with the default sampler: once
        self._open_process_parts()
        self.check_worker_number_rationality()

    def __len__(self) -> int:
        if self._iterable:
            # The samples count is kept to warn if an epoch yields more batches than it.
            self._IterableDataset_len_called = len(self.dataset)
            return iterable_length(self._IterableDataset_len_called, self.batch_size,
                                   self.drop_last)
        if self.options.auto_collation:
            return len(self.batch_sampler)
        return len(self.sampler)

    def __iter__(self) -> Iterator[T_co]:
        _check_open(self)
        if os.getpid() != self._pid:  # (before the lock: the parent's, which a thread of the
            self._adopt_after_fork()  # parent inside iter() at the fork holds here for good)
        with self._iterators.lock:  # one at a time (LiveIterators.lock)
            return self._iter()

    def _iter(self) -> Iterator[T_co]:
        _check_open(self)
        options = self.options
        check_no_timeout_in_process(options)  # (before anything is drawn or begun)
        if not self._warned_unsharded:
            self._warned_unsharded = warn_if_every_rank_loads_all(options)
        self._iterators.settle()  # (an unused iterator's draws given back first)
        if self._stager is not None and options.persistent_workers:
            # (Before it is looked at: a thread stuck in a slow batch gets it closed.)
            self._stager.detach(self._iterators.persistent)
        with self._resume.lock:  # state_dict() in another thread: before, or once drawn
            plan = self._resume.begin_epoch(self)  # a loaded state: its epoch's draws replayed
            if plan.resumed:  # its workers start anew, seeded by the replayed draw: an iter() cut
                self._iterators.close_persistent()  # short may have made some (load_state_dict)
            # A stage's thread takes batches ahead of you: the host moves a copy of the position.
            positions = self._resume.follower(plan) if self._stager is not None else None
            # Given back if the iterator is never used (not a resumed epoch's: its draws replay
            # the interrupted run's, even when nothing of that epoch is left to hand out).
            draws = None if plan.resumed else UnusedIteratorDraws.take(self)
            # Random draws in torch's order: the DataPipe seed, the workers' base seed (for a new
            # iterator only), then the sampler's own at its first index.
            if self._datapipe is not None:
                self._datapipe.start_epoch(self._seeds.datapipe_seed(), *distributed_settings())
            persistent = self._iterators.persistent
            reuse = (options.num_workers > 0 and options.persistent_workers
                     and persistent is not None and not persistent.broken)
            if self.pin_memory and not reuse:
                warn_pin_memory(self.pin_memory_device, self._unpinned)
            base_seed = self._resume.base_seed(self._seeds, reuse)
            if self._datapipe is not None and options.num_workers > 0 and self._resume.drew_seed:
                # torch's new worker iterator draws the DataPipe seed once more, in its _reset(),
                # for the main process's copy; its workers keep the first. Drawn to stay in step.
                self._seeds.datapipe_seed()
        plan.batches = self._resume.drawn(self, plan, epoch_batches(
            options, self.sampler, self.batch_sampler, self._filler, plan.skip))
        if options.num_workers == 0:
            iterator: Any = InProcessIterator(self, self._filler, self._source, plan)
        elif reuse:  # `persistent` as read above: close() in another thread may drop it
            persistent.reset(plan)  # (its session raises LoaderClosedError once closed)
            _check_open(self)
            epoch = _checked_length(self, self._staged(persistent, False, positions))
            return self._iterators.watched(draws, self._source, plan.position, epoch, None)
        else:
            self.check_worker_number_rationality()
            if persistent is not None:  # (read once: see above)
                persistent.close()
            # The loader keeps its persistent iterator: that one must not reference the loader
            # back, or a dropped loader would wait for the cyclic GC to stop its workers.
            iterator = MultiProcessIterator(None if options.persistent_workers else self,
                                            options, self._filler, self._source, plan,
                                            base_seed)
            if options.persistent_workers:
                self._iterators.persistent = iterator
        self._iterators.add(iterator)
        _check_open(self, iterator)  # close() from another thread while it was being made
        return self._iterators.watched(draws, self._source, plan.position, _checked_length(
            self, self._staged(iterator, not options.persistent_workers, positions)),
            iterator if options.persistent_workers else None)

    @property
    def _stager(self) -> Any:
        """The stage between the host iterator and you: the device copies, or the pin
        thread (``pin_memory`` with workers); None."""
        return self._device if self._device is not None else self._pinning

    def _staged(self, iterator: Any, owns_host: bool, positions: Any) -> Any:
        return self._iterators.staged(self, self._stager, iterator, owns_host, positions)

    def _adopt_after_fork(self) -> None:
        """First use in a process forked from the one that made this loader (``os.fork``, a
        fork-started ``Pool``, an inner loader in a forked worker): its arena, workers and
        pipes belong to the parent, so this process starts afresh with its own
        (docs/design.md, "Fork safety")."""
        if self._device is not None or self._pin_batch is not None:
            raise LoaderForkedError(
                f"this ArenaLoader (pin_memory={self.pin_memory}, device={self.device!r}) was "
                f"created in process {self._pid} and CUDA does not survive fork; create the "
                "loader in this process, or start the process with the 'spawn' method")
        self._finalizer.detach()  # the copy of the parent's: it must not run here
        self._open_process_parts()

    def snapshot(self) -> LoaderSnapshot:
        """A read-only picture of this loader now: its slab and each slot's state, the
        batches your code holds, and each live iterator's phase, worker pids and batches in
        flight (docs/design.md, "Introspection"). Cheap, and changes nothing: for tests,
        debugging and monitoring."""
        return self._source.snapshot(self._iterators.snapshots())

    def close(self) -> None:
        """Stop every worker of this loader and release its slab. Idempotent.

        Batches you still hold stay valid: their memory is unmapped when the last one dies.
        """
        # No early return: each step is idempotent, so a close() that Ctrl-C cut short is
        # finished by the next call.
        self._closed = True
        if self._stager is not None:
            self._stager.detach()
        self._iterators.close_persistent()
        # Not through the finalizer, which runs once: a close_all that Ctrl-C cut short must
        # run again at the next close() (every step of it is idempotent).
        close_all(self._source, self._iterators.live, self._pid)
        self._finalizer.detach()

    def __enter__(self) -> ArenaLoader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
