"""Batch layout: which bytes of a batch's storage hold which array, decided per batch.

Every batch is laid out on its own: the worker walks it (the samples under default
collation, or the batch a ``collate_fn`` returned), and every numeric leaf (numpy array or
numeric scalar, Python number, dense CPU torch tensor) becomes a *field* with its own dtype,
shape and 64-byte aligned offset. Shapes and dtypes may change from batch to batch and, in a
collated batch, from leaf to leaf. Every other leaf (str and ``np.str_``, bytes, tensors the
slab cannot hold: nested, sparse, quantized) is an *object leaf*: the values are pickled into
the same storage, after the fields.

- ``plan``: ``Plan`` (what the consumer needs) and ``Prepared`` (a plan and its values);
- ``spec``: walking samples, and torch's ``default_collate`` rules for object leaves;
- ``planner``: ``prepare_samples`` / ``prepare_batch`` / ``prepare_rows``;
- ``records``: the plan on the wire (``PlanEncoder`` / ``PlanDecoder``);
- ``rowcopy``: large rows copied by numpy's cast loop (``CastRows``), not ``memmove``.
"""

from .plan import (
    FIELD_ALIGNMENT,
    KIND_TORCH,
    KIND_TORCH_RAW,
    FieldPlacement,
    Plan,
    Prepared,
    promote_to,
)
from .planner import prepare_batch, prepare_rows, prepare_samples, rows_view
from .records import PlanDecoder, PlanEncoder
from .rowcopy import CastRows

__all__ = ["FIELD_ALIGNMENT", "KIND_TORCH", "KIND_TORCH_RAW", "CastRows", "FieldPlacement", "Plan",
           "PlanDecoder", "PlanEncoder", "Prepared", "prepare_batch", "prepare_rows",
           "prepare_samples", "promote_to", "rows_view"]
