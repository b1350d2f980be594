"""Scenario 1: h5py datasets with torch's DataLoader vs ArenaLoader."""

import os
import sys
import tempfile

import h5py
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import compare, report_end, seeded, shm, variants  # noqa: E402

N = 37


def make_file(path):
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f["images"] = rng.integers(0, 255, (N, 3, 8, 8), dtype=np.uint8)
        f["labels"] = np.arange(N, dtype=np.int64) % 5
        f["fl"] = rng.random((N, 4)).astype(np.float32)
        comp = np.zeros(N, dtype=[("id", "<i4"), ("score", "<f8"), ("xy", "<f4", (2,))])
        comp["id"] = np.arange(N)
        comp["score"] = np.arange(N) / 3
        comp["xy"] = rng.random((N, 2))
        f["comp"] = comp
        f["names"] = np.array([f"s{i}".encode() for i in range(N)])
        f.create_dataset("vl", (N,), dtype=h5py.vlen_dtype(np.float32))
        for i in range(N):
            f["vl"][i] = np.arange(i % 4 + 1, dtype=np.float32)


class Lazy:
    """(a) open lazily per worker."""
    def __init__(self, path):
        self.path, self.f = path, None

    def __len__(self):
        return N

    def __getitem__(self, i):
        if self.f is None:
            self.f = h5py.File(self.path, "r")
        return {"image": self.f["images"][i], "label": int(self.f["labels"][i]),
                "fl": self.f["fl"][i], "name": self.f["names"][i]}


class Eager:
    """(b) opened in the main process before the loader starts."""
    def __init__(self, path):
        self.f = h5py.File(path, "r")

    def __len__(self):
        return N

    def __getitem__(self, i):
        return self.f["images"][i], self.f["labels"][i]


class Batched(Lazy):
    """(c) __getitems__: one sorted fancy read per batch."""
    def __getitems__(self, idx):
        if self.f is None:
            self.f = h5py.File(self.path, "r")
        order = np.argsort(idx)
        s = np.asarray(idx)[order]
        if len(np.unique(s)) != len(s):
            return [self[i] for i in idx]
        inv = np.empty_like(order)
        inv[order] = np.arange(len(order))
        imgs = self.f["images"][s][inv]
        labels = self.f["labels"][s][inv]
        return [{"image": imgs[k], "label": int(labels[k])} for k in range(len(idx))]


class Compound(Lazy):
    """(d) compound dtype rows (np.void) and vlen."""
    def __getitem__(self, i):
        if self.f is None:
            self.f = h5py.File(self.path, "r")
        return self.f["comp"][i]


class CompoundFields(Lazy):
    def __getitem__(self, i):
        if self.f is None:
            self.f = h5py.File(self.path, "r")
        r = self.f["comp"][i]
        return {"id": r["id"], "score": r["score"], "xy": r["xy"]}


class VLen(Lazy):
    def __getitem__(self, i):
        if self.f is None:
            self.f = h5py.File(self.path, "r")
        return self.f["vl"][i]


def pad(batch):
    import torch
    L = max(len(b) for b in batch)
    out = torch.zeros(len(batch), L)
    for k, b in enumerate(batch):
        out[k, :len(b)] = torch.from_numpy(b)
    return out


if __name__ == "__main__":
    before = shm()
    d = tempfile.mkdtemp()
    path = os.path.join(d, "data.h5")
    make_file(path)
    base = dict(batch_size=8, shuffle=True)
    for tag, kw in variants(base):
        compare(f"1a lazy {tag} torch", Lazy(path), seeded(kw), extra={"output": "torch"})
        compare(f"1b eager {tag} torch", Eager(path), seeded(kw), extra={"output": "torch"})
        compare(f"1c getitems {tag} torch", Batched(path), seeded(kw), extra={"output": "torch"})
        compare(f"1d compound-fields {tag}", CompoundFields(path), seeded(kw), extra={"output": "torch"})
        compare(f"1d vlen pad {tag}", VLen(path), seeded(dict(kw, collate_fn=pad)))
    # compound rows: torch raises TypeError (documented difference)
    compare("1d compound rows nw=2", Compound(path), seeded(dict(base, num_workers=2)), extra={"output": "torch"})
    compare("1d compound rows batch_size=None nw=2", Compound(path), seeded(dict(batch_size=None, num_workers=2)))
    compare("1d vlen default collate nw=0", VLen(path), seeded(dict(base, num_workers=0)))
    # numpy default output (no output=) to see the documented numpy-vs-tensor difference is the only one
    compare("1a lazy nw=2 default output", Lazy(path), seeded(dict(base, num_workers=2)))
    report_end(before)
