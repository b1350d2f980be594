"""The floor: an (idx, slot)-only loader, the least a multi-process loader can do per batch.

A measuring instrument, not a design to copy. What it leaves out, on purpose: every
guarantee ArenaLoader keeps. Map-style datasets whose samples are one array of one shape and
dtype only (no dicts, no collate_fn, no variable shapes); fork only; no sampler beyond the
sequential order the bench uses; no worker errors (a failing worker exits with status 1 and
the consumer reports that exit, nothing more); no ``worker_init_fn``, no ``get_worker_info``,
no leases held across epochs (the consumer must drop each batch before asking for the one a
slot later). What is left is the per-batch path alone:

- worker ``w`` computes its own batches (``idx = w, w + N, ...``): no per-batch task message;
- each worker owns ``depth`` slots of one anonymous shared mapping; a slot comes back as an
  8-byte credit on the worker's credit pipe, read in bulk, blocking only with no credit left;
- a worker writes the batch with one ``np.stack(out=...)`` and sends a 16-byte (idx, slot)
  record on its own pipe; batch ``k`` is the next record of worker ``k % N``, so the consumer
  needs no reordering, no thread and no lock: one ``os.read`` per batch;
- the consumer hands out a view whose base is a lease; ``weakref.finalize`` queues the
  credit, flushed in one write per worker at the next batch.

ArenaLoader / floor is the price of the guarantees. ``../shared/reference/floor.py`` (outside
this repo) is the reference this one follows.
"""

from __future__ import annotations

import mmap
import os
import select
import signal
import struct
import time
import weakref
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np

RECORD = struct.Struct("<qq")  # idx, slot
CREDIT = struct.Struct("<q")   # a slot index within the worker's ring; on the epoch pipe: n
WAIT_S = 60.0


class _Lease:
    """The base of a batch view: its death returns the slot."""

    __slots__ = ("__weakref__", "_bytes")

    def __init__(self, raw: np.ndarray):
        self._bytes = raw

    @property
    def __array_interface__(self) -> dict:
        return self._bytes.__array_interface__


def _read(fd: int, nbytes: int, pid: int) -> bytes:
    ready, _, _ = select.select([fd], [], [], WAIT_S)
    data = os.read(fd, nbytes) if ready else b""
    if not data:
        done, status = os.waitpid(pid, os.WNOHANG)
        state = (f"exited with status {os.waitstatus_to_exitcode(status)}" if done
                 else f"sent nothing in {WAIT_S} s")
        raise RuntimeError(f"floor worker pid {pid} {state}")
    return data


def _work(w: int, workers: int, dataset: Any, batch_size: int, slots: list[np.ndarray],
          credit_r: int, result_w: int, epoch_r: int) -> None:
    free = deque(range(len(slots)))
    n = len(dataset)
    while True:
        data = os.read(epoch_r, CREDIT.size)  # "an epoch of n batches"; -1 or EOF: stop
        if not data or CREDIT.unpack(data)[0] < 0:
            return
        (batches,) = CREDIT.unpack(data)
        for idx in range(w, batches, workers):
            while not free:
                credits = os.read(credit_r, 4096)
                if not credits:  # the consumer closed: stop mid-epoch
                    return
                free.extend(j for (j,) in CREDIT.iter_unpack(credits))
            j = free.popleft()
            lo, hi = idx * batch_size, min((idx + 1) * batch_size, n)
            np.stack([dataset[i] for i in range(lo, hi)], out=slots[j][: hi - lo])
            os.write(result_w, RECORD.pack(idx, j))


class FloorLoader:
    """``workers`` forked processes, ``depth`` slots each, batches in sequential order."""

    def __init__(self, dataset: Any, batch_size: int, workers: int = 2, depth: int = 2):
        sample = np.asarray(dataset[0])
        self.dataset, self.batch_size, self.workers, self.depth = (
            dataset, batch_size, workers, depth)
        self.shape, self.dtype = sample.shape, sample.dtype
        self.slot_nbytes = -(-batch_size * sample.nbytes // 64) * 64  # 64-byte aligned slots
        self._map = mmap.mmap(-1, workers * depth * self.slot_nbytes)  # shared, anonymous
        slab = np.frombuffer(self._map, np.uint8)
        self._slots = [slab[s * self.slot_nbytes: s * self.slot_nbytes
                            + batch_size * sample.nbytes].view(self.dtype)
                       .reshape(batch_size, *self.shape) for s in range(workers * depth)]
        self.batches = -(-len(dataset) // batch_size)
        self._pids: list[int] = []
        self._credit_w: list[int] = []
        self._result_r: list[int] = []
        self._epoch_w: list[int] = []
        self._released: deque[int] = deque()
        self._closed = False
        try:
            for w in range(workers):
                self._start(w)
        except BaseException:
            self.close()
            raise

    def _start(self, w: int) -> None:
        (cr, cw), (rr, rw), (er, ew) = os.pipe(), os.pipe(), os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker: runs _work and leaves with os._exit, never returns
            code = 0
            try:
                for fd in (cw, rr, ew, *self._credit_w, *self._result_r, *self._epoch_w):
                    os.close(fd)
                own = self._slots[w * self.depth:(w + 1) * self.depth]
                _work(w, self.workers, self.dataset, self.batch_size, own, cr, rw, er)
            except BaseException:
                code = 1
            os._exit(code)
        for fd in (cr, rw, er):
            os.close(fd)
        self._pids.append(pid)
        self._credit_w.append(cw)
        self._result_r.append(rr)
        self._epoch_w.append(ew)

    def _flush_credits(self) -> None:
        owed: dict[int, list[int]] = {}
        while self._released:
            slot = self._released.popleft()
            owed.setdefault(slot // self.depth, []).append(slot % self.depth)
        for w, slots in owed.items():
            os.write(self._credit_w[w], b"".join(CREDIT.pack(j) for j in slots))

    def __iter__(self) -> Iterator[np.ndarray]:
        for ew in self._epoch_w:
            os.write(ew, CREDIT.pack(self.batches))
        for k in range(self.batches):
            self._flush_credits()
            w = k % self.workers
            idx, j = RECORD.unpack(_read(self._result_r[w], RECORD.size, self._pids[w]))
            assert idx == k, (idx, k)  # each worker's pipe carries its batches in order
            rows = min(self.batch_size, len(self.dataset) - k * self.batch_size)
            slot = w * self.depth + j
            lease = _Lease(self._slots[slot][:rows])
            weakref.finalize(lease, self._released.append, slot).atexit = False
            view = np.asarray(lease)
            del lease
            yield view
            del view
        self._flush_credits()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # End of file on its credit and epoch pipes stops a worker wherever it waits.
        for fd in (*self._credit_w, *self._epoch_w):
            os.close(fd)
        for pid in self._pids:
            for _ in range(int(WAIT_S / 0.01)):
                if os.waitpid(pid, os.WNOHANG)[0]:
                    break
                time.sleep(0.01)
            else:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        for fd in self._result_r:
            os.close(fd)
        self._pids, self._slots = [], []
