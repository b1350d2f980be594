"""One field's rows (a leaf's values across a batch's samples) typed and checked as torch's
``default_collate`` stacks them: numpy arrays, plain tensors, Python and numpy numbers, and
the per-row walk that names the sample at fault."""

from __future__ import annotations

import functools
import operator
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import LayoutError, SampleShapeError, SampleTypeError
from .numbers import (
    AS_TENSOR_DTYPES,
    as_tensor_list,
    floats_after_a_float,
    number_dtype,
    numbers_of_tensors,
    numeric_list,
    promote,
)
from .plan import KIND_NUMPY, KIND_TORCH, EqualRows, FieldPlacement, TensorRows, promote_to
from .spec import (
    PYTHON_NUMBER_DTYPES,
    TORCH_COLLATE_TYPE_ERROR,
    describe,
    is_tensor,
    object_array_error,
    outside_int64,
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


def column(values: list, path: str, indices: Sequence[Any],
            fast: bool = True) -> tuple[list, FieldPlacement]:
    """The rows of one field as numpy values, and its dtype, shape and kind (offset 0)."""
    first = values[0]
    # The hottest path: arrays of at least one dimension whose dtypes promote to the first
    # one's (numpy's promotion then agrees with torch's); every row's shape is checked by the
    # write itself (write_equal_rows), in C, and a row that fails it gets the full walk.
    if (fast and type(first) is np.ndarray and first.ndim and not first.dtype.hasobject
            and promote_to(values, first.dtype)):
        rows = EqualRows(values, lambda: column(values, path, indices, fast=False))
        return rows, FieldPlacement(first.dtype, (len(values), *first.shape), 0)
    # Plain tensors: of one dtype, written by one torch.stack (TensorRows), 0-d ones too
    # (TensorDataset's labels: stacked to shape (n,), as torch stacks them); else viewed as
    # numpy, as arrays. ``numpy()`` refuses what needs the walk (a grad, a conjugate or
    # negative bit, another device, a dtype numpy lacks): the walk cost ~4 us more a row
    # (trial23, num_workers=0), and numpy() itself 2.2 us a row.
    torch = sys.modules.get("torch")
    if fast and torch is not None and type(first) is torch.Tensor and set(
            map(type, values)) == {torch.Tensor}:
        if len(set(map(_DTYPE, values))) == 1:
            dtype = numpy_dtype(first)
            if dtype is not None:
                rows = TensorRows(values, lambda: column(values, path, indices, fast=False)[0])
                return rows, FieldPlacement(dtype, (len(values), *first.shape), 0, KIND_TORCH)
        try:
            arrays = [value.numpy() for value in values]
        except (RuntimeError, TypeError):
            arrays = None
        if arrays is not None and arrays[0].ndim and promote_to(arrays, arrays[0].dtype):
            rows = EqualRows(arrays, lambda: column(values, path, indices, fast=False))
            return rows, FieldPlacement(arrays[0].dtype, (len(arrays), *arrays[0].shape), 0,
                                        KIND_TORCH)
    # The hot path: every row an ndarray of one dtype and shape, checked by C-level maps.
    if type(first) is np.ndarray and set(map(type, values)) == {np.ndarray}:
        shapes, dtypes = set(map(_SHAPE, values)), set(map(_DTYPE, values))
        if len(shapes) == 1 and len(dtypes) == 1:
            check_dtype(first.dtype, path, indices[0])
            return values, FieldPlacement(first.dtype, (len(values), *first.shape), 0)
    if type(first) in PYTHON_NUMBER_DTYPES:
        kind, types = KIND_NUMPY, set(map(type, values))
        if len(types) == 1:  # one Python type: its dtype (``number_dtype``'s answer)
            dtype = PYTHON_NUMBER_DTYPES[type(first)]
            return number_column(values, path, indices, dtype, kind)
        others = types.difference(PYTHON_NUMBER_DTYPES)
        if others and type(first) is float:
            values = floats_after_a_float(values, others)
            types = set(map(type, values))
            others = types.difference(PYTHON_NUMBER_DTYPES)
        if others and any(is_tensor(v) for v in values if type(v) in others):
            values, kind = numbers_of_tensors(values), KIND_TORCH
            types = set(map(type, values))
        dtype = number_dtype(values, path, indices, types)
        return number_column(values, path, indices, dtype, kind)
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
        check_dtype(dtype, path, index)
    if len(raw_names) > 1 and any(raw_names):  # a dtype stored as its bits beside others
        if all(map(is_tensor, values)):  # torch promotes them (bfloat16 + bool -> bfloat16)
            torch = sys.modules["torch"]
            target = functools.reduce(torch.promote_types, (value.dtype for value in values))
            return column([value.to(target) for value in values], path, indices, fast=False)
        # beside numpy rows: torch raises too
        raise LayoutError(f"sample {indices[0]!r}: field {path} mixes {max(raw_names)} with "
                          "other dtypes; convert every sample to one dtype in the dataset")
    check_dtype(dtype, path, indices[0])
    return rows, FieldPlacement(dtype, (len(rows), *shape), 0, kind, raw_name)


# torch dtype -> the numpy dtype of its tensors' numpy(), for the dtypes numpy has.
_NUMPY_DTYPES: dict[Any, np.dtype] = {}


def numpy_dtype(tensor: Any) -> np.dtype | None:
    """The numpy dtype a plain tensor's rows are stored as, or None: its ``numpy()`` refuses
    it (learned per torch dtype, as ``numpy()`` costs ~1 us; a tensor it refuses for another
    reason, a device or a lazy bit, is walked by ``write_tensor_rows`` if the stack refuses)."""
    dtype = _NUMPY_DTYPES.get(tensor.dtype)
    if dtype is None:
        try:
            dtype = _NUMPY_DTYPES[tensor.dtype] = tensor.numpy().dtype
        except (RuntimeError, TypeError):
            return None
    return dtype


def number_column(values: list, path: str, indices: Sequence[Any], dtype: np.dtype,
             kind: int) -> tuple[list, FieldPlacement]:
    """A field of numbers stored as ``dtype``: ints checked against int64's range."""
    if dtype.kind == "i":
        check_int64(values, path, indices)
    return values, FieldPlacement(dtype, (len(values),), 0, kind)


def check_int64(values: list, path: str, indices: Sequence[Any]) -> None:
    """Numbers stored as int64 (ints, bools): a LayoutError naming one int64 cannot hold."""
    # (min and max in C first: a value per call cost 0.5 us a row)
    if not -(2**63) <= min(values) <= max(values) < 2**63:
        for value, index in zip(values, indices):
            if outside_int64(value):
                raise LayoutError(f"sample {index!r}: field {path} is {value}, outside the "
                                  "int64 range it is stored in; store it as a float or a "
                                  "string instead")


def check_dtype(dtype: np.dtype, path: str, index: Any) -> None:
    if dtype.hasobject:
        where = f"sample {index!r}" if path == "sample" else f"field {path} of sample {index!r}"
        raise object_array_error(dtype, where)
