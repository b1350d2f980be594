"""``ShardedDataPipe``: an ``IterDataPipe`` dataset seeded and sharded per epoch, rank and
worker as torch's DataLoader does it."""

from __future__ import annotations

import ctypes
import multiprocessing
import sys
from collections.abc import Iterator
from multiprocessing.context import get_spawning_popen
from typing import Any

from .worker_info import get_worker_info


class ShardedDataPipe:
    """An ``IterDataPipe`` that, when iterated, seeds its ``shuffle()`` steps and applies its
    ``sharding_filter()`` the way torch's DataLoader does: in a worker, shard ``id *
    world_size + rank`` of ``num_workers * world_size``; in the main process (``num_workers=0``),
    shard ``rank`` of ``world_size``. Every worker seeds shuffling with the same epoch seed,
    so the shards are disjoint parts of one shuffled order.

    The seed lives in a shared-memory cell that workers inherit: the main process sets it at
    each ``iter(loader)`` before any task of that epoch is sent, so persistent workers shuffle
    each epoch with its new seed, as torch's do after its ``_ResumeIteration`` message. The
    world size and rank are set there too, as torch reads them for each new iterator (a
    loader made before ``init_process_group``, or in the parent of ``mp.spawn``, shards by
    the rank that iterates it); persistent workers keep those they started with, as torch's.
    """

    def __init__(self, pipe: Any) -> None:
        data = sys.modules["torch.utils.data"]
        wrapper = getattr(getattr(data, "datapipes", None), "datapipe", None)
        wrapper = getattr(wrapper, "_IterDataPipeSerializationWrapper", None)
        # torch's wrapper pickles the pipe with dill where a lambda needs it (spawn workers);
        # it is private, and torch has no public way to pickle a DataPipe as its workers do.
        self.pipe = wrapper(pipe) if wrapper is not None else pipe
        self.world_size, self.rank = 1, 0  # (set by start_epoch at each iter(loader))
        self._seed = multiprocessing.RawValue(ctypes.c_int64, 0)

    def start_epoch(self, seed: int, world_size: int, rank: int) -> None:
        """Main process, at ``iter(loader)``: the seed this epoch's shuffling uses, and the
        ``torch.distributed`` world size and rank it shards by."""
        self._seed.value = seed
        self.world_size, self.rank = world_size, rank

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if get_spawning_popen() is None:
            # A copy (copy.deepcopy, pickle: a loader's copy), not a spawned worker: the value,
            # for a cell of its own (the shared cell pickles only into a starting process).
            state["_seed"] = self._seed.value
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if isinstance(state["_seed"], int):
            state = {**state, "_seed": multiprocessing.RawValue(ctypes.c_int64, state["_seed"])}
        self.__dict__.update(state)

    def __iter__(self) -> Iterator[Any]:
        torch = sys.modules["torch"]  # loaded: unpickling or forking the pipe imported it
        from torch.utils.data import graph_settings

        shared_rng = torch.Generator()
        shared_rng.manual_seed(self._seed.value)
        graph_settings.apply_random_seed(self.pipe, shared_rng)
        info = get_worker_info()
        if info is None:
            graph_settings.apply_sharding(self.pipe, self.world_size, self.rank)
        else:
            graph_settings.apply_sharding(self.pipe, info.num_workers * self.world_size,
                                          info.id * self.world_size + self.rank)
        return iter(self.pipe)
