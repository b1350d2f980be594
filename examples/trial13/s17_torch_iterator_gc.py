"""Scenario 17 (torch behaviour, not ours): a torch iterator that raised and is kept alive, collected while a
second loader's workers run, blocks ~10 s in torch's _shutdown_workers (argv t: second loader torch, a: ours)."""
import sys, time, gc, numpy as np
from torch.utils.data import DataLoader
from arena_loader import ArenaLoader
class Bad:
    def __len__(self): return 20
    def __getitem__(self, i):
        if i == 2: raise TypeError("bad")
        return np.full(3, i)
class Good(Bad):
    def __getitem__(self, i): return np.full(3, i)
gc.disable()
try:
    for b in DataLoader(Bad(), batch_size=4, num_workers=2): pass
except TypeError as e:
    saved = e   # keeps torch's iterator alive through the traceback
cls = DataLoader if sys.argv[1] == "t" else ArenaLoader
kw = {} if sys.argv[1] == "t" else {"output": "torch"}
L = cls(Good(), batch_size=4, num_workers=2, **kw)
it = iter(L); next(it)
t = time.time(); del saved; gc.collect(); print(sys.argv[1], "torch iterator GC while second loader's workers run:", round(time.time() - t, 2), "s")
list(it)
t = time.time(); gc.collect(); print("gc2", round(time.time() - t, 2))
