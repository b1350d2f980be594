"""``pin_memory=True`` without a device, with workers: an ``arena_loader-pin`` thread copies
each batch's tensors into torch's page-locked memory while the training step runs, as torch's
pin-memory thread does, and ``next()`` takes the copies (docs/design.md, "Stages").

Pinned in ``next()`` instead, the copy (a memcpy of the whole batch) ran between training
steps: on an H200, 16 MiB batches with a 4.5 ms GPU step took 7.41 ms a step (torch 7.29),
4.83 with the copy in this thread (``benchmarks/pin_training_step.py``; docs/benchmarks.md,
tenth session). Without workers the batch is pinned in
``next()``, as torch's single-process iterator does (``ArenaSource``'s ``pin_batch``).

The thread takes host batches ahead of the consumer, so the host iterator's epoch position
runs ahead too: each result carries the position as of its batch (``LoaderResume.follower``),
and the consumer's ``next()`` makes that the loader's, so ``state_dict()`` still counts only
the batches the consumer received.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

from ._output import NUMPY_UNPINNED
from ._stage import Ended, HostStage, Raised, Stager

# Pinned batches waiting for the consumer (one more is being pinned): torch's pin thread
# runs as far ahead as the workers' read-ahead lets it; two hide one copy behind the step.
PIN_PREFETCH = 2


class Pinned:
    """A pinned batch for the consumer, with the epoch position as of it (None: not
    tracked)."""

    __slots__ = ("batch", "position")

    def __init__(self, batch: Any, position: Any):
        self.batch, self.position = batch, position


class PinStage(HostStage):
    thread_name = "arena_loader-pin"

    def __init__(self, host: Iterator, owns_host: bool, pin: Callable[[Any, list], Any],
                 device_index: int | None,
                 positions: tuple[Callable[[], Any], Callable[[Any], None]] | None):
        super().__init__(host, owns_host, PIN_PREFETCH, positions)
        self._pin = pin
        self._device_index = device_index
        self._warned = False
        self._warning: str | None = None  # given by the consumer's next next()

    # -- the pin thread -------------------------------------------------------------------

    def _work(self) -> None:
        if self._device_index is not None:
            import torch

            torch.cuda.set_device(self._device_index)  # torch's pin thread does so too
        item: Any
        item, self._first = self._first, None  # no other frame may keep the first batch
        while True:
            if item is None:
                item = self._next_host()
                if item is None:
                    return
            if not isinstance(item, (Raised, Ended)):
                item = self._pinned(item)  # the host batch goes: its slot is free now
            if not self._publish(item):
                return
            if isinstance(item, Ended) or (isinstance(item, Raised) and item.fatal):
                return
            if isinstance(item, Raised):
                self._wait_taken(item)  # the next batch is loaded once this error is seen
            item = None

    def _pinned(self, batch: Any) -> Pinned | Raised:
        """``batch``'s page-locked copy, or the error pinning raised (that batch's error, as
        torch's pin thread hands it on; the next batch goes on)."""
        numpy_left: list = []
        try:
            pinned = self._pin(batch, numpy_left)
        except Exception as exc:
            return Raised(exc, False, self._position())
        if numpy_left and not self._warned:
            self._warned = True
            self._warning = NUMPY_UNPINNED
        return Pinned(pinned, self._position())

    # -- the consumer ---------------------------------------------------------------------

    def next_batch(self) -> Any:
        with self._consumer_lock:
            if self._warning is not None:  # before anything is taken: an error loses nothing
                message, self._warning = self._warning, None
                warnings.warn(message, UserWarning, stacklevel=3)
            with self._cv:
                item = self._first_queued()
            self._received(item)
            if isinstance(item, Pinned):
                return self._remove(item).batch
            self._hand_on(item)


class BatchPinner(Stager):
    """The loader's pin leg with workers: a ``PinStage`` around each host iterator."""

    def __init__(self, pin: Callable[[Any, list], Any]):
        super().__init__()
        self._pin = pin

    def make(self, host: Iterator, owns_host: bool, positions: Any) -> PinStage:
        return PinStage(host, owns_host, self._pin, _current_device(), positions)


def _current_device() -> int | None:
    """The consumer's current CUDA device, for the pin thread (None if torch cannot say)."""
    import torch

    try:
        return torch.cuda.current_device()
    except (AssertionError, RuntimeError):  # a CPU build of torch told a GPU is there
        return None
