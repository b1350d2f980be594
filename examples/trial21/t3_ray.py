"""Ray Train 2.60 ``ray.train.torch.prepare_data_loader`` (its v2 code path, the default):
torch's DataLoader against ArenaLoader, the loop Ray's docs show (README.md).

No Ray cluster: ``ray.train.get_context()`` is replaced by a context giving world size 1 or
2 and a rank, and ``ray.train.torch.get_device()`` by the CPU, which is all
``prepare_data_loader`` reads. With one worker it wraps the loader in its
``_WrappedDataLoader`` (a torch DataLoader subclass that copies the loader's ``__dict__`` and
iterates it one batch ahead); with more, it first rebuilds a torch ``DataLoader`` from the
loader's attributes with a ``DistributedSampler``, shuffled unless the loader's sampler is a
torch ``SequentialSampler``. Each run trains trial19's model (SGD, 2 epochs,
``sampler.set_epoch`` each epoch when world size > 1, as Ray's docs do) and compares what
``prepare_data_loader`` returns, every batch, each loss and the weights.
"""

from __future__ import annotations

import logging
import os
import sys
from functools import partial

import ray.train
import ray.train.torch
import torch
from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CONFIGS, Tally, describe, error, seed_all, shm_names, stop_torch, trial19, wants

from arena_loader import ArenaLoader

logging.getLogger("ray").setLevel(logging.ERROR)
B = 8


class Context:
    """What ``prepare_data_loader`` asks of ``ray.train.get_context()``."""

    def __init__(self, size: int, rank: int):
        self.size, self.rank = size, rank

    def get_world_size(self) -> int:
        return self.size

    def get_world_rank(self) -> int:
        return self.rank


def run(make, world: tuple[int, int], epochs: int = 2) -> dict:
    seed_all()
    ray.train.get_context = partial(Context, *world)
    ray.train.torch.get_device = partial(torch.device, "cpu")
    # the DistributedSampler Ray makes reads the world from torch.distributed (no process
    # group here: is_initialized() stays False, so neither loader sees one)
    torch.distributed.get_world_size = lambda group=None: world[0]
    torch.distributed.get_rank = lambda group=None: world[1]
    out = {"batches": [], "losses": []}
    model = trial19.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = prepared = None
    try:
        loader = make()
        prepared = ray.train.torch.prepare_data_loader(loader)
        inner = prepared._dataloader
        out["prepared"] = (type(prepared).__name__, "the loader" if inner is loader else
                           f"a new {type(inner).__name__}")
        for epoch in range(epochs):
            if world[0] > 1:
                prepared.sampler.set_epoch(epoch)
            for batch in prepared:
                out["batches"].append(describe(batch))
                x, y = torch.as_tensor(batch["x"]), torch.as_tensor(batch["y"])
                loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                out["losses"].append(round(loss.item(), 6))
    except Exception as exc:  # an error is a result to compare
        out["error"] = error(exc)
    finally:
        inner = getattr(prepared, "_dataloader", None)
        loader, prepared, inner = stop_torch(loader), None, stop_torch(inner)
    out["weights"] = [p.detach().round(decimals=5).tolist() for p in model.parameters()]
    return out


VARIANTS = {
    "seq": lambda ds, world: {},
    "shuffle": lambda ds, world: {"shuffle": True},
    # the docs' workaround (migrating.md): torch's sampler object, which Ray recognises
    "torch-seq-sampler": lambda ds, world: {"sampler": SequentialSampler(ds)},
    "user-dist-sampler": lambda ds, world: {"sampler": DistributedSampler(
        ds, num_replicas=world[0], rank=world[1], shuffle=True, seed=3)},
}


def main() -> None:
    tally = Tally()
    datasets = {"tensors": trial19.Tensors(), "numpy": trial19.Arrays()}
    for world in ((1, 0), (2, 0), (2, 1)):
        for cname, cfg in CONFIGS.items():
            for dname, ds in datasets.items():
                for vname, variant in VARIANTS.items():
                    name = f"world{world[0]}-rank{world[1]}-{cname}-{dname}-{vname}"
                    if not wants(name):
                        continue
                    want = run(partial(DataLoader, ds, B, **variant(ds, world), **cfg), world)
                    before = shm_names()
                    got = run(partial(ArenaLoader, ds, B, **variant(ds, world), **cfg), world)
                    note = (f"{len(want['batches'])} batches, prepared: {got.get('prepared')}"
                            + (f", {want['error']}" if "error" in want else ""))
                    if vname == "seq" and world[0] > 1 and want != got:
                        # Ray reads "shuffle" from isinstance(sampler, torch's
                        # SequentialSampler); ours is arena_loader's (docs/migrating.md)
                        tally.add("known", name, "Ray shuffles it: " + trial19.first_difference(
                            want, got))
                        for found in trial19.leftovers(before):
                            tally.add("LEAK", name, found)
                        continue
                    tally.check(name, want, got, before, note)
    tally.done()


if __name__ == "__main__":
    main()
