"""Default collation row by row (two or more of a worker's threads running): the thread
that fetched a sample writes it into its row of the batch's storage (the slot) at once, so
the copy into shared memory runs in the worker's threads, overlapped with their waits, and
is the only copy.

The batch's plan is fixed by the first sample to arrive (``prepare_rows``: the plan of
``rows`` samples shaped like it). A row is written in place only if its sample matches that
sample exactly: same structure, and per leaf the same type, and for arrays the same dtype and
shape. Then default collation of all samples (``prepare_samples``) would give this very plan,
so the batch is what ``worker_threads=1`` gives. Anything else (object leaves such as str,
torch tensors, a leaf of another dtype that collation would promote, a shape mismatch) turns
the batch to the general path: the samples, kept as they arrived, are planned and written by
``prepare_samples`` once all are in, which also raises the error ``worker_threads=1`` raises
(docs/design.md, "Threads inside workers"). A plan larger than the slot gets a one-off
segment, as every batch does (``WorkerState._storage``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._layout import CastRows, Prepared, prepare_rows
from ._layout.spec import PYTHON_NUMBER_DTYPES, SpecBuilder, flatten
from .errors import LayoutError


class RowWriter:
    """One batch of ``len(indices)`` rows, written row by row by whichever thread has each
    sample (``offer``). ``storage_for(nbytes)`` gives the storage for a plan of that many
    bytes (a slot's bytes, or a one-off segment's)."""

    def __init__(self, indices: Sequence[Any], storage_for: Callable[[int], np.ndarray]):
        self.indices = indices
        self.samples: list[Any] = [None] * len(indices)
        self.in_place = True  # every row so far written into the planned storage
        self.prepared: Prepared | None = None
        self._storage_for = storage_for
        self._lock = threading.Lock()
        self._rows: list[np.ndarray] | None = None  # per field: its (rows, *shape) view
        self._casts: list[CastRows | None] = []  # per field: how large rows go in
        self._spec: Any = None
        self._template: list[Any] = []  # the first sample's field leaves

    def offer(self, row: int, sample: Any) -> None:
        """Keep ``sample`` (row ``row``) and write it into its row if the batch is still
        written in place."""
        self.samples[row] = sample
        if not self.in_place:
            return
        if self._rows is None:
            with self._lock:  # the first sample to arrive plans the batch
                if self._rows is None and self.in_place:
                    self._plan(row, sample)
            if not self.in_place:
                return
        if not self._write(row, sample):
            self.in_place = False

    def _plan(self, row: int, sample: Any) -> None:
        index = self.indices[row]
        leaves = self._leaves_or_none(None, sample, index)
        if leaves is None or not all(_in_place_leaf(leaf) for leaf in leaves):
            self.in_place = False
            return
        try:
            prepared, plan = prepare_rows(sample, len(self.indices), index)
        except LayoutError:  # object leaves: the general path says what it does with them
            self.in_place = False
            return
        storage = self._storage_for(plan.nbytes)
        self._spec, self._template, self.prepared = plan.spec, leaves, prepared
        rows = [np.ndarray(f.shape, f.dtype, storage, f.offset) for f in plan.fields]
        # _rows last: offer() reads it without the lock, as the sign that the rest is set.
        self._casts = [CastRows.of(field_rows) for field_rows in rows]
        self._rows = rows

    def _leaves_or_none(self, spec: Any, sample: Any, index: Any) -> list[Any] | None:
        """``sample``'s field leaves in plan order (None: it does not have the structure)."""
        if sample is None:
            return None
        if spec is None:  # the first sample: the walk prepare_samples does
            builder = SpecBuilder()
            builder.build(sample, "sample")
            return None if builder.object_paths else builder.field_values
        fields = [[] for _ in self._template]
        try:
            flatten(spec, sample, fields, [[]], index)
        except LayoutError:
            return None
        return [column[0] for column in fields]

    def _write(self, row: int, sample: Any) -> bool:
        """Write ``sample`` into row ``row``; False if it does not match the first sample."""
        leaves = self._leaves_or_none(self._spec, sample, self.indices[row])
        if leaves is None:
            return False
        for leaf, first in zip(leaves, self._template):
            if isinstance(first, np.ndarray):  # np.memmap rows too
                if not (isinstance(leaf, np.ndarray) and leaf.dtype == first.dtype
                        and leaf.shape == first.shape):
                    return False
            elif type(leaf) is not type(first):
                return False
        try:
            for field_rows, cast, leaf in zip(self._rows, self._casts, leaves):
                if cast is None or not cast.write_row(row, leaf):  # large rows: rowcopy.py
                    field_rows[row] = leaf
        except (OverflowError, ValueError, TypeError):  # an int beyond int64, say
            return False
        return True

    def done(self) -> bool:
        """Every row was written in place: ``prepared`` is the batch, already written."""
        return self.in_place and self._rows is not None


def _in_place_leaf(leaf: Any) -> bool:
    if isinstance(leaf, np.ndarray):
        return not leaf.dtype.hasobject
    return type(leaf) in PYTHON_NUMBER_DTYPES or (isinstance(leaf, np.generic)
                                         and not isinstance(leaf, np.character))
