"""Scenario 14: a collate_fn returning a DataFrame / Arrow table / other library objects."""

import os
import sys

import numpy as np
import pandas as pd
import polars as pl
import pyarrow as pa

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402
from common import compare, report_end, seeded, shm, variants  # noqa: E402


class Rows:
    def __len__(self):
        return 14

    def __getitem__(self, i):
        return {"id": i, "x": i / 4, "name": f"r{i}", "v": np.arange(3, dtype=np.float32) + i}


def to_pandas(b):
    return pd.DataFrame([{k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in r.items()} for r in b])


def to_polars(b):
    return pl.DataFrame([{k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in r.items()} for r in b])


def to_arrow(b):
    return pa.Table.from_pylist([{k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in r.items()}
                                 for r in b])


def to_pandas_np(b):
    """A DataFrame of numeric columns only: its values are one numpy block."""
    return pd.DataFrame({"id": [r["id"] for r in b], "x": [r["x"] for r in b]})


def to_recarray(b):
    return np.rec.fromrecords([(r["id"], r["x"], r["name"]) for r in b], names="id,x,name")


if __name__ == "__main__":
    before = shm()
    orig = common.plain

    def plain(x):
        if isinstance(x, (pd.DataFrame, pl.DataFrame)):
            return (type(x).__name__, str(x.dtypes if isinstance(x, pd.DataFrame) else x.schema),
                    orig(x.to_dict(orient="list") if isinstance(x, pd.DataFrame) else x.to_dict(as_series=False)))
        if isinstance(x, pa.Table):
            return ("Table", str(x.schema), orig(x.to_pydict()))
        return orig(x)
    common.plain = plain
    for tag, kw in variants(dict(batch_size=4, shuffle=True)):
        for fn in (to_pandas, to_polars, to_arrow, to_pandas_np, to_recarray):
            compare(f"14 collate_fn -> {fn.__name__} {tag}", Rows(), seeded(dict(kw, collate_fn=fn)))
    report_end(before)
