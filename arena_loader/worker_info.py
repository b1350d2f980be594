"""``get_worker_info()``: which worker this code runs in (torch's fields), or None.

Its own module so that the fetch code, the worker loop and torch's compatibility layer can
all ask without importing one another."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class WorkerInfo:
    """What ``get_worker_info()`` returns inside a worker (torch's fields)."""

    id: int
    num_workers: int
    seed: int
    dataset: Any


_process_worker: WorkerInfo | None = None
# Thread workers (worker_mode="thread") share the process: each sets its own info here.
_thread_worker = threading.local()


def get_worker_info() -> WorkerInfo | None:
    """This worker's ``WorkerInfo`` (process or thread worker), or ``None`` elsewhere."""
    return getattr(_thread_worker, "info", None) or _process_worker


def set_process_worker_info(info: WorkerInfo | None) -> None:
    """Set ``get_worker_info()`` for the whole process (a worker process, at its start)."""
    global _process_worker
    _process_worker = info


def set_thread_worker_info(info: WorkerInfo | None) -> None:
    """Set ``get_worker_info()`` for the calling thread only."""
    _thread_worker.info = info
