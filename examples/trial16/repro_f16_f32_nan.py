"""A float32 row and a float16 row holding NaNs (>= 32 KB each): torch promotes with its own
half->float conversion (NaN bits quieted/changed), ArenaLoader with numpy's (payload kept), so
the float32 batch differs in the NaN elements' bits. Same with the pre-cast-loop code (the rows
are of two dtypes: the plain path writes them)."""
import numpy as np
import torch
from torch.utils.data import DataLoader

from arena_loader import ArenaLoader

h = np.full((64, 1024), 0x7C01, np.uint16).view(np.float16)  # signalling NaN, payload 1
ds = [np.zeros((64, 1024), np.float32), h]
t = next(iter(DataLoader(ds, batch_size=2)))
o = next(iter(ArenaLoader(ds, batch_size=2, output="torch")))
print("torch:", hex(t[1].view(torch.int32)[0, 0].item() & 0xFFFFFFFF), "ours:",
      hex(o[1].view(torch.int32)[0, 0].item() & 0xFFFFFFFF))
