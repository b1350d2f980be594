"""The parts of torch's DataLoader behaviour that involve torch objects or torch's wording:
DataPipe sharding and shuffling, torch's seed draws, and torch's two warnings.

torch is never imported here: each function looks at ``sys.modules`` and only acts on what
the program already loaded (a DataPipe or a ``torch.Generator`` cannot exist without it).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

from .worker_info import get_worker_info


def loaded_torch() -> Any:
    """The torch module if the program imported it, else None."""
    return sys.modules.get("torch")


def is_iter_datapipe(dataset: Any) -> bool:
    """True for a torch ``IterDataPipe`` (torch's DataLoader shards and shuffles these)."""
    data = sys.modules.get("torch.utils.data")
    pipe_type = getattr(data, "IterDataPipe", None) if data is not None else None
    return pipe_type is not None and isinstance(dataset, pipe_type)


def draw_torch_seed(generator: Any) -> int:
    """torch's ``torch.empty((), dtype=torch.int64).random_(generator=...)`` draw, from
    ``generator`` (a ``torch.Generator``) or torch's global RNG (``None``)."""
    torch = sys.modules["torch"]
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def initialized_distributed() -> Any:
    """``torch.distributed`` if the program initialised a process group, else None."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist
    return None


def distributed_settings() -> tuple[int, int]:
    """(world size, rank) of the initialised ``torch.distributed`` group, else (1, 0): what
    torch's DataLoader shards DataPipes by."""
    dist = initialized_distributed()
    return (dist.get_world_size(), dist.get_rank()) if dist is not None else (1, 0)


class ShardedDataPipe:
    """An ``IterDataPipe`` that, when iterated, seeds its ``shuffle()`` steps and applies its
    ``sharding_filter()`` the way torch's DataLoader does: in a worker, shard ``id *
    world_size + rank`` of ``num_workers * world_size``; in the main process (``num_workers=0``),
    shard ``rank`` of ``world_size``. Every worker seeds shuffling with the same epoch seed,
    so the shards are disjoint parts of one shuffled order.

    The seed lives in a shared-memory cell that workers inherit: the main process sets it at
    each ``iter(loader)`` before any task of that epoch is sent, so persistent workers shuffle
    each epoch with its new seed, as torch's do after its ``_ResumeIteration`` message.
    """

    def __init__(self, pipe: Any, world_size: int, rank: int) -> None:
        data = sys.modules["torch.utils.data"]
        wrapper = getattr(getattr(data, "datapipes", None), "datapipe", None)
        wrapper = getattr(wrapper, "_IterDataPipeSerializationWrapper", None)
        # torch's wrapper pickles the pipe with dill where a lambda needs it (spawn workers).
        self.pipe = wrapper(pipe) if wrapper is not None else pipe
        self.world_size = world_size
        self.rank = rank
        self._seed = multiprocessing.RawValue(ctypes.c_int64, 0)

    def start_epoch(self, seed: int) -> None:
        """Main process, at ``iter(loader)``: the seed this epoch's shuffling uses."""
        self._seed.value = seed

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


class LengthCheckedIterator:
    """An epoch's iterator that warns, with torch's text, once an iterable-style dataset has
    yielded more batches than the ``len(dataset)`` read by ``len(loader)`` before ``iter()``
    (torch's ``_BaseDataLoaderIter.__next__`` check, which compares batches with samples)."""

    def __init__(self, iterator: Any, dataset: Any, reported_len: int, num_workers: int):
        self._iterator = iterator
        self._dataset = dataset
        self._reported_len = reported_len
        self._num_workers = num_workers
        self._yielded = 0

    def __iter__(self) -> LengthCheckedIterator:
        return self

    def __next__(self) -> Any:
        batch = next(self._iterator)
        self._yielded += 1
        if self._yielded > self._reported_len:
            message = (f"Length of IterableDataset {self._dataset} was reported to be "
                       f"{self._reported_len}(when accessing len(dataloader)), but "
                       f"{self._yielded} samples have been fetched. ")
            if self._num_workers > 0:
                message += (
                    "For multiprocessing data-loading, this could be caused by not properly "
                    "configuring the IterableDataset replica at each worker. Please see "
                    "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset "
                    "for examples.")
            warnings.warn(message, UserWarning, stacklevel=2)
        return batch

    def __getattr__(self, name: str) -> Any:
        # worker_pids, stats, close(), ...: the wrapped iterator's.
        return getattr(self._iterator, name)


def check_worker_number(num_workers: int, stacklevel: int) -> None:
    """torch's ``DataLoader.check_worker_number_rationality``: a UserWarning, in torch's
    words, when ``num_workers`` exceeds the CPUs this process may run on."""
    if not num_workers:
        return
    if hasattr(os, "sched_getaffinity"):
        suggested: int | None = len(os.sched_getaffinity(0))
        cpuset_checked = True
    else:
        suggested, cpuset_checked = os.cpu_count(), False
    if suggested is not None and num_workers <= suggested:
        return
    if suggested is None:
        suggestion = ("DataLoader is not able to compute a suggested max number of worker in "
                      "current system.")
    else:
        suggestion = (f"Our suggested max number of worker in current system is {suggested}"
                      f"{'' if cpuset_checked else ' (`cpuset` is not taken into account)'}, "
                      "which is smaller than what this DataLoader is going to create.")
    warnings.warn(
        f"This DataLoader will create {num_workers} worker processes in total. {suggestion} "
        "Please be aware that excessive worker creation might get DataLoader running slow or "
        "even freeze, lower the worker number to avoid potential slowness/freeze if "
        "necessary.", UserWarning, stacklevel=stacklevel + 1)
