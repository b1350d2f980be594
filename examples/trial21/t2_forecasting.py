"""pytorch-forecasting 1.8 ``TimeSeriesDataSet``: its ``to_dataloader`` (torch's DataLoader)
against ``ArenaLoader(ts, batch_size=..., collate_fn=TimeSeriesDataSet._collate_fn, ...)``,
as a user would write it (README.md).

A batch is ``(x: dict of padded tensors, (target, weight))``; ``weight`` is ``None`` without a
weight column, ``target`` and ``x["target_scale"]`` are lists of tensors with two targets, and
``randomize_length`` draws each sample's encoder length from torch's RNG in ``__getitem__``
(in a worker, the worker's seed). The ``train`` cases fit a small ``DecoderMLP`` with
Lightning's Trainer (2 epochs) and compare each step's loss, the weights and the
predictions of ``model.predict(loader)``.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from functools import partial

import lightning.pytorch as pl
import numpy as np
import pandas as pd
import torch
from pytorch_forecasting import DecoderMLP, TimeSeriesDataSet
from pytorch_forecasting.data import GroupNormalizer, MultiNormalizer
from pytorch_forecasting.data.samplers import TimeSynchronizedBatchSampler
from torch.utils.data import SequentialSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CONFIGS, SEED, Tally, describe, error, seed_all, shm_names, stop_torch, wants

from arena_loader import ArenaLoader

warnings.filterwarnings("ignore", module="lightning")
warnings.filterwarnings("ignore", module="pytorch_forecasting")
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
B = 8


def frame() -> pd.DataFrame:
    """6 series of 20-28 steps: two targets, a weight, a known categorical, a real."""
    rng = np.random.default_rng(0)
    rows = []
    for s in range(6):
        for t in range(20 + 2 * s):
            rows.append(dict(series=f"s{s}", time_idx=t, value=np.sin(t / 3 + s) + s,
                             other=np.cos(t / 4) * (s + 1), w=1.0 + (t % 3),
                             weekday=str(t % 7), temp=rng.normal()))
    df = pd.DataFrame(rows)
    df["weekday"] = df["weekday"].astype("category")
    return df


def dataset(kind: str, df: pd.DataFrame) -> TimeSeriesDataSet:
    args = dict(time_idx="time_idx", target="value", group_ids=["series"],
                max_encoder_length=8, min_encoder_length=3, max_prediction_length=4,
                min_prediction_length=1, static_categoricals=["series"],
                time_varying_known_categoricals=["weekday"], time_varying_known_reals=["temp"],
                time_varying_unknown_reals=["value"],
                target_normalizer=GroupNormalizer(groups=["series"]),
                add_relative_time_idx=True, add_target_scales=True, add_encoder_length=True)
    if kind == "weighted":
        args["weight"] = "w"
    if kind == "random":
        args["randomize_length"] = True
    if kind == "multi":
        args.update(target=["value", "other"], time_varying_unknown_reals=["value", "other"],
                    target_normalizer=MultiNormalizer([GroupNormalizer(groups=["series"])] * 2))
    return TimeSeriesDataSet(df, **args)


# --- runs --------------------------------------------------------------------------------------
class Losses(pl.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(round(float(outputs["loss"]), 6))


def one_target(batch) -> bool:
    """``x["decoder_target"]`` holds the tensors of ``y[0]`` themselves, as ``_collate_fn``
    made them (a list of them with two targets: its own list with ArenaLoader, the same list
    object with torch's; docs/migrating.md)."""
    here, there = batch[0]["decoder_target"], batch[1][0]
    if isinstance(here, list):
        return len(here) == len(there) and all(a is b for a, b in zip(here, there))
    return here is there


def nan_safe(value):
    """Predictions past a short series' end are NaN: compared as the string "nan"."""
    if isinstance(value, float) and value != value:
        return "nan"
    if isinstance(value, dict):
        return {k: nan_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [nan_safe(v) for v in value]
    return value


def run(make, epochs=2, train=False, make_val=None):
    """Read ``epochs`` epochs and describe every batch; ``train``: fit a DecoderMLP instead
    (Lightning iterates; ``make_val``'s loader validates each epoch and is then given to
    ``model.predict`` with x, y and index returned) and compare losses, validation loss,
    weights and predictions."""
    seed_all()
    out = {}
    loader = val = None
    try:
        loader, ts = make()
        if not train:
            out["batches"] = [(describe(b), one_target(b)) for _ in range(epochs) for b in loader]
        else:
            pl.seed_everything(SEED, verbose=False)
            model = DecoderMLP.from_dataset(ts, hidden_size=8, n_hidden_layers=1,
                                            learning_rate=0.05)
            losses = Losses()
            trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False,
                                 enable_model_summary=False, callbacks=[losses],
                                 num_sanity_val_steps=0)
            val = make_val()[0]
            trainer.fit(model, train_dataloaders=loader, val_dataloaders=val)
            out["losses"] = losses.losses
            out["val_loss"] = round(float(trainer.callback_metrics["val_loss"]), 6)
            out["weights"] = [p.detach().round(decimals=5).tolist() for p in model.parameters()]
            got = model.predict(val, return_x=True, return_y=True, return_index=True,
                                trainer_kwargs={"logger": False})
            out["predict"] = nan_safe(describe({"output": got.output, "x": got.x, "y": got.y,
                                                "index": got.index.to_dict("list")}))
    except Exception as exc:  # an error is a result to compare
        out["error"] = error(exc)
    finally:
        loader, val = stop_torch(loader), stop_torch(val)
    out["rng"] = torch.rand(1).item()
    return out


def torch_loader(ts, train, sampler=None, generator=None, **cfg):
    if generator == "seed 7":
        generator = torch.Generator().manual_seed(7)
    if generator is not None:
        cfg["generator"] = generator
    return ts.to_dataloader(train=train, batch_size=B, batch_sampler=sampler, **cfg), ts


def arena_loader(ts, train, sampler=None, generator=None, **cfg):
    """What the user writes for ``ts.to_dataloader(train=..., batch_size=B, **cfg)``."""
    if generator == "seed 7":
        generator = torch.Generator().manual_seed(7)
    if sampler == "synchronized":
        batch_sampler = TimeSynchronizedBatchSampler(SequentialSampler(ts), batch_size=B,
                                                     shuffle=train, drop_last=train)
        return ArenaLoader(ts, batch_sampler=batch_sampler, collate_fn=ts._collate_fn,
                           generator=generator, **cfg), ts
    return ArenaLoader(ts, batch_size=B, shuffle=train, drop_last=train and len(ts) > B,
                       collate_fn=TimeSeriesDataSet._collate_fn, generator=generator,
                       **cfg), ts


def compare(tally, name, ts, **kw):
    if not wants(name):
        return
    train = kw.pop("fit", False)
    val = {**kw, "train": False}
    want = run(partial(torch_loader, ts, **kw), train=train,
               make_val=partial(torch_loader, ts, **val))
    before = shm_names()
    got = run(partial(arena_loader, ts, **kw), train=train,
              make_val=partial(arena_loader, ts, **val))
    note = (f"{len(want.get('batches', want.get('losses', [])))} "
            f"{'steps' if train else 'batches'}" + (f", {want['error']}" if "error" in want
                                                   else ""))
    tally.check(name, want, got, before, note)


def main() -> None:
    tally = Tally()
    df = frame()
    sets = {kind: dataset(kind, df) for kind in ("plain", "weighted", "random", "multi")}
    sets["predict"] = TimeSeriesDataSet.from_dataset(sets["plain"], df, predict=True)
    for cname, cfg in CONFIGS.items():
        for kind, ts in sets.items():
            compare(tally, f"{kind}-train-{cname}", ts, train=True, **cfg)
            compare(tally, f"{kind}-train-{cname}-gen", ts, train=True, generator="seed 7",
                    **cfg)
            compare(tally, f"{kind}-val-{cname}", ts, train=False, **cfg)
        compare(tally, f"synchronized-{cname}", sets["plain"], train=True,
                sampler="synchronized", **cfg)
        for kind in ("plain", "weighted", "multi", "random"):
            compare(tally, f"fit-{kind}-{cname}", sets[kind], train=True, fit=True, **cfg)
    for kind in ("plain", "multi"):        # spawn-started workers: the dataset pickled
        compare(tally, f"{kind}-train-spawn", sets[kind], train=True, num_workers=2,
                multiprocessing_context="spawn")
    tally.done()


if __name__ == "__main__":
    main()
