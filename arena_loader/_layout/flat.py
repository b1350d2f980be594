"""Samples of a flat structure, split into columns by C-level iteration.

The commonest samples are one level of leaves: a dict of arrays and numbers, an ``(image,
label)`` tuple. ``spec.flatten`` walks each sample in Python (~2.5 us a sample of two leaves
on the 2-core machine, more than torch's whole ``default_collate`` per sample); when every
sample is a plain dict with the first one's keys (a tuple or list of its length), each
leaf's column is one comprehension over the samples instead. Anything else is walked.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from .plan import FieldLeaf, MappingNode, ObjectLeaf, SequenceNode

_LEAVES = (FieldLeaf, ObjectLeaf)


def take_flat(spec: Any, samples: Sequence[Any], fields: list, objects: list) -> bool:
    """Append the leaves of ``samples`` (shaped like the first sample, whose ``spec`` this
    is) to the per-leaf lists and return True; or append nothing and return False (the
    structure is not one level of leaves, or a sample differs: ``flatten`` then walks them
    and names the sample that differs)."""
    kind = type(spec)
    if kind is MappingNode:
        if spec.type is not dict or spec.fields_only or spec.shell >= 0 or not all(
                type(child) in _LEAVES for child in spec.children):
            return False
        if set(map(type, samples)) != {dict} or set(map(len, samples)) != {len(spec.keys)}:
            return False
        try:  # (the same length and every key: the same keys)
            columns = [list(map(operator.itemgetter(key), samples)) for key in spec.keys]
        except KeyError:
            return False
    elif kind is SequenceNode:
        if spec.type not in (tuple, list) or not all(
                type(child) in _LEAVES for child in spec.children):
            return False
        if set(map(type, samples)) != {spec.type} or set(map(len, samples)) != {
                len(spec.children)}:
            return False
        columns = zip(*samples)
    else:
        return False
    for child, column in zip(spec.children, columns):
        (fields if type(child) is FieldLeaf else objects)[child.index].extend(column)
    return True


def flat_leaves(sample: Any) -> tuple[type, Any, Any] | None:
    """(container type, keys or length, leaves) of a plain dict, tuple or list sample with at
    least one leaf; None for any other."""
    kind = type(sample)
    if kind is dict:
        return (kind, tuple(sample), sample.values()) if sample else None
    if kind is tuple or kind is list:
        return (kind, len(sample), sample) if sample else None
    return None
