"""Scenario 12: albumentations detection pipeline (variable bbox counts) with the torchvision-reference
collate `tuple(zip(*batch))`, and with default collation (unequal bbox counts: both must raise)."""

import os
import sys

import albumentations as A
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import compare, report_end, seeded, shm, variants  # noqa: E402

N = 18


class Det:
    def __init__(self, as_tensor=False):
        rng = np.random.default_rng(1)
        self.imgs = rng.integers(0, 255, (N, 32, 32, 3), dtype=np.uint8)
        self.boxes = [np.sort(rng.integers(0, 32, (1 + i % 3, 2, 2)), axis=1).reshape(-1, 4).astype(np.float32)
                      for i in range(N)]
        for b in self.boxes:
            b[:, 2:] = np.maximum(b[:, 2:], b[:, :2] + 2)
        self.t = A.Compose([A.HorizontalFlip(p=0.5), A.RandomBrightnessContrast(p=0.5)],
                           bbox_params=A.BboxParams(format="pascal_voc", label_fields=["labels"]), seed=3)
        self.as_tensor = as_tensor

    def __len__(self):
        return N

    def __getitem__(self, i):
        out = self.t(image=self.imgs[i], bboxes=self.boxes[i], labels=list(range(len(self.boxes[i]))))
        img = out["image"]
        target = {"boxes": np.asarray(out["bboxes"], np.float32), "labels": np.asarray(out["labels"], np.int64),
                  "image_id": i}
        if self.as_tensor:
            img = torch.from_numpy(img).permute(2, 0, 1)
            target = {"boxes": torch.from_numpy(target["boxes"]), "labels": torch.from_numpy(target["labels"]),
                      "image_id": i}
        return img, target


def zip_collate(batch):
    return tuple(zip(*batch))


def reseed(worker_id):
    info = torch.utils.data.get_worker_info()
    info.dataset.t.set_random_seed(info.seed % 2**32)


if __name__ == "__main__":
    before = shm()
    base = dict(batch_size=4, shuffle=True)
    for tag, kw in variants(base):
        init = {"worker_init_fn": reseed} if kw["num_workers"] else {}
        compare(f"12 det numpy zip collate {tag}", lambda: Det(), seeded(dict(kw, collate_fn=zip_collate, **init)),
                epochs=2)
        compare(f"12 det tensor zip collate {tag}", lambda: Det(True),
                seeded(dict(kw, collate_fn=zip_collate, **init)), epochs=2)
    compare("12 det default collate nw=2", lambda: Det(True), seeded(dict(base, num_workers=2)))
    report_end(before)
