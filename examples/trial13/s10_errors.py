"""Scenario 10: error paths with these libraries: spawn + unpicklable h5py file, a failing sample
with persistent workers then the next epoch, an h5py Dataset object returned as a sample."""

import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import compare, report_end, shm  # noqa: E402
from s1_h5py import Eager, Lazy, make_file  # noqa: E402


class Flaky:
    """Fails on index 7 while a marker file exists (the user then fixes the data)."""
    def __init__(self, marker):
        self.marker = marker

    def __len__(self):
        return 20

    def __getitem__(self, i):
        if i == 7 and os.path.exists(self.marker):
            raise KeyError(f"bad sample {i}")
        return np.full(2, i)


class H5Object(Lazy):
    def __getitem__(self, i):
        super().__getitem__(i)
        return self.f["images"]


def flaky_run(cls, marker, nw, pw):
    import torch
    open(marker, "w").close()
    kw = dict(batch_size=4, num_workers=nw, generator=torch.Generator().manual_seed(0), shuffle=True)
    if nw:
        kw["persistent_workers"] = pw
    loader = cls(Flaky(marker), **kw)
    got = []
    try:
        for b in loader:
            got.append(np.asarray(b).tolist())
    except KeyError as e:
        got.append(f"KeyError after {len(got)} batches: {str(e).splitlines()[0]}")
    os.remove(marker)
    got.append([np.asarray(b).tolist() for b in loader])  # next epoch, data fixed
    if hasattr(loader, "close"):
        loader.close()
    return got


if __name__ == "__main__":
    from torch.utils.data import DataLoader

    from arena_loader import ArenaLoader
    before = shm()
    d = tempfile.mkdtemp()
    path = os.path.join(d, "data.h5")
    make_file(path)
    compare("10 spawn + h5py file opened in parent", Eager(path),
            lambda: dict(batch_size=4, num_workers=2, multiprocessing_context="spawn"), extra={"output": "torch"})
    compare("10 forkserver + lazy h5py", Lazy(path),
            lambda: dict(batch_size=4, num_workers=2, multiprocessing_context="forkserver"),
            extra={"output": "torch"})
    compare("10 h5py Dataset object as sample nw=2", H5Object(path), lambda: dict(batch_size=4, num_workers=2))
    compare("10 h5py Dataset object as sample nw=0", H5Object(path), lambda: dict(batch_size=4, num_workers=0))
    for nw, pw in ((0, False), (2, False), (2, True)):
        marker = os.path.join(d, "bad")
        t = flaky_run(DataLoader, marker, nw, pw)
        a = flaky_run(ArenaLoader, marker, nw, pw)
        print(f"[10 failing sample then next epoch nw={nw} pw={pw}] {'SAME' if t == a else 'DIFF'}")
        if t != a:
            print("   torch:", t[:-1], "next epoch batches:", len(t[-1]))
            print("   arena:", a[:-1], "next epoch batches:", len(a[-1]), "equal next epoch:", t[-1] == a[-1])
    report_end(before)
