"""Scenario 1: webdataset .tar shards (PNG 16x16, JPEG of varying size, .cls labels, .json)
through ``wds.WebDataset`` pipelines (decode "rgb"/"pil"/"torchrgb", to_tuple, map, rename,
map_dict, batched with the loader's batch_size=None, shard and sample shuffles with seeds,
detshuffle over epochs, resampled shards with with_epoch, split_by_worker / split_by_node
with RANK/WORLD_SIZE set), and wids' ``ShardListDataset`` (map-style) with shuffle."""

import io
import os
import random
import sys
import warnings

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.dirname(__file__))
import webdataset as wds
import wids
from common import DATA, TORCH_OUT, compare, fresh_dir, report_end, shm, variants

warnings.simplefilter("ignore")
SHARDS, PER_SHARD = 4, 10
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def write_shards():
    root = fresh_dir("wds")
    rng = np.random.default_rng(0)
    urls = []
    for s in range(SHARDS):
        path = os.path.join(root, f"shard-{s:04d}.tar")
        with wds.TarWriter(path) as sink:
            for j in range(PER_SHARD):
                i = s * PER_SHARD + j
                png, jpg = io.BytesIO(), io.BytesIO()
                Image.fromarray(rng.integers(0, 256, (16, 16, 3), np.uint8)).save(png, "PNG")
                h, w = rng.integers(12, 40, 2)
                Image.fromarray(rng.integers(0, 256, (h, w, 3), np.uint8)).save(jpg, "JPEG")
                sink.write(
                    {
                        "__key__": f"s{i:05d}",
                        "png": png.getvalue(),
                        "jpg": jpg.getvalue(),
                        "cls": str(i % 7).encode(),
                        "json": {"id": i, "tags": ["a", "b"][: i % 3], "w": int(w)},
                    }
                )
        urls.append(path)
    return root, urls


ROOT, URLS = write_shards()
BRACE = os.path.join(ROOT, "shard-{0000..0003}.tar")


def to_chw(img):
    """torchvision-style ToTensor + Normalize on a float HWC numpy array."""
    return (torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1) - MEAN) / STD


def random_crop_flip(img, size=12):
    """torchvision-style RandomCrop + RandomHorizontalFlip on a PIL image, drawing from
    Python's ``random`` (seeded per worker by both loaders)."""
    w, h = img.size
    x, y = random.randint(0, w - size), random.randint(0, h - size)
    img = img.crop((x, y, x + size, y + size))
    if random.random() < 0.5:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    return torch.from_numpy(np.asarray(img, np.uint8).copy()).permute(2, 0, 1)


def factory(build):
    def make():
        random.seed(11)  # num_workers=0: the main process's RNG, the same for both loaders
        torch.manual_seed(11)
        return build()

    return make


def kwargs(kw):
    def make():
        return dict(kw, generator=torch.Generator().manual_seed(99))  # workers' base seed

    return make


def tuples():
    return (
        wds.WebDataset(URLS, shardshuffle=False)
        .decode("rgb")
        .to_tuple("png", "cls")
        .map_tuple(to_chw, int)
    )


def batched():
    return (
        wds.WebDataset(BRACE, shardshuffle=False)
        .decode("rgb")
        .to_tuple("png", "cls", "__key__")
        .map_tuple(to_chw, int, str)
        .batched(5)
    )


def batched_partial_false():
    return (
        wds.WebDataset(URLS, shardshuffle=False)
        .decode("torchrgb")
        .to_tuple("png", "json")
        .batched(3, partial=False)
    )


def pil_crop():
    return (
        wds.WebDataset(URLS, shardshuffle=False)
        .decode("pil")
        .to_tuple("jpg", "cls")
        .map_tuple(random_crop_flip, int)
    )


def dicts():
    return (
        wds.WebDataset(URLS, shardshuffle=False)
        .decode("rgb")
        .rename(image="png", label="cls", meta="json")
        .map_dict(image=to_chw)
        .map(
            lambda d: {
                "image": d["image"],
                "label": d["label"],
                "key": d["__key__"],
                "id": d["meta"]["id"],
                "url": os.path.basename(d["__url__"]),
            }
        )
    )


def pil_lists():  # detection-style: images of varying size kept as PIL objects
    return wds.WebDataset(URLS, shardshuffle=False).decode("pil").to_tuple("jpg", "json")


def shard_shuffle(detshuffle):
    def build():
        return (
            wds.WebDataset(URLS, shardshuffle=3, seed=5, detshuffle=detshuffle)
            .shuffle(8, seed=3)
            .decode("rgb")
            .to_tuple("png", "cls")
            .map_tuple(to_chw, int)
        )

    return build


def resampled():
    """WebDataset(resampled=True) seeds from pid and time (not comparable between runs);
    the DataPipeline spelling with ResampledShards(deterministic=True) seeds from the worker
    id and the epoch, counted per dataset copy (so persistent workers differ per epoch)."""
    return wds.DataPipeline(
        wds.ResampledShards(URLS, seed=4, deterministic=True),
        wds.tarfile_to_samples(),
        wds.shuffle(6, seed=1),
        wds.decode("rgb"),
        wds.to_tuple("cls", "__key__"),
    ).with_epoch(12)


def split_nodes():
    return (
        wds.WebDataset(
            URLS,
            shardshuffle=False,
            nodesplitter=wds.split_by_node,
            workersplitter=wds.split_by_worker,
        )
        .decode("rgb")
        .to_tuple("cls", "__key__")
    )


def no_worker_split():  # workersplitter=None: every worker yields every shard (as torch)
    return wds.WebDataset(URLS, shardshuffle=False, workersplitter=None).to_tuple("cls", "__key__")


def tuple_collate(batch):
    return tuple(zip(*batch))


def wids_dataset():
    ds = wids.ShardListDataset(
        [dict(url=u, nsamples=PER_SHARD) for u in URLS], cache_dir=os.path.join(DATA, "wids_cache")
    )

    def tfm(sample):
        return {
            "image": to_chw(np.asarray(sample[".png"], np.float32) / 255.0),
            "label": int(sample[".cls"]),
            "key": sample["__key__"],
            "index": int(sample["__index__"]),
        }

    ds.add_transform(tfm)
    return ds


def pil_collate(batch):
    return [b["image"] for b in batch], torch.tensor([b["label"] for b in batch])


def wids_pil():
    ds = wids.ShardListDataset(
        [dict(url=u, nsamples=PER_SHARD) for u in URLS], cache_dir=os.path.join(DATA, "wids_cache")
    )
    ds.add_transform(lambda s: {"image": s[".jpg"], "label": int(s[".cls"])})
    return ds


if __name__ == "__main__":
    before = shm()
    for tag, kw in variants({}):
        e = dict(epochs=3) if kw.get("persistent_workers") else {}
        compare(f"1 to_tuple map bs=5 {tag}", factory(tuples), kwargs(dict(kw, batch_size=5)), **e)
        compare(
            f"1 to_tuple drop_last bs=4 {tag}",
            factory(tuples),
            kwargs(dict(kw, batch_size=4, drop_last=True)),
            **e,
        )
        compare(
            f"1 .batched(5) bs=None {tag}", factory(batched), kwargs(dict(kw, batch_size=None)), **e
        )
        compare(
            f"1 .batched(3,partial=False) torchrgb bs=None {tag}",
            factory(batched_partial_false),
            kwargs(dict(kw, batch_size=None)),
            **e,
        )
        compare(
            f"1 pil random crop bs=4 {tag}", factory(pil_crop), kwargs(dict(kw, batch_size=4)), **e
        )
        compare(
            f"1 rename/map_dict dicts bs=3 {tag}",
            factory(dicts),
            kwargs(dict(kw, batch_size=3)),
            **e,
        )
        compare(
            f"1 PIL lists tuple(zip) collate {tag}",
            factory(pil_lists),
            kwargs(dict(kw, batch_size=4, collate_fn=tuple_collate)),
            **e,
        )
        for det in (False, True):
            compare(
                f"1 shardshuffle=3 detshuffle={det} .shuffle(8) {tag}",
                factory(shard_shuffle(det)),
                kwargs(dict(kw, batch_size=4)),
                epochs=3,
            )
        compare(
            f"1 ResampledShards(deterministic) with_epoch(12) {tag}",
            factory(resampled),
            kwargs(dict(kw, batch_size=4)),
            epochs=3,
            extra=TORCH_OUT,
        )
        compare(
            f"1 workersplitter=None {tag}",
            factory(no_worker_split),
            kwargs(dict(kw, batch_size=6)),
            extra=TORCH_OUT,
            **e,
        )
        os.environ.update(RANK="1", WORLD_SIZE="2")
        try:
            compare(
                f"1 split_by_node rank 1/2 {tag}",
                factory(split_nodes),
                kwargs(dict(kw, batch_size=4)),
                extra=TORCH_OUT,
                **e,
            )
        finally:
            del os.environ["RANK"], os.environ["WORLD_SIZE"]
        compare(
            f"1 break after 2 batches {tag}",
            factory(tuples),
            kwargs(dict(kw, batch_size=3)),
            epochs=3,
            steps=2,
        )
        sh = dict(kw, shuffle=True)
        compare(
            f"1 wids ShardListDataset shuffle bs=4 {tag}",
            wids_dataset,
            kwargs(dict(sh, batch_size=4)),
            **e,
        )
        compare(
            f"1 wids PIL list collate {tag}",
            wids_pil,
            kwargs(dict(sh, batch_size=5, collate_fn=pil_collate)),
            **e,
        )
        compare(
            f"1 wids ChunkedSampler {tag}",
            wids_dataset,
            lambda kw=kw: dict(
                kw,
                batch_size=4,
                sampler=wids.ChunkedSampler(
                    range(SHARDS * PER_SHARD), chunksize=10, shuffle=True, seed=2
                ),
            ),
            epochs=3,
            on_epoch=lambda loader, ds, ep: loader.sampler.set_epoch(ep),
        )
    report_end(before)
