"""Walking a sample or a batch: its structure (a spec tree), which leaves are numeric fields
and which are object leaves, and torch's ``default_collate`` rules for object leaves."""

from __future__ import annotations

import copy
import dataclasses
import numbers
import sys
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import numpy as np

from ..errors import LayoutError, SampleKeyError, SampleShapeError, SampleTypeError
from .plan import KIND_TORCH, KIND_TORCH_RAW, FieldLeaf, MappingNode, ObjectLeaf, SequenceNode

# Python scalar types and the dtype torch's default_collate gives a batch of them.
PYTHON_NUMBER_DTYPES = {bool: np.dtype(np.bool_), int: np.dtype(np.int64),
                        float: np.dtype(np.float64), complex: np.dtype(np.complex128)}

# torch dtypes numpy has no type for, stored bit for bit as an integer type of the same size.
_TORCH_RAW_DTYPES = {"bfloat16": np.dtype(np.int16), "float8_e4m3fn": np.dtype(np.uint8),
                     "float8_e5m2": np.dtype(np.uint8), "float8_e4m3fnuz": np.dtype(np.uint8),
                     "float8_e5m2fnuz": np.dtype(np.uint8), "complex32": np.dtype(np.int32)}


def describe(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.dtype}{list(value.shape)}"
    if isinstance(value, np.generic):
        return f"{value.dtype} scalar"
    if is_tensor(value):
        return f"tensor {value.dtype}{list(value.shape)}"
    return type(value).__name__


def is_tensor(value: Any) -> bool:
    """A torch tensor, of torch's classes or a subclass from any module (MONAI's
    ``MetaTensor``, a user's ``class Tagged(torch.Tensor)``)."""
    if type(value).__module__.startswith("torch"):
        return hasattr(value, "untyped_storage")
    torch = sys.modules.get("torch")  # not imported: no value is a tensor
    return torch is not None and isinstance(value, torch.Tensor)


def _stacks_as_subclass(tensor: Any) -> bool:
    """A tensor subclass that ``torch.stack`` keeps, through its ``__torch_function__``
    (``MetaTensor`` then merges its metadata): default collation stacks these with torch, as
    torch's ``default_collate`` does, and hand the result out as an object. ``Parameter`` and
    ``Buffer`` disable torch functions, so they stack to plain tensors, as fields do."""
    torch = sys.modules["torch"]
    cls = type(tensor)
    return (cls is not torch.Tensor
            and cls.__torch_function__ is not torch.nn.Parameter.__torch_function__)


def slab_holds(tensor: Any) -> bool:
    """A tensor whose values are one dense block numpy can view: strided, neither nested nor
    quantized, and not part of an autograd graph. Any other kind (nested, sparse, quantized,
    mkldnn, ``requires_grad``) travels pickled, as torch's workers send it (which keeps a leaf's
    ``requires_grad`` and refuses a non-leaf with its own error)."""
    return (tensor.layout is sys.modules["torch"].strided and not tensor.is_nested
            and not tensor.is_quantized and not tensor.requires_grad)


def outside_int64(value: Any) -> bool:
    """A Python int that int64 cannot hold."""
    return type(value) is int and not -(2**63) <= value < 2**63


def is_field(value: Any) -> bool:
    """A leaf stored as an array in the slab: numpy arrays but object ones, numeric numpy
    scalars (a ``np.str_`` is a str to torch's ``default_collate``, so an object leaf), Python
    numbers, dense tensors (but subclasses that stack as themselves)."""
    if type(value) in PYTHON_NUMBER_DTYPES:
        return True
    if isinstance(value, np.ndarray):  # object arrays travel pickled, as torch's do
        return not value.dtype.hasobject
    if isinstance(value, np.generic):
        return not isinstance(value, np.character)
    return is_tensor(value) and slab_holds(value) and not _stacks_as_subclass(value)


def _kept_subclass(value: Any, converted: bool | None) -> bool:
    """A numpy array or tensor subclass in a ``collate_fn``'s batch (a ``MaskedArray``,
    ``recarray``, ``matrix``, PyG's ``EdgeIndex``, a ``Parameter``): torch hands it out as it
    is (its workers pickle it), so it travels as an object leaf, keeping its type and state (a
    mask, a sparse size). ``np.memmap`` (what slicing a memmap gives) stays a field, stored as
    a plain array: its mapping cannot cross processes anyway. ``converted`` (``batch_size=
    None``, no ``collate_fn``): torch's ``default_convert`` keeps tensor subclasses, makes
    tensors of numpy's own array subclasses (``matrix``) and passes the others through;
    None: inside a dataclass it passes through whole, numpy scalars kept too."""
    cls = type(value)
    if is_tensor(value):
        return cls is not sys.modules["torch"].Tensor
    if cls is np.ndarray or not isinstance(value, np.ndarray) or isinstance(value, np.memmap):
        return converted is None and isinstance(value, np.generic)
    return not (converted and cls.__module__ == "numpy")


def tensor_array(value: Any) -> tuple[np.ndarray, int, str]:
    """A CPU torch tensor's values as numpy: (array, kind, raw torch dtype name)."""
    tensor = value.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    # Views with a lazy conjugate or negative bit (``x.conj()``, ``x.conj().imag``) have no
    # numpy view: materialise them, as torch's stack does.
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    name = str(tensor.dtype).rpartition(".")[2]
    raw = _TORCH_RAW_DTYPES.get(name)
    if raw is not None:  # numpy has no such dtype: keep the bits
        import torch

        as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[raw.itemsize]
        return tensor.contiguous().view(as_int).numpy(), KIND_TORCH_RAW, name
    return tensor.numpy(), KIND_TORCH, ""


_TORCH_COLLATE = "torch.utils.data._utils.collate"
_TORCHS_OWN = [()]  # the functions of the last default_collate_fn_map found to be torch's own


def collate_extensions() -> dict:
    """torch's ``default_collate_fn_map`` if a library or the user registered a collate
    function of their own in it (MONAI's ``list_data_collate`` adds ``MetaTensor``'s), else
    an empty dict. Read per batch: the map may change at any time, in a worker too."""
    collate = sys.modules.get(_TORCH_COLLATE)
    table = getattr(collate, "default_collate_fn_map", None)
    functions = tuple(table.values()) if table else ()
    if functions == _TORCHS_OWN[0] or all(  # (the first test: one C pass, by identity)
            getattr(fn, "__module__", None) == _TORCH_COLLATE for fn in functions):
        _TORCHS_OWN[0] = functions
        return {}
    return table


def registered_collate(value: Any, table: dict) -> Any:
    """The collate function ``table`` registers for ``value`` if not torch's own, found as
    torch's ``collate`` finds it (its exact type, else the first key it is an instance of)."""
    fn = table.get(type(value))
    if fn is None:
        fn = next((table[key] for key in table if isinstance(value, key)), None)
    return fn if fn is not None and getattr(fn, "__module__", None) != _TORCH_COLLATE else None


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


class SpecBuilder:
    """Walks a sample (or a collated batch) and records its structure, fields and objects."""

    def __init__(self, keep_state: bool = False, converted: bool = False,
                 extensions: dict | None = None) -> None:
        # Mappings with attributes of their own keep them (``shell``: the first sample's, in
        # default collation, as torch's copy.copy(elem).update(...) does); in a collate_fn's
        # batch, numpy array and tensor subclasses are kept as they are (``_kept_subclass``).
        self.keep_state = keep_state
        self.converted: bool | None = converted
        # Default collation: leaves of a type registered in default_collate_fn_map are
        # collated by that function (``object_collates``), before any structure is walked
        # (``extensions``: that map, read by the caller already).
        self.extensions = {} if keep_state or converted else (
            collate_extensions() if extensions is None else extensions)
        self.object_collates: list[Any] = []
        self.field_paths: list[str] = []
        self.field_values: list[Any] = []
        self.object_paths: list[str] = []
        self.object_values: list[Any] = []
        # Per object leaf: its parent is a tuple or list (torch's default_collate then hands
        # out the leaf's values as the tuple its zip() made, not a list).
        self.object_in_sequence: list[bool] = []

    def build(self, value: Any, path: str, in_sequence: bool = False) -> Any:
        if self.extensions:
            collate = registered_collate(value, self.extensions)
            if collate is not None:
                return self._object(value, path, in_sequence, collate)
        # (In a collate_fn's batch an int past int64 is handed out as it is, as by torch.)
        if is_field(value) and not (self.keep_state and (
                _kept_subclass(value, self.converted)
                or outside_int64(value))):
            self.field_paths.append(path)
            self.field_values.append(value)
            return FieldLeaf(len(self.field_paths) - 1)
        if isinstance(value, Mapping):
            keys = tuple(value.keys())
            children = tuple(self.build(value[k], f"{path}[{k!r}]") for k in keys)
            shell = _emptied_copy(value) if type(value) is not dict else None
            if shell is None:
                return MappingNode(type(value), keys, children, path,
                                   key_types=tuple(map(type, keys)))
            leaf = self._object(shell, path, False, _first_shell)
            return MappingNode(type(value), keys, children, path, leaf.index,
                               key_types=tuple(map(type, keys)))
        if isinstance(value, (tuple, list)):
            if _is_namedtuple(value):
                names = type(value)._fields
                children = tuple(self.build(v, f"{path}.{n}", True)
                                 for n, v in zip(names, value))
            else:
                children = tuple(self.build(v, f"{path}[{i}]", True)
                                 for i, v in enumerate(value))
            return SequenceNode(type(value), children, path)
        names = rebuildable_fields(value)
        if names is not None:
            # torch's default_convert passes a dataclass through whole: its numpy scalars
            # and array subclasses too (kept as objects: _kept_subclass, converted=None)
            converted = self.converted
            self.converted = None if converted else converted
            children = tuple(self.build(getattr(value, n), f"{path}.{n}") for n in names)
            self.converted = converted
            return MappingNode(type(value), names, children, path, fields_only=True)
        return self._object(value, path, in_sequence)

    def _object(self, value: Any, path: str, in_sequence: bool, collate: Any = None) -> Any:
        self.object_paths.append(path)
        self.object_values.append(value)
        self.object_in_sequence.append(in_sequence)
        self.object_collates.append(collate)
        return ObjectLeaf(len(self.object_paths) - 1)


def rebuildable_fields(value: Any) -> tuple[str, ...] | None:
    """The field names of a dataclass instance whose whole state is its fields and which
    pickles by the default protocol, else None. ``plan.rebuild`` makes such an instance
    again as unpickling makes it (``__new__``, the fields set, no ``__init__`` or
    ``__post_init__`` run again). Any other state (an attribute that is not a field, a
    tensorclass's ``batch_size``) or pickling of its own makes the object one leaf, handed
    out whole, as torch's DataLoader hands it out."""
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return None
    kind = type(value)
    if kind.__reduce_ex__ is not object.__reduce_ex__ or kind.__reduce__ is not object.__reduce__ \
            or hasattr(kind, "__setstate__") \
            or getattr(kind, "__getstate__", _DEFAULT_GETSTATE) is not _DEFAULT_GETSTATE:
        return None
    names = tuple(field.name for field in dataclasses.fields(value))  # (no ClassVar, InitVar)
    state = getattr(value, "__dict__", None)
    if state is None or set(state) != set(names):
        return None
    return names


_DEFAULT_GETSTATE = getattr(object, "__getstate__", None)  # (Python 3.11+)


def _first_shell(shells: list, *, collate_fn_map: dict) -> Any:
    """Default collation of a mapping's shell: the first sample's, as torch copies it."""
    return shells[0]


def _emptied_copy(mapping: Mapping) -> Any:
    """A mutable mapping with instance attributes besides its items (a ``UserDict``'s
    ``data``): a shallow copy of it without its items, or None for any other mapping (or one
    that does not copy)."""
    state = getattr(mapping, "__dict__", None)
    if not state or not set(state) - {"data"} or not isinstance(mapping, MutableMapping):
        return None
    try:
        shell = copy.copy(mapping)
        shell.clear()
    except Exception:
        return None
    return shell


def flatten(node: Any, value: Any, fields: list, objects: list, index: Any) -> None:
    """Append ``value``'s leaves (a sample shaped like the first) to the per-leaf lists."""
    kind = type(node)
    if kind is FieldLeaf:
        fields[node.index].append(value)
    elif kind is ObjectLeaf:
        objects[node.index].append(value)
    elif kind is MappingNode:
        if hasattr(value, "__dataclass_fields__") and not isinstance(value, Mapping):
            try:
                for key, child in zip(node.keys, node.children):
                    flatten(child, getattr(value, key), fields, objects, index)
            except AttributeError:
                _structure_error(node, value, index)
            return
        if not isinstance(value, Mapping) or len(value) != len(node.keys):
            _structure_error(node, value, index)
        for key, child in zip(node.keys, node.children):
            try:  # (the lookup alone: a nested sample's own KeyError goes up as it is)
                item = value[key]
            except KeyError:
                _structure_error(node, value, index)
            flatten(child, item, fields, objects, index)
    else:
        if not isinstance(value, (tuple, list)) and _sized_iterable(value):
            value = list(value)  # torch's zip(*batch) takes any (an array's rows, bytes' ints)
        if not isinstance(value, (tuple, list)) or len(value) != len(node.children):
            _structure_error(node, value, index)
        for child, item in zip(node.children, value):
            flatten(child, item, fields, objects, index)


def _sized_iterable(value: Any) -> bool:
    try:
        len(value)
    except TypeError:  # no length (a number, a 0-d array or tensor)
        return False
    return hasattr(value, "__iter__")


def _structure_error(node: Any, value: Any, index: Any) -> None:
    if isinstance(node, MappingNode):
        expected = f"a mapping with keys {list(node.keys)}"
        actual = f"keys {list(value.keys())}" if isinstance(value, Mapping) else describe(value)
    else:
        expected = f"a {node.type.__name__} of {len(node.children)} items"
        actual = (f"a {type(value).__name__} of {len(value)} items"
                  if isinstance(value, (tuple, list)) else describe(value))
    message = (f"sample {index!r}: {node.path} must be {expected} like the batch's first "
               f"sample, got {actual}; return the same structure (keys, lengths) for every "
               "sample, or pass a collate_fn")
    if isinstance(node, SequenceNode) and isinstance(value, (tuple, list)):
        # A length that differs: torch's default_collate raises RuntimeError, with this text.
        raise SampleShapeError("each element in list of batch should be of equal size "
                               f"(torch's words). {message}")
    # torch's class: KeyError for a key the sample lacks, TypeError subscripting (taking len()
    # of) no mapping (sequence); a mapping with every key and more is ours alone.
    mapped = isinstance(value, Mapping) and isinstance(node, MappingNode)
    if mapped and any(key not in value for key in node.keys):
        raise SampleKeyError(message)
    raise (LayoutError if mapped or (isinstance(node, SequenceNode) and _sized_iterable(value))
           else SampleTypeError)(message)


# torch's default_collate text for a leaf it cannot batch (torch/utils/data/_utils/collate.py).
TORCH_COLLATE_TYPE_ERROR = ("default_collate: batch must contain tensors, numpy arrays, numbers, "
                             "dicts or lists; found {}")
_TORCH_UNSTACKABLE = ("Batches of {} tensors are not currently supported by the default "
                      "collate_fn; please provide a custom collate_fn to handle them "
                      "appropriately.")
_SPARSE_LAYOUTS = ("sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc")


def object_array_error(dtype: np.dtype, where: str) -> SampleTypeError:
    """torch's ``TypeError`` for an object-dtype array under default collation."""
    return SampleTypeError(
        f"{TORCH_COLLATE_TYPE_ERROR.format(dtype)} ({where} is an object-dtype array "
        f"({dtype}), which default collation cannot batch; convert it to a numeric or "
        "fixed-width string dtype, return a list, or pass a collate_fn)")


def collate_objects(values: list, path: str, in_sequence: bool, indices: Sequence[Any]) -> Any:
    """One object leaf's values under default collation, as torch's ``default_collate`` gives
    them: str and bytes as they are (a tuple inside a tuple or list sample, the list
    otherwise), a tensor kind the slab cannot hold, or a subclass, stacked by torch (nested
    and sparse raise torch's ``RuntimeError``); what torch rejects raises
    ``SampleTypeError`` (a ``TypeError``). As in torch, the first sample's value decides."""
    first = values[0]
    if isinstance(first, (str, bytes)):
        return tuple(values) if in_sequence else values
    where = f"sample {indices[0]!r}"
    if path != "sample":
        where = f"field {path} of {where}"
    if isinstance(first, np.ndarray):  # of dtype object (other arrays are fields)
        raise object_array_error(first.dtype, where)
    if is_tensor(first):
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
    raise SampleTypeError(f"{TORCH_COLLATE_TYPE_ERROR.format(type(first))} ({where} is {what}, "
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
