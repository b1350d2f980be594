"""Scenario 3: albumentations random transforms; per-worker seeding vs torch's DataLoader."""

import os
import random
import sys

import albumentations as A
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import compare, report_end, seeded, shm, variants  # noqa: E402

N = 24


def make_compose(seed):
    return A.Compose([
        A.HorizontalFlip(p=0.5),
        A.RandomBrightnessContrast(p=0.8),
        A.ShiftScaleRotate(p=0.7) if hasattr(A, "ShiftScaleRotate") else A.Affine(p=0.7),
        A.RandomCrop(12, 12),
    ], seed=seed)


class Images:
    def __init__(self, seed=137, mode="albu"):
        self.rng_img = np.random.default_rng(0).integers(0, 255, (N, 16, 16, 3), dtype=np.uint8)
        self.t = make_compose(seed)
        self.mode = mode

    def __len__(self):
        return N

    def __getitem__(self, i):
        img = self.rng_img[i]
        if self.mode == "albu":
            out = self.t(image=img)["image"]
        elif self.mode == "pyrandom":  # 1.x-style: python `random`, which torch seeds per worker
            out = np.rot90(img, random.randint(0, 3)).copy()
        elif self.mode == "nprandom":  # global numpy RNG: torch does not seed it per worker
            out = (img + np.random.randint(0, 5)).astype(np.uint8)
        else:
            out = (img + torch.randint(0, 5, ()).item()).astype(np.uint8)  # torch RNG, seeded per worker
        return {"image": out, "i": i}


def reseed_albu(worker_id):
    """The recipe from albumentations' docs/issues: reseed the Compose from torch's worker seed."""
    info = torch.utils.data.get_worker_info()
    info.dataset.t.set_random_seed(info.seed % 2**32)


def reseed_np(worker_id):
    np.random.seed(torch.initial_seed() % 2**32)


def reset_globals(make):
    """num_workers=0 draws from the main process's global RNGs: start both loaders equal."""
    def wrapped():
        torch.manual_seed(0)
        random.seed(0)
        np.random.seed(0)
        return make()
    return wrapped


def factory(**k):
    return lambda: Images(**k)


if __name__ == "__main__":
    before = shm()
    base = dict(batch_size=4, shuffle=True)
    for tag, kw in variants(base):
        compare(f"3 albu seed=137 no init {tag}", factory(), seeded(kw), epochs=3, extra={"output": "torch"})
        if kw["num_workers"]:
            compare(f"3 albu reseed init_fn {tag}", factory(), seeded(dict(kw, worker_init_fn=reseed_albu)),
                    epochs=3, extra={"output": "torch"})
            compare(f"3 np reseed init_fn {tag}", factory(mode="nprandom"),
                    seeded(dict(kw, worker_init_fn=reseed_np)), epochs=3, extra={"output": "torch"})
        compare(f"3 python random {tag}", factory(mode="pyrandom"), reset_globals(seeded(kw)), epochs=3,
                extra={"output": "torch"})
        compare(f"3 torch rng {tag}", factory(mode="torch"), reset_globals(seeded(kw)), epochs=3,
                extra={"output": "torch"})
        compare(f"3 global np (no seed) {tag}", factory(mode="nprandom"), reset_globals(seeded(kw)), epochs=3,
                extra={"output": "torch"})
    # global seeding instead of generator=
    for nw in (0, 2):
        def mk(nw=nw):
            torch.manual_seed(5)
            random.seed(5)
            np.random.seed(5)
            return dict(batch_size=4, shuffle=True, num_workers=nw)
        compare(f"3 manual_seed python random nw={nw}", factory(mode="pyrandom"), mk, epochs=2, extra={"output": "torch"})
        compare(f"3 manual_seed np global nw={nw}", factory(mode="nprandom"), mk, epochs=2, extra={"output": "torch"})
    report_end(before)
