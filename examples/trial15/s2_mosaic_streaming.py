"""Scenario 2: mosaicml-streaming. ``MDSWriter`` writes a local MDS directory (PNG images as
"pil", int labels, int32 token arrays, str text; several shards); ``StreamingDataset(local=...,
batch_size=...)`` (a subclass overriding ``__getitem__`` with torchvision-style transforms, as
its docs suggest) through both loaders: in order and shuffled (py1e, py1s, seeded), epoch_size,
a ``break`` mid-epoch, and its own resume pattern (``state_dict(num_samples, from_beginning)``
then ``load_state_dict`` on a fresh dataset). ``StreamingDataLoader`` subclasses torch's: not
tried. The library's own shared memory (``/dev/shm/<prefix>_...``) is reported as "their shm"."""

import os
import sys
import warnings

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.dirname(__file__))
from common import (
    compare,
    compare_resume,
    fresh_dir,
    report_end,
    shm,
    stub_torchvision_for,
    variants,
)

streaming = stub_torchvision_for("streaming")
from streaming import MDSWriter, StreamingDataset  # noqa: E402
from streaming.base.util import clean_stale_shared_memory  # noqa: E402

warnings.simplefilter("ignore")
N = 60


def write_mds():
    root = fresh_dir("mds")
    rng = np.random.default_rng(1)
    columns = {"image": "pil", "label": "int", "tokens": "ndarray:int32", "text": "str"}
    with MDSWriter(out=root, columns=columns, size_limit=4096) as out:
        for i in range(N):
            out.write(
                {
                    "image": Image.fromarray(rng.integers(0, 256, (8, 8, 3), np.uint8)),
                    "label": i % 5,
                    "tokens": rng.integers(0, 1000, 6).astype(np.int32),
                    "text": f"sample {i}",
                }
            )
    return root


ROOT = write_mds()


class Images(StreamingDataset):
    """A StreamingDataset whose ``__getitem__`` applies ToTensor/Normalize with torch ops."""

    def __getitem__(self, i):
        s = super().__getitem__(i)
        x = torch.from_numpy(np.asarray(s["image"], np.float32) / 255).permute(2, 0, 1)
        return {
            "image": (x - 0.5) / 0.25,
            "label": s["label"],
            "tokens": torch.from_numpy(s["tokens"]),
            "text": s["text"],
        }


def dataset(cls=Images, **kw):
    def make():
        clean_stale_shared_memory()
        return cls(local=ROOT, **kw)

    return make


def resumed(k, bs):
    """mosaic's own resume pattern: a dataset that has yielded k batches, its
    ``state_dict(k * bs, from_beginning=False)``, and a fresh dataset loading it."""

    def make():
        clean_stale_shared_memory()
        first = Images(local=ROOT, batch_size=bs, shuffle=True, shuffle_seed=3)
        it = iter(first)
        for _ in range(k * bs):
            next(it)
        state = first.state_dict(k * bs, from_beginning=False)
        del it, first
        clean_stale_shared_memory()
        ds = Images(local=ROOT, batch_size=bs, shuffle=True, shuffle_seed=3)
        ds.load_state_dict(state)
        return ds

    return make


def kwargs(kw):
    def make():
        return dict(kw, generator=torch.Generator().manual_seed(5))

    return make


def raw_collate(batch):  # the library's own sample dicts (PIL image, int, ndarray, str)
    return {k: [s[k] for s in batch] for k in batch[0]}


if __name__ == "__main__":
    before = shm()
    for tag, kw in variants({}):
        e = dict(epochs=3) if kw.get("persistent_workers") else {}
        bs = dict(kw, batch_size=4)
        compare(f"2 in order bs=4 {tag}", dataset(batch_size=4), kwargs(bs), **e)
        for algo in ("py1e", "py1s", "py1br"):
            compare(
                f"2 shuffle {algo} seed=7 bs=4 {tag}",
                dataset(batch_size=4, shuffle=True, shuffle_algo=algo, shuffle_seed=7),
                kwargs(bs),
                epochs=3,
            )
        compare(
            f"2 raw samples list collate bs=5 {tag}",
            dataset(StreamingDataset, batch_size=5),
            kwargs(dict(kw, batch_size=5, collate_fn=raw_collate)),
            **e,
        )
        compare(
            f"2 epoch_size=22 drop_last bs=4 {tag}",
            dataset(batch_size=4, epoch_size=22, shuffle=True, shuffle_seed=1),
            kwargs(dict(bs, drop_last=True)),
            epochs=3,
        )
        compare(
            f"2 break after 3 batches {tag}",
            dataset(batch_size=4, shuffle=True, shuffle_seed=2),
            kwargs(bs),
            epochs=2,
            steps=3,
        )
        compare(f"2 own resume after 3 batches {tag}", resumed(3, 4), kwargs(bs), epochs=1)
        # our loader's state_dict(): StreamingDataset.state_dict needs arguments (not
        # torchdata's protocol), so a resumed worker skips the samples it had handed out
        compare_resume(
            f"2 ArenaLoader.state_dict resume after 3 {tag}",
            dataset(batch_size=4, shuffle=True, shuffle_seed=7),
            kwargs(bs),
            3,
            epochs=2,
        )
    report_end(before)
