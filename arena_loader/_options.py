"""Loader options: torch's names and defaults, validated once, frozen afterwards."""

from __future__ import annotations

import multiprocessing
import numbers
import operator
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._output import OUTPUTS

DEFAULT_PREFETCH_FACTOR = 2
WORKER_MODES = ("process", "thread")


def is_iterable_dataset(dataset: Any) -> bool:
    """True for iterable-style datasets (torch's ``IterableDataset`` or ``__iter__`` only)."""
    # Only look at torch if the program already imported it: importing it here would cost
    # a second, and a dataset cannot be a torch IterableDataset without it.
    torch_data = sys.modules.get("torch.utils.data")
    if torch_data is not None and isinstance(dataset, torch_data.IterableDataset):
        return True
    if hasattr(dataset, "__next__") and not hasattr(dataset, "__getitem__"):
        name = type(dataset).__name__  # (torch's DataLoader raises its TypeError at iter())
        raise TypeError(f"object of type '{name}' has no len() (torch's words): dataset is a "
                        f"one-shot iterator ({name}) that the first epoch would use up, leaving "
                        "every later epoch empty; pass a list, or an IterableDataset whose "
                        "__iter__ makes a new iterator each time")
    return hasattr(dataset, "__iter__") and not hasattr(dataset, "__getitem__")


def _resolve_context(value: Any) -> multiprocessing.context.BaseContext | None:
    """The context for a ``multiprocessing_context`` value; None for None, which means the
    program's start method at each ``iter()`` (``start_context``)."""
    if value is None:
        return None
    if isinstance(value, str):
        if value not in _start_methods():
            raise ValueError(torch_worded(
                f"multiprocessing_context option should specify a valid start method in "
                f"{_start_methods()!r}, but got multiprocessing_context={value!r}",
                f"multiprocessing_context must be a valid start method in {_start_methods()!r}, "
                f"got {value!r}"))
        return multiprocessing.get_context(value)
    if isinstance(value, multiprocessing.context.BaseContext):
        return value
    raise TypeError(torch_worded(
        "multiprocessing_context option should be a valid context object or a string "
        f"specifying the start method, but got multiprocessing_context={value}",
        "multiprocessing_context must be a start method name or a multiprocessing context "
        f"object, got {type(value).__name__}"))


def torch_worded(torch_text: str, ours: str) -> str:
    """torch's message verbatim (code matching torch's text keeps working), then ours."""
    return f"{torch_text} ({ours})"


def _start_methods() -> list[str]:
    return multiprocessing.get_all_start_methods()


@dataclass(frozen=True)
class LoaderOptions:
    """Every ``ArenaLoader`` option; ``__post_init__`` rejects what torch rejects, and more."""

    batch_size: int | None = 1
    shuffle: bool | None = None
    sampler: Any = None
    batch_sampler: Any = None
    num_workers: int = 0
    collate_fn: Callable[[list], Any] | None = None
    pin_memory: bool = False
    drop_last: bool = False
    timeout: float = 0
    worker_init_fn: Callable[[int], None] | None = None
    multiprocessing_context: Any = None
    generator: Any = None
    prefetch_factor: int | None = None
    persistent_workers: bool = False
    in_order: bool = True
    slots: int | None = None
    held_batch_limit: int | None = None
    # Set by the loader for an iterable-style dataset (is_iterable_dataset), which forbids
    # shuffle, sampler and batch_sampler as torch does.
    iterable: bool = False
    # Set by the loader for a torch IterDataPipe, whose `shuffle` torch accepts: it switches
    # the pipe's shuffle() steps on or off (graph_settings.apply_shuffle_settings).
    datapipe: bool = False
    output: str | None = None
    device: Any = None
    worker_mode: str = "process"
    worker_threads: int = 1

    def __post_init__(self) -> None:
        # Checks run in torch's order, so a call with several mistakes gets torch's error type.
        _check_int(self, "num_workers", minimum=0,
                   fix="use num_workers=0 to load in the main process",
                   torch_text="num_workers option should be non-negative; use num_workers=0 to "
                   "disable multiprocessing.")
        # Any real number, as torch's comparison takes it (numpy's too); kept as a float.
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, numbers.Real):
            raise TypeError(f"timeout must be a number of seconds, got "
                            f"{type(self.timeout).__name__} {self.timeout!r}; use 0 for no timeout")
        if not isinstance(self.timeout, (int, float)):
            object.__setattr__(self, "timeout", float(self.timeout))
        if self.timeout < 0:
            raise ValueError(torch_worded(
                "timeout option should be non-negative",
                f"timeout must be >= 0 seconds, got {self.timeout!r}; use 0 for no timeout"))
        if self.num_workers == 0:
            if self.prefetch_factor is not None:
                raise ValueError(torch_worded(
                    "prefetch_factor option could only be specified in multiprocessing.let "
                    "num_workers > 0 to enable multiprocessing, otherwise set prefetch_factor "
                    "to None.",
                    f"got prefetch_factor={self.prefetch_factor!r} with num_workers=0"))
            if self.persistent_workers:
                raise ValueError(torch_worded(
                    "persistent_workers option needs num_workers > 0",
                    "got num_workers=0; pass num_workers > 0 or persistent_workers=False"))
            if self.multiprocessing_context is not None:
                raise ValueError(torch_worded(
                    "multiprocessing_context can only be used with multi-process loading "
                    "(num_workers > 0), but got num_workers=0",
                    f"multiprocessing_context={self.multiprocessing_context!r} needs "
                    "num_workers > 0; pass num_workers > 0 or drop multiprocessing_context"))
        elif self.prefetch_factor is not None:
            # torch accepts 0, which silently yields an empty epoch; we refuse it.
            _check_int(self, "prefetch_factor", minimum=1,
                       fix="use prefetch_factor=None for the default of 2",
                       torch_text="prefetch_factor option should be non-negative", torch_below=0)
        if self.worker_mode not in WORKER_MODES:
            raise ValueError(f"worker_mode must be one of {WORKER_MODES!r}, got "
                             f"{self.worker_mode!r}; use \"thread\" when loading releases the "
                             "GIL (compiled gathers, file reads), else \"process\"")
        if self.worker_mode == "thread" and self.multiprocessing_context is not None:
            raise ValueError(
                "multiprocessing_context must be None with worker_mode='thread', got "
                f"{self.multiprocessing_context!r}: thread workers start no process; drop one "
                "of the two options")
        if self.worker_mode == "thread" and self.iterable and self.num_workers > 0:
            raise ValueError(
                "worker_mode must be 'process' for an iterable-style dataset, got 'thread': "
                "such datasets shard by torch.utils.data.get_worker_info(), which is one value "
                "per process, so every thread would yield the whole dataset")
        self._check_worker_threads()
        # Validates the start method now, at construction, as torch does.
        object.__setattr__(self, "context", _resolve_context(self.multiprocessing_context)
                           if self.num_workers > 0 and self.worker_mode == "process" else None)
        if self.iterable:
            self._check_iterable_options()
        # A datapipe's shuffle is a setting of the pipe, not a sampler (as in torch).
        shuffle = self.shuffle and not self.datapipe
        if self.sampler is not None and shuffle:
            raise ValueError(torch_worded(
                "sampler option is mutually exclusive with shuffle",
                "got shuffle=True with a sampler: shuffle inside the sampler, or drop `sampler`"))
        if self.batch_sampler is not None and (
            self.batch_size != 1 or shuffle or self.sampler is not None or self.drop_last
        ):
            raise ValueError(torch_worded(
                "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, "
                "and drop_last", "leave those at their defaults when passing batch_sampler"))
        if self.batch_size is None and self.batch_sampler is None and self.drop_last:
            raise ValueError(torch_worded(
                "batch_size=None option disables auto-batching and is mutually exclusive with "
                "drop_last", "got drop_last=True: pass a batch_size, or drop_last=False"))
        if self.batch_sampler is None and self.batch_size is not None and (
            isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int)
            or self.batch_size <= 0
        ):
            # ValueError for a wrong type too: torch's BatchSampler raises ValueError for both.
            raise ValueError(torch_worded(
                "batch_size should be a positive integer value, but got "
                f"batch_size={self.batch_size}",
                f"batch_size must be a positive int, got {self.batch_size!r}; use "
                "batch_size=None to disable automatic batching"))
        if self.batch_size is not None and self.batch_sampler is None \
                and not isinstance(self.drop_last, bool):
            # Where torch checks it: in the BatchSampler built from batch_size and drop_last.
            raise ValueError(torch_worded(
                f"drop_last should be a boolean value, but got drop_last={self.drop_last}",
                f"drop_last must be a bool (True or False), got {self.drop_last!r}"))
        if self.output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS!r}, got {self.output!r}")
        if self.slots is not None:
            _check_int(self, "slots", minimum=1,
                       fix="pass a positive int, or slots=None for "
                       "prefetch_factor * num_workers + 1")
        if self.held_batch_limit is not None:
            _check_int(self, "held_batch_limit", minimum=1,
                       fix="pass a positive int, or None to let held batches grow memory")
        object.__setattr__(self, "device", _check_device(self.device))

    def _check_worker_threads(self) -> None:
        """Threads inside workers (docs/design.md, "Threads inside workers") share out the
        samples of a map-style dataset's batch."""
        _check_int(self, "worker_threads", minimum=1,
                   fix="pass 1 (the default) for workers of one thread each")
        if self.worker_threads == 1:
            return
        if self.num_workers == 0:
            raise ValueError(
                f"worker_threads must be 1 with num_workers=0, got {self.worker_threads}: the "
                "threads run inside workers; pass num_workers >= 1 (worker_mode='thread' "
                "keeps the workers inside this process)")
        if self.iterable:
            raise ValueError(
                f"worker_threads must be 1 for an iterable-style dataset, got "
                f"{self.worker_threads}: the threads of a worker would share its one iterator, "
                "which hands out items one at a time; use more workers (num_workers), or a "
                "map-style dataset (__getitem__ and __len__)")
        if not self.auto_collation:
            raise ValueError(
                f"worker_threads must be 1 with batch_size=None, got {self.worker_threads}: "
                "each batch is then one sample, loaded by one thread; pass a batch_size, or "
                "use more workers (num_workers)")

    def _check_iterable_options(self) -> None:
        """torch's rule: an iterable-style dataset decides its own order and batches' keys."""
        # shuffle=False is accepted: it was torch's default once, and means "unspecified".
        shuffle_unset = self.datapipe or self.shuffle in (None, False)
        for name, value, unset in (("shuffle", self.shuffle, shuffle_unset),
                                   ("sampler", self.sampler, self.sampler is None),
                                   ("batch_sampler", self.batch_sampler,
                                    self.batch_sampler is None)):
            if not unset:
                raise ValueError(torch_worded(
                    f"DataLoader with IterableDataset: expected unspecified {name} option, but "
                    f"got {name}={value}",
                    f"{name} must be left unset for an iterable-style dataset: shuffle, sample "
                    "or batch inside its __iter__ (shard with get_worker_info())"))

    @property
    def effective_prefetch_factor(self) -> int:
        if self.num_workers == 0:
            return 0
        return DEFAULT_PREFETCH_FACTOR if self.prefetch_factor is None else self.prefetch_factor

    @property
    def max_in_flight(self) -> int:
        """Batches handed to workers and not yet received: torch's prefetch bound."""
        return self.effective_prefetch_factor * self.num_workers

    @property
    def slots_or_default(self) -> int:
        """``slots``, or by default room for the read-ahead and the batch a ``for`` loop still
        holds while asking for the next (and the device stage's two): the most batches
        torch's DataLoader holds at once. With ``num_workers=0``, 2."""
        if self.slots is not None:
            return self.slots
        # The device stage holds up to two host batches itself (one copying, one next).
        return max(2, self.max_in_flight + 1) + (2 if self.device is not None else 0)

    def start_context(self) -> multiprocessing.context.BaseContext:
        """The worker start method: the option's, else the program's
        (``multiprocessing.set_start_method``), else fork where there is fork."""
        if self.context is not None:
            return self.context
        method = multiprocessing.get_start_method(allow_none=True)
        if method is None:
            method = "fork" if "fork" in _start_methods() else None
        return multiprocessing.get_context(method)

    @property
    def auto_collation(self) -> bool:
        return self.batch_sampler is not None or self.batch_size is not None

    @property
    def gpu_index(self) -> int | None:
        """The N of ``device="cuda:N"``; None for ``"cuda"`` (the current GPU) or no device."""
        if self.device is None or self.device == "cuda":
            return None
        return int(self.device.partition(":")[2])


_DEVICE_RULE = ("device must be None, 'cpu', 'cuda' or 'cuda:N' with N a GPU index >= 0")
_DEVICE_FIX = ("pass device='cuda' to get batches on the current GPU, or leave device=None "
               "for host batches")


def _check_device(value: Any) -> str | None:
    """``device`` normalized to None (host batches), ``"cuda"`` or ``"cuda:N"``."""
    if type(value).__module__ == "torch" and type(value).__name__ == "device":
        value = str(value)  # torch.device("cuda", 1) -> "cuda:1"
    if value is None or value == "cpu":
        return None
    if not isinstance(value, str):
        raise TypeError(f"{_DEVICE_RULE}, got {type(value).__name__} {value!r}; {_DEVICE_FIX}")
    kind, colon, index = value.partition(":")
    if kind == "cuda" and (not colon or (index.isascii() and index.isdigit())):
        return f"cuda:{int(index)}" if colon else "cuda"
    raise ValueError(f"{_DEVICE_RULE}, got {value!r}; {_DEVICE_FIX}")


def _check_int(options: LoaderOptions, name: str, *, minimum: int, fix: str,
               torch_text: str | None = None, torch_below: int | None = None) -> None:
    """Option ``name`` made a plain int: any integer but a bool (a numpy integer too, as
    torch takes it). ``torch_text``: what torch says when it is below ``torch_below`` (by
    default ``minimum``)."""
    value = getattr(options, name)
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}; "
                        f"{fix}") from None
    if number < minimum:
        ours = f"{name} must be >= {minimum}, got {number}; {fix}"
        below_torch = number < (minimum if torch_below is None else torch_below)
        raise ValueError(torch_worded(torch_text, ours) if torch_text and below_torch else ours)
    object.__setattr__(options, name, number)
