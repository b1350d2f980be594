"""pytorch-ignite 0.5.5: ``Engine.run(loader, ...)`` with torch's DataLoader and ArenaLoader, the
other options alike; compared: every batch the process function gets (structure, types,
values, order), its losses, the engine's final ``state`` (iteration, epoch), and then
leftovers. Cases:

* ``whole``: ``run(loader, max_epochs=3)``;
* ``epoch_length=3`` (shorter than the loader's 5 batches: ignite keeps one iterator across
  its epochs and drops it mid-epoch at the end) and ``epoch_length=7`` (longer: ignite
  re-iterates within an epoch);
* ``terminate_epoch`` after 2 batches of epoch 2, and ``interrupt`` after 7 iterations then
  ``run()`` again (ignite keeps the iterator and resumes it);
* ``evaluator``: an evaluator Engine runs over the same loader at each ``EPOCH_COMPLETED``
  of the trainer (whose iterator is still open then: ignite stops at ``epoch_length``
  without asking for more), with ``epoch_length`` 5 and 3;
* ``resume``: ``state_dict()`` after an interrupted run (epoch 1 done), a new Engine,
  ``load_state_dict``, ``run(loader)`` to 3 epochs;
* ``deterministic``: ignite's ``DeterministicEngine`` (reseeds torch's global RNG each epoch;
  swaps a torch DataLoader's batch sampler for its ``ReproducibleBatchSampler``, which it
  cannot do for ours) whole, and resumed mid-epoch from a ``state_dict`` in a new engine;
  here each loader's resumed run is compared with its own uninterrupted run, and the two
  loaders' orders with each other;
* ``checkpoint``: ArenaLoader only: ignite's ``Checkpoint`` handler saves the loader beside
  the engine, model and optimizer each iteration; a new set (RNGs reseeded elsewhere) loads
  the checkpoint after iteration 5 (an epoch's end) or 7 (mid-epoch) and runs to the end:
  equal to the uninterrupted run? (torch's DataLoader has no ``state_dict`` to save.)
"""

from __future__ import annotations

import common
import torch
from common import CONFIGS, Tally, describe, error, first_difference, shm_names, wants
from ignite.engine import DeterministicEngine, Engine, Events
from torch.utils.data import DataLoader

from arena_loader import ArenaLoader


class Trainer:
    def __init__(self, engine_cls=Engine):
        self.model = common.model()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.5)
        self.batches: list = []
        self.losses: list = []
        self.engine = engine_cls(self.step)

    def step(self, engine, batch):
        self.batches.append(describe(batch))
        x, y = torch.as_tensor(batch["x"]), torch.as_tensor(batch["y"])
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.losses.append(round(loss.item(), 6))
        return loss.item()

    def result(self) -> dict:
        s = self.engine.state
        return {"batches": self.batches, "losses": self.losses,
                "state": (s.iteration, s.epoch, s.epoch_length)}


def make(loader_cls, options, extra, generator, dataset_cls=common.Tensors):
    kw = dict(options, **extra, batch_size=8, shuffle=True)
    if generator:
        kw["generator"] = torch.Generator().manual_seed(7)
    return loader_cls(dataset_cls(), **kw)


def scenario(kind: str, loader_cls, options, extra, generator, dataset_cls) -> dict:
    common.seed_all()
    loader = make(loader_cls, options, extra, generator, dataset_cls)
    t = Trainer(DeterministicEngine if kind.startswith("deterministic") else Engine)
    out: dict = {}
    try:
        if kind in ("whole", "deterministic"):
            t.engine.run(loader, max_epochs=3)
        elif kind.startswith("epoch_length"):
            t.engine.run(loader, max_epochs=3, epoch_length=int(kind.split("=")[1]))
        elif kind.startswith("evaluator"):  # an evaluator over the same loader each epoch
            evaluator = Engine(lambda e, b: t.batches.append(("eval", describe(b))))
            t.engine.add_event_handler(Events.EPOCH_COMPLETED, lambda e: evaluator.run(loader))
            length = kind.partition("=")[2]
            t.engine.run(loader, max_epochs=3, epoch_length=int(length) if length else None)
        elif kind == "terminate_epoch":
            t.engine.add_event_handler(Events.ITERATION_COMPLETED(once=7),
                                       lambda e: e.terminate_epoch())
            t.engine.run(loader, max_epochs=3)
        elif kind == "interrupt":
            t.engine.add_event_handler(Events.ITERATION_COMPLETED(once=7),
                                       lambda e: e.interrupt())
            t.engine.run(loader, max_epochs=3)
            out["at"] = t.engine.state.iteration
            t.engine.run(loader, max_epochs=3)
        elif kind in ("resume", "deterministic-resume"):
            stop_at = 5 if kind == "resume" else 7  # an epoch's end; mid-epoch 2
            t.engine.add_event_handler(Events.ITERATION_COMPLETED(once=stop_at),
                                       lambda e: e.interrupt())
            t.engine.run(loader, max_epochs=3)
            state = t.engine.state_dict()
            # a new process: the plain Engine's resume must not depend on the global RNGs;
            # DeterministicEngine draws its seed from torch's at the start of each run(), so
            # its user seeds the restarted script as the first run was seeded
            common.seed_all(common.SEED + (99 if kind == "resume" else 0))
            fresh = make(loader_cls, options, extra, generator, dataset_cls)
            t2 = Trainer(type(t.engine))
            t2.model.load_state_dict(t.model.state_dict())
            t2.opt.load_state_dict(t.opt.state_dict())
            t2.batches, t2.losses = t.batches, t.losses
            t2.engine.load_state_dict(state)
            t2.engine.run(fresh, max_epochs=3)
            if hasattr(fresh, "close"):
                fresh.close()
            t = t2
        out.update(t.result())
    except Exception as exc:
        out["error"] = error(exc)
        out.update(t.result())
    if hasattr(loader, "close"):
        loader.close()
    return out


def checkpointed(options, extra, generator, cut: int) -> dict:
    """ArenaLoader only: ignite's ``Checkpoint`` saves the engine, model, optimizer and the
    loader (it has ``state_dict``; torch's DataLoader has none) every iteration; a new set of
    them (the global RNGs reseeded elsewhere) loads ``checkpoint_{cut}`` with
    ``Checkpoint.load_objects`` and runs to the end: the batches and losses after the cut
    against the uninterrupted run's."""
    import tempfile

    from ignite.handlers import Checkpoint, DiskSaver

    common.seed_all()
    loader = make(ArenaLoader, options, extra, generator)
    t = Trainer()
    with tempfile.TemporaryDirectory(prefix="trial19-") as tmp:
        objects = {"trainer": t.engine, "model": t.model, "opt": t.opt, "loader": loader}
        t.engine.add_event_handler(Events.ITERATION_COMPLETED, Checkpoint(
            objects, DiskSaver(tmp, require_empty=False), n_saved=None))
        t.engine.run(loader, max_epochs=3)
        whole = t.result()
        loader.close()
        common.seed_all(common.SEED + 99)
        fresh = make(ArenaLoader, options, extra, generator)
        t2 = Trainer()
        objects = {"trainer": t2.engine, "model": t2.model, "opt": t2.opt, "loader": fresh}
        path = f"{tmp}/checkpoint_{cut}.pt"
        Checkpoint.load_objects(objects, path)
        t2.engine.run(fresh, max_epochs=3)
        fresh.close()
    got = t2.result()
    whole["batches"], whole["losses"] = whole["batches"][cut:], whole["losses"][cut:]
    return {"whole": whole, "resumed": got}


KINDS = ("whole", "epoch_length=3", "epoch_length=7", "terminate_epoch", "interrupt", "resume",
         "evaluator", "evaluator-epoch_length=3")


def main() -> None:
    tally = Tally()
    for config, options in CONFIGS.items():
        for generator in (False, True):
            g = "gen" if generator else "global"
            for dataset_cls, outputs in ((common.Tensors, (None,)),
                                         (common.Arrays, (None, "torch"))):
                for output in outputs:
                    extra = {"output": output} if output else {}
                    for kind in KINDS:
                        name = (f"ignite/{kind}/{dataset_cls.__name__}/{config}/{g}/"
                                f"output={output}")
                        if not wants(name):
                            continue
                        before = shm_names()
                        want = scenario(kind, DataLoader, options, {}, generator, dataset_cls)
                        got = scenario(kind, ArenaLoader, options, extra, generator,
                                       dataset_cls)
                        tally.check(name, want, got, before,
                                    f"{len(got['batches'])} batches {got.get('error', '')}")
            for cut in (5, 7):
                name = f"ignite/checkpoint-{cut}/{config}/{g}"
                if wants(name):
                    before = shm_names()
                    try:
                        r = checkpointed(options, {}, generator, cut)
                        tally.check(name + "/resumed=whole", r["whole"], r["resumed"], before)
                    except Exception as exc:
                        tally.add("MISMATCH", name, error(exc))
            name = f"ignite/deterministic/{config}/{g}"
            if not wants(name):
                continue
            before = shm_names()
            runs = {}
            for cls in (DataLoader, ArenaLoader):
                for kind in ("deterministic", "deterministic-resume"):
                    extra = {"output": "torch"} if cls is ArenaLoader else {}
                    runs[cls.__name__, kind] = scenario(kind, cls, options, extra, generator,
                                                        common.Tensors)
            for cls in ("DataLoader", "ArenaLoader"):
                whole, resumed = runs[cls, "deterministic"], runs[cls, "deterministic-resume"]
                if whole != resumed and "error" not in resumed:
                    # ignite's own (README): a resumed epoch of a loader that is not a torch
                    # DataLoader is reseeded with epoch 0's seed (_from_iteration calls
                    # _setup_seed(iteration=0)); torch's goes through its
                    # ReproducibleBatchSampler and differs too, except with 2 workers
                    tally.add("ignite", f"{name}/{cls}-resume!=whole",
                              first_difference(whole, resumed))
                    continue
                tally.check(f"{name}/{cls}-resume=whole", whole, resumed, before,
                            resumed.get("error", ""))
            tally.check(f"{name}/torch=arena", runs["DataLoader", "deterministic"],
                        runs["ArenaLoader", "deterministic"], before)
    tally.done()


if __name__ == "__main__":
    main()
