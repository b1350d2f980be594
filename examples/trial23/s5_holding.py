"""s5: batches the loop holds: gradient accumulation over k batches, held batches stacked
(``torch.stack`` / ``torch.cat`` / ``np.concatenate`` / ``default_collate``), every batch of
several epochs kept, views and fields of batches kept, a batch changed in place, the last
batch used after its loop and after the next epoch, batches outliving the loader, pickled.

    python s5_holding.py [substring]
"""

from __future__ import annotations

import collections
import copy
import gc
import io
import pickle

import numpy as np
import torch
from common import Case, Ctx, main
from torch.utils.data import default_collate


def grad_accumulation(ctx: Ctx) -> None:
    loader = ctx.loader(n=28)
    for epoch in range(2):
        held = []
        for batch in loader:
            held.append(batch)
            ctx.got(batch, f"epoch {epoch}", keep=True)
            if len(held) == 3:  # the step: a loss over the k held batches
                ctx.value(float(sum(b["x"].sum() for b in held)), "step loss")
                held.clear()
        ctx.value(len(held), "left over")


def stack_held(ctx: Ctx) -> None:
    loader = ctx.loader()
    held = [b for _, b in zip(range(4), loader)]
    xs = [b["x"] for b in held]
    ctx.got(torch.stack(xs), "stack")
    ctx.got(torch.cat(xs), "cat")
    ctx.got(np.concatenate([np.asarray(x) for x in xs]), "np.concatenate")
    ctx.got(np.stack([b["y"].numpy() for b in held]), "np.stack")
    ctx.got(default_collate(held), "default_collate")
    ctx.got(torch.cat([b["y"] for b in loader]), "cat of a whole epoch")
    ctx.epoch(held, "held", keep=True)


def keep_every_epoch(ctx: Ctx) -> None:
    loader = ctx.loader()
    for epoch in range(3):
        ctx.epoch(loader, f"epoch {epoch}", keep=True)
        ctx.check(f"after epoch {epoch}")


def keep_views(ctx: Ctx) -> None:
    loader = ctx.loader()
    for batch in loader:
        x, y = batch["x"], batch["y"]
        ctx.got(x[1:3], "slice", keep=True)
        ctx.got(x.view(-1), "view", keep=True)
        ctx.got(x.T, "transpose", keep=True)
        ctx.got(y.numpy(), "numpy", keep=True)
        ctx.got(np.asarray(x), "asarray", keep=True)
        ctx.got(x[0, 0], "0-d", keep=True)
        ctx.got(list(y), "list of 0-d", keep=True)
        ctx.got(torch.unbind(x), "unbind", keep=True)
    for batch in loader:  # the slots are reused while the views live
        ctx.got(batch, "next epoch")


def change_in_place(ctx: Ctx) -> None:
    loader = ctx.loader()
    for batch in loader:
        batch["x"] += 1  # the user's own normalisation, in place
        batch["x"].mul_(2)
        batch["y"][0] = -1
        ctx.got(batch, "changed", keep=True)
    for batch in loader:
        ctx.got(batch, "next epoch")  # no trace of the changes


def last_after_loop(ctx: Ctx) -> None:
    loader = ctx.loader()
    for batch in loader:
        last = batch
    ctx.got(last, "last", keep=True)
    for batch in loader:  # a new epoch fills the slots again
        ctx.got(batch, "epoch 2")
    ctx.got(last, "last after epoch 2")
    tail = collections.deque(loader, maxlen=2)
    ctx.epoch(tail, "deque tail", keep=True)


def outlive_loader(ctx: Ctx) -> None:
    loader = ctx.loader()
    batches = list(loader)
    it = iter(loader)
    one = next(it)
    del loader, it
    gc.collect()
    ctx.epoch([*batches, one], "after the loader", keep=True)
    ctx.got(torch.stack([b["x"] for b in batches]), "stacked after")


def copies_and_pickles(ctx: Ctx) -> None:
    loader = ctx.loader()
    for batch in loader:
        ctx.got(dict(batch), "dict", keep=True)
        ctx.got({**batch}, "splat", keep=True)
        ctx.got(copy.copy(batch), "copy", keep=True)
        ctx.got(copy.deepcopy(batch), "deepcopy", keep=True)
        ctx.got(pickle.loads(pickle.dumps(batch)), "pickled", keep=True)
        buffer = io.BytesIO()
        torch.save(batch, buffer)
        buffer.seek(0)
        ctx.got(torch.load(buffer), "torch.save", keep=True)
        ctx.got({k: v.clone() for k, v in batch.items()}, "clone", keep=True)


def to_device_style(ctx: Ctx) -> None:
    """``batch = {k: v.to(device, non_blocking=True) ...}`` with device cpu, and ``.float()``,
    ``.contiguous()``, ``.pin_memory()``-free paths: what many training loops do first."""
    loader = ctx.loader()
    for batch in loader:
        moved = {k: v.to("cpu", non_blocking=True) for k, v in batch.items()}
        ctx.value(moved["x"].data_ptr() == batch["x"].data_ptr(), "to(cpu) shares")
        ctx.got({"x": moved["x"].float().contiguous(), "y": moved["y"].long()}, "moved",
                keep=True)
        ctx.value(batch["x"].is_contiguous(), "contiguous")
        ctx.value(batch["x"].requires_grad, "requires_grad")
        ctx.value(batch["x"].is_shared(), "is_shared")


CASES = [
    Case("grad-accumulation", grad_accumulation),
    Case("stack-held", stack_held),
    Case("keep-every-epoch", keep_every_epoch),
    Case("keep-views", keep_views),
    Case("change-in-place", change_in_place),
    Case("last-after-loop", last_after_loop),
    Case("outlive-loader", outlive_loader),
    Case("copies-and-pickles", copies_and_pickles),
    Case("to-device-style", to_device_style,
         known="known: is_shared() (docs/migrating.md)"),
]

if __name__ == "__main__":
    main(CASES)
