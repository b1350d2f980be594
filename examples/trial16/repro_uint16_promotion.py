"""Rows of uint16 (uint32, uint64) beside other integer dtypes, each >= 32 KB: torch's
DataLoader raises RuntimeError ("Promotion for uint16, uint32, uint64 types is not supported");
ArenaLoader stacks them as numpy promotes (int32 here). Same with the pre-cast-loop code."""
import numpy as np
from torch.utils.data import DataLoader

from arena_loader import ArenaLoader

ds = [np.full((64, 1024), 7, np.int32), np.full((64, 1024), 65535, np.uint16)]
try:
    next(iter(DataLoader(ds, batch_size=2)))
except RuntimeError as exc:
    print("torch:", type(exc).__name__, exc)
b = next(iter(ArenaLoader(ds, batch_size=2, output="torch")))
print("ours:", b.dtype, b[1, 0, 0].item())
