"""trial17 s6: a Lance dataset (pylance, written here with pyarrow in 3 fragments) read by
index, torch's DataLoader beside ArenaLoader with the same options (common.compare):

* ``lance.torch.data.SafeLanceDataset``: map-style, ``__getitems__`` = ``take(indices)``
  rows as Python values (lists for fixed-size-list columns), opened lazily per worker;
* ``Rows``: ``take([i])`` per sample, fixed-size-list columns as numpy (uint8 image 3x4x4,
  float32 embedding), opened lazily per process;
* ``Bulk``: ``__getitems__`` with one ``take(indices)`` cut into numpy rows;
* a null in a column (default collation raises);
* ``lance.torch.data.LanceDataset`` (iterable, its own batches of 4, loader
  ``batch_size=None``, no shuffle).

lance's runtime threads do not survive fork (a worker forked after the parent wrote or read
the dataset can wait forever inside lance: trial15 saw it, and torch's DataLoader hung so here
with ``LanceDataset``), so every run with workers uses ``forkserver``, both loaders.

    .venv/bin/python examples/trial17/s6_lance.py [substring of case names]
"""

from __future__ import annotations

import functools
import os

import common
import lance
import numpy as np
import pyarrow as pa
from lance.torch.data import LanceDataset, SafeLanceDataset

ROOT = "/tmp/trial17"
N = 22


def fixed(values: np.ndarray, width: int) -> pa.Array:
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), width)


def write(name: str, with_null: bool = False) -> str:
    path = os.path.join(ROOT, name)
    img = (np.arange(N * 48) * 7 % 256).astype(np.uint8)
    emb = (np.arange(N * 4) / 8).astype(np.float32)
    label = [None if with_null and i == 9 else i % 3 for i in range(N)]
    table = pa.table({"id": pa.array(range(N), pa.int64()), "img": fixed(img, 48),
                      "emb": fixed(emb, 4), "label": pa.array(label, pa.int32()),
                      "text": [f"caption {i}" for i in range(N)]})
    lance.write_dataset(table, path, mode="overwrite", max_rows_per_file=8)
    return path


class Rows:
    def __init__(self, uri: str):
        self.uri, self._ds = uri, None

    def __len__(self):
        return N

    @property
    def ds(self):
        if self._ds is None:  # opened in the process that reads (each worker its own)
            self._ds = lance.dataset(self.uri)
        return self._ds

    def __getstate__(self):
        return {"uri": self.uri, "_ds": None}

    def __getitem__(self, i):
        row = self.ds.take([i]).to_pylist()[0]
        return {"id": row["id"], "img": np.asarray(row["img"], np.uint8).reshape(3, 4, 4),
                "emb": np.asarray(row["emb"], np.float32), "label": row["label"],
                "text": row["text"]}


class Bulk(Rows):
    def __getitems__(self, indices):
        table = self.ds.take(list(indices))
        img = table["img"].combine_chunks().flatten().to_numpy().reshape(-1, 3, 4, 4)
        emb = table["emb"].combine_chunks().flatten().to_numpy().reshape(-1, 4)
        ids = table["id"].to_numpy()
        return [{"id": ids[j], "img": img[j], "emb": emb[j]} for j in range(len(ids))]


ITERABLE_CONFIGS = [
    ("nw0", {"num_workers": 0}, {}),
    ("nw2", {"num_workers": 2}, {}),
    ("nw2-persist", {"num_workers": 2, "persistent_workers": True}, {}),
]


if __name__ == "__main__":
    os.makedirs(ROOT, exist_ok=True)
    uri, null_uri = write("lance_plain"), write("lance_null", with_null=True)
    tally = common.Tally()
    compare = functools.partial(common.compare, tally)
    by_forkserver = common.forkserver(common.LOADER_CONFIGS)
    compare("lance SafeLanceDataset", lambda: SafeLanceDataset(uri), configs=by_forkserver)
    compare("lance take([i]) numpy rows", lambda: Rows(uri),
            configs=[by_forkserver[i] for i in (0, 2, 3, 4)])
    compare("lance __getitems__ take(indices)", lambda: Bulk(uri),
            configs=[by_forkserver[i] for i in (0, 1, 3)])
    compare("lance null label (raises)", lambda: Rows(null_uri),
            configs=common.forkserver(common.ERROR_CONFIGS))
    compare("lance.torch LanceDataset", lambda: LanceDataset(
        uri, batch_size=4, columns=["id", "img", "emb"]),
            configs=common.forkserver(ITERABLE_CONFIGS), batch_size=None, shuffle=False)
    tally.done()
