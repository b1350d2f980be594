"""``DistributedSampler``: each ``torch.distributed`` rank's share of the dataset, with
torch's padding, shuffling and ``set_epoch`` rules (exported from ``arena_loader.samplers``)."""

from __future__ import annotations

import math
import operator
import os
import sys
import warnings
from collections.abc import Iterator, Sized
from typing import Any

import numpy as np

from ._options import LoaderOptions, torch_worded
from ._torch_compat import initialized_distributed


class DistributedSampler:
    """The share of the dataset that process ``rank`` of ``num_replicas`` loads.

    torch's rules: without ``drop_last`` the index list is padded by repeating it from the
    start until it divides evenly; with ``drop_last`` its tail is cut so it does. Rank ``r``
    takes every ``num_replicas``-th index starting at ``r``, so ranks are disjoint apart from
    padding. With ``shuffle`` the order is a permutation that depends only on ``seed`` and the
    epoch given to ``set_epoch`` (call it before each epoch), the same on every rank. In a
    program that imported torch it is torch's permutation for ``seed + epoch`` (the same
    order as torch's DistributedSampler); without torch, numpy's.

    ``num_replicas`` and ``rank`` default to the initialised ``torch.distributed`` group, else
    to the ``WORLD_SIZE`` and ``RANK`` environment variables that ``torchrun`` sets.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if num_replicas is None:
            num_replicas = _distributed_default("num_replicas", "WORLD_SIZE")
        if rank is None:
            rank = _distributed_default("rank", "RANK")
        # Any integer but a bool, numpy's included, as torch's takes them.
        num_replicas, rank = _integer(num_replicas), _integer(rank)
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) \
                or num_replicas <= 0:
            raise ValueError(f"num_replicas must be a positive int, got {num_replicas!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ValueError(torch_worded(
                f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]",
                f"rank must be in [0, num_replicas - 1] = [0, {num_replicas - 1}], got "
                f"rank={rank!r} with num_replicas={num_replicas}; pass a rank below "
                "num_replicas"))
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        size = len(dataset)
        if drop_last and size % num_replicas:
            # Cut the tail to the nearest multiple of num_replicas below size.
            self.num_samples = math.ceil((size - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(size / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def __iter__(self) -> Iterator[int]:
        size = len(self.dataset)
        torch = sys.modules.get("torch")
        if self.shuffle and torch is not None:
            generator = torch.Generator()  # torch's: seeded by seed + epoch only
            generator.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(size, generator=generator).tolist()
        elif self.shuffle:
            # A fresh generator from (seed, epoch) only: every rank computes the same order.
            rng = np.random.default_rng([self.seed % 2**64, self.epoch % 2**64])
            indices = rng.permutation(size).tolist()
        else:
            indices = list(range(size))
        if self.total_size > size:
            repeats = math.ceil(self.total_size / size)
            indices = (indices * repeats)[:self.total_size]
        else:
            indices = indices[:self.total_size]
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s order on the next ``iter()``; call it at the start of each epoch."""
        self.epoch = epoch


def _integer(value: Any) -> Any:
    """``value`` as a plain int if it is an integer other than a bool, else as it is."""
    if isinstance(value, bool):
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value


def _distributed_default(name: str, variable: str) -> int:
    """``num_replicas`` or ``rank`` from ``torch.distributed``, else from the environment."""
    dist = initialized_distributed()
    if dist is not None:
        return dist.get_world_size() if name == "num_replicas" else dist.get_rank()
    value = os.environ.get(variable)
    if value is None:
        raise ValueError(
            f"{name} must be given when torch.distributed is not initialised and {variable} is "
            f"not set, got {name}=None; pass {name}=..., call "
            "torch.distributed.init_process_group() first, or launch with torchrun")
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"{name} must be an int; it defaults to the {variable} environment variable, "
            f"which is {value!r}; set {variable} to an integer or pass {name}=...") from None


class EpochSetter:
    """``loader.set_epoch(epoch)``, which torch's DataLoader lacks but trainers call on a
    loader that has it (Hugging Face's ``Trainer`` calls it each epoch, as Accelerate's
    prepared loaders have one; it gives no ArenaLoader a sampler of its own). Passed on as
    those loaders pass it: to the batch sampler's ``set_epoch``, else the sampler's (a
    ``DistributedSampler`` reshuffles), else the dataset's (a Hugging Face
    ``IterableDataset``'s shuffle). It takes effect at the next ``iter()``."""

    batch_sampler: Any
    sampler: Any
    dataset: Any

    def set_epoch(self, epoch: int) -> None:
        batch_sampler = self.batch_sampler
        for owner in (batch_sampler, getattr(batch_sampler, "sampler", None), self.sampler,
                      self.dataset):
            set_epoch = getattr(owner, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)
                return


def warn_if_every_rank_loads_all(options: LoaderOptions) -> bool:
    """Warn when ``torch.distributed`` runs several ranks and the loader draws from its default
    sampler: every rank then loads the whole dataset. Trainers such as Lightning put a
    DistributedSampler into torch's DataLoader themselves, which they cannot do for an
    ArenaLoader (not a DataLoader subclass): silent, each rank would train on every sample.
    True once warned (the loader warns once)."""
    if options.iterable or options.sampler is not None or options.batch_sampler is not None:
        return False
    dist = initialized_distributed()
    if dist is None or (world_size := dist.get_world_size()) <= 1:
        return False
    warnings.warn(
        f"torch.distributed runs {world_size} ranks and this ArenaLoader has no sampler of "
        "yours: every rank loads the whole dataset. Trainers such as Lightning give torch's "
        "DataLoader a DistributedSampler; they cannot give ArenaLoader one. Pass "
        "sampler=arena_loader.DistributedSampler(dataset, shuffle=...) (its set_epoch is called "
        "by Lightning, and by Hugging Face's Trainer through loader.set_epoch; else call "
        "loader.set_epoch(epoch) each epoch), or a sampler of your own to keep this order on "
        "every rank", UserWarning, stacklevel=3)
    return True
