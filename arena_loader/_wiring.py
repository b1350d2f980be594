"""The loader's parts built from its options, and what ``iter(loader)`` wraps an epoch in:
torch's default samplers, the workers' seed stream, the epoch's batch order, the CUDA stage,
and the persistent iterator's face. ``loader.py`` only wires these together."""

from __future__ import annotations

import itertools
import os
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

from ._arena import ArenaSource
from ._fetch import BatchFiller
from ._iterator_length import LoaderLength
from ._leases import WeakEntries
from ._options import LoaderOptions
from ._output import NUMPY_UNPINNED, tensor_pinner
from ._pipeline.iterator import MultiProcessIterator
from ._torch_compat import (
    UnusedIteratorDraws,
    draw_torch_seed,
    initialized_distributed,
    loaded_torch,
)
from .samplers import (
    BatchSampler,
    InfiniteConstantSampler,
    RandomSampler,
    SequentialSampler,
    as_numpy_generator,
    is_torch_generator,
)


def default_samplers(dataset: Any, options: LoaderOptions, sampler: Any, batch_sampler: Any,
                     batch_size: int | None, drop_last: bool) -> tuple[Any, Any]:
    """(sampler, batch_sampler) as torch's DataLoader makes them when not given."""
    if options.iterable:
        # Each worker iterates its own replica of the dataset; the sampler only says
        # "one more", as torch's does.
        sampler = InfiniteConstantSampler() if sampler is None else sampler
    elif sampler is None:
        sampler = (RandomSampler(dataset, generator=options.generator) if options.shuffle
                   else SequentialSampler(dataset))
    if batch_size is not None and batch_sampler is None:
        batch_sampler = BatchSampler(sampler, batch_size, drop_last)
    return sampler, batch_sampler


def make_filler(dataset: Any, options: LoaderOptions, sampler: Any, batch_sampler: Any,
                batch_size: int | None, drop_last: bool) -> BatchFiller:
    """What loads and collates a batch of ``batch_size`` rows (a user batch_sampler's rows
    are learnt from its first batch: its ``batch_size`` attribute, if any, may mean anything,
    a token budget or a list of bucket sizes)."""
    user_batch_sampler = options.batch_sampler is not None
    rows = None if user_batch_sampler else batch_size
    index_source = (f"batch_sampler {type(batch_sampler).__name__}" if user_batch_sampler
                    else f"sampler {type(sampler).__name__}")
    return BatchFiller(dataset, options.collate_fn, options.auto_collation, rows,
                       iterable=options.iterable, drop_last=drop_last,
                       index_source=index_source)


class EpochSeeds:
    """The workers' base seed and the DataPipe seed of each epoch, drawn as torch draws them:
    from the user's ``generator`` or torch's global RNG, else (None or a seed) from one numpy
    stream for every epoch."""

    def __init__(self, generator: Any):
        self._generator = generator
        self._group: Any = None  # torch.distributed group sharing the DataPipe seed
        self._world: Any = None  # the default group it was made under
        if is_torch_generator(generator) or isinstance(generator, np.random.Generator) \
                or (generator is None and loaded_torch() is not None):
            self._rng = None
        else:  # any other type raises TypeError now
            self._rng = as_numpy_generator(generator)

    @property
    def stream(self) -> np.random.Generator | None:
        """The numpy stream the seeds come from (None: torch's generator, or the user's)."""
        return self._rng

    def base_seed(self) -> int:
        """The epoch's worker base seed (with a ``torch.Generator``, or none in a program
        using torch, torch's very draw: the same seed gives torch's worker seeds, and leaves
        torch's RNG where torch leaves it)."""
        generator = self._generator
        if is_torch_generator(generator) or (generator is None and self._rng is None):
            return draw_torch_seed(generator)
        rng = self._rng if self._rng is not None else as_numpy_generator(generator)
        return int(rng.integers(2**63))

    def datapipe_seed(self) -> int:
        """torch's shared DataPipe seed: drawn like the base seed, and under
        ``torch.distributed`` broadcast from rank 0 so every rank shuffles alike."""
        seed = self.base_seed()
        dist = initialized_distributed()
        if dist is not None:
            torch = loaded_torch()
            if self._group is None or self._world is not dist.group.WORLD:
                # Anew under a new default group (destroy_process_group(), then
                # init_process_group()): the old group went with its world.
                self._group = dist.new_group(backend="gloo")
                self._world = dist.group.WORLD
            shared = torch.tensor(seed, dtype=torch.int64)
            dist.broadcast(shared, src=0, group=self._group)
            seed = int(shared.item())
        return seed

    def __getstate__(self) -> dict[str, Any]:
        # A group belongs to its process (and does not pickle): a loader's copy makes its own.
        return {**self.__dict__, "_group": None, "_world": None}


def epoch_batches(options: LoaderOptions, sampler: Any, batch_sampler: Any,
                  filler: BatchFiller, first: int = 0) -> Iterator[Any]:
    """The epoch's batch order: each batch's indices (None per batch for iterable-style
    datasets, whose workers' iterators decide when they end), past the ``first`` batches a
    resumed epoch skips (drawn as in a whole epoch, never loaded)."""
    if options.iterable:
        return itertools.repeat(None)
    if not options.auto_collation:
        return itertools.islice(sampler, first, None) if first else iter(sampler)
    arrays = filler.reads_index_arrays
    if type(batch_sampler) is BatchSampler:
        # int64 arrays straight into the batch order (workers read them as ints); the
        # in-process loader hands the dataset ints, as torch does, so takes lists, but where
        # the dataset's read_into takes the batch's index array.
        batches = batch_sampler.index_batches(first, lists=options.num_workers == 0
                                              and not arrays)
    elif first:
        batches = itertools.islice(batch_sampler, first, None)
    else:
        batches = iter(batch_sampler)
    if filler.batch_size is None and options.num_workers > 0:
        # A user batch_sampler: the workers' index entries are sized by its first batch (a
        # larger one travels pickled), taken now as torch's first prefetch takes it; the rest
        # are asked for as torch asks (the sampler may be endless, or draw as it goes).
        first_batch = next(batches, None)
        if first_batch is None:
            return iter(())
        if not hasattr(first_batch, "__len__"):
            first_batch = list(first_batch)  # (a generator of indices)
        filler.batch_size = max(len(first_batch), 1)
        batches = itertools.chain((first_batch,), batches)
    return batches


class PersistentEpoch(LoaderLength):
    """The persistent iterator as ``iter(loader)`` returns it: holds the loader (so that
    ``for b in ArenaLoader(...)`` keeps it alive) while the loader holds only the iterator."""

    __slots__ = ("__weakref__", "_next", "_owner", "iterator")

    def __init__(self, owner: Any, iterator: MultiProcessIterator):
        self._owner = owner
        self.iterator = iterator
        self._next = iterator.next_batch

    def __iter__(self) -> PersistentEpoch:
        return self

    def __next__(self) -> Any:
        return self._next()

    def close(self) -> None:
        """Stops nothing: the workers are the loader's (``loader.close()`` stops them), and
        the next ``iter()`` goes on with them. ``yield from loader`` in a generator closed
        early (or collected) calls this, where torch's iterator has no ``close()``."""

    def __getattr__(self, name: str) -> Any:
        # (Not self.iterator: on an instance without it, that lookup came back here.)
        return getattr(object.__getattribute__(self, "iterator"), name)  # worker_pids, ...


class LiveIterators:
    """A loader's iterators still alive (closed with it; ``snapshot()`` lists them in the
    order they were made) and its persistent one, with the face ``iter(loader)`` returns."""

    def __init__(self) -> None:
        # (WeakEntries, not WeakSet: their callbacks cannot swallow a Ctrl-C.)
        self.live = WeakEntries()  # what close() closes (a staged iterator: its wrapper)
        self._made = WeakEntries()  # every iterator made, in order (snapshots)
        self.persistent: MultiProcessIterator | None = None
        self._face: weakref.ref | None = None
        # One iter() at a time (ArenaLoader.__iter__): two at once with persistent workers and
        # a stage each stopped the other's stage before either began its epoch, so both
        # stages read the one epoch (a batch twice, each epoch cut short without an error);
        # an unused iterator's draws are given back holding it, so never in the middle of one.
        self.lock = threading.RLock()
        self.begun = 0  # iter() calls past their give-backs: a later one keeps earlier draws
        self._watch: weakref.finalize | None = None  # the last iter()'s draws, if given back

    def settle(self) -> None:
        """At the start of ``iter()``: the deferred give-backs, then this ``iter()`` counts
        (an iterator made before it may no longer give its draws back, so its watch goes:
        the persistent face is the same object every epoch while it lives, and a watch
        left on it per epoch held that epoch's position and draws until the face died)."""
        UnusedIteratorDraws.settle()
        self.begun += 1
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.detach()

    def add(self, iterator: Any) -> None:
        self.live.add(iterator)
        self._made.add(iterator)

    def snapshots(self) -> tuple:
        return tuple(iterator.snapshot() for iterator, _ in self._made.items())

    def persistent_face(self, owner: Any, iterator: MultiProcessIterator) -> PersistentEpoch:
        """The same object every epoch while the user holds it, as torch's."""
        face = self._face() if self._face is not None else None
        if face is None or face.iterator is not iterator:
            face = PersistentEpoch(owner, iterator)
            self._face = weakref.ref(face)
        return face

    def staged(self, owner: Any, stager: Any, iterator: Any, owns_host: bool,
               positions: Any) -> Any:
        """``iterator`` behind the loader's stage (``_stage.Stager``), if it has one (else,
        for the persistent iterator, behind its face that keeps the loader alive)."""
        if stager is None:
            return iterator if owns_host else self.persistent_face(owner, iterator)
        if owns_host:
            # Closed by the staged iterator, after its thread stopped (and its copies from
            # the slab completed).
            self.live.discard(iterator)
        wrapped = stager.wrap(owner, iterator, owns_host, positions)
        self.live.add(wrapped)
        return wrapped

    def watched(self, draws: Any, source: ArenaSource, position: Any, epoch: Any,
                new_persistent: MultiProcessIterator | None) -> Any:
        """``epoch``, whose random draws are given back if it is dropped unused (a probe
        such as Lightning's ``iter(loader)``), with the persistent iterator this ``iter()``
        made (its workers were seeded from those draws: it is dropped too). Used: it handed
        out a batch, or ended (``position``, the epoch's: an empty epoch drew as torch's)."""
        if draws is not None:
            iterators, begun = weakref.ref(self), self.begun

            def drop_persistent() -> None:
                live = iterators()
                if live is not None and live.persistent is new_persistent:
                    live.close_persistent()

            def used() -> int:  # (or a later iter() began, which drew after these draws)
                live = iterators()
                later = live is not None and live.begun != begun
                return source.delivered_count() + position.finished + later

            self._watch = draws.watch(epoch, used, self.lock,
                                      drop_persistent if new_persistent is not None else None)
        return epoch

    def close_persistent(self) -> None:
        persistent, self.persistent = self.persistent, None
        if persistent is not None:
            persistent.close()

    def let_go_persistent(self) -> None:
        """The next ``iter()`` starts new workers, as torch's does after ``loader._iterator =
        None`` (torchdata's ``load_state_dict``): an epoch still being iterated (in another
        thread, say) ends on the old ones, which stop once that iterator is dropped (closed
        at once if nothing else holds it)."""
        self.persistent = None


def open_gpu_options(options: LoaderOptions) -> tuple[Any, Any, Any, str | None]:
    """(slab pinner, device copier, batch pinner, why nothing is pinned), each or None, for
    ``pin_memory`` and ``device``. Without a device, ``pin_memory`` copies a batch's tensors
    into torch's page-locked memory, as torch does (``_output.tensor_pinner``): the slab is
    not page-locked, since a slot is rewritten once its batch is dropped, which
    ``x = x.cuda(non_blocking=True)`` does before its copy has run."""
    if options.device is not None:
        return (*open_cuda(options), None, None)
    if not options.pin_memory:
        return None, None, None, None
    if options.output == "numpy":
        warnings.warn(NUMPY_UNPINNED, UserWarning, stacklevel=3)
        return None, None, None, None
    return (None, None, *tensor_pinner())


def open_cuda(options: LoaderOptions) -> tuple[Any, Any]:
    """(slab pinner or None, device copier) for ``device`` (with ``pin_memory``, the slab is
    page-locked in place: only the device stage copies from it). Without CUDA it is an error
    naming ``device``."""
    try:
        from . import _device  # numba.cuda is imported only here, only when asked for
    except ImportError as exc:
        reason = f"numba.cuda does not import: {exc}"
    else:
        reason = _device.cuda_unavailable_reason()
    if reason is None:
        gpu = _device.resolve_gpu(options.gpu_index)
        pinner = _device.HostPinner(gpu) if options.pin_memory else None
        copier = _device.DeviceCopier(gpu, options.slots_or_default, options.pin_memory,
                                      options.output, options.held_batch_limit)
        return pinner, copier
    raise RuntimeError(f"device={options.device!r} needs a CUDA GPU, but {reason}; pass "
                       "device=None for host batches, or install arena_loader[cuda] on a "
                       "machine with a GPU")


def close_all(source: ArenaSource, live: WeakEntries, pid: int) -> None:
    if os.getpid() != pid:
        return  # a finalizer copied into a forked worker: the loader is the parent's
    try:
        for iterator, _ in live.items():
            iterator.close()
    finally:
        source.close()
