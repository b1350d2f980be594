"""Scenario 5: Hugging Face ``datasets``. ``Dataset.to_iterable_dataset(num_shards=...)`` with
``with_format("torch")``, ``.map``, ``.shuffle(seed=..., buffer_size=...)`` with and without
``set_epoch`` per epoch (its epoch lives in a torch shared-memory tensor so persistent workers
see it), ``.batch(4)`` with the loader's ``batch_size=None``, fewer shards than workers,
``datasets.distributed.split_dataset_by_node``, and the map-style ``Dataset`` (its
``__getitems__``) with a seeded shuffle and a padding collate."""

import os
import sys
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
import datasets
from common import compare, compare_resume, report_end, seeded, shm, variants
from datasets.distributed import split_dataset_by_node

warnings.simplefilter("ignore")
datasets.disable_progress_bars()
datasets.logging.set_verbosity_error()
N = 40
rng = np.random.default_rng(7)
DATA = {
    "x": [rng.standard_normal(3).astype(np.float32).tolist() for _ in range(N)],
    "tokens": [rng.integers(1, 300, 2 + i % 7).tolist() for i in range(N)],
    "label": [i % 3 for i in range(N)],
    "id": [f"row{i}" for i in range(N)],
}
BASE = datasets.Dataset.from_dict(DATA)


def add_length(row):
    return {"length": len(row["tokens"])}


def pad_collate(batch):
    n = max(len(b["tokens"]) for b in batch)
    ids = torch.zeros(len(batch), n, dtype=torch.long)
    for j, b in enumerate(batch):
        ids[j, : len(b["tokens"])] = torch.as_tensor(b["tokens"])
    return {
        "input_ids": ids,
        "attention_mask": ids != 0,
        "labels": torch.tensor([int(b["label"]) for b in batch]),
        "ids": [b["id"] for b in batch],
    }


def iterable(num_shards=4, shuffle=False, fmt="torch", split=None, batch=None):
    def make():
        ds = BASE.to_iterable_dataset(num_shards=num_shards).map(add_length)
        if shuffle:
            ds = ds.shuffle(seed=42, buffer_size=8)
        if split:
            ds = split_dataset_by_node(ds, rank=split[0], world_size=split[1])
        if batch:
            ds = ds.batch(batch)
        return ds.with_format(fmt) if fmt else ds

    return make


def fixed_fields(row):
    return {"x": row["x"], "label": row["label"], "length": row["length"]}


def set_epoch(loader, ds, epoch):
    ds.set_epoch(epoch)


def kwargs(kw):
    def make():
        return dict(kw, generator=torch.Generator().manual_seed(8))

    return make


def cases(kw):
    """(name, dataset factory, loader kwargs, compare options) for one worker setting."""
    bs4 = dict(kw, batch_size=4)
    padded = kwargs(dict(bs4, collate_fn=pad_collate))
    shuffled = iterable(shuffle=True, fmt=None)
    yield ("iterable torch format default collate",
           lambda: iterable()().select_columns(["x", "label", "length"]), kwargs(bs4), {})
    yield "iterable pad collate", iterable(fmt=None), padded, {}
    yield "shuffle(seed, buffer) set_epoch", shuffled, padded, {"on_epoch": set_epoch}
    yield "shuffle(seed, buffer) no set_epoch", shuffled, padded, {}
    yield "num_shards=1 (fewer than workers)", iterable(num_shards=1, fmt=None), padded, {}
    yield ("split_dataset_by_node rank 1/2 shuffled",
           iterable(shuffle=True, fmt=None, split=(1, 2)), padded, {"on_epoch": set_epoch})
    yield (".batch(4) bs=None torch format",
           lambda: iterable(batch=4)().select_columns(["x", "label", "id"]),
           kwargs(dict(kw, batch_size=None)), {})
    yield ("break after 3 batches set_epoch", shuffled, padded,
           {"on_epoch": set_epoch, "steps": 3})
    sh = dict(kw, shuffle=True, batch_size=5)
    yield ("map-style Dataset __getitems__ pad collate", lambda: BASE,
           seeded(dict(sh, collate_fn=pad_collate)), {})
    yield ("map-style torch format default collate",
           lambda: BASE.select_columns(["x", "label"]).with_format("torch"), seeded(sh), {})
    yield ("map-style numpy format default collate",
           lambda: BASE.select_columns(["x", "label"]).with_format("numpy"), seeded(sh),
           {"extra": {"output": "torch"}})


def resume_cases(kw):
    """HF's IterableDataset has state_dict()/load_state_dict(): called per batch."""
    padded = kwargs(dict(kw, batch_size=4, collate_fn=pad_collate))
    for k in (1, 4):
        for shuffle in (False, True):
            yield f"after {k} iterable shuffle={shuffle}", iterable(shuffle=shuffle, fmt=None), \
                padded, k, {}
    yield "after 3 set_epoch", iterable(shuffle=True, fmt=None), padded, 3, \
        {"epochs": 3, "on_epoch": set_epoch}
    yield "map-style after 3", lambda: BASE, \
        seeded(dict(kw, shuffle=True, batch_size=5, collate_fn=pad_collate)), 3, {}


if __name__ == "__main__":
    before = shm()
    for tag, kw in variants({}):
        for name, make, make_kwargs, options in cases(kw):
            compare(f"5 {name} {tag}", make, make_kwargs, **{"epochs": 3, **options})
        for name, make, make_kwargs, k, options in resume_cases(kw):
            compare_resume(f"5 resume state_dict {name} {tag}", make, make_kwargs, k, **options)
    report_end(before)
