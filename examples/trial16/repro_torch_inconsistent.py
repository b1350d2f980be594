"""torch's own num_workers=0 vs num_workers>0 disagreement (torch.stack without / with out= a
tensor of the FIRST sample's dtype); ArenaLoader gives the num_workers=0 answer for both.
Rows >= 32 KB so the cast loop is in play, though none of this depends on it."""
import numpy as np
import torch
from torch.utils.data import DataLoader

from arena_loader import ArenaLoader


def show(name, ds):
    for nw in (0, 2):
        try:
            t = next(iter(DataLoader(ds, batch_size=2, num_workers=nw)))
            t = (t.dtype, t.view(torch.uint8).reshape(-1)[:4].tolist() if t.dtype == torch.bool
                 else t.reshape(2, -1)[:, 0].tolist())
        except Exception as exc:
            t = type(exc).__name__
        o = next(iter(ArenaLoader(ds, batch_size=2, num_workers=nw, output="torch")))
        o = (o.dtype, o.view(torch.uint8).reshape(-1)[:4].tolist() if o.dtype == torch.bool
             else o.reshape(2, -1)[:, 0].tolist())
        print(f"{name} nw={nw}: torch {t} | ours {o}")


S = (64, 1024)
show("int8 then int16", [np.full(S, 1, np.int8), np.full(S, 300, np.int16)])
show("float16 then float32", [np.full(S, 1, np.float16), np.full(S, 1e6, np.float32)])
show("int32 then float32", [np.full(S, 1, np.int32), np.full(S, 0.5, np.float32)])
show("uint8 then int8", [np.full(S, 200, np.uint8), np.full(S, -1, np.int8)])
show("bool then uint8", [np.ones(S, bool), np.full(S, 9, np.uint8)])
raw = np.full(S[0] * S[1], 2, np.uint8).view(bool).reshape(S)  # bool bytes that are not 0/1
show("bool bytes 2", [raw, raw])
