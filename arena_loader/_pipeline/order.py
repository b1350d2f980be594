"""The epoch's batch order, published to workers through one shared-memory ring.

Each worker has ``depth`` fixed-size entries. The main process writes the entry for a batch
(its ``idx``, the ``slot`` to fill, the epoch and the sample ``indices``) and then moves that
worker's ``published`` counter in the ring's header; a worker that has taken every published
entry says it is going to sleep (its ``sleeping`` flag, also in the header) and waits on its
doorbell pipe, and only then does publishing write a doorbell byte. A busy worker costs the
main process no system call per batch. No task message is pickled: a list of int indices is
stored as int64, anything else (keys that are not ints, ``batch_size=None``) as a pickle in the
entry, or, when it does not fit, on the pipe before the entry is published. Control entries
(``ATTACH``: map the sized slab; ``STOP``) travel the same way.

Position ``seq % depth`` of a worker's ring is reused only after the worker has taken entry
``seq - depth``: each worker publishes how many entries it has taken in a counter of its own
(an aligned int64 store), and the main process never writes past it.

Memory ordering: an entry is written before ``published`` moves past it, and read after the
worker has seen ``published`` move (stores are seen in order on x86; on other machines the
entry's own ``seq`` is checked and re-read). Missed wake-ups: each side stores its own flag or
counter, passes a full fence (``fence()``, an atomic read-modify-write), then reads the
other's, so either the publisher sees ``sleeping`` or the worker sees the entry. Where the
fence is weaker, the main process heals a missed wake-up before it waits (``wake_sleepers``).
"""

from __future__ import annotations

import enum
import os
import pickle
import struct
import threading
import time
import weakref
from array import array
from typing import Any

import numpy as np

from .._messages import listed
from .._readable import readable, writable
from .._slab import SlabHandle, map_shared, open_shared, size_shared
from .spin import spin_while_equal

ORDER_TAG = "order_"  # in the ring's /dev/shm name, beside the slab's
# seq (the entry's number in this worker's ring), idx, slot, epoch, kind, payload bytes
ENTRY = struct.Struct("<qqiiBxxxI")
# Per worker, int64 counters on cache lines of their own: `taken` (written by the worker),
# `sleeping` (the worker), `published` (the main process) and `sent` (the worker: bytes of
# completion records written to its pipe, so the main process reads only when some wait).
_HEADER_STRIDE = 256
_TAKEN, _SLEEPING, _PUBLISHED, _SENT = 0, 8, 16, 24  # in int64s from the worker's header
_PIPED = struct.Struct("<qI")  # after PIPED_TAG on the pipe: the entry's seq, payload bytes
DOORBELL = b"\1"
PIPED_TAG = b"\2"  # a pickled payload follows on the pipe (_PIPED, then its bytes)
_FENCE = threading.Lock()


def _new_fence() -> None:
    global _FENCE
    _FENCE = threading.Lock()  # a fork while another thread held it: the child's is free


os.register_at_fork(after_in_child=_new_fence)


def fence() -> None:
    """A full memory fence: taking a free lock is an atomic read-modify-write (``lock``-prefixed
    on x86), which no load after it passes a store before it. Never blocks: held (a finalizer
    or signal handler publishing inside a publish, or another thread), this one is skipped,
    and the wake-up it guards is healed by ``OrderRing.wake_sleepers``. (try/finally: an
    interrupt cannot leave it held.)"""
    if _FENCE.acquire(False):
        try:
            pass
        finally:
            _FENCE.release()


def _counters(mapping: Any, workers: int, which: int) -> memoryview:
    """One counter per worker, as a strided view of int64s: indexing it reads or stores one
    aligned word and gives a Python int (a numpy scalar costs twice as much per access)."""
    stride = _HEADER_STRIDE // 8
    return memoryview(mapping).cast("B")[: workers * _HEADER_STRIDE].cast("q")[which::stride]


class EntryKind(enum.IntEnum):
    INDICES = 1  # payload: int64 sample indices
    PICKLED = 2  # payload: the indices pickled (any keys)
    PIPED = 3  # the pickled indices follow the doorbell byte on the pipe (too large here)
    STREAM = 4  # iterable-style dataset: the next batch of the worker's own iterator
    ATTACH = 5  # the slab is sized: map it; `slot` carries nothing, `idx` the slot bytes
    STOP = 6  # finish and exit


_KINDS = {int(kind): kind for kind in EntryKind}  # (a dict lookup: EntryKind() costs more)


def entry_nbytes(rows: int) -> int:
    """An entry that holds ``rows`` int64 indices, rounded to a cache line."""
    return -(-(ENTRY.size + 8 * max(rows, 1)) // 64) * 64


class OrderRing:
    """The main process's side: owns the shared ring and writes entries."""

    def __init__(self, workers: int, depth: int, rows: int):
        self.workers, self.depth = workers, depth
        self.entry_nbytes = entry_nbytes(rows)
        self._header_nbytes = workers * _HEADER_STRIDE
        self.nbytes = self._header_nbytes + workers * depth * self.entry_nbytes
        self._fd = -1
        try:  # the descriptor closed on any failure, Ctrl-C included
            # Closed with the ring if close() never runs (a crew cut short by Ctrl-C).
            self._fd_closer = weakref.finalize(self, os.close, fd := open_shared(ORDER_TAG))
            self._fd_closer.atexit = False
            self._fd = fd
            size_shared(self._fd, self.nbytes, what=_WHAT)
            self._mmap = map_shared(self._fd, self.nbytes, what=_WHAT)
        except BaseException:
            if self._fd >= 0:
                self._fd_closer()
            raise
        self.mapping = np.frombuffer(self._mmap, np.uint8)  # thread workers read it directly
        self._buffer = memoryview(self.mapping)
        self._taken = _counters(self.mapping, workers, _TAKEN)
        self._sleeping = _counters(self.mapping, workers, _SLEEPING)
        # Per worker: entries published so far (the next one's seq), in the shared header
        # (workers read it). Read, never written, by others: an interrupted publish is
        # published iff this moved past its seq (one store).
        self.published = _counters(self.mapping, workers, _PUBLISHED)
        self.sent = _counters(self.mapping, workers, _SENT)  # (CompletionReader reads it)
        self._doorbells: list[int] = [-1] * workers

    def handle(self) -> SlabHandle:
        """What a worker process maps the ring with (its descriptor travels like the slab's)."""
        return SlabHandle(self._fd, self.nbytes)

    def connect(self, doorbell_fds: list[int]) -> None:
        """The write ends of the workers' doorbell pipes (non-blocking: a worker that stopped
        reading must not block the main process)."""
        for fd in doorbell_fds:
            os.set_blocking(fd, False)
        self._doorbells = list(doorbell_fds)

    def has_room(self, worker: int) -> bool:
        return self.published[worker] - self._taken[worker] < self.depth

    def publish(self, worker: int, kind: EntryKind, idx: int = 0, slot: int = 0,
                epoch: int = 0, indices: Any = None) -> bool:
        """Write one entry for ``worker`` and, if it sleeps, ring its doorbell; False when its
        ring is full or its pipe is closed (it is gone)."""
        if not self.has_room(worker):
            return False
        published = self.published
        seq = published[worker]
        offset = self._header_nbytes + (worker * self.depth + seq % self.depth) \
            * self.entry_nbytes
        piped = b""
        if indices is None and kind is not EntryKind.INDICES:  # STREAM, ATTACH, STOP
            payload: Any = b""
        elif kind is EntryKind.PICKLED:  # (a batch_sampler's arrays: Feed.send)
            payload = pickle.dumps(indices, protocol=5)
        elif type(indices) is np.ndarray:  # int64 slices of our samplers' epoch array (any
            payload, kind = indices, EntryKind.INDICES  # other array comes PICKLED: Feed.send)
        elif type(indices) is list and indices and type(indices[0]) is int:
            try:
                payload, kind = array("q", indices), EntryKind.INDICES
            except (TypeError, OverflowError):  # a later key is not an int64
                payload, kind = pickle.dumps(indices, protocol=5), EntryKind.PICKLED
        else:
            payload, kind = pickle.dumps(indices, protocol=5), EntryKind.PICKLED
        nbytes = len(payload) * payload.itemsize if kind == EntryKind.INDICES else len(payload)
        if nbytes > self.entry_nbytes - ENTRY.size:
            if kind == EntryKind.INDICES:
                payload = pickle.dumps(listed(indices), protocol=5)
            piped = PIPED_TAG + _PIPED.pack(seq, len(payload)) + payload
            kind, nbytes = EntryKind.PIPED, 0
        else:
            start = offset + ENTRY.size
            self._buffer[start: start + nbytes] = memoryview(payload).cast("B")
        ENTRY.pack_into(self._buffer, offset, seq, idx, slot, epoch, kind, nbytes)
        doorbell = self._doorbells[worker]
        if piped:  # on the pipe before the entry is published: the worker reads it then.
            # (Written and not published, e.g. Ctrl-C between: the worker drops it by its seq.)
            try:
                _write_all(doorbell, piped)
            except OSError:  # full with nothing written (not reading), or closed (gone)
                return False
        try:
            published[worker] = seq + 1  # published: one store, whatever interrupts next
            fence()
            if self._sleeping[worker]:
                os.write(doorbell, DOORBELL)
        except BlockingIOError:
            pass  # the pipe is full of doorbells: the worker wakes anyway
        except OSError:  # BrokenPipeError: the worker is gone
            return False
        return True

    def wake_sleepers(self) -> None:
        """Ring every worker that sleeps with entries waiting (a wake-up missed where the fence
        is weaker than x86's); the main process calls this before it waits."""
        published, taken, sleeping = self.published, self._taken, self._sleeping
        for worker in range(self.workers):
            if sleeping[worker] and taken[worker] < published[worker]:
                try:
                    os.write(self._doorbells[worker], DOORBELL)
                except OSError:
                    pass  # full (it wakes anyway) or closed (its exit is reported)

    def close(self) -> None:
        """Idempotent. Workers map the ring themselves; this process's mapping goes now."""
        if self._fd < 0:
            return
        self._fd = -1
        self._fd_closer()
        self._buffer.release()
        self._taken = self._sleeping = self.published = self.sent = None  # type: ignore
        self.mapping = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:
            pass  # a thread worker stuck in user code still holds a view: unmapped with it


_WHAT = "the batch-order ring"


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    try:
        while view:
            try:
                written = os.write(fd, view)
            except BlockingIOError:
                if len(view) == len(data):
                    raise  # nothing written: the caller may give up cleanly
                writable(fd, 1.0)  # a piped payload midway: finish it
                continue
            view = view[written:]
    except KeyboardInterrupt:
        if 0 < len(view) < len(data):  # half a message would put the pipe out of step
            _write_all(fd, view.tobytes())
        raise


def _drop_doorbells(bell: bytearray) -> None:
    """Drop the doorbell bytes at the head of what the pipe held (only there: a piped
    payload's own bytes are never touched)."""
    if bell[:1] == DOORBELL:
        del bell[: len(bell) - len(bell.lstrip(DOORBELL))]


class Entry:
    """One decoded entry, on the worker's side."""

    __slots__ = ("epoch", "idx", "indices", "kind", "slot")

    def __init__(self, kind: EntryKind, idx: int, slot: int, epoch: int, indices: Any):
        self.kind, self.idx, self.slot, self.epoch, self.indices = kind, idx, slot, epoch, indices


class OrderReader:
    """A worker's side: maps the ring (or shares the main process's mapping, for thread
    workers) and reads this worker's entries in order."""

    def __init__(self, worker: int, workers: int, depth: int, entry_nbytes: int,
                 doorbell_fd: int, mapping: Any, index_arrays: bool = False,
                 spin: bool = False):
        self._worker, self._depth, self._entry_nbytes = worker, depth, entry_nbytes
        self._spin = spin  # a process worker yields the CPU a moment before it sleeps
        # Indices as one int64 array (a dataset's read_into takes them so), else a list.
        self._index_arrays = index_arrays
        self._doorbell = doorbell_fd
        os.set_blocking(doorbell_fd, False)
        self._buffer = memoryview(mapping).cast("B")
        self._taken = _counters(mapping, workers, _TAKEN)
        self._sleeping = _counters(mapping, workers, _SLEEPING)
        self._published = _counters(mapping, workers, _PUBLISHED)
        self._sent = _counters(mapping, workers, _SENT)
        self._base = workers * _HEADER_STRIDE + worker * depth * entry_nbytes
        self._seq = 0
        self._bell = bytearray()  # what the pipe held: doorbells and piped payloads

    def next_entry(self, timeout_s: float) -> Entry | None:
        """The next entry, waiting up to ``timeout_s`` for it; None on timeout. EOFError when
        the main process closed the pipe."""
        seq = self._seq
        if seq >= self._published[self._worker] and not (
                self._spin and spin_while_equal(self._published, self._worker, seq)) \
                and not self._sleep(timeout_s):
            return None
        offset = self._base + (seq % self._depth) * self._entry_nbytes
        got_seq, idx, slot, epoch, kind, nbytes = ENTRY.unpack_from(self._buffer, offset)
        if got_seq != seq:
            got_seq, idx, slot, epoch, kind, nbytes = self._reread(offset, seq)
        start = offset + ENTRY.size
        if kind == EntryKind.INDICES:
            if self._index_arrays:
                indices: Any = np.frombuffer(self._buffer, np.int64, nbytes // 8, start).copy()
            else:
                ints = array("q")
                ints.frombytes(self._buffer[start: start + nbytes])
                indices = ints.tolist()
        elif kind == EntryKind.PICKLED:
            indices = pickle.loads(self._buffer[start: start + nbytes])
        elif kind == EntryKind.PIPED:
            indices = pickle.loads(self._read_piped(seq))
        else:
            indices = None
        self._seq = seq + 1
        self._taken[self._worker] = seq + 1  # the position may be written again
        return Entry(_KINDS[kind], idx, slot, epoch, indices)

    def next_entry_now(self) -> Entry | None:
        """The next entry if it is published already; None, with no wait, if not."""
        if self._seq >= self._published[self._worker]:
            return None
        return self.next_entry(0.0)

    def _sleep(self, timeout_s: float) -> bool:
        """Nothing published: say so (``sleeping``), look again past a fence, and wait on the
        doorbell. True once an entry is published; False after ``timeout_s``."""
        worker, published, seq = self._worker, self._published, self._seq
        self._sleeping[worker] = 1
        try:
            fence()
            deadline = time.monotonic() + timeout_s
            while seq >= published[worker]:
                wait_s = deadline - time.monotonic()
                if wait_s <= 0 or not readable(self._doorbell, wait_s):
                    return seq < published[worker]
                self._read_pipe()
            return True
        finally:
            self._sleeping[worker] = 0

    def _reread(self, offset: int, seq: int) -> tuple:
        """The entry's bytes were not all seen yet (a machine that reorders stores): read it
        again for a while before calling it a bug."""
        for _ in range(1000):
            time.sleep(0.0001)
            entry = ENTRY.unpack_from(self._buffer, offset)
            if entry[0] == seq:
                return entry
        raise RuntimeError(f"arena_loader worker {self._worker} expected order entry {seq} "
                           f"and found {entry[0]} (arena_loader bug: please report it)")

    def _read_pipe(self) -> None:
        """Take what the pipe holds: doorbells are dropped, piped payloads kept in order."""
        try:
            data = os.read(self._doorbell, 65536)
        except BlockingIOError:
            return
        if not data:
            raise EOFError("the main process closed the order pipe")
        bell = self._bell
        bell += data
        _drop_doorbells(bell)

    def _read_piped(self, seq: int) -> bytes:
        """The payload of PIPED entry ``seq``: on the pipe (after doorbells, maybe, and after
        payloads of entries that were never published, which are dropped) since before the
        entry was published."""
        bell, head = self._bell, 1 + _PIPED.size
        while True:
            _drop_doorbells(bell)
            if len(bell) >= head:
                got_seq, length = _PIPED.unpack_from(bell, 1)
                if bell[:1] != PIPED_TAG or got_seq > seq:
                    raise RuntimeError(f"arena_loader worker {self._worker}: the order pipe "
                                       "is out of step (arena_loader bug: please report it)")
                if len(bell) >= head + length:
                    payload = bytes(bell[head: head + length])
                    del bell[: head + length]
                    if got_seq == seq:
                        return payload
                    continue  # written for an entry that was never published
            readable(self._doorbell, 1.0)
            self._read_pipe()

    def note_sent(self, nbytes: int) -> None:
        """``nbytes`` of completion records are on the pipe (written before this)."""
        self._sent[self._worker] += nbytes

    def close(self) -> None:
        self._taken = self._sleeping = self._published = self._sent = None  # type: ignore
        self._buffer.release()
