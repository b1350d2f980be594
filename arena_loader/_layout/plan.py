"""What a batch looks like in its storage: fields (dtype, shape, 64-byte aligned offset),
object leaves pickled after them, and the structure to rebuild (docs/design.md, "Batch
layout"). ``Plan`` is what the consumer needs; ``Prepared`` is a plan with the values a worker
writes."""

from __future__ import annotations

import math
import operator
import pickle
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .rowcopy import CastRows, large_rows

FIELD_ALIGNMENT = 64

# Field kinds: how the consumer hands the leaf out.
KIND_NUMPY = 0  # a numpy array (or a numpy/Python scalar stacked into one)
KIND_TORCH = 1  # a torch tensor in the worker: a tensor again where torch output is asked for
KIND_NUMBER = 2  # an unbatched Python number (collate_fn output): handed out as a number
KIND_TORCH_RAW = 3  # a torch dtype numpy lacks (bfloat16, float8): bits stored, torch dtype kept
KIND_NUMPY_SCALAR = 4  # a numpy scalar in a collate_fn's batch: handed out as that scalar
SCALAR_KINDS = (KIND_NUMBER, KIND_NUMPY_SCALAR)  # read back as values, not views


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
class FieldLeaf:
    index: int


@dataclass(frozen=True)
class ObjectLeaf:
    index: int


@dataclass(frozen=True)
class MappingNode:
    type: type
    keys: tuple
    children: tuple
    path: str
    # A collate_fn's mutable mapping with attributes of its own (transformers' BatchEncoding
    # keeps its tokenizer encodings so): the object leaf holding an emptied copy of it, which
    # the batch's items are put back into, as torch hands out the object itself; -1: none.
    shell: int = -1
    # A dataclass instance whose state is its fields (spec.rebuildable_fields): rebuilt as
    # unpickling rebuilds it, whatever class the main process has under its name (a
    # placeholder that worker_init_fn rebinds in workers, say), as torch's batch arrives.
    fields_only: bool = False
    # The keys' types: keys compare equal across types (1, 1.0, True), structures must not
    # (a worker names a structure it sent before by its id: records.PlanEncoder).
    key_types: tuple = ()


@dataclass(frozen=True)
class SequenceNode:
    type: type
    children: tuple
    path: str


class Plan:
    """Where one batch's fields and object leaves are in its storage, and its structure."""

    __slots__ = ("collated", "converted", "fields", "flat", "leaf_objects", "nbytes",
                 "objects_len", "objects_offset", "positions", "raw", "single", "spec", "torch")

    def __init__(self, spec: Any, fields: tuple[FieldPlacement, ...], objects_offset: int,
                 objects_len: int, nbytes: int, torch: bool, collated: bool = True,
                 converted: bool = False, live_objects: bool = False,
                 positions: tuple[int, ...] | None = None):
        self.spec = spec
        self.fields = fields
        # The field of each of the spec's field leaves, where one field is in several places
        # (an array twice in a collate_fn's batch: ``planner._one_field_per_object``); None:
        # leaf k is field k. The spec stays the one of its structure, so that batches whose
        # repeats differ share it (each structure travels once: records.PlanEncoder).
        self.positions = positions
        self.objects_offset = objects_offset
        # bytes of the pickled object-leaf lists (0: none, or ``live_objects``: the objects
        # themselves are handed to the consumer, num_workers=0, as torch's are)
        self.objects_len = objects_len
        self.nbytes = nbytes  # bytes of storage the batch uses
        self.torch = torch  # some leaf was a torch tensor: output=None hands out tensors
        # Stacked by default collation (tuples become lists in torch output, as torch's
        # default_collate makes them), not a collate_fn's batch (kept as it is).
        self.collated = collated
        # One sample as it came (batch_size=None, no collate_fn): torch's default_convert
        # turns its tuples into lists too, in torch output.
        self.converted = converted
        # A torch dtype numpy lacks is among the fields: views need converting.
        self.raw = any(f.kind == KIND_TORCH_RAW for f in fields)
        # The batch is one array field and nothing else (samples that are one array): its
        # placement, so that assemble makes the one view without walking the structure.
        alone = type(spec) is FieldLeaf and len(fields) == 1 and not objects_len
        self.single = fields[0] if alone and fields[0].kind not in SCALAR_KINDS else None
        # The batch is a plain dict, list or tuple of its array fields, in order (samples such
        # as TensorDataset's): that type, so that assemble builds it without a walk; or None.
        self.flat = _flat_type(spec, fields) if not objects_len and positions is None else None
        # Which of the objects are object leaves (not a mapping's shell): handed out as they
        # came, as torch's default_collate hands out a str-first field's list untouched.
        self.leaf_objects = _object_leaves(spec) if objects_len or live_objects else ()

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

        ``storage`` may be a device batch's fields (``_device.cuda.DeviceFields``, from the
        device copy stage), which passes the host storage as ``host_bytes`` to read Python
        numbers from; ``convert``, if given, turns each field's view into what the consumer
        gets (a tensor, say)."""
        single = self.single
        if single is not None and convert is None and type(storage) is np.ndarray:
            return np.ndarray(single.shape, single.dtype, storage, single.offset)
        flat = self.flat
        if flat is not None and convert is None and type(storage) is np.ndarray:
            views = [np.ndarray(f.shape, f.dtype, storage, f.offset) for f in self.fields]
            return views if flat is list else tuple(views) if flat is tuple else dict(
                zip(self.spec.keys, views))
        views = []
        host = type(storage) is np.ndarray
        for f in self.fields:
            if f.kind in SCALAR_KINDS:
                source = storage if host_bytes is None else host_bytes
                value = source[f.offset: f.offset + f.nbytes].view(f.dtype)
                views.append(value.item() if f.kind == KIND_NUMBER else value[0])
                continue
            if host:  # one constructor call: its base is `storage`, which keeps the lease
                view = np.ndarray(f.shape, f.dtype, storage, f.offset)
            else:
                view = storage.field(f.offset, f.nbytes, f.dtype, f.shape)
            views.append(view if convert is None else convert(view, f))
        if self.positions is not None:  # one object in each of its places
            views = [views[field] for field in self.positions]
        return rebuild(self.spec, views, objects)


class Prepared:
    """A batch ready to be written: its plan and the values to write."""

    __slots__ = ("_columns", "_objects", "live_objects", "plan")

    def __init__(self, plan: Plan, columns: list, objects: bytes | None,
                 live_objects: list | None = None):
        self.plan = plan
        self._columns = columns  # per field: a list of row values, or one value (collated)
        self._objects = objects
        self.live_objects = live_objects  # the object leaves unpickled (``live`` below)

    @property
    def nbytes(self) -> int:
        return self.plan.nbytes

    @property
    def equal_rows(self) -> bool:
        """The batch is one field of rows written by ``write_equal_rows`` (samples that are
        each one array, of dtypes that promote to the first's)."""
        return len(self._columns) == 1 and type(self._columns[0]) is EqualRows

    def write(self, storage: np.ndarray) -> None:
        """Write every field (one C call each where the data allows) and the objects."""
        for field, column in zip(self.plan.fields, self._columns):
            if type(column) is EqualRows:
                write_equal_rows(storage, column, field)
                continue
            if type(column) is TensorRows:
                write_tensor_rows(storage, column, field)
                continue
            flat = storage[field.offset: field.offset + field.nbytes].view(field.dtype)
            if type(column) is list:
                write_rows(flat, column, field)
            elif type(column) is np.ndarray and column.dtype == field.dtype:
                np.concatenate((column,), axis=None, out=flat, casting="no")
            else:
                flat[...] = np.asarray(column, dtype=field.dtype).reshape(-1)
        if self._objects is not None:
            start = self.plan.objects_offset
            storage[start: start + len(self._objects)] = np.frombuffer(self._objects, np.uint8)


class EqualRows:
    """Rows whose dtypes promote to the first row's: the write checks (in C, as it copies)
    that every row has the first row's shape; the per-row walk runs only if that fails.
    A holder of the rows list, not a list subclass: numpy's assignment takes its fast path
    for an exact list, and the rows are not copied (a worker's load of a tiny batch, timed
    alone: 60.0 -> 58.1 us; the loader's rate did not move beyond noise: docs/benchmarks.md,
    fifth session)."""

    __slots__ = ("explain", "rows")

    def __init__(self, rows: list, explain: Callable[[], Any]):
        self.rows = rows
        self.explain = explain  # a call that raises the named error when the write fails


class TensorRows:
    """Plain CPU tensors of one dtype: written by one ``torch.stack`` into the field's view
    (as torch's workers stack into shared memory), which checks the shapes. A row it refuses
    (another shape, a grad, another device) is walked instead: ``walk()`` gives the rows as
    numpy (a grad detached, a device left) or raises the error that names the sample."""

    __slots__ = ("rows", "walk")

    def __init__(self, rows: list, walk: Callable[[], list]):
        self.rows = rows
        self.walk = walk


_NDIM = operator.attrgetter("ndim")


def write_tensor_rows(storage: np.ndarray, column: TensorRows, field: FieldPlacement) -> None:
    out = np.ndarray(field.shape, field.dtype, storage, field.offset)
    torch = sys.modules["torch"]
    rows = column.rows
    if len(field.shape) == 1 and field.dtype.kind in "biu" and set(map(_NDIM, rows)) == {0}:
        # 0-d integer rows (TensorDataset's labels): their values, exact, by one assignment
        # (~2,800 instructions a row; torch.stack ~3,700, as it makes a view of each first)
        out[...] = list(map(torch.Tensor.item, rows))
        return
    try:
        torch.stack(column.rows, out=torch.from_numpy(out))
    except (RuntimeError, TypeError, ValueError):
        out[...] = column.walk()


def promote_to(rows: list, dtype: np.dtype) -> bool:
    """Whether numpy promotes the rows' dtypes to ``dtype`` (the first row's: torch's
    promotion then agrees); False for a row that is neither an array nor a scalar."""
    try:
        return np.result_type(*rows) == dtype
    except (TypeError, ValueError):
        return False


def write_equal_rows(storage: np.ndarray, column: EqualRows, field: FieldPlacement) -> None:
    out = np.ndarray(field.shape, field.dtype, storage, field.offset)
    if large_rows(field.nbytes, field.shape[0]):  # by the faster loop (rowcopy.py)
        cast = CastRows.of(out)
        if cast is not None and cast.write(column.rows):
            return
    try:  # numpy reads the rows as one array of the batch's shape: a row of any other
        out[...] = column.rows  # shape (or a non-array) fails; dtypes only promote (checked)
    except (ValueError, TypeError):
        column.explain()  # raises the error that names the sample and the fix
        raise


def write_rows(flat: np.ndarray, rows: list, field: FieldPlacement) -> None:
    if rows and not isinstance(rows[0], np.ndarray):  # numbers (a failed concatenate: 12 us;
        # an array subclass, np.memmap rows say, is concatenated as arrays are)
        flat[...] = rows  # (converted as np.asarray(rows, dtype=flat.dtype) converts them)
        return
    try:  # the hot path: every row already has the field's dtype; one memcpy per row, in C
        np.concatenate(rows, axis=None, out=flat, casting="no")
    except TypeError:  # a row of another dtype (promoted)
        np.concatenate(rows, axis=None, out=flat, casting="unsafe")


def _flat_type(spec: Any, fields: tuple[FieldPlacement, ...]) -> type | None:
    """dict, list or tuple: ``spec`` is a container of exactly that type whose children are
    the fields in order (``rebuild`` makes it from the views as they are), none a scalar."""
    kind = type(spec)
    if (kind is not MappingNode and kind is not SequenceNode) or spec.type not in (
            dict, list, tuple) or len(spec.children) != len(fields):
        return None
    for position, (child, field) in enumerate(zip(spec.children, fields)):
        if type(child) is not FieldLeaf or child.index != position or field.kind in SCALAR_KINDS:
            return None
    return spec.type


def _object_leaves(node: Any) -> tuple[int, ...]:
    if type(node) is ObjectLeaf:
        return (node.index,)
    if type(node) is FieldLeaf:
        return ()
    return tuple(index for child in node.children for index in _object_leaves(child))


def rebuild(node: Any, views: list, objects: list) -> Any:
    if type(node) is FieldLeaf:
        return views[node.index]
    if type(node) is ObjectLeaf:
        return objects[node.index]
    if type(node) is MappingNode:
        items = {k: rebuild(c, views, objects) for k, c in zip(node.keys, node.children)}
        if node.type is dict:
            return items
        if node.shell >= 0:
            shell = objects[node.shell]
            shell.update(items)
            return shell
        if node.fields_only:
            built = node.type.__new__(node.type)  # as unpickling makes it: no __init__ or
            for key, item in items.items():  # __post_init__ run again, frozen or not
                object.__setattr__(built, key, item)  # (spec.rebuildable_fields)
            return built
        try:
            return node.type(items)
        except TypeError:  # a Mapping type that cannot be built from a dict
            return items
    children = [rebuild(c, views, objects) for c in node.children]
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



def align(offset: int) -> int:
    return -(-offset // FIELD_ALIGNMENT) * FIELD_ALIGNMENT
