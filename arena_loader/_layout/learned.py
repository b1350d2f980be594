"""The layout learned from earlier batches of flat samples whose every leaf is a field
(TensorDataset's ``(x, y)``, an ``(image, label)`` tuple, ``{"x": tensor, "y": int}``): the
spec ``SpecBuilder`` builds from such a first sample, the last plan made with it, and what
each column was (``ColumnRecipe``), so that a batch like the last is typed by a few C-level
checks per column instead of the walk and ``columns.column``.

Every check here is one the general path makes, or implies what it would find; a batch that
fails any is left to it (``planner.prepare_samples``), which names the sample at fault.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from .columns import check_int64, column
from .plan import KIND_NUMPY, FieldPlacement, Plan, TensorRows
from .spec import PYTHON_NUMBER_DTYPES, slab_holds

_DTYPE = operator.attrgetter("dtype")


class ColumnRecipe:
    """What one column of the last batch was, and what a column must be to be the same:
    plain tensors of one torch dtype whose first row has the last first row's shape (written
    by one stack: ``TensorRows``), or Python numbers of one type (``tensor`` None)."""

    __slots__ = ("dtypes", "placement", "shape", "tensor", "types")

    def __init__(self, types: frozenset, placement: FieldPlacement, tensor: Any = None,
                 shape: tuple = ()) -> None:
        self.types = types  # {torch.Tensor}, or {int} (one Python number type)
        self.placement = placement  # the last batch's, offset and all (the plan's field)
        self.tensor = tensor  # the torch dtype, for tensors
        self.dtypes = frozenset((tensor,))
        self.shape = shape  # the first row's shape, for tensors

    def rows(self, values: list, path: str, indices: Sequence[Any]) -> Any:
        """What ``columns.column`` gives for ``values`` (as the last batch's) or None."""
        if set(map(type, values)) != self.types:
            return None
        if self.tensor is None:  # Python numbers of the last batch's type: its dtype
            if self.placement.dtype.kind == "i":
                check_int64(values, path, indices)
            return values
        first = values[0]
        # (a first row the slab cannot hold is an object leaf, in the spec SpecBuilder builds)
        if set(map(_DTYPE, values)) != self.dtypes or first.shape != self.shape or not (
                slab_holds(first)):
            return None
        return TensorRows(values, lambda: column(values, path, indices, fast=False)[0])


def recipe_of(rows: Any, placement: FieldPlacement) -> ColumnRecipe | None:
    """The recipe of a column ``columns.column`` gave, or None: another kind of column."""
    if type(rows) is TensorRows:
        first = rows.rows[0]
        return ColumnRecipe(frozenset((type(first),)), placement, first.dtype,
                            tuple(first.shape))
    if type(rows) is list and placement.kind == KIND_NUMPY and len(placement.shape) == 1:
        types = frozenset(map(type, rows))
        (kind,) = types if len(types) == 1 else (None,)
        if PYTHON_NUMBER_DTYPES.get(kind) == placement.dtype:
            return ColumnRecipe(types, placement)
    return None


class FlatLayout:
    """A learned layout: samples of container type ``kind`` with ``keys`` (a dict's keys, in
    order; a tuple's or list's length) and fields only have ``spec`` and ``paths``; ``plan``
    and ``recipes`` are the last batch's. Immutable: replaced whole (thread workers share
    one: ``planner._prepare_flat``)."""

    __slots__ = ("key_types", "keys", "kind", "paths", "plan", "recipes", "spec")

    def __init__(self, kind: type, keys: Any, spec: Any, paths: list[str],
                 plan: Plan | None = None, recipes: list | None = None):
        self.kind = kind
        self.keys = keys
        # (keys that compare equal but differ in type, 1 and True, name other items)
        self.key_types = list(map(type, keys)) if kind is dict else None
        self.spec = spec
        self.paths = paths
        self.plan = plan
        # per column, when every column has one; (): not every one has; None: not learned
        self.recipes = recipes

    def fits(self, kind: type, keys: Any) -> bool:
        """Samples of ``kind`` with ``keys`` (``flat.flat_leaves``) have this spec."""
        return kind is self.kind and keys == self.keys and (
            kind is not dict or list(map(type, keys)) == self.key_types)

    def plan_for(self, placements: list) -> Plan | None:
        """The last plan, if ``placements`` (offset 0) are its fields' but for the offsets."""
        plan = self.plan
        if plan is None:
            return None
        for new, old in zip(placements, plan.fields):
            if (new.dtype != old.dtype or new.shape != old.shape or new.kind != old.kind
                    or new.torch_dtype != old.torch_dtype):
                return None
        return plan

    def learned(self, plan: Plan, columns: list) -> FlatLayout:
        """This layout with ``plan`` and the recipes of its ``columns`` as the last batch's."""
        recipes = list(map(recipe_of, columns, plan.fields))
        return FlatLayout(self.kind, self.keys, self.spec, self.paths, plan,
                          () if None in recipes else recipes)

    def take(self, samples: Sequence[Any], indices: Sequence[Any]) -> list | None:
        """The columns of a batch (samples that ``fits``) if each is what the last batch's
        was, as many rows: then ``plan`` is its plan. None: the general path decides."""
        recipes, plan = self.recipes, self.plan
        if not recipes or plan.fields[0].shape[0] != len(samples):
            return None
        kind = self.kind
        if set(map(type, samples)) != {kind} or set(map(len, samples)) != {len(recipes)}:
            return None
        if kind is dict:
            try:  # (the same length and every key: the same keys)
                values = [list(map(operator.itemgetter(key), samples)) for key in self.keys]
            except KeyError:
                return None
        else:
            values = list(map(list, zip(*samples)))
        columns = []
        for rows, recipe, path in zip(values, recipes, self.paths):
            taken = recipe.rows(rows, path, indices)
            if taken is None:
                return None
            columns.append(taken)
        return columns
