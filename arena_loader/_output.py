"""What the consumer receives: the numpy views of a slot as they are, or as torch tensors in
the structure torch's ``default_collate`` gives (tuples become lists, namedtuples stay).

``torch.from_numpy`` shares the memory, so a tensor keeps the numpy view (and through its
``.base`` chain the slot's lease) alive: the slot is reused only once the tensor is gone.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, MutableMapping, MutableSequence, Sequence
from typing import Any

import numpy as np

from ._layout import KIND_TORCH, KIND_TORCH_RAW, FieldPlacement

OUTPUTS = (None, "numpy", "torch")


def torch_raw_view(view: Any, torch_dtype: str) -> Any:
    """A field stored as raw bits (a torch dtype numpy lacks, e.g. bfloat16) as a tensor of
    that dtype, sharing the memory; ``view`` is a numpy view or already a tensor (of the
    bits, on a GPU, say)."""
    import torch

    tensor = torch.from_numpy(view) if isinstance(view, np.ndarray) else view
    return tensor.view(getattr(torch, torch_dtype))


def raw_field(view: Any, field: FieldPlacement) -> Any:
    return torch_raw_view(view, field.torch_dtype) if field.kind == KIND_TORCH_RAW else view


def converted_field(convert: Callable[[Any], Any], view: Any, field: FieldPlacement) -> Any:
    return raw_field(convert(view), field)


def tensor_field(view: Any, field: FieldPlacement) -> Any:
    """A field that was a torch tensor in the worker as a tensor again; any other as is."""
    if field.kind == KIND_TORCH:
        import torch

        return torch.from_numpy(view)
    return raw_field(view, field)


def numeric_tensor_field(view: Any, field: FieldPlacement) -> Any:
    """``output="torch"``: any numeric field as a tensor (strings stay numpy arrays)."""
    if field.kind != KIND_TORCH_RAW and view.dtype.kind in "biufc":
        import torch

        return torch.from_numpy(view)
    return raw_field(view, field)


def make_converter(output: str | None, lazy: bool = False) -> Callable[[Any], Any] | None:
    """The function applied to every batch, or None to hand out numpy views unchanged.
    ``lazy``: import torch at the first batch that needs it, not now."""
    if output == "numpy":
        return None
    torch = None if lazy else _import_torch()

    def to_torch(value: Any, collated: bool = True, converted: bool = False,
                 kept: frozenset = frozenset(), forced: bool = False) -> Any:
        """``collated``: the batch was stacked by default collation, so tuples become lists
        as in torch's ``default_collate``; ``converted``: one sample (``batch_size=None``, no
        ``collate_fn``), whose tuples become lists as in torch's ``default_convert``; a
        ``collate_fn``'s structure is kept as is. ``kept``: ids of values handed out as they
        are (object leaves: torch's default_collate returns a str-first field's list of
        values untouched, numpy arrays among them). ``forced``: output="torch"."""
        nonlocal torch
        if torch is None:
            torch = _import_torch()
        return _to_torch(torch, value, collated, converted, kept, forced)

    return to_torch


def _import_torch() -> Any:
    import torch  # only loaded when asked for: importing arena_loader must not need torch

    return torch


def _to_torch(torch: Any, value: Any, collated: bool, converted: bool = False,
              kept: frozenset = frozenset(), forced: bool = False) -> Any:
    """``forced``: output="torch", which makes tensors of numeric arrays inside a dataclass
    that torch's default_convert passes through as it is (its structure kept)."""
    if kept and id(value) in kept:
        return value
    kind = type(value)
    if kind is np.ndarray or (kind is not dict and isinstance(value, np.ndarray)):
        # Strings and other dtypes torch has no tensor type for stay numpy arrays.
        return torch.from_numpy(value) if value.dtype.kind in "biufc" else value
    walk = (collated, converted, kept, forced)
    if kind is dict or kind is list or (kind is tuple and (collated or converted)):
        # (the commonest containers first, without the ABC checks below: what they give;
        # their numeric arrays at once, the commonest leaves)
        if kind is dict:
            return {key: torch.from_numpy(item) if type(item) is np.ndarray and not kept
                    and item.dtype.kind in "biufc" else _to_torch(torch, item, *walk)
                    for key, item in value.items()}
        return [torch.from_numpy(item) if type(item) is np.ndarray and not kept
                and item.dtype.kind in "biufc" else _to_torch(torch, item, *walk)
                for item in value]
    if isinstance(value, Mapping):
        return _same_mapping(value, {key: _to_torch(torch, item, *walk)
                                     for key, item in value.items()})
    if isinstance(value, tuple) and hasattr(type(value), "_fields"):
        return type(value)(*(_to_torch(torch, item, *walk) for item in value))
    if isinstance(value, (tuple, list)):
        items = [_to_torch(torch, item, *walk) for item in value]
        # torch's default_collate (and default_convert) turns a tuple of fields into a list,
        # and keeps a list subclass
        if type(value) is list or ((collated or converted) and isinstance(value, tuple)):
            return items
        return _same_sequence(value, items)
    if hasattr(value, "__dataclass_fields__") and not isinstance(value, type):
        if converted and not forced:
            return value
        for name in value.__dataclass_fields__:
            item = getattr(value, name)
            new = _to_torch(torch, item, collated, False, kept, forced)
            if new is not item:
                try:
                    setattr(value, name, new)
                except AttributeError:  # frozen: left as numpy
                    pass
        return value
    return value


def _same_mapping(value: Mapping, entries: dict) -> Any:
    """``entries`` in a mapping of ``value``'s type: a mutable one copied and updated, which
    keeps what its type holds besides the items (transformers' BatchEncoding, its
    encodings), as torch's collate and pin_memory do; a plain dict (or a mapping type not
    built from a dict) is ``entries`` itself."""
    if type(value) is dict:
        return entries
    try:
        if isinstance(value, MutableMapping):
            clone = copy.copy(value)
            clone.update(entries)
            return clone
        return type(value)(entries)
    except TypeError:
        return entries


def _same_sequence(value: Sequence, items: list) -> Any:
    """``items`` in a sequence of ``value``'s type, as torch's collate, convert and pin_memory
    make one: a mutable one copied with its items set (keeping what its type holds besides
    them), another built from the list; the list itself if the type refuses either."""
    try:
        if isinstance(value, MutableSequence):
            clone = copy.copy(value)
            for index, item in enumerate(items):
                clone[index] = item
            return clone
        return type(value)(items)
    except TypeError:
        return items


# -- pin_memory=True without a device -----------------------------------------------------

NUMPY_UNPINNED = (
    "pin_memory=True page-locks torch tensors only (copied into torch's page-locked memory, as "
    "torch's DataLoader does); numpy arrays in batches are views of the slab, in pageable "
    "memory (a page-locked slot is rewritten once its batch is dropped, even while an "
    "asynchronous copy to the GPU still reads it). Pass output='torch' for pinned tensors, or "
    "device='cuda' for page-locked copies to the GPU")


def tensor_pinner() -> tuple[Callable[[Any, list], Any] | None, str | None]:
    """``pin_memory=True`` without ``device``: the function that gives a batch whose torch
    tensors are copies in torch's page-locked memory, as torch's pin-memory thread does, or
    None and why not (torch's warning names it at ``iter()``).

    Copies, not the slab page-locked in place: torch's copies to the GPU record an event on
    each page-locked block they read, and torch reuses a block only once its copy is done. A
    slab slot is reused once the batch is dropped, which ``x = x.cuda(non_blocking=True)``
    does before the copy has run: a page-locked slot then reaches the GPU with the next
    batch's rows in it (244 of 256 batches on an H200, docs/benchmarks.md)."""
    try:
        torch = _import_torch()
    except ImportError:
        return None, "torch is not installed: without device='cuda' only tensors are pinned"
    if not torch.cuda.is_available():
        return None, "torch finds no CUDA GPU"
    return pin_tensors, None


def pin_tensors(value: Any, numpy_left: list | None = None) -> Any:
    """``value`` with each torch tensor replaced by its ``pin_memory()`` copy, through the
    containers torch's ``pin_memory`` walks, with its results (torch 2.13): an object with a
    ``pin_memory()`` method is pinned by it, mappings, sequences and tuples keep their type
    where it can be rebuilt; anything else (numpy arrays, strings) is kept as is. Numeric
    numpy arrays kept are listed in ``numpy_left`` (their shapes)."""
    pin = getattr(value, "pin_memory", None)
    if pin is not None:
        return pin()
    if isinstance(value, np.ndarray):
        if numpy_left is not None and value.dtype.kind in "biufc":
            numpy_left.append(value.shape)
        return value
    if isinstance(value, (str, bytes)):
        return value
    if isinstance(value, Mapping):
        return _same_mapping(value, {key: pin_tensors(item, numpy_left)
                                     for key, item in value.items()})
    if isinstance(value, tuple):
        items = [pin_tensors(item, numpy_left) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, Sequence):
        return _same_sequence(value, [pin_tensors(item, numpy_left) for item in value])
    return value
