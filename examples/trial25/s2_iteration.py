"""s2: how the loop iterates: iterable-style datasets, ``state_dict()`` every batch (torch's
side: torchdata's ``StatefulDataLoader``), resuming every epoch, ``iter(loader)`` abandoned
after 1-3 batches, a ``break`` every epoch, two loaders zipped, the loader made anew (and
closed) every epoch.

    python s2_iteration.py [substring]
"""

from __future__ import annotations

import data
from common import Case, Ctx, main
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader


def iterable(ctx: Ctx) -> None:
    ctx.epochs(ctx.loader(data.Stream()), 20)


def iterable_stateful(ctx: Ctx) -> None:
    ctx.epochs(ctx.loader(data.StatefulStream()), 20, each=lambda loader: loader.state_dict())


def state_dict_every_batch(ctx: Ctx) -> None:
    ctx.epochs(ctx.loader(data.Plain(), shuffle=True), 20,
               each=lambda loader: loader.state_dict())


def resume_every_epoch(ctx: Ctx) -> None:
    """37 batches, the state taken, the iterator dropped, the state loaded, the epoch's rest."""
    loader = ctx.loader(data.Plain(), shuffle=True)
    for _ in ctx.epoch_range(20):
        it = iter(loader)
        for _ in range(37):
            ctx.tick(next(it))
        state = loader.state_dict()
        del it
        loader.load_state_dict(state)
        for batch in loader:
            ctx.tick(batch)


def abandoned(count: int):
    def loop(ctx: Ctx) -> None:
        loader = ctx.loader(data.Plain(), shuffle=True)
        total = ctx.n(count if ctx.pw or not ctx.nw else count // 4)
        for k in range(total):
            if k == total // 4:
                ctx.mark_warm()
            it = iter(loader)
            for _ in range(1 + k % 3):
                ctx.tick(next(it))
            del it
        ctx.shutdown(loader)
    return loop


def break_every_epoch(ctx: Ctx) -> None:
    loader = ctx.loader(data.Plain(), shuffle=True)
    for _ in ctx.epoch_range(40):
        for k, batch in enumerate(loader):
            ctx.tick(batch)
            if k == 49:
                break
    ctx.shutdown(loader)


def zipped(ctx: Ctx) -> None:
    a = ctx.loader(data.Plain(), shuffle=True)
    b = ctx.loader(data.NumpyPlain(), shuffle=False)
    for _ in ctx.epoch_range(20):
        for x, y in zip(a, b):
            ctx.tick((x, y))


def recreated(close: bool):
    """A new loader every epoch, closed after it (ours; torch's persistent workers shut down),
    or only dropped (ours: the collector and finalizers clean up)."""
    def loop(ctx: Ctx) -> None:
        for _ in ctx.epoch_range(20):
            loader = ctx.loader(data.Plain(), shuffle=True)
            for batch in loader:
                ctx.tick(batch)
            if close or ctx.is_torch:  # (torch's persistent workers take seconds when dropped)
                ctx.shutdown(loader)
            del loader
    return loop


def distributed_set_epoch(ctx: Ctx) -> None:
    """A ``DistributedSampler`` (one replica) and ``set_epoch(epoch)`` before each epoch."""
    dataset = data.Plain()
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True)
    loader = ctx.loader(dataset, sampler=sampler)
    for epoch in ctx.epoch_range(20):
        sampler.set_epoch(epoch)
        for batch in loader:
            ctx.tick(batch)
    ctx.shutdown(loader)


def iter_rebound(ctx: Ctx) -> None:
    """``it = iter(loader)`` each epoch: the last epoch's iterator is still bound as the next
    ``iter()`` runs."""
    loader = ctx.loader(data.Plain(), shuffle=True)
    it = None
    for _ in ctx.epoch_range(20):
        it = iter(loader)
        for batch in it:
            ctx.tick(batch)
    del it
    ctx.shutdown(loader)


CASES = [
    Case("iterable", iterable),
    Case("iterable-stateful", iterable_stateful, torch_cls=StatefulDataLoader),
    Case("state-dict-every-batch", state_dict_every_batch, torch_cls=StatefulDataLoader),
    Case("resume-every-epoch", resume_every_epoch, torch_cls=StatefulDataLoader),
    Case("iter-abandoned", abandoned(1000), sample=20),
    Case("break-every-epoch", break_every_epoch),
    Case("zip-two-loaders", zipped),
    Case("recreated-every-epoch", recreated(True)),
    Case("recreated-dropped", recreated(False)),
    Case("iter-rebound", iter_rebound),
    Case("distributed-set-epoch", distributed_set_epoch),
]

if __name__ == "__main__":
    main(CASES)
