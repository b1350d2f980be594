"""``get_worker_info()``: which worker this code runs in (torch's fields, plus the thread's
index among the worker's ``worker_threads``), or None.

Its own module so that the fetch code, the worker loop and torch's compatibility layer can
all ask without importing one another."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class WorkerInfo:
    """What ``get_worker_info()`` returns inside a worker: torch's fields (``id``,
    ``num_workers``, ``seed``, ``dataset``), then which of the worker's ``worker_threads``
    threads asks (``thread_id`` in ``range(num_threads)``; 0 is the thread that runs the
    worker loop), that thread's own seed and a numpy ``Generator`` seeded with it (``rng``).

    ``thread_seed`` depends only on the base seed, ``id`` and ``thread_id``, and lane ``t``
    (thread ``t``, or whichever thread runs its share when fewer threads do) loads rows
    ``t, t + num_threads, ...`` of each of its worker's batches in order, so draws from
    ``rng`` (or from ``random.Random(thread_seed)``) are the same in every run.
    The process-wide RNGs (``random``, numpy's global one, torch's) are shared by the threads.
    """

    id: int
    num_workers: int
    seed: int
    dataset: Any
    thread_id: int = 0
    num_threads: int = 1
    thread_seed: int = 0
    rng: np.random.Generator | None = field(default=None, compare=False, repr=False)


def thread_seed(base_seed: int, worker_id: int, thread_id: int) -> int:
    """The seed of thread ``thread_id`` of worker ``worker_id``: a 64-bit value drawn from
    ``SeedSequence([worker_id, thread_id, base_seed])``."""
    sequence = np.random.SeedSequence([worker_id, thread_id, base_seed % 2**63])
    return int(sequence.generate_state(1, np.uint64)[0])


def thread_info(base_seed: int, worker_id: int, num_workers: int, seed: int, dataset: Any,
                thread_id: int, num_threads: int) -> WorkerInfo:
    """The ``WorkerInfo`` of one thread of a worker, with its own seeded ``rng``."""
    own = thread_seed(base_seed, worker_id, thread_id)
    return WorkerInfo(worker_id, num_workers, seed, dataset, thread_id, num_threads, own,
                      np.random.default_rng(own))


_process_worker: WorkerInfo | None = None
# Thread workers (worker_mode="thread") and a worker's extra threads (worker_threads > 1)
# share the process: each sets its own info here.
_thread_worker = threading.local()


def get_worker_info() -> WorkerInfo | None:
    """This worker's ``WorkerInfo`` (process or thread worker, any of its threads), or
    ``None`` elsewhere."""
    return getattr(_thread_worker, "info", None) or _process_worker


def set_process_worker_info(info: WorkerInfo | None) -> None:
    """Set ``get_worker_info()`` for the whole process (a worker process, at its start)."""
    global _process_worker
    _process_worker = info


def thread_worker_info() -> WorkerInfo | None:
    """The calling thread's own info (None where it has none: it answers with the process's)."""
    return getattr(_thread_worker, "info", None)


def set_thread_worker_info(info: WorkerInfo | None) -> None:
    """Set ``get_worker_info()`` for the calling thread only."""
    _thread_worker.info = info
