"""Scenario 5: kornia augmentations (torch ops, torch's global RNG) in a collate_fn (batch
level: flip, affine, color jitter) and per sample in the dataset; AugmentationSequential with
boxes, and the names of the params it drew, in a collate_fn's dict."""

import os
import sys
import warnings

import kornia.augmentation as K  # noqa: N812 (kornia's own spelling)
import torch
from torch.utils.data import default_collate

sys.path.insert(0, os.path.dirname(__file__))
from common import compare, report_end, seeded, shm, variants

warnings.simplefilter("ignore")
N = 14
AUG = K.AugmentationSequential(K.RandomHorizontalFlip(p=0.5), K.RandomAffine(degrees=15, p=0.7),
                               K.ColorJitter(0.2, 0.2, 0.2, 0.1, p=0.8), data_keys=["input"])
BOX_AUG = K.AugmentationSequential(K.RandomHorizontalFlip(p=0.5), K.RandomResizedCrop((8, 8)),
                                   data_keys=["input", "bbox_xyxy"])


class Images:
    def __init__(self, per_sample=False):
        self.per_sample = per_sample

    def __len__(self):
        return N

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        image = torch.rand(3, 12, 12, generator=g)
        if self.per_sample:
            image = AUG(image[None])[0]
        return image, i % 3


def fresh(per_sample=False):
    def make():
        torch.manual_seed(11)  # num_workers=0: kornia draws from torch's global RNG
        return Images(per_sample)
    return make


def aug_collate(batch):
    images, labels = default_collate(batch)
    return AUG(images), labels


def box_collate(batch):
    images, labels = default_collate(batch)
    boxes = torch.tensor([[[1.0, 1.0, 6.0, 7.0]]] * len(batch))
    out_image, out_boxes = BOX_AUG(images, boxes)
    return {"image": out_image, "boxes": out_boxes, "labels": labels,
            "params": [p.name for p in BOX_AUG._params]}


if __name__ == "__main__":
    before = shm()
    base = dict(batch_size=4, shuffle=True)
    for tag, kw in variants(base):
        compare(f"5 kornia in collate_fn {tag}", fresh(), seeded(dict(kw, collate_fn=aug_collate)))
        compare(f"5 kornia per sample in workers {tag}", fresh(True), seeded(kw))
        compare(f"5 kornia boxes in collate_fn {tag}", fresh(),
                seeded(dict(kw, collate_fn=box_collate)))
    report_end(before)
