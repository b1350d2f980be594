"""Batch layout: which bytes of a slot hold which field of a batch.

A layout is inferred once, from the first sample (default collate) or the first collated
batch (custom ``collate_fn``, or ``batch_size=None``). Nested dicts / tuples / lists /
namedtuples are walked; every numeric leaf (numpy array, numpy scalar, Python number,
CPU torch tensor) becomes a *field* with a dtype, a shape and a 64-byte aligned offset inside
the slot. Every other leaf (str, bytes, None, arbitrary objects) is an *object leaf*: its
values are collected into a list and travel in the small result message.

Workers write straight into the field arrays of a slot; the consumer gets views of the same
bytes, rebuilt into the sample's nested structure (docs/design.md, "Batch layout").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import LayoutError

FIELD_ALIGNMENT = 64

# Python scalar types and the dtype torch's default_collate gives a batch of them.
_PYTHON_NUMBER_DTYPES = {bool: np.dtype(np.bool_), int: np.dtype(np.int64),
                         float: np.dtype(np.float64), complex: np.dtype(np.complex128)}
# Which Python/numpy scalar kinds a field first seen as a Python number accepts later.
_ACCEPTED_KINDS = {bool: "b", int: "bui", float: "buif", complex: "buifc"}
_INT64_MIN, _INT64_MAX = int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max)


@dataclass(frozen=True)
class Field:
    """One numeric leaf: ``shape`` is per row when ``batched``, else the whole array's."""

    path: str
    dtype: np.dtype
    shape: tuple[int, ...]
    batched: bool
    capacity: int  # rows for a batched field, 1 otherwise
    offset: int
    python_type: type | None  # set when the first value was a Python number

    @property
    def nbytes(self) -> int:
        return self.capacity * math.prod(self.shape) * self.dtype.itemsize


# Structure nodes. A spec is a tree of these; leaves point into the field / object lists.
@dataclass(frozen=True)
class _FieldLeaf:
    index: int


@dataclass(frozen=True)
class _ObjectLeaf:
    index: int


@dataclass(frozen=True)
class _MappingNode:
    type: type
    keys: tuple
    children: tuple
    path: str


@dataclass(frozen=True)
class _SequenceNode:
    type: type
    children: tuple
    path: str


def _describe(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.dtype}{list(value.shape)}"
    if isinstance(value, np.generic):
        return f"{value.dtype} scalar"
    return type(value).__name__


def _as_numeric(value: Any) -> np.ndarray | np.generic | None:
    """The numpy form of a numeric leaf, or None for an object leaf."""
    if isinstance(value, (np.ndarray, np.generic)):
        return value
    if type(value) in _PYTHON_NUMBER_DTYPES:
        return value
    if type(value).__module__ == "torch" and type(value).__name__ == "Tensor":
        return value.detach().cpu().numpy()
    return None


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


class _SpecBuilder:
    """Walks the first sample (or batch) once and records fields, object leaves, structure."""

    def __init__(self, batched_capacity: int | None, rows_seen: int | None, label: str):
        # batched_capacity: rows per slot for batched fields (None: every field is fixed).
        # rows_seen: samples in the batch being walked when it is a collated batch.
        self.batched_capacity = batched_capacity
        self.rows_seen = rows_seen
        self.label = label
        self.fields: list[dict] = []
        self.object_paths: list[str] = []

    def build(self, value: Any, path: str) -> Any:
        if isinstance(value, Mapping):
            keys = tuple(value.keys())
            children = tuple(self.build(value[k], f"{path}[{k!r}]") for k in keys)
            return _MappingNode(type(value), keys, children, path)
        if isinstance(value, (tuple, list)):
            if _is_namedtuple(value):
                names = type(value)._fields
                children = tuple(self.build(v, f"{path}.{n}") for n, v in zip(names, value))
            else:
                children = tuple(self.build(v, f"{path}[{i}]") for i, v in enumerate(value))
            return _SequenceNode(type(value), children, path)
        numeric = _as_numeric(value)
        if numeric is None:
            self.object_paths.append(path)
            return _ObjectLeaf(len(self.object_paths) - 1)
        return _FieldLeaf(self._add_field(numeric, path))

    def _add_field(self, value: Any, path: str) -> int:
        python_type = type(value) if type(value) in _PYTHON_NUMBER_DTYPES else None
        if python_type is not None:
            dtype, shape = _PYTHON_NUMBER_DTYPES[python_type], ()
        else:
            dtype, shape = value.dtype, tuple(value.shape)
        if dtype.hasobject:
            raise LayoutError(
                f"{self.label} field {path} is an object-dtype array ({dtype}), which cannot be "
                "stored in shared memory; convert it to a numeric or fixed-width string dtype"
            )
        if self.batched_capacity is None:
            batched, capacity = False, 1
        elif self.rows_seen is None:  # a sample: one row of a batched field
            batched, capacity = True, self.batched_capacity
        elif len(shape) >= 1:  # a collated batch: leading axis is the batch axis
            batched = True
            capacity = max(1, -(-shape[0] * self.batched_capacity // max(self.rows_seen, 1)))
            shape = shape[1:]
        else:
            batched, capacity = False, 1
        self.fields.append(dict(path=path, dtype=dtype, shape=shape, batched=batched,
                                capacity=capacity, python_type=python_type))
        return len(self.fields) - 1


class BatchLayout:
    """Fields, object leaves and nested structure of one batch, plus its slot size."""

    def __init__(self, spec: Any, fields: tuple[Field, ...], object_paths: tuple[str, ...],
                 rows_capacity: int | None):
        self.spec = spec
        self.fields = fields
        self.object_paths = object_paths
        self.rows_capacity = rows_capacity  # samples a slot holds (None: one unbatched sample)
        # Samples that are one plain array: rows can be stacked in one numpy call.
        self._array_samples = (type(spec) is _FieldLeaf and len(fields) == 1
                               and fields[0].batched and not object_paths)
        end = max((f.offset + f.nbytes for f in fields), default=0)
        self.slot_nbytes = max(FIELD_ALIGNMENT, _align(end))

    @classmethod
    def from_sample(cls, sample: Any, batch_size: int, sample_index: Any) -> BatchLayout:
        """Layout for default collation of ``batch_size`` samples shaped like ``sample``."""
        _reject_none(sample, f"dataset[{sample_index!r}]")
        builder = _SpecBuilder(batch_size, None, f"sample {sample_index!r}:")
        spec = builder.build(sample, "sample")
        return cls._finish(spec, builder, rows_capacity=batch_size)

    @classmethod
    def from_batch(cls, batch: Any, batch_size: int | None, rows: int | None,
                   label: str) -> BatchLayout:
        """Layout for a collated batch of ``rows`` samples (``batch_size=None``: unbatched)."""
        _reject_none(batch, label)
        builder = _SpecBuilder(batch_size, rows, f"{label}:")
        spec = builder.build(batch, "batch")
        return cls._finish(spec, builder, rows_capacity=batch_size)

    @classmethod
    def _finish(cls, spec: Any, builder: _SpecBuilder, rows_capacity: int | None
                ) -> BatchLayout:
        fields, offset = [], 0
        for raw in builder.fields:
            field = Field(offset=offset, **raw)
            fields.append(field)
            offset = _align(offset + field.nbytes)
        return cls(spec, tuple(fields), tuple(builder.object_paths), rows_capacity)

    # -- the write side (workers, and the main process when num_workers=0) ------------------

    def slot_arrays(self, slab: np.ndarray, slot: int) -> list[np.ndarray]:
        """Full-capacity arrays, one per field, over the bytes of ``slot`` in ``slab``."""
        base = slot * self.slot_nbytes
        arrays = []
        for f in self.fields:
            raw = slab[base + f.offset: base + f.offset + f.nbytes]
            shape = (f.capacity, *f.shape) if f.batched else f.shape
            arrays.append(raw.view(f.dtype).reshape(shape))
        return arrays

    def check_fits(self, indices: Sequence[Any]) -> None:
        """A LayoutError unless a batch of ``indices`` fits the slot's rows."""
        if len(indices) > self.rows_capacity:
            raise LayoutError(
                f"a batch of {len(indices)} indices {list(indices)!r} does not fit a slot of "
                f"{self.rows_capacity} rows (sized from the first batch); give the batch_sampler "
                "a batch_size attribute with its largest batch size"
            )

    def rows_view(self, arrays: list[np.ndarray], rows: int) -> Any:
        """The first ``rows`` rows of a slot's field arrays, in the structure of a sample:
        the ``out`` a batch-protocol dataset's ``read_into`` writes (docs/batch_protocol.md)."""
        views = [array[:rows] if field.batched else array
                 for field, array in zip(self.fields, arrays)]
        return _rebuild(self.spec, views, [])

    def write_samples(self, arrays: list[np.ndarray], samples: Sequence[Any],
                      indices: Sequence[Any]) -> list[list]:
        """Copy each sample into its row of the slot; returns the object-leaf lists."""
        self.check_fits(indices)
        if self._array_samples and _stack_into(arrays[0], samples, self.fields[0]):
            return []
        objects: list[list] = [[] for _ in self.object_paths]
        leaves: list[Any] = []
        for row, (sample, index) in enumerate(zip(samples, indices)):
            if sample is None:
                _reject_none(sample, f"dataset[{index!r}]")
            leaves.clear()
            self._flatten(self.spec, sample, leaves, objects, index)
            for field, array, value in zip(self.fields, arrays, leaves):
                if (type(value) is np.ndarray and value.dtype == field.dtype
                        and value.shape == field.shape):
                    array[row] = value  # the hot path: one memcpy into the slab
                elif type(value) is field.python_type is not int:
                    array[row] = value  # a float, bool or complex like the first sample's
                else:
                    array[row] = self._checked(field, value, f"sample {index!r}")
        return objects

    def write_batch(self, arrays: list[np.ndarray], batch: Any,
                    describe: Callable[[], str]) -> tuple[tuple[int, ...], list[list]]:
        """Copy a collated batch into the slot; returns per-field lengths and object leaves.

        ``describe()`` names the batch in error messages (only called to raise one).
        """
        if batch is None:
            _reject_none(batch, describe())
        objects: list[list] = [[] for _ in self.object_paths]
        leaves: list[Any] = []
        self._flatten(self.spec, batch, leaves, objects, describe, collated=True)
        lengths = []
        for field, array, value in zip(self.fields, arrays, leaves):
            numeric = _as_numeric(value)
            if not field.batched:
                array[...] = self._checked(field, value, describe(), first="batch")
                lengths.append(1)
                continue
            if not isinstance(numeric, np.ndarray) or numeric.ndim != len(field.shape) + 1:
                raise LayoutError(
                    f"{describe()}: field {field.path} must be an array of shape [rows, "
                    f"{', '.join(map(str, field.shape))}] like the first batch, got "
                    f"{_describe(numeric if numeric is not None else value)}; {_COLLATE_FIX}"
                )
            rows = numeric.shape[0]
            if rows > field.capacity or numeric.shape[1:] != field.shape:
                raise LayoutError(
                    f"{describe()}: field {field.path} has shape {list(numeric.shape)}, but the "
                    f"slot holds at most [{field.capacity}, {', '.join(map(str, field.shape))}] "
                    "(inferred from the first batch); pad collate_fn outputs to a fixed size"
                )
            if numeric.dtype != field.dtype:
                raise LayoutError(f"{describe()}: field {field.path} has dtype {numeric.dtype}, "
                                  f"expected {field.dtype} as in the first batch; {_COLLATE_FIX}")
            array[:rows] = numeric
            lengths.append(rows)
        return tuple(lengths), [values[0] for values in objects]

    def _flatten(self, node: Any, value: Any, leaves: list, objects: list, where: Any,
                 collated: bool = False) -> None:
        if type(node) is _FieldLeaf:
            leaves.append(value)
        elif type(node) is _MappingNode:
            if not isinstance(value, Mapping) or len(value) != len(node.keys):
                self._structure_error(node, value, where, collated)
            try:
                for key, child in zip(node.keys, node.children):
                    self._flatten(child, value[key], leaves, objects, where, collated)
            except KeyError:
                self._structure_error(node, value, where, collated)
        elif type(node) is _SequenceNode:
            if not isinstance(value, (tuple, list)) or len(value) != len(node.children):
                self._structure_error(node, value, where, collated)
            for child, item in zip(node.children, value):
                self._flatten(child, item, leaves, objects, where, collated)
        else:  # _ObjectLeaf
            objects[node.index].append(value)

    def _structure_error(self, node: Any, value: Any, where: Any, collated: bool) -> None:
        if isinstance(node, _MappingNode):
            expected = f"a mapping with keys {list(node.keys)}"
            actual = (f"keys {list(value.keys())}" if isinstance(value, Mapping)
                      else _describe(value))
        else:
            expected = f"a {node.type.__name__} of {len(node.children)} items"
            actual = (f"a {type(value).__name__} of {len(value)} items"
                      if isinstance(value, (tuple, list)) else _describe(value))
        subject = where() if collated else f"sample {where!r}"
        fix = _COLLATE_FIX if collated else ("return the same structure (keys, lengths) for "
                                             "every sample, or pass a collate_fn")
        raise LayoutError(f"{subject}: {node.path} must be {expected} like the first "
                          f"{'batch' if collated else 'sample'}, got {actual}; {fix}")

    def _checked(self, field: Field, value: Any, subject: str, first: str = "sample") -> Any:
        """``value`` as something numpy can assign to ``field`` exactly, or a LayoutError."""
        numeric = _as_numeric(value)
        if field.python_type is not None:
            kind = numeric.dtype.kind if isinstance(numeric, (np.ndarray, np.generic)) else (
                _PYTHON_NUMBER_DTYPES[type(numeric)].kind if numeric is not None else None)
            shape = getattr(numeric, "shape", ())
            if kind is not None and kind in _ACCEPTED_KINDS[field.python_type] and shape == ():
                if field.dtype.kind == "i" and not _INT64_MIN <= int(numeric) <= _INT64_MAX:
                    raise LayoutError(f"{subject}: field {field.path} is {int(numeric)}, outside "
                                      f"the int64 range it is stored in; store it as a float "
                                      "or a string instead")
                return numeric
            expected = f"a Python {field.python_type.__name__} (stored as {field.dtype})"
        else:
            if (isinstance(numeric, (np.ndarray, np.generic)) and numeric.dtype == field.dtype
                    and numeric.shape == field.shape):
                return numeric
            expected = f"{field.dtype}{list(field.shape)}"
        actual = _describe(numeric if numeric is not None else value)
        raise LayoutError(f"{subject}: field {field.path} must be {expected} like the first "
                          f"{first}, got {actual}; make every sample the same shape and dtype "
                          "(or pad it), or pass a collate_fn")

    # -- the read side (consumer) ----------------------------------------------------------

    def assemble(self, slot_bytes: np.ndarray, rows: int, lengths: tuple[int, ...] | None,
                 objects: list[list] | None, convert: Callable[[Any], Any] | None = None,
                 host_bytes: np.ndarray | None = None) -> Any:
        """The batch as views of ``slot_bytes``, in the structure of the first sample.

        ``slot_bytes`` may be a device array with numpy's slicing (the device copy stage),
        which passes the host slot as ``host_bytes`` to read Python numbers from; ``convert``,
        if given, is applied to each field's view (e.g. to a torch tensor)."""
        views = []
        for i, f in enumerate(self.fields):
            if f.batched:
                n = rows if lengths is None else lengths[i]
                shape = (n, *f.shape)
            else:
                shape = f.shape
            size = math.prod(shape) * f.dtype.itemsize
            if f.python_type is not None and not f.batched:
                # An unbatched Python number comes back as one, as torch's default_convert
                # leaves it.
                source = slot_bytes if host_bytes is None else host_bytes
                views.append(source[f.offset: f.offset + size].view(f.dtype).item())
                continue
            view = slot_bytes[f.offset: f.offset + size].view(f.dtype).reshape(shape)
            views.append(view if convert is None else convert(view))
        return _rebuild(self.spec, views, objects or [])


def _rebuild(node: Any, views: list, objects: list) -> Any:
    if type(node) is _FieldLeaf:
        return views[node.index]
    if type(node) is _ObjectLeaf:
        return objects[node.index]
    if type(node) is _MappingNode:
        items = {k: _rebuild(c, views, objects) for k, c in zip(node.keys, node.children)}
        if node.type is dict:
            return items
        try:
            return node.type(items)
        except TypeError:  # a Mapping type that cannot be built from a dict
            return items
    children = [_rebuild(c, views, objects) for c in node.children]
    if node.type is list:
        return children
    if node.type is tuple:
        return tuple(children)
    if hasattr(node.type, "_fields"):
        return node.type(*children)
    try:
        return node.type(children)
    except TypeError:
        return children


_COLLATE_FIX = ("make collate_fn return the same structure, dtypes and trailing shapes for "
                "every batch (pad variable sizes)")


def _stack_into(array: np.ndarray, samples: Sequence[Any], field: Field) -> bool:
    """Copy ``samples`` into the first rows of ``array`` with one ``np.stack`` when every one
    is an ndarray of the field's dtype and shape (what the per-row hot path would copy);
    False, having written nothing, otherwise. For small rows the per-row Python loop costs
    several times the copy itself (float32[16] x 256: ~0.77 ms against ~0.16 ms)."""
    if not samples:
        return False
    for sample in samples:
        if type(sample) is not np.ndarray or sample.dtype != field.dtype \
                or sample.shape != field.shape:
            return False
    np.stack(samples, out=array[: len(samples)])
    return True


def _reject_none(value: Any, subject: str) -> None:
    if value is None:
        raise LayoutError(f"{subject} returned None; every sample must be an array, a number or "
                          "a nested dict/tuple/list of them (filter missing samples in the "
                          "dataset or the sampler)")


def _align(offset: int) -> int:
    return -(-offset // FIELD_ALIGNMENT) * FIELD_ALIGNMENT
