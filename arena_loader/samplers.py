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

import functools
import itertools
import sys
from collections.abc import Iterable, Iterator, Sequence, Sized
from typing import Any

import numpy as np

from ._distributed import DistributedSampler
from ._epoch_batches import ChunkedBatches, ListedBatches, SlicedBatches
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
    "numpy_stream",
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


def numpy_stream(sampler: Any) -> np.random.Generator | None:
    """The numpy generator one of our random samplers draws from (None when it follows
    torch, or for any other sampler): the loader's state_dict() records its state."""
    if type(sampler) in (RandomSampler, SubsetRandomSampler, WeightedRandomSampler):
        return sampler._rng
    return None


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

    def _draws_array(self) -> bool:
        return True

    def _index_array(self) -> np.ndarray:
        """The epoch's indices as one array (BatchSampler slices it: no list per index)."""
        return np.arange(len(self.data_source), dtype=np.int64)

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
        # torch's check, of the dataset's length (read now, as torch's) when not given: an
        # empty dataset is its ValueError, one without len() its TypeError.
        count = len(data_source) if num_samples is None else num_samples
        if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
            raise ValueError(_num_samples_message(count))
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

    def _draws_array(self) -> bool:
        """The epoch is drawn as one array (``_index_array``): not from a torch generator of
        the caller's, which torch draws from chunk by chunk as the epoch goes on."""
        return len(self.data_source) > 0 and (self.generator is None
                                               or torch_for(self.generator) is None)

    def _index_array(self) -> np.ndarray:
        """The epoch's indices as one int64 array, drawn now; with torch's RNG by torch's
        calls, every chunk at once (from a generator of its own, seeded now, as torch's)."""
        n = len(self.data_source)
        torch = torch_for(self.generator)
        if torch is None:
            return self._numpy_indices(n).astype(np.int64, copy=False)
        return torch.cat(list(self._torch_chunks(torch, n))).numpy()  # (int64, as drawn)

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
        for drawn in self._torch_chunks(torch, n):
            yield from drawn.tolist()

    def _torch_chunks(self, torch: Any, n: int) -> Iterator[Any]:
        """The tensors torch's RandomSampler draws, in its order (its seed drawn first)."""
        generator = self.generator
        if generator is None:
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
            generator = torch.Generator()
            generator.manual_seed(seed)
        draws, sizes = self._chunk_draws(torch, n, generator)
        for (call, args), size in zip(draws, sizes):
            yield next(map(call, *args))[:size]

    def _chunk_draws(self, torch: Any, n: int,
                     generator: Any) -> tuple[list[tuple[Any, tuple]], list[int]]:
        """torch's RandomSampler's draws from ``generator``: per chunk a C callable and its
        argument iterables (``map(call, *args)`` draws it), and how many of its indices
        count."""
        if self.replacement:
            call = functools.partial(torch.randint, dtype=torch.int64, generator=generator)
            sizes = [32] * (self.num_samples // 32) + [self.num_samples % 32]
            return [(call, ((n,), ((size,),))) for size in sizes], sizes
        call = functools.partial(torch.randperm, generator=generator)
        sizes = [n] * (self.num_samples // n) + [self.num_samples % n]
        return [(call, ((n,),))] * len(sizes), sizes

    def _chunked_batches(self, size: int, drop_last: bool, first: int,
                         lists: bool) -> ChunkedBatches:
        """The epoch's batches drawn from the caller's torch generator as torch draws them."""
        n = len(self.data_source)
        draws, sizes = self._chunk_draws(torch_for(self.generator), n, self.generator)
        return ChunkedBatches(draws, sizes, size, drop_last, first, lists)

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

    def index_batches(self, first: int = 0,
                      lists: bool = False) -> Iterator[list[int] | np.ndarray]:
        """The epoch's batches as ``__iter__`` draws them, but each as a slice of one int64
        array where the sampler is one of ours (what a loader with workers writes into the
        batch order as it is; ``lists``: its ``tolist()``); lists otherwise. ``first``:
        batches to skip (a resumed epoch): the sampler draws as in a whole epoch, and the
        skipped indices are dropped before any list is made."""
        sampler = self.sampler
        if type(sampler) in (RandomSampler, SequentialSampler) and sampler._draws_array():
            return SlicedBatches(sampler._index_array, self.batch_size, self.drop_last, first,
                                 lists)
        if type(sampler) is RandomSampler and len(sampler.data_source) > 0:
            return sampler._chunked_batches(self.batch_size, self.drop_last, first, lists)
        return ListedBatches(sampler, self.batch_size, self.drop_last, first)

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


def seeded_by_epoch(sampler: Any) -> bool:
    """A sampler whose order comes from its seed and ``set_epoch`` (DistributedSampler)."""
    return callable(getattr(sampler, "set_epoch", None)) and \
        isinstance(getattr(sampler, "epoch", None), int)


# Samplers that draw nothing (ours and torch's), by type
_DRAW_NOTHING = {SequentialSampler, BatchSampler, InfiniteConstantSampler}
_TORCH_DRAW_NOTHING = {("torch.utils.data.sampler", "SequentialSampler"),
                       ("torch.utils.data.sampler", "BatchSampler"),
                       ("torch.utils.data.dataloader", "_InfiniteConstantSampler")}


def may_draw_globally(sampler: Any) -> bool:
    """Whether ``sampler`` may draw from torch's global RNG: with ``generator=None``, as
    torch's samplers do, or with no generator of its own and no ``set_epoch`` seeding
    (torchsampler's ImbalancedDatasetSampler calls ``torch.multinomial``); not ours or
    torch's that draw nothing."""
    if hasattr(sampler, "generator"):
        return sampler.generator is None
    kind = type(sampler)
    return not (numpy_stream(sampler) is not None or seeded_by_epoch(sampler)
                or kind in _DRAW_NOTHING
                or (kind.__module__, kind.__qualname__) in _TORCH_DRAW_NOTHING)
