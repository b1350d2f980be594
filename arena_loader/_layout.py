"""Batch layout: which bytes of a batch's storage hold which array, decided per batch.

Every batch is laid out on its own: the worker walks it (the samples under default
collation, or the batch a ``collate_fn`` returned), and every numeric leaf (numpy array or
numeric scalar, Python number, dense CPU torch tensor) becomes a *field* with its own dtype,
shape and 64-byte aligned offset. Shapes and dtypes may change from batch to batch and, in a
collated batch, from leaf to leaf (a list of variable-length arrays stays a list of arrays).
Every other leaf (str and ``np.str_``, bytes, tensors the slab cannot hold: nested, sparse,
quantized) is an *object leaf*: the values are pickled into the same storage, after the fields.
Default collation accepts as object leaves only what torch's ``default_collate`` accepts, and
raises torch's error type for the rest (``collate_objects``).

``prepare_samples`` / ``prepare_batch`` give a ``Prepared`` batch: its ``Plan`` (the small
description the consumer needs: structure, fields, where the objects are) and how many bytes
it needs. The caller picks storage that large (a slot, or a one-off segment) and calls
``write``. The plan travels as a fixed-size record plus one small record per field
(``encode_plan`` / ``PlanDecoder``); the structure is sent once per worker and cached.
The consumer's ``Plan.assemble`` builds views of the storage (docs/design.md, "Batch layout").
"""

from __future__ import annotations

import math
import numbers
import operator
import pickle
import struct
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import LayoutError, SampleTypeError

FIELD_ALIGNMENT = 64

# Python scalar types and the dtype torch's default_collate gives a batch of them.
_PYTHON_NUMBER_DTYPES = {bool: np.dtype(np.bool_), int: np.dtype(np.int64),
                         float: np.dtype(np.float64), complex: np.dtype(np.complex128)}
_CATEGORY = {"b": 0, "u": 1, "i": 1, "f": 2, "c": 3}

# Field kinds: how the consumer hands the leaf out.
KIND_NUMPY = 0  # a numpy array (or a numpy/Python scalar stacked into one)
KIND_TORCH = 1  # a torch tensor in the worker: a tensor again where torch output is asked for
KIND_NUMBER = 2  # an unbatched Python number (collate_fn output): handed out as a number
KIND_TORCH_RAW = 3  # a torch dtype numpy lacks (bfloat16, float8): bits stored, torch dtype kept

# torch dtypes numpy has no type for, stored bit for bit as an integer type of the same size.
_TORCH_RAW_DTYPES = {"bfloat16": np.dtype(np.int16), "float8_e4m3fn": np.dtype(np.uint8),
                     "float8_e5m2": np.dtype(np.uint8), "float8_e4m3fnuz": np.dtype(np.uint8),
                     "float8_e5m2fnuz": np.dtype(np.uint8), "complex32": np.dtype(np.int32)}


class FieldPlacement:
    """One numeric leaf of one batch: its bytes are ``storage[offset: offset + nbytes]``.
    (A plain slotted class: a batch has up to hundreds of these, made per batch on both
    sides, and a frozen dataclass costs several times more to build.)"""

    __slots__ = ("dtype", "kind", "nbytes", "offset", "shape", "torch_dtype")

    def __init__(self, dtype: np.dtype, shape: tuple[int, ...], offset: int,
                 kind: int = KIND_NUMPY, torch_dtype: str = ""):
        self.dtype = dtype
        self.shape = shape
        self.offset = offset
        self.kind = kind
        self.torch_dtype = torch_dtype  # KIND_TORCH_RAW only: the torch dtype's name
        self.nbytes = math.prod(shape) * dtype.itemsize

    def at(self, offset: int) -> FieldPlacement:
        return FieldPlacement(self.dtype, self.shape, offset, self.kind, self.torch_dtype)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FieldPlacement) and (
            self.dtype, self.shape, self.offset, self.kind, self.torch_dtype) == (
            other.dtype, other.shape, other.offset, other.kind, other.torch_dtype)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"FieldPlacement({self.dtype}, {self.shape}, offset={self.offset}, "
                f"kind={self.kind}{', ' + self.torch_dtype if self.torch_dtype else ''})")


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


class Plan:
    """Where one batch's fields and object leaves are in its storage, and its structure."""

    __slots__ = ("collated", "fields", "nbytes", "objects_len", "objects_offset", "raw",
                 "spec", "torch")

    def __init__(self, spec: Any, fields: tuple[FieldPlacement, ...], objects_offset: int,
                 objects_len: int, nbytes: int, torch: bool, collated: bool = True):
        self.spec = spec
        self.fields = fields
        self.objects_offset = objects_offset
        self.objects_len = objects_len  # bytes of the pickled object-leaf lists (0: none)
        self.nbytes = nbytes  # bytes of storage the batch uses
        self.torch = torch  # some leaf was a torch tensor: output=None hands out tensors
        # Stacked by default collation (tuples become lists in torch output, as torch's
        # default_collate makes them), not a collate_fn's batch (kept as it is).
        self.collated = collated
        # A torch dtype numpy lacks is among the fields: views need converting.
        self.raw = any(f.kind == KIND_TORCH_RAW for f in fields)

    def objects(self, storage: np.ndarray) -> list:
        """The object-leaf values, unpickled from ``storage`` (host memory)."""
        if not self.objects_len:
            return []
        start = self.objects_offset
        return pickle.loads(storage[start: start + self.objects_len])

    def assemble(self, storage: Any, objects: list,
                 convert: Callable[[Any, FieldPlacement], Any] | None = None,
                 host_bytes: np.ndarray | None = None) -> Any:
        """The batch as views of ``storage``, in the batch's structure.

        ``storage`` may be a device array with numpy's slicing (the device copy stage), which
        passes the host storage as ``host_bytes`` to read Python numbers from; ``convert``, if
        given, turns each field's view into what the consumer gets (a tensor, say)."""
        views = []
        host = type(storage) is np.ndarray
        for f in self.fields:
            if f.kind == KIND_NUMBER:
                source = storage if host_bytes is None else host_bytes
                views.append(source[f.offset: f.offset + f.nbytes].view(f.dtype).item())
                continue
            if host:  # one constructor call: its base is `storage`, which keeps the lease
                view = np.ndarray(f.shape, f.dtype, storage, f.offset)
            else:  # a device array: numpy-style slicing only
                view = storage[f.offset: f.offset + f.nbytes].view(f.dtype).reshape(f.shape)
            views.append(view if convert is None else convert(view, f))
        return _rebuild(self.spec, views, objects)


class Prepared:
    """A batch ready to be written: its plan and the values to write."""

    __slots__ = ("_columns", "_objects", "plan")

    def __init__(self, plan: Plan, columns: list, objects: bytes | None):
        self.plan = plan
        self._columns = columns  # per field: a list of row values, or one value (collated)
        self._objects = objects

    @property
    def nbytes(self) -> int:
        return self.plan.nbytes

    def write(self, storage: np.ndarray) -> None:
        """Write every field (one C call each where the data allows) and the objects."""
        for field, column in zip(self.plan.fields, self._columns):
            flat = storage[field.offset: field.offset + field.nbytes].view(field.dtype)
            if type(column) is _EqualRows:
                _write_equal_rows(flat, column, field)
            elif type(column) is list:
                _write_rows(flat, column, field)
            elif type(column) is np.ndarray and column.dtype == field.dtype:
                np.concatenate((column,), axis=None, out=flat, casting="no")
            else:
                flat[...] = np.asarray(column, dtype=field.dtype).reshape(-1)
        if self._objects is not None:
            start = self.plan.objects_offset
            storage[start: start + len(self._objects)] = np.frombuffer(self._objects, np.uint8)


class _EqualRows(list):
    """Rows of one dtype and one length, whose other dimensions the write checks (in
    C, as it copies): the per-row shape walk is done only if that check fails."""

    __slots__ = ("indices", "path")


def _write_equal_rows(flat: np.ndarray, rows: _EqualRows, field: FieldPlacement) -> None:
    shape = field.shape
    try:  # axis 0 into an out of the batch's shape: numpy checks every row's other dims
        np.concatenate(rows, axis=0, out=flat.reshape(shape[0] * shape[1], *shape[2:]),
                       casting="no")
    except (ValueError, TypeError):
        _column(list(rows), rows.path, rows.indices, fast=False)  # raises the named error
        raise


def _write_rows(flat: np.ndarray, rows: list, field: FieldPlacement) -> None:
    try:  # the hot path: every row already has the field's dtype; one memcpy per row, in C
        np.concatenate(rows, axis=None, out=flat, casting="no")
    except TypeError:  # a row of another dtype (promoted) or Python numbers
        if rows and type(rows[0]) is not np.ndarray:
            flat[...] = np.asarray(rows, dtype=field.dtype).reshape(-1)
        else:
            np.concatenate(rows, axis=None, out=flat, casting="unsafe")


# -- preparing a batch (workers, and the main process when num_workers=0) -------------------

def _describe(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.dtype}{list(value.shape)}"
    if isinstance(value, np.generic):
        return f"{value.dtype} scalar"
    if _is_tensor(value):
        return f"tensor {value.dtype}{list(value.shape)}"
    return type(value).__name__


def _is_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "untyped_storage")


def _slab_holds(tensor: Any) -> bool:
    """A tensor whose values are one dense block numpy can view: strided, neither nested nor
    quantized. Any other kind (nested, sparse, quantized, mkldnn) travels pickled, as torch's
    workers send it."""
    return (tensor.layout is sys.modules["torch"].strided and not tensor.is_nested
            and not tensor.is_quantized)


def _is_field(value: Any) -> bool:
    """A leaf stored as an array in the slab: numpy arrays, numeric numpy scalars (a
    ``np.str_`` is a str to torch's ``default_collate``, so an object leaf), Python numbers,
    dense tensors."""
    if isinstance(value, np.ndarray) or type(value) in _PYTHON_NUMBER_DTYPES:
        return True
    if isinstance(value, np.generic):
        return not isinstance(value, np.character)
    return _is_tensor(value) and _slab_holds(value)


def _tensor_array(value: Any) -> tuple[np.ndarray, int, str]:
    """A CPU torch tensor's values as numpy: (array, kind, raw torch dtype name)."""
    tensor = value.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    name = str(tensor.dtype).rpartition(".")[2]
    raw = _TORCH_RAW_DTYPES.get(name)
    if raw is not None:  # numpy has no such dtype: keep the bits
        import torch

        as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[raw.itemsize]
        return tensor.contiguous().view(as_int).numpy(), KIND_TORCH_RAW, name
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    return tensor.numpy(), KIND_TORCH, ""


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


class _SpecBuilder:
    """Walks a sample (or a collated batch) and records its structure, fields and objects."""

    def __init__(self) -> None:
        self.field_paths: list[str] = []
        self.field_values: list[Any] = []
        self.object_paths: list[str] = []
        self.object_values: list[Any] = []
        # Per object leaf: its parent is a tuple or list (torch's default_collate then hands
        # out the leaf's values as the tuple its zip() made, not a list).
        self.object_in_sequence: list[bool] = []

    def build(self, value: Any, path: str, in_sequence: bool = False) -> Any:
        if _is_field(value):
            self.field_paths.append(path)
            self.field_values.append(value)
            return _FieldLeaf(len(self.field_paths) - 1)
        if isinstance(value, Mapping):
            keys = tuple(value.keys())
            children = tuple(self.build(value[k], f"{path}[{k!r}]") for k in keys)
            return _MappingNode(type(value), keys, children, path)
        if isinstance(value, (tuple, list)):
            if _is_namedtuple(value):
                names = type(value)._fields
                children = tuple(self.build(v, f"{path}.{n}", True)
                                 for n, v in zip(names, value))
            else:
                children = tuple(self.build(v, f"{path}[{i}]", True)
                                 for i, v in enumerate(value))
            return _SequenceNode(type(value), children, path)
        if hasattr(value, "__dataclass_fields__") and not isinstance(value, type):
            names = tuple(value.__dataclass_fields__)
            children = tuple(self.build(getattr(value, n), f"{path}.{n}") for n in names)
            return _MappingNode(type(value), names, children, path)
        self.object_paths.append(path)
        self.object_values.append(value)
        self.object_in_sequence.append(in_sequence)
        return _ObjectLeaf(len(self.object_paths) - 1)


def _flatten(node: Any, value: Any, fields: list, objects: list, index: Any) -> None:
    """Append ``value``'s leaves (a sample shaped like the first) to the per-leaf lists."""
    kind = type(node)
    if kind is _FieldLeaf:
        fields[node.index].append(value)
    elif kind is _ObjectLeaf:
        objects[node.index].append(value)
    elif kind is _MappingNode:
        if hasattr(value, "__dataclass_fields__") and not isinstance(value, Mapping):
            try:
                for key, child in zip(node.keys, node.children):
                    _flatten(child, getattr(value, key), fields, objects, index)
            except AttributeError:
                _structure_error(node, value, index)
            return
        if not isinstance(value, Mapping) or len(value) != len(node.keys):
            _structure_error(node, value, index)
        try:
            for key, child in zip(node.keys, node.children):
                _flatten(child, value[key], fields, objects, index)
        except KeyError:
            _structure_error(node, value, index)
    else:
        if not isinstance(value, (tuple, list)) or len(value) != len(node.children):
            _structure_error(node, value, index)
        for child, item in zip(node.children, value):
            _flatten(child, item, fields, objects, index)


def _structure_error(node: Any, value: Any, index: Any) -> None:
    if isinstance(node, _MappingNode):
        expected = f"a mapping with keys {list(node.keys)}"
        actual = f"keys {list(value.keys())}" if isinstance(value, Mapping) else _describe(value)
    else:
        expected = f"a {node.type.__name__} of {len(node.children)} items"
        actual = (f"a {type(value).__name__} of {len(value)} items"
                  if isinstance(value, (tuple, list)) else _describe(value))
    raise LayoutError(f"sample {index!r}: {node.path} must be {expected} like the batch's first "
                      f"sample, got {actual}; return the same structure (keys, lengths) for "
                      "every sample, or pass a collate_fn")


# torch's default_collate text for a leaf it cannot batch (torch/utils/data/_utils/collate.py).
_TORCH_COLLATE_TYPE_ERROR = ("default_collate: batch must contain tensors, numpy arrays, numbers, "
                             "dicts or lists; found {}")
_TORCH_UNSTACKABLE = ("Batches of {} tensors are not currently supported by the default "
                      "collate_fn; please provide a custom collate_fn to handle them "
                      "appropriately.")
_SPARSE_LAYOUTS = ("sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc")


def collate_objects(values: list, path: str, in_sequence: bool, indices: Sequence[Any]) -> Any:
    """One object leaf's values under default collation, as torch's ``default_collate`` gives
    them: str and bytes as they are (a tuple inside a tuple or list sample, the list otherwise),
    a tensor kind the slab cannot hold stacked by torch (nested and sparse raise torch's
    ``RuntimeError``); what torch rejects raises ``SampleTypeError`` (a ``TypeError``). As in
    torch, the first sample's value decides."""
    first = values[0]
    if isinstance(first, (str, bytes)):
        return tuple(values) if in_sequence else values
    where = f"sample {indices[0]!r}"
    if path != "sample":
        where = f"field {path} of {where}"
    if _is_tensor(first):
        torch = sys.modules["torch"]
        kind = ("nested" if first.is_nested else "sparse"
                if str(first.layout).rpartition(".")[2] in _SPARSE_LAYOUTS else None)
        if kind is not None:
            raise RuntimeError(f"{_TORCH_UNSTACKABLE.format(kind)} ({where} is a {kind} "
                               "tensor; a collate_fn that returns them as a list, or "
                               "batch_size=None, hands them out as they are)")
        return torch.stack(values)  # quantized, mkldnn, ...: torch stacks them, pickled here
    if isinstance(first, Sequence):
        return values  # range, deque, ...: kept as a list (torch transposes them)
    what = "None" if first is None else f"a {type(first).__module__}.{type(first).__qualname__}"
    raise SampleTypeError(f"{_TORCH_COLLATE_TYPE_ERROR.format(type(first))} ({where} is {what}, "
                          f"which default collation cannot batch; {_collate_fix(first)})")


def _collate_fix(value: Any) -> str:
    """How to make ``value`` batchable, by what it is."""
    if value is None:
        return ("give the field a value in every sample (a number, an array or a string, "
                "with a mask if it can be missing), leave it out of the sample, or pass a "
                "collate_fn that handles None")
    if type(value).__module__.startswith("PIL."):
        return ("convert the image to an array in the dataset's transform "
                "(torchvision.transforms.ToTensor() or PILToTensor(), or np.asarray(image)), "
                "or pass a collate_fn")
    if isinstance(value, numbers.Number):
        return ("convert it to float or int in the dataset (float(value)), or pass a "
                "collate_fn")
    return ("convert it to an array, a number or a string in the dataset, or pass a "
            "collate_fn that batches it")


def _promote(dtypes: list[np.dtype]) -> np.dtype:
    """torch's type promotion for stacking: the highest category (bool < int < float <
    complex) wins, and within it numpy's promotion (int8 + uint8 -> int16)."""
    top = max(_CATEGORY.get(d.kind, 4) for d in dtypes)
    if top == 4:  # strings, bytes: the widest
        return np.result_type(*dtypes)
    return np.result_type(*(d for d in dtypes if _CATEGORY.get(d.kind, 4) == top))


def _number_dtype(values: list, path: str, indices: Sequence[Any]) -> np.dtype:
    """torch's default_collate for a batch of Python numbers: the first one's type decides,
    and a float among ints gives torch's default float dtype (float32)."""
    first = type(values[0])
    types = set(map(type, values))
    if not types <= set(_PYTHON_NUMBER_DTYPES):
        other = next(v for v in values if type(v) not in _PYTHON_NUMBER_DTYPES)
        row = next(i for i, v in enumerate(values) if v is other)
        raise LayoutError(f"sample {indices[row]!r}: field {path} is {_describe(other)} where "
                          f"sample {indices[0]!r} has a Python {first.__name__}; return the "
                          "same type for every sample, or pass a collate_fn")
    if complex in types:
        return np.dtype(np.complex128) if first is complex else np.dtype(np.complex64)
    if float in types:
        return np.dtype(np.float64) if first is float else np.dtype(np.float32)
    if int in types:
        return np.dtype(np.int64)
    return np.dtype(np.bool_)


_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")


def _column(values: list, path: str, indices: Sequence[Any],
            fast: bool = True) -> tuple[list, FieldPlacement]:
    """The rows of one field as numpy values, and its dtype, shape and kind (offset 0)."""
    first = values[0]
    # The hottest path: arrays of at least one dimension, one dtype and one length;
    # their other dimensions are checked by the write itself (_write_equal_rows).
    if fast and type(first) is np.ndarray and first.ndim and not first.dtype.hasobject:
        try:
            equal = len(set(map(len, values))) == 1 and len(set(map(_DTYPE, values))) == 1
        except (TypeError, AttributeError):  # a row without len() or dtype: the full walk
            equal = False
        if equal:
            rows = _EqualRows(values)
            rows.path, rows.indices = path, indices
            return rows, FieldPlacement(first.dtype, (len(values), *first.shape), 0)
    # The hot path: every row an ndarray of one dtype and shape, checked by C-level maps.
    if type(first) is np.ndarray and set(map(type, values)) == {np.ndarray}:
        shapes, dtypes = set(map(_SHAPE, values)), set(map(_DTYPE, values))
        if len(shapes) == 1 and len(dtypes) == 1:
            _check_dtype(first.dtype, path, indices[0])
            return values, FieldPlacement(first.dtype, (len(values), *first.shape), 0)
    if type(first) in _PYTHON_NUMBER_DTYPES:
        dtype = _number_dtype(values, path, indices)
        if dtype.kind == "i":
            for value, index in zip(values, indices):
                if type(value) is int and not -(2**63) <= value < 2**63:
                    raise LayoutError(f"sample {index!r}: field {path} is {value}, outside the "
                                      "int64 range it is stored in; store it as a float or a "
                                      "string instead")
        return values, FieldPlacement(dtype, (len(values),), 0)
    kind, raw_name, rows = KIND_NUMPY, "", []
    for value, index in zip(values, indices):
        if _is_tensor(value):
            array, kind, raw_name = _tensor_array(value)
        elif isinstance(value, (np.ndarray, np.generic)):
            array = value
        elif type(value) in _PYTHON_NUMBER_DTYPES:
            array = np.asarray(value, dtype=_number_dtype([value], path, [index]))
        elif value is None and type(first) is not type(None) and path == "sample":
            _reject_none(value, f"dataset[{index!r}]", collated=True)
        else:
            raise LayoutError(f"sample {index!r}: field {path} is {_describe(value)} where "
                              f"sample {indices[0]!r} has {_describe(first)}; return the same "
                              "type for every sample, or pass a collate_fn")
        rows.append(array)
    shape = rows[0].shape
    for array, index in zip(rows, indices):
        if array.shape != shape:
            raise LayoutError(
                f"sample {index!r}: field {path} has shape {list(array.shape)} but sample "
                f"{indices[0]!r} has {list(shape)}; default collation stacks samples, so they "
                "must have equal shapes (torch.stack raises here too): pad or crop them, or "
                "pass a collate_fn (e.g. one that pads to the longest with pad_sequence)")
    dtypes = {a.dtype for a in rows}
    dtype = rows[0].dtype if len(dtypes) == 1 else _promote(list(dtypes))
    if dtype.hasobject:  # name the sample that brought the object dtype in
        index = next(i for a, i in zip(rows, indices) if a.dtype.hasobject)
        _check_dtype(dtype, path, index)
    if kind == KIND_TORCH_RAW and len(dtypes) > 1:
        raise LayoutError(f"sample {indices[0]!r}: field {path} mixes {raw_name} with other "
                          "dtypes; convert every sample to one dtype in the dataset")
    _check_dtype(dtype, path, indices[0])
    return rows, FieldPlacement(dtype, (len(rows), *shape), 0, kind, raw_name)


def _check_dtype(dtype: np.dtype, path: str, index: Any) -> None:
    if dtype.hasobject:
        raise LayoutError(
            f"sample {index!r}: field {path} is an object-dtype array ({dtype}), which cannot "
            "be stored in shared memory; convert it to a numeric or fixed-width string dtype, "
            "or return a list")


def _leaf_placement(value: Any, path: str, label: str) -> tuple[Any, FieldPlacement]:
    """One leaf of a collated batch: (the value to write, its placement at offset 0)."""
    if type(value) in _PYTHON_NUMBER_DTYPES:
        dtype = _PYTHON_NUMBER_DTYPES[type(value)]
        if type(value) is int and not -(2**63) <= value < 2**63:
            raise LayoutError(f"{label}: field {path} is {value}, outside the int64 range it is "
                              "stored in; store it as a float or a string instead")
        return value, FieldPlacement(dtype, (), 0, KIND_NUMBER)
    if _is_tensor(value):
        array, kind, raw_name = _tensor_array(value)
        return array, FieldPlacement(array.dtype, array.shape, 0, kind, raw_name)
    if value.dtype.hasobject:
        raise LayoutError(
            f"{label}: field {path} is an object-dtype array ({value.dtype}), which cannot be "
            "stored in shared memory; convert it to a numeric or fixed-width string dtype, or "
            "return a list")
    return value, FieldPlacement(value.dtype, value.shape, 0)


def _finish(spec: Any, columns: list, placements: list[FieldPlacement],
            objects: list | None, collated: bool) -> Prepared:
    offset, torch = 0, False
    for p in placements:  # placements are this batch's own: set their offsets in place
        p.offset = offset
        torch = torch or p.kind in (KIND_TORCH, KIND_TORCH_RAW)
        offset += -(-p.nbytes // FIELD_ALIGNMENT) * FIELD_ALIGNMENT
    fields = placements
    pickled = None
    if objects:
        pickled = pickle.dumps(objects, protocol=pickle.HIGHEST_PROTOCOL)
    objects_offset = offset
    nbytes = max(FIELD_ALIGNMENT, _align(offset + (len(pickled) if pickled else 0)))
    plan = Plan(spec, tuple(fields), objects_offset, len(pickled) if pickled else 0, nbytes,
                torch, collated)
    return Prepared(plan, columns, pickled)


def prepare_samples(samples: Sequence[Any], indices: Sequence[Any]) -> Prepared:
    """Default collation: the samples stacked per leaf as torch's ``default_collate`` would
    (dtype promotion included); str and other objects become lists."""
    first = samples[0]
    if first is None:
        _reject_none(first, f"dataset[{indices[0]!r}]", collated=True)
    builder = _SpecBuilder()
    spec = builder.build(first, "sample")
    if type(spec) is _FieldLeaf:  # samples that are one array or number: no walk
        raw_columns, objects = [list(samples)], []
    else:
        raw_columns = [[v] for v in builder.field_values]
        objects = [[v] for v in builder.object_values]
        for sample, index in zip(samples[1:], indices[1:]):
            if sample is None:
                _reject_none(sample, f"dataset[{index!r}]", collated=True)
            _flatten(spec, sample, raw_columns, objects, index)
        objects = [collate_objects(values, path, in_sequence, indices) for values, path, in_sequence
                   in zip(objects, builder.object_paths, builder.object_in_sequence)]
    columns, placements = [], []
    for values, path in zip(raw_columns, builder.field_paths):
        rows, placement = _column(values, path, indices)
        columns.append(rows)
        placements.append(placement)
    return _finish(spec, columns, placements, objects, collated=True)


def prepare_batch(batch: Any, label: str) -> Prepared:
    """A batch a ``collate_fn`` made (or one sample, with ``batch_size=None``): every leaf
    keeps its own shape and dtype."""
    if batch is None:
        _reject_none(batch, label)
    builder = _SpecBuilder()
    spec = builder.build(batch, "batch")
    columns, placements = [], []
    for value, path in zip(builder.field_values, builder.field_paths):
        column, placement = _leaf_placement(value, path, label)
        columns.append(column)
        placements.append(placement)
    return _finish(spec, columns, placements, builder.object_values, collated=False)


def prepare_rows(sample: Any, rows: int, index: Any) -> tuple[Prepared, Any]:
    """The batch protocol (``read_into``): the plan for ``rows`` samples shaped like
    ``sample``, and the ``out`` structure over a storage (via ``rows_view``)."""
    builder = _SpecBuilder()
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
        offset = _align(offset + placed.nbytes)
    plan = Plan(prepared.plan.spec, tuple(fields), offset, 0, max(FIELD_ALIGNMENT, offset),
                prepared.plan.torch)
    return Prepared(plan, [None] * len(fields), None), plan


def rows_view(plan: Plan, storage: np.ndarray) -> Any:
    """The fields of ``plan`` as writable views of ``storage``, in the sample's structure:
    the ``out`` a batch-protocol dataset's ``read_into`` writes (docs/batch_protocol.md)."""
    return plan.assemble(storage, [])


# -- the plan on the wire ----------------------------------------------------------------

# idx, slot, worker, status, flags, number of fields, structure id, structure bytes,
# storage bytes, objects offset, objects bytes
HEADER = struct.Struct("<qiiBBxxIIIqqq")
_FIELD = struct.Struct("<qBBH")  # offset, kind, ndim, dtype descriptor bytes
RECORD_MAGIC = b"R"
FLAG_TORCH = 1
FLAG_SEGMENT = 2  # the storage is a one-off segment whose descriptor follows on the side
FLAG_COLLATED = 4


class PlanEncoder:
    """A worker's side: plans as records; each structure is sent once and then named by id."""

    def __init__(self) -> None:
        self._structure_ids: dict[Any, int] = {}
        self._dtype_bytes: dict[tuple[np.dtype, str], bytes] = {}

    def encode(self, plan: Plan, idx: int, slot: int, worker_id: int, segment: bool) -> bytes:
        try:
            sid = self._structure_ids.get(plan.spec)
            structure = b""
            if sid is None:
                sid = len(self._structure_ids)
                structure = _pickle_structure(plan.spec)
                self._structure_ids[plan.spec] = sid
        except TypeError:  # a structure that does not hash (unhashable keys): send it each time
            sid, structure = 0xFFFFFFFF, _pickle_structure(plan.spec)
        flags = (FLAG_TORCH if plan.torch else 0) | (FLAG_SEGMENT if segment else 0) | (
            FLAG_COLLATED if plan.collated else 0)
        parts = [RECORD_MAGIC, HEADER.pack(idx, slot, worker_id, 0, flags, len(plan.fields), sid,
                                           len(structure), plan.nbytes, plan.objects_offset,
                                           plan.objects_len), structure]
        dtype_bytes, append = self._dtype_bytes, parts.append
        for f in plan.fields:
            key = (f.dtype, f.torch_dtype)
            descr = dtype_bytes.get(key)
            if descr is None:
                descr = dtype_bytes[key] = _dtype_descr(f.dtype) + f.torch_dtype.encode()
            shape = f.shape
            append(_FIELD.pack(f.offset, f.kind, len(shape), len(descr)))
            append(descr)
            append(_shape_struct(len(shape)).pack(*shape))
        return b"".join(parts)


def _pickle_structure(spec: Any) -> bytes:
    try:
        return pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise LayoutError(
            f"the batch's structure cannot be pickled to the main process ({exc}): a dict, "
            "namedtuple or dataclass type in it cannot be pickled; define that type at module "
            "level (not inside a function)") from exc


@dataclass(frozen=True)
class Record:
    """A decoded worker record: batch ``idx`` is in ``slot`` (or a segment) with ``plan``;
    ``ended``: the worker's iterator ended instead (no batch)."""

    idx: int
    slot: int
    worker_id: int
    ended: bool
    segment: bool
    plan: Plan | None


class PlanDecoder:
    """The main process's side, one per worker (structure ids are per worker)."""

    def __init__(self) -> None:
        self._structures: dict[int, Any] = {}
        self._dtypes: dict[bytes, tuple[np.dtype, str]] = {}  # descriptor -> (dtype, torch)

    def decode(self, payload: bytes) -> Record:
        if payload[:1] != RECORD_MAGIC or len(payload) < 1 + HEADER.size:
            raise ValueError(f"not a batch record ({len(payload)} bytes starting "
                             f"{payload[:8]!r})")
        (idx, slot, worker_id, status, flags, nfields, sid, structure_len, nbytes,
         objects_offset, objects_len) = HEADER.unpack_from(payload, 1)
        if status == 1:
            return Record(idx, slot, worker_id, True, False, None)
        pos = 1 + HEADER.size
        if structure_len:
            spec = pickle.loads(payload[pos: pos + structure_len])
            pos += structure_len
            if sid != 0xFFFFFFFF:
                self._structures[sid] = spec
        else:
            spec = self._structures[sid]
        fields = []
        dtypes, field_size, unpack_field = self._dtypes, _FIELD.size, _FIELD.unpack_from
        for _ in range(nfields):
            offset, kind, ndim, descr_len = unpack_field(payload, pos)
            pos += field_size
            descr = payload[pos: pos + descr_len]
            pos += descr_len
            known = dtypes.get(descr)
            if known is None:
                dtype_bytes, _, raw = bytes(descr).partition(b"\0")
                known = dtypes[descr] = (_dtype_from_descr(dtype_bytes), raw.decode())
            shape = _shape_struct(ndim).unpack_from(payload, pos)
            pos += 8 * ndim
            fields.append(FieldPlacement(known[0], shape, offset, kind, known[1]))
        if pos != len(payload):
            raise ValueError(f"batch record of {len(payload)} bytes has {len(payload) - pos} "
                             "bytes after its last field")
        plan = Plan(spec, tuple(fields), objects_offset, objects_len, nbytes,
                    bool(flags & FLAG_TORCH), bool(flags & FLAG_COLLATED))
        return Record(idx, slot, worker_id, False, bool(flags & FLAG_SEGMENT), plan)


_SHAPE_STRUCTS: dict[int, struct.Struct] = {}


def _shape_struct(ndim: int) -> struct.Struct:
    packer = _SHAPE_STRUCTS.get(ndim)
    if packer is None:
        packer = _SHAPE_STRUCTS[ndim] = struct.Struct(f"<{ndim}q")
    return packer


def _dtype_descr(dtype: np.dtype) -> bytes:
    # Simple dtypes by their str ('<f4', '<U12'); structured ones pickled. A NUL ends it.
    if dtype.fields is None and dtype.subdtype is None:
        return dtype.str.encode() + b"\0"
    return b"P" + pickle.dumps(dtype).hex().encode() + b"\0"


def _dtype_from_descr(descr: bytes) -> np.dtype:
    if descr[:1] == b"P":
        return pickle.loads(bytes.fromhex(descr[1:].decode()))
    return np.dtype(descr.decode())


# -- the read side --------------------------------------------------------------------------

def _rebuild(node: Any, views: list, objects: list) -> Any:
    if type(node) is _FieldLeaf:
        return views[node.index]
    if type(node) is _ObjectLeaf:
        return objects[node.index]
    if type(node) is _MappingNode:
        items = {k: _rebuild(c, views, objects) for k, c in zip(node.keys, node.children)}
        if node.type is dict:
            return items
        if hasattr(node.type, "__dataclass_fields__"):
            try:
                return node.type(**items)
            except TypeError:  # a dataclass with init=False fields
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


def _reject_none(value: Any, subject: str, collated: bool = False) -> None:
    """``collated``: default collation, where torch raises TypeError for a None sample too."""
    if value is None:
        message = (f"{subject} returned None; every sample must be an array, a number or a "
                   "nested dict/tuple/list of them (filter missing samples in the dataset or "
                   "the sampler)")
        if collated:
            raise SampleTypeError(f"{_TORCH_COLLATE_TYPE_ERROR.format(type(None))} ({message})")
        raise LayoutError(message)


def _align(offset: int) -> int:
    return -(-offset // FIELD_ALIGNMENT) * FIELD_ALIGNMENT


def torch_loaded() -> bool:
    return "torch" in sys.modules
