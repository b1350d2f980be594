"""Scenario 7: batches held, mutated, kept past close(); breaks mid-epoch."""

import gc
import os
import sys
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import children, plain, report_end, shm  # noqa: E402

from arena_loader import ArenaLoader  # noqa: E402

warnings.simplefilter("ignore")
N = 40


class DS:
    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"x": np.full((4, 4), i, np.float32), "y": i, "name": f"n{i}"}


def np_collate(b):
    return {"x": np.stack([s["x"] for s in b]), "y": np.array([s["y"] for s in b])}


def check(name, ok, detail=""):
    print(f"[{name}] {'OK' if ok else 'FAIL'} {detail}", flush=True)


if __name__ == "__main__":
    before = shm()
    for nw, pw, out, coll in [(0, False, "torch", None), (2, False, "torch", None), (2, True, "numpy", None),
                              (2, True, None, np_collate), (2, False, "torch", None)]:
        kw = dict(batch_size=4, shuffle=True, num_workers=nw, generator=torch.Generator().manual_seed(3),
                  output=out, collate_fn=coll)
        if nw:
            kw["persistent_workers"] = pw
        tag = f"nw={nw} pw={pw} out={out} collate={coll is not None}"
        loader = ArenaLoader(DS(), **kw)
        held, copies = [], []
        for ep in range(3):
            for k, b in enumerate(loader):
                held.append(b)
                copies.append(plain(b))
                if ep == 1 and k == 3:
                    break  # break mid-epoch
        check(f"7 held batches unchanged across epochs {tag}", [plain(b) for b in held] == copies)
        # in-place mutation, as a user normalising a batch would
        b = next(iter(loader))
        try:
            if isinstance(b["x"], torch.Tensor):
                b["x"].mul_(2)
            else:
                b["x"] *= 2
            check(f"7 in-place mutation allowed {tag}", True)
        except Exception as e:  # noqa: BLE001
            check(f"7 in-place mutation allowed {tag}", False, f"{type(e).__name__}: {e}")
        again = [plain(x) for x in loader]
        flat = [(x, y) for p in again for x, y in zip(p[1][0][1][3], p[1][1][1][3])]
        check(f"7 mutation does not leak into later batches {tag}",
              len(flat) == N and all(x == [[float(y)] * 4] * 4 for x, y in flat))
        loader.close()
        del loader
        gc.collect()
        try:
            check(f"7 held batches readable after close {tag}", [plain(b) for b in held] == copies)
        except Exception as e:  # noqa: BLE001
            check(f"7 held batches readable after close {tag}", False, f"{type(e).__name__}: {e}")
        del held, b
        gc.collect()
        check(f"7 no children/shm after close+drop {tag}", not children() and not (shm() - before),
              f"{children()} {sorted(shm() - before)}")
    report_end(before)
