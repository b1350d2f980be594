"""s1: what batches look like: variable shapes, repeated objects, object leaves, structured
dtypes, torch dtypes, ``batch_size=None``. 20 epochs of 100 batches each (400 samples in
batches of 4), the same loop through both loaders.

    python s1_shapes.py [substring]
"""

from __future__ import annotations

import data
from common import Case, Ctx, main


def plain(ctx: Ctx) -> None:
    ctx.epochs(ctx.loader(data.Plain()), 20)


def numpy_plain(ctx: Ctx) -> None:
    ctx.epochs(ctx.loader(data.NumpyPlain()), 20)


def text_padding(ctx: Ctx) -> None:
    ctx.epochs(ctx.loader(data.Tokens(), collate_fn=data.pad_collate, shuffle=True), 20)


def detect(ctx: Ctx) -> None:
    ctx.epochs(ctx.loader(data.Detect(), collate_fn=data.detect_collate, shuffle=True), 20)


def detect_pooled(ctx: Ctx) -> None:
    ctx.epochs(ctx.loader(data.DetectPooled(), collate_fn=data.detect_collate, shuffle=True), 20)


def strings(ctx: Ctx) -> None:
    ctx.epochs(ctx.loader(data.Strings(), shuffle=True), 20)


def dict_of_lists(ctx: Ctx) -> None:
    ctx.epochs(ctx.loader(data.DictOfLists(), collate_fn=data.lists_collate, shuffle=True), 20)


def structured(ctx: Ctx) -> None:
    ctx.epochs(ctx.loader(data.Structured(), collate_fn=data.stack_collate), 20)


def dtypes(ctx: Ctx) -> None:
    ctx.epochs(ctx.loader(data.Dtypes()), 20)


def batch_size_none(ctx: Ctx) -> None:
    ctx.epochs(ctx.loader(data.Plain(100), batch_size=None, shuffle=True), 20)


def novel_shapes(ctx: Ctx) -> None:
    ctx.epochs(ctx.loader(data.Novel(), collate_fn=data.pad_numpy_collate, shuffle=True), 20)


def new_keys(ctx: Ctx) -> None:
    ctx.epochs(ctx.loader(data.Plain(), collate_fn=data.new_keys_collate), 20)


CASES = [
    Case("plain-dict", plain),
    Case("numpy-dict", numpy_plain),
    Case("text-padding", text_padding),
    Case("detect", detect),
    Case("detect-pooled", detect_pooled),
    Case("str-bytes", strings),
    Case("dict-of-lists", dict_of_lists),
    Case("structured", structured),
    Case("dtypes-bf16", dtypes),
    Case("batch-size-none", batch_size_none),
    Case("novel-shapes", novel_shapes),
    Case("new-keys-per-batch", new_keys),
]

if __name__ == "__main__":
    main(CASES)
