"""What the consumer receives: the numpy views of a slot as they are, or as torch tensors in
the structure torch's ``default_collate`` gives (tuples become lists, namedtuples stay).

``torch.from_numpy`` shares the memory, so a tensor keeps the numpy view (and through its
``.base`` chain the slot's lease) alive: the slot is reused only once the tensor is gone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

OUTPUTS = ("numpy", "torch")


def make_converter(output: str) -> Callable[[Any], Any] | None:
    """The function applied to every batch, or None to hand out numpy views unchanged."""
    if output == "numpy":
        return None
    import torch  # only loaded when asked for: importing arena_loader must not need torch

    def to_torch(value: Any) -> Any:
        if isinstance(value, np.ndarray):
            # Strings and other dtypes torch has no tensor type for stay numpy arrays.
            return torch.from_numpy(value) if value.dtype.kind in "biufc" else value
        if isinstance(value, Mapping):
            converted = {key: to_torch(item) for key, item in value.items()}
            try:
                return type(value)(converted)
            except TypeError:  # a mapping type that is not built from a dict
                return converted
        if isinstance(value, tuple) and hasattr(type(value), "_fields"):
            return type(value)(*(to_torch(item) for item in value))
        if isinstance(value, (tuple, list)):
            # torch's default_collate turns a tuple of fields into a list
            return [to_torch(item) for item in value]
        return value

    return to_torch
