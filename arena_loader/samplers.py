"""Index samplers with torch's semantics.

Where the program uses torch (a ``torch.Generator`` is passed, or ``generator=None`` and torch
is imported), the random samplers draw with torch's very calls, so a seed gives torch's order:
switching a training run from torch's DataLoader keeps its sample order. Without torch they
draw from numpy (docs/migrating.md, "Sample order").

Any iterable of sample indices (a torch sampler included) may be passed to ``ArenaLoader`` as
``sampler``, and any iterable of index lists as ``batch_sampler``; these classes are the
defaults the loader builds from ``shuffle``, ``batch_size`` and ``drop_last``.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
from collections.abc import Iterable, Iterator, Sequence, Sized
from typing import Any

import numpy as np

from ._options import torch_worded

__all__ = [
    "BatchSampler",
    "DistributedSampler",
    "InfiniteConstantSampler",
    "RandomSampler",
    "SequentialSampler",
    "SubsetRandomSampler",
    "WeightedRandomSampler",
    "as_numpy_generator",
    "is_torch_generator",
    "torch_for",
]


def is_torch_generator(generator: Any) -> bool:
    """True for a ``torch.Generator``, without importing torch."""
    return type(generator).__module__.startswith("torch") and hasattr(generator, "initial_seed")


def torch_for(generator: Any) -> Any:
    """The torch module when sampling with ``generator`` must follow torch, else None.

    Never imports torch: a ``torch.Generator`` exists only once torch is imported, and with
    ``generator=None`` torch's global RNG is used only by a program that imported torch.
    """
    if is_torch_generator(generator):
        return sys.modules["torch"]
    return sys.modules.get("torch") if generator is None else None


def _numpy_unless_torch(generator: Any) -> np.random.Generator | None:
    # A torch.Generator is used as is, as torch does; drawing a numpy seed from it here would
    # move its state away from torch's.
    return None if is_torch_generator(generator) else as_numpy_generator(generator)


def as_numpy_generator(generator: Any) -> np.random.Generator:
    """A numpy ``Generator`` from ``None`` (fresh entropy), a seed, a numpy or a torch generator.

    A ``torch.Generator`` is consumed for one 63-bit seed, so a seeded torch generator still
    gives a reproducible order.
    """
    if generator is None or isinstance(generator, (int, np.integer)):
        return np.random.default_rng(generator)
    if isinstance(generator, np.random.Generator):
        return generator
    if is_torch_generator(generator):
        import torch

        seed = int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
        return np.random.default_rng(seed)
    raise TypeError(
        "generator must be None, an int seed, a numpy.random.Generator or a torch.Generator, "
        f"got {type(generator).__name__}"
    )


class InfiniteConstantSampler:
    """Yields ``None`` forever: the ``sampler`` of an iterable-style dataset, whose own
    iterator decides what comes next and when the epoch ends (torch's
    ``_InfiniteConstantSampler``)."""

    def __iter__(self) -> Iterator[None]:
        return itertools.repeat(None)


def _num_samples_message(num_samples: Any) -> str:
    return torch_worded(
        f"num_samples should be a positive integer value, but got num_samples={num_samples}",
        f"num_samples must be a positive int, got {num_samples!r}")


class SequentialSampler:
    """Yields ``0 .. len(data_source) - 1`` in order."""

    def __init__(self, data_source: Sized) -> None:
        self.data_source = data_source

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.data_source)))

    def _index_array(self) -> np.ndarray:
        """The epoch's indices as one array (BatchSampler slices it: no list per index)."""
        return np.arange(len(self.data_source))

    def __len__(self) -> int:
        return len(self.data_source)


class RandomSampler:
    """A fresh random permutation (or draws with ``replacement``) on every ``iter()``."""

    def __init__(
        self,
        data_source: Sized,
        replacement: bool = False,
        num_samples: int | None = None,
        generator: Any = None,
    ) -> None:
        if not isinstance(replacement, bool):
            raise TypeError(torch_worded(
                f"replacement should be a boolean value, but got replacement={replacement}",
                f"replacement must be a bool, got {replacement!r}"))
        if num_samples is not None and (
            isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples <= 0
        ):
            raise ValueError(_num_samples_message(num_samples))
        self.data_source = data_source
        self.replacement = replacement
        self._num_samples = num_samples
        self.generator = generator
        self._rng = _numpy_unless_torch(generator)

    @property
    def num_samples(self) -> int:
        return len(self.data_source) if self._num_samples is None else self._num_samples

    def __iter__(self) -> Iterator[int]:
        n = len(self.data_source)
        if n == 0:
            return iter(())
        torch = torch_for(self.generator)
        if torch is not None:
            return self._torch_indices(torch, n)
        return iter(self._numpy_indices(n).tolist())

    def _index_array(self) -> np.ndarray | None:
        """The epoch's indices as one array, drawn now; None when they follow torch's
        generator (drawn one by one, as torch does, by ``iter``)."""
        n = len(self.data_source)
        if n == 0 or torch_for(self.generator) is not None:
            return None
        return self._numpy_indices(n)

    def _numpy_indices(self, n: int) -> np.ndarray:
        if self.replacement:
            drawn = self._rng.integers(0, n, size=self.num_samples)
        else:
            whole, rest = divmod(self.num_samples, n)
            parts = [self._rng.permutation(n) for _ in range(whole)]
            if rest:  # no permutation drawn only to take none of it
                parts.append(self._rng.permutation(n)[:rest])
            drawn = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return drawn

    def _torch_indices(self, torch: Any, n: int) -> Iterator[int]:
        """torch.utils.data.RandomSampler.__iter__'s draws, call for call (a generator, like
        torch's, so its seed is drawn at the first next())."""
        generator = self.generator
        if generator is None:
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
            generator = torch.Generator()
            generator.manual_seed(seed)
        if self.replacement:
            for _ in range(self.num_samples // 32):
                yield from torch.randint(high=n, size=(32,), dtype=torch.int64,
                                         generator=generator).tolist()
            yield from torch.randint(high=n, size=(self.num_samples % 32,), dtype=torch.int64,
                                     generator=generator).tolist()
        else:
            for _ in range(self.num_samples // n):
                yield from torch.randperm(n, generator=generator).tolist()
            yield from torch.randperm(n, generator=generator).tolist()[:self.num_samples % n]

    def __len__(self) -> int:
        return self.num_samples


class BatchSampler:
    """Groups the indices of ``sampler`` into lists of ``batch_size``."""

    def __init__(self, sampler: Iterable[int], batch_size: int, drop_last: bool) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(torch_worded(
                f"batch_size should be a positive integer value, but got batch_size={batch_size}",
                f"batch_size must be a positive int, got {batch_size!r}"))
        if not isinstance(drop_last, bool):
            raise ValueError(torch_worded(
                f"drop_last should be a boolean value, but got drop_last={drop_last}",
                f"drop_last must be a bool, got {drop_last!r}"))
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last

    def __iter__(self) -> Iterator[list[int]]:
        # Our own samplers give the epoch as one array: each batch is one slice's tolist().
        # Any other sampler: islice fills each list in C.
        for batch in self.index_batches():
            yield batch if type(batch) is list else batch.tolist()

    def index_batches(self) -> Iterator[list[int] | np.ndarray]:
        """The epoch's batches as ``__iter__`` draws them, but each as a slice of one int64
        array where the sampler is one of ours (what a loader with workers writes into the
        batch order as it is); lists otherwise."""
        index_array = getattr(self.sampler, "_index_array", None)
        array = index_array() if index_array is not None and type(self.sampler) in (
            RandomSampler, SequentialSampler) else None
        if array is not None:
            array = array.astype(np.int64, copy=False)
            size = self.batch_size
            stop = len(array) - len(array) % size if self.drop_last else len(array)
            for start in range(0, stop, size):
                yield array[start: start + size]
            return
        indices = iter(self.sampler)
        while True:
            batch = list(itertools.islice(indices, self.batch_size))
            if len(batch) < self.batch_size and (self.drop_last or not batch):
                return
            yield batch

    def __len__(self) -> int:
        if self.drop_last:
            return len(self.sampler) // self.batch_size  # type: ignore[arg-type]
        return -(-len(self.sampler) // self.batch_size)  # type: ignore[arg-type]


class SubsetRandomSampler:
    """A fresh random permutation of ``indices`` on every ``iter()`` (torch's semantics)."""

    def __init__(self, indices: Sequence[int], generator: Any = None) -> None:
        self.indices = indices
        self.generator = generator
        self._rng = _numpy_unless_torch(generator)

    def __iter__(self) -> Iterator[int]:
        torch = torch_for(self.generator)
        if torch is not None:
            order = torch.randperm(len(self.indices), generator=self.generator).tolist()
        else:
            order = self._rng.permutation(len(self.indices)).tolist()
        return iter([self.indices[i] for i in order])

    def __len__(self) -> int:
        return len(self.indices)


class WeightedRandomSampler:
    """Draws ``num_samples`` indices of ``weights``, index ``i`` with probability
    ``weights[i] / sum(weights)``; without ``replacement``, no index twice in one ``iter()``.

    Weights are checked here, at construction, where torch only fails when iterating.
    """

    def __init__(
        self,
        weights: Sequence[float],
        num_samples: int,
        replacement: bool = True,
        generator: Any = None,
    ) -> None:
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples <= 0:
            raise ValueError(_num_samples_message(num_samples))
        if not isinstance(replacement, bool):
            # ValueError, not TypeError: torch's WeightedRandomSampler raises ValueError here.
            raise ValueError(torch_worded(
                f"replacement should be a boolean value, but got replacement={replacement}",
                f"replacement must be a bool (True or False), got {replacement!r}"))
        try:
            array = np.asarray(weights, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"weights must be a 1-d sequence of numbers, got {weights!r}") from exc
        if array.ndim != 1:
            raise ValueError(torch_worded(
                "weights should be a 1d sequence but given weights have shape "
                f"{tuple(array.shape)}",
                f"weights must be a 1-d sequence of numbers, got an array of shape {array.shape}"))
        if not np.all(np.isfinite(array)) or np.any(array < 0):
            bad = int(np.flatnonzero(~np.isfinite(array) | (array < 0))[0])
            raise ValueError(
                f"weights must be finite and >= 0, got weights[{bad}]={float(array[bad])!r}; "
                "fix or drop that weight")
        positive = int(np.count_nonzero(array))
        if positive == 0:
            raise ValueError("weights must have at least one positive entry, got all zeros")
        if not replacement and num_samples > positive:
            raise ValueError(
                f"num_samples must be <= the {positive} positive weights when "
                f"replacement=False, got {num_samples}; pass replacement=True or fewer samples")
        self.weights = array
        self.num_samples = num_samples
        self.replacement = replacement
        self._probabilities = array / array.sum()
        self.generator = generator
        self._rng = _numpy_unless_torch(generator)

    def __iter__(self) -> Iterator[int]:
        torch = torch_for(self.generator)
        if torch is not None:
            drawn = torch.multinomial(torch.as_tensor(self.weights, dtype=torch.double),
                                      self.num_samples, self.replacement,
                                      generator=self.generator)
            return iter(drawn.tolist())
        drawn = self._rng.choice(len(self.weights), size=self.num_samples,
                                 replace=self.replacement, p=self._probabilities)
        return iter(drawn.tolist())

    def __len__(self) -> int:
        return self.num_samples


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


def _distributed_default(name: str, variable: str) -> int:
    """``num_replicas`` or ``rank`` from ``torch.distributed``, else from the environment."""
    # Only a program that imported torch.distributed can have initialised it, so there is
    # nothing to ask (and no import to pay for) when it is not loaded.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
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
