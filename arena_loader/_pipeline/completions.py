"""Completion records: what a worker sends back for each order entry, on its own pipe.

A record is a fixed-size header (``COMPLETION``: body length, status, idx, slot) and a body:
the batch's plan record (``_layout.PlanEncoder``) for a loaded batch, the pickled failure for
a failed one, nothing otherwise. Arrays never travel: the batch is already in its slot or
segment. The main process reads each worker's pipe itself (``CompletionReader``), many
records per ``read`` when they are there, and decodes a plan only when its bytes differ from
that worker's previous one (batches of one structure share a ``Plan``).
"""

from __future__ import annotations

import enum
import os
import struct
from collections import deque
from typing import Any

from .._layout import PlanDecoder
from .spin import nap_while_equal, spin_while_equal

COMPLETION = struct.Struct("<IBxxxqi")  # body bytes, status, idx, slot
READ_NBYTES = 1 << 16


class Status(enum.IntEnum):
    LOADED = 1  # in the entry's slot
    SEGMENT = 2  # in a one-off segment whose descriptor follows on the worker's fd socket
    ENDED = 3  # an iterable-style dataset's iterator ended: no batch
    FAILED = 4  # body: a pickled BatchFailed
    WORKER_FAILED = 5  # body: a pickled WorkerFailed (the worker could not start or attach)
    # body: the worker's replica state after batch idx, sent just before its record (only
    # for iterable-style datasets with state_dict; docs/design.md, "Resuming")
    STATE = 6


# The statuses as plain ints, for the per-batch path (an IntEnum call costs a microsecond);
# a Completion's ``status`` is one of these.
LOADED, SEGMENT, ENDED, FAILED, WORKER_FAILED, STATE = (int(s) for s in Status)


class Completion:
    """One decoded record: ``plan`` for loaded batches, ``body`` (bytes) otherwise. Filed,
    it also carries the batch's ``indices`` and, for a SEGMENT batch, its ``storage``."""

    __slots__ = ("body", "idx", "indices", "plan", "slot", "state", "status", "storage",
                 "worker")

    def __init__(self, worker: int, status: int, idx: int, slot: int, body: bytes,
                 plan: Any):
        self.worker, self.status, self.idx, self.slot = worker, status, idx, slot
        self.body, self.plan = body, plan
        self.indices: Any = None
        self.storage: Any = None  # a SEGMENT batch's bytes, once received
        self.state: bytes | None = None  # the worker's replica state after it (STATE)


def encode(status: Status, idx: int, slot: int, body: bytes = b"") -> bytes:
    return COMPLETION.pack(len(body), status, idx, slot) + body


def write_completion(fd: int, record: bytes) -> None:
    """Write a whole record to a worker's (blocking) result pipe."""
    view = memoryview(record)
    while view:
        view = view[os.write(fd, view):]


class CompletionReader:
    """The main process's side: one buffer and one plan decoder per worker; parsed records
    wait in ``arrived`` until the session has filed them (it pops each only once filed, and
    filing is idempotent, so an interrupt anywhere loses no record: see ``fill``)."""

    def __init__(self, fds: list[int], sent: Any = None):
        self.fds = list(fds)
        # Bytes each worker has written (its shared counter, moved after the write) and bytes
        # read here: equal, a speculative read would find nothing (and costs a system call).
        self._sent = sent
        self._received = [0] * len(fds)
        self._slow = False  # the last wait outlasted the spin (spin_for)
        for fd in self.fds:
            os.set_blocking(fd, False)
        self.arrived: deque[Completion] = deque()
        self.records = 0  # parsed so far, and their bytes (tests check no array travels)
        self.nbytes = 0
        self._buffers = [bytearray() for _ in fds]
        # Per worker, the bytes of a read that the buffer has not taken yet (see ``fill``), and
        # os.read's arguments, as map() takes them.
        self._reads: list[list[bytes]] = [[] for _ in fds]
        self._read_args = [((fd,), (READ_NBYTES,)) for fd in self.fds]
        self._decoders = [PlanDecoder() for _ in fds]
        self._last_plan: list[tuple[bytes, Any]] = [(b"", None)] * len(fds)

    def fill(self, worker: int, speculative: bool = False) -> bool | None:
        """Parse what ``worker``'s pipe holds into ``arrived``: True if it held anything,
        False if nothing (yet), None at EOF (the worker is gone; all it sent is parsed).
        ``speculative``: not after a poll said so; skipped when the worker's counter says
        nothing is waiting (a record the counter does not show yet is found by the poll).

        A record is appended before the buffer drops its bytes: interrupted in between, it is
        parsed again, and the session files a duplicate as a no-op. The read's bytes are kept
        by ``list.extend``, which calls ``os.read`` from C: CPython handles a signal as a call
        into C returns, and ``buffer += os.read(...)`` lost the bytes to a Ctrl-C handled as
        the read returned (their records never filed: ``next()`` waited for good)."""
        buffer = self._buffers[worker]
        sent = self._sent
        got: bool | None = False
        if not speculative or sent is None or sent[worker] != self._received[worker]:
            try:
                read = self._reads[worker]
                if not read:  # (else the bytes an interrupt left out of the buffer)
                    read.extend(map(os.read, *self._read_args[worker]))
                data = read[0]
                buffer += data; read.clear()  # noqa: E702 (one line: taken, then forgotten)
                # (Interrupted before this, it lags: reads are then never skipped, only wasted.)
                self._received[worker] += len(data)
                got = True if data else None
            except BlockingIOError:  # all it wrote is read: resynchronise a count that lags
                if sent is not None:
                    self._received[worker] = sent[worker]
        if buffer:  # (also what an interrupt left unparsed, when the read was skipped)
            self._parse(worker)
        return got

    def unreported(self, owed: int | None = None) -> list[int]:
        """Workers (``owed`` only, if given) with records here that an interrupt kept from
        being filed, which no poll would report (their pipe may be empty now): a read kept
        out of the buffer, a whole record left unparsed in it, records parsed and not filed.
        ``fill`` (``Intake.receive``) takes them in."""
        if not (self.arrived or any(self._reads) or any(self._buffers)):  # (common: in C)
            return []
        header = COMPLETION.size
        workers = {completion.worker for completion in self.arrived}
        for worker, (read, buffer) in enumerate(zip(self._reads, self._buffers)):
            if read or (len(buffer) >= header and
                        len(buffer) >= header + COMPLETION.unpack_from(buffer)[0]):
                workers.add(worker)
        return sorted(w for w in workers if owed is None or w == owed)

    def spin_for(self, worker: int) -> bool:
        """Yield the CPU a moment while ``worker``'s counter shows nothing unread, and nap
        too when the last wait also outlasted the spin (spin.py); True once it shows more."""
        sent = self._sent
        if sent is None:
            return False
        received = self._received[worker]
        if spin_while_equal(sent, worker, received):
            self._slow = False
            return True
        # Naps only once waits outlast the spin: a wait that does so now and then (tiny
        # batches on a busy machine) sleeps and is woken at once, as a nap could not be.
        slow, self._slow = self._slow, True
        return slow and nap_while_equal(sent, worker, received)

    def drop_filed(self) -> None:
        """Nothing is in flight (an epoch was drained): whatever is queued or still in a
        buffer is a record filed already, kept by an interrupt between its parse and its
        removal. Dropped: filed in the next epoch, it would answer no batch of it."""
        self.arrived.clear()
        for buffer in self._buffers:
            buffer.clear()
        for read in self._reads:
            read.clear()

    def stop_counting(self) -> None:
        """The ring holding the workers' counters is closing: read without them."""
        self._sent = None

    def _parse(self, worker: int) -> None:
        buffer, pos, count = self._buffers[worker], 0, 0
        header, unpack, append = COMPLETION.size, COMPLETION.unpack_from, self.arrived.append
        while len(buffer) - pos >= header:
            body_len, status, idx, slot = unpack(buffer, pos)
            end = pos + header + body_len
            if end > len(buffer):
                break
            body = bytes(buffer[pos + header: end])
            plan = self._plan(worker, body) if status <= SEGMENT else None
            append(Completion(worker, status, idx, slot, body, plan))
            pos, count = end, count + 1
        self.records, self.nbytes = self.records + count, self.nbytes + pos
        del buffer[:pos]

    def _plan(self, worker: int, body: bytes) -> Any:
        last_body, last_plan = self._last_plan[worker]
        if body == last_body:
            return last_plan
        plan = self._decoders[worker].decode(body).plan
        self._last_plan[worker] = (body, plan)
        return plan
