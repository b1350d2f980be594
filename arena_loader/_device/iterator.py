"""The device leg as the loader sees it: ``DeviceCopier`` puts each host iterator behind a
``DeviceStage`` (``_stage.StagedIterator``), whose batches are on the GPU."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .._stage import Stager
from . import cuda
from .stage import DeviceStage


class DeviceCopier(Stager):
    """The loader's device leg: a ``DeviceStage`` around each host iterator; ``iter()``
    gives batches whose arrays are on the GPU (numba device arrays, or torch CUDA tensors
    with ``output="torch"``)."""

    def __init__(self, gpu: int, slots: int, pin_memory: bool, output: str | None,
                 held_limit: int | None = None):
        super().__init__()
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

    def make(self, host: Iterator, owns_host: bool, positions: Any) -> DeviceStage:
        return DeviceStage(host, self.gpu, self._slots, self._pin_memory, self._to_torch,
                           owns_host, self._held_limit, self._auto_torch, positions)
