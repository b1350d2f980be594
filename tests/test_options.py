"""Option validation: torch's errors for torch's bad combinations, plus ours."""

from __future__ import annotations

import pytest

from arena_loader import ArenaLoader
from arena_loader.samplers import BatchSampler, RandomSampler, SequentialSampler

from .datasets import ImageDataset

DATA = ImageDataset(10)


# Combinations torch rejects too are in test_torch_parity.py, checked against torch itself;
# these are the ones only ArenaLoader rejects.
@pytest.mark.parametrize("kwargs, error, pattern", [
    (dict(num_workers=1.5), TypeError, r"num_workers must be an int"),
    (dict(timeout=True), TypeError, r"timeout must be a number of seconds, got bool"),
    # (torch takes 0, so its "should be non-negative" would be wrong here: ours alone)
    (dict(num_workers=1, prefetch_factor=0), ValueError, r"^prefetch_factor must be >= 1, "
                                                         r"got 0; use prefetch_factor=None"),
    (dict(batch_size=0), ValueError, r"batch_size must be a positive int, got 0; use "
                                     r"batch_size=None to disable automatic batching"),
    (dict(slots=0), ValueError, r"slots must be >= 1, got 0; pass a positive int, or "
                                r"slots=None"),
    (dict(held_batch_limit=0), ValueError, r"held_batch_limit must be >= 1, got 0"),
    (dict(generator="seed"), TypeError, r"generator must be None, an int seed"),
])
def test_invalid_options_raise_named_errors(kwargs, error, pattern):
    """Each bad option or combination raises at construction, naming the parameter."""
    with pytest.raises(error, match=pattern):
        ArenaLoader(DATA, **kwargs)


def test_torch_defaults_and_attributes():
    """Attributes a torch user reads are there with torch's defaults."""
    loader = ArenaLoader(DATA)
    assert loader.batch_size == 1 and loader.num_workers == 0 and not loader.drop_last
    assert isinstance(loader.sampler, SequentialSampler)
    assert isinstance(loader.batch_sampler, BatchSampler)
    assert len(loader) == 10
    assert loader.collate_fn is None and loader.timeout == 0 and loader.prefetch_factor is None
    assert not loader.persistent_workers and loader.in_order and loader.slots == 2
    assert loader.held_batch_limit is None and loader.output is None
    assert ArenaLoader(DATA, num_workers=8).slots == 2 * 8 + 1
    assert ArenaLoader(DATA, num_workers=2, prefetch_factor=4).slots == 4 * 2 + 1
    shuffled = ArenaLoader(DATA, batch_size=3, shuffle=True, drop_last=True)
    assert isinstance(shuffled.sampler, RandomSampler) and len(shuffled) == 3


def test_random_sampler_replacement_and_num_samples():
    """RandomSampler draws num_samples indices in range, reproducibly for a seed."""
    sampler = RandomSampler(DATA, replacement=True, num_samples=25, generator=3)
    drawn = list(sampler)
    assert len(drawn) == len(sampler) == 25 and all(0 <= i < 10 for i in drawn)
    assert drawn == list(RandomSampler(DATA, replacement=True, num_samples=25, generator=3))
    longer = list(RandomSampler(DATA, num_samples=23, generator=1))
    assert len(longer) == 23 and sorted(longer[:20]) == sorted(list(range(10)) * 2)


def test_empty_or_unsized_dataset_with_shuffle_raises_torchs_error_at_construction():
    """shuffle=True makes a RandomSampler, which reads the dataset's length at construction,
    as torch's does: an empty dataset is torch's ValueError, one without len() its TypeError
    (both were accepted: an empty epoch, or the TypeError only at iter())."""
    tud = pytest.importorskip("torch.utils.data")

    class Unsized:
        def __getitem__(self, index):
            return index

    torch_text = r"^num_samples should be a positive integer value, but got num_samples=0"
    for dataset, error, theirs, ours in (
            (ImageDataset(0), ValueError, torch_text,
             torch_text + r" \(num_samples must be a positive int, got 0\)"),
            (Unsized(), TypeError, r"has no len\(\)", r"has no len\(\)")):
        with pytest.raises(error, match=theirs):
            tud.DataLoader(dataset, batch_size=2, shuffle=True)
        with pytest.raises(error, match=ours):
            ArenaLoader(dataset, batch_size=2, shuffle=True)
        with pytest.raises(error, match=ours):
            RandomSampler(dataset)


@pytest.mark.parametrize("make", [lambda: (i for i in range(4)), lambda: map(int, range(4)),
                                  lambda: iter([0, 1, 2, 3])],
                         ids=["generator", "map", "list_iterator"])
def test_a_one_shot_iterator_as_dataset_is_torchs_type_error_naming_the_fix(make):
    """A generator (or any iterator) passed as the dataset: torch's TypeError (torch takes it
    for a map-style dataset without len()), here at construction with the fix. Before: taken
    for an iterable-style dataset, its first epoch used it up and every later epoch was
    empty without a word (found by trial22)."""
    tud = pytest.importorskip("torch.utils.data")

    with pytest.raises(TypeError, match=r"has no len\(\)"):
        list(tud.DataLoader(make(), batch_size=2))
    name = type(make()).__name__
    with pytest.raises(TypeError, match=rf"^object of type '{name}' has no len\(\) \(torch's "
                                        rf"words\): dataset is a one-shot iterator.*later epoch "
                                        r"empty; pass a list"):
        ArenaLoader(make(), batch_size=2)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_empty_dataset_yields_nothing(num_workers):
    """An empty dataset (not shuffled, or shuffled by a sampler of the caller's over indices
    that are gone) is an empty epoch, not a ZeroDivisionError."""
    shrinking = list(range(4))
    sampler = RandomSampler(shrinking)
    shrinking.clear()
    for options in (dict(), dict(sampler=sampler)):
        with ArenaLoader(ImageDataset(0), batch_size=2, num_workers=num_workers,
                         **options) as loader:
            assert list(loader) == [] and len(loader) == 0
