"""s3: options and holding: ``pin_memory=True``, ``output="torch"``, ``worker_threads=4``,
``worker_mode="thread"``, ``in_order=False``, ``held_batch_limit``, batches kept in a list
then dropped (beyond the slots: one-off segments), larger batches held a while, ``timeout=``,
a dataset that raises for 1% of its samples (the loop catches and goes on). Options torch's
DataLoader does not have go to ArenaLoader only (``arena``); torch runs the same loop without.

    python s3_options.py [substring]
"""

from __future__ import annotations

import collections

import data
from common import Case, Ctx, main


def simple(**options):
    def loop(ctx: Ctx) -> None:
        ctx.epochs(ctx.loader(data.Plain(), shuffle=True, **options), 20)
    return loop


def numpy_samples(ctx: Ctx) -> None:
    ctx.epochs(ctx.loader(data.NumpyPlain(), shuffle=True), 20)


def keep_recent(count: int, dataset=None, batch_size=4, epochs=20):
    """The last ``count`` batches kept (a deque), as a loop averaging over recent steps."""
    def loop(ctx: Ctx) -> None:
        loader = ctx.loader(dataset or data.Plain(), batch_size=batch_size, shuffle=True)
        recent: collections.deque = collections.deque(maxlen=count)
        ctx.epochs(loader, epochs, each=lambda _: recent.append(ctx.last))
    return loop


def keep_then_drop(ctx: Ctx) -> None:
    """40 batches kept in a list (more than the slots), then all dropped, over and over."""
    loader = ctx.loader(data.Plain(), shuffle=True)
    kept: list = []

    def keep(_: object) -> None:
        kept.append(ctx.last)
        if len(kept) == 40:
            kept.clear()
    ctx.epochs(loader, 20, each=keep)


def raising(ctx: Ctx) -> None:
    loader = ctx.loader(data.Raising(), shuffle=True)
    for _ in ctx.epoch_range(20):
        it = iter(loader)
        while ctx.next_or_caught(it):
            pass


def timeout_fires(ctx: Ctx) -> None:
    """``timeout=0.1`` over a dataset with a 0.3 s sample every 200: the loop catches the
    timeout error and calls ``next()`` again (both loaders then deliver the slow batch)."""
    loader = ctx.loader(data.SlowSome(), shuffle=True, timeout=0.1)
    for _ in ctx.epoch_range(10):
        it = iter(loader)
        while ctx.next_or_caught(it):
            pass


WORKERS = ((2, False), (2, True))
CASES = [
    Case("pin-memory", simple(pin_memory=True)),
    Case("output-torch", numpy_samples, arena={"output": "torch"}),
    Case("worker-threads-4", simple(), arena={"worker_threads": 4}, configs=WORKERS),
    Case("worker-mode-thread", simple(), arena={"worker_mode": "thread"}, configs=WORKERS),
    Case("in-order-false", simple(in_order=False), configs=WORKERS),
    Case("held-batch-limit", keep_recent(4), arena={"held_batch_limit": 8}),
    Case("keep-40-then-drop", keep_then_drop),
    Case("big-keep-3", keep_recent(3, data.Big(), batch_size=8, epochs=40)),
    Case("timeout", simple(timeout=30), configs=WORKERS),
    Case("timeout-fires", timeout_fires, configs=WORKERS, sample=25),
    Case("raising-1pct", raising),
]

if __name__ == "__main__":
    main(CASES)
