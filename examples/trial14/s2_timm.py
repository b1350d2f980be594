"""Scenario 2: timm's data path without torchvision (timm's package imports torchvision, so its
mixup.py is loaded by file): a PIL RandomResizedCrop/flip pipeline drawing from Python's random,
timm's fast_collate (written out: uint8 batch, int64 targets), FastCollateMixup as collate_fn
(numpy's global RNG in workers), Mixup applied to default_collate's batch in a collate_fn."""

import importlib.util
import os
import random
import sys

import numpy as np
import torch
from PIL import Image
from torch.utils.data import default_collate

sys.path.insert(0, os.path.dirname(__file__))
from common import compare, report_end, seeded, shm, variants

_spec = importlib.util.find_spec("timm")
_path = os.path.join(_spec.submodule_search_locations[0], "data", "mixup.py")
_spec = importlib.util.spec_from_file_location("timm_mixup", _path)
mixup = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mixup)

N = 14


class Images:
    """PIL images, RandomResizedCrop + horizontal flip by Python's random, as timm's
    transforms_factory builds them (torchvision-free)."""

    def __init__(self, size=16, to_chw=True):
        rng = np.random.default_rng(1)
        self.images = [Image.fromarray(rng.integers(0, 255, (20 + i, 24, 3), np.uint8))
                       for i in range(N)]
        self.size, self.to_chw = size, to_chw

    def __len__(self):
        return N

    def __getitem__(self, i):
        image = self.images[i]
        w, h = image.size
        scale, ratio = random.uniform(0.3, 1.0), random.uniform(3 / 4, 4 / 3)
        cw = min(w, round((w * h * scale * ratio) ** 0.5))
        ch = min(h, round((w * h * scale / ratio) ** 0.5))
        x, y = random.randint(0, w - cw), random.randint(0, h - ch)
        image = image.crop((x, y, x + cw, y + ch)).resize((self.size, self.size),
                                                            Image.BILINEAR)
        if random.random() < 0.5:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        array = np.asarray(image)
        return (np.ascontiguousarray(array.transpose(2, 0, 1)) if self.to_chw else array), i % 5


def fresh():
    """A dataset with every global RNG reseeded (num_workers=0: nothing else reseeds)."""
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    return Images()


def fast_collate(batch):
    """timm.data.loader.fast_collate's tuple branch."""
    targets = torch.tensor([b[1] for b in batch], dtype=torch.int64)
    tensor = torch.zeros((len(batch), *batch[0][0].shape), dtype=torch.uint8)
    for i in range(len(batch)):
        tensor[i] += torch.from_numpy(batch[i][0])
    return tensor, targets


FAST_MIXUP = mixup.FastCollateMixup(mixup_alpha=0.8, cutmix_alpha=1.0, prob=1.0, switch_prob=0.5,
                                    label_smoothing=0.1, num_classes=5)
ELEM_MIXUP = mixup.FastCollateMixup(mixup_alpha=0.8, cutmix_alpha=1.0, prob=1.0,
                                    switch_prob=0.5, mode="elem", num_classes=5)
MIXUP = mixup.Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, prob=1.0, switch_prob=0.5, num_classes=5)


def float_mixup_collate(batch):
    images, targets = default_collate(batch)
    return MIXUP(images.float() / 255, targets)


def init(worker_id):
    info = torch.utils.data.get_worker_info()
    random.seed(info.seed % 2**32 + 1)


if __name__ == "__main__":
    before = shm()
    base = dict(batch_size=4, shuffle=True)
    for tag, kw in variants(base):
        torch_out = {"output": "torch"}  # numpy samples: numpy batches otherwise (documented)
        compare(f"2 PIL pipeline default collate {tag}", fresh, seeded(kw), extra=torch_out)
        compare(f"2 fast_collate {tag}", fresh, seeded(dict(kw, collate_fn=fast_collate)))
        compare(f"2 FastCollateMixup batch {tag}", fresh, seeded(dict(kw, collate_fn=FAST_MIXUP)))
        compare(f"2 FastCollateMixup elem {tag}", fresh, seeded(dict(kw, collate_fn=ELEM_MIXUP)))
        compare(f"2 Mixup in collate_fn {tag}", fresh,
                seeded(dict(kw, collate_fn=float_mixup_collate, drop_last=True)))
        if kw["num_workers"]:
            compare(f"2 worker_init_fn reseeds random {tag}", fresh,
                    seeded(dict(kw, worker_init_fn=init)), extra=torch_out)
    report_end(before)
