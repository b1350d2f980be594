"""Scenario 8: keep only a derived view of a batch (row, unbind, .numpy(), memoryview, storage), drop the batch."""

import gc
import os
import sys
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import report_end, shm  # noqa: E402

from arena_loader import ArenaLoader  # noqa: E402

warnings.simplefilter("ignore")
N = 64


class DS:
    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"x": np.full((8,), i, np.float32), "y": i}


KEEPERS = {
    "row x[0]": lambda x: x[0],
    "unbind/list": lambda x: list(x)[1],
    "torch .numpy()": lambda x: x.numpy() if isinstance(x, torch.Tensor) else x.view(),
    "reshape/T": lambda x: x.reshape(-1, 2).T,
    "memoryview": lambda x: memoryview(x.numpy() if isinstance(x, torch.Tensor) else x),
    "np.asarray": lambda x: np.asarray(x),
    "from_numpy(np)": lambda x: torch.from_numpy(np.asarray(x)),
    "storage": lambda x: x.untyped_storage() if isinstance(x, torch.Tensor) else x.base,
    "dlpack": lambda x: torch.from_dlpack(x) if isinstance(x, torch.Tensor) else np.from_dlpack(x),
    "slice x[1:3]": lambda x: x[1:3],
    "np.frombuffer": lambda x: np.frombuffer(memoryview(x.numpy() if isinstance(x, torch.Tensor) else x),
                                             np.float32),
}


def snap(v):
    if isinstance(v, memoryview):
        return np.array(np.asarray(v)).tolist()
    if isinstance(v, torch.UntypedStorage):
        return bytes(v)
    return np.array(v).tolist()


if __name__ == "__main__":
    before = shm()
    for out in ("torch", "numpy"):
        for nw in (0, 2):
            for name, keep in KEEPERS.items():
                loader = ArenaLoader(DS(), batch_size=4, shuffle=True, num_workers=nw, output=out,
                                     generator=torch.Generator().manual_seed(1))
                kept, copies, err = [], [], None
                try:
                    for _ in range(3):
                        for b in loader:
                            v = keep(b["x"])
                            kept.append(v)
                            copies.append(snap(v))
                            del b
                except Exception as e:  # noqa: BLE001
                    err = f"{type(e).__name__}: {e}"[:200]
                bad = sum(snap(v) != c for v, c in zip(kept, copies))
                loader.close()
                del loader
                gc.collect()
                try:
                    bad2 = sum(snap(v) != c for v, c in zip(kept, copies))
                except Exception as e:  # noqa: BLE001
                    bad2 = f"{type(e).__name__}: {e}"
                print(f"[8 keep {name} out={out} nw={nw}] {'OK' if not bad and not bad2 and not err else 'FAIL'}"
                      f" changed-while-open={bad} changed-after-close={bad2} err={err}", flush=True)
                del kept
                gc.collect()
    report_end(before)
