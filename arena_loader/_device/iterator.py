"""The device leg as the loader sees it: ``DeviceCopier`` wraps each host iterator in a
``DeviceIterator``, whose batches are on the GPU."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

from . import cuda
from .stage import DeviceStage


class DeviceIterator:
    """What ``iter(loader)`` returns with ``device`` set: batches whose arrays are on the GPU
    (numba device arrays, or torch CUDA tensors with ``output="torch"``)."""

    def __init__(self, owner: Any, host: Iterator, gpu: int, slots: int, pin_memory: bool,
                 to_torch: bool, owns_host: bool, held_limit: int | None = None,
                 auto_torch: bool = False):
        self._owner = owner  # the loader: `for b in ArenaLoader(...)` must keep it alive
        self._host = host
        self._stage = DeviceStage(host, gpu, slots, pin_memory, to_torch, owns_host,
                                  held_limit, auto_torch)
        self._finalizer = weakref.finalize(self, self._stage.close)

    def __iter__(self) -> DeviceIterator:
        return self

    def __next__(self) -> Any:
        stage = self._stage
        if stage.awaits_first:
            # The first batch is taken here, in the consumer's thread, so that whatever the
            # host iterator does at its first next() (claim the arena, pin the slab) happens
            # here; its errors are this next()'s, and the following next() tries again.
            stage.start(next(self._host))  # no local: the thread alone holds that slot
        return stage.next_batch()

    def close(self) -> None:
        self._finalizer()


class DeviceCopier:
    """The loader's device leg: a ``DeviceIterator`` around each host iterator."""

    def __init__(self, gpu: int, slots: int, pin_memory: bool, output: str | None,
                 held_limit: int | None = None):
        self.gpu = gpu
        self._slots = slots
        self._held_limit = held_limit
        self._pin_memory = pin_memory
        self._to_torch = output == "torch"
        # output=None: batches of a torch dataset become CUDA tensors (not in the simulator,
        # which has no __cuda_array_interface__ for torch to read).
        self._auto_torch = output is None and not cuda.SIMULATED
        if self._to_torch:
            cuda.torch_converter(gpu)  # the simulator cannot: say so at construction
        self._shared: weakref.ref | None = None  # the iterator reading a persistent host one

    def wrap(self, owner: Any, host: Iterator, owns_host: bool) -> DeviceIterator:
        """``owns_host``: close ``host`` with the device iterator (it is not persistent)."""
        iterator = DeviceIterator(owner, host, self.gpu, self._slots, self._pin_memory,
                                  self._to_torch, owns_host, self._held_limit, self._auto_torch)
        if not owns_host:
            self._shared = weakref.ref(iterator)
        return iterator

    def detach(self) -> None:
        """Stop the device iterator still reading the persistent host iterator (an abandoned
        epoch) before that one starts a new epoch."""
        previous = self._shared() if self._shared is not None else None
        self._shared = None
        if previous is not None:
            previous.close()
