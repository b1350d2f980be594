"""The worker process: attach the slab, then turn order entries into filled slots until told
to stop.

Everything a worker needs arrives in one ``WorkerSetup`` (pickled under spawn/forkserver,
inherited under fork). It reads its entries of the epoch's batch order from the shared ring
(``_pipeline.order``) and answers each with a completion record on its private result pipe
(``_pipeline.completions``), so a worker that dies cannot corrupt a channel another worker
uses (docs/design.md, "Workers"). ``serve`` is the one loop that process and thread workers
both run.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import random
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np

from ._after_import import when_imported
from ._fd_socket import receive_slab, send_segment
from ._fetch import BatchFiller, Fetched, StreamPosition
from ._forksafe import close_on_exec_inherited, started_by_fork
from ._layout import PlanEncoder
from ._messages import BatchFailed, RemoteError, WorkerFailed
from ._pipeline.completions import Status, encode, write_completion
from ._pipeline.order import Entry, EntryKind, OrderReader
from ._resume_stream import ReplicaStream, StreamResume
from ._rows import SameShapeRows
from ._sample_threads import SampleThreads
from ._slab import Segment, SlabHandle, map_shared
from ._worker_torch import limit_torch_threads, set_up_torch
from .worker_info import WorkerInfo, set_process_worker_info, thread_info

# How often an idle worker checks that its parent is still alive, in case the parent-death
# signal could not be armed (see _arm_parent_death_signal).
PARENT_CHECK_S = 0.5
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class WorkerSetup:
    worker_id: int
    num_workers: int
    filler: BatchFiller
    slot_nbytes: int  # 0: not known yet; an ATTACH entry brings it
    slab: SlabHandle
    slots: int
    fd_socket: Any  # a socket: one-off segments' descriptors go to the main process on it
    base_seed: int
    worker_init_fn: Callable[[int], None] | None
    arm_parent_death_signal: bool
    # The main process uses torch: set torch's worker info too; a fresh (spawn / forkserver)
    # interpreter sets torch up when something imports it (_after_import).
    publish_to_torch: bool = False
    # The shared ring of the epoch's batch order (``_pipeline.order``): its descriptor (None
    # for thread workers, which read the main process's own mapping) and geometry.
    order: SlabHandle | None = None
    order_depth: int = 0
    order_entry_nbytes: int = 0
    # Threads per worker (docs/design.md, "Threads inside workers"): 1 is the worker alone.
    worker_threads: int = 1
    # A resumed epoch, iterable-style datasets: where this worker's iterator starts.
    stream_resume: StreamResume | None = None


def seed_worker(base_seed: int, worker_id: int) -> int:
    """Seed ``random``, numpy's global RNG and torch (if loaded) for one worker."""
    seed = (base_seed + worker_id) % 2**64
    random.seed(seed)
    np.random.seed(np.random.SeedSequence([worker_id, base_seed % 2**63]).generate_state(4))
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed)
    return seed


def worker_main(setup: WorkerSetup, doorbell: Any, result: Any) -> None:
    """A worker process: ``doorbell`` and ``result`` are its ends of its two pipes."""
    # Ctrl-C reaches the whole process group; the main process handles it and stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if started_by_fork():
        # What the parent had is the parent's: out of this process's collector, so that no
        # collection here writes the headers of (and so copies) the pages it shares with the
        # parent, and no finalizer of the parent's garbage runs here (an abandoned torch
        # iterator's would stop workers that are not ours).
        gc.freeze()
    else:  # spawn, forkserver: multiprocessing's fds come inheritable
        close_on_exec_inherited()
    # Our parent is the main process (fork, spawn) or the forkserver, which exits with it.
    parent_pid = os.getppid()
    if setup.arm_parent_death_signal:
        _arm_parent_death_signal()
    if parent_pid == 1 or not pid_exists(parent_pid):
        return  # the parent died before the signal was armed
    result_fd = result.fileno()
    try:
        ring = setup.order.map()
        os.close(setup.order.fd)
        reader = OrderReader(setup.worker_id, setup.num_workers, setup.order_depth,
                             setup.order_entry_nbytes, doorbell.fileno(), ring,
                             setup.filler.reads_index_arrays, spin=True)
        state = WorkerState(setup)
        if setup.slot_nbytes:
            state.attach(setup.slot_nbytes)
        limit_torch_threads()
        seed = seed_worker(setup.base_seed, setup.worker_id)  # (torch too, if loaded)
        infos = worker_infos(setup, seed)
        set_process_worker_info(infos[0])  # the extra threads set their own, thread-local
        if setup.publish_to_torch:
            # Loaded (fork; or a spawned one whose dataset imported it as it unpickled): set
            # up now. Else as torch's import completes, in whichever code imports it.
            when_imported("torch", functools.partial(set_up_torch, seed, infos[0],
                                                     "torch" not in sys.modules))
        if setup.worker_init_fn is not None:
            setup.worker_init_fn(setup.worker_id)
        state.start_threads(infos)
    except Exception as exc:
        report_worker_failure(result_fd, setup.worker_id, exc)
        return
    serve(state, reader, result_fd, parent_pid)


def worker_infos(setup: WorkerSetup, seed: int) -> list[WorkerInfo]:
    """What ``get_worker_info()`` answers in each of the worker's ``worker_threads``."""
    return [thread_info(setup.base_seed, setup.worker_id, setup.num_workers, seed,
                        setup.filler.dataset, t, setup.worker_threads)
            for t in range(setup.worker_threads)]


def report_worker_failure(result_fd: int, worker_id: int, exc: BaseException) -> None:
    """Tell the main process this worker cannot work (start-up, worker_init_fn, attach)."""
    body = ForkingPickler.dumps(WorkerFailed(worker_id, RemoteError.capture(exc)))
    write_completion(result_fd, encode(Status.WORKER_FAILED, -1, -1, bytes(body)))


def pid_exists(pid: int) -> bool:
    """Whether ``pid`` still exists (a zombie counts: it still holds its exit status)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class WorkerState:
    """The slab mapping, and for iterable-style datasets this worker's iterator of it."""

    def __init__(self, setup: WorkerSetup):
        self.setup = setup
        self.slab: np.ndarray | None = None  # the slab's bytes, once its size is known
        self.slot_nbytes = 0
        self._generation = 0  # the grown slab mapped last (attach), 0: the first one
        self.encoder = PlanEncoder()
        self._stream: ReplicaStream | None = None
        self._stream_epoch = -1
        self._position = 0  # items taken from the iterator: names samples in errors
        self._resume = setup.stream_resume  # for the first epoch's iterator only
        # worker_threads > 1 (map-style, automatic batching): the worker's extra threads
        self.threads: SampleThreads | None = None
        # The one-off segment of each batch being loaded that has one (two at a time when
        # the threads begin a batch before the last one is sent: ``begin``).
        self._segments: dict[int, Segment] = {}
        self._same_shape = SameShapeRows()  # the commonest batch, without a plan built

    def start_threads(self, infos: list[WorkerInfo]) -> None:
        if len(infos) > 1:
            self.threads = SampleThreads(infos)

    def close(self) -> None:
        """Stop the extra threads (the worker loop is ending)."""
        if self.threads is not None:
            self.threads.close()

    def attach(self, slot_nbytes: int, generation: int = 0) -> None:
        """Map the slab, sized for slots of ``slot_nbytes``: the one this worker started
        with, or (``generation`` > 0) a grown one whose descriptor the main process sent on
        the worker's socket (persistent workers go on across a regrow)."""
        if generation:
            if generation == self._generation:
                return  # told twice: mapped
            fd = receive_slab(self.setup.fd_socket, generation)
            try:
                mapping = map_shared(fd, self.setup.slots * slot_nbytes)
            finally:
                os.close(fd)
            self.slab, self.slot_nbytes, self._generation = (
                np.frombuffer(mapping, dtype=np.uint8), slot_nbytes, generation)
            self._same_shape.forget()
            return
        if self.slab is not None and self.slot_nbytes == slot_nbytes:
            return  # told twice (the main process was interrupted after telling): mapped
        setup = self.setup
        slab_mmap = setup.slab.map(setup.slots * slot_nbytes)
        os.close(setup.slab.fd)
        self.slab = np.frombuffer(slab_mmap, dtype=np.uint8)
        self.slot_nbytes = slot_nbytes
        self._same_shape.forget()

    def begin(self, entry: Entry) -> Callable[..., Fetched] | None:
        """The extra threads start loading batch ``entry`` (``worker_threads > 1``); the call
        returned gives it (``load``). None where the threads do not load it."""
        filler = self.setup.filler
        if self.threads is None or filler.iterable:
            return None
        return filler.begin(entry.indices, self.threads,
                            lambda nbytes: self._storage(entry, nbytes))

    def fetch(self, entry: Entry) -> tuple[Fetched | None, Any]:
        """(the batch, its indices); (None, None) when an iterable's iterator is done."""
        filler = self.setup.filler
        if not filler.iterable:
            return filler.fetch(entry.indices), entry.indices
        if entry.epoch != self._stream_epoch:  # a new epoch (persistent workers): start over
            self._stream, self._stream_epoch, self._position = None, entry.epoch, 0
            resume, self._resume = self._resume, None
            self._stream = ReplicaStream(filler.dataset, resume, filler.batch_size or 1)
        if self._stream is None:
            return None, None  # the iterator raised while being made: nothing this epoch
        fetched = self._stream.next_batch(filler)
        if fetched is None:
            return None, None
        indices = [StreamPosition(i) for i in range(self._position,
                                                     self._position + fetched.rows)]
        self._position += fetched.rows
        return fetched, indices

    def _storage(self, entry: Entry, nbytes: int) -> np.ndarray:
        """Where batch ``entry`` of ``nbytes`` bytes goes: its slot, or if it has none or does
        not fit, a one-off segment (kept in ``_segments`` until sent). Asked again with another
        size (rows written in place, then planned anew), it gives storage of that size."""
        if entry.slot >= 0 and self.slab is not None and nbytes <= self.slot_nbytes:
            self._close_segment(entry.idx)
            start = entry.slot * self.slot_nbytes
            return self.slab[start: start + nbytes]
        segment = self._segments.get(entry.idx)
        if segment is None or segment.nbytes != max(nbytes, 1):
            self._close_segment(entry.idx)
            segment = self._segments[entry.idx] = Segment(nbytes)
        return segment.array[:nbytes]

    def _close_segment(self, idx: int) -> None:
        segment = self._segments.pop(idx, None)
        if segment is not None:
            segment.close()

    def load(self, entry: Entry, started: Callable[..., Fetched] | None = None,
             between: Callable[[], None] | None = None) -> bytes:
        """Load batch ``entry.idx`` (``started``: begun by the threads, ``begin``; then
        ``between`` runs once this thread's rows are in), write it into its slot (or, if it
        has none or does not fit, a one-off segment sent over the descriptor socket) and
        return its completion."""
        try:
            filler, slot = self.setup.filler, entry.slot
            fetched, indices = (started(between), entry.indices) if started is not None \
                else self.fetch(entry)
            # The replica's state after this batch goes just before its record.
            # (a replica with state_dict: its state goes with each batch)
            state_of = self._stream.state_of if self._stream is not None else None
            state = b"" if state_of is None else encode(Status.STATE, entry.idx, slot,
                                                        state_of())
            if fetched is None:
                return state + encode(Status.ENDED, entry.idx, slot)
            # Samples that are each one array, shaped as the last batch's: written at once.
            samples, same_shape = fetched.samples, self._same_shape
            if samples is not None and slot >= 0 and same_shape.write(samples, slot):
                return state + encode(Status.LOADED, entry.idx, slot, same_shape.plan_record)
            prepared = filler.prepare(fetched, indices)
            storage = self._storage(entry, prepared.nbytes)
            filler.write(prepared, fetched, storage, indices)
            # The plan record carries no idx or slot, so batches of one structure send equal
            # bodies, which the main process decodes once (_pipeline.completions). Encoded
            # once written: the first record of a structure carries it, and a write that
            # fails (rows unequal after all) must not leave it recorded as sent.
            plan = self.encoder.encode(prepared.plan, 0, 0, 0, segment=False)
            segment = self._segments.get(entry.idx)
            if segment is None:
                if samples is not None and prepared.equal_rows:
                    same_shape.learn(prepared, plan, self.slab, self.slot_nbytes)
                return state + encode(Status.LOADED, entry.idx, slot, plan)
            send_segment(self.setup.fd_socket, entry.idx, segment)
            return state + encode(Status.SEGMENT, entry.idx, slot, plan)
        finally:
            self._close_segment(entry.idx)


def serve(state: WorkerState, reader: OrderReader, result_fd: int,
          parent_pid: int | None) -> None:
    """The worker loop, for process and thread workers alike (``parent_pid=None``: a thread,
    no reparenting check): take entries in order until STOP or the main process goes."""
    try:
        _serve(state, reader, result_fd, parent_pid)
    finally:
        state.close()


def _serve(state: WorkerState, reader: OrderReader, result_fd: int,
           parent_pid: int | None) -> None:
    worker_id = state.setup.worker_id
    ahead: tuple[Entry, Callable[..., Fetched] | None] | None = None  # (_NextEntry)
    while True:
        if ahead is not None:
            (entry, started), ahead = ahead, None
        else:
            try:
                entry = reader.next_entry(PARENT_CHECK_S)
            except EOFError:
                return
            if entry is None:
                if parent_pid is not None and os.getppid() != parent_pid:
                    return  # reparented: the parent is gone
                continue
            started = None
        kind = entry.kind
        if kind is EntryKind.STOP:
            return
        if kind is EntryKind.ATTACH:
            try:
                state.attach(entry.idx, entry.slot)
            except Exception as exc:  # the slab could not be mapped: this worker cannot work
                report_worker_failure(result_fd, worker_id, exc)
                return
            continue
        if started is None and state.threads is not None:  # (no call per batch without)
            started = state.begin(entry)
        after = _NextEntry(state, reader) if started is not None else None
        try:
            if after is not None:
                after.take()  # (published already: its batch begins with this one's)
            record = state.load(entry, started, after and after.take)
        except Exception as exc:
            body = ForkingPickler.dumps(
                BatchFailed(entry.idx, entry.slot, worker_id, RemoteError.capture(exc)))
            record = encode(Status.FAILED, entry.idx, entry.slot, bytes(body))
        write_completion(result_fd, record)
        reader.note_sent(len(record))
        if after is not None:
            ahead = after.taken


class _NextEntry:
    """With worker_threads > 1: the next entry, taken while this batch loads if the main
    process has published it by then (as this batch begins, or once this thread's own rows
    are in), and its batch begun, so the extra threads go on to it instead of waiting for
    this batch's last rows."""

    __slots__ = ("_reader", "_state", "taken")

    def __init__(self, state: WorkerState, reader: OrderReader):
        self._state, self._reader = state, reader
        self.taken: tuple[Entry, Callable[..., Fetched] | None] | None = None

    def take(self) -> None:
        if self.taken is not None or not self._state.threads.overlaps():
            return
        try:
            entry = self._reader.next_entry_now()
        except Exception:  # EOFError, or indices that do not unpickle: not taken, so the
            return  # loop's own read meets them (a piped payload, gone by then, ends the
            # worker there, as an undecodable one does without threads)
        if entry is not None:  # a new slab (ATTACH) is mapped before a later batch begins
            self.taken = entry, (None if entry.kind is EntryKind.STOP or entry.kind is
                                 EntryKind.ATTACH else self._state.begin(entry))


def _arm_parent_death_signal() -> None:
    """Ask Linux to SIGKILL this worker when the thread that started it exits."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the idle loop's getppid() check still notices
