"""Scenario 2: pyarrow / polars tables as map-style datasets."""

import os
import sys
import tempfile

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.ipc as ipc

sys.path.insert(0, os.path.dirname(__file__))
from common import compare, report_end, seeded, shm, variants  # noqa: E402

N = 29


def table():
    return pa.table({
        "id": pa.array(range(N), pa.int64()),
        "x": pa.array([i / 7 for i in range(N)], pa.float32()),
        "text": pa.array([f"row {i}" * (i % 3 + 1) for i in range(N)]),
        "emb": pa.array([[float(i), float(i) + 0.5, -1.0] for i in range(N)], pa.list_(pa.float32(), 3)),
        "flag": pa.array([i % 2 == 0 for i in range(N)]),
        "maybe": pa.array([None if i % 4 == 0 else i for i in range(N)], pa.int32()),
        "ts": pa.array(np.arange(N).astype("datetime64[s]")),
    })


class ArrowRows:
    """Rows of a memory-mapped IPC file, python scalars/strings + numpy arrays."""
    def __init__(self, path, cols=("id", "x", "text", "emb", "flag")):
        self.path, self.cols, self.t = path, cols, None

    def __len__(self):
        return N

    def _tab(self):
        if self.t is None:
            self.t = ipc.open_file(pa.memory_map(self.path)).read_all()
        return self.t

    def __getitem__(self, i):
        t = self._tab()
        row = {c: t.column(c)[i].as_py() for c in self.cols}
        if "emb" in row:
            row["emb"] = np.asarray(row["emb"], np.float32)
        return row


class ArrowBatched(ArrowRows):
    """__getitems__ returning a dict of columns (as HF datasets do)."""
    def __getitems__(self, idx):
        t = self._tab().take(pa.array(idx))
        return [{"id": r["id"], "x": r["x"], "text": r["text"],
                 "emb": np.asarray(r["emb"], np.float32)} for r in t.to_pylist()]


class ArrowColumns(ArrowRows):
    """__getitems__ returning one dict of columns, collated by a passthrough collate_fn."""
    def __getitems__(self, idx):
        t = self._tab().take(pa.array(idx))
        return {"id": t.column("id").to_numpy(), "x": t.column("x").to_numpy(),
                "text": t.column("text").to_pylist(),
                "emb": np.stack(t.column("emb").to_numpy(zero_copy_only=False))}


class PolarsRows:
    def __init__(self):
        self.df = pl.from_arrow(table())

    def __len__(self):
        return N

    def __getitem__(self, i):
        r = self.df.row(i, named=True)
        return {"id": r["id"], "x": r["x"], "text": r["text"], "emb": np.array(r["emb"], np.float32),
                "flag": r["flag"]}


class PolarsNumpy(PolarsRows):
    def __getitem__(self, i):
        return self.df[i].select("id", "x").to_numpy()[0]


def ident(b):
    return b


if __name__ == "__main__":
    before = shm()
    d = tempfile.mkdtemp()
    path = os.path.join(d, "t.arrow")
    with ipc.new_file(path, table().schema) as w:
        w.write_table(table())
    base = dict(batch_size=6, shuffle=True)
    for tag, kw in variants(base):
        compare(f"2 arrow rows {tag}", ArrowRows(path), seeded(kw), extra={"output": "torch"})
        compare(f"2 arrow getitems rows {tag}", ArrowBatched(path), seeded(kw), extra={"output": "torch"})
        compare(f"2 arrow getitems cols+ident {tag}", ArrowColumns(path), seeded(dict(kw, collate_fn=ident)))
        compare(f"2 polars rows {tag}", PolarsRows(), seeded(kw), extra={"output": "torch"})
        if kw["num_workers"] == 0:  # forked workers deadlock in polars' thread pool, torch's too
            compare(f"2 polars numpy {tag}", PolarsNumpy(), seeded(kw), extra={"output": "torch"})
    # None field: both should raise
    compare("2 arrow None field nw=2", ArrowRows(path, ("id", "maybe")), seeded(dict(base, num_workers=2)),
            extra={"output": "torch"})
    compare("2 arrow datetime field nw=0", ArrowRows(path, ("id", "ts")), seeded(dict(base, num_workers=0)),
            extra={"output": "torch"})
    compare("2 arrow rows drop_last nw=2", ArrowRows(path), seeded(dict(base, num_workers=2, drop_last=True)),
            extra={"output": "torch"})
    report_end(before)
