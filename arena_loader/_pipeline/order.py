"""The epoch's batch order, published to workers through one shared-memory ring.

Each worker has ``depth`` fixed-size entries. The main process writes the entry for a batch
(its ``idx``, the ``slot`` to fill, the epoch and the sample ``indices``) and then one
doorbell byte on that worker's pipe; the worker reads doorbells in bulk and entries in order.
No task message is pickled: a list of int indices is stored as int64, anything else (keys
that are not ints, ``batch_size=None``) as a pickle in the entry, or, when it does not fit,
after the doorbell byte on the pipe. Control entries (``ATTACH``: map the sized slab;
``STOP``) travel the same way, so a worker waits on one descriptor only.

Position ``seq % depth`` of a worker's ring is reused only after the worker has taken entry
``seq - depth``: each worker publishes how many entries it has taken in a counter of its own
in the ring's header (an aligned int64 store), and the main process never writes past it.
Memory ordering: the entry is written before the doorbell ``write`` and read after the
doorbell ``read``; both are system calls, so each side sees the other's bytes complete.
"""

from __future__ import annotations

import enum
import os
import pickle
import select
import struct
import weakref
from array import array
from typing import Any

import numpy as np

from .._messages import listed
from .._slab import SlabHandle, map_shared, open_shared, size_shared

ORDER_TAG = "order_"  # in the ring's /dev/shm name, beside the slab's
# seq (the entry's number in this worker's ring), idx, slot, epoch, kind, payload bytes
ENTRY = struct.Struct("<qqiiBxxxI")
_HEADER_STRIDE = 64  # each worker's `taken` counter on a cache line of its own
_PIPE_LENGTH = struct.Struct("<I")
DOORBELL = b"\1"


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
        self._taken = np.frombuffer(self.mapping, np.int64, workers * 8)[::8]
        # Per worker: entries published so far (the next one's seq). Read, never written,
        # by others: an interrupted publish is published iff this moved past its seq.
        self.published = [0] * workers
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
        return self.published[worker] - int(self._taken[worker]) < self.depth

    def publish(self, worker: int, kind: EntryKind, idx: int = 0, slot: int = 0,
                epoch: int = 0, indices: Any = None) -> bool:
        """Write one entry for ``worker`` and ring its doorbell; False when its ring is full
        or its pipe is (it is not reading: stopped or stuck)."""
        if not self.has_room(worker):
            return False
        seq = self.published[worker]
        offset = self._header_nbytes + (worker * self.depth + seq % self.depth) \
            * self.entry_nbytes
        piped = b""
        if indices is None and kind is not EntryKind.INDICES:  # STREAM, ATTACH, STOP
            payload: Any = b""
        elif type(indices) is np.ndarray:  # int64 slices of the sampler's epoch array
            payload, kind = indices, EntryKind.INDICES
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
            piped, kind, nbytes = _PIPE_LENGTH.pack(len(payload)) + payload, EntryKind.PIPED, 0
        else:
            start = offset + ENTRY.size
            self._buffer[start: start + nbytes] = memoryview(payload).cast("B")
        ENTRY.pack_into(self._buffer, offset, seq, idx, slot, epoch, kind, nbytes)
        doorbell = self._doorbells[worker]
        try:
            if piped:
                _write_all(doorbell, DOORBELL + piped)
                self.published[worker] = seq + 1
            else:
                # One statement: once the byte is written the entry counts as published,
                # whatever interrupts next (the caller reads ``published`` to know).
                self.published[worker] = seq + os.write(doorbell, DOORBELL)
        except (BlockingIOError, BrokenPipeError, OSError):
            return False
        return True

    def close(self) -> None:
        """Idempotent. Workers map the ring themselves; this process's mapping goes now."""
        if self._fd < 0:
            return
        self._fd = -1
        self._fd_closer()
        self._buffer.release()
        self._taken = self.mapping = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:
            pass  # a thread worker stuck in user code still holds a view: unmapped with it


_WHAT = "the batch-order ring"


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except BlockingIOError:
            if len(view) == len(data):
                raise  # nothing written: the caller may give up cleanly
            select.select([], [fd], [], 1.0)  # a piped payload midway: finish it
            continue
        view = view[written:]


class Entry:
    """One decoded entry, on the worker's side."""

    __slots__ = ("epoch", "idx", "indices", "kind", "slot")

    def __init__(self, kind: EntryKind, idx: int, slot: int, epoch: int, indices: Any):
        self.kind, self.idx, self.slot, self.epoch, self.indices = kind, idx, slot, epoch, indices


class OrderReader:
    """A worker's side: maps the ring (or shares the main process's mapping, for thread
    workers) and reads this worker's entries in order."""

    def __init__(self, worker: int, workers: int, depth: int, entry_nbytes: int,
                 doorbell_fd: int, mapping: Any):
        self._worker, self._depth, self._entry_nbytes = worker, depth, entry_nbytes
        self._doorbell = doorbell_fd
        os.set_blocking(doorbell_fd, False)
        self._buffer = memoryview(mapping).cast("B")
        self._taken = np.frombuffer(mapping, np.int64, workers * 8)[::8]
        self._base = workers * _HEADER_STRIDE + worker * depth * entry_nbytes
        self._seq = 0
        self._bell = bytearray()  # doorbell bytes (and piped payloads) read ahead

    def next_entry(self, timeout_s: float) -> Entry | None:
        """The next entry, waiting up to ``timeout_s`` for its doorbell; None on timeout.
        EOFError when the main process closed the pipe."""
        if not self._bell and not self._fill(timeout_s):
            return None
        del self._bell[:1]
        seq = self._seq
        offset = self._base + (seq % self._depth) * self._entry_nbytes
        got_seq, idx, slot, epoch, kind, nbytes = ENTRY.unpack_from(self._buffer, offset)
        if got_seq != seq:
            raise RuntimeError(f"arena_loader worker {self._worker} expected order entry {seq} "
                               f"and found {got_seq} (arena_loader bug: please report it)")
        start = offset + ENTRY.size
        if kind == EntryKind.INDICES:
            ints = array("q")
            ints.frombytes(self._buffer[start: start + nbytes])
            indices: Any = ints.tolist()
        elif kind == EntryKind.PICKLED:
            indices = pickle.loads(self._buffer[start: start + nbytes])
        elif kind == EntryKind.PIPED:
            indices = pickle.loads(self._read_piped())
        else:
            indices = None
        self._seq = seq + 1
        self._taken[self._worker] = seq + 1  # the position may be written again
        return Entry(_KINDS[kind], idx, slot, epoch, indices)

    def _fill(self, timeout_s: float) -> bool:
        try:
            data = os.read(self._doorbell, 65536)
        except BlockingIOError:
            if not select.select([self._doorbell], [], [], timeout_s)[0]:
                return False
            data = os.read(self._doorbell, 65536)
        if not data:
            raise EOFError("the main process closed the order pipe")
        self._bell += data
        return True

    def _read_piped(self) -> bytes:
        while len(self._bell) < _PIPE_LENGTH.size:
            self._fill(None)  # type: ignore[arg-type]
        (length,) = _PIPE_LENGTH.unpack_from(self._bell)
        while len(self._bell) < _PIPE_LENGTH.size + length:
            self._fill(None)  # type: ignore[arg-type]
        payload = bytes(self._bell[_PIPE_LENGTH.size: _PIPE_LENGTH.size + length])
        del self._bell[: _PIPE_LENGTH.size + length]
        return payload

    def close(self) -> None:
        self._taken = None  # type: ignore[assignment]
        self._buffer.release()
