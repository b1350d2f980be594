"""Scenario 4: storage libraries read lazily per worker, torchvision-style transforms with torch
ops, a detection-style collate (list of dicts with a varying number of boxes) and a padding
NLP collate.

- lmdb: PNG bytes + a pickled target per key; the environment opened on first use in
  ``__getitem__``, or in ``worker_init_fn`` (through ``get_worker_info().dataset``).
- tfrecord: ``tfrecord.torch.TFRecordDataset`` (iterable; shards by ``get_worker_info`` over
  an index file; ``shuffle_queue_size`` draws from Python's ``random``) and
  ``MultiTFRecordDataset`` (weighted shards, infinite: a ``break`` after k batches).
- Lance (pylance): a map-style dataset taking rows by index (``__getitem__`` and torch's
  ``__getitems__``), opened lazily; ``lance.torch.data.LanceDataset`` (iterable, yields batches
  itself: loader ``batch_size=None``)."""

import io
import os
import pickle
import random
import sys
import warnings

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.dirname(__file__))
import lance
import lmdb
import pyarrow as pa
from common import DATA, TORCH_OUT, compare, fresh_dir, report_end, seeded, shm, variants
from lance.torch.data import LanceDataset
from tfrecord.tools.tfrecord2idx import create_index
from tfrecord.torch.dataset import MultiTFRecordDataset, TFRecordDataset
from tfrecord.writer import TFRecordWriter

warnings.simplefilter("ignore")
N = 30


def sample(i):
    rng = np.random.default_rng(100 + i)
    h, w = rng.integers(16, 28, 2)
    png = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), np.uint8)).save(png, "PNG")
    k = int(rng.integers(0, 4))
    boxes = np.sort(rng.uniform(0, 16, (k, 4)).astype(np.float32).reshape(k, 2, 2), 1).reshape(k, 4)
    tokens = rng.integers(1, 500, 3 + i % 6).astype(np.int64)
    return png.getvalue(), {"boxes": boxes, "labels": rng.integers(1, 9, k), "image_id": i}, tokens


SAMPLES = [sample(i) for i in range(N)]


ROOT = os.path.join(
    DATA, "storage"
)  # written by the main process only: spawned workers import this


def write_all():
    root = fresh_dir("storage")
    env = lmdb.open(os.path.join(root, "lmdb"), map_size=1 << 24)
    with env.begin(write=True) as txn:
        for i, (png, target, tokens) in enumerate(SAMPLES):
            txn.put(b"%08d" % i, pickle.dumps((png, target, tokens)))
    env.close()
    for s in range(3):
        path = os.path.join(root, f"part{s}.tfrecord")
        writer = TFRecordWriter(path)
        for i in range(s, N, 3):
            png, target, tokens = SAMPLES[i]
            writer.write(
                {
                    "image": (png, "byte"),
                    "label": (i % 5, "int"),
                    "tokens": (tokens.tolist(), "int"),
                    "score": (float(i) / 7, "float"),
                }
            )
        writer.close()
        create_index(path, path + ".idx")
    table = pa.table(
        {
            "id": pa.array(range(N), pa.int64()),
            "image": pa.array([s[0] for s in SAMPLES], pa.binary()),
            "tokens": pa.array([s[2].tolist() for s in SAMPLES], pa.list_(pa.int64())),
            "label": pa.array([i % 5 for i in range(N)], pa.int64()),
        }
    )
    lance.write_dataset(table, os.path.join(root, "data.lance"), max_rows_per_file=10)
    return root


MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def decode(png):
    return torch.from_numpy(np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).copy()).permute(
        2, 0, 1
    )


def random_resized_crop_flip(img, size=12):
    """torchvision-style RandomResizedCrop (scale 0.5-1) + RandomHorizontalFlip + Normalize,
    drawing from torch's RNG (seeded per worker by both loaders)."""
    _, h, w = img.shape
    ch = int(h * (0.5 + 0.5 * torch.rand(()).item()))
    cw = int(w * (0.5 + 0.5 * torch.rand(()).item()))
    y = int(torch.randint(0, h - ch + 1, ()).item())
    x = int(torch.randint(0, w - cw + 1, ()).item())
    crop = img[:, y : y + ch, x : x + cw].float().unsqueeze(0) / 255
    out = torch.nn.functional.interpolate(
        crop, size=(size, size), mode="bilinear", align_corners=False
    )[0]
    if torch.rand(()) < 0.5:
        out = out.flip(-1)
    return (out - MEAN) / STD


class LmdbImages:
    """Map-style over lmdb, the environment opened lazily (never inherited across a fork)."""

    def __init__(self, detection=False):
        self.path, self.env, self.detection = os.path.join(ROOT, "lmdb"), None, detection

    def open(self):
        if self.env is None:
            self.env = lmdb.open(self.path, readonly=True, lock=False, readahead=False)

    def __len__(self):
        return N

    def __getitem__(self, i):
        self.open()
        with self.env.begin() as txn:
            png, target, tokens = pickle.loads(txn.get(b"%08d" % i))
        img = decode(png)
        if self.detection:  # image kept at its size, boxes flipped with it
            flip = bool(torch.rand(()) < 0.5)
            boxes = torch.from_numpy(target["boxes"])
            if flip:
                img, boxes = (
                    img.flip(-1),
                    torch.stack(
                        [
                            img.shape[-1] - boxes[:, 2],
                            boxes[:, 1],
                            img.shape[-1] - boxes[:, 0],
                            boxes[:, 3],
                        ],
                        1,
                    ),
                )
            return img, {
                "boxes": boxes,
                "labels": torch.as_tensor(target["labels"]),
                "image_id": target["image_id"],
            }
        return {
            "image": random_resized_crop_flip(img),
            "tokens": torch.from_numpy(tokens),
            "label": i % 5,
        }


def open_in_worker(worker_id):
    torch.utils.data.get_worker_info().dataset.open()


def detection_collate(batch):
    return tuple(zip(*batch))


def list_of_dicts_collate(batch):
    return [{"image": img, **target} for img, target in batch]


def pad_collate(batch):
    key = "tokens"
    n = max(len(b[key]) for b in batch)
    ids = torch.full((len(batch), n), -100, dtype=torch.long)
    for j, b in enumerate(batch):
        ids[j, : len(b[key])] = torch.as_tensor(b[key])
    out = {"input_ids": ids, "lengths": torch.tensor([len(b[key]) for b in batch])}
    out.update(
        {k: torch.stack([torch.as_tensor(b[k]) for b in batch]) for k in batch[0] if k != key}
    )
    return out


def tf_transform(rec):
    return {
        "image": random_resized_crop_flip(decode(bytes(rec["image"]))),
        "tokens": rec["tokens"],
        "label": rec["label"][0],
        "score": rec["score"][0],
    }


def tfrecord(shuffle_queue_size=None):
    def make():
        random.seed(3)
        np.random.seed(3)  # nw=0: the reader starts at a random record (numpy's global RNG)
        torch.manual_seed(3)
        path = os.path.join(ROOT, "part1.tfrecord")
        return TFRecordDataset(
            path, path + ".idx", shuffle_queue_size=shuffle_queue_size, transform=tf_transform
        )

    return make


def multi_tfrecord():
    random.seed(4)
    np.random.seed(4)  # MultiTFRecordDataset samples its shards from numpy's global RNG
    torch.manual_seed(4)
    pattern = os.path.join(ROOT, "{}.tfrecord")
    return MultiTFRecordDataset(
        pattern,
        pattern + ".idx",
        {"part0": 0.5, "part1": 0.3, "part2": 0.2},
        description={"label": "int", "tokens": "int"},
    )


class LanceRows:
    """Map-style over a Lance dataset, opened lazily; ``__getitems__`` takes a batch's rows in
    one ``take`` (torch's batched-fetch protocol)."""

    def __init__(self, batched):
        self.path, self.ds = os.path.join(ROOT, "data.lance"), None
        if batched:
            self.__getitems__ = self.getitems

    def __len__(self):
        return N

    def rows(self, indices):
        if self.ds is None:
            self.ds = lance.dataset(self.path)
        return self.ds.take(list(indices), columns=["id", "image", "tokens", "label"]).to_pylist()

    def one(self, row):
        return {
            "image": random_resized_crop_flip(decode(row["image"])),
            "tokens": row["tokens"],
            "label": row["label"],
            "id": row["id"],
        }

    def __getitem__(self, i):
        return self.one(self.rows([i])[0])

    def getitems(self, indices):
        return [self.one(r) for r in self.rows(indices)]


def seeded_factory(make):
    def build():
        torch.manual_seed(9)
        return make()

    return build


def kwargs(kw):
    def make():
        return dict(kw, generator=torch.Generator().manual_seed(21))

    return make


if __name__ == "__main__":
    write_all()
    before = shm()
    for tag, kw in variants({}):
        e = dict(epochs=3) if kw.get("persistent_workers") else {}
        sh = dict(kw, shuffle=True, batch_size=4)
        compare(
            f"4 lmdb lazy pad collate {tag}",
            seeded_factory(LmdbImages),
            seeded(dict(sh, collate_fn=pad_collate)),
            **e,
        )
        compare(
            f"4 lmdb default collate (tokens dropped) {tag}",
            seeded_factory(LmdbImages),
            seeded(dict(sh, collate_fn=lambda b: pad_collate(b)["input_ids"])),
            **e,
        )
        if kw["num_workers"]:
            compare(
                f"4 lmdb opened in worker_init_fn {tag}",
                LmdbImages,
                seeded(dict(sh, collate_fn=pad_collate, worker_init_fn=open_in_worker)),
                **e,
            )
        compare(
            f"4 lmdb detection tuple(zip) {tag}",
            seeded_factory(lambda: LmdbImages(True)),
            seeded(dict(sh, collate_fn=detection_collate)),
            **e,
        )
        compare(
            f"4 lmdb detection list of dicts {tag}",
            seeded_factory(lambda: LmdbImages(True)),
            seeded(dict(sh, collate_fn=list_of_dicts_collate, drop_last=True)),
            **e,
        )
        compare(
            f"4 tfrecord pad collate {tag}",
            tfrecord(),
            kwargs(dict(kw, batch_size=3, collate_fn=pad_collate)),
            **e,
        )
        compare(
            f"4 tfrecord shuffle_queue_size=4 {tag}",
            tfrecord(4),
            kwargs(dict(kw, batch_size=3, collate_fn=pad_collate)),
            epochs=3,
        )
        compare(
            f"4 tfrecord default collate bs=1 {tag}",
            tfrecord(),
            kwargs(dict(kw, batch_size=1)),
            extra=TORCH_OUT,
            **e,
        )
        compare(
            f"4 MultiTFRecordDataset break at 5 {tag}",
            multi_tfrecord,
            kwargs(dict(kw, batch_size=4, collate_fn=pad_collate)),
            steps=5,
        )
        # lance is not fork-safe: its runtime's threads, started in this process by
        # write_dataset (and by the nw=0 cases), leave a forked worker waiting forever inside
        # lance (torch's DataLoader first: it hung here under fork). Lance's advice is spawn;
        # timeout= turns any wait into an error in both loaders.
        lk = dict(kw, multiprocessing_context="spawn", timeout=60) if kw["num_workers"] else kw
        for batched in (False, True):
            compare(
                f"4 lance rows __getitems__={batched} pad collate {tag} spawn",
                seeded_factory(lambda b=batched: LanceRows(b)),
                seeded(dict(lk, shuffle=True, batch_size=4, collate_fn=pad_collate)),
                **e,
            )
        compare(
            f"4 lance.torch LanceDataset bs=None {tag} spawn",
            lambda: LanceDataset(
                os.path.join(ROOT, "data.lance"), batch_size=7, columns=["id", "label"]
            ),
            kwargs(dict(lk, batch_size=None)),
            **e,
        )
    report_end(before)
