"""How torch's ``default_collate`` types the numbers of a batch: Python numbers, numpy scalars
and 0-d tensors side by side (``torch.tensor(batch)``'s inference), lists after an array
(``as_tensor``), and the promotion of row dtypes."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import SampleTypeError
from .plan import KIND_TORCH
from .spec import PYTHON_NUMBER_DTYPES, describe, is_tensor, tensor_array

_CATEGORY = {"b": 0, "u": 1, "i": 1, "f": 2, "c": 3}


def promote(dtypes: list[np.dtype]) -> np.dtype:
    """torch's type promotion for stacking: the highest category (bool < int < float <
    complex) wins, and within it numpy's promotion (int8 + uint8 -> int16). A complex result
    is wide enough for the floats' precision too, as torch's (complex64 + float64 ->
    complex128; ints do not widen it: complex64 + int64 -> complex64)."""
    top = max(_CATEGORY.get(d.kind, 4) for d in dtypes)
    if top == 4:  # strings, bytes: the widest
        return np.result_type(*dtypes)
    lowest = 2 if top == 3 else top
    return np.result_type(*(d for d in dtypes if lowest <= _CATEGORY.get(d.kind, 4) <= top))


# The dtype torch's tensor inference gives a Python number (a float: the default float32).
AS_TENSOR_DTYPES = {bool: np.dtype(np.bool_), int: np.dtype(np.int64),
                     float: np.dtype(np.float32), complex: np.dtype(np.complex64)}


def _numpy_number(value: Any) -> bool:
    """A numeric numpy scalar or 0-d array: torch's ``tensor()`` takes it as a number."""
    if isinstance(value, (np.number, np.bool_)):
        return True
    return type(value) is np.ndarray and value.ndim == 0 and value.dtype.kind in "biufc"


def number_dtype(values: list, path: str, indices: Sequence[Any], types: set) -> np.dtype:
    """torch's default_collate for a batch of Python numbers: the first one's type decides,
    and a float among ints gives torch's default float dtype (float32). Numeric numpy scalars
    (and 0-d arrays) among them are taken as torch's ``tensor()`` takes them: after a Python
    float the batch is float64 (torch's dtype there), after an int or bool their dtypes
    promote with the Python numbers' (``[0, np.int64(3)]`` -> int64, ``[0, np.float16(1)]``
    -> float16)."""
    first = type(values[0])  # (``types``: the values' types, the caller's set)
    scalars = types - set(PYTHON_NUMBER_DTYPES)
    if scalars and all(map(_numpy_number, (v for v in values if type(v) in scalars))):
        dtypes = {v.dtype for v in values if type(v) in scalars}
        dtypes.update(AS_TENSOR_DTYPES[t] for t in types - scalars)
        if complex in types or any(d.kind == "c" for d in dtypes):
            if first is float:
                return np.dtype(np.complex128)
        elif first is float:
            return np.dtype(np.float64)
        return promote(list(dtypes))
    if scalars:
        other = next(v for v in values if type(v) not in PYTHON_NUMBER_DTYPES)
        row = next(i for i, v in enumerate(values) if v is other)
        raise SampleTypeError(f"sample {indices[row]!r}: field {path} is {describe(other)} "
                              f"where sample {indices[0]!r} has a Python {first.__name__}; "
                              "return the same type for every sample, or pass a collate_fn")
    if complex in types:
        return np.dtype(np.complex128) if first is complex else np.dtype(np.complex64)
    if float in types:
        return np.dtype(np.float64) if first is float else np.dtype(np.float32)
    if int in types:
        return np.dtype(np.int64)
    return np.dtype(np.bool_)


def numbers_of_tensors(values: list) -> list:
    """A Python number's field with 0-d tensors after it: torch's default_collate makes it
    ``torch.tensor(batch)``, which takes each 0-d tensor as a number of its dtype; as 0-d
    arrays here, they promote as numpy scalars do (``number_dtype``). Any other tensor (one
    of more dimensions, or of a dtype numpy lacks) is left for ``number_dtype`` to name."""
    numbers = []
    for value in values:
        if is_tensor(value) and value.ndim == 0:
            array, kind, _raw = tensor_array(value)
            if kind == KIND_TORCH:
                value = array
        numbers.append(value)
    return numbers


def floats_after_a_float(values: list, others: set) -> list:
    """After a Python float, torch's ``tensor(batch, dtype=float64)`` takes any value by its
    ``__float__`` (a ``Fraction``, a ``Decimal``); arrays, numpy scalars and tensors keep
    their own path, and a value ``float()`` refuses is left to be named."""
    floats = []
    for value in values:
        if type(value) in others and hasattr(type(value), "__float__") and not (
                is_tensor(value) or isinstance(value, (np.ndarray, np.generic))):
            with contextlib.suppress(TypeError, ValueError, OverflowError):
                value = float(value)
        floats.append(value)
    return floats


def numeric_list(value: list | tuple) -> bool:
    """A non-empty list of numbers (nested lists of equal length too)."""
    try:
        return bool(value) and np.asarray(value).dtype.kind in "biufc"
    except ValueError:  # ragged
        return False


def as_tensor_list(value: list | tuple) -> np.ndarray:
    """A list of numbers as torch's ``as_tensor`` types it (floats: float32)."""
    array = np.asarray(value)
    return array.astype({"f": np.float32, "c": np.complex64}.get(array.dtype.kind, array.dtype))
