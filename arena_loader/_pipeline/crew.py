"""The workers of one session and their channels: the order ring they read, the pipes their
completion records come back on, their exit sentinels, and one poll set over all of them.

Process and thread workers look the same from here (``WorkerGroupLike``); the session talks
to a ``Crew`` only: publish an entry, read what a worker sent, wait for any of them, stop.
"""

from __future__ import annotations

import select
import sys
from collections import deque
from typing import Any, Protocol

import numpy as np

from .._fd_socket import SegmentReceiver, send_slab
from .._fetch import BatchFiller
from .._options import LoaderOptions
from .._process import WorkerGroup, is_main_thread
from .._resume_stream import StreamResume
from .._slab import Slab
from .._threads import ThreadWorkerGroup
from .._worker import WorkerSetup
from ..errors import WorkerCrashedError
from .completions import Completion, CompletionReader
from .order import EntryKind, OrderRing

WAKER = -1  # what poll() reports for the waker's descriptor


class WorkerGroupLike(Protocol):
    """What ``_process.WorkerGroup`` and ``_threads.ThreadWorkerGroup`` both offer."""

    pids: list[int]
    sentinels: list[int]  # process exit sentinels (none for threads: their pipes close)
    task_conns: list[Any]  # doorbell pipes, main process's (write) ends
    result_conns: list[Any]  # completion pipes, main process's (read) ends
    fd_sockets: list[Any]  # one-off segments' descriptors arrive here

    closed: bool  # stopped: its pipes are closed

    def crash_error(self, worker_id: int, owed: list[tuple[int, Any]]) -> WorkerCrashedError: ...

    def exited(self) -> list[int]: ...

    def shutdown(self, graceful: bool = True) -> None: ...


class Crew:
    def __init__(self, options: LoaderOptions, filler: BatchFiller, slab: Slab,
                 slot_nbytes: int, slots: int, base_seed: int, window: int, rows: int,
                 waker_fd: int, streams: list[StreamResume] | None = None):
        """Start ``options.num_workers`` workers holding ``slab`` (sized: ``slot_nbytes``;
        reserved: 0, an ATTACH entry sizes it later) and a ring deep enough for ``window``,
        its entries ``rows`` indices long (a longer batch's travel on the order pipe);
        ``streams``: where each resumed worker's iterator starts (iterable-style datasets)."""
        self.workers = options.num_workers
        self.ring = OrderRing(self.workers, window + 2, rows)
        thread = options.worker_mode == "thread"
        # The slab the workers write (``hand_slab`` gives them a grown one).
        self.slab = slab
        self._thread = thread
        self._generation = 0
        self._handed = [0] * self.workers  # the generation each worker was sent
        setups = [
            WorkerSetup(worker_id=i, num_workers=self.workers, filler=filler,
                        slot_nbytes=slot_nbytes, slab=slab.handle(), slots=slots,
                        fd_socket=None, base_seed=base_seed,
                        worker_init_fn=options.worker_init_fn,
                        arm_parent_death_signal=is_main_thread(),
                        publish_to_torch="torch" in sys.modules,
                        order=None if thread else self.ring.handle(),
                        order_depth=self.ring.depth, order_entry_nbytes=self.ring.entry_nbytes,
                        worker_threads=options.worker_threads,
                        stream_resume=streams[i] if streams is not None else None)
            for i in range(self.workers)
        ]
        group: WorkerGroupLike | None = None
        # One try from before the workers start: any failure (or Ctrl-C) once they run, on
        # any line, must stop them (a group interrupted while starting stops its own).
        try:
            if thread:
                group = ThreadWorkerGroup(setups, slab, self.ring.mapping)
            else:
                context = options.start_context()
                if context.get_start_method() == "fork":
                    filler.warm_up()
                group = WorkerGroup(context, setups)
            self.group = group
            self.ring.connect([conn.fileno() for conn in group.task_conns])
            self.reader = CompletionReader([conn.fileno() for conn in group.result_conns],
                                           self.ring.sent)
            self._segments = [SegmentReceiver(sock) for sock in group.fd_sockets]
            self._poller = select.poll()
            self._owner: dict[int, tuple[int, bool]] = {}  # fd -> (worker, is its sentinel)
            for worker, fd in enumerate(self.reader.fds):
                self._watch(fd, worker, False)
            for worker, fd in enumerate(group.sentinels):
                self._watch(fd, worker, True)
            self._watch(waker_fd, WAKER, False)
            # Per worker: its result pipe, every exit sentinel and the waker. next() in order
            # waits on the worker that owes its batch only: another's record would wake it
            # for nothing (read in its turn), while any exit and close() still do.
            self._owed_pollers = []
            for fd in self.reader.fds:
                poller = select.poll()
                for watched in (fd, *group.sentinels, waker_fd):
                    poller.register(watched, select.POLLIN)
                self._owed_pollers.append(poller)
            self._spin = not thread  # (spin.py: not while a thread worker needs the GIL)
            self._open = True
        except BaseException:
            if group is not None:
                group.shutdown(graceful=False)
            self.ring.close()
            raise

    def _watch(self, fd: int, worker: int, sentinel: bool) -> None:
        self._poller.register(fd, select.POLLIN)
        self._owner[fd] = (worker, sentinel)

    @property
    def pids(self) -> list[int]:
        return self.group.pids

    @property
    def stopped(self) -> bool:
        return self.group.closed

    @property
    def stuck(self) -> list[int]:
        """Thread workers left running in user code by a shutdown."""
        return list(getattr(self.group, "stuck_ids", ()))

    # -- the order ring -------------------------------------------------------------------

    def publish(self, worker: int, kind: EntryKind, idx: int = 0, slot: int = 0,
                epoch: int = 0, indices: Any = None) -> bool:
        return self._open and self.ring.publish(worker, kind, idx, slot, epoch, indices)

    def hand_slab(self, slab: Slab, slot_nbytes: int) -> None:
        """The workers go on with ``slab`` (grown: a batch outgrew its slot), as torch's
        persistent workers go on: its descriptor on each process worker's socket (thread
        workers: set on their group), tagged with a new generation, then an ATTACH entry
        naming it. Called again after an interrupt, it tells only the workers not yet told
        (a descriptor sent twice is closed by the worker)."""
        generation = self._generation + 1
        if self._thread:
            self.group.slab = slab
        for worker, sock in enumerate(self.group.fd_sockets):
            if self._handed[worker] == generation:
                continue
            try:
                if not self._thread:
                    send_slab(sock, generation, slab)
            except OSError:  # (BrokenPipeError: it died since the last epoch)
                continue  # dead: its exit is the news, found by the next wait
            if self.publish(worker, EntryKind.ATTACH, idx=slot_nbytes, slot=generation):
                self._handed[worker] = generation
        self._generation, self.slab = generation, slab

    def wake_sleepers(self) -> None:
        """Before the main process waits: no worker asleep with entries waiting (a wake-up
        the fence missed, on a machine with weaker ordering than x86's)."""
        if self._open and not self.group.closed:
            self.ring.wake_sleepers()

    # -- what workers send -----------------------------------------------------------------

    @property
    def arrived(self) -> deque[Completion]:
        """Records parsed and not yet filed (the session pops each once filed)."""
        return self.reader.arrived

    def fill(self, worker: int, speculative: bool = False) -> bool | None:
        """Parse what ``worker`` has sent into ``arrived`` (see CompletionReader.fill)."""
        # (A stopped group has closed the pipes: their numbers may name other files now.)
        return self.reader.fill(worker, speculative) \
            if self._open and not self.group.closed else False

    def spin_for(self, worker: int) -> bool:
        """Process workers: yield the CPU a moment while ``worker`` has sent nothing unread
        (spin.py); True once a record of it waits to be read."""
        return self._spin and self._open and not self.group.closed \
            and self.reader.spin_for(worker)

    def poll(self, timeout_s: float, owed: int | None = None) -> list[tuple[int, bool]]:
        """Wait up to ``timeout_s`` for a record, a worker's exit or the waker: the
        (worker or WAKER, is a sentinel) of each that is ready; ``owed``: records of that
        worker only. Called without the session's lock; a closed crew's descriptors read as
        ready at once."""
        if not self._open or self.group.closed:
            return []
        kept = self.reader.unreported(owed)  # (what an interrupt kept: no poll shows it)
        if kept:
            return [(worker, False) for worker in kept]
        poller = self._poller if owed is None else self._owed_pollers[owed]
        events = poller.poll(max(0, int(timeout_s * 1000)))
        owner = self._owner
        ready = [owner[fd] for fd, _ in events if fd in owner]
        if not ready:  # nothing for a while: an exit no sentinel showed (WorkerGroup.exited)
            ready = [(worker, True) for worker in self.group.exited()]
        return ready

    def receive_segment(self, worker: int, idx: int, nbytes: int) -> np.ndarray:
        """Map the one-off segment ``worker`` sent for batch ``idx`` (``forget_segment`` once
        the batch holds the mapping)."""
        return self._segments[worker].receive(idx, nbytes)

    def forget_segment(self, worker: int, idx: int) -> None:
        self._segments[worker].forget(idx)

    def forget_segments(self) -> None:
        """A new epoch: descriptors still held are of the last one's batches, never filed
        (their idx would be taken for this epoch's batches of the same idx): close them."""
        for segments in self._segments:
            segments.close()

    def crash_error(self, worker: int, owed: list[tuple[int, Any]]) -> WorkerCrashedError:
        return self.group.crash_error(worker, owed)

    @property
    def stats(self) -> dict[str, int]:
        return {"results_received": self.reader.records, "result_bytes": self.reader.nbytes}

    # -- stopping --------------------------------------------------------------------------

    def ask_to_stop(self) -> None:
        """A STOP entry to every worker whose ring has room (the others are terminated)."""
        if self._open and not self.group.closed:
            for worker in range(self.workers):
                self.ring.publish(worker, EntryKind.STOP)

    def shutdown(self, graceful: bool) -> None:
        """Join (``graceful``: they were asked to stop), terminate, kill; idempotent."""
        self.group.shutdown(graceful)

    def close_channels(self) -> None:
        """Idempotent; after ``shutdown``. Records not yet filed are dropped (their slots are
        reclaimed with the rest of the in-flight ones)."""
        if not self._open:
            return
        self._open = False
        self.reader.arrived.clear()
        self.reader.stop_counting()  # (its view of the ring's counters would keep it mapped)
        self.ring.close()
        for segments in self._segments:
            segments.close()
