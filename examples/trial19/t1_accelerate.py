"""Hugging Face accelerate 1.15, CPU, one process: ``accelerator.prepare(model, opt, loader)``
with torch's DataLoader and with ArenaLoader, the other options alike; compared:

* ``prepare``: what comes back for the loader (torch's: a ``DataLoaderShard``; ours: the same
  object), printed once;
* ``accumulate``: a training loop under ``accelerator.accumulate(model)`` with 1, 2 and 3
  accumulation steps over 2 epochs: every batch (structure, types, values, order), each
  step's loss, ``sync_gradients`` per batch and the final weights. 40 samples in batches of
  8 (5 a epoch) and of 10 (4 a epoch);
* ``skip``: ``accelerator.skip_first_batches(loader, 2)`` in epoch 1 after a full epoch 0: the
  batches of the loader it returns, and its type;
* ``lrsched``: a ``LambdaLR`` prepared beside them, stepped each optimizer step: the learning
  rates seen (part of ``accumulate``);
* ``prepare_data_loader``: accelerate's function (``accelerator.prepare_data_loader`` calls it
  on any loader, unlike ``prepare``) with 2 simulated processes, ranks 0 and 1, 2 epochs with
  ``set_epoch``: plain, ``split_batches``, ``even_batches=False``, ``use_seedable_sampler``
  with ``shuffle=True`` and with a torch ``RandomSampler`` passed.

Options varied: num_workers 0 / 2 / 2 persistent, shuffle with a seeded generator or the
global RNG, drop_last, output=None / "torch".
"""

from __future__ import annotations

import common
import torch
from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader
from accelerate.state import AcceleratorState, GradientState, PartialState
from common import CONFIGS, Tally, describe, error, shm_names, wants
from torch.utils.data import DataLoader

from arena_loader import ArenaLoader


def fresh_accelerator(steps: int) -> Accelerator:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()
    return Accelerator(cpu=True, gradient_accumulation_steps=steps)


def make_loader(loader_cls, options: dict, extra: dict, generator: bool, dataset=None):
    kw = dict(options, **extra)
    if generator:
        kw["generator"] = torch.Generator().manual_seed(7)
    return loader_cls(dataset or common.Tensors(), **kw)


def train(loader_cls, options, extra, generator, steps, batch_size, drop_last):
    common.seed_all()
    acc = fresh_accelerator(steps)
    model = common.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    loader = make_loader(loader_cls, options, dict(extra, batch_size=batch_size,
                                                   shuffle=True, drop_last=drop_last),
                         generator)
    model, opt, prepared, sched = acc.prepare(model, opt, loader, sched)
    out: dict = {"prepared": type(prepared).__name__, "same": prepared is loader,
                 "batches": [], "losses": [], "sync": [], "lr": []}
    try:
        for _epoch in range(2):
            for batch in prepared:
                out["batches"].append(describe(batch))
                with acc.accumulate(model):
                    loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
                    acc.backward(loss)
                    opt.step()
                    sched.step()
                    opt.zero_grad()
                out["losses"].append(round(loss.item(), 6))
                out["sync"].append(acc.sync_gradients)
                out["lr"].append(round(sched.get_last_lr()[0], 6))
        out["weights"] = [round(v, 5) for p in model.parameters() for v in p.flatten().tolist()]
    except Exception as exc:
        out["error"] = error(exc)
    if hasattr(loader, "close"):
        loader.close()
    return out


def skip(loader_cls, options, extra, generator, dataset):
    common.seed_all()
    acc = fresh_accelerator(1)
    loader = make_loader(loader_cls, options, dict(extra, batch_size=6, shuffle=True),
                         generator, dataset)
    prepared = acc.prepare(loader)
    out: dict = {"epoch0": [describe(b) for b in prepared]}
    try:
        skipped = acc.skip_first_batches(prepared, 2)
        out["type"] = type(skipped).__name__
        out["len"] = len(skipped)
        out["epoch1"] = [describe(b) for b in skipped]
        out["epoch2"] = [describe(b) for b in prepared]
    except Exception as exc:
        out["error"] = error(exc)
    loader.close() if hasattr(loader, "close") else None
    return out


PDL_CASES = {  # accelerate.data_loader.prepare_data_loader's options, 2 simulated processes
    "plain": {},
    "split_batches": {"split_batches": True},
    "uneven": {"even_batches": False},
    "seedable": {"use_seedable_sampler": True, "data_seed": 5},
    "seedable-torch-RandomSampler": {"use_seedable_sampler": True, "data_seed": 5},
}


def rebuilt(loader_cls, case: str, generator: bool) -> dict:
    """``prepare_data_loader(loader, num_processes=2, process_index=r)`` for r 0 and 1 (what
    ``accelerator.prepare_data_loader`` calls, on any loader): 2 epochs of each rank."""
    out: dict = {}
    for rank in (0, 1):
        common.seed_all()
        dataset = common.Tensors(42)
        kw: dict = {"batch_size": 8}
        if case.endswith("RandomSampler"):
            kw["sampler"] = torch.utils.data.RandomSampler(dataset)
        else:
            kw["shuffle"] = True
        if generator and "sampler" not in kw:
            kw["generator"] = torch.Generator().manual_seed(7)
        loader = loader_cls(dataset, **kw)
        try:
            shard = prepare_data_loader(loader, num_processes=2, process_index=rank,
                                        put_on_device=False, **PDL_CASES[case])
            out["type"] = type(shard).__name__
            epochs = []
            for epoch in range(2):
                shard.set_epoch(epoch)
                epochs.append([describe(b) for b in shard])
            out[rank] = epochs
        except Exception as exc:
            out[rank] = error(exc)
        if hasattr(loader, "close"):
            loader.close()
    return out


def first_split(want: dict, got: dict) -> int:
    return next(i for i, (w, g) in enumerate(zip(want["losses"], got["losses"])) if w != g)


def main() -> None:
    tally = Tally()
    for config, options in CONFIGS.items():
        for generator in (False, True):
            for output in (None, "torch"):
                extra = {"output": output} if output else {}
                g = "gen" if generator else "global"
                for steps, batch_size, drop_last in ((1, 8, False), (2, 8, False),
                                                     (2, 10, False), (3, 8, True)):
                    name = (f"accelerate/accumulate{steps}-bs{batch_size}"
                            f"{'-drop_last' if drop_last else ''}/{config}/{g}/output={output}")
                    if not wants(name):
                        continue
                    before = shm_names()
                    want = train(DataLoader, options, {}, generator, steps, batch_size,
                                 drop_last)
                    got = train(ArenaLoader, options, extra, generator, steps, batch_size,
                                drop_last)
                    note = f"prepare gave {got['prepared']} (same object: {got['same']})"
                    for key in ("prepared", "same"):
                        want.pop(key), got.pop(key)
                    if (40 // batch_size) % steps and want["batches"] == got["batches"] \
                            and want != got:
                        # documented (docs/migrating.md): not wrapped, the loader never sets
                        # GradientState.end_of_dataloader, so the epoch's leftover gradient
                        # joins the next epoch's first step
                        tally.add("known", name, "end_of_dataloader: batches equal, losses "
                                  f"from step {first_split(want, got)} differ")
                        continue
                    tally.check(name, want, got, before, note + got.get("error", ""))
                for data in (common.Tensors, common.Arrays):
                    name = (f"accelerate/skip_first_batches/{data.__name__}/{config}/{g}/"
                            f"output={output}")
                    if not wants(name):
                        continue
                    before = shm_names()
                    want = skip(DataLoader, options, {}, generator, data())
                    got = skip(ArenaLoader, options, extra, generator, data())
                    note = f"torch's gave {want.get('type')}, ours {got.get('type')}"
                    want.pop("type", None), got.pop("type", None)
                    tally.check(name, want, got, before, note + got.get("error", ""))
    for case in PDL_CASES:
        for generator in (False, True):
            name = f"accelerate/prepare_data_loader/{case}/{'gen' if generator else 'global'}"
            if not wants(name) or (generator and case.endswith("RandomSampler")):
                continue
            before = shm_names()
            want, got = rebuilt(DataLoader, case, generator), rebuilt(ArenaLoader, case, generator)
            if case == "seedable" and want != got:
                # documented (docs/migrating.md): accelerate swaps only a torch RandomSampler
                # for its SeedableRandomSampler; ours keeps its own shuffle
                tally.add("known", name, "use_seedable_sampler: torch's RandomSampler only")
                continue
            tally.check(name, want, got, before, f"gave {got.get('type')}")
    tally.done()


if __name__ == "__main__":
    main()
