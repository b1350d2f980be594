"""Rows written into a slot with no plan built for the batch.

``SameShapeRows``: samples that are each one array, shaped as the last batch's, written at
once (the commonest batch).

``RowWriter``: default collation row by row (two or more of a worker's threads running):
the thread that fetched a sample writes it into its row of the batch's storage (the slot) at
once, so the copy into shared memory runs in the worker's threads, overlapped with their
waits, and is the only copy.

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

from ._layout import CastRows, Prepared, prepare_rows, promote_to
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


class SameShapeRows:
    """The commonest batch, straight: samples that are each one array of the dtype and shape
    of the last batch the general path wrote as equal rows (``Prepared.equal_rows``), as many,
    into a slot. Checked as ``prepare_samples`` checks them (the dtypes promote to the
    first's: ``promote_to``; every row has the first's shape: the write, in C) and answered
    with that batch's plan record, so no plan is built. Anything else (or a check that
    fails) is left to the general path, which names the sample at fault."""

    __slots__ = ("_dtype", "_outs", "_rows", "_shape", "_slab", "_slot_nbytes", "plan_record")

    def __init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        """The slab was mapped anew: nothing learned holds."""
        self._dtype: np.dtype | None = None
        self._shape: tuple[int, ...] = ()
        self._rows = 0
        # Per slot: the batch's array over it, and how large rows go in (or None).
        self._outs: dict[int, tuple[np.ndarray, CastRows | None, np.ndarray | None]] = {}
        self._slab: np.ndarray | None = None
        self._slot_nbytes = 0
        self.plan_record = b""

    def learn(self, prepared: Prepared, plan_record: bytes, slab: np.ndarray,
              slot_nbytes: int) -> None:
        """``prepared`` (equal rows) was just written into a slot of ``slab``."""
        field = prepared.plan.fields[0]
        if (field.dtype, field.shape) != (self._dtype, (self._rows, *self._shape)):
            self._outs = {}  # arrays of the old shape (a new slab: ``forget``)
        self._dtype, self._shape, self._rows = field.dtype, field.shape[1:], field.shape[0]
        self._slab, self._slot_nbytes, self.plan_record = slab, slot_nbytes, plan_record

    def write(self, samples: list, slot: int) -> bool:
        """True: ``samples`` are in ``slot``, laid out as ``plan_record`` says."""
        dtype = self._dtype
        if dtype is None or len(samples) != self._rows:
            return False
        first = samples[0]
        if type(first) is not np.ndarray or first.dtype != dtype or first.shape != self._shape:
            return False
        if not promote_to(samples, dtype):
            return False  # promoted: the general path types the batch as torch would
        outs = self._outs.get(slot)
        if outs is None:
            out = np.ndarray((self._rows, *self._shape), dtype, self._slab,
                             slot * self._slot_nbytes)
            cast = CastRows.of(out)  # large rows; small ones are concatenated into `stacked`
            stacked = out.reshape(-1, *self._shape[1:]) if cast is None and self._shape else None
            outs = self._outs[slot] = (out, cast, stacked)
        out, cast, stacked = outs
        if cast is not None and cast.write(samples):
            return True  # large rows, by the cast loop (_layout/rowcopy.py)
        if stacked is not None:
            # Rows as long as the first, one copy each; the concatenation checks their other
            # axes, and every dtype promotes to the first's (checked): a safe cast. numpy
            # reading the list as one array first (below) cost ~20% more (tiny rows).
            try:
                if len(set(map(len, samples))) == 1:
                    np.concatenate(samples, axis=0, out=stacked, casting="safe")
                    return True
            except (ValueError, TypeError):
                pass
            return False
        try:
            out[...] = samples  # a row of another shape, or not an array, fails here
        except (ValueError, TypeError):
            return False
        return True
