"""The loaders the benchmark compares, each built the same way: ``(dataset, Setup)`` -> an
object that can be iterated once per epoch and has ``close()``.

Baselines written here: ``QueuePicklingLoader`` (the textbook multiprocessing design: batches
collated with ``np.stack`` in a worker and pickled through a queue), ``SpdlArenaLoader``
(SPDL's ``SharedMemorySegmentPool`` arena, one ``iterate_in_subprocess`` per worker),
``GrainLoader`` (``grain.python.DataLoader`` with ``worker_count``), ``NodesLoader``
(``torchdata.nodes``: ``ParallelMapper`` over batches of indices), ``CopyLimit`` (one thread
collating the same batches into a preallocated ring) and the floor (``floor.FloorLoader``).
torch, spdl, grain and torchdata are imported only when their loader is built.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import mmap
import multiprocessing as mp
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..loader import ArenaLoader
from .floor import FloorLoader
from .workloads import aligned

TASK_TIMEOUT_S = 60.0
BENCH_EXTRA = "pip install -e '.[bench]'"  # what brings every peer (SPDL, Grain, torchdata)


@dataclass(frozen=True)
class Setup:
    """What every loader of one case shares: batch size, workers, prefetch depth."""

    batch_size: int
    workers: int
    prefetch_factor: int = 2
    collate_fn: Callable[[list], Any] | None = None  # the workload's own, if it has one
    threads: int | None = None  # thread workers of the rows that wait in threads
    worker_threads: int = 1  # threads inside each worker (ArenaLoader worker_threads rows)


def numpy_collate(samples: list[Any]) -> Any:
    """Stack samples into numpy arrays (dicts field by field): the collate a numpy user
    writes, whose result torch's DataLoader has to pickle through its queue."""
    first = samples[0]
    if isinstance(first, dict):
        return {key: numpy_collate([s[key] for s in samples]) for key in first}
    return np.stack([np.asarray(s) for s in samples])


def batch_ranges(n: int, batch_size: int) -> list[range]:
    return [range(start, min(start + batch_size, n)) for start in range(0, n, batch_size)]


# --- the copy limit -------------------------------------------------------------------------

class CopyLimit:
    """The same batches collated by one thread, row by row, into a preallocated ring of
    buffers: what one core does with no loader at all. ``shared``: the ring is shared memory
    (an anonymous ``MAP_SHARED`` mapping), what any loader that hands a batch to another
    process writes into. Where the kernel gives shared memory no transparent huge pages
    (``/sys/kernel/mm/transparent_hugepage/shmem_enabled``: never) and private memory gets
    them (numpy asks with ``madvise`` for arrays of 4 MB and more), the private ring copies
    faster: 18.9 against 15.7 GB/s for 150 KB rows on the bench's 2-core VM
    (``benchmarks/copy_ceiling.py``; docs/benchmarks.md, "Rows copied by the cast loop").
    Both copy a row the way a user's loop does (numpy's assignment: ``memmove``)."""

    def __init__(self, dataset: Any, batch_size: int, ring: int = 4, shared: bool = False):
        self.dataset, self.batch_size, self.ring = dataset, batch_size, ring
        self.shared = shared
        self._buffers: Any = None

    def _allocate(self, sample: Any) -> Any:
        if isinstance(sample, dict):
            return {key: self._allocate(value) for key, value in sample.items()}
        value = np.asarray(sample)
        shape = (self.ring, self.batch_size, *value.shape)
        if self.shared:  # page-aligned; the pages are made (written) before timing, as below
            nbytes = int(np.prod(shape)) * value.dtype.itemsize
            ring = np.frombuffer(mmap.mmap(-1, max(1, nbytes)), np.uint8)[:nbytes]
            ring[...] = 0
            return ring.view(value.dtype).reshape(shape)
        # Rows start on cache lines, as the pools' do: a copy between buffers misaligned
        # to each other runs ~1.5x slower (image: 1,250 against 1,900 batches/s).
        return aligned(np.zeros(shape, dtype=value.dtype))

    def __iter__(self) -> Iterator[Any]:
        for k, rows in enumerate(batch_ranges(len(self.dataset), self.batch_size)):
            if self._buffers is None:
                self._buffers = self._allocate(self.dataset[0])
            yield _fill(self._buffers, k % self.ring, rows, self.dataset)

    def close(self) -> None:
        self._buffers = None


def _fill(buffers: Any, slot: int, rows: range, dataset: Any) -> Any:
    if isinstance(buffers, dict):
        out = {key: buffers[key][slot] for key in buffers}
        for row, index in enumerate(rows):
            sample = dataset[index]
            for key, array in out.items():
                array[row] = sample[key]
        return {key: array[: len(rows)] for key, array in out.items()}
    out = buffers[slot]
    for row, index in enumerate(rows):
        out[row] = dataset[index]
    return out[: len(rows)]


# --- the textbook queue-pickling loader -----------------------------------------------------

@dataclass(frozen=True)
class Task:
    """A batch for a worker of ``QueuePicklingLoader``: its sequence number and indices."""

    idx: int
    indices: list[int]


@dataclass(frozen=True)
class Done:
    """A collated batch, pickled whole through the result queue."""

    idx: int
    batch: Any


@dataclass(frozen=True)
class Failed:
    idx: int
    message: str


def _queue_worker(dataset: Any, tasks: mp.Queue, results: mp.Queue) -> None:
    while (task := tasks.get()) is not None:
        try:
            results.put(Done(task.idx, numpy_collate([dataset[i] for i in task.indices])))
        except Exception as error:  # reported to the consumer, which raises it
            results.put(Failed(task.idx, f"{type(error).__name__}: {error}"))


class QueuePicklingLoader:
    """The textbook multiprocessing loader: persistent workers take batch indices from a task
    queue, collate with ``np.stack`` and put the whole batch (pickled) on a result queue; the
    consumer reorders by ``idx``. At most ``workers * prefetch_factor`` batches in flight."""

    def __init__(self, dataset: Any, setup: Setup):
        self.dataset, self.setup = dataset, setup
        context = mp.get_context()
        self._tasks: mp.Queue = context.Queue()
        self._results: mp.Queue = context.Queue()
        self._workers = [context.Process(target=_queue_worker, daemon=True,
                                         args=(dataset, self._tasks, self._results))
                         for _ in range(setup.workers)]
        for worker in self._workers:
            worker.start()

    def __iter__(self) -> Iterator[Any]:
        batches = batch_ranges(len(self.dataset), self.setup.batch_size)
        window = self.setup.workers * self.setup.prefetch_factor
        sent, waiting = 0, {}
        for idx in range(len(batches)):
            while sent < len(batches) and sent < idx + window:
                self._tasks.put(Task(sent, list(batches[sent])))
                sent += 1
            while idx not in waiting:
                message = self._receive()
                if isinstance(message, Failed):
                    raise RuntimeError(f"batch {message.idx} failed in a worker: "
                                       f"{message.message}")
                waiting[message.idx] = message.batch
            yield waiting.pop(idx)

    def _receive(self) -> Done | Failed:
        try:
            return self._results.get(timeout=TASK_TIMEOUT_S)
        except queue.Empty:
            dead = [(w.pid, w.exitcode) for w in self._workers if not w.is_alive()]
            raise RuntimeError(f"no batch from the queue-pickling workers in "
                               f"{TASK_TIMEOUT_S} s; dead workers (pid, exit code): "
                               f"{dead}") from None

    def close(self) -> None:
        for _ in self._workers:
            self._tasks.put(None)
        for worker in self._workers:
            worker.join(timeout=5)
            if worker.is_alive():
                worker.kill()
                worker.join()
        for q in (self._tasks, self._results):
            q.close()
            q.join_thread()


# --- SPDL's shared-memory segment pool ------------------------------------------------------

def spdl_missing() -> str | None:
    """Why the SPDL baseline cannot run here, or None when it can."""
    if importlib.util.find_spec("spdl") is None:
        return f"not installed ({BENCH_EXTRA})"
    try:
        from spdl.pipeline import SharedMemorySegmentPool, iterate_in_subprocess  # noqa: F401
    except ImportError as error:
        return f"spdl is installed but has no SharedMemorySegmentPool: {error}"
    if sys.version_info >= (3, 13) and importlib.metadata.version("spdl") == "0.8.0":
        # Its arena sets a pickler's persistent_id, read-only on CPython 3.13: every batch
        # fails with "'_pickle.Pickler' object attribute 'persistent_id' is read-only".
        return "spdl 0.8.0 does not run on Python 3.13+ (it sets Pickler.persistent_id)"
    return None


class _WorkerShare:
    """The batches worker ``worker`` of ``workers`` collates, in order (an SPDL iterable:
    ``iter()`` once per epoch)."""

    def __init__(self, dataset: Any, batch_size: int, worker: int, workers: int):
        self.dataset, self.batch_size = dataset, batch_size
        self.worker, self.workers = worker, workers

    def __iter__(self) -> Iterator[Any]:
        batches = batch_ranges(len(self.dataset), self.batch_size)
        for rows in batches[self.worker::self.workers]:
            yield numpy_collate([self.dataset[i] for i in rows])


def _quiet_resource_tracker() -> None:
    # Python < 3.13's resource tracker prints a KeyError traceback for every SPDL segment
    # (the segments are unregistered twice); start it with stderr on /dev/null so the
    # benchmark's progress lines stay readable.
    from multiprocessing import resource_tracker

    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            resource_tracker.ensure_running()
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class SpdlArenaLoader:
    """SPDL's arena at the same worker count: one ``iterate_in_subprocess`` per worker, each
    with its own ``SharedMemorySegmentPool`` (``prefetch_factor + 2`` segments, SPDL's
    recommended minimum for a buffer of ``prefetch_factor``); worker ``w`` collates batches
    ``w, w + workers, ...`` with ``np.stack`` and the arena copies them into a segment; the
    consumer takes them round-robin (so in order) as zero-copy views."""

    def __init__(self, dataset: Any, setup: Setup):
        from spdl.pipeline import SharedMemorySegmentPool, iterate_in_subprocess

        _quiet_resource_tracker()
        self.dataset, self.setup = dataset, setup
        batch_nbytes = _nbytes(numpy_collate([dataset[0]] * setup.batch_size))
        segment_size = batch_nbytes + 64 * 1024  # room for alignment and pickled metadata
        self._sources = []
        try:
            for worker in range(setup.workers):
                pool = SharedMemorySegmentPool(segment_size=segment_size,
                                               count=setup.prefetch_factor + 2)
                share = functools.partial(_WorkerShare, dataset, setup.batch_size, worker,
                                          setup.workers)
                self._sources.append(iterate_in_subprocess(
                    share, buffer_size=setup.prefetch_factor, arena=pool,
                    timeout=TASK_TIMEOUT_S))
        except BaseException:
            self.close()
            raise

    def __iter__(self) -> Iterator[Any]:
        iterators = [iter(source) for source in self._sources]
        count = len(batch_ranges(len(self.dataset), self.setup.batch_size))
        for idx in range(count):
            yield next(iterators[idx % len(iterators)])
        for iterator in iterators:  # let each worker see its epoch end
            for _ in iterator:
                raise RuntimeError("an SPDL worker produced more batches than its share")

    def close(self) -> None:
        for source in self._sources:
            # No public close in spdl 0.8: _shutdown() runs the finalizer that stops the
            # subprocess and unlinks its arena.
            with contextlib.suppress(Exception):
                source._shutdown()
        self._sources = []


def _nbytes(batch: Any) -> int:
    if isinstance(batch, dict):
        return sum(_nbytes(value) for value in batch.values())
    return int(batch.nbytes)


# --- Grain ----------------------------------------------------------------------------------


def grain_missing() -> str | None:
    if importlib.util.find_spec("grain") is None:
        return f"not installed ({BENCH_EXTRA})"
    return None


class GrainLoader:
    """``grain.python.DataLoader`` with ``worker_count`` workers (spawned processes),
    ``worker_buffer_size = prefetch_factor`` and ``grain.python.Batch`` (``np.stack``; Grain
    puts each batch's arrays in new shared-memory segments). ``ReadOptions(num_threads=0)``,
    Grain's advice for data in memory: its default (16 reader threads and a 500-record
    buffer per worker) would read ~1,000 samples ahead of the others' prefetch depth.
    Grain's workers each take every ``workers``-th record and batch their own share, so a
    batch holds records ``w, w + workers, ...`` and an epoch of the persistent stream below is
    the next ``len(dataset) / batch_size`` batches of it: the same bytes per epoch as the
    others' consecutive batches, not the same samples. Grain starts its workers per
    iterator, so for persistent workers as the others have, one iterator over an endless
    sequential sampler serves every epoch when the dataset is whole batches (the bench's
    are); otherwise each epoch is a new iterator (workers started again)."""

    def __init__(self, dataset: Any, setup: Setup):
        import grain.python as grain
        from absl import flags  # a dependency of grain's

        # Grain reads absl flags, which only an absl app parses: with jax installed, grain
        # 0.2.18's profiler reads one in its loader thread (UnparsedFlagAccessError).
        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        self._grain, self.dataset, self.setup = grain, dataset, setup
        self.batches = len(batch_ranges(len(dataset), setup.batch_size))
        self.persistent = len(dataset) % setup.batch_size == 0
        self._stream: Any = self._iterator(None) if self.persistent else None

    def _iterator(self, epochs: int | None) -> Any:
        grain = self._grain
        sampler = grain.IndexSampler(num_records=len(self.dataset), num_epochs=epochs,
                                     shard_options=grain.NoSharding(), shuffle=False, seed=0)
        loader = grain.DataLoader(
            data_source=self.dataset, sampler=sampler,
            operations=[grain.Batch(self.setup.batch_size, drop_remainder=False)],
            worker_count=self.setup.workers, worker_buffer_size=self.setup.prefetch_factor,
            read_options=grain.ReadOptions(num_threads=0))
        return iter(loader)

    def __iter__(self) -> Iterator[Any]:
        if self._stream is not None:
            for _ in range(self.batches):
                yield next(self._stream)
            return
        iterator = self._iterator(1)
        try:
            yield from iterator
        finally:
            _close_grain(iterator)

    def close(self) -> None:
        if self._stream is not None:
            _close_grain(self._stream)
            self._stream = None


def _close_grain(iterator: Any) -> None:
    # grain 0.2.18's DataLoaderIterator has no close(); the dataset iterator it wraps does
    # (it stops and joins the worker processes and frees their shared memory).
    iterator._iterator.close()


# --- torchdata -------------------------------------------------------------------------------

def torchdata_missing() -> str | None:
    if importlib.util.find_spec("torch") is None:
        return "not installed (pip install torch==2.13.0)"
    if importlib.util.find_spec("torchdata") is None:
        return f"not installed ({BENCH_EXTRA})"
    return None


class _FetchCollate:
    """A batch of indices -> the collated batch (a picklable map_fn for process workers)."""

    def __init__(self, dataset: Any, collate_fn: Callable[[list], Any]):
        self.dataset, self.collate_fn = dataset, collate_fn

    def __call__(self, indices: list[int]) -> Any:
        return self.collate_fn([self.dataset[i] for i in indices])


class NodesLoader:
    """``torchdata.nodes``: ``SamplerWrapper(BatchSampler)`` -> ``ParallelMapper`` (fetch and
    ``np.stack`` a batch per call, ``method`` processes or threads, ``in_order``) ->
    ``Prefetcher`` -> ``Loader``; batches are pickled from process workers. The nodes
    restart their workers at every epoch (``reset``): that is their design, and counted."""

    def __init__(self, dataset: Any, setup: Setup, method: str = "process"):
        import torch.utils.data as data
        import torchdata.nodes as nodes

        workers = setup.threads if method == "thread" and setup.threads else setup.workers
        collate = setup.collate_fn or numpy_collate
        sampler = data.BatchSampler(data.SequentialSampler(range(len(dataset))),
                                    batch_size=setup.batch_size, drop_last=False)
        node = nodes.ParallelMapper(nodes.SamplerWrapper(sampler),
                                    map_fn=_FetchCollate(dataset, collate),
                                    num_workers=workers, method=method,
                                    multiprocessing_context="fork" if method == "process"
                                    else None, in_order=True)
        self._node = node
        self._prefetcher = nodes.Prefetcher(node, prefetch_factor=setup.prefetch_factor
                                            * setup.workers)
        self._loader = nodes.Loader(self._prefetcher)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._loader)

    def close(self) -> None:
        # torchdata 0.11 has no public close: what the iterators' __del__ does (_shutdown),
        # run now, after the mapper's process workers have ended. Stopped mid-epoch, a
        # worker finishes the tasks already queued, then hangs at exit flushing its result
        # queue into a pipe nobody reads any more (torchdata's _shutdown waits 0.5 s for
        # each, then leaves it). So: stop the stages, let the sort thread, the pipe's only
        # reader, leave (within its 0.1 s poll), then end the workers.
        prefetch = getattr(self._prefetcher, "_it", None)
        mapper = getattr(getattr(self._node, "_it", None), "_it", None)
        if mapper is not None:
            mapper._stop.set()
            mapper._mp_stop.set()
            if mapper._sort_thread.is_alive():
                mapper._sort_thread.join()
            for worker in mapper._workers:
                if isinstance(worker, mp.process.BaseProcess) and worker.is_alive():
                    worker.kill()
                    worker.join()
            # A worker killed inside the stop event's is_set() (it polls it) leaves the event's
            # shared lock taken for good: _shutdown() and __del__ would wait on it forever (seen
            # once, a CI run hung in gc). The workers are gone and saw the event set: the
            # iterator gets an event of its own, already set.
            done = threading.Event()
            done.set()
            mapper._mp_stop = done
        for iterator in (prefetch, mapper):
            if iterator is not None:
                iterator._shutdown()


# --- torch ----------------------------------------------------------------------------------

def torch_missing() -> str | None:
    return None if importlib.util.find_spec("torch") else "not installed (pip install torch)"


def _torch_loader(dataset: Any, setup: Setup, collate_fn: Callable | None = None,
                  stateful: bool = False) -> Any:
    import torch

    if stateful:  # torchdata's drop-in subclass (checkpointable iteration)
        from torchdata.stateful_dataloader import StatefulDataLoader as DataLoader
    else:
        from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    collate_fn = setup.collate_fn or collate_fn
    kwargs = {} if collate_fn is None else {"collate_fn": collate_fn}
    return _Closing(DataLoader(dataset, batch_size=setup.batch_size,
                               num_workers=setup.workers, prefetch_factor=setup.prefetch_factor,
                               persistent_workers=True, **kwargs))


class _Closing:
    """torch's DataLoader has no ``close()``: dropping its persistent iterator (and
    collecting it) is what stops its workers."""

    def __init__(self, loader: Any):
        self.loader = loader

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    def close(self) -> None:
        iterator = getattr(self.loader, "_iterator", None)
        if iterator is not None:
            iterator._shutdown_workers()
        self.loader = None


# --- ArenaLoader ----------------------------------------------------------------------------

def _arena(dataset: Any, setup: Setup, **extra: Any) -> ArenaLoader:
    if setup.collate_fn is not None:
        extra["collate_fn"] = setup.collate_fn
    return ArenaLoader(dataset, batch_size=setup.batch_size, num_workers=setup.workers,
                       prefetch_factor=setup.prefetch_factor, persistent_workers=True,
                       **extra)  # (the default slots: what a user who switches gets)


def _arena_torch(dataset: Any, setup: Setup) -> ArenaLoader:
    return _arena(dataset, setup, output="torch")


def _arena_threads(dataset: Any, setup: Setup) -> ArenaLoader:
    threads = setup.threads or setup.workers
    extra = {} if setup.collate_fn is None else {"collate_fn": setup.collate_fn}
    return ArenaLoader(dataset, batch_size=setup.batch_size, num_workers=threads,
                       prefetch_factor=setup.prefetch_factor, persistent_workers=True,
                       worker_mode="thread", **extra)


def _arena_hybrid(dataset: Any, setup: Setup) -> ArenaLoader:
    """Worker processes with ``worker_threads`` threads each (processes x threads)."""
    return _arena(dataset, setup, worker_threads=setup.worker_threads)


def _floor(dataset: Any, setup: Setup) -> FloorLoader:
    return FloorLoader(dataset, setup.batch_size, setup.workers, depth=setup.prefetch_factor)


@dataclass(frozen=True)
class LoaderKind:
    """One loader the benchmark compares: its report name, how to build it, and why it
    cannot run here (None when it can)."""

    name: str
    build: Callable[[Any, Setup], Any]
    missing: Callable[[], str | None] = lambda: None
    uses_workers: bool = True
    takes_collate_fn: bool = True  # runs workloads that bring their own collate_fn
    fixed_shape_only: bool = False  # samples must be one array of one shape (the floor)
    threads: bool = False  # thread workers: run only on workloads that wait (Workload.threads)
    only: tuple[str, ...] = ()  # runs only on these workloads (empty: on every one)
    hybrid: bool = False  # processes x threads: --workers processes of --worker-threads each
    wide: bool = False  # runs with --wide-workers workers instead of --workers


ARENA = "ArenaLoader"
ARENA_TORCH = "ArenaLoader torch"
TORCH = "torch default collate"
TORCH_NUMPY = "torch numpy collate"
QUEUE = "queue pickling"
SPDL = "SPDL arena"
GRAIN = "Grain"
STATEFUL = "torchdata StatefulDataLoader"
NODES = "torchdata nodes"
ARENA_THREADS = "ArenaLoader threads"
NODES_THREADS = "torchdata nodes threads"
ARENA_HYBRID = "ArenaLoader worker_threads"
TORCH_WIDE = "torch default collate wide"
COPY = "copy limit"
COPY_SHARED = "copy limit (shared memory)"
FLOOR = "floor"

LOADERS: list[LoaderKind] = [
    LoaderKind(ARENA, _arena),
    LoaderKind(ARENA_TORCH, _arena_torch, torch_missing),
    LoaderKind(TORCH, _torch_loader, torch_missing),
    LoaderKind(TORCH_NUMPY, functools.partial(_torch_loader, collate_fn=numpy_collate),
               torch_missing),
    LoaderKind(QUEUE, QueuePicklingLoader, takes_collate_fn=False),
    LoaderKind(SPDL, SpdlArenaLoader, spdl_missing, takes_collate_fn=False),
    LoaderKind(GRAIN, GrainLoader, grain_missing, takes_collate_fn=False),
    LoaderKind(STATEFUL, functools.partial(_torch_loader, stateful=True), torchdata_missing),
    LoaderKind(NODES, NodesLoader, torchdata_missing),
    LoaderKind(ARENA_THREADS, _arena_threads, threads=True),
    LoaderKind(NODES_THREADS, functools.partial(NodesLoader, method="thread"),
               torchdata_missing, threads=True),
    LoaderKind(ARENA_HYBRID, _arena_hybrid, only=("jpeg", "remote"), hybrid=True),
    LoaderKind(TORCH_WIDE, _torch_loader, torch_missing, only=("remote",), wide=True),
    LoaderKind(COPY, lambda dataset, setup: CopyLimit(dataset, setup.batch_size),
               uses_workers=False, takes_collate_fn=False),
    LoaderKind(COPY_SHARED, lambda dataset, setup: CopyLimit(dataset, setup.batch_size,
                                                             shared=True),
               uses_workers=False, takes_collate_fn=False, only=("image",)),
    LoaderKind(FLOOR, _floor, takes_collate_fn=False, fixed_shape_only=True),
]
