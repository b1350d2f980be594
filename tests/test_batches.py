"""Every batch equals the in-process reference (``np.stack`` of the same samples)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from arena_loader import ArenaLoader

from .datasets import (
    CountedBatches,
    ImageDataset,
    NestedDataset,
    assert_batches_equal,
    draws_per_next,
    reference_epoch,
    stack_reference,
)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("num_workers, worker_mode", [
    (0, "process"), (1, "process"), (2, "process"), (3, "process"), (1, "thread"), (3, "thread"),
])
@pytest.mark.parametrize("n, batch_size, drop_last", [
    (1, 1, False), (7, 3, False), (7, 3, True), (12, 4, False), (12, 4, True),
    (5, 8, False), (5, 8, True), (33, 5, False),
])
def test_batches_match_stacked_reference(num_workers, worker_mode, n, batch_size, drop_last):
    """Sizes, partial last batch and drop_last give exactly the stacked samples."""
    dataset = ImageDataset(n, shape=(3, 4, 5), dtype=np.float32)
    expected = reference_epoch(dataset, batch_size, drop_last)
    with ArenaLoader(dataset, batch_size=batch_size, drop_last=drop_last,
                     num_workers=num_workers, worker_mode=worker_mode) as loader:
        assert len(loader) == len(expected)
        for epoch in range(2):
            batches = list(loader)
            assert len(batches) == len(expected), f"epoch {epoch}"
            for i, (actual, ref) in enumerate(zip(batches, expected)):
                assert_batches_equal(actual, ref, f"epoch {epoch} batch {i}")
            del batches


@pytest.mark.parametrize("num_workers, worker_mode", [(0, "process"), (2, "process"),
                                                      (2, "thread")])
def test_nested_samples_keep_structure_and_dtypes(num_workers, worker_mode):
    """Dict, tuple and namedtuple samples with numpy, Python and string leaves."""
    dataset = NestedDataset(11)
    expected = reference_epoch(dataset, 4, False)
    with ArenaLoader(dataset, batch_size=4, num_workers=num_workers,
                     worker_mode=worker_mode) as loader:
        batches = list(loader)
    assert len(batches) == 3
    for i, (actual, ref) in enumerate(zip(batches, expected)):
        assert_batches_equal(actual, ref, f"batch {i}")
    assert batches[0]["label"].dtype == np.int64
    assert batches[0]["point"].x.dtype == np.float64
    assert batches[0]["flag"].dtype == np.bool_
    assert batches[2]["name"] == ["sample-8", "sample-9", "sample-10"]


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int32, np.int64, np.float16,
                                   np.float64, np.complex64, np.bool_])
@pytest.mark.parametrize("worker_mode", ["process", "thread"])
def test_dtypes_round_trip(dtype, worker_mode):
    """Every numeric dtype arrives bit-exact through worker processes and threads."""
    dataset = ImageDataset(9, shape=(5, 3), dtype=dtype)
    expected = reference_epoch(dataset, 4, False)
    with ArenaLoader(dataset, batch_size=4, num_workers=2, worker_mode=worker_mode) as loader:
        count = 0
        for actual, ref in zip(loader, expected):
            assert_batches_equal(actual, ref)
            count += 1
    assert count == len(expected) == 3


@pytest.mark.parametrize("num_workers, worker_mode", [(0, "process"), (2, "process"),
                                                      (2, "thread")])
def test_shuffle_with_seed_is_a_reproducible_permutation(num_workers, worker_mode):
    """shuffle=True covers every sample once; the same generator seed gives the same order."""
    dataset = ImageDataset(30, shape=(1,), dtype=np.int64)

    def epoch_order(seed):
        with ArenaLoader(dataset, batch_size=4, shuffle=True, generator=seed,
                         num_workers=num_workers, worker_mode=worker_mode) as loader:
            return [[int(v) for v in batch[:, 0]] for batch in loader]

    first, again, other = epoch_order(7), epoch_order(7), epoch_order(8)
    flat = [v for batch in first for v in batch]
    assert sorted(flat) == sorted(int(dataset[i][0]) for i in range(30))
    assert first == again
    assert first != other


@pytest.mark.parametrize("worker_mode", ["process", "thread"])
def test_out_of_order_delivery_yields_every_batch_once(worker_mode):
    """in_order=False delivers all batches, each exactly once, with correct contents."""
    dataset = ImageDataset(40, shape=(2,), dtype=np.int64)
    expected = {int(b[0, 0]): b for b in reference_epoch(dataset, 3, False)}
    with ArenaLoader(dataset, batch_size=3, num_workers=3, in_order=False,
                     worker_mode=worker_mode) as loader:
        seen = {}
        for batch in loader:
            key = int(batch[0, 0])
            assert key not in seen
            seen[key] = np.array(batch)
    assert seen.keys() == expected.keys()
    for key, batch in seen.items():
        np.testing.assert_array_equal(batch, expected[key])


@pytest.mark.parametrize("num_workers, worker_mode", [(0, "process"), (2, "process"),
                                                      (2, "thread")])
def test_custom_collate_fn_output_is_copied_into_the_slot(num_workers, worker_mode):
    """A collate_fn's arrays arrive intact; the partial last batch keeps its true length."""
    dataset = ImageDataset(10, shape=(3,), dtype=np.int32)

    def collate(samples):
        stacked = np.stack(samples)
        return {"sum": stacked.sum(axis=1), "doubled": stacked * 2, "count": len(samples)}

    with ArenaLoader(dataset, batch_size=4, num_workers=num_workers,
                     collate_fn=collate, worker_mode=worker_mode) as loader:
        batches = list(loader)
    refs = [collate([dataset[i] for i in range(s, min(s + 4, 10))]) for s in (0, 4, 8)]
    for actual, ref in zip(batches, refs):
        np.testing.assert_array_equal(actual["sum"], ref["sum"])
        np.testing.assert_array_equal(actual["doubled"], ref["doubled"])
        assert int(actual["count"]) == ref["count"]
    assert batches[-1]["doubled"].shape == (2, 3)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batch_size_none_yields_single_samples(num_workers):
    """batch_size=None: no batch axis, each sample is one item, as in torch."""
    dataset = ImageDataset(5, shape=(2, 3), dtype=np.float32)
    with ArenaLoader(dataset, batch_size=None, num_workers=num_workers) as loader:
        items = list(loader)
        assert len(loader) == 5
    assert len(items) == 5
    for i, item in enumerate(items):
        assert_batches_equal(item, dataset[i], f"item {i}")


def test_batch_sampler_without_batch_size_attribute_sizes_slots_from_its_batches():
    """A plain list of index lists works as batch_sampler, batches of any length."""
    dataset = ImageDataset(20, shape=(2,), dtype=np.int64)
    batch_sampler = [[3, 1], [0, 5, 7, 9, 11], [2]]
    with ArenaLoader(dataset, batch_sampler=batch_sampler, num_workers=2) as loader:
        batches = list(loader)
    assert len(batches) == len(batch_sampler)
    for actual, indices in zip(batches, batch_sampler):
        np.testing.assert_array_equal(actual, stack_reference([dataset[i] for i in indices]))


class EndlessBatches:
    """An infinite batch sampler with no ``batch_size`` attribute (a training sampler that
    never ends an epoch), batches of 1 to 5 indices."""

    def __iter__(self):
        start = 0
        while True:
            size = 1 + start % 5
            yield list(range(start, start + size))
            start += size


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_batch_sampler_without_batch_size_is_drawn_as_torch_draws_it(num_workers):
    """A batch_sampler that does not say its batch size is drawn batch by batch, as the
    epoch goes, never to its end ahead of it: an endless one gives its batches (it hung
    iter(), drawing forever), and a finite one has given as many batches as to torch's
    DataLoader after iter() and after each next()."""
    torch_data = pytest.importorskip("torch.utils.data")
    dataset = ImageDataset(1000, shape=(2,), dtype=np.int64)
    with ArenaLoader(dataset, batch_sampler=EndlessBatches(), num_workers=num_workers) as loader:
        for batch, indices in zip(iter(loader), itertools.islice(EndlessBatches(), 8)):
            np.testing.assert_array_equal(batch,
                                          stack_reference([dataset[i] for i in indices]))
    sampler = CountedBatches(12, 2)
    expected = draws_per_next(torch_data.DataLoader(dataset, batch_sampler=sampler,
                                                    num_workers=num_workers), sampler)
    with ArenaLoader(dataset, batch_sampler=sampler, num_workers=num_workers) as loader:
        assert draws_per_next(loader, sampler, settle_s=0.01) == expected


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 40),
    batch_size=st.integers(1, 9),
    drop_last=st.booleans(),
    num_workers=st.sampled_from([0, 1, 2, 3]),
    worker_mode=st.sampled_from(["process", "thread"]),
    dtype=st.sampled_from([np.uint8, np.int16, np.float32, np.float64]),
    shape=st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple),
    nested=st.booleans(),
)
def test_property_any_configuration_matches_reference(n, batch_size, drop_last, num_workers,
                                                      worker_mode, dtype, shape, nested):
    """Hypothesis: any size, batch size, drop_last, worker count and kind, dtype and shape."""
    dataset = NestedDataset(n) if nested else ImageDataset(n, shape=shape, dtype=dtype)
    expected = reference_epoch(dataset, batch_size, drop_last)
    count = 0
    with ArenaLoader(dataset, batch_size=batch_size, drop_last=drop_last,
                     num_workers=num_workers, worker_mode=worker_mode) as loader:
        # Compared as they arrive: an epoch may have more batches than slots.
        for i, actual in enumerate(loader):
            assert_batches_equal(actual, expected[i], f"batch {i}")
            count += 1
    assert count == len(expected)


class _SubclassSamples:
    """Samples as numpy arrays, for collate_fns returning numpy's array subclasses."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int) -> np.ndarray:
        return np.arange(3, dtype=np.float32) + index


def _masked_collate(batch: list) -> np.ma.MaskedArray:
    return np.ma.masked_array(np.stack(batch), mask=np.stack([b % 2 == 0 for b in batch]))


def _matrix_collate(batch: list) -> np.matrix:
    return np.matrix(np.stack(batch))


def _recarray_collate(batch: list) -> dict:
    columns = [np.array([b[0] for b in batch]), np.array([b[1] for b in batch])]
    return {"rec": np.rec.fromarrays(columns, names="a,b")}


class _MaskedSamples(_SubclassSamples):
    def __getitem__(self, index: int) -> dict:
        return {"m": np.ma.masked_array(np.arange(3.0) + index, mask=[True, False, index % 2 == 0])}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_collate_fn_numpy_subclasses_are_handed_out_as_they_are(num_workers):
    """A collate_fn's MaskedArray keeps its mask, a matrix stays a matrix and a recarray a
    recarray, as torch's DataLoader hands them out (they were plain arrays: the mask dropped,
    masked values exposed, and a matrix's ``*`` silently elementwise)."""
    for collate, check in (
            (_masked_collate, lambda b: isinstance(b, np.ma.MaskedArray)
             and np.array_equal(b.mask, b.data % 2 == 0)),
            (_matrix_collate, lambda b: type(b) is np.matrix and b.shape == (2, 3)),
            (_recarray_collate, lambda b: type(b["rec"]) is np.recarray
             and np.array_equal(b["rec"].b, b["rec"].a + 1))):
        with ArenaLoader(_SubclassSamples(), batch_size=2, num_workers=num_workers,
                         collate_fn=collate) as loader:
            batches = list(loader)
        assert len(batches) == 3 and all(check(b) for b in batches), collate.__name__


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batch_size_none_keeps_a_masked_array_as_torch_does(num_workers):
    """batch_size=None: torch's default_convert passes a MaskedArray through (its module is
    numpy.ma); it kept its values but lost its mask here."""
    with ArenaLoader(_MaskedSamples(), batch_size=None, num_workers=num_workers) as loader:
        samples = list(loader)
    assert all(isinstance(s["m"], np.ma.MaskedArray) for s in samples)
    assert [s["m"].mask.tolist() for s in samples] == [
        [True, False, i % 2 == 0] for i in range(6)]


def _memmap_collate(batch: list) -> np.ndarray:
    return np.stack(batch).view(np.memmap)


def test_collate_fn_memmap_slices_still_go_into_the_slot():
    """np.memmap (what slicing a memmap gives) is stored as a plain array in the slab, the fast
    path, not pickled: its mapping cannot cross processes anyway."""
    with ArenaLoader(_SubclassSamples(), batch_size=2, num_workers=0,
                     collate_fn=_memmap_collate) as loader:
        batch = next(iter(loader))
        assert type(batch) is np.ndarray
        np.testing.assert_array_equal(batch, [[0, 1, 2], [1, 2, 3]])


def test_drop_last_drops_the_short_last_batch_of_a_user_sampler_as_torch_does():
    """A user's sampler (not one of ours) grouped into batches: with drop_last the short last
    batch is dropped, as torch's BatchSampler drops it."""
    import torch.utils.data

    sampler = [6, 5, 4, 3, 2, 1, 0]  # any iterable of indices is a sampler
    expected = [batch.tolist() for batch in torch.utils.data.DataLoader(
        list(range(7)), batch_size=3, drop_last=True, sampler=sampler)]
    with ArenaLoader(list(range(7)), batch_size=3, drop_last=True, sampler=sampler) as loader:
        assert [np.asarray(batch).tolist() for batch in loader] == expected == [[6, 5, 4],
                                                                                [3, 2, 1]]
