"""Scenario 3: litdata. ``litdata.optimize`` writes a local chunked dataset (uint8 image arrays
and PIL images, int labels, variable-length int64 token arrays, str ids); ``StreamingDataset``
(in order, shuffled with its seed, ``drop_last``, ``transform=``, a subclass with a
``__getitem__`` transform, ``set_epoch`` per epoch or not, ``len(loader)`` asked first) through
both loaders with a padding collate and default collation. litdata's own
``StreamingDataLoader`` subclasses torch's: not tried."""

import os
import subprocess
import sys
import warnings

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.dirname(__file__))
import litdata
from common import TORCH_OUT, compare, compare_resume, fresh_dir, report_end, shm, variants
from litdata import StreamingDataset

warnings.simplefilter("ignore")
N = 50


def make_item(i):
    rng = np.random.default_rng(i)
    return {
        "image": rng.integers(0, 256, (3, 8, 8), dtype=np.uint8),
        "pil": Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)),
        "label": i % 4,
        "tokens": rng.integers(1, 100, 2 + i % 5).astype(np.int64),
        "id": f"item{i}",
    }


def write():
    """``litdata.optimize`` in a child process: it sets the program's start method to spawn
    ("Setting multiprocessing start_method to spawn"), which would make every case with
    workers spawn them (30 s a case here); spawned workers are tried below through
    ``multiprocessing_context="spawn"``, given to both loaders."""
    root = fresh_dir("litdata")
    subprocess.run(
        [sys.executable, __file__, "--write", root],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return root


def normalize(item):
    """torchvision-style ConvertImageDtype + Normalize, and PIL -> tensor, with torch ops."""
    x = torch.from_numpy(item["image"]).float() / 255
    p = torch.from_numpy(np.asarray(item["pil"], np.uint8).copy()).permute(2, 0, 1)
    return {
        "image": (x - 0.5) / 0.2,
        "pil": p,
        "label": item["label"],
        "tokens": torch.from_numpy(item["tokens"]),
        "id": item["id"],
    }


class Normalized(StreamingDataset):
    def __getitem__(self, index):
        return normalize(super().__getitem__(index))


def pad_collate(batch):
    """NLP-style: pad tokens to the batch's longest, with an attention mask."""
    n = max(len(b["tokens"]) for b in batch)
    ids = torch.zeros(len(batch), n, dtype=torch.long)
    mask = torch.zeros(len(batch), n, dtype=torch.bool)
    for j, b in enumerate(batch):
        ids[j, : len(b["tokens"])] = torch.as_tensor(b["tokens"])
        mask[j, : len(b["tokens"])] = True
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": torch.tensor([b["label"] for b in batch]),
        "ids": [b["id"] for b in batch],
    }


def no_tokens(item):
    item = dict(item)
    del item["tokens"], item["pil"]
    return item


def dataset(cls=Normalized, **kw):
    def make():
        return cls(input_dir=ROOT, **kw)

    return make


def kwargs(kw):
    def make():
        return dict(kw, generator=torch.Generator().manual_seed(3))

    return make


def set_epoch(loader, ds, epoch):
    ds.set_epoch(epoch + 1)


def ask_len(loader, ds, epoch):
    len(loader)  # litdata's __len__ sets the dataset's num_workers and batch_size


if __name__ == "__main__" and sys.argv[1:2] == ["--write"]:
    litdata.optimize(
        fn=make_item,
        inputs=list(range(N)),
        output_dir=sys.argv[2],
        chunk_size=8,
        num_workers=1,
        mode="overwrite",
    )
elif __name__ == "__main__":
    ROOT = write()
    before = shm()
    for tag, kw in variants({}):
        e = dict(epochs=3)
        bs = dict(kw, batch_size=4)
        compare(
            f"3 in order pad collate bs=4 {tag}",
            dataset(),
            kwargs(dict(bs, collate_fn=pad_collate)),
            **e,
        )
        compare(
            f"3 shuffle seed=7 pad collate {tag}",
            dataset(shuffle=True, seed=7),
            kwargs(dict(bs, collate_fn=pad_collate)),
            **e,
        )
        compare(
            f"3 shuffle set_epoch pad collate {tag}",
            dataset(shuffle=True, seed=7),
            kwargs(dict(bs, collate_fn=pad_collate)),
            on_epoch=set_epoch,
            **e,
        )
        compare(
            f"3 shuffle drop_last len(loader) first {tag}",
            dataset(shuffle=True, drop_last=True, seed=2),
            kwargs(dict(bs, collate_fn=pad_collate)),
            on_epoch=ask_len,
            **e,
        )
        compare(
            f"3 transform= default collate {tag}",
            dataset(StreamingDataset, shuffle=True, seed=1, transform=no_tokens),
            kwargs(bs),
            extra=TORCH_OUT,
            **e,
        )
        compare(
            f"3 bs=None raw items {tag}",
            dataset(StreamingDataset),
            kwargs(dict(kw, batch_size=None)),
            extra=TORCH_OUT,
            **e,
        )
        compare(
            f"3 break after 2 batches {tag}",
            dataset(shuffle=True, seed=5),
            kwargs(dict(bs, collate_fn=pad_collate)),
            steps=2,
            **e,
        )
        # litdata's state_dict(num_samples_yielded, num_workers, batch_size) takes arguments:
        # never called by ours (a resumed worker skips what it had handed out)
        compare_resume(
            f"3 ArenaLoader.state_dict resume after 3 {tag}",
            dataset(shuffle=True, seed=5),
            kwargs(dict(bs, collate_fn=pad_collate)),
            3,
        )
    spawn = dict(
        num_workers=2, batch_size=4, collate_fn=pad_collate, multiprocessing_context="spawn"
    )
    for pw in (False, True):
        compare(
            f"3 spawn shuffle set_epoch pad collate nw=2 pw={pw}",
            dataset(shuffle=True, seed=7),
            kwargs(dict(spawn, persistent_workers=pw)),
            on_epoch=set_epoch,
            epochs=3,
        )
    report_end(before)
