"""Worker errors on their way to the main process: small frozen dataclasses, never arrays.

The per-batch path has no message of this kind: the batch order is an entry of the order ring
(``_pipeline.order``) and a loaded batch a completion record (``_pipeline.completions``)."""

from __future__ import annotations

import pickle
import sys
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np

# An entry's slot when the batch has no slot (the slab is not sized yet, or the consumer holds
# every slot): the worker writes it into a one-off segment.
NO_SLOT = -1


@dataclass(frozen=True)
class RemoteError:
    """An exception raised in a worker, carried with its type and formatted traceback."""

    type_name: str
    traceback: str
    pickled: bytes | None  # the exception itself, when it pickles
    # Its class alone (by reference), for one whose instance does not pickle (an attribute
    # that is a lock, a socket): torch re-raises that class, built from the message.
    pickled_type: bytes | None = None

    @classmethod
    def capture(cls, exc: BaseException) -> RemoteError:
        pickled = pickled_type = None
        try:
            pickled = pickle.dumps(exc)
            pickle.loads(pickled)  # only keep it if it also rebuilds
        except Exception:
            pickled = None  # (dumped, it may not load)
            try:
                pickled_type = pickle.dumps(type(exc))
            except Exception:
                pickled_type = None  # a class defined in a function: RuntimeError
        return cls(
            type_name=f"{type(exc).__module__}.{type(exc).__qualname__}",
            traceback=formatted(exc),
            pickled=pickled,
            pickled_type=pickled_type,
        )

    def original(self) -> BaseException | None:
        if self.pickled is None:
            return None
        try:
            return pickle.loads(self.pickled)
        except Exception:
            return None

    def carried_type(self) -> type[BaseException]:
        """The class carried alone (the instance did not pickle), else RuntimeError."""
        try:
            loaded = pickle.loads(self.pickled_type) if self.pickled_type else None
        except Exception:
            loaded = None
        return loaded if isinstance(loaded, type) and issubclass(loaded, BaseException) \
            else RuntimeError


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)``. Python 3.10 has no notes: there the note goes into the same
    list (``__notes__``), which ``formatted`` writes under the traceback as 3.11 prints it."""
    try:
        if callable(getattr(error, "add_note", None)):
            error.add_note(note)
            return
        notes = getattr(error, "__notes__", None)
        if not isinstance(notes, list):
            notes = error.__notes__ = []
        notes.append(note)
    except (AttributeError, TypeError):
        pass  # (an exception type that takes no attributes: the note is lost, not the error)


def formatted(error: BaseException) -> str:
    """``error``'s traceback as Python prints it, with its notes on Python 3.10 too."""
    text = "".join(traceback.format_exception(error))
    if sys.version_info < (3, 11):
        text += "".join(f"{note}\n" for note in getattr(error, "__notes__", None) or ())
    return text


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


class _ReadableMessage(str):
    """A str whose repr is itself, so ``str(KeyError(msg))`` shows the traceback readably."""

    def __repr__(self) -> str:
        return str(self)


def listed(indices: Any) -> Any:
    """Sample indices as the user sees them (a list), where the batch order holds an int64
    array (``BatchSampler.index_batches``)."""
    return indices.tolist() if type(indices) is np.ndarray else indices


def rebuild_worker_error(failure: BatchFailed | WorkerFailed, indices: Any = None,
                         idx: int | None = None) -> BaseException:
    """The worker's exception, re-created with its type, tagged with worker, idx and indices.

    Falls back to ``RuntimeError`` when the exception did not survive pickling or its type
    cannot be built from one message, and for ``StopIteration``, which would otherwise end
    the epoch silently.
    """
    error, indices = failure.error, listed(indices)
    if idx is None:
        where = "while starting (slab attach, seeding or worker_init_fn)"
    elif indices is None:
        where = f"while loading batch idx={idx} from its iterator of the dataset"
    else:
        where = f"while loading batch idx={idx} (indices {indices!r})"
    # torch's first line word for word (code and searches match it), then ours, then torch's
    # "Original Traceback (most recent call last): ..." with the worker's traceback.
    name = error.type_name.rpartition(".")[2]
    message = (f"Caught {name} in DataLoader worker process {failure.worker_id}.\n"
               f"{error.type_name} {where}.\nOriginal {error.traceback}")
    original = error.original()
    exc_type = type(original) if original is not None else error.carried_type()
    if issubclass(exc_type, StopIteration):
        exc_type = RuntimeError
    if issubclass(exc_type, KeyError):
        message = _ReadableMessage(message)  # KeyError's str() is the repr of its argument
    try:
        exc = exc_type(message)
    except Exception:  # an exception type whose constructor wants other arguments
        exc = RuntimeError(message)
    if isinstance(exc, OSError) and getattr(original, "errno", None) is not None:
        exc.errno = original.errno  # kept (ENOSPC, EMFILE, ...); str() stays torch's text
    exc.__cause__ = original
    exc.worker_id = failure.worker_id  # type: ignore[attr-defined]
    exc.batch_idx = idx  # type: ignore[attr-defined]
    exc.indices = indices  # type: ignore[attr-defined]
    return exc


def fresh_copy(error: BaseException) -> BaseException:
    """A new exception like ``error`` (type, args, attributes, cause), with no traceback.

    A session keeps its fatal error to raise at every later next(). Raising the kept object
    would give it a traceback through the consumer's frames, the iterator's among them; the
    iterator's finalizer holds the session, so that iterator (and the locals of those frames)
    could then never be collected. Each raise gets a copy instead (docs/design.md, "Errors").
    """
    try:
        clone = type(error).__new__(type(error), *error.args)
        clone.__dict__.update(error.__dict__)
        if isinstance(error, OSError):
            clone.errno = error.errno  # (a slot, not in __dict__)
    except Exception:  # an exception type with an unusual __new__: raise the original
        return error
    clone.__cause__ = error.__cause__
    clone.__suppress_context__ = error.__suppress_context__
    return clone


def without_tracebacks(exc: BaseException) -> BaseException:
    """``exc`` and every exception chained to it (cause, context) without its traceback: an
    error kept to raise later, whose frames would hold slot views or the session."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        chained = pending.pop()
        if chained is not None and id(chained) not in seen:
            seen.add(id(chained))
            chained.with_traceback(None)
            pending += [chained.__cause__, chained.__context__]
    return exc
