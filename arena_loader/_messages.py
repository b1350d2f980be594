"""Messages between the main process and workers: small frozen dataclasses, never arrays."""

from __future__ import annotations

import pickle
import traceback
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Task:
    """Main -> worker: fill ``slot`` with the samples ``indices`` of batch ``idx``."""

    idx: int
    slot: int
    indices: Any  # a list of sample indices, or one index when batch_size=None


@dataclass(frozen=True)
class Stop:
    """Main -> worker: finish and exit."""


@dataclass(frozen=True)
class BatchReady:
    """Worker -> main: ``slot`` now holds batch ``idx``.

    ``rows`` is the batch's true row count; ``lengths`` the leading size of each batched field
    when a collate_fn produced the batch (None: all equal to ``rows``); ``objects`` the values
    of non-numeric leaves, one list (or collated object) per leaf.
    """

    idx: int
    slot: int
    rows: int
    lengths: tuple[int, ...] | None
    objects: list | None


@dataclass(frozen=True)
class RemoteError:
    """An exception raised in a worker, carried with its type and formatted traceback."""

    type_name: str
    message: str
    traceback: str
    pickled: bytes | None  # the exception itself, when it pickles

    @classmethod
    def capture(cls, exc: BaseException) -> RemoteError:
        try:
            pickled = pickle.dumps(exc)
            pickle.loads(pickled)  # only keep it if it also rebuilds
        except Exception:
            pickled = None
        return cls(
            type_name=f"{type(exc).__module__}.{type(exc).__qualname__}",
            message=str(exc),
            traceback="".join(traceback.format_exception(exc)),
            pickled=pickled,
        )

    def original(self) -> BaseException | None:
        if self.pickled is None:
            return None
        try:
            return pickle.loads(self.pickled)
        except Exception:
            return None


@dataclass(frozen=True)
class BatchFailed:
    """Worker -> main: loading batch ``idx`` raised; ``slot`` may be reused."""

    idx: int
    slot: int
    worker_id: int
    error: RemoteError


@dataclass(frozen=True)
class WorkerFailed:
    """Worker -> main: the worker failed before taking tasks (``worker_init_fn``, attach)."""

    worker_id: int
    error: RemoteError
