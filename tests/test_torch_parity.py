"""torch.utils.data.DataLoader parity: the same errors, the same batches, torch's samplers'
rules, and torch's worker seeding contract, each checked against torch itself."""

from __future__ import annotations

import importlib
import itertools
import os
import sys
from typing import Any

import numpy as np
import psutil
import pytest

from arena_loader import ArenaLoader, get_worker_info
from arena_loader._options import LoaderOptions
from arena_loader.samplers import (
    DistributedSampler,
    RandomSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from .datasets import (
    BatchedFetchDataset,
    ImageDataset,
    NestedDataset,
    WorkerProbeDataset,
    host_copy,
)


class LazyModule:
    """Imports a module on first attribute access. Importing torch when pytest collects this
    file would load it for the whole session and make every other test's leak check (two
    gc.collect() runs over torch's objects) and worker forks slower."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str) -> Any:
        return getattr(importlib.import_module(self._name), attribute)


torch = LazyModule("torch")
tud = LazyModule("torch.utils.data")

DATA = ImageDataset(10, shape=(3, 2), dtype=np.float32)


def make_stream():
    """An iterable-style dataset: torch's loader recognises it by its base class."""
    class Stream(tud.IterableDataset):
        def __iter__(self):
            return iter(np.arange(4))

    return Stream()


# ---------------------------------------------------------------------------------------------
# The same exception type as torch for every combination torch rejects, our message naming
# the parameter.

REJECTED = [
    (dict(num_workers=-1), r"num_workers must be >= 0, got -1"),
    (dict(num_workers="2"), r"num_workers must be an int, got str"),
    (dict(timeout=-1), r"timeout must be >= 0 seconds, got -1"),
    (dict(timeout="1"), r"timeout must be a number of seconds, got str"),
    (dict(prefetch_factor=2), r"prefetch_factor option could only be specified"),
    (dict(num_workers=2, prefetch_factor=-1), r"prefetch_factor must be >= 1, got -1"),
    (dict(num_workers=2, prefetch_factor="2"), r"prefetch_factor must be an int"),
    (dict(persistent_workers=True), r"persistent_workers option needs num_workers > 0"),
    (dict(sampler=[0, 1], shuffle=True), r"sampler option is mutually exclusive with shuffle"),
    (dict(batch_sampler=[[0]], batch_size=2), r"batch_sampler option is mutually exclusive"),
    (dict(batch_sampler=[[0]], shuffle=True), r"batch_sampler option is mutually exclusive"),
    (dict(batch_sampler=[[0]], sampler=[0]), r"batch_sampler option is mutually exclusive"),
    (dict(batch_sampler=[[0]], drop_last=True), r"batch_sampler option is mutually exclusive"),
    (dict(batch_size=None, drop_last=True), r"batch_size=None option .* drop_last"),
    (dict(batch_size=0), r"batch_size must be a positive int, got 0"),
    (dict(batch_size=-3), r"batch_size must be a positive int, got -3"),
    (dict(batch_size=2.5), r"batch_size must be a positive int, got 2.5"),
    (dict(drop_last="yes"), r"drop_last must be a bool .*'yes'"),
    (dict(num_workers=1, multiprocessing_context="threads"),
     r"multiprocessing_context must be a valid start method .*got 'threads'"),
    (dict(num_workers=1, multiprocessing_context=3),
     r"multiprocessing_context must be a start method name or a multiprocessing context"),
    (dict(multiprocessing_context="fork"),
     r"multiprocessing_context='fork' needs num_workers > 0"),
]

ITERABLE_REJECTED = [
    (dict(shuffle=True), r"expected unspecified shuffle option, but got shuffle=True"),
    (dict(sampler=[0, 1]), r"expected unspecified sampler option, but got sampler=\[0, 1\]"),
    (dict(batch_sampler=[[0]]), r"expected unspecified batch_sampler option"),
    (dict(sampler=[0], shuffle=True), r"expected unspecified shuffle option"),
]


def torch_error(dataset, kwargs) -> type[Exception]:
    with pytest.raises((TypeError, ValueError)) as raised:
        tud.DataLoader(dataset, **kwargs)
    return raised.type


@pytest.mark.parametrize("kwargs, pattern", REJECTED, ids=[str(k) for k, _ in REJECTED])
def test_invalid_combination_raises_torchs_exception_type(kwargs, pattern):
    """ArenaLoader raises the exception type torch's DataLoader raises, naming the parameter."""
    with pytest.raises(torch_error(DATA, kwargs), match=pattern):
        ArenaLoader(DATA, **kwargs)


@pytest.mark.parametrize("kwargs, pattern", ITERABLE_REJECTED,
                         ids=[str(k) for k, _ in ITERABLE_REJECTED])
def test_iterable_dataset_options_raise_torchs_exception_type(kwargs, pattern):
    """shuffle, sampler and batch_sampler with an iterable-style dataset: torch's ValueError."""
    with pytest.raises(torch_error(make_stream(), kwargs), match=pattern):
        LoaderOptions(iterable=True, **kwargs)


def test_iterable_dataset_options_raise_through_arena_loader():
    """The iterable-style checks above also guard ArenaLoader itself."""
    for kwargs, pattern in ITERABLE_REJECTED:
        with pytest.raises(ValueError, match=pattern):
            ArenaLoader(make_stream(), **kwargs)


def test_iterable_dataset_accepts_shuffle_false_like_torch():
    """shuffle=False (torch's old default) is not an error for an iterable-style dataset."""
    tud.DataLoader(make_stream(), shuffle=False)
    assert LoaderOptions(iterable=True, shuffle=False).iterable


def test_setting_sampling_attributes_after_construction_raises_like_torch():
    """batch_size, batch_sampler, sampler, drop_last, dataset and persistent_workers are fixed
    once the loader exists: setting one raises torch's ValueError instead of being ignored."""
    for attribute in ("batch_size", "batch_sampler", "sampler", "drop_last", "dataset",
                      "persistent_workers"):
        with pytest.raises(ValueError):
            setattr(tud.DataLoader(DATA), attribute, None)
        with ArenaLoader(DATA) as loader, pytest.raises(ValueError, match=attribute):
            setattr(loader, attribute, None)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kwargs", [
    dict(num_workers=np.int64(2)),
    dict(num_workers=np.int32(1), prefetch_factor=np.int64(3)),
    dict(num_workers=1, timeout=np.float32(30.0)),
    dict(num_workers=1, timeout=np.int64(30)),
], ids=["num_workers", "prefetch_factor", "timeout-float32", "timeout-int64"])
def test_numpy_numbers_are_options_as_in_torch(kwargs):
    """numpy integers for num_workers and prefetch_factor, and numpy numbers for timeout (a
    config computed with numpy), work in torch's DataLoader; they were a TypeError here.
    The attributes read back as passed, as torch's."""
    theirs = tud.DataLoader(DATA, batch_size=4, **kwargs)
    expected = [host_copy(batch) for batch in theirs]
    with ArenaLoader(DATA, batch_size=4, **kwargs) as loader:
        for name, value in kwargs.items():
            assert getattr(loader, name) is value and getattr(theirs, name) is value
        got = list(loader)
        assert len(got) == len(expected)
        for ours, reference in zip(got, expected):
            assert_same_batch(ours, reference, "batch")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kwargs", [
    dict(batch_size=3), dict(batch_size=3, drop_last=True, num_workers=2),
    dict(batch_size=4, shuffle=True, num_workers=2, persistent_workers=True),
    dict(batch_size=None), dict(batch_sampler=[[0, 1], [2], [3, 4, 5]], num_workers=1),
], ids=["in-process", "workers", "persistent", "unbatched", "batch_sampler"])
def test_an_iterator_has_the_length_of_torchs(kwargs):
    """len(iter(loader)) is the index sampler's length, as torch's iterators have it (code
    counts steps with len(it), tqdm(it) shows a total); it was a TypeError. An iterable-style
    dataset's iterator has none, as in torch."""
    theirs = tud.DataLoader(DATA, **kwargs)
    with ArenaLoader(DATA, **kwargs) as loader:
        for _ in range(2):  # a persistent iterator's second epoch too
            iterator = iter(loader)
            assert len(iterator) == len(iter(theirs)) == len(loader)
            next(iterator)
            assert len(iterator) == len(loader)  # torch's: the whole epoch's, not what is left
            del iterator
    stream = make_stream()
    with pytest.raises(TypeError):
        len(iter(tud.DataLoader(stream)))
    with ArenaLoader(stream) as loader, pytest.raises(TypeError):
        len(iter(loader))


def seed_numpy_per_worker(worker_id: int) -> None:
    np.random.seed(1234 + worker_id)


def draws_with_init_set_after_construction(cls) -> list[int]:
    loader = cls(WorkerProbeDataset(4), batch_size=2, num_workers=1)
    loader.worker_init_fn = seed_numpy_per_worker
    draws = [int(x) for batch in loader for x in batch["draw"]]
    if hasattr(loader, "close"):
        loader.close()
    return draws


@pytest.mark.timeout(60)
def test_options_torch_reads_at_iter_take_effect_when_set_after_construction():
    """torch's DataLoader reads timeout, worker_init_fn, multiprocessing_context (checked as
    its constructor checks it) and in_order when iter() makes a new iterator, so code sets
    them on a made loader (`loader.multiprocessing_context = "spawn"`). They were stored and
    silently ignored: the workers forked, without the init function."""
    assert draws_with_init_set_after_construction(ArenaLoader) == \
        draws_with_init_set_after_construction(tud.DataLoader)
    for cls in (tud.DataLoader, ArenaLoader):
        in_process = cls(DATA)
        in_process.timeout = 5
        with pytest.raises(AssertionError, match="_SingleProcessDataLoaderIter requires timeout"):
            iter(in_process)
        with pytest.raises(ValueError, match="can only be used with multi-process loading"):
            in_process.multiprocessing_context = "fork"
        loader = cls(DATA, batch_size=5, num_workers=1)
        with pytest.raises(ValueError, match="should specify a valid start method"):
            loader.multiprocessing_context = "threads"
        with pytest.raises(TypeError, match="should be a valid context object"):
            loader.multiprocessing_context = 3
        loader.multiprocessing_context = "forkserver"
        assert loader.multiprocessing_context.get_start_method() == "forkserver"
        if cls is ArenaLoader:
            iterator = iter(loader)
            # A forkserver's children are the server's, not this process's.
            assert all(psutil.Process(pid).ppid() != os.getpid()
                       for pid in iterator.worker_pids)
            assert len(list(iterator)) == 2
            loader.close()


def test_options_built_into_the_loader_cannot_be_set_after_construction():
    """What the slab, samplers, seeds and collation were built from cannot change (torch
    reads num_workers, collate_fn, prefetch_factor, pin_memory and generator at each
    iter()): setting one to another value is an error naming it, not a change ignored."""
    changes = dict(num_workers=1, collate_fn=list, prefetch_factor=3, pin_memory=True,
                   generator=7, slots=9, held_batch_limit=4, output="numpy", device="cpu:0",
                   worker_mode="thread", worker_threads=2)
    with ArenaLoader(DATA, batch_size=5) as loader:
        for name, value in changes.items():
            before = getattr(loader, name)
            with pytest.raises(ValueError, match=f"{name} cannot be changed after ArenaLoader "
                                                 "is initialized"):
                setattr(loader, name, value)
            assert getattr(loader, name) == before
            setattr(loader, name, before)  # the value it has: nothing changes
        assert [batch.shape for batch in loader] == [(5, 3, 2), (5, 3, 2)]


# ---------------------------------------------------------------------------------------------
# Conformance: the same configuration through both loaders gives the same batches.

def assert_same_batch(ours, theirs, where: str) -> None:
    """Same structure, dtype, shape and values. A tuple sample collates to a list in torch and
    to a tuple here (see test_tuple_samples_collate_to_a_list_like_torch)."""
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and ours.keys() == theirs.keys(), where
        for key in theirs:
            assert_same_batch(ours[key], theirs[key], f"{where}[{key!r}]")
    elif isinstance(theirs, tuple) and hasattr(theirs, "_fields"):
        assert type(ours) is type(theirs), f"{where}: {type(ours)} != {type(theirs)}"
        for field, (a, b) in zip(theirs._fields, zip(ours, theirs)):  # namedtuple's public API
            assert_same_batch(a, b, f"{where}.{field}")
    elif isinstance(theirs, list) and theirs and isinstance(theirs[0], str):
        assert list(ours) == theirs, where
    elif isinstance(theirs, (list, tuple)):
        assert isinstance(ours, (list, tuple)) and len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_same_batch(a, b, f"{where}[{i}]")
    else:
        assert isinstance(ours, np.ndarray), f"{where}: {type(ours)}"
        assert ours.dtype == theirs.dtype, f"{where}: {ours.dtype} != {theirs.dtype}"
        assert ours.shape == theirs.shape, f"{where}: {ours.shape} != {theirs.shape}"
        np.testing.assert_array_equal(ours, theirs, err_msg=where)


def seeded_random_sampler(dataset, seed=0):
    return tud.RandomSampler(dataset, generator=torch.Generator().manual_seed(seed))


# Each entry: (dataset, a function making fresh keyword arguments for one loader). Samplers are
# made anew per loader, from the same seed, so both loaders see the same index stream.
CONFIGURATIONS = {
    "sequential": (DATA, lambda: dict(batch_size=3)),
    "drop_last": (DATA, lambda: dict(batch_size=3, drop_last=True)),
    "seeded_sampler": (DATA, lambda: dict(batch_size=4, sampler=seeded_random_sampler(DATA))),
    "seeded_sampler_with_replacement": (DATA, lambda: dict(batch_size=3, sampler=tud.RandomSampler(
        DATA, replacement=True, num_samples=17, generator=torch.Generator().manual_seed(1)))),
    "batch_sampler": (DATA, lambda: dict(batch_sampler=tud.BatchSampler(
        seeded_random_sampler(DATA, 2), batch_size=3, drop_last=False))),
    "batch_size_none": (DATA, lambda: dict(batch_size=None)),
    "batch_size_none_with_sampler": (DATA, lambda: dict(
        batch_size=None, sampler=seeded_random_sampler(DATA, 3))),
    "nested_samples": (NestedDataset(11), lambda: dict(batch_size=4)),
    "getitems": (BatchedFetchDataset(10, shape=(2,), dtype=np.int64),
                 lambda: dict(batch_size=4)),
    "distributed_sampler": (DATA, lambda: dict(batch_size=2, sampler=tud.DistributedSampler(
        DATA, num_replicas=3, rank=1, shuffle=False))),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("name", list(CONFIGURATIONS))
def test_batches_equal_torch_dataloader(name, num_workers):
    """Every batch of two epochs equals torch's, element-wise, with torch's dtypes."""
    dataset, make_kwargs = CONFIGURATIONS[name]
    theirs_loader = tud.DataLoader(dataset, num_workers=num_workers, **make_kwargs())
    theirs = [[host_copy(batch) for batch in theirs_loader] for _ in range(2)]
    del theirs_loader
    with ArenaLoader(dataset, num_workers=num_workers, **make_kwargs()) as loader:
        for epoch in range(2):
            count = 0
            for i, batch in enumerate(loader):
                assert_same_batch(batch, theirs[epoch][i], f"{name} epoch {epoch} batch {i}")
                count += 1
            assert count == len(theirs[epoch]) == len(loader), f"{name} epoch {epoch}"


class InfiniteBatches:
    """A batch sampler without end or ``__len__`` (iteration-based training), drawing each
    batch from torch's RNG as it is asked for; ``batch_size``: an attribute that is not the
    row count (a token budget, a list of bucket sizes), or none."""

    def __init__(self, batch_size: Any = None) -> None:
        if batch_size is not None:
            self.batch_size = batch_size

    def __iter__(self):
        while True:
            yield torch.randint(0, 10, (int(torch.randint(1, 5, ())),)).tolist()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("batch_size", [None, 10**9, 2.5, [2, 4]],
                         ids=["none", "huge", "float", "list"])
def test_a_batch_sampler_is_drawn_as_torch_draws_it(num_workers, batch_size):
    """A user batch sampler is asked for batches as torch asks (at each next(), or a
    prefetch window ahead with workers), so an infinite one works and a lazy one draws from
    torch's RNG between the user's draws as with torch. Its first epoch was drawn whole at
    the first iter() to size the workers' index entries (an infinite one: a hang), and its
    batch_size attribute, when it had one, sized them instead (10**9: a ShmCapacityError,
    2.5 or a list: a TypeError)."""
    def run(cls):
        torch.manual_seed(0)
        loader = cls(DATA, batch_sampler=InfiniteBatches(batch_size), num_workers=num_workers)
        epochs = []
        for _ in range(2):
            iterator = iter(loader)
            batches = [host_copy(next(iterator))]
            drawn = torch.rand(2).tolist()  # between the batches, as a training step draws
            batches += [host_copy(next(iterator)) for _ in range(5)]
            epochs.append((batches, drawn))
            del iterator
        if hasattr(loader, "close"):
            loader.close()
        return epochs

    theirs, ours = run(tud.DataLoader), run(ArenaLoader)
    for (their_batches, their_draw), (our_batches, our_draw) in zip(theirs, ours):
        assert our_draw == their_draw
        for mine, reference in zip(our_batches, their_batches, strict=True):
            assert_same_batch(mine, reference, "batch")


class CountedBatches:
    """A finite lazy batch sampler that draws each batch from torch's RNG as it is asked."""

    def __init__(self, batches: int) -> None:
        self.batches = batches

    def __iter__(self):
        for _ in range(self.batches):
            yield torch.randint(0, 10, (3,)).tolist()

    def __len__(self) -> int:
        return self.batches


@pytest.mark.timeout(60)
def test_a_for_loop_draws_the_sampler_as_torch_with_the_default_slots():
    """A ``for`` loop holds its last batch while asking for the next; with the default slots
    (the read-ahead + 1) the window's last send then waits for that batch's slot until the
    next ``next()``. The sampler must still be drawn as torch draws it: a training step that
    draws from torch's RNG between batches gets torch's numbers, and the batches are torch's,
    epoch after epoch."""
    def run(cls):
        torch.manual_seed(0)
        loader = cls(DATA, batch_sampler=CountedBatches(24), num_workers=2,
                     persistent_workers=True)
        seen = []
        for _ in range(2):
            for batch in loader:  # (the loop holds `batch` through the next next())
                seen.append((host_copy(batch), torch.rand(1).item()))
        if hasattr(loader, "close"):
            assert loader.slots == 2 * 2 + 1
            loader.close()
        return seen

    theirs, ours = run(tud.DataLoader), run(ArenaLoader)
    assert len(ours) == len(theirs) == 48
    for (mine, my_draw), (reference, their_draw) in zip(ours, theirs, strict=True):
        assert my_draw == their_draw
        assert_same_batch(mine, reference, "batch")


class TupleDataset(ImageDataset):
    """Plain-tuple samples."""

    def __getitem__(self, index):
        return (super().__getitem__(index), index)


def test_tuple_samples_keep_their_type_in_numpy_and_become_lists_in_torch_output():
    """A plain-tuple sample collates to a tuple of arrays with output="numpy" (documented:
    the sample's own container), and to torch's list of tensors with output="torch"."""
    dataset = TupleDataset(4, shape=(2,))
    theirs = next(iter(tud.DataLoader(dataset, batch_size=2)))
    with ArenaLoader(dataset, batch_size=2) as loader:
        assert type(next(iter(loader))) is tuple
    with ArenaLoader(dataset, batch_size=2, output="torch") as loader:
        ours = next(iter(loader))
    assert type(ours) is type(theirs) is list
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


# ---------------------------------------------------------------------------------------------
# Samplers: torch's index lists where torch is deterministic, torch's properties elsewhere.

def test_distributed_sampler_without_shuffle_equals_torch():
    """Every rank's index list equals torch's, padding and truncation included."""
    for size in (0, 1, 5, 10, 11, 12):
        for num_replicas in (1, 3, 4, 13):
            for drop_last, rank in itertools.product((False, True), range(num_replicas)):
                where = f"size={size} num_replicas={num_replicas} drop_last={drop_last} rank={rank}"
                ours = DistributedSampler(range(size), num_replicas, rank, shuffle=False,
                                          drop_last=drop_last)
                theirs = tud.DistributedSampler(range(size), num_replicas, rank, shuffle=False,
                                                drop_last=drop_last)
                assert list(ours) == list(theirs), where
                assert len(ours) == len(theirs) and ours.total_size == theirs.total_size, where


def shuffled_shares(size, num_replicas, drop_last=False, seed=0, epoch=0):
    shares = []
    for rank in range(num_replicas):
        sampler = DistributedSampler(range(size), num_replicas, rank, shuffle=True, seed=seed,
                                     drop_last=drop_last)
        sampler.set_epoch(epoch)
        shares.append(list(sampler))
    return shares


def test_distributed_shuffle_splits_the_dataset_between_ranks():
    """Equal shares, disjoint but for padding, covering the dataset; truncated with drop_last."""
    for size, num_replicas in [(12, 4), (13, 4), (10, 3), (2, 3)]:
        where = f"size={size} num_replicas={num_replicas}"
        shares = shuffled_shares(size, num_replicas)
        per_rank = -(-size // num_replicas)
        assert all(len(share) == per_rank for share in shares), where
        flat = [i for share in shares for i in share]
        assert set(flat) == set(range(size)), where
        assert len(flat) - len(set(flat)) == per_rank * num_replicas - size, where  # padding
        truncated = [i for share in shuffled_shares(size, num_replicas, drop_last=True)
                     for i in share]
        assert len(truncated) == len(set(truncated)) == size // num_replicas * num_replicas


@pytest.mark.parametrize("torch_imported", [True, False])
def test_distributed_shuffle_depends_only_on_seed_and_epoch(torch_imported, monkeypatch):
    """The same (seed, epoch) reproduces the order; a new epoch or seed changes it; in a
    program without torch too (numpy's permutation of (seed, epoch))."""
    if not torch_imported:
        monkeypatch.setitem(sys.modules, "torch", None)  # (as the sampler sees no torch)
    first = shuffled_shares(50, 2, seed=3, epoch=0)
    assert first == shuffled_shares(50, 2, seed=3, epoch=0)
    assert first != shuffled_shares(50, 2, seed=3, epoch=1)
    assert first != shuffled_shares(50, 2, seed=4, epoch=0)
    sampler = DistributedSampler(range(50), 2, 0, seed=3)
    assert list(sampler) == list(sampler) == first[0]  # re-iterating without set_epoch
    sampler.set_epoch(1)
    assert list(sampler) != first[0] and sorted(sampler) != sorted(first[0])


def test_distributed_rank_out_of_range_raises_like_torch():
    """A rank outside [0, num_replicas) is torch's ValueError, naming rank and num_replicas."""
    for num_replicas, rank in [(4, 4), (4, -1), (2, 7)]:
        with pytest.raises(ValueError):
            tud.DistributedSampler(range(8), num_replicas, rank)
        with pytest.raises(ValueError, match=rf"rank must be in \[0, num_replicas - 1\] = "
                                             rf"\[0, {num_replicas - 1}\], got rank={rank} with "
                                             rf"num_replicas={num_replicas}"):
            DistributedSampler(range(8), num_replicas, rank)
    for num_replicas in (0, -2, True, 2.0):  # (torch: an "Invalid rank" ValueError, or none)
        with pytest.raises(ValueError, match=rf"num_replicas must be a positive int, got "
                                             rf"{num_replicas!r}$"):
            DistributedSampler(range(8), num_replicas, 0)
    for seed in (True, "3", 1.5):  # (torch's fails later, in iter(): manual_seed(seed + epoch))
        with pytest.raises(TypeError, match=rf"seed must be an int, got {type(seed).__name__}"):
            DistributedSampler(range(8), 2, 0, seed=seed)


def test_distributed_sampler_takes_numpy_integers_like_torch():
    """num_replicas and rank as numpy integers (a launcher's config read with numpy) give
    torch's share; they were a ValueError ("num_replicas must be a positive int")."""
    for shuffle in (False, True):
        theirs = tud.DistributedSampler(range(11), np.int64(3), np.int32(2), shuffle=shuffle)
        ours = DistributedSampler(range(11), np.int64(3), np.int32(2), shuffle=shuffle)
        assert list(ours) == list(theirs) and len(ours) == len(theirs) == 4
        assert ours.num_replicas == 3 and ours.rank == 2


def test_distributed_defaults_come_from_torchrun_environment(monkeypatch):
    """Without torch.distributed initialised, WORLD_SIZE and RANK give the defaults."""
    assert not torch.distributed.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    sampler = DistributedSampler(range(9), shuffle=False)
    assert (sampler.num_replicas, sampler.rank) == (3, 2)
    assert list(sampler) == [2, 5, 8]
    assert DistributedSampler(range(9), rank=0).rank == 0  # an explicit value wins
    monkeypatch.setenv("RANK", "two")
    with pytest.raises(ValueError, match=r"rank must be an int; .* RANK .*'two'"):
        DistributedSampler(range(9))
    monkeypatch.delenv("RANK")
    with pytest.raises(ValueError, match=r"rank must be given .* RANK is not set.*pass rank="):
        DistributedSampler(range(9))
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ValueError, match=r"num_replicas must be given .* WORLD_SIZE"):
        DistributedSampler(range(9), rank=0)


def test_subset_random_sampler_permutes_the_subset():
    """Each iter() is a permutation of the subset; a seed reproduces it; epochs differ."""
    indices = [3, 17, 4, 99, 42, 8, 23, 61]
    sampler = SubsetRandomSampler(indices, generator=1)
    epochs = [list(sampler) for _ in range(3)]
    assert all(sorted(epoch) == sorted(indices) for epoch in epochs)
    assert len(sampler) == len(indices)
    assert len({tuple(epoch) for epoch in epochs}) > 1
    again = SubsetRandomSampler(indices, generator=1)
    assert [list(again) for _ in range(3)] == epochs
    torch_seeded = [list(SubsetRandomSampler(indices, torch.Generator().manual_seed(4)))
                    for _ in range(2)]
    assert torch_seeded[0] == torch_seeded[1]


@pytest.mark.parametrize("loader_draws", [False, True])
def test_a_numpy_drawn_random_sampler_covers_every_index_as_torchs_does(loader_draws):
    """Drawn from numpy (an int seed): ``num_samples`` past the dataset's length is whole
    permutations and then part of one (each index ``num_samples // n`` or one time more, as
    torch's), and with ``replacement`` every index can be drawn, the last one too. Drawn by
    the sampler's ``iter()`` and by a loader's batches (one array for the epoch)."""
    def drawn(sampler):
        if not loader_draws:
            return list(sampler)
        return [int(i) for batch in ArenaLoader(np.arange(5), batch_size=4, sampler=sampler)
                for i in np.asarray(batch)]

    counts = np.bincount(drawn(RandomSampler(range(5), num_samples=11, generator=0)),
                         minlength=5)
    assert counts.sum() == 11 and set(counts) == {2, 3}
    with_replacement = drawn(RandomSampler(range(5), replacement=True, num_samples=400,
                                           generator=0))
    assert len(with_replacement) == 400 and set(with_replacement) == set(range(5))


class _KeyTypes:
    """Sample ``i`` is ``[i, 1 if the key was a numpy integer else 0]``."""

    def __len__(self):
        return 8

    def __getitem__(self, index):
        return np.array([int(index), isinstance(index, np.integer)], np.int64)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("batches", [
    lambda: [[np.int64(i), np.int64(i + 1)] for i in range(0, 8, 2)],
    lambda: [np.arange(i, i + 2) for i in range(0, 8, 2)],
], ids=["lists_of_numpy_ints", "numpy_arrays"])
def test_a_batch_samplers_numpy_keys_reach_the_dataset_as_torchs_do(batches, num_workers):
    """A batch_sampler of the user's yielding numpy integers (lists of them, or arrays): the
    dataset gets numpy integers, as from torch's DataLoader, not Python ints."""
    def keys(cls):
        return [np.asarray(b).tolist() for b in cls(_KeyTypes(), batch_sampler=batches(),
                                                     num_workers=num_workers)]

    assert keys(ArenaLoader) == keys(tud.DataLoader)
    assert all(flag == 1 for batch in keys(ArenaLoader) for _, flag in batch)


def test_weighted_random_sampler_follows_the_weights():
    """Zero weights are never drawn; frequencies follow the weights; a seed reproduces."""
    weights = [0.0, 1.0, 3.0, 0.0, 6.0]
    sampler = WeightedRandomSampler(weights, 20_000, generator=0)
    drawn = np.array(list(sampler))
    assert len(drawn) == len(sampler) == 20_000
    counts = np.bincount(drawn, minlength=5)
    assert counts[0] == counts[3] == 0
    np.testing.assert_allclose(counts / 20_000, [0, 0.1, 0.3, 0, 0.6], atol=0.02)
    assert list(WeightedRandomSampler(weights, 50, generator=0)) == drawn[:50].tolist()


def test_weighted_random_sampler_without_replacement_draws_distinct_indices():
    """replacement=False: distinct indices, only among the positive weights."""
    weights = [5.0, 0.0, 1.0, 1.0, 0.5, 2.0]
    for seed in range(20):
        drawn = list(WeightedRandomSampler(weights, 5, replacement=False, generator=seed))
        assert len(set(drawn)) == 5 and 1 not in drawn


# (args, kwargs, our message, whether torch's sampler rejects it at construction too)
WEIGHTED_REJECTED = [
    (([1.0, 2.0], 0), {}, r"num_samples must be a positive int, got 0", True),
    (([1.0, 2.0], True), {}, r"num_samples must be a positive int, got True", True),
    (([1.0, 2.0], 2), dict(replacement=1), r"replacement must be a bool", True),
    (([[1.0], [2.0]], 2), {}, r"weights must be a 1-d sequence .*shape \(2, 1\)", True),
    (([1.0, -2.0], 2), {}, r"weights must be finite and >= 0, got weights\[1\]=-2\.0", False),
    (([1.0, float("nan")], 2), {}, r"weights must be finite .*weights\[1\]=nan", False),
    (([0.0, 0.0], 2), {}, r"weights must have at least one positive entry", False),
    (([1.0, 0.0, 1.0], 3), dict(replacement=False),
     r"num_samples must be <= the 2 positive weights when replacement=False, got 3", False),
    (("abc", 2), {}, r"weights must be a 1-d sequence of numbers", False),
]


def test_weighted_random_sampler_rejects_bad_input_at_construction():
    """Bad weights, num_samples or replacement raise ValueError naming the parameter, the type
    torch's sampler raises (torch finds bad weight values only when iterating)."""
    for args, kwargs, pattern, torch_rejects in WEIGHTED_REJECTED:
        if torch_rejects:
            with pytest.raises(ValueError):
                tud.WeightedRandomSampler(*args, **kwargs)
        with pytest.raises(ValueError, match=pattern):
            WeightedRandomSampler(*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# Worker seeding: torch's contract for get_worker_info() and the RNGs in workers.

def probe_epochs(epochs: int, **kwargs) -> list[list[dict]]:
    """Per epoch, per sample: the worker id, its seed and numpy draw, as plain Python."""
    with ArenaLoader(WorkerProbeDataset(16), batch_size=2, num_workers=2, **kwargs) as loader:
        return [[{key: batch[key][row] if key == "seed" else batch[key][row].item()
                  for key in batch}
                 for batch in loader for row in range(len(batch["draw"]))]
                for _ in range(epochs)]


@pytest.mark.timeout(60)
def test_every_batch_sees_torchs_worker_info():
    """Every batch, the first included, is loaded by a worker whose WorkerInfo has torch's
    fields: id, num_workers, seed = base seed + id, and the worker's copy of the dataset."""
    assert get_worker_info() is None
    (samples,) = probe_epochs(1)
    assert len(samples) == 16
    assert all(s["worker"] in (0, 1) and s["num_workers"] == 2 and s["holds_dataset"]
               for s in samples)
    seeds = {s["worker"]: int(s["seed"]) for s in samples}
    assert seeds[1] == seeds[0] + 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("make_generator", [
    lambda seed: torch.Generator().manual_seed(seed),
    np.random.default_rng,
], ids=["torch_generator", "numpy_generator"])
def test_worker_random_numbers_differ_by_worker_and_epoch_and_reproduce(make_generator):
    """numpy draws in __getitem__ differ between workers and between epochs, and two loaders
    with generators seeded alike draw the same numbers."""
    def worker_draws(seed):
        return [[(s["worker"], s["seed"], s["draw"]) for s in epoch]
                for epoch in probe_epochs(2, generator=make_generator(seed))]

    first, again, other = worker_draws(11), worker_draws(11), worker_draws(12)
    assert first == again
    assert first != other
    for epoch in first:
        by_worker = {worker: {draw for w, _, draw in epoch if w == worker} for worker in (0, 1)}
        assert by_worker[0] and by_worker[1] and by_worker[0].isdisjoint(by_worker[1])
    # A new epoch draws a new base seed: new worker seeds, new numbers.
    assert {seed for _, seed, _ in first[0]}.isdisjoint({seed for _, seed, _ in first[1]})
    assert {d for *_, d in first[0]}.isdisjoint({d for *_, d in first[1]})


@pytest.mark.timeout(60)
def test_worker_seed_equals_torchs_for_the_same_torch_generator():
    """Switching loaders keeps worker seeds: the same generator gives torch's base seed."""
    theirs = tud.DataLoader(WorkerProbeDataset(4), batch_size=2, num_workers=2,
                            generator=torch.Generator().manual_seed(9))
    their_seeds = {int(b["worker"][0]): int(b["seed"][0]) for b in theirs}
    ours = probe_epochs(1, generator=torch.Generator().manual_seed(9))[0]
    assert {s["worker"]: int(s["seed"]) for s in ours} == their_seeds


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (1, False), (1, True)])
def test_an_iterator_refuses_copy_and_pickle_as_torchs_and_goes_on(num_workers, persistent):
    """torch's iterators raise NotImplementedError for copy.copy, copy.deepcopy and pickle.
    Ours: copy.copy made a shallow twin sharing the epoch's state (with num_workers=0 the
    twin and the original handed out the same batch), a RecursionError with persistent
    workers; deepcopy and pickle raised TypeError / AttributeError about their insides. The
    original goes on with the rest of its epoch."""
    import copy
    import pickle

    with ArenaLoader(DATA, batch_size=2, num_workers=num_workers,
                     persistent_workers=persistent) as loader:
        iterator = iter(loader)
        first = np.asarray(next(iterator)).tolist()
        for how in (copy.copy, copy.deepcopy, pickle.dumps):
            with pytest.raises(NotImplementedError, match="cannot be pickled or copied"):
                how(iterator)
        rest = [np.asarray(b).tolist() for b in iterator]
    assert [first, *rest] == [np.asarray(b).tolist() for b in tud.DataLoader(DATA, batch_size=2)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("how", "num_workers", "persistent"), [
    ("deepcopy", 0, False), ("pickle", 1, False), ("deepcopy", 1, True)])
def test_a_loader_deep_copies_and_pickles_as_torchs_does(how, num_workers, persistent):
    """torch's DataLoader pickles its ``__dict__``: the dataset, samplers and generator as
    they are now (``copy.deepcopy``, ``mp.spawn(fn, args=(loader,))``, a spawn Pool). Ours
    raised TypeError (an RLock; a local function). The copy gives the epochs torch's copy
    gives, from a slab of its own, and leaves the original's order as torch's leaves it.
    torch refuses a loader whose persistent workers run: those copy before any epoch."""
    import copy
    import pickle

    clone = copy.deepcopy if how == "deepcopy" else (lambda x: pickle.loads(pickle.dumps(x)))

    def epochs(loader_cls):
        torch.manual_seed(0)
        loader = loader_cls(DATA, batch_size=3, shuffle=True, num_workers=num_workers,
                            persistent_workers=persistent,
                            generator=torch.Generator().manual_seed(5))
        seen = [] if persistent else [[np.asarray(b).tolist() for b in loader]]
        twin = clone(loader)
        for one in (twin, loader, twin):
            seen.append([np.asarray(b).tolist() for b in one])
        if loader_cls is ArenaLoader:
            assert twin.snapshot().slab_address != loader.snapshot().slab_address
            twin.close()
            loader.close()
        return seen

    assert epochs(ArenaLoader) == epochs(tud.DataLoader)
