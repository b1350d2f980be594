"""The commonest batch, written straight (``_rows.SameShapeRows``): once a worker has written
a batch of samples that are each one array, later batches of that dtype and shape skip the
planner. These batches come after each worker's first, where only the straight path runs:
every check the planner makes must still hold there."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from arena_loader import ArenaLoader, LayoutError, SampleShapeError

pytestmark = pytest.mark.timeout(60)

MODES = [(2, "process"), (2, "thread"), (1, "process")]


class Rows:
    """float32 rows of 6 values; ``odd`` maps an index to the sample returned there."""

    def __init__(self, n: int, odd: dict | None = None):
        self.n, self.odd = n, odd or {}

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i in self.odd:
            return self.odd[i]
        return np.arange(6, dtype=np.float32) + i


def stacked(dataset, indices):
    return np.stack([np.asarray(dataset[i]) for i in indices])


@pytest.mark.parametrize("odd, named", [
    ({27: 5}, "sample 27: field sample has shape \\[5\\]"),
    # 7 + 5 values: as many as two rows of 6, so only each row's own length tells them apart
    ({26: 7, 27: 5}, "sample 26: field sample has shape \\[7\\]")])
@pytest.mark.parametrize("num_workers, worker_mode", MODES)
def test_a_row_of_another_shape_late_in_the_epoch_names_the_sample(num_workers, worker_mode,
                                                                    odd, named):
    """Sample 27 (batch 6: every worker has written batches before it) has 5 values, or
    sample 26 has 7 and 27 has 5: torch's RuntimeError naming the first, for that batch only;
    the next batch loads."""
    dataset = Rows(40, {i: np.zeros(n, np.float32) for i, n in odd.items()})
    with ArenaLoader(dataset, batch_size=4, num_workers=num_workers,
                     worker_mode=worker_mode) as loader:
        iterator = iter(loader)
        for b in range(6):
            np.testing.assert_array_equal(next(iterator), stacked(dataset, range(4 * b, 4 * b + 4)))
        with pytest.raises(SampleShapeError, match=named + r" but sample 24 has \[6\]"):
            next(iterator)
        for b in range(7, 10):
            np.testing.assert_array_equal(next(iterator), stacked(dataset, range(4 * b, 4 * b + 4)))
        del iterator


@pytest.mark.parametrize("num_workers, worker_mode", MODES)
def test_a_row_that_is_no_array_late_in_the_epoch_is_batched_or_named(num_workers, worker_mode):
    """A list of 6 numbers where the others are arrays: the planner's batch, as torch's
    default_collate gives it (its ``as_tensor`` takes the list: float32 here); a str there:
    the planner's LayoutError naming the sample, as on a worker's first batch."""
    dataset = Rows(40, {30: [0.5] * 6, 34: "abcdef"})
    with ArenaLoader(dataset, batch_size=4, num_workers=num_workers,
                     worker_mode=worker_mode) as loader:
        iterator = iter(loader)
        for _ in range(7):
            next(iterator)
        batch = next(iterator)
        assert batch.dtype == np.float32
        np.testing.assert_array_equal(batch, stacked(dataset, range(28, 32)))
        with pytest.raises(LayoutError, match=r"sample 34: field sample is str where "
                                              r"sample 32 has float32\[6\]"):
            next(iterator)
        np.testing.assert_array_equal(next(iterator), stacked(dataset, range(36, 40)))
        del iterator


@pytest.mark.parametrize("num_workers, worker_mode", MODES)
def test_a_wider_dtype_late_in_the_epoch_types_its_batch_as_torch(num_workers, worker_mode):
    """A float64 row in batch 6 makes that batch float64 (torch's promotion), an int64 row in
    batch 8 leaves its batch float32 (float beats int), and batch 9 of an int16 row then
    float16 rows is float16, though numpy promotes them to the float32 of the batches before;
    every value equals torch's."""
    torch = pytest.importorskip("torch")
    odd = {26: np.full(6, 0.1, np.float64), 33: np.arange(6, dtype=np.int64) * 2**40,
           36: np.arange(6, dtype=np.int16),
           **{i: np.full(6, i / 4, np.float16) for i in (37, 38, 39)}}
    dataset = Rows(40, odd)
    with ArenaLoader(dataset, batch_size=4, num_workers=num_workers, worker_mode=worker_mode,
                     output="numpy") as loader:
        batches = [np.array(b) for b in loader]
    expected = [torch.utils.data.default_collate(
        [torch.from_numpy(np.asarray(dataset[i])) for i in range(b, b + 4)]).numpy()
        for b in range(0, 40, 4)]
    assert [b.dtype for b in batches] == [e.dtype for e in expected]
    assert batches[6].dtype == np.float64 and batches[8].dtype == np.float32
    assert batches[9].dtype == np.float16
    for ours, theirs in zip(batches, expected):
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("num_workers, worker_mode", MODES)
def test_batches_of_fewer_rows_and_new_shapes_are_laid_out_anew(num_workers, worker_mode):
    """A batch sampler of uneven sizes (one row among them: numpy would broadcast it over a
    batch of four) and samples whose shape changes every few batches: each batch is its own
    samples stacked, nothing of the batch learned before."""

    class Growing(Rows):  # 4 values, then 1 (numpy would broadcast it over 4), 6, 7
        def __getitem__(self, i):
            return np.arange((4, 1, 6, 7)[i // 12], dtype=np.float32) + i

    dataset = Growing(48)
    sizes = [4, 4, 4, 4, 1, 4, 3, 4, 4, 4, 4, 2, 4, 2]  # 12 rows of each shape
    starts = [int(s) for s in np.cumsum([0, *sizes])]
    batch_sampler = [list(range(a, b)) for a, b in itertools.pairwise(starts)]
    with ArenaLoader(dataset, batch_sampler=batch_sampler, num_workers=num_workers,
                     worker_mode=worker_mode) as loader:
        for _ in range(2):  # persistent or not, the second epoch too
            batches = [np.array(b) for b in loader]
            assert len(batches) == len(batch_sampler)
            for ours, indices in zip(batches, batch_sampler):
                np.testing.assert_array_equal(ours, stacked(dataset, indices))


@pytest.mark.parametrize("num_workers, worker_mode", MODES)
def test_rows_of_one_value_after_rows_of_four_fill_their_own_shape(num_workers, worker_mode):
    """Twelve batches of 4-value rows, then twelve of 1-value rows, in the same slots: numpy
    would broadcast a (4, 1) batch over an array of the old (4, 4) shape without a word, so
    what was learned for the old shape must not be used for the new."""

    class Narrowing(Rows):
        def __getitem__(self, i):
            return np.arange(4 if i < 48 else 1, dtype=np.float32) + i

    dataset = Narrowing(96)
    with ArenaLoader(dataset, batch_size=4, num_workers=num_workers, worker_mode=worker_mode,
                     slots=4) as loader:
        for b, batch in enumerate(loader):
            np.testing.assert_array_equal(batch, stacked(dataset, range(4 * b, 4 * b + 4)))


@pytest.mark.parametrize("worker_mode", ["process", "thread"])
def test_rows_learned_before_the_slab_grew_go_to_the_new_slab(worker_mode):
    """Persistent workers write the small rows straight on the first slab; the last batches
    outgrow it, so the next epoch runs on a larger one (handed to the workers, which go on;
    rows learned anew): every batch of every epoch is its samples, and the slab grew once."""

    class Outgrowing(Rows):
        def __getitem__(self, i):
            return np.full(1024 if i >= 32 else 16, i, dtype=np.float64)

    dataset = Outgrowing(40)
    expected = [stacked(dataset, range(b, b + 4)) for b in range(0, 40, 4)]
    with ArenaLoader(dataset, batch_size=4, num_workers=2, worker_mode=worker_mode,
                     persistent_workers=True, output="numpy") as loader:
        slot_sizes = set()
        for _ in range(3):
            for ours, theirs in zip(loader, expected, strict=True):
                np.testing.assert_array_equal(ours, theirs)
                slot_sizes.add(loader.snapshot().slot_nbytes)
        assert len(slot_sizes) == 2, slot_sizes  # the slab grew once
