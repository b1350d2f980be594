"""Preparing a batch (in workers, and in the main process when ``num_workers=0``): the rows
of each field checked and typed as torch's ``default_collate`` would stack them, offsets
assigned, object leaves pickled."""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import LayoutError
from .columns import column, reject_none
from .flat import flat_leaves, take_flat
from .learned import FlatLayout
from .plan import (
    FIELD_ALIGNMENT,
    KIND_NUMBER,
    KIND_NUMPY_SCALAR,
    KIND_TORCH,
    KIND_TORCH_RAW,
    EqualRows,
    FieldPlacement,
    Plan,
    Prepared,
    align,
)
from .spec import (
    PYTHON_NUMBER_DTYPES,
    FieldLeaf,
    ObjectLeaf,
    SpecBuilder,
    collate_extensions,
    collate_objects,
    flatten,
    is_field,
    is_tensor,
    registered_collate,
    tensor_array,
)


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
        rows, placement = column(samples, "sample", indices)
        if type(rows) is EqualRows:
            return Prepared(_equal_rows_plan(placement), [rows], None)
        return _finish(_SAMPLE_LEAF, [rows], [placement], None, collated=True)
    if first is None:
        reject_none(first, f"dataset[{indices[0]!r}]", collated=True)
    if not extensions:
        prepared = _prepare_flat(samples, indices)
        if prepared is not None:
            return prepared
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
    columns, placements = _columns(raw_columns, builder.field_paths, indices)
    return _finish(spec, columns, placements, objects, collated=True,
                   object_paths=builder.object_paths, live=live)


def _columns(raw_columns: list, paths: list[str], indices: Sequence[Any]) -> tuple[list, list]:
    columns, placements = [], []
    for values, path in zip(raw_columns, paths):
        rows, placement = column(values, path, indices)
        columns.append(rows)
        placements.append(placement)
    return columns, placements


# The layout learned from the last batch of flat samples of fields only (learned.py);
# replaced whole in one assignment (thread workers share it).
_last_flat: FlatLayout | None = None


def _prepare_flat(samples: Sequence[Any], indices: Sequence[Any]) -> Prepared | None:
    """A batch of flat samples of fields only, by the layout an earlier batch learned: typed
    by its column recipes where each column is what it was, else walked by ``take_flat`` and
    ``column`` (its plan again where the fields' dtypes and shapes are the same); None for any
    other batch, or samples that differ in structure (the general path then names the one at
    fault). Default collation with no collate function registered."""
    global _last_flat
    found = flat_leaves(samples[0])
    if found is None:
        return None
    kind, keys, leaves = found
    layout = _last_flat
    if layout is not None and layout.fits(kind, keys):
        columns = layout.take(samples, indices)
        if columns is not None:
            return Prepared(layout.plan, columns, None)
    if not all(map(is_field, leaves)):
        return None
    if layout is None or not layout.fits(kind, keys):
        builder = SpecBuilder(extensions={})
        spec = builder.build(samples[0], "sample")  # (fields only: no object leaf)
        layout = FlatLayout(kind, keys, spec, builder.field_paths)
    raw_columns = [[leaf] for leaf in leaves]
    if not take_flat(layout.spec, samples[1:], raw_columns, []):
        return None
    columns, placements = _columns(raw_columns, layout.paths, indices)
    plan = layout.plan_for(placements)
    if plan is None:
        plan = _finish(layout.spec, columns, placements, None, collated=True).plan
    if plan is not layout.plan or layout.recipes is None:
        _last_flat = layout.learned(plan, columns)
    return Prepared(plan, columns, None)


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
