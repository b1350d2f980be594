"""torch parity, round 2: each case is built with torch's DataLoader and with ArenaLoader, and
the two must agree: constructor errors (type, torch's text inside ours), warnings, crash
messages, pickled exceptions, attributes, sample order for a seed, and DataPipe sharding."""

from __future__ import annotations

import errno
import inspect
import os
import pickle
import re
import signal
import subprocess
import sys
import typing
import warnings
from pathlib import Path

import numpy as np
import pytest

import arena_loader.errors
import arena_loader.loader
from arena_loader import ArenaLoader
from arena_loader.errors import LayoutError, SampleShapeError, WorkerCrashedError
from arena_loader.samplers import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from . import zygote
from .datasets import ImageDataset, SuicidalDataset
from .test_parity3 import torch_error
from .test_torch_parity import probe_epochs, torch, tud

DATA = ImageDataset(10, shape=(2,), dtype=np.int64)


class IndexDataset:
    """Sample ``i`` is ``i``: batches read as the indices that made them."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.int64:
        return np.int64(index)


class ExitingDataset(IndexDataset):
    """The worker loading index 3 exits with code 3 (no exception, no signal)."""

    def __getitem__(self, index: int) -> np.int64:
        if index == 3:
            os._exit(3)
        return super().__getitem__(index)


def make_stream(n: int = 4, claimed_len: int | None = None):
    """A torch IterableDataset yielding 0..n-1, whose __len__ (if given) says ``claimed_len``."""
    class Stream(tud.IterableDataset):
        def __iter__(self):
            return iter(np.arange(n))

    if claimed_len is not None:
        Stream.__len__ = lambda self: claimed_len
    return Stream()


def flat(loader) -> list[int]:
    """Every sample of one epoch, in order, as ints (torch tensors and numpy arrays alike)."""
    return [int(x) for batch in loader for x in np.asarray(batch).reshape(-1)]


# ---------------------------------------------------------------------------------------------
# Constructor errors: torch's exception type, torch's message verbatim inside ours.

MAP_REJECTED = [
    dict(num_workers=-1),
    dict(timeout=-1),
    dict(timeout=-0.5),
    dict(prefetch_factor=2),
    dict(num_workers=2, prefetch_factor=-1),
    dict(persistent_workers=True),
    dict(sampler=[0, 1], shuffle=True),
    dict(batch_sampler=[[0]], batch_size=2),
    dict(batch_sampler=[[0]], shuffle=True),
    dict(batch_sampler=[[0]], sampler=[0]),
    dict(batch_sampler=[[0]], drop_last=True),
    dict(batch_size=None, drop_last=True),
    dict(batch_size=0),
    dict(batch_size=-3),
    dict(batch_size=2.5),
    dict(drop_last="yes"),
    dict(num_workers=1, multiprocessing_context="threads"),
    dict(num_workers=1, multiprocessing_context=3),
    dict(multiprocessing_context="fork"),
    dict(multiprocessing_context="spawn", persistent_workers=True),
]
ITERABLE_REJECTED = [
    dict(shuffle=True),
    dict(sampler=[0, 1]),
    dict(batch_sampler=[[0]]),
    dict(sampler=[0], shuffle=True),
]


def torch_rejection(dataset, kwargs) -> tuple[type[Exception], str]:
    with pytest.raises((TypeError, ValueError)) as raised:
        tud.DataLoader(dataset, **kwargs)
    return raised.type, str(raised.value)


def test_constructor_error_has_torchs_type_and_contains_torchs_message():
    """Every option combination torch rejects (map-style and iterable-style datasets) raises
    torch's type, with torch's text inside ours, and ours adds the value or the fix."""
    stream = make_stream()
    cases = [(DATA, kwargs) for kwargs in MAP_REJECTED]
    cases += [(stream, kwargs) for kwargs in ITERABLE_REJECTED]
    for dataset, kwargs in cases:
        error_type, torch_message = torch_rejection(dataset, kwargs)
        with pytest.raises(error_type) as raised:
            ArenaLoader(dataset, **kwargs)
        assert torch_message in str(raised.value), kwargs
        assert str(raised.value) != torch_message, kwargs


SAMPLER_REJECTED = [
    ("RandomSampler", (range(3),), dict(replacement=1)),
    ("RandomSampler", (range(3),), dict(num_samples=0)),
    ("BatchSampler", (range(3), 0, False), {}),
    ("BatchSampler", (range(3), 2, "no"), {}),
    ("WeightedRandomSampler", ([1.0, 2.0], 0), {}),
    ("WeightedRandomSampler", ([1.0, 2.0], 2), dict(replacement=1)),
    ("WeightedRandomSampler", ([[1.0, 2.0]], 2), {}),
    ("DistributedSampler", (range(4),), dict(num_replicas=2, rank=2)),
    ("DistributedSampler", (range(4),), dict(num_replicas=2, rank=-1)),
]


def test_sampler_error_has_torchs_type_and_contains_torchs_message():
    """The samplers reject what torch's reject, with torch's type and torch's text inside."""
    ours_by_name = {"RandomSampler": RandomSampler, "BatchSampler": BatchSampler,
                    "WeightedRandomSampler": WeightedRandomSampler,
                    "DistributedSampler": DistributedSampler}
    for name, args, kwargs in SAMPLER_REJECTED:
        with pytest.raises((TypeError, ValueError)) as theirs:
            getattr(tud, name)(*args, **kwargs)
        with pytest.raises(theirs.type) as ours:
            ours_by_name[name](*args, **kwargs)
        assert str(theirs.value) in str(ours.value), (name, kwargs)


# ---------------------------------------------------------------------------------------------
# Warnings: torch's category and text.

def test_more_workers_than_cpus_warns_like_torch():
    """num_workers above the CPUs this process may use: torch's UserWarning, word for word;
    within them, no warning from either."""
    too_many = len(os.sched_getaffinity(0)) + 1
    with pytest.warns(UserWarning) as theirs:
        tud.DataLoader(DATA, num_workers=too_many)
    with pytest.warns(UserWarning) as ours:
        ArenaLoader(DATA, num_workers=too_many).close()
    assert [str(w.message) for w in ours] == [str(w.message) for w in theirs]
    assert all(w.filename == __file__ for w in ours), "the warning should point at the caller"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tud.DataLoader(DATA, num_workers=1)
        ArenaLoader(DATA, num_workers=1).close()


def warning_texts(loader) -> tuple[list[int], list[str]]:
    """(samples of one epoch after len(loader), the warnings it raised, as text)."""
    len(loader)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        samples = flat(loader)
    return samples, [str(w.message) for w in caught if w.category is UserWarning]


@pytest.mark.timeout(60)
def test_iterable_longer_than_its_len_warns_like_torch():
    """An IterableDataset yielding more batches than the len() read before iter() gets
    torch's UserWarning, with torch's text, at the same batches, with and without workers."""
    stream = make_stream(n=8, claimed_len=3)
    for num_workers in (0, 2):
        theirs = warning_texts(tud.DataLoader(stream, batch_size=2, num_workers=num_workers))
        with ArenaLoader(stream, batch_size=2, num_workers=num_workers) as loader:
            ours = warning_texts(loader)
        assert sorted(ours[0]) == sorted(theirs[0])
        assert ours[1] == theirs[1] and len(ours[1]) == len(theirs[0]) // 2 - 3


def test_iterable_within_its_len_does_not_warn():
    """No warning when the epoch stays within len(), or when len() was never asked."""
    stream = make_stream(n=4, claimed_len=4)
    with ArenaLoader(stream, batch_size=2) as loader:
        assert warning_texts(loader)[1] == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ArenaLoader(make_stream(n=8, claimed_len=1)) as loader:
            assert flat(loader) == list(range(8))


# ---------------------------------------------------------------------------------------------
# Exceptions pickle, and crash messages carry torch's wording.

def exception_examples() -> list[Exception]:
    """One instance of every exception class arena_loader exports, with its fields set."""
    examples = []
    for name in arena_loader.errors.__all__:
        cls = getattr(arena_loader.errors, name)
        if cls is WorkerCrashedError:
            examples.append(cls("worker 1 died", worker_id=1, pid=4321, exitcode=-9))
        elif issubclass(cls, OSError):
            examples.append(cls(errno.ENOSPC, "no room in /dev/shm"))
        else:
            examples.append(cls(f"{name} happened"))
    return examples


def test_every_exception_class_pickles_with_its_fields():
    """pickle.loads(pickle.dumps(e)) is the same type with the same str, args and fields, for
    every exception class arena_loader exports."""
    for error in exception_examples():
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error)
        assert str(copy) == str(error) and copy.args == error.args, type(error)
        assert vars(copy) == vars(error), type(error)
        if isinstance(error, OSError):
            assert (copy.errno, copy.strerror) == (error.errno, error.strerror)


def test_every_public_exception_class_is_covered():
    """The pickling test above covers each exception class in the public API."""
    public = {name for name, value in vars(arena_loader).items()
              if inspect.isclass(value) and issubclass(value, BaseException)}
    assert public <= {type(e).__name__ for e in exception_examples()}


def torch_crash_message(dataset) -> tuple[str, int]:
    """torch's error text for ``dataset``'s dead worker, and that worker's pid."""
    loader = tud.DataLoader(dataset, batch_size=2, num_workers=1)
    with pytest.raises(RuntimeError) as raised:
        for _ in loader:
            pass
    message = str(raised.value)
    pid = int(re.search(r"pid(?:\(s\))? (\d+)", message).group(1))
    return message, pid


@pytest.mark.timeout(90)
@pytest.mark.parametrize("make_dataset", [
    lambda: SuicidalDataset(8, fatal_index=3, signum=signal.SIGKILL),
    lambda: ExitingDataset(8),
], ids=["sigkill", "exit3"])
def test_crash_message_ends_with_torchs_words_and_pickles(make_dataset):
    """A dead worker's WorkerCrashedError keeps our message and ends with torch's text for the
    same death (pid replaced by ours); it pickles with pid, worker_id and exitcode."""
    theirs, their_pid = torch_crash_message(make_dataset())
    with ArenaLoader(make_dataset(), batch_size=2, num_workers=1) as loader:
        with pytest.raises(WorkerCrashedError) as raised:
            for _ in loader:
                pass
    error = raised.value
    message = str(error)
    assert message.startswith(f"DataLoader worker 0 (pid {error.pid}) ")
    # torch words it one of two ways (its SIGCHLD handler or its timeout check): ours has both.
    assert theirs.replace(str(their_pid), str(error.pid)) in message
    assert message.endswith(("Killed. ", "may give better error trace."))
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), str(copy)) == (WorkerCrashedError, message)
    assert (copy.pid, copy.worker_id, copy.exitcode) == (error.pid, 0, error.exitcode)


class MissingKey(IndexDataset):
    def __getitem__(self, i):
        if i == 1:
            raise KeyError(f"no record {i}")
        return super().__getitem__(i)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [2])
def test_worker_exception_begins_with_torchs_first_line(num_workers):
    """A dataset's exception in a worker: the same type, and the message's first line is
    torch's word for word ("Caught KeyError in DataLoader worker process 0."), so code and
    searches keyed on it match; the traceback follows torch's "Original Traceback"."""
    theirs = torch_error(MissingKey(8), batch_size=2, num_workers=num_workers)
    assert type(theirs) is KeyError
    theirs = str(theirs)
    with ArenaLoader(MissingKey(8), batch_size=2, num_workers=num_workers) as loader:
        with pytest.raises(KeyError) as raised:
            next(iter(loader))
        ours = str(raised.value)
    assert ours.splitlines()[0] == theirs.strip("'\"").splitlines()[0]
    assert re.match(r"Caught KeyError in DataLoader worker process \d", ours)
    assert "\nOriginal Traceback (most recent call last):\n" in ours
    assert ours.rstrip().endswith("KeyError: 'no record 1'")


UNEQUAL = {  # samples torch's default_collate cannot stack, and torch's text for them
    "tensors": ([torch.zeros(3), torch.zeros(2)], "stack expects each tensor to be equal size"),
    "arrays": ([np.zeros((2, 3)), np.zeros((2, 4))], "stack expects each tensor to be equal size"),
    "field": ([{"a": np.zeros(3)}, {"a": np.zeros(4)}], "stack expects each tensor to be equal"),
    "lists": ([[1, 2, 3], [1, 2]], "each element in list of batch should be of equal size"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case, num_workers", [(case, 0) for case in UNEQUAL] + [
    ("arrays", 2), ("lists", 2)])
def test_unequal_samples_raise_torchs_runtime_error_with_torchs_text_first(case, num_workers):
    """Samples that do not stack: a RuntimeError (SampleShapeError, also a LayoutError) whose
    message starts with torch's text (after torch's "Caught ..." line with workers), as
    torch's DataLoader raises; ours then names the sample, field, shapes and the fix. (A
    ValueError before: `except RuntimeError` missed it; found by a user trial.)"""
    samples, text = UNEQUAL[case]
    theirs = torch_error(samples, batch_size=2, num_workers=num_workers)
    assert isinstance(theirs, RuntimeError)
    with ArenaLoader(samples, batch_size=2, num_workers=num_workers) as loader, \
            pytest.raises(SampleShapeError) as ours:
        next(iter(loader))
    assert isinstance(ours.value, RuntimeError) and isinstance(ours.value, LayoutError)
    mine = str(ours.value.__cause__ if num_workers else ours.value)  # the worker's own
    torchs = str(theirs).rstrip().splitlines()[-1].removeprefix("RuntimeError: ")
    assert mine.startswith(text)
    # torch's whole sentence, shapes and entries too (torch's workers stacking tensors into
    # shared memory say "Trying to resize storage that is not resizable" instead)
    assert mine.startswith(torchs) or (case == "tensors" and num_workers)
    assert "sample 1" in mine and "collate_fn" in mine


# ---------------------------------------------------------------------------------------------
# Generic class, and attributes that read as torch's.

def test_arena_loader_is_generic_like_dataloader():
    """ArenaLoader[T] is a parametrised alias of ArenaLoader, as DataLoader[T] is."""
    alias = ArenaLoader[int]
    assert typing.get_origin(alias) is ArenaLoader and typing.get_args(alias) == (int,)
    assert typing.get_origin(tud.DataLoader[int]) is tud.DataLoader
    with alias(DATA, batch_size=5) as loader:
        assert len(flat(loader)) == 20


ATTRIBUTE_CASES = [
    dict(),
    dict(num_workers=2),
    dict(num_workers=2, prefetch_factor=4, persistent_workers=True, timeout=5.0),
    dict(num_workers=1, multiprocessing_context="spawn"),
    dict(batch_sampler=[[0, 1], [2]]),
    dict(batch_size=None),
    dict(batch_size=3, drop_last=True, shuffle=True),
    dict(pin_memory_device="cuda:0", in_order=False, worker_init_fn=print),
]
ATTRIBUTES = ("batch_size", "drop_last", "num_workers", "prefetch_factor", "pin_memory",
              "pin_memory_device", "timeout", "worker_init_fn", "persistent_workers",
              "in_order", "generator", "_auto_collation")


def describe(loader) -> dict:
    """The attributes a torch user reads, comparable between the two loaders."""
    described = {name: getattr(loader, name) for name in ATTRIBUTES}
    context = loader.multiprocessing_context
    described["multiprocessing_context"] = (None if context is None
                                            else context.get_start_method())
    for name in ("sampler", "batch_sampler", "_index_sampler"):
        value = getattr(loader, name)
        described[name] = value if isinstance(value, list) else type(value).__name__.lstrip("_")
    described["dataset"] = loader.dataset
    try:
        described["len"] = len(loader)
    except TypeError:
        described["len"] = TypeError
    return described


def test_attributes_read_as_torchs():
    """Every attribute torch's DataLoader exposes has torch's value for the same options."""
    for kwargs in ATTRIBUTE_CASES:
        with ArenaLoader(DATA, **kwargs) as ours:
            assert describe(ours) == describe(tud.DataLoader(DATA, **kwargs)), kwargs


def test_iterable_dataset_attributes_read_as_torchs():
    """An IterableDataset's loader has torch's infinite sampler and its batch sampler."""
    stream = make_stream(claimed_len=4)
    with ArenaLoader(stream, batch_size=3) as ours:
        assert describe(ours) == describe(tud.DataLoader(stream, batch_size=3))


def test_timeout_without_workers_fails_at_iter_as_torchs():
    """timeout > 0 with num_workers=0: torch's AssertionError (its text in ours) at iter(),
    not at construction; timeout=0 loads."""
    theirs = tud.DataLoader(DATA, timeout=5)
    with pytest.raises(AssertionError) as their_error:
        iter(theirs)
    with ArenaLoader(DATA, timeout=5) as loader:
        with pytest.raises(AssertionError, match="pass timeout=0, or num_workers > 0") as ours:
            iter(loader)
    assert str(their_error.value) in str(ours.value)
    with ArenaLoader(DATA, timeout=0) as loader:
        assert len(list(loader)) == len(DATA)


def test_pin_memory_warnings_contain_torchs_text():
    """pin_memory_device with pin_memory: torch's deprecation warning at iter(); without an
    accelerator, torch's 'no accelerator' text inside ours."""
    with pytest.warns(UserWarning) as theirs:
        iter(tud.DataLoader(DATA, pin_memory=True, pin_memory_device="cuda"))
    with pytest.warns(UserWarning) as ours:
        with ArenaLoader(DATA, pin_memory=True, pin_memory_device="cuda") as loader:
            iter(loader)
    their_texts = [str(w.message) for w in theirs]
    our_text = " | ".join(str(w.message) for w in ours)
    assert their_texts and all(text in our_text for text in their_texts)


# ---------------------------------------------------------------------------------------------
# Sample order: the same seed gives torch's order, and leaves torch's RNG where torch does.

def epochs_and_rng(make_loader, seed: int, epochs: int = 2) -> tuple[list, list]:
    torch.manual_seed(seed)
    loader = make_loader()
    orders = [flat(loader) for _ in range(epochs)]
    if isinstance(loader, ArenaLoader):
        loader.close()
    return orders, torch.get_rng_state().tolist()


@pytest.mark.parametrize("with_generator", [False, True], ids=["global_rng", "generator"])
def test_shuffle_order_equals_torchs_for_the_same_seed(with_generator):
    """For 5 seeds and several sizes: torch.manual_seed(s) (or generator=
    torch.Generator().manual_seed(s)), then two epochs of shuffle=True give the same samples
    in the same order, and leave torch's RNG in the same state."""
    for seed in range(5):
        for size, drop_last in ((1, False), (7, False), (10, True), (64, False)):
            def make(cls, size=size, drop_last=drop_last, seed=seed):
                generator = torch.Generator().manual_seed(seed + 100) if with_generator else None
                return lambda: cls(IndexDataset(size), batch_size=3, shuffle=True,
                                   drop_last=drop_last, generator=generator)

            ours = epochs_and_rng(make(ArenaLoader), seed)
            assert ours == epochs_and_rng(make(tud.DataLoader), seed), (seed, size)
            assert len(set(ours[0][0])) == len(ours[0][0]) == size - size % 3 * drop_last


@pytest.mark.parametrize(("size", "drop_last"), [(8, False), (9, False), (9, True)])
def test_the_callers_generator_moves_at_torchs_moments_batch_by_batch(size, drop_last):
    """shuffle=True with the caller's torch.Generator, num_workers=0: after each batch (and
    at the epoch's end) the generator is where torch's DataLoader leaves it. torch draws a
    last, empty chunk when a batch first asks past the end, not with a batch that ends
    exactly there."""
    def states(cls):
        generator = torch.Generator().manual_seed(5)
        found = []
        for batch in cls(IndexDataset(size), batch_size=4, shuffle=True, drop_last=drop_last,
                         generator=generator):
            found.append((np.asarray(batch).tolist(), generator.get_state().tolist()))
        return [*found, generator.get_state().tolist()]

    assert states(ArenaLoader) == states(tud.DataLoader)


@pytest.mark.parametrize(("replacement", "num_samples"), [(False, 12), (True, 70)])
def test_batches_across_torchs_chunks_are_torchs(replacement, num_samples):
    """Our RandomSampler with the caller's torch.Generator, drawing more than one chunk
    (``randperm`` per dataset length, ``randint`` per 32): batches that span two chunks
    hold torch's indices, and the generator moves as torch's, batch by batch."""
    def batches(loader_class, sampler_class):
        generator = torch.Generator().manual_seed(3)
        sampler = sampler_class(range(5), replacement=replacement, num_samples=num_samples,
                                generator=generator)
        return [(np.asarray(b).tolist(), generator.get_state().tolist())
                for b in loader_class(IndexDataset(5), batch_size=3, sampler=sampler)]

    assert batches(ArenaLoader, RandomSampler) == batches(tud.DataLoader, tud.RandomSampler)


@pytest.mark.timeout(60)
def test_shuffle_order_with_workers_equals_torchs():
    """With worker processes too: torch's order and torch's RNG state afterwards."""
    def make(cls):
        return lambda: cls(IndexDataset(23), batch_size=4, shuffle=True, num_workers=2)

    assert epochs_and_rng(make(ArenaLoader), 7) == epochs_and_rng(make(tud.DataLoader), 7)


@pytest.mark.timeout(60)
def test_worker_seeds_equal_torchs_after_manual_seed():
    """generator=None in a program using torch: the workers' seeds come from torch's global
    RNG, so torch.manual_seed(s) gives torch's worker seeds."""
    from .datasets import WorkerProbeDataset

    torch.manual_seed(21)
    theirs = tud.DataLoader(WorkerProbeDataset(4), batch_size=2, num_workers=2)
    their_seeds = {int(b["worker"][0]): int(b["seed"][0]) for b in theirs}
    torch.manual_seed(21)
    ours = {s["worker"]: int(s["seed"]) for s in probe_epochs(1)[0]}
    assert ours == their_seeds and len(ours) == 2


def test_random_samplers_draw_torchs_indices():
    """RandomSampler (with and without replacement, over 32 draws), SubsetRandomSampler and
    WeightedRandomSampler give torch's indices for the same generator seed, for 5 seeds."""
    for seed in range(5):
        assert_samplers_draw_like_torch(seed)


def assert_samplers_draw_like_torch(seed: int) -> None:
    cases = [
        (RandomSampler, tud.RandomSampler, (range(9),), dict(replacement=True, num_samples=70)),
        (RandomSampler, tud.RandomSampler, (range(9),), dict(num_samples=20)),
        (SubsetRandomSampler, tud.SubsetRandomSampler, ([5, 8, 13, 21, 34],), {}),
        (WeightedRandomSampler, tud.WeightedRandomSampler, ([0.1, 0.5, 2.0, 0.0, 1.0], 4),
         dict(replacement=False)),
        (WeightedRandomSampler, tud.WeightedRandomSampler, ([1.0, 3.0, 0.5], 40), {}),
    ]
    for ours_cls, theirs_cls, args, kwargs in cases:
        ours = ours_cls(*args, generator=torch.Generator().manual_seed(seed), **kwargs)
        theirs = theirs_cls(*args, generator=torch.Generator().manual_seed(seed), **kwargs)
        assert list(ours) == list(theirs) and list(ours) == list(theirs), ours_cls.__name__


def test_distributed_sampler_shuffle_equals_torchs():
    """DistributedSampler(shuffle=True): torch's indices on each rank, for each epoch."""
    for seed, epoch in ((0, 0), (0, 1), (5, 0), (5, 1)):
        for rank in range(3):
            ours = DistributedSampler(IndexDataset(11), num_replicas=3, rank=rank, seed=seed)
            theirs = tud.DistributedSampler(IndexDataset(11), num_replicas=3, rank=rank,
                                            seed=seed)
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)


def test_without_torch_samplers_use_numpy_and_never_import_torch():
    """In a program that never imports torch, shuffling works (numpy) and torch stays out."""
    script = (
        "import sys\n"
        "from arena_loader import ArenaLoader, DistributedSampler\n"
        "data = list(range(10))\n"
        "with ArenaLoader(data, batch_size=4, shuffle=True, generator=3) as loader:\n"
        "    order = [int(x) for b in loader for x in b]\n"
        "assert sorted(order) == data, order\n"
        "assert sorted(DistributedSampler(data, num_replicas=1, rank=0)) == data\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------------------------------------
# DataPipes: sharding per worker and per rank, shuffle accepted, as torch does.

def make_pipe(n: int = 12):
    from torch.utils.data.datapipes.iter import IterableWrapper

    return IterableWrapper(range(n)).shuffle().sharding_filter()


@pytest.mark.timeout(90)
def test_datapipe_is_sharded_and_shuffled_like_torch():
    """An IterDataPipe with sharding_filter(): each sample once across 0, 2 or 3 workers, in
    torch's order for the same seed; shuffle=True is accepted, shuffle=False turns it off."""
    for num_workers, shuffle in ((0, True), (0, False), (2, None), (2, False), (3, True)):
        def make(cls, num_workers=num_workers, shuffle=shuffle):
            return lambda: cls(make_pipe(), batch_size=2, num_workers=num_workers,
                               shuffle=shuffle)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # 3 workers on a 2-CPU machine
            ours = epochs_and_rng(make(ArenaLoader), 4)
            assert ours == epochs_and_rng(make(tud.DataLoader), 4), (num_workers, shuffle)
        assert sorted(ours[0][0]) == list(range(12))
        if shuffle is False and num_workers == 0:
            assert ours[0][0] == list(range(12))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_datapipe_is_sharded_across_distributed_ranks_like_torch(num_workers, monkeypatch):
    """With 2 torch.distributed ranks, each rank loads its own part of the pipe (torch's part,
    in torch's order); together the ranks load every sample once."""
    import torch.utils.data.dataloader as torch_dataloader

    per_rank = []
    for rank in range(2):
        monkeypatch.setattr(torch_dataloader, "_get_distributed_settings", lambda r=rank: (2, r))
        monkeypatch.setattr(arena_loader.loader, "distributed_settings", lambda r=rank: (2, r))

        def make(cls):
            return lambda: cls(make_pipe(), batch_size=2, num_workers=num_workers, shuffle=True)

        ours = epochs_and_rng(make(ArenaLoader), 8, epochs=1)
        assert ours == epochs_and_rng(make(tud.DataLoader), 8, epochs=1)
        per_rank.append(ours[0][0])
    assert sorted(per_rank[0] + per_rank[1]) == list(range(12))


@pytest.mark.timeout(60)
def test_persistent_workers_reshuffle_a_datapipe_each_epoch_like_torch():
    """Persistent workers keep sharding a shuffled pipe, with torch's new order each epoch."""
    def make(cls):
        return lambda: cls(make_pipe(16), batch_size=2, num_workers=2, shuffle=True,
                           persistent_workers=True)

    ours = epochs_and_rng(make(ArenaLoader), 2, epochs=3)
    assert ours == epochs_and_rng(make(tud.DataLoader), 2, epochs=3)
    epochs = ours[0]
    assert all(sorted(epoch) == list(range(16)) for epoch in epochs)
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]


# ---------------------------------------------------------------------------------------------
# docs/migrating.md: its runnable examples run as written.

MIGRATING = Path(__file__).parent.parent / "docs" / "migrating.md"


@pytest.mark.timeout(120)
def test_migrating_guide_examples_run(tmp_path):
    """Each ```python block of docs/migrating.md runs (```py blocks need packages not
    installed here and are not run)."""
    blocks = re.findall(r"```python\n(.*?)```", MIGRATING.read_text(), re.DOTALL)
    assert len(blocks) >= 2
    for index, block in enumerate(blocks):
        script = tmp_path / f"example{index}.py"
        script.write_text(block)
        result = zygote.run([str(script)], timeout=50, preload="torch")
        assert result.returncode == 0, (index, result.stderr)
