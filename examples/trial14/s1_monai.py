"""Scenario 1: MONAI: dict transforms making MetaTensors (affine, meta, applied_operations)
through default collation, list_data_collate and pad_list_data_collate; CacheDataset,
PersistentDataset; monai.data.DataLoader beside ArenaLoader with MONAI's collate and
worker_init_fn (found: default collation of MetaTensors raised SampleTypeError, fixed)."""

import os
import sys
import tempfile
import warnings

import numpy as np
import torch
from monai import transforms as T  # noqa: N812 (MONAI's own spelling)
from monai.data import (
    CacheDataset,
    Dataset,
    MetaTensor,
    PersistentDataset,
    list_data_collate,
    pad_list_data_collate,
)
from monai.data import DataLoader as MonaiLoader
from monai.data.utils import set_rnd
from monai.data.utils import worker_init_fn as monai_worker_init

sys.path.insert(0, os.path.dirname(__file__))
from common import collect, compare, first_diff, report_end, seeded, shm, variants

from arena_loader import ArenaLoader

warnings.simplefilter("ignore")
N = 11


def items(ragged=False):
    rng = np.random.default_rng(0)
    out = []
    for i in range(N):
        h, w = (8 + i % 3, 7 + i % 2) if ragged else (8, 8)
        aff = np.eye(4)
        aff[0, 3] = i
        image = MetaTensor(rng.random((1, h, w), dtype=np.float32), affine=torch.as_tensor(aff),
                           meta={"filename_or_obj": f"img{i}.nii", "idx": i})
        out.append({"img": image, "seg": (rng.random((1, h, w)) > 0.5).astype(np.uint8),
                    "label": i % 3, "name": f"case{i}"})
    return out


def fixed_tf():
    return T.Compose([T.EnsureTyped(keys=["img", "seg"]), T.ScaleIntensityd(keys="img"),
                      T.Spacingd(keys=["img"], pixdim=(1.0, 1.0), mode="bilinear")])


def rand_tf():
    keys = ["img", "seg"]
    return T.Compose([T.EnsureTyped(keys=keys), T.RandFlipd(keys=keys, prob=0.5, spatial_axis=0),
                      T.RandRotate90d(keys=keys, prob=0.5),
                      T.RandGaussianNoised(keys="img", prob=0.5)])


def ragged_tf():
    return T.Compose([T.EnsureTyped(keys=["img", "seg"]),
                      T.RandSpatialCropd(keys=["img", "seg"], roi_size=(4, 4), random_size=True)])


def ds_fixed():
    return Dataset(items(), fixed_tf())


def seeded_rnd(dataset):
    """Transforms' RandomStates seeded per loader (with num_workers=0 nothing reseeds them,
    so they would run on from one loader to the next; MONAI's DataLoader does the same)."""
    set_rnd(dataset, 7)
    return dataset


def ds_rand():
    return seeded_rnd(Dataset(items(), rand_tf()))


def ds_ragged():
    return seeded_rnd(Dataset(items(ragged=True), ragged_tf()))


def ds_cache():
    return seeded_rnd(CacheDataset(items(), rand_tf(), cache_rate=1.0, num_workers=0,
                                   progress=False))


def ds_rand_as_monai():
    """What MONAI's DataLoader does with num_workers=0 (a user switching writes it out):
    seed the transforms from one draw of the loader's generator, then restore it."""
    generator = torch.Generator().manual_seed(5)
    dataset = Dataset(items(), rand_tf())
    set_rnd(dataset, int(torch.empty((), dtype=torch.int64).random_(generator=generator)))
    return dataset


CACHE_DIR = tempfile.mkdtemp()


def ds_persistent():
    dataset = PersistentDataset(items(), rand_tf(), cache_dir=CACHE_DIR)
    for i in range(len(dataset)):  # the cache written before either loader reads it
        dataset[i]
    return seeded_rnd(dataset)


if __name__ == "__main__":
    before = shm()
    base = dict(batch_size=4, shuffle=True)
    for tag, kw in variants(base):
        compare(f"1 MetaTensor default collate {tag}", ds_fixed, seeded(kw))
        compare(f"1 MetaTensor default collate output=torch {tag}", ds_fixed, seeded(kw),
                extra={"output": "torch"})
        compare(f"1 MetaTensor batch_size=None {tag}", ds_fixed, seeded(dict(kw, batch_size=None)))
        winit = dict(kw, worker_init_fn=monai_worker_init) if kw["num_workers"] else kw
        listed = dict(winit, collate_fn=list_data_collate)
        compare(f"1 rand list_data_collate {tag}", ds_rand, seeded(listed))
        compare(f"1 ragged pad_list_data_collate {tag}", ds_ragged,
                seeded(dict(winit, collate_fn=pad_list_data_collate)))
        compare(f"1 CacheDataset list_data_collate {tag}", ds_cache, seeded(listed))
        compare(f"1 PersistentDataset {tag}", ds_persistent, seeded(listed))
        compare(f"1 rand default collate {tag}", ds_rand, seeded(winit))
    # MONAI's own DataLoader (torch's, with its collate and worker_init_fn) beside ours with those
    for nw in (0, 2):
        kw = dict(batch_size=4, shuffle=True, num_workers=nw)
        res = {}
        ours = dict(collate_fn=list_data_collate, worker_init_fn=monai_worker_init)
        for name, cls, extra in (("monai", MonaiLoader, {}), ("arena", ArenaLoader, ours)):
            try:
                res[name] = collect(cls, lambda extra=extra, kw=kw: dict(
                    kw, generator=torch.Generator().manual_seed(5), **extra),
                    ds_rand if nw or cls is MonaiLoader else ds_rand_as_monai, 2)
            except Exception as e:
                res[name] = f"{type(e).__name__}: {e}"
        d = res["arena"] if isinstance(res["arena"], str) else first_diff(*res.values())
        print(f"[1 monai.data.DataLoader vs ArenaLoader nw={nw}] "
              f"{'SAME' if d is None else 'DIFF ' + d}", flush=True)
    report_end(before)
