"""Samplers from pytorch-metric-learning 2.9 and sentence-transformers 6.2 with torch's DataLoader
and ArenaLoader, the other options alike.

* ``pml``: ``MPerClassSampler`` (as ``sampler=``, numpy's global RNG) and ``HierarchicalSampler``
  (as ``batch_sampler=``) over 48 samples in 4 classes; a 4-8 embedding trained with
  ``TripletMarginLoss`` and a ``MultiSimilarityMiner``, 2 epochs: every batch (types, values,
  order) and each step's loss and mined-pair count;
* ``st``: sentence-transformers' ``GroupByLabelBatchSampler`` and ``NoDuplicatesBatchSampler``
  (their own ``generator`` reseeded from ``seed + epoch``; the user calls ``set_epoch``) as
  ``batch_sampler=`` over a Hugging Face ``datasets.Dataset`` of text pairs and labels (plain,
  and ``with_format("torch")``), 3 epochs: every batch, with the loader's default collation
  and with a collate_fn shaped as sentence-transformers' (texts per column, a label tensor).
"""

from __future__ import annotations

import common
import datasets
import numpy as np
import torch
from common import CONFIGS, Tally, describe, error, shm_names, wants
from pytorch_metric_learning import losses, miners, samplers
from sentence_transformers.base.sampler import GroupByLabelBatchSampler, NoDuplicatesBatchSampler
from torch.utils.data import DataLoader

from arena_loader import ArenaLoader

datasets.disable_progress_bars()
N = 48


class Labelled(common.Tensors):
    def __getitem__(self, i):
        s = super().__getitem__(i)
        s["y"] = torch.tensor(int(i) % 4)
        return s


class LabelledArrays(Labelled):
    def __getitem__(self, i):
        s = super().__getitem__(i)
        return {"i": int(s["i"]), "x": s["x"].numpy(), "y": int(s["y"])}


LABELS = np.arange(N) % 4
SUPER = np.stack([LABELS // 2, LABELS], axis=1)  # HierarchicalSampler: (super, sub) label pairs


def pml_kwargs(kind: str) -> dict:
    if kind == "MPerClass":
        return {"sampler": samplers.MPerClassSampler(LABELS, m=4, batch_size=8,
                                                     length_before_new_iter=N),
                "batch_size": 8}
    return {"batch_sampler": samplers.HierarchicalSampler(
        SUPER, batch_size=8, samples_per_class=2, batches_per_super_tuple=3,
        super_classes_per_batch=2)}


def pml_run(loader_cls, kind, options, extra, dataset_cls) -> dict:
    common.seed_all()
    torch.manual_seed(common.SEED)
    embed = torch.nn.Linear(4, 8)
    opt = torch.optim.SGD(embed.parameters(), lr=0.1)
    loss_fn, miner = losses.TripletMarginLoss(margin=0.1), miners.MultiSimilarityMiner(0.1)
    out: dict = {"batches": [], "losses": [], "mined": []}
    loader = loader_cls(dataset_cls(N), **pml_kwargs(kind), **options, **extra)
    try:
        for _ in range(2):
            for batch in loader:
                out["batches"].append(describe(batch))
                emb = embed(torch.as_tensor(batch["x"]))
                labels = torch.as_tensor(batch["y"])
                pairs = miner(emb, labels)
                loss = loss_fn(emb, labels, pairs)
                opt.zero_grad()
                loss.backward()
                opt.step()
                out["losses"].append(round(loss.item(), 6))
                out["mined"].append(sum(len(p) for p in pairs))
    except Exception as exc:
        out["error"] = error(exc)
    if hasattr(loader, "close"):
        loader.close()
    return out


def st_dataset(fmt: str | None):
    rows = {"anchor": [f"question {i}" for i in range(N)],
            "positive": [f"answer {i % 20}" for i in range(N)],  # duplicates across rows
            "label": [i % 4 for i in range(N)]}
    ds = datasets.Dataset.from_dict(rows)
    return ds.with_format(fmt) if fmt else ds


def st_collate(rows: list[dict]) -> dict:
    """sentence-transformers' collator's shape (without a tokenizer): texts per column, and
    the labels as a tensor."""
    out = {col: [r[col] for r in rows] for col in ("anchor", "positive")}
    out["label"] = torch.tensor([int(r["label"]) for r in rows])
    return out


def st_run(loader_cls, kind, fmt, collate, options, extra) -> dict:
    common.seed_all()
    ds = st_dataset(fmt)
    cls = {"GroupByLabel": GroupByLabelBatchSampler, "NoDuplicates": NoDuplicatesBatchSampler}
    try:
        bs = cls[kind](ds, batch_size=8, drop_last=False, valid_label_columns=["label"],
                       generator=torch.Generator(), seed=12)
    except ValueError as exc:  # GroupByLabel over torch-format labels: each tensor a label
        return {"error": error(exc)}
    kw = dict(options, **extra, batch_sampler=bs)
    if collate:
        kw["collate_fn"] = st_collate
    loader = loader_cls(ds, **kw)
    out: dict = {"epochs": []}
    try:
        for epoch in range(3):
            bs.set_epoch(epoch)
            out["epochs"].append([describe(b) for b in loader])
            out.setdefault("lens", []).append(len(loader))
    except Exception as exc:
        out["error"] = error(exc)
    if hasattr(loader, "close"):
        loader.close()
    return out


def main() -> None:
    tally = Tally()
    for config, options in CONFIGS.items():
        for kind in ("MPerClass", "Hierarchical"):
            for dataset_cls, outputs in ((Labelled, (None,)), (LabelledArrays, (None, "torch"))):
                for output in outputs:
                    name = f"pml/{kind}/{dataset_cls.__name__}/{config}/output={output}"
                    if not wants(name):
                        continue
                    before = shm_names()
                    extra = {"output": output} if output else {}
                    want = pml_run(DataLoader, kind, options, {}, dataset_cls)
                    got = pml_run(ArenaLoader, kind, options, extra, dataset_cls)
                    tally.check(name, want, got, before,
                                f"{len(got['batches'])} batches {got.get('error', '')}")
        for kind in ("GroupByLabel", "NoDuplicates"):
            for fmt in (None, "torch"):
                for collate in (False, True):
                    for output in (None, "torch"):
                        name = (f"st/{kind}/format={fmt}/{'collate' if collate else 'default'}"
                                f"/{config}/output={output}")
                        if not wants(name):
                            continue
                        before = shm_names()
                        extra = {"output": output} if output else {}
                        want = st_run(DataLoader, kind, fmt, collate, options, {})
                        got = st_run(ArenaLoader, kind, fmt, collate, options, extra)
                        n = sum(map(len, got.get("epochs", [])))
                        tally.check(name, want, got, before,
                                    f"{n} batches {got.get('error', '')}")
    tally.done()


if __name__ == "__main__":
    main()
