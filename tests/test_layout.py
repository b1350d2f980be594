"""Per-batch layout: planning, writing, the record on the wire and assembly, without any
process."""

from __future__ import annotations

import itertools
from collections import deque, namedtuple
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import pytest

from arena_loader import LayoutError, SampleTypeError
from arena_loader._layout import (
    FIELD_ALIGNMENT,
    PlanDecoder,
    PlanEncoder,
    prepare_batch,
    prepare_samples,
)
from arena_loader._layout.records import STRUCTURES_KEPT

from .datasets import NestedDataset, stack_reference

torch = pytest.importorskip("torch")

Box = namedtuple("Box", "xy label")


@dataclass
class Pair:
    x: np.ndarray
    tag: str


def round_trip(prepared, idx=0, decoder=None, encoder=None):
    """Write ``prepared`` into fresh storage, send its plan through a record, assemble."""
    storage = np.zeros(prepared.nbytes, dtype=np.uint8)
    prepared.write(storage)
    record = (decoder or PlanDecoder()).decode(
        (encoder or PlanEncoder()).encode(prepared.plan, idx, 3, 1, segment=False))
    assert (record.idx, record.slot, record.worker_id, record.segment) == (idx, 3, 1, False)
    return record.plan.assemble(storage, record.plan.objects(storage)), record


def test_fields_are_aligned_disjoint_and_sized_for_the_batch():
    samples = [NestedDataset(5)[i] for i in range(5)]
    prepared = prepare_samples(samples, list(range(5)))
    fields = prepared.plan.fields
    assert all(f.offset % FIELD_ALIGNMENT == 0 for f in fields)
    assert fields[0].shape == (5, 2, 5, 3)
    ends = sorted((f.offset, f.offset + f.nbytes) for f in fields)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(ends))
    assert prepared.nbytes % FIELD_ALIGNMENT == 0
    assert prepared.nbytes >= prepared.plan.objects_offset + prepared.plan.objects_len


def test_nested_samples_round_trip_as_default_collate_would():
    dataset = NestedDataset(3)
    samples = [dataset[i] for i in range(3)]
    batch, _ = round_trip(prepare_samples(samples, [0, 1, 2]))
    expected = stack_reference(samples)
    assert batch["name"] == expected["name"]
    np.testing.assert_array_equal(batch["image"], expected["image"])
    np.testing.assert_array_equal(batch["pair"][1], expected["pair"][1])
    assert batch["point"].x.dtype == np.float64
    np.testing.assert_array_equal(batch["point"].y, expected["point"].y)


@pytest.mark.parametrize("values", [
    [1, 2.5], [2.5, 1], [True, 2], [np.int32(1), np.float32(2)],
    [np.zeros(2, np.int32), np.ones(2, np.float32)],
    [np.zeros(2, np.float32), np.ones(2, np.float64)],
    [np.zeros(2, np.int8), np.ones(2, np.uint8)],
    # Later rows of a dtype that promotes to the first row's: written with a safe cast.
    [np.ones(2, np.float32), np.full(2, 3, np.int8), np.ones(2, np.float16)],
    [np.ones((2, 3), np.int16), np.full((2, 3), -2, np.int8)],
])
def test_dtype_promotion_follows_torch_default_collate(values):
    expected = torch.utils.data.default_collate(values)
    batch, _ = round_trip(prepare_samples(values, list(range(len(values)))))
    assert str(batch.dtype) == str(expected.dtype).removeprefix("torch.")
    np.testing.assert_array_equal(batch, expected.numpy())


def test_bfloat16_tensors_are_bit_exact_and_stay_tensors():
    values = [torch.randn(3).to(torch.bfloat16) for _ in range(4)]
    _batch, record = round_trip(prepare_samples(values, list(range(4))))
    assert record.plan.torch
    from arena_loader._output import torch_raw_view

    field = record.plan.fields[0]
    storage = np.zeros(record.plan.nbytes, np.uint8)
    prepare_samples(values, list(range(4))).write(storage)
    tensor = torch_raw_view(storage[: field.nbytes].view(field.dtype).reshape(field.shape),
                            field.torch_dtype)
    assert tensor.dtype == torch.bfloat16
    assert torch.equal(tensor, torch.stack(values))


def test_an_int16_field_beside_a_bfloat16_one_keeps_its_own_dtype_in_the_record():
    """bfloat16 is stored as int16 bits: a plain int16 field in the same batch (either one
    first) is described apart from it in the record, so each comes back as it went."""
    for sample in ({"label": torch.tensor([1, -2], dtype=torch.int16),
                    "x": torch.tensor([0.5, 1.5], dtype=torch.bfloat16)},
                   {"x": torch.tensor([0.5, 1.5], dtype=torch.bfloat16),
                    "label": torch.tensor([1, -2], dtype=torch.int16)}):
        prepared = prepare_samples([sample, sample], [0, 1])
        encoder, decoder = PlanEncoder(), PlanDecoder()
        for idx in (0, 1):  # (the second record reuses the encoder's dtype descriptions)
            _, record = round_trip(prepared, idx, decoder, encoder)
            assert record.plan.fields == prepared.plan.fields
            assert sorted(f.torch_dtype for f in record.plan.fields) == ["", "bfloat16"]


def test_strings_of_varying_width_take_the_widest():
    values = [np.array(["a", "bb"]), np.array(["cccc", "d"])]
    batch, _ = round_trip(prepare_samples(values, [0, 1]))
    assert batch.dtype == np.dtype("<U4")
    assert batch.tolist() == [["a", "bb"], ["cccc", "d"]]


def test_collated_batches_keep_each_leaf_shape_lists_stay_lists():
    batch = (np.zeros((2, 3, 5, 4), np.uint8),
             [np.arange(3), np.arange(7, dtype=np.float32)],
             ({"boxes": np.ones((2, 4)), "n": 2}, Box(np.zeros(2), "cat")))
    out, _record = round_trip(prepare_batch(batch, "collate_fn output"))
    assert isinstance(out, tuple) and isinstance(out[1], list)
    assert [a.shape for a in out[1]] == [(3,), (7,)]
    assert out[1][1].dtype == np.float32
    assert out[2][0]["n"] == 2 and isinstance(out[2][0]["n"], int)
    assert isinstance(out[2][1], Box) and out[2][1].label == "cat"
    np.testing.assert_array_equal(out[2][0]["boxes"], np.ones((2, 4)))


def test_dataclass_batches_travel_field_by_field():
    out, _ = round_trip(prepare_batch(Pair(np.arange(4.0), "t"), "collate_fn output"))
    assert isinstance(out, Pair) and out.tag == "t"
    np.testing.assert_array_equal(out.x, np.arange(4.0))


@dataclass
class Doubled:
    x: np.ndarray

    def __post_init__(self):
        self.x = self.x * 2  # run once: the batch must not be doubled again on arrival


@dataclass
class Counted:
    x: np.ndarray
    n: int = field(init=False)
    unit: ClassVar[str] = "px"

    def __post_init__(self):
        self.n = len(self.x)


@dataclass(frozen=True)
class Frozen:
    x: np.ndarray
    tag: str


@dataclass
class Extra:  # state beyond its fields (as a tensorclass's batch_size)
    x: np.ndarray

    def __post_init__(self):
        self.batch_size = [len(self.x)]


@dataclass
class OwnPickling:
    x: np.ndarray

    def __reduce__(self):
        return OwnPickling, (self.x + 1,)


def test_a_dataclass_batch_arrives_with_exactly_its_state():
    """A collate_fn's dataclass arrives as unpickling would make it: fields through the slot
    (__post_init__ not run again, init=False fields and frozen ones kept, ClassVars not taken
    for fields); one with state beyond its fields, or pickling of its own, whole."""
    doubled, _ = round_trip(prepare_batch(Doubled(np.arange(3.0)), "collate_fn output"))
    assert type(doubled) is Doubled
    np.testing.assert_array_equal(doubled.x, [0.0, 2.0, 4.0])
    counted, _ = round_trip(prepare_batch(Counted(np.arange(5.0)), "collate_fn output"))
    assert type(counted) is Counted and counted.n == 5 and counted.unit == "px"
    np.testing.assert_array_equal(counted.x, np.arange(5.0))
    frozen, _ = round_trip(prepare_batch(Frozen(np.ones(2), "f"), "collate_fn output"))
    assert type(frozen) is Frozen and frozen.tag == "f"
    extra, _ = round_trip(prepare_batch(Extra(np.arange(4)), "collate_fn output"))
    assert type(extra) is Extra and extra.batch_size == [4]
    np.testing.assert_array_equal(extra.x, np.arange(4))
    own, _ = round_trip(prepare_batch(OwnPickling(np.zeros(2)), "collate_fn output"))
    np.testing.assert_array_equal(own.x, [1.0, 1.0])  # its __reduce__ ran, as in pickle


class Rebound:
    """A module-level placeholder that worker_init_fn replaces, in each worker, by a dataclass
    of the same name (a type the program builds at start-up, say)."""


def test_a_dataclass_batch_whose_class_a_worker_rebound_arrives_as_unpickling_makes_it(
        monkeypatch):
    """A collate_fn's dataclass whose class the worker rebound under a module-level name
    that is a placeholder in the main process: it arrives as an instance of the main
    process's class with the fields as attributes, as unpickling makes it (torch's DataLoader
    hands it out so). It arrived as a plain dict."""
    import dataclasses
    import pickle
    import sys

    made = dataclasses.make_dataclass("Rebound", ["x", "n"])
    made.__module__ = __name__
    monkeypatch.setattr(sys.modules[__name__], "Rebound", made)  # in the worker
    prepared = prepare_batch(made(np.arange(3.0), 3), "collate_fn output")
    storage = np.zeros(prepared.nbytes, dtype=np.uint8)
    prepared.write(storage)
    payload = PlanEncoder().encode(prepared.plan, 0, 3, 1, segment=False)
    pickled = pickle.dumps(made(np.arange(3.0), 3))  # what torch's worker sends
    monkeypatch.undo()  # the main process
    plan = PlanDecoder().decode(payload).plan
    out = plan.assemble(storage, plan.objects(storage))
    torch_out = pickle.loads(pickled)
    assert type(out) is type(torch_out) is Rebound
    assert vars(out).keys() == vars(torch_out).keys() == {"x", "n"} and out.n == 3
    np.testing.assert_array_equal(out.x, np.arange(3.0))


def test_the_structure_is_sent_once_per_encoder():
    encoder, decoder = PlanEncoder(), PlanDecoder()
    prepared = prepare_samples([{"a": np.zeros(2)}] * 3, [0, 1, 2])
    first = encoder.encode(prepared.plan, 0, 0, 0, segment=False)
    second = encoder.encode(prepared.plan, 1, 0, 0, segment=False)
    assert len(second) < len(first)
    assert decoder.decode(first).plan.spec == decoder.decode(second).plan.spec


def test_structures_kept_are_bounded_and_an_evicted_one_comes_back_whole():
    """A collate_fn whose batches each have a structure of their own (one array in places
    that vary from batch to batch) must not grow either side's table for good: past
    STRUCTURES_KEPT the oldest id is reused, and a structure met again after its eviction
    is sent again, so every record still decodes to its own structure."""
    encoder, decoder = PlanEncoder(), PlanDecoder()
    plans = [prepare_samples([{f"k{i}": np.zeros(2)}] * 2, [0, 1]).plan
             for i in range(3 * STRUCTURES_KEPT)]
    for idx, plan in enumerate(plans + plans[:5] + plans[-3:]):
        record = decoder.decode(encoder.encode(plan, idx, 0, 0, segment=False))
        assert record.plan.spec == plan.spec
        assert decoder.kept <= STRUCTURES_KEPT
    assert decoder.kept == STRUCTURES_KEPT
    # still named: its record carries no structure; one evicted by plans[:5] carries it
    named = encoder.encode(plans[-1], 10**6, 0, 0, segment=False)
    evicted = encoder.encode(plans[2 * STRUCTURES_KEPT], 10**6 + 1, 0, 0, segment=False)
    assert len(named) < len(evicted)
    assert decoder.decode(named).plan.spec == plans[-1].spec
    assert decoder.decode(evicted).plan.spec == plans[2 * STRUCTURES_KEPT].spec


def test_batches_whose_repeated_arrays_differ_share_one_structure_and_keep_identity():
    """A collate_fn's batch holding one array in two places (a pooled or cached dataset's
    sample drawn twice: the bench's detect workload) is one field in both places, as torch's
    pickling keeps it. Which places repeat changes from batch to batch; the structure does
    not, so it travels once, and each record says which field each place is."""
    a, b, c = (np.full(3, value, np.float32) for value in (1, 2, 3))
    encoder, decoder = PlanEncoder(), PlanDecoder()
    records = []
    for idx, batch in enumerate([(a, a, b), (a, b, b), (a, b, c), (c, b, c)]):
        prepared = prepare_batch(batch, "batch")
        storage = np.zeros(prepared.plan.nbytes, np.uint8)
        prepared.write(storage)
        payload = encoder.encode(prepared.plan, idx, 0, 0, segment=False)
        records.append(payload)
        plan = decoder.decode(payload).plan
        out = plan.assemble(storage, plan.objects(storage))
        assert [row.tolist() for row in out] == [row.tolist() for row in batch]
        assert [x is y for x, y in itertools.combinations(out, 2)] == [
            x is y for x, y in itertools.combinations(batch, 2)]
    assert len(records[1]) < len(records[0])  # the structure went with the first only
    assert decoder.kept == 1


def plan_and_write(samples, indices):
    """Plan ``samples`` and write them: for rows of one array dtype the write is where
    numpy checks every row's shape (in C), so either step may raise the batch's error."""
    prepared = prepare_samples(samples, indices)
    prepared.write(np.zeros(prepared.nbytes, dtype=np.uint8))


@pytest.mark.parametrize("rows", [
    [np.zeros(2), np.zeros(3)],  # longer
    [np.zeros(2), np.zeros(1)],  # shorter
    [np.zeros(2), np.zeros((1, 2))],  # one more dimension, as many elements
    [np.zeros((3, 2)), np.zeros((2, 3))],  # as many elements, other shape
    [np.zeros(2), np.zeros(2), np.zeros(4), np.zeros(0)],  # lengths that add up
])
def test_unequal_sample_shapes_name_the_sample_field_and_the_fix(rows):
    shape = list(rows[0].shape)
    odd = next(k for k, r in enumerate(rows) if r.shape != rows[0].shape)
    indices = [5 + 2 * k for k in range(len(rows))]
    with pytest.raises(LayoutError, match=rf"sample {indices[odd]}: field sample\['x'\] has shape "
                                          rf"\[.*\] but sample 5 has \{shape}.*collate_fn"):
        plan_and_write([{"x": r} for r in rows], indices)
    with pytest.raises(LayoutError, match=rf"sample {indices[odd]}: field sample has shape "):
        plan_and_write(rows, indices)  # samples that are one array: the fastest path


def test_structure_mismatch_is_named():
    with pytest.raises(LayoutError, match=r"sample 1: sample must be a tuple of 2 items"):
        prepare_samples([(np.zeros(2), np.zeros(3)), (np.zeros(2),)], [0, 1])


def test_none_and_object_arrays_are_layout_errors():
    with pytest.raises(LayoutError, match=r"dataset\[4\] returned None"):
        plan_and_write([np.zeros(1), None], [3, 4])
    with pytest.raises(SampleTypeError, match=r"found object .* object-dtype"):
        prepare_samples([np.array([1, "a"], dtype=object)], [0])
    with pytest.raises(SampleTypeError, match=r"field sample\['x'\] of sample 7 is an obj"):
        prepare_samples([{"x": np.array([1, "a"], dtype=object)}], [7])
    # What a collate_fn returned: an object leaf, pickled and handed out as it is.
    out, _ = round_trip(prepare_batch({"x": np.array([1, "a"], dtype=object)}, "batch"))
    assert out["x"].dtype == object and out["x"].tolist() == [1, "a"]


def test_structured_records_stack_into_a_structured_array_with_their_fields():
    """docs/migrating.md: ``np.void`` records (an h5py compound dataset's rows) stack into a
    structured array; its dtype (names, offsets, a sub-array field) travels in the batch's
    record whole, not as the bare void type of its size."""
    dtype = np.dtype([("id", "<i4"), ("score", "<f8"), ("tag", "S3"), ("xy", "<f4", (2,))])
    table = np.array([(i, i / 2, b"t%d" % i, (i, -i)) for i in range(3)], dtype=dtype)
    out, _ = round_trip(prepare_samples([table[i] for i in range(3)], [0, 1, 2]))
    assert out.dtype == dtype
    for name in dtype.names:
        np.testing.assert_array_equal(out[name], table[name])


def test_sequence_leaves_other_than_tuple_and_list_come_back_as_the_list_of_them():
    """docs/migrating.md: ``range``, ``deque`` and ``bytearray`` leaves come back as the list
    of the samples' values (torch transposes them), as they were."""
    samples = [{"r": range(i, i + 2), "d": deque([i]), "b": bytearray([i])} for i in range(3)]
    out, _ = round_trip(prepare_samples(samples, [0, 1, 2]))
    assert out == {"r": [range(0, 2), range(1, 3), range(2, 4)],
                   "d": [deque([0]), deque([1]), deque([2])],
                   "b": [bytearray([0]), bytearray([1]), bytearray([2])]}
    assert all(type(out[key]) is list for key in out)


def test_integers_outside_int64_are_a_layout_error_in_default_collation_only():
    """Default collation stores an int field as int64 (torch's tensor() overflows too); in
    a collate_fn's batch an int past it is handed out as it is, as torch hands it out. The
    bounds are int64's own: its extremes are stored, one past either is not."""
    for outside in (2**64, 2**63, -(2**63) - 1):
        with pytest.raises(LayoutError, match="outside the int64 range"):
            prepare_samples([{"id": 1}, {"id": outside}], [0, 1])
    out, _ = round_trip(prepare_samples([2**63 - 1, -(2**63)], [0, 1]))
    assert out.dtype == np.int64 and out.tolist() == [2**63 - 1, -(2**63)]
    out, _ = round_trip(prepare_batch({"id": 2**64, "small": 3, "neg": -(2**70),
                                       "edge": 2**63, "low": -(2**63) - 1}, "batch"))
    assert out == {"id": 2**64, "small": 3, "neg": -(2**70), "edge": 2**63,
                   "low": -(2**63) - 1}


def test_string_and_bytes_leaves_travel_as_lists():
    """str, np.str_ and bytes leaves of dict samples come back as lists of the values."""
    samples = [{"s": "a", "b": b"x", "n": np.str_("p"), "v": np.ones(1)},
               {"s": "bc", "b": b"y", "n": np.str_("q"), "v": np.zeros(1)}]
    out, _ = round_trip(prepare_samples(samples, [0, 1]))
    assert out["s"] == ["a", "bc"] and out["b"] == [b"x", b"y"] and out["n"] == ["p", "q"]
    assert type(out["n"][0]) is np.str_


def test_a_structure_that_does_not_pickle_is_a_clear_error():
    Local = namedtuple("Local", "x")
    with pytest.raises(LayoutError, match=r"Local.*cannot be pickled.*module level"):
        round_trip(prepare_batch(Local(np.zeros(1)), "collate_fn output"))


@pytest.mark.parametrize("collated", [True, False])
def test_an_object_leaf_that_does_not_pickle_names_its_field_and_keeps_its_type(collated):
    """A memoryview (an lmdb value read with buffers=True) or a lambda among the leaves: the
    error names the field and the fix, with the type pickle gave it."""
    samples = [{"x": np.zeros(2), "raw": memoryview(bytes([i]))} for i in range(3)]
    prepare = (lambda: prepare_samples(samples, [0, 1, 2])) if collated else (
        lambda: prepare_batch({"x": np.zeros(2), "meta": [{"key": lambda: 0}]}, "batch"))
    field = r"sample\['raw'\]" if collated else r"batch\['meta'\]\[0\]\['key'\]"
    with pytest.raises((TypeError, AttributeError), match=rf"field {field} cannot be pickled to "
                       r"the main process \(.*pickle.*\); return .*bytes\(x\) for a memoryview"):
        prepare()


def test_a_malformed_record_is_refused():
    prepared = prepare_samples([np.zeros(2)], [0])
    record = PlanEncoder().encode(prepared.plan, 0, 0, 0, segment=False)
    with pytest.raises(ValueError, match="after its last field"):
        PlanDecoder().decode(record + b"junk")
    with pytest.raises(ValueError, match="not a batch record"):
        PlanDecoder().decode(b"\x80junk")


def test_a_leased_slot_assembled_as_tensors_gives_bfloat16_back():
    """The device stage's assembly (a leased slot over a copy of its bytes, each field made a
    tensor): a bfloat16 field stored as raw bits is a bfloat16 tensor again, equal to the
    samples; the other fields keep their dtypes."""
    from arena_loader._arena import LeasedSlot

    samples = [{"t": torch.randn(3).to(torch.bfloat16), "x": np.float32(i)} for i in range(4)]
    prepared = prepare_samples(samples, list(range(4)))
    storage = np.zeros(prepared.plan.nbytes, np.uint8)
    prepared.write(storage)
    leased = LeasedSlot(storage, prepared.plan, [], pinned=False)
    batch = leased.assemble(storage.copy(), torch.from_numpy)
    assert batch["t"].dtype == torch.bfloat16
    assert torch.equal(batch["t"], torch.stack([s["t"] for s in samples]))
    assert batch["x"].dtype == torch.float32 and batch["x"].tolist() == [0.0, 1.0, 2.0, 3.0]
