"""s1: ``__getitem__`` returns something default collation cannot batch for one sample (9 of
20, batches of 4: the third batch), or something it batches differently.

    python s1_returns.py [substring]
"""

from __future__ import annotations

import fractions

import numpy as np
import torch
from common import BAD, Case, N, compare, report
from torch.utils.data import Dataset


class Rows(Dataset):
    """Sample i: ``{"x": float32[3] of i, "y": i}``; sample ``BAD`` from ``bad(i)`` instead."""

    def __init__(self, kind: str):
        self.kind = kind

    def __len__(self):
        return N

    def good(self, i):
        return {"x": torch.full((3,), float(i)), "y": i}

    def __getitem__(self, i):
        sample = self.good(i)
        return BAD_SAMPLES[self.kind](i, sample) if i == BAD else sample


def with_(field, value):
    return lambda i, s: {**s, field: value}


BAD_SAMPLES = {
    "none": lambda i, s: None,
    "none-field": with_("y", None),
    "object-leaf": with_("y", object()),
    "set-leaf": with_("y", {1, 2}),
    "fraction": with_("y", fractions.Fraction(1, 3)),
    "shape": with_("x", torch.zeros(4)),
    "scalar-vs-vector": with_("x", torch.tensor(1.0)),
    "missing-key": lambda i, s: {"x": s["x"]},
    "extra-key": with_("z", 5),
    "renamed-key": lambda i, s: {"x": s["x"], "label": i},
    "str-in-ints": with_("y", "9"),
    "numpy-in-tensors": with_("x", np.zeros(3, np.float32)),
    "list-not-tensor": with_("x", [9.0, 9.0, 9.0]),
    "object-array": with_("x", np.array([1, "a", None], dtype=object)),
    "nan-in-ints": with_("y", float("nan")),
    "np-nan-in-ints": with_("y", np.float64("nan")),
    "bool-in-ints": with_("y", True),
    "tuple-for-dict": lambda i, s: (s["x"], s["y"]),
    "generator": lambda i, s: (v for v in (1, 2)),
    "float64-in-float32": with_("x", torch.zeros(3, dtype=torch.float64)),
    "int-tensor-in-float": with_("x", torch.zeros(3, dtype=torch.int64)),
    "str-vs-bytes": with_("y", b"9"),
    "nested-shape": lambda i, s: {**s, "x": {"a": torch.zeros(2)}},
}


class ExtraFirst(Rows):
    """The batch's first sample (8) has an extra key, the others do not."""

    def __getitem__(self, i):
        sample = self.good(i)
        return {**sample, "z": 5} if i == BAD - 1 else sample


class ListLengths(Rows):
    """A list field whose length differs at sample 9."""

    def __getitem__(self, i):
        return {"ids": [i] * (3 if i != BAD else 2), "y": i}


class IntArrays(Rows):
    """numpy int64 arrays, one float array with NaN at 9 (a pandas column with a gap)."""

    def __getitem__(self, i):
        x = np.arange(3) + i
        return {"x": x.astype(np.float64) * np.nan if i == BAD else x, "y": i}


QUIRK = "nw=2: torch's workers raise AttributeError; ours torch's nw=0 class"
FIX = r"collate_fn|return|convert|filter|pad|same"
SAMPLE = r"\b9\b"
CASES = [
    Case("none-sample", lambda: Rows("none"), names=(SAMPLE,), fix=FIX),
    Case("none-field", lambda: Rows("none-field"), names=(SAMPLE, r"'y'"), fix=FIX),
    Case("object-leaf", lambda: Rows("object-leaf"), names=(SAMPLE, r"'y'"), fix=FIX),
    Case("set-leaf", lambda: Rows("set-leaf"), names=(SAMPLE, r"'y'"), fix=FIX),
    Case("fraction-leaf", lambda: Rows("fraction"), names=(SAMPLE, r"'y'"), fix=FIX),
    Case("mixed-shapes", lambda: Rows("shape"), names=(SAMPLE, r"'x'"), fix=FIX),
    Case("scalar-vs-vector", lambda: Rows("scalar-vs-vector"), names=(SAMPLE, r"'x'"), fix=FIX),
    Case("dict-missing-key", lambda: Rows("missing-key"), names=(SAMPLE, r"'y'"), fix=FIX),
    Case("dict-extra-key", lambda: Rows("extra-key"), names=(SAMPLE, r"'z'"), fix=FIX,
         known="a later sample's extra key: torch drops it, ours raises"),
    Case("dict-extra-key-first", lambda: ExtraFirst(""), names=(r"\b8\b|\b9\b", r"'z'"), fix=FIX),
    Case("dict-renamed-key", lambda: Rows("renamed-key"), names=(SAMPLE,), fix=FIX),
    Case("str-in-ints", lambda: Rows("str-in-ints"), names=(SAMPLE, r"'y'"), fix=FIX),
    Case("bytes-in-ints", lambda: Rows("str-vs-bytes"), names=(SAMPLE, r"'y'"), fix=FIX),
    Case("numpy-in-tensors", lambda: Rows("numpy-in-tensors"), names=(SAMPLE, r"'x'"), fix=FIX,
         known="a numpy value among tensors is stacked where torch raises"),
    Case("list-in-tensors", lambda: Rows("list-not-tensor"), names=(SAMPLE, r"'x'"), fix=FIX,
         known=QUIRK),
    Case("object-array", lambda: Rows("object-array"), names=(SAMPLE, r"'x'"), fix=FIX,
         known=QUIRK),
    Case("nan-in-ints", lambda: Rows("nan-in-ints")),
    Case("np-nan-in-ints", lambda: Rows("np-nan-in-ints")),
    Case("nan-array-in-int-arrays", lambda: IntArrays(""),
         known="promoted as torch's nw=0; torch's workers stack into int64 and raise"),
    Case("bool-in-ints", lambda: Rows("bool-in-ints")),
    Case("tuple-for-dict", lambda: Rows("tuple-for-dict"), names=(SAMPLE,), fix=FIX),
    Case("generator-sample", lambda: Rows("generator"), names=(SAMPLE,), fix=FIX),
    Case("float64-in-float32", lambda: Rows("float64-in-float32"),
         known="promoted as torch's nw=0; torch's workers stack into float32"),
    Case("int-tensor-in-float", lambda: Rows("int-tensor-in-float")),
    Case("list-lengths", lambda: ListLengths(""), names=(SAMPLE, r"'ids'"), fix=FIX),
    Case("nested-for-tensor", lambda: Rows("nested-shape"), names=(SAMPLE, r"'x'"), fix=FIX,
         known=QUIRK),
]

if __name__ == "__main__":
    for case in CASES:
        compare(case)
    report()
