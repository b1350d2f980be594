"""Scenario 9: zarr arrays (opened in the parent / lazily), HF IterableDataset sharded by worker."""

import os
import sys
import tempfile

import numpy as np
import zarr
from datasets import Dataset

sys.path.insert(0, os.path.dirname(__file__))
from common import compare, report_end, seeded, shm, variants  # noqa: E402

N = 30


class ZarrEager:
    def __init__(self, path):
        self.z = zarr.open_group(path, mode="r")

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"img": self.z["img"][i], "label": int(self.z["label"][i])}


class ZarrLazy:
    def __init__(self, path):
        self.path, self.z = path, None

    def __len__(self):
        return N

    def __getitem__(self, i):
        if self.z is None:
            self.z = zarr.open_group(self.path, mode="r")
        return {"img": self.z["img"][i], "label": int(self.z["label"][i])}


if __name__ == "__main__":
    before = shm()
    path = os.path.join(tempfile.mkdtemp(), "d.zarr")
    g = zarr.open_group(path, mode="w")
    g.create_array("img", data=np.random.default_rng(0).random((N, 3, 5)).astype(np.float32), chunks=(4, 3, 5))
    g.create_array("label", data=np.arange(N) % 4, chunks=(8,))
    base = dict(batch_size=4, shuffle=True)
    hf = Dataset.from_dict({"x": [[float(i)] * 3 for i in range(N)], "label": list(range(N))})
    for tag, kw in variants(base):
        compare(f"9 zarr lazy {tag}", ZarrLazy(path), seeded(kw), extra={"output": "torch"})
        os.environ["TRIAL_NOTE"] = tag
        compare(f"9 zarr opened in parent {tag}", ZarrEager(path), seeded(kw), extra={"output": "torch"})
        for ns in (1, 2, 4):
            it = hf.to_iterable_dataset(num_shards=ns).with_format("numpy")
            compare(f"9 hf iterable shards={ns} {tag}", it, lambda kw=kw: dict(kw, shuffle=False),
                    extra={"output": "torch"})
    report_end(before)
