"""Page-locking a slab in place, once per arena, for ``pin_memory=True`` with ``device``: the
device stage alone copies from it, and holds each slot until its copy is done."""

from __future__ import annotations

import sys
import warnings
from typing import Any

import numpy as np

from . import cuda
from .upload import STAGING_BUFFERS


class PinnedSlab:
    """One slab page-locked in place; ``close`` unregisters it (before the slab is unmapped)."""

    def __init__(self, memory: Any, gpu: int):
        self._memory = memory  # numba's PinnedMemory: its finalizer unregisters at once
        self._gpu = gpu

    def close(self) -> None:
        memory, self._memory = self._memory, None
        if memory is None:
            return
        try:
            with cuda.on_gpu(self._gpu):
                del memory
        except Exception:
            if not sys.is_finalizing():  # at exit the driver may already be gone
                raise


class HostPinner:
    """Page-locks each slab of a loader once, in place; warns once if that fails.

    Called by ``Arena`` with the slab array, on whichever thread makes the arena.
    """

    def __init__(self, gpu: int):
        self.gpu = gpu
        self._warned = False

    def __call__(self, array: np.ndarray) -> PinnedSlab | None:
        try:
            with cuda.on_gpu(self.gpu):
                return PinnedSlab(cuda.register(array), self.gpu)
        except Exception as exc:
            if not self._warned:
                self._warned = True
                warnings.warn(f"pin_memory=True: page-locking the {array.nbytes}-byte slab in "
                              f"place failed ({exc!r}); batches are copied to the GPU through "
                              f"{STAGING_BUFFERS} pinned staging buffers instead (one more host "
                              "copy per batch)", stacklevel=2)
            return None
