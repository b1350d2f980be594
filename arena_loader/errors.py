"""Exceptions raised by arena_loader.

Two families are kept apart on purpose (docs/design.md, "Errors"):
"you closed it" (:class:`LoaderClosedError`) and "it broke" (:class:`WorkerCrashedError`,
:class:`LoaderTimeoutError`, a re-raised worker exception). Each class also derives from the
builtin type torch raises in the same situation, so that code catching torch's error types keeps
working: shared-memory and descriptor exhaustion are ``OSError`` and ``RuntimeError`` (torch
raises ``RuntimeError``), a sample default collation cannot batch is a ``TypeError``.

Every class is constructible from its message alone (``type(e)(message)``, what torch's
``ExceptionWrapper`` does to re-raise a worker's error), its fields then ``None``.
"""

from __future__ import annotations

import os

__all__ = [
    "ArenaLoaderError",
    "DescriptorLimitError",
    "LayoutError",
    "LoaderClosedError",
    "LoaderForkedError",
    "LoaderTimeoutError",
    "SampleKeyError",
    "SampleShapeError",
    "SampleTypeError",
    "ShmCapacityError",
    "SlotsExhaustedError",
    "WorkerCrashedError",
]


class ArenaLoaderError(Exception):
    """Base class of every error this package defines.

    Every subclass pickles with its message and attributes (``pickle.loads(pickle.dumps(e))``
    is the same type with the same ``str`` and fields), so an error can cross a process
    boundary (a torchrun rank, a Ray task, a multiprocessing pool) intact. The default
    exception pickling calls ``type(e)(*e.args)``, which fails for keyword-only fields.
    """

    def __reduce__(self) -> tuple:
        return _rebuild, (type(self), self.args, self.__dict__)


def _rebuild(cls: type[BaseException], args: tuple, fields: dict) -> BaseException:
    """``cls`` with ``args`` and ``fields``, without calling its ``__init__``."""
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(fields)
    return error


class LoaderClosedError(ArenaLoaderError, RuntimeError):
    """The loader or iterator was closed by its owner and cannot produce batches."""


class LoaderForkedError(ArenaLoaderError, RuntimeError):
    """An iterator was used in a process forked from the one that created it: its workers,
    pipes and slab belong to that process (docs/design.md, "Fork safety")."""


def forked_iterator_error(owner_pid: int) -> LoaderForkedError:
    return LoaderForkedError(
        f"this iterator was created in process {owner_pid} and cannot be used in process "
        f"{os.getpid()}, which was forked from it: its workers and shared memory "
        "belong to the parent; call iter(loader) in this process to start its own (batches "
        "you already hold stay valid)")


class DescriptorLimitError(ArenaLoaderError, OSError, RuntimeError):
    """The process may not open enough file descriptors for the workers asked for (torch
    raises ``RuntimeError`` when it runs out of descriptors)."""


class WorkerCrashedError(ArenaLoaderError, RuntimeError):
    """A worker process died while the loader was running (killed, segfault, ``os._exit``).

    ``pid``, ``worker_id`` and ``exitcode`` (negative: the signal number) are attributes;
    ``None`` when unknown (an error rebuilt from its message alone).
    """

    def __init__(self, message: str = "", *, worker_id: int | None = None,
                 pid: int | None = None, exitcode: int | None = None):
        super().__init__(message)
        self.worker_id = worker_id
        self.pid = pid
        self.exitcode = exitcode


class LoaderTimeoutError(ArenaLoaderError, RuntimeError):
    """No batch arrived within ``timeout`` seconds (torch raises ``RuntimeError`` here too)."""


class SlotsExhaustedError(ArenaLoaderError, RuntimeError):
    """The consumer still references every slot, so no batch can be produced."""


class LayoutError(ArenaLoaderError, ValueError):
    """A sample or collated batch does not fit the batch layout inferred from the first one."""


class SampleTypeError(LayoutError, TypeError, RuntimeError):
    """Default collation met a leaf it cannot batch (``None``, a ``Fraction``, a PIL image,
    ...), or leaves of different kinds in one field, where torch's ``default_collate`` raises
    ``TypeError`` or, for a number beside a leaf ``torch.tensor()`` cannot type (``None``, a
    ``dict``, a ``Fraction``), ``RuntimeError``: an ``except`` for either catches it."""


class SampleKeyError(LayoutError, KeyError):
    """A later sample lacks a key of the batch's first (default collation), where torch's
    ``default_collate`` raises ``KeyError`` looking it up. Its ``str()`` is the message itself,
    not KeyError's quoted repr of it."""

    __str__ = Exception.__str__


class SampleShapeError(LayoutError, RuntimeError):
    """Default collation met samples whose arrays differ in shape, or whose lists or tuples
    differ in length, where torch's ``default_collate`` raises ``RuntimeError`` too (its text
    comes first in the message)."""


class ShmCapacityError(ArenaLoaderError, OSError, RuntimeError):
    """Shared memory could not be had: ``/dev/shm`` is full, or the process ran out of file
    descriptors for it (torch raises ``RuntimeError`` in both cases)."""
