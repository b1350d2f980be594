"""transformers 5.24 ``Trainer`` (CPU, a 4-8-3 MLP, 40 samples in batches of 8, 2 epochs) with a
subclass whose ``get_train_dataloader`` / ``get_eval_dataloader`` return a loader built the
same way, once ``torch.utils.data.DataLoader`` and once ``ArenaLoader`` (the one import a user
changes); compared: every batch the model's ``forward`` gets (its sample ids, in order; the
types of its inputs), the Trainer's ``log_history`` (loss per step, eval_loss, epochs) and the
final weights; then leftovers. Cases:

* ``train``: ``train()`` then ``evaluate()`` (the Trainer's ``default_data_collator`` as
  ``collate_fn``, or the loader's default collation; ``gradient_accumulation_steps`` 1 and 2;
  ``dataloader_num_workers`` 0 / 2, ``dataloader_persistent_workers``);
* ``resume``: ``train()`` with a checkpoint every step, then a new Trainer resumes from
  ``checkpoint-3`` and ``checkpoint-5`` (mid-epoch or an epoch's end, by the accumulation
  steps; mid-epoch the Trainer calls accelerate's ``skip_first_batches`` on the loader): the
  resumed run's batches and losses from the checkpoint on, against the uninterrupted run of
  the same loader, and torch's against ours.
* ``stock``: the stock Trainer (its own torch DataLoader, ``use_seedable_sampler`` off)
  against the ArenaLoader subclass, as a user who had no subclass sees it.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

import common
import numpy as np
import torch
import transformers
from common import Tally, error, shm_names, wants
from torch.utils.data import DataLoader

from arena_loader import ArenaLoader

transformers.logging.set_verbosity_error()
logging.getLogger("accelerate").setLevel(logging.ERROR)
SEEN: list = []


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = common.model()

    def forward(self, x, labels, i=None):
        SEEN.append((type(x).__name__, [int(v) for v in i], self.training))
        logits = self.net(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


class Rows(common.Tensors):
    def __getitem__(self, i):
        s = super().__getitem__(i)
        return {"i": s["i"], "x": s["x"], "labels": s["y"]}


def trainer_cls(loader_cls):
    if loader_cls is None:
        return transformers.Trainer

    class Switched(transformers.Trainer):
        def _loader(self, dataset, batch_size, shuffle):
            a = self.args
            kw = dict(batch_size=batch_size, shuffle=shuffle,
                      num_workers=a.dataloader_num_workers,
                      persistent_workers=a.dataloader_persistent_workers,
                      drop_last=a.dataloader_drop_last)
            if self.options.get("collator"):
                kw["collate_fn"] = self.data_collator
            if loader_cls is ArenaLoader:
                kw["output"] = "torch"
            return loader_cls(dataset, **kw)

        def get_train_dataloader(self):
            return self._loader(self.train_dataset, self._train_batch_size, True)

        def get_eval_dataloader(self, eval_dataset=None):
            return self._loader(eval_dataset or self.eval_dataset, self.args.eval_batch_size,
                                False)

    return Switched


def make(loader_cls, options: dict, out_dir: str, **args):
    common.seed_all()
    targs = transformers.TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=8, per_device_eval_batch_size=8,
        num_train_epochs=2, learning_rate=0.3, optim="sgd", lr_scheduler_type="constant",
        logging_steps=1, report_to="none", use_cpu=True, disable_tqdm=True, seed=42,
        accelerator_config={"use_seedable_sampler": False},
        dataloader_num_workers=options.get("num_workers", 0),
        dataloader_persistent_workers=options.get("persistent_workers", False),
        gradient_accumulation_steps=options.get("accum", 1), **{"save_strategy": "no", **args})
    cls = trainer_cls(loader_cls)
    cls.options = options
    trainer = cls(model=Model(), args=targs, train_dataset=Rows(), eval_dataset=Rows(20))
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
    return trainer


def summary(trainer) -> dict:
    logs = [{k: round(v, 5) if isinstance(v, float) else v for k, v in e.items()
             if k in ("loss", "eval_loss", "epoch", "step")} for e in trainer.state.log_history]
    weights = [round(v, 5) for p in trainer.model.parameters() for v in p.flatten().tolist()]
    return {"seen": list(SEEN), "logs": logs, "weights": weights}


def train(loader_cls, options: dict) -> dict:
    SEEN.clear()
    out_dir = tempfile.mkdtemp(prefix="trial19-")
    try:
        trainer = make(loader_cls, options, out_dir)
        trainer.train()
        trainer.evaluate()
        return summary(trainer)
    except Exception as exc:
        return {"error": error(exc), "seen": list(SEEN)}
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def resume(loader_cls, options: dict, checkpoint: int) -> dict:
    """The uninterrupted run's batches and logs from ``checkpoint`` on, and the resumed
    run's."""
    out_dir = tempfile.mkdtemp(prefix="trial19-")
    try:
        SEEN.clear()
        trainer = make(loader_cls, options, out_dir, save_strategy="steps", save_steps=1)
        trainer.train()
        whole = summary(trainer)
        del trainer
        SEEN.clear()
        trainer = make(loader_cls, options, out_dir, save_strategy="no")
        trainer.train(resume_from_checkpoint=os.path.join(out_dir, f"checkpoint-{checkpoint}"))
        got = summary(trainer)
        whole["seen"] = whole["seen"][len(whole["seen"]) - len(got["seen"]):]
        whole["logs"] = [e for e in whole["logs"] if e.get("step", 0) > checkpoint]
        got["logs"] = [e for e in got["logs"] if e.get("step", 0) > checkpoint]
        return {"whole": whole, "resumed": got}
    except Exception as exc:
        return {"error": error(exc)}
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


CONFIGS = {
    "nw0": dict(num_workers=0),
    "nw2": dict(num_workers=2),
    "nw2-persist": dict(num_workers=2, persistent_workers=True),
    "nw0-collator": dict(num_workers=0, collator=True),
    "nw2-collator": dict(num_workers=2, collator=True),
    "nw0-accum2": dict(num_workers=0, accum=2),
    "nw2-persist-accum2": dict(num_workers=2, persistent_workers=True, accum=2),
}


def strip_eval(run: dict) -> dict:
    return {**run, "logs": [{k: v for k, v in e.items() if k != "eval_loss"}
                            for e in run.get("logs", [])]}


def eval_losses(run: dict) -> list:
    return [e["eval_loss"] for e in run.get("logs", []) if "eval_loss" in e]


def main() -> None:
    tally = Tally()
    for config, options in CONFIGS.items():
        name = f"trainer/train/{config}"
        if wants(name):
            before = shm_names()
            want = train(DataLoader, options)
            got = train(ArenaLoader, options)
            tally.check(name, want, got, before,
                        f"{len(got['seen'])} forward calls {got.get('error', '')}")
        name = f"trainer/stock/{config}"
        if wants(name) and not options.get("collator"):
            before = shm_names()
            want = train(None, options)
            got = train(ArenaLoader, options)
            if strip_eval(want) == strip_eval(got) and want != got:
                # documented (docs/migrating.md): not an accelerate-prepared loader, so the
                # Trainer's eval_loss weighs the short last eval batch (4 of 20) as a full one
                tally.add("known", name, "training equal; eval_loss differs "
                          f"({eval_losses(want)} vs {eval_losses(got)})")
                continue
            tally.check(name, want, got, before, got.get("error", ""))
    for config in ("nw0", "nw2", "nw2-persist-accum2"):
        for checkpoint in (3, 5):
            name = f"trainer/resume-{checkpoint}/{config}"
            if not wants(name):
                continue
            before = shm_names()
            runs = {cls.__name__: resume(cls, CONFIGS[config], checkpoint)
                    for cls in (DataLoader, ArenaLoader)}
            if any("error" in r for r in runs.values()):
                tally.add("MISMATCH", name, str([r.get("error") for r in runs.values()]))
                continue
            torch_run, arena_run = runs["DataLoader"], runs["ArenaLoader"]
            if torch_run["whole"] != torch_run["resumed"] and \
                    torch_run["resumed"] == arena_run["resumed"]:
                # the Trainer's own: its resume differs from its uninterrupted run with
                # torch's DataLoader too, and ours resumes exactly as torch's does
                tally.add("trainer", f"{name}/resumed!=whole", "torch's and ours alike")
            else:
                for cls, r in runs.items():
                    tally.check(f"{name}/{cls}-resumed=whole", r["whole"], r["resumed"], set())
            tally.check(f"{name}/torch=arena", torch_run["resumed"], arena_run["resumed"],
                        before)
    tally.done()


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
