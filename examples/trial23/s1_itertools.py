"""s1: itertools and builtins over the loader: zip of loaders of different lengths (one
iterator abandoned mid-epoch), islice then a new epoch, cycle over epochs (it keeps every
batch of the first), chain, tee, enumerate, list, sum, sorted, pairwise, map / filter, any.

    python s1_itertools.py [substring]
"""

from __future__ import annotations

import itertools

from common import Case, Ctx, main


def zip_lengths(ctx: Ctx) -> None:
    long, short = ctx.loader(n=20), ctx.loader(n=12, seed=1)
    for first, second in ((long, short), (short, long)):
        for x, y in zip(first, second):  # the longer one's iterator is left mid-epoch
            ctx.got(x, "a")
            ctx.got(y, "b", keep=True)
    ctx.epoch(long, "long again")
    ctx.epoch(short, "short again")


def zip_range(ctx: Ctx) -> None:
    loader = ctx.loader()
    for step, batch in zip(range(3), loader):
        ctx.got(batch, f"step {step}", keep=True)
    for batch, step in zip(loader, range(2)):  # the loader is read once more than the range
        ctx.got(batch, f"step {step}")
    ctx.epoch(loader, "full")


def zip_longest(ctx: Ctx) -> None:
    long, short = ctx.loader(n=20), ctx.loader(n=12, seed=1)
    for x, y in itertools.zip_longest(long, short):
        ctx.got(x, "a")
        ctx.value(y is None, "b missing")
        if y is not None:
            ctx.got(y, "b")


def zip_same_loader(ctx: Ctx) -> None:
    loader = ctx.loader()
    for x, y in zip(loader, loader):  # two iterators of one loader at once
        ctx.got(x, "x", keep=True)
        ctx.got(y, "y", keep=True)
    ctx.epoch(loader, "after")


def zip_one_iterator_twice(ctx: Ctx) -> None:
    loader = ctx.loader()
    for x, y in zip(*[iter(loader)] * 2):  # consecutive pairs; the odd last batch dropped
        ctx.got(x, "x", keep=True)
        ctx.got(y, "y", keep=True)
    for pair in zip(*[iter(loader)] * 2, strict=False):
        ctx.value(len(pair), "pair")


def islice_new_epoch(ctx: Ctx) -> None:
    loader = ctx.loader()
    head = list(itertools.islice(loader, 2))
    ctx.epoch(head, "head", keep=True)
    ctx.epoch(loader, "epoch 2")
    ctx.epoch(itertools.islice(loader, 1, 4), "slice 1:4")
    ctx.epoch(loader, "epoch 4")


def cycle_epochs(ctx: Ctx) -> None:
    loader = ctx.loader()
    for batch in itertools.islice(itertools.cycle(loader), 13):  # 2.6 epochs, 5 kept by cycle
        ctx.got(batch, "cycle", keep=True)
    ctx.check("after cycle")
    ctx.epoch(loader, "new epoch", keep=True)
    ctx.epoch(loader, "newer epoch")


def cycle_training_steps(ctx: Ctx) -> None:
    """A step-based loop: ``it = cycle(loader)``, ``next(it)`` per step; batches not kept."""
    loader = ctx.loader(n=12)
    it = itertools.cycle(loader)
    for step in range(10):
        ctx.got(next(it), f"step {step}")


def chain_loaders(ctx: Ctx) -> None:
    one, two = ctx.loader(n=12), ctx.loader(n=8, seed=1)
    ctx.epoch(itertools.chain(one, two, one), "chain", keep=True)
    ctx.epoch(itertools.chain.from_iterable([one, two]), "from_iterable")


def tee_branches(ctx: Ctx) -> None:
    loader = ctx.loader()
    left, right = itertools.tee(loader)
    for batch in left:  # right's buffer now holds the whole epoch
        ctx.got(batch, "left")
    ctx.epoch(right, "right")
    left, right = itertools.tee(loader, 2)
    for x, y in zip(left, itertools.islice(right, 1, None)):  # one ahead of the other
        ctx.got(x, "x")
        ctx.got(y, "y")
    ctx.check("after tee")
    ctx.epoch(loader, "after")


def enumerate_start(ctx: Ctx) -> None:
    loader = ctx.loader()
    for i, batch in enumerate(loader, start=1):
        ctx.value(i, "i")
        ctx.got(batch, "batch")
    for i, batch in enumerate(loader, 10):
        if i == 12:
            break
        ctx.got(batch, f"{i}")


def list_then_compare(ctx: Ctx) -> None:
    loader = ctx.loader()
    first = list(loader)
    ctx.epoch(first, "first", keep=True)
    second = list(loader)
    ctx.epoch(second, "second", keep=True)
    ctx.value(len(first) == len(second) == len(loader), "lengths")
    third = [b for b in loader]
    ctx.value([int(b["y"][0]) for b in third], "third's first ids")


def sum_generator(ctx: Ctx) -> None:
    loader = ctx.loader()
    ctx.value(sum(b["y"].sum() for b in loader), "sum y")
    ctx.value(sum(b["x"] for b in loader), "sum x")
    ctx.value(sum(len(b["y"]) for b in loader), "count")
    ctx.value(max(int(b["y"].max()) for b in loader), "max")


def sorted_max(ctx: Ctx) -> None:
    loader = ctx.loader()
    for batch in sorted(loader, key=lambda b: int(b["y"][0])):
        ctx.got(batch, "sorted", keep=True)
    ctx.got(max(loader, key=lambda b: float(b["x"].sum())), "max", keep=True)
    ctx.epoch(reversed(list(loader)), "reversed", keep=True)


def pairwise_batches(ctx: Ctx) -> None:
    loader = ctx.loader()
    for previous, current in itertools.pairwise(loader):
        ctx.got(previous, "previous", keep=True)
        ctx.got(current, "current")
    ctx.epoch(loader, "after")


def map_filter(ctx: Ctx) -> None:
    loader = ctx.loader()
    for ids in map(lambda b: b["y"], loader):  # keeps one field (a view) of each batch
        ctx.got(ids, "y", keep=True)
    for batch in filter(lambda b: int(b["y"][0]) % 2 == 0, loader):
        ctx.got(batch, "even first")
    for x, y in itertools.starmap(lambda x, y: (x * 2, y), ((b["x"], b["y"]) for b in loader)):
        ctx.got((x, y), "starmap")


def any_short_circuit(ctx: Ctx) -> None:
    loader = ctx.loader()
    ctx.value(any(int(b["y"].min()) < 4 for b in loader), "any")
    ctx.value(all(len(b["y"]) == 4 for b in loader), "all")
    for batch in itertools.takewhile(lambda b: int(b["y"][0]) != 3, loader):
        ctx.got(batch, "takewhile")
    for batch in itertools.dropwhile(lambda b: int(b["y"][0]) > 5, loader):
        ctx.got(batch, "dropwhile")
    ctx.epoch(loader, "after")


def not_an_iterator(ctx: Ctx) -> None:
    loader = ctx.loader()
    for attempt in (lambda: next(loader), lambda: loader[0]):
        try:
            attempt()
        except Exception as e:
            ctx.error(e, "misuse")
    it = iter(loader)
    ctx.value(iter(it) is it, "iter(it) is it")
    ctx.value(len(it), "len(it)")
    ctx.got(next(it), "next(it)")


CASES = [
    Case("zip-different-lengths", zip_lengths),
    Case("zip-range", zip_range),
    Case("zip-longest", zip_longest),
    Case("zip-same-loader", zip_same_loader),
    Case("zip-one-iterator-twice", zip_one_iterator_twice),
    Case("islice-new-epoch", islice_new_epoch),
    Case("cycle-keeps-epoch", cycle_epochs),
    Case("cycle-steps", cycle_training_steps),
    Case("chain", chain_loaders),
    Case("tee", tee_branches),
    Case("enumerate-start", enumerate_start),
    Case("list-compare", list_then_compare),
    Case("sum-generator", sum_generator),
    Case("sorted-max-reversed", sorted_max),
    Case("pairwise", pairwise_batches),
    Case("map-filter-starmap", map_filter),
    Case("any-takewhile", any_short_circuit),
    Case("not-an-iterator", not_an_iterator),
]

if __name__ == "__main__":
    main(CASES)
