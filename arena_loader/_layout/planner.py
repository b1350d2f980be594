"""Preparing a batch (in workers, and in the main process when ``num_workers=0``): the rows
of each field checked and typed as torch's ``default_collate`` would stack them, offsets
assigned, object leaves pickled."""

from __future__ import annotations

import functools
import operator
import pickle
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import LayoutError, SampleShapeError, SampleTypeError
from .flat import take_flat
from .numbers import (
    AS_TENSOR_DTYPES,
    as_tensor_list,
    floats_after_a_float,
    number_dtype,
    numbers_of_tensors,
    numeric_list,
    promote,
)
from .plan import (
    FIELD_ALIGNMENT,
    KIND_NUMBER,
    KIND_NUMPY,
    KIND_NUMPY_SCALAR,
    KIND_TORCH,
    KIND_TORCH_RAW,
    EqualRows,
    FieldPlacement,
    Plan,
    Prepared,
    TensorRows,
    align,
    promote_to,
)
from .spec import (
    PYTHON_NUMBER_DTYPES,
    TORCH_COLLATE_TYPE_ERROR,
    FieldLeaf,
    ObjectLeaf,
    SpecBuilder,
    collate_extensions,
    collate_objects,
    describe,
    flatten,
    is_tensor,
    object_array_error,
    outside_int64,
    registered_collate,
    tensor_array,
)

_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")


def reject_none(value: Any, subject: str, collated: bool = False) -> None:
    """``collated``: default collation, where torch raises TypeError for a None sample too."""
    if value is None:
        message = (f"{subject} returned None; every sample must be an array, a number or a "
                   "nested dict/tuple/list of them (filter missing samples in the dataset or "
                   "the sampler)")
        if collated:
            raise SampleTypeError(f"{TORCH_COLLATE_TYPE_ERROR.format(type(None))} ({message})")
        raise LayoutError(message)


def _column(values: list, path: str, indices: Sequence[Any],
            fast: bool = True) -> tuple[list, FieldPlacement]:
    """The rows of one field as numpy values, and its dtype, shape and kind (offset 0)."""
    first = values[0]
    # The hottest path: arrays of at least one dimension whose dtypes promote to the first
    # one's (numpy's promotion then agrees with torch's); every row's shape is checked by the
    # write itself (write_equal_rows), in C, and a row that fails it gets the full walk.
    if (fast and type(first) is np.ndarray and first.ndim and not first.dtype.hasobject
            and promote_to(values, first.dtype)):
        rows = EqualRows(values, lambda: _column(values, path, indices, fast=False))
        return rows, FieldPlacement(first.dtype, (len(values), *first.shape), 0)
    # Plain tensors: of one dtype, written by one torch.stack (TensorRows); else viewed as
    # numpy, as arrays. ``numpy()`` refuses what needs the walk (a grad, a conjugate or
    # negative bit, another device, a dtype numpy lacks): the walk cost ~4 us more a row
    # (trial23, num_workers=0), and numpy() itself 2.2 us a row.
    torch = sys.modules.get("torch")
    if fast and torch is not None and type(first) is torch.Tensor and set(
            map(type, values)) == {torch.Tensor}:
        if first.dim() and len({value.dtype for value in values}) == 1:
            try:
                dtype = first.numpy().dtype
            except (RuntimeError, TypeError):
                dtype = None
            if dtype is not None:
                rows = TensorRows(values, lambda: _column(values, path, indices, fast=False)[0])
                return rows, FieldPlacement(dtype, (len(values), *first.shape), 0, KIND_TORCH)
        try:
            arrays = [value.numpy() for value in values]
        except (RuntimeError, TypeError):
            arrays = None
        if arrays is not None and arrays[0].ndim and promote_to(arrays, arrays[0].dtype):
            rows = EqualRows(arrays, lambda: _column(values, path, indices, fast=False))
            return rows, FieldPlacement(arrays[0].dtype, (len(arrays), *arrays[0].shape), 0,
                                        KIND_TORCH)
    # The hot path: every row an ndarray of one dtype and shape, checked by C-level maps.
    if type(first) is np.ndarray and set(map(type, values)) == {np.ndarray}:
        shapes, dtypes = set(map(_SHAPE, values)), set(map(_DTYPE, values))
        if len(shapes) == 1 and len(dtypes) == 1:
            _check_dtype(first.dtype, path, indices[0])
            return values, FieldPlacement(first.dtype, (len(values), *first.shape), 0)
    if type(first) in PYTHON_NUMBER_DTYPES:
        kind, types = KIND_NUMPY, set(map(type, values))
        others = types.difference(PYTHON_NUMBER_DTYPES)
        if others and type(first) is float:
            values = floats_after_a_float(values, others)
            types = set(map(type, values))
            others = types.difference(PYTHON_NUMBER_DTYPES)
        if others and any(is_tensor(v) for v in values if type(v) in others):
            values, kind = numbers_of_tensors(values), KIND_TORCH
            types = set(map(type, values))
        dtype = number_dtype(values, path, indices, types)
        # (min and max in C first: a value per call cost 0.5 us a row)
        if dtype.kind == "i" and not -(2**63) <= min(values) <= max(values) < 2**63:
            for value, index in zip(values, indices):
                if outside_int64(value):
                    raise LayoutError(f"sample {index!r}: field {path} is {value}, outside the "
                                      "int64 range it is stored in; store it as a float or a "
                                      "string instead")
        return values, FieldPlacement(dtype, (len(values),), 0, kind)
    kind, raw_name, rows, raw_names = KIND_NUMPY, "", [], set()
    for value, index in zip(values, indices):
        row_raw = ""  # the row's torch dtype numpy lacks, stored as its bits
        if is_tensor(value):
            array, kind, raw_name = tensor_array(value)
            row_raw = raw_name
        elif isinstance(value, (np.ndarray, np.generic)):
            array = value
        elif type(value) in PYTHON_NUMBER_DTYPES:
            # after an array or a numpy scalar: the dtype torch's as_tensor gives the number
            # (a float is float32, torch's default), promoted with the others below
            array = np.asarray(value, dtype=AS_TENSOR_DTYPES[type(value)])
        elif type(first) is np.ndarray and type(value) in (list, tuple) and numeric_list(value):
            array = as_tensor_list(value)  # torch's as_tensor, for each row after an array
        elif value is None and type(first) is not type(None) and path == "sample":
            reject_none(value, f"dataset[{index!r}]", collated=True)
        else:
            raise SampleTypeError(f"sample {index!r}: field {path} is {describe(value)} where "
                                  f"sample {indices[0]!r} has {describe(first)}; return the "
                                  "same type for every sample, or pass a collate_fn")
        raw_names.add(row_raw)
        rows.append(array)
    shape = rows[0].shape
    for entry, (array, index) in enumerate(zip(rows, indices)):
        if array.shape != shape:
            if is_tensor(first) and not is_tensor(values[entry]):  # torch.stack's TypeError
                raise SampleTypeError(
                    f"expected Tensor as element {entry} in argument 0 (torch's words). sample "
                    f"{index!r}: field {path} is {describe(values[entry])} where sample "
                    f"{indices[0]!r} has {describe(first)}; return the same type for every "
                    "sample, or pass a collate_fn")
            raise SampleShapeError(
                f"stack expects each tensor to be equal size, but got {list(shape)} at entry 0 "
                f"and {list(array.shape)} at entry {entry} (torch's words). "
                f"sample {index!r}: field {path} has shape {list(array.shape)} but sample "
                f"{indices[0]!r} has {list(shape)}; default collation stacks samples, so they "
                "must have equal shapes (torch.stack raises here too): pad or crop them, or "
                "pass a collate_fn (e.g. one that pads to the longest with pad_sequence)")
    dtypes = {a.dtype for a in rows}
    dtype = rows[0].dtype if len(dtypes) == 1 else promote(list(dtypes))
    if dtype.hasobject:  # name the sample that brought the object dtype in
        index = next(i for a, i in zip(rows, indices) if a.dtype.hasobject)
        _check_dtype(dtype, path, index)
    if len(raw_names) > 1 and any(raw_names):  # a dtype stored as its bits beside others
        if all(map(is_tensor, values)):  # torch promotes them (bfloat16 + bool -> bfloat16)
            torch = sys.modules["torch"]
            target = functools.reduce(torch.promote_types, (value.dtype for value in values))
            return _column([value.to(target) for value in values], path, indices, fast=False)
        # beside numpy rows: torch raises too
        raise LayoutError(f"sample {indices[0]!r}: field {path} mixes {max(raw_names)} with "
                          "other dtypes; convert every sample to one dtype in the dataset")
    _check_dtype(dtype, path, indices[0])
    return rows, FieldPlacement(dtype, (len(rows), *shape), 0, kind, raw_name)


def _check_dtype(dtype: np.dtype, path: str, index: Any) -> None:
    if dtype.hasobject:
        where = f"sample {index!r}" if path == "sample" else f"field {path} of sample {index!r}"
        raise object_array_error(dtype, where)


def _leaf_placement(value: Any, path: str, label: str,
                    converted: bool = False) -> tuple[Any, FieldPlacement]:
    """One leaf of a collated batch: (the value to write, its placement at offset 0).
    A numpy scalar in a collate_fn's batch comes back as that scalar, as torch hands out what
    the collate_fn made (``converted``: one sample, which torch's ``default_convert`` makes a
    tensor, so it is stored as a 0-d array)."""
    if type(value) in PYTHON_NUMBER_DTYPES:
        return value, FieldPlacement(PYTHON_NUMBER_DTYPES[type(value)], (), 0, KIND_NUMBER)
    if is_tensor(value):
        array, kind, raw_name = tensor_array(value)
        return array, FieldPlacement(array.dtype, array.shape, 0, kind, raw_name)
    if isinstance(value, np.generic) and not converted:
        return value, FieldPlacement(value.dtype, (), 0, KIND_NUMPY_SCALAR)
    return value, FieldPlacement(value.dtype, value.shape, 0)


def _finish(spec: Any, columns: list, placements: list[FieldPlacement],
            objects: list | None, collated: bool, converted: bool = False,
            object_paths: Sequence[str] = (), live: bool = False,
            positions: tuple[int, ...] | None = None) -> Prepared:
    """``live``: the batch stays in this process (num_workers=0), so its object leaves are
    handed out as they are, as torch's are there: not pickled (a lossy pickle, such as
    BatchEncoding's, an object's identity, or one that does not pickle, all kept)."""
    offset, torch = 0, False
    for p in placements:  # placements are this batch's own: set their offsets in place
        p.offset = offset
        torch = torch or p.kind in (KIND_TORCH, KIND_TORCH_RAW)
        offset += -(-p.nbytes // FIELD_ALIGNMENT) * FIELD_ALIGNMENT
    fields = placements
    pickled = None
    if objects:
        # stacked by torch (a tensor subclass, a nested tensor), or in one unbatched sample
        # (requires_grad, a subclass): the dataset makes tensors
        torch = torch or ((collated or converted) and any(map(is_tensor, objects)))
        pickled = None if live else _pickled(objects, object_paths)
    objects_offset = offset
    nbytes = max(FIELD_ALIGNMENT, align(offset + (len(pickled) if pickled else 0)))
    live = bool(live and objects)
    plan = Plan(spec, tuple(fields), objects_offset, len(pickled) if pickled else 0, nbytes,
                torch, collated, converted, live, positions)
    return Prepared(plan, columns, pickled, objects if live else None)


def _pickled(objects: list, paths: Sequence[str]) -> bytes:
    """The object leaves (one entry per path), pickled to travel to the main process; one
    that cannot be pickled is named, the error's type kept."""
    try:
        return pickle.dumps(objects, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        for value, path in zip(objects, paths):
            try:
                pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            except (pickle.PicklingError, TypeError, AttributeError):
                raise type(exc)(
                    f"field {path} cannot be pickled to the main process ({exc}); return a "
                    "value that pickles there (bytes(x) for a memoryview, a module-level "
                    "function or class instead of a lambda or a local one), or a collate_fn "
                    "that converts it") from exc
        raise


_SAMPLE_LEAF = FieldLeaf(0)
# The plan of the last batch of equal-shape array samples, by (dtype, shape): batches of one
# shape share one Plan, so the worker encodes it once (records.PlanEncoder). Replaced whole
# in one assignment (thread workers share it).
_last_equal_plan: tuple[Any, Plan | None] = (None, None)


def _equal_rows_plan(placement: FieldPlacement) -> Plan:
    global _last_equal_plan
    key = (placement.dtype, placement.shape)
    last_key, plan = _last_equal_plan
    if last_key != key or plan is None:
        plan = _finish(_SAMPLE_LEAF, [None], [placement], None, collated=True).plan
        _last_equal_plan = (key, plan)
    return plan


def prepare_samples(samples: Sequence[Any], indices: Sequence[Any],
                    live: bool = False) -> Prepared:
    """Default collation: the samples stacked per leaf as torch's ``default_collate`` would
    (dtype promotion included); str and other objects become lists."""
    if not samples:  # (torch's default_collate fails reading batch[0]: IndexError)
        raise IndexError(f"default collation got an empty batch (indices {list(indices)!r}): a "
                         "batch_sampler yielded an empty list; make it skip empty batches, or "
                         "pass a collate_fn that handles an empty list")
    first = samples[0]
    extensions = collate_extensions()
    # the commonest sample: one array (no structure to walk), collated as torch's arrays
    # are unless a collate function of a library's is registered for it
    if type(first) is np.ndarray and not (extensions and registered_collate(first, extensions)):
        rows, placement = _column(samples, "sample", indices)
        if type(rows) is EqualRows:
            return Prepared(_equal_rows_plan(placement), [rows], None)
        return _finish(_SAMPLE_LEAF, [rows], [placement], None, collated=True)
    if first is None:
        reject_none(first, f"dataset[{indices[0]!r}]", collated=True)
    builder = SpecBuilder(extensions=extensions)
    spec = builder.build(first, "sample")
    if type(spec) is FieldLeaf:  # samples that are one array or number: no walk
        raw_columns, objects = [list(samples)], []
    else:
        raw_columns = [[v] for v in builder.field_values]
        objects = [[v] for v in builder.object_values]
        # (A first sample that is a str or bytes takes anything after it, None too: torch
        # hands the list out as it is.)
        takes_none, rest = type(spec) is ObjectLeaf, samples[1:]
        if not take_flat(spec, rest, raw_columns, objects):
            for sample, index in zip(rest, indices[1:]):
                if sample is None and not takes_none:
                    reject_none(sample, f"dataset[{index!r}]", collated=True)
                flatten(spec, sample, raw_columns, objects, index)
        objects = [collate(values, collate_fn_map=builder.extensions) if collate is not None
                   else collate_objects(values, path, in_sequence, indices)
                   for values, path, in_sequence, collate in zip(
                       objects, builder.object_paths, builder.object_in_sequence,
                       builder.object_collates)]
    columns, placements = [], []
    for values, path in zip(raw_columns, builder.field_paths):
        rows, placement = _column(values, path, indices)
        columns.append(rows)
        placements.append(placement)
    return _finish(spec, columns, placements, objects, collated=True,
                   object_paths=builder.object_paths, live=live)


def prepare_batch(batch: Any, label: str, converted: bool = False,
                  live: bool = False) -> Prepared:
    """A batch a ``collate_fn`` made (or one sample, with ``batch_size=None``): every leaf
    keeps its own shape and dtype. ``converted``: one sample with no ``collate_fn``, which
    torch passes through ``default_convert``. A batch that is None (a collate_fn that drops a
    batch, a sample with ``batch_size=None``) is handed out as None, as torch does."""
    builder = SpecBuilder(keep_state=True, converted=converted)
    spec = builder.build(batch, "batch")
    values, paths, positions = builder.field_values, builder.field_paths, None
    if len(set(map(id, values))) < len(values):  # (one C pass: batches seldom have any)
        values, paths, positions = _one_field_per_object(values, paths)
    columns, placements = [], []
    for value, path in zip(values, paths):
        column, placement = _leaf_placement(value, path, label, converted)
        columns.append(column)
        placements.append(placement)
    return _finish(spec, columns, placements, builder.object_values, collated=False,
                   converted=converted, object_paths=builder.object_paths, live=live,
                   positions=positions)


def _one_field_per_object(values: list, paths: list) -> tuple[list, list, tuple[int, ...]]:
    """One array or tensor in two places of a collate_fn's batch or an unbatched sample
    (``{"input_ids": ids, "labels": ids}``, pytorch-forecasting's target in ``x`` and ``y``)
    is one field, handed out as one object in both places, as torch's is (its workers'
    pickling keeps identity). A Python number met twice too (immutable, one value either
    way); not a numpy scalar, which ``batch_size=None`` makes a tensor of per place, each
    with its own memory, as torch's ``default_convert`` does. Returns the fields' values and
    paths, and the field of each leaf (``Plan.positions``)."""
    fields: dict[int, int] = {}  # id -> its new field
    firsts: list[int] = []  # per new field: its first place
    positions = []  # per leaf: its field
    for position, value in enumerate(values):
        key = -1 - position if isinstance(value, np.generic) else id(value)
        field = fields.setdefault(key, len(fields))
        if field == len(firsts):
            firsts.append(position)
        positions.append(field)
    return [values[i] for i in firsts], [paths[i] for i in firsts], tuple(positions)


def prepare_rows(sample: Any, rows: int, index: Any) -> tuple[Prepared, Any]:
    """The batch protocol (``read_into``): the plan for ``rows`` samples shaped like
    ``sample``, and the ``out`` structure over a storage (via ``rows_view``)."""
    builder = SpecBuilder()
    builder.build(sample, "sample")
    if builder.object_paths:
        raise LayoutError(
            f"sample {index!r}: the dataset defines read_into, but leaves "
            f"{builder.object_paths} are not numeric, so read_into cannot write them into "
            "shared memory; return only numbers and arrays, or remove read_into")
    prepared = prepare_samples([sample], [index])
    fields, offset = [], 0
    for f in prepared.plan.fields:
        placed = FieldPlacement(f.dtype, (rows, *f.shape[1:]), offset, f.kind, f.torch_dtype)
        fields.append(placed)
        offset = align(offset + placed.nbytes)
    plan = Plan(prepared.plan.spec, tuple(fields), offset, 0, max(FIELD_ALIGNMENT, offset),
                prepared.plan.torch)
    return Prepared(plan, [None] * len(fields), None), plan


def rows_view(plan: Plan, storage: np.ndarray) -> Any:
    """The fields of ``plan`` as writable views of ``storage``, in the sample's structure:
    the ``out`` a batch-protocol dataset's ``read_into`` writes (docs/batch_protocol.md)."""
    return plan.assemble(storage, [])
