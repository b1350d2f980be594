"""Scenario 5: Hugging Face datasets (numpy/torch formats, set_transform, padding collate)."""

import os
import sys

import numpy as np
import torch
from datasets import Dataset

sys.path.insert(0, os.path.dirname(__file__))
from common import compare, report_end, seeded, shm, variants  # noqa: E402

N = 26


def make():
    rng = np.random.default_rng(0)
    return Dataset.from_dict({
        "ids": [list(rng.integers(1, 100, 2 + i % 5)) for i in range(N)],
        "label": [i % 3 for i in range(N)],
        "text": [f"text {i}" for i in range(N)],
        "feat": [rng.random(4).astype(np.float32).tolist() for _ in range(N)],
        "score": [float(i) / 3 for i in range(N)],
    })


def pad_np(batch):
    L = max(len(r["ids"]) for r in batch)
    ids = np.zeros((len(batch), L), np.int64)
    mask = np.zeros((len(batch), L), np.bool_)
    for k, r in enumerate(batch):
        ids[k, :len(r["ids"])] = r["ids"]
        mask[k, :len(r["ids"])] = True
    return {"ids": ids, "mask": mask, "label": np.array([r["label"] for r in batch]),
            "text": [str(r["text"]) for r in batch]}


def pad_torch(batch):
    from torch.nn.utils.rnn import pad_sequence
    return {"ids": pad_sequence([r["ids"] for r in batch], batch_first=True),
            "label": torch.stack([r["label"] for r in batch]), "text": [r["text"] for r in batch]}


def transform(b):
    return {"ids_len": [len(x) for x in b["ids"]], "label": b["label"],
            "feat": [np.asarray(f, np.float32) * 2 for f in b["feat"]]}


if __name__ == "__main__":
    before = shm()
    ds = make()
    np_ds = ds.with_format("numpy")
    t_ds = ds.with_format("torch")
    fixed_np = ds.with_format("numpy", columns=["label", "feat", "score"])
    fixed_t = ds.with_format("torch", columns=["label", "feat", "score"])
    tr = make()
    tr.set_transform(transform)
    base = dict(batch_size=4, shuffle=True)
    for tag, kw in variants(base):
        compare(f"5 numpy pad collate {tag}", np_ds, seeded(dict(kw, collate_fn=pad_np)))
        compare(f"5 torch pad collate {tag}", t_ds, seeded(dict(kw, collate_fn=pad_torch)))
        compare(f"5 numpy fixed default {tag}", fixed_np, seeded(kw), extra={"output": "torch"})
        compare(f"5 torch fixed default {tag}", fixed_t, seeded(kw))
        compare(f"5 set_transform default {tag}", tr, seeded(kw), extra={"output": "torch"})
        compare(f"5 plain (python) format fixed {tag}", ds.select_columns(["label", "feat", "score", "text"]),
                seeded(kw), extra={"output": "torch"})
    compare("5 numpy ragged default nw=0", np_ds, seeded(dict(base, num_workers=0)), extra={"output": "torch"})
    compare("5 torch fixed drop_last nw=2", fixed_t, seeded(dict(base, num_workers=2, drop_last=True)))
    compare("5 torch fixed batch_size=None nw=2", fixed_t, seeded(dict(batch_size=None, num_workers=2)))
    report_end(before)
