"""Index samplers with torch's semantics, drawing randomness from numpy.

Any iterable of sample indices (a torch sampler included) may be passed to ``ArenaLoader`` as
``sampler``, and any iterable of index lists as ``batch_sampler``; these classes are the
defaults the loader builds from ``shuffle``, ``batch_size`` and ``drop_last``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sized
from typing import Any

import numpy as np

__all__ = ["BatchSampler", "RandomSampler", "SequentialSampler", "as_numpy_generator",
           "is_torch_generator"]


def is_torch_generator(generator: Any) -> bool:
    """True for a ``torch.Generator``, without importing torch."""
    return type(generator).__module__.startswith("torch") and hasattr(generator, "initial_seed")


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


class SequentialSampler:
    """Yields ``0 .. len(data_source) - 1`` in order."""

    def __init__(self, data_source: Sized) -> None:
        self.data_source = data_source

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.data_source)))

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
            raise TypeError(f"replacement must be a bool, got {replacement!r}")
        if num_samples is not None and (
            isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples <= 0
        ):
            raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
        self.data_source = data_source
        self.replacement = replacement
        self._num_samples = num_samples
        self._rng = as_numpy_generator(generator)

    @property
    def num_samples(self) -> int:
        return len(self.data_source) if self._num_samples is None else self._num_samples

    def __iter__(self) -> Iterator[int]:
        n = len(self.data_source)
        if n == 0:
            return iter(())
        if self.replacement:
            drawn = self._rng.integers(0, n, size=self.num_samples)
        else:
            whole, rest = divmod(self.num_samples, n)
            parts = [self._rng.permutation(n) for _ in range(whole)]
            parts.append(self._rng.permutation(n)[:rest])
            drawn = np.concatenate(parts)
        return iter(drawn.tolist())

    def __len__(self) -> int:
        return self.num_samples


class BatchSampler:
    """Groups the indices of ``sampler`` into lists of ``batch_size``."""

    def __init__(self, sampler: Iterable[int], batch_size: int, drop_last: bool) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if not isinstance(drop_last, bool):
            raise ValueError(f"drop_last must be a bool, got {drop_last!r}")
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last

    def __iter__(self) -> Iterator[list[int]]:
        batch: list[int] = []
        for index in self.sampler:
            batch.append(index)
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        if batch and not self.drop_last:
            yield batch

    def __len__(self) -> int:
        if self.drop_last:
            return len(self.sampler) // self.batch_size  # type: ignore[arg-type]
        return -(-len(self.sampler) // self.batch_size)  # type: ignore[arg-type]
