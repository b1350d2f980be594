"""Scenario 16: what __getitems__ returns under default collation (a dict of columns, a generator, a
tuple, one array): torch vs ours, error types and messages (fixed in 70d9777)."""
from torch.utils.data import DataLoader
from arena_loader import ArenaLoader
class ColDict:
    def __len__(self): return 8
    def __getitems__(self, idx):
        return {0: [i * 10 for i in idx], 1: [i for i in idx]}   # dict keyed 0..B-1 by mistake / dict of columns
    def __getitem__(self, i): return i
class Gen:
    def __len__(self): return 8
    def __getitems__(self, idx):
        return (i * 10 for i in idx)                           # a generator instead of a list
    def __getitem__(self, i): return i
class Tup:
    def __len__(self): return 8
    def __getitems__(self, idx):
        return tuple(i * 10 for i in idx)
    def __getitem__(self, i): return i
class NP:
    def __len__(self): return 8
    def __getitems__(self, idx):
        import numpy as np
        return np.array(idx) * 10                               # one array for the batch
    def __getitem__(self, i): return i
for ds in (ColDict(), Gen(), Tup(), NP()):
    for cls in (DataLoader, ArenaLoader):
        for nw in (0,):
            try:
                b = next(iter(cls(ds, batch_size=2, num_workers=nw)))
                print(type(ds).__name__, cls.__name__, "OK", repr(b))
            except Exception as e:
                print(type(ds).__name__, cls.__name__, type(e).__name__, repr(str(e)[:300]))
