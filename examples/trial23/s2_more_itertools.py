"""s2: more_itertools (peekable, chunked, windowed, spy, seekable, tail, ...) and tqdm
(``len()``, ``leave=False``, a ``break`` mid-epoch) around the loader.

    pip install --target /tmp/trial23-site more-itertools tqdm
    PYTHONPATH=$PYTHONPATH:/tmp/trial23-site python s2_more_itertools.py [substring]
"""

from __future__ import annotations

import io

import more_itertools as mi
import numpy as np
import torch
from common import Case, Ctx, main
from tqdm import tqdm, trange


def peekable(ctx: Ctx) -> None:
    loader = ctx.loader()
    it = mi.peekable(loader)
    ctx.got(it.peek(), "peek", keep=True)
    ctx.got(it[2], "it[2]", keep=True)  # caches batches 0..2
    for batch in it:
        ctx.got(batch, "loop")
        if it:  # the next one peeked while this one is in use
            ctx.got(it.peek(), "peek next")
    ctx.value(bool(it), "exhausted")
    it = mi.peekable(loader)
    first = next(it)
    it.prepend(first)
    ctx.epoch(it, "after prepend")


def chunked(ctx: Ctx) -> None:
    loader = ctx.loader()
    for chunk in mi.chunked(loader, 2):
        ctx.value(len(chunk), "chunk size")
        for batch in chunk:
            ctx.got(batch, "chunked", keep=True)
    for chunk in mi.ichunked(loader, 2):
        ctx.got(list(chunk), "ichunked")
    for chunk in mi.batched(loader, 3):
        ctx.got(torch.cat([b["x"] for b in chunk]), "batched cat")


def windowed(ctx: Ctx) -> None:
    loader = ctx.loader()
    for window in mi.windowed(loader, 3):  # overlapping windows: a batch lives in 3
        ctx.got(list(window), "window", keep=True)
    for window in mi.sliding_window(loader, 2):
        ctx.got(torch.stack([b["x"] for b in window]), "sliding stack")
    for window in mi.windowed(loader, 2, step=2, fillvalue=None):
        ctx.value(window[-1] is None, "last missing")


def spy(ctx: Ctx) -> None:
    loader = ctx.loader()
    head, it = mi.spy(loader, 2)
    ctx.epoch(head, "head", keep=True)
    ctx.epoch(it, "rest")
    (first,), it = mi.spy(loader)
    ctx.value(tuple(first["x"].shape), "first shape")
    ctx.value(mi.ilen(it), "ilen")


def seekable(ctx: Ctx) -> None:
    loader = ctx.loader()
    it = mi.seekable(loader)  # caches every batch it has handed out
    ctx.epoch(mi.take(3, it), "first pass", keep=True)
    it.seek(0)
    ctx.epoch(it, "after seek", keep=True)
    it.seek(1)
    ctx.got(next(it), "seek 1")
    ctx.check("before a new epoch")
    ctx.epoch(loader, "new epoch")


def first_last_nth(ctx: Ctx) -> None:
    loader = ctx.loader()
    ctx.got(mi.first(loader), "first", keep=True)
    ctx.got(mi.last(loader), "last", keep=True)
    ctx.got(mi.nth(loader, 3), "nth 3", keep=True)
    ctx.value(mi.ilen(loader), "ilen")
    ctx.epoch(mi.tail(2, loader), "tail", keep=True)
    mi.consume(loader)
    it = iter(loader)
    mi.consume(it, 2)
    ctx.got(next(it), "after consume 2")
    ctx.value(mi.one([1]), "one")


def interleave(ctx: Ctx) -> None:
    one, two = ctx.loader(n=20), ctx.loader(n=12, seed=1)
    ctx.epoch(mi.interleave(one, two), "interleave")
    ctx.epoch(mi.interleave_longest(one, two), "interleave_longest")
    ctx.epoch(mi.roundrobin(one, two), "roundrobin", keep=True)


def side_effect_and_marks(ctx: Ctx) -> None:
    loader = ctx.loader()
    seen = []
    for batch in mi.side_effect(lambda b: seen.append(int(b["y"][0])), loader):
        ctx.got(batch, "side_effect")
    ctx.value(seen, "seen")
    for is_first, is_last, batch in mi.mark_ends(loader):
        ctx.value((is_first, is_last), "ends")
        ctx.got(batch, "marked")
    for head in mi.split_at(loader, lambda b: int(b["y"][0]) < 8):
        ctx.value(len(head), "split part")
    for part in mi.distribute(2, loader):
        ctx.got(list(part), "distributed", keep=True)
    ctx.value(mi.strictly_n(loader, 5, too_short=lambda n: None, too_long=lambda n: None)
              is not None, "strictly_n")


def tqdm_loop(ctx: Ctx) -> None:
    loader = ctx.loader()
    out = io.StringIO()
    bar = tqdm(loader, file=out)
    ctx.value(len(bar), "len(bar)")
    ctx.epoch(bar, "tqdm")
    ctx.value(bar.n, "bar.n")
    for epoch in trange(2, file=out, desc="epochs"):
        for step, batch in enumerate(tqdm(loader, leave=False, file=out, desc=f"e{epoch}")):
            ctx.got(batch, f"epoch {epoch}")
            if epoch == 0 and step == 2:
                break  # the inner bar and its iterator are abandoned mid-epoch
    with tqdm(total=len(loader), file=out) as bar:
        for batch in loader:
            bar.update(1)
            bar.set_postfix(loss=float(batch["x"].mean()))
        ctx.value(bar.n, "manual bar.n")
    ctx.value("100%" in out.getvalue(), "bars finished")
    for batch in tqdm(loader, total=3, file=out):  # a wrong total: the bar over-runs
        ctx.got(batch, "total=3")


def tqdm_numpy_stack(ctx: Ctx) -> None:
    loader = ctx.loader(shuffle=False)
    kept = [b["x"] for b in tqdm(loader, file=io.StringIO(), leave=False)]
    ctx.got(np.concatenate([np.asarray(x) for x in kept]), "concatenated")
    ctx.got(torch.cat(kept), "cat")


CASES = [
    Case("peekable", peekable),
    Case("chunked", chunked),
    Case("windowed", windowed),
    Case("spy", spy),
    Case("seekable", seekable),
    Case("first-last-nth-tail", first_last_nth),
    Case("interleave-roundrobin", interleave),
    Case("side-effect-mark-ends-distribute", side_effect_and_marks),
    Case("tqdm", tqdm_loop),
    Case("tqdm-keep-stack", tqdm_numpy_stack),
]

if __name__ == "__main__":
    main(CASES)
