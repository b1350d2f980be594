"""Scenario 13: the dataset changed in the main process between epochs (curriculum), persistent or not;
and an HF dataset whose set_transform is swapped between epochs."""

import os
import sys

import numpy as np
from datasets import Dataset
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(__file__))
from common import report_end, shm  # noqa: E402

from arena_loader import ArenaLoader  # noqa: E402


class Curriculum:
    def __init__(self):
        self.level = 0

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return np.full(2, i + 100 * self.level)


def run(cls, make_ds, mutate, nw, pw):
    ds = make_ds()
    kw = dict(batch_size=4, num_workers=nw)
    if nw:
        kw["persistent_workers"] = pw
    loader = cls(ds, **kw)
    out = []
    for ep in range(3):
        mutate(ds, ep)
        out.append([({k: np.asarray(v).tolist() for k, v in b.items()} if isinstance(b, dict)
                     else np.asarray(b).tolist()) for b in loader])
    if cls is ArenaLoader:
        loader.close()
    return out


def cur_mut(ds, ep):
    ds.level = ep


def hf_make():
    return Dataset.from_dict({"x": list(range(8))})


def hf_mut(ds, ep):
    ds.set_transform(lambda b, ep=ep: {"x": [np.float32(v + 0.5 * ep) for v in b["x"]]})


if __name__ == "__main__":
    before = shm()
    for name, mk, mut in (("curriculum attr", Curriculum, cur_mut), ("hf set_transform", hf_make, hf_mut)):
        for nw, pw in ((0, False), (2, False), (2, True)):
            t = run(DataLoader, mk, mut, nw, pw)
            a = run(ArenaLoader, mk, mut, nw, pw)
            same = t == a  # values (torch gives tensors, we numpy here: documented)
            print(f"[13 {name} nw={nw} pw={pw}] {'SAME values' if same else 'DIFF'}", flush=True)
            if not same:
                print("   torch", t, "\n   arena", a)
    report_end(before)
