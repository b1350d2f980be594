"""s4: iterator lifecycles a loop creates without thinking: ``next(iter(loader))`` in a loop,
two live iterators of one loader, an iterator outliving ``del loader``, one dropped
mid-epoch (by refcount, or later by the cyclic GC), the loop body raising (the error kept, its
traceback holding the iterator), a generator wrapper closed early, a ``for`` inside a ``for``
over the same loader, a ``return`` from inside the loop, ``next()`` after the end.

    python s4_lifecycle.py [substring]
"""

from __future__ import annotations

import copy
import gc
import pickle
import time

from common import Case, Ctx, main


def next_iter_loop(ctx: Ctx) -> None:
    loader = ctx.loader()
    t0 = time.monotonic()
    for i in range(30):  # a fresh iterator each time: the first batch of a new epoch
        ctx.got(next(iter(loader)), f"shuffled {i}")
    ctx.send("timing", time.monotonic() - t0)
    fixed = ctx.loader(shuffle=False)
    for i in range(5):
        ctx.got(next(iter(fixed)), f"sequential {i}")
    ctx.epoch(loader, "whole epoch after")


def two_live_iterators(ctx: Ctx) -> None:
    loader = ctx.loader()
    first = iter(loader)
    ctx.got(next(first), "first")
    second = iter(loader)
    ctx.value(first is second, "same object")
    ctx.got(next(second), "second")
    for name, it in (("first", first), ("second", second), ("first", first)):
        try:
            ctx.got(next(it), name)
        except (StopIteration, Exception) as e:
            ctx.error(e, name)
    rest = []
    for it in (first, second):
        try:
            rest.append(len(list(it)))
        except Exception as e:
            ctx.error(e, "rest")
    ctx.value(rest, "rest lengths")
    ctx.epoch(loader, "new epoch")


def iterator_outlives_loader(ctx: Ctx) -> None:
    loader = ctx.loader()
    it = iter(loader)
    ctx.got(next(it), "before del", keep=True)
    del loader
    gc.collect()
    ctx.epoch(it, "after del", keep=True)
    it = iter(ctx.loader(seed=3))  # only the iterator references the loader
    gc.collect()
    ctx.epoch(it, "orphan iterator", keep=True)


def dropped_mid_epoch(ctx: Ctx) -> None:
    loader = ctx.loader()
    it = iter(loader)
    ctx.got(next(it), "dropped")
    ctx.got(next(it), "dropped")
    del it  # by refcount
    ctx.epoch(loader, "epoch 2")

    class Holder:
        pass

    holder = Holder()
    holder.self, holder.it = holder, iter(loader)  # a cycle: freed by the cyclic GC only
    ctx.got(next(holder.it), "in a cycle")
    del holder
    ctx.epoch(loader, "epoch 4, cycle not yet collected")
    gc.collect()
    ctx.epoch(loader, "epoch 5")


def body_raises(ctx: Ctx) -> None:
    loader = ctx.loader()
    kept_error = None
    for attempt in range(2):
        try:
            for step, batch in enumerate(loader):
                ctx.got(batch, f"attempt {attempt}")
                if step == 2:
                    raise ValueError("loss is nan")
        except ValueError as e:
            ctx.error(e, "body")
            if attempt == 0:
                kept_error = e  # its traceback holds the loop's frame and iterator
    ctx.value(kept_error is not None, "kept")
    ctx.epoch(loader, "after")
    del kept_error
    gc.collect()
    ctx.epoch(loader, "after dropping the error")


def body_keyboard_interrupt(ctx: Ctx) -> None:
    loader = ctx.loader()
    try:
        for step, batch in enumerate(loader):
            ctx.got(batch, "interrupted")
            if step == 1:
                raise KeyboardInterrupt
    except KeyboardInterrupt as e:
        ctx.error(e, "body")
    ctx.epoch(loader, "after")


def generator_closed(ctx: Ctx) -> None:
    loader = ctx.loader()

    def scaled():
        for batch in loader:
            yield {"x": batch["x"] * 2, "y": batch["y"]}

    def passthrough():
        try:
            yield from loader
        finally:
            ctx.value("finally ran", "passthrough")

    for make in (scaled, passthrough):
        gen = make()
        ctx.got(next(gen), make.__name__)
        ctx.got(next(gen), make.__name__, keep=True)
        gen.close()
        try:
            next(gen)
        except StopIteration as e:
            ctx.error(e, "after close")
        ctx.epoch(make(), "a new one")


def generator_thrown_into(ctx: Ctx) -> None:
    """``throw()`` / ``send()`` into a ``yield from loader`` generator (forwarded to the
    iterator when it has such a method), and one dropped mid-epoch (closed by refcount)."""
    loader = ctx.loader()

    def passthrough():
        yield from loader

    gen = passthrough()
    ctx.got(next(gen), "before throw")
    try:
        gen.throw(ValueError("stop here"))
    except ValueError as e:
        ctx.error(e, "throw")
    gen = passthrough()
    ctx.got(next(gen), "before send")
    try:
        ctx.got(gen.send("x"), "send")
    except Exception as e:
        ctx.error(e, "send")
    gen = passthrough()
    ctx.got(next(gen), "dropped")
    del gen
    ctx.epoch(loader, "after")


def yield_from_held_iterator(ctx: Ctx) -> None:
    """``yield from it`` over an iterator the loop still holds, the generator closed early
    (evaluation every k steps off one training iterator): Python closes ``it`` too when it
    has a ``close()``, as ours has (torch's has none)."""
    loader = ctx.loader()
    it = iter(loader)

    def steps():
        yield from it

    for step, batch in enumerate(steps()):
        ctx.got(batch, "first steps")
        if step == 1:
            break  # the generator is dropped: closed
    try:
        ctx.epoch(it, "rest of the epoch")
    except Exception as e:
        ctx.error(e, "rest of the epoch")
    ctx.epoch(loader, "next epoch")


def subclass_generator_iter(ctx: Ctx) -> None:
    """A loader subclass whose ``__iter__`` is a generator over ``super().__iter__()``
    (a transform on every batch), with a ``break`` mid-epoch and the loop's generator then
    dropped, over three epochs; ``yield from`` and ``for`` forms."""
    class Scaled(ctx.cls):
        def __iter__(self):
            for batch in super().__iter__():
                yield {"x": batch["x"] * 10, "y": batch["y"]}

    class Delegating(ctx.cls):
        def __iter__(self):
            yield from super().__iter__()

    for cls in (Scaled, Delegating):
        loader = ctx.loader(cls=cls)
        for epoch in range(3):
            for step, batch in enumerate(loader):
                ctx.got(batch, f"{cls.__name__} epoch {epoch}")
                if epoch == 0 and step == 1:
                    break


def reiterate_on_stop(ctx: Ctx) -> None:
    """The step loop that makes a new iterator when one ends."""
    loader = ctx.loader(n=12)
    it = iter(loader)
    for step in range(10):
        try:
            batch = next(it)
        except StopIteration:
            ctx.value(step, "new epoch at step")
            it = iter(loader)
            batch = next(it)
        ctx.got(batch, f"step {step}")


def len_during_iteration(ctx: Ctx) -> None:
    loader = ctx.loader(n=18)
    it = iter(loader)
    for i, batch in enumerate(it):
        ctx.value((i, len(loader), len(it)), "i, len(loader), len(it)")
        ctx.got(batch, "batch")


def copy_iterator(ctx: Ctx) -> None:
    """``copy.copy`` / ``copy.deepcopy`` / ``pickle`` of an iterator (an object holding
    one, copied), then the original goes on."""
    loader = ctx.loader()
    it = iter(loader)
    ctx.got(next(it), "before")
    for name, how in (("copy", copy.copy), ("deepcopy", copy.deepcopy),
                      ("pickle", pickle.dumps)):
        try:
            twin = how(it)
            ctx.value("made", name)
            if name != "pickle":
                ctx.got(next(twin), f"{name} twin")
        except Exception as e:
            ctx.error(e, name)
    ctx.epoch(it, "the original goes on")


def nested_for(ctx: Ctx) -> None:
    loader = ctx.loader(n=12)
    pairs = []
    try:
        for outer in loader:
            for inner in loader:
                pairs.append((int(outer["y"][0]), int(inner["y"][0])))
    except Exception as e:
        ctx.error(e, "nested")
    ctx.value(pairs, "pairs")
    ctx.epoch(loader, "after")


def return_from_loop(ctx: Ctx) -> None:
    loader = ctx.loader()

    def find(target: int):
        for batch in loader:
            if target in batch["y"].tolist():
                return batch
        return None

    for target in (7, 0, 19, 99):
        found = find(target)
        ctx.value(found is None, f"none {target}")
        if found is not None:
            ctx.got(found, f"found {target}", keep=True)


def next_after_end(ctx: Ctx) -> None:
    loader = ctx.loader(n=8)
    it = iter(loader)
    ctx.epoch(it, "epoch")
    for _ in range(3):
        try:
            ctx.got(next(it), "after the end")
        except StopIteration as e:
            ctx.error(e, "after the end")
    ctx.value(list(it), "list of spent")
    ctx.epoch(loader, "new epoch")


CASES = [
    Case("next-iter-30", next_iter_loop),
    Case("two-live-iterators", two_live_iterators),
    Case("iterator-outlives-loader", iterator_outlives_loader),
    Case("dropped-mid-epoch", dropped_mid_epoch),
    Case("body-raises", body_raises),
    Case("body-keyboard-interrupt", body_keyboard_interrupt),
    Case("generator-closed", generator_closed),
    Case("generator-thrown-into", generator_thrown_into),
    Case("yield-from-held-iterator", yield_from_held_iterator,
         known="known: an iterator of ours has close() (docs/migrating.md)"),
    Case("subclass-generator-iter", subclass_generator_iter),
    Case("reiterate-on-stop", reiterate_on_stop),
    Case("len-during-iteration", len_during_iteration),
    Case("copy-iterator", copy_iterator),
    Case("nested-for", nested_for),
    Case("return-from-loop", return_from_loop),
    Case("next-after-end", next_after_end),
]

if __name__ == "__main__":
    main(CASES)
