"""Batch layout inference and slot writing, without any process."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from arena_loader import LayoutError
from arena_loader._layout import FIELD_ALIGNMENT, BatchLayout

from .datasets import NestedDataset, stack_reference


def test_fields_are_aligned_and_sized_for_a_full_batch():
    """Every field starts on a 64-byte boundary and holds batch_size rows."""
    sample = NestedDataset(1)[0]
    layout = BatchLayout.from_sample(sample, batch_size=5, sample_index=0)
    paths = [f.path for f in layout.fields]
    assert paths == ["sample['image']", "sample['pair'][0]", "sample['pair'][1]",
                     "sample['point'].x", "sample['point'].y", "sample['label']",
                     "sample['flag']"]
    assert layout.object_paths == ("sample['name']",)
    for field in layout.fields:
        assert field.offset % FIELD_ALIGNMENT == 0
        assert field.capacity == 5
    image = layout.fields[0]
    assert image.nbytes == 5 * 2 * 5 * 3
    assert layout.slot_nbytes % FIELD_ALIGNMENT == 0
    assert layout.slot_nbytes >= max(f.offset + f.nbytes for f in layout.fields)
    ends = sorted((f.offset, f.offset + f.nbytes) for f in layout.fields)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(ends))


def test_write_then_assemble_round_trips_a_partial_batch():
    """Writing 3 samples into a 5-row slot and assembling gives np.stack of the 3."""
    dataset = NestedDataset(3)
    samples = [dataset[i] for i in range(3)]
    layout = BatchLayout.from_sample(samples[0], batch_size=5, sample_index=0)
    slab = np.zeros(2 * layout.slot_nbytes, dtype=np.uint8)
    objects = layout.write_samples(layout.slot_arrays(slab, 1), samples, [0, 1, 2])
    assert not slab[: layout.slot_nbytes].any(), "slot 0 was written"
    batch = layout.assemble(slab[layout.slot_nbytes:], 3, None, objects)
    expected = stack_reference(samples)
    assert batch["name"] == expected["name"]
    np.testing.assert_array_equal(batch["image"], expected["image"])
    np.testing.assert_array_equal(batch["pair"][1], expected["pair"][1])
    assert batch["point"].x.dtype == np.float64
    np.testing.assert_array_equal(batch["point"].y, expected["point"].y)


def test_python_numbers_accept_compatible_kinds_only():
    """An int field takes ints and numpy integers; a float into it is a LayoutError."""
    layout = BatchLayout.from_sample({"n": 1, "x": 0.5}, batch_size=3, sample_index=0)
    slab = np.zeros(layout.slot_nbytes, dtype=np.uint8)
    arrays = layout.slot_arrays(slab, 0)
    layout.write_samples(arrays, [{"n": 2, "x": 1}, {"n": np.int32(3), "x": np.float32(2)}],
                         [0, 1])
    assert arrays[0][:2].tolist() == [2, 3] and arrays[1][:2].tolist() == [1.0, 2.0]
    with pytest.raises(LayoutError, match=r"sample 9: field sample\['n'\] must be a Python "
                                          r"int \(stored as int64\).*got float"):
        layout.write_samples(arrays, [{"n": 2.5, "x": 1.0}], [9])


def test_sequence_length_mismatch_is_named():
    """A tuple sample with a different length names the index and path."""
    layout = BatchLayout.from_sample((np.zeros(2), np.zeros(3)), batch_size=2, sample_index=0)
    arrays = layout.slot_arrays(np.zeros(layout.slot_nbytes, np.uint8), 0)
    with pytest.raises(LayoutError, match=r"sample 4: sample must be a tuple of 2 items like "
                                          r"the first sample, got a tuple of 3 items"):
        layout.write_samples(arrays, [(np.zeros(2), np.zeros(3), 1)], [4])


def test_batch_larger_than_slot_is_refused():
    """More samples than the slot's rows raise LayoutError instead of writing out of bounds."""
    layout = BatchLayout.from_sample(np.zeros(2), batch_size=2, sample_index=0)
    arrays = layout.slot_arrays(np.zeros(layout.slot_nbytes, np.uint8), 0)
    with pytest.raises(LayoutError, match=r"a batch of 3 indices \[0, 1, 2\] does not fit a "
                                          r"slot of 2 rows"):
        layout.write_samples(arrays, [np.zeros(2)] * 3, [0, 1, 2])


def test_collated_batch_fields_must_fit_their_capacity():
    """A collate_fn output larger than the first batch's (scaled) shape names the field."""
    first = {"x": np.zeros((4, 3), np.float32), "n": np.int64(4)}
    layout = BatchLayout.from_batch(first, batch_size=4, rows=4, label="collate_fn output")
    arrays = layout.slot_arrays(np.zeros(layout.slot_nbytes, np.uint8), 0)
    lengths, _ = layout.write_batch(arrays, {"x": np.ones((2, 3), np.float32), "n": np.int64(2)},
                                    lambda: "batch 1")
    assert lengths == (2, 1)
    with pytest.raises(LayoutError, match=r"batch 2: field batch\['x'\] has shape \[4, 5\]"):
        layout.write_batch(arrays, {"x": np.ones((4, 5), np.float32), "n": np.int64(4)},
                           lambda: "batch 2")


def test_strings_and_none_leaves_travel_as_lists():
    """Non-numeric leaves become lists of values, not fields."""
    layout = BatchLayout.from_sample({"s": "a", "b": b"x", "o": None, "v": np.ones(1)},
                                     batch_size=2, sample_index=0)
    assert len(layout.fields) == 1 and len(layout.object_paths) == 3
    arrays = layout.slot_arrays(np.zeros(layout.slot_nbytes, np.uint8), 0)
    objects = layout.write_samples(
        arrays, [{"s": "a", "b": b"x", "o": None, "v": np.ones(1)},
                 {"s": "c", "b": b"y", "o": 3, "v": np.ones(1)}], [0, 1])
    assert objects == [["a", "c"], [b"x", b"y"], [None, 3]]


def test_integers_outside_int64_are_a_layout_error():
    """A Python int or uint64 too large for the int64 field names the sample and field."""
    layout = BatchLayout.from_sample({"id": 1}, batch_size=2, sample_index=0)
    arrays = layout.slot_arrays(np.zeros(layout.slot_nbytes, np.uint8), 0)
    for big in (2**63, np.uint64(2**64 - 1)):
        with pytest.raises(LayoutError, match=r"sample 5: field sample\['id'\] is \d+, outside "
                                              r"the int64 range"):
            layout.write_samples(arrays, [{"id": big}], [5])


class _TaggedArray(np.ndarray):
    """An ndarray subclass (like np.memmap rows): not the one-call stack path."""


def test_plain_array_samples_are_stacked_and_others_written_row_by_row():
    """Plain ndarray samples (the one-call stack path) and a batch with an ndarray subclass
    (the per-row path) both land in the slot as np.stack would, without touching slot 0."""
    rows = [np.arange(4, dtype=np.float32) + 10 * i for i in range(3)]
    layout = BatchLayout.from_sample(rows[0], batch_size=4, sample_index=0)
    for samples in (rows, [rows[0], rows[1].view(_TaggedArray), rows[2]]):
        slab = np.zeros(2 * layout.slot_nbytes, dtype=np.uint8)
        assert layout.write_samples(layout.slot_arrays(slab, 1), samples, [0, 1, 2]) == []
        assert not slab[: layout.slot_nbytes].any(), "slot 0 was written"
        batch = layout.assemble(slab[layout.slot_nbytes:], 3, None, [])
        np.testing.assert_array_equal(batch, np.stack([np.asarray(s, np.float32)
                                                       for s in samples]))
    with pytest.raises(LayoutError, match="sample 7"):
        layout.write_samples(layout.slot_arrays(slab, 0), [rows[0], np.zeros(5, np.float32)],
                             [6, 7])
