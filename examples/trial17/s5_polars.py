"""trial17 s5: a polars DataFrame as a map-style dataset, torch's DataLoader beside
ArenaLoader with the same options (common.LOADER_CONFIGS x output None / "torch").

* ``Rows``: ``df.row(i, named=True)``, a dict of Python values per sample (int, float, bool,
  str, a list of ints, a fixed-size array column as a list);
* ``NumpyRows``: the same row as numpy values (float32 vector, numpy scalars);
* ``Bulk``: ``__getitems__`` takes the batch's rows in one ``df[indices]`` and returns them
  as dicts (``to_dicts()``) or as numpy rows cut from ``to_numpy()`` columns;
* a nullable column (None in some rows) and a date column: default collation raises.

polars' thread pool does not survive ``fork``: a worker forked after the parent used the pool
hangs in ``df[indices]`` (torch's DataLoader and ArenaLoader alike; polars documents
``spawn``/``forkserver``), so the ``__getitems__`` cases start workers with ``forkserver``,
both loaders; ``df.row(i)`` uses no pool and runs under ``fork``.

    .venv/bin/python examples/trial17/s5_polars.py [substring of case names]
"""

from __future__ import annotations

import datetime
import functools

import common
import numpy as np
import polars as pl

N = 22


def frame() -> pl.DataFrame:
    rng = np.random.default_rng(5)
    df = pl.DataFrame({
        "id": np.arange(N, dtype=np.int64),
        "x": rng.random(N),
        "x32": rng.random(N).astype(np.float32),
        "flag": np.arange(N) % 3 == 0,
        "name": [f"row{i}" for i in range(N)],
        "tags": [[i, i * 2] for i in range(N)],
        "vec": pl.Series([[i + j / 4 for j in range(4)] for i in range(N)],
                         dtype=pl.Array(pl.Float32, 4)),
        "maybe": [None if i % 5 == 3 else i for i in range(N)],
        "day": [datetime.date(2026, 1, 1 + i) for i in range(N)],
    })
    return df.sort("x").sort("id")  # the parent uses polars' thread pool, as real code does


PLAIN = ["id", "x", "x32", "flag", "name", "tags", "vec"]


class Rows:
    def __init__(self, columns=tuple(PLAIN)):
        self.df, self.columns = frame(), list(columns)

    def __len__(self):
        return N

    def __getitem__(self, i):
        row = self.df.row(i, named=True)  # no thread pool: safe in a forked worker
        return {c: row[c] for c in self.columns}


class NumpyRows(Rows):
    def __getitem__(self, i):
        row = self.df.row(i, named=True)
        return {"id": np.int64(row["id"]), "x": np.float64(row["x"]),
                "vec": np.asarray(row["vec"], np.float32), "flag": np.bool_(row["flag"])}


class Bulk(Rows):
    """Rows fetched together: ``__getitems__`` (torch's bulk protocol) over ``df[indices]``."""

    def __init__(self, as_numpy=False):
        super().__init__()
        self.as_numpy = as_numpy

    def __getitems__(self, indices):
        part = self.df[list(indices)].select(self.columns)
        if not self.as_numpy:
            return part.to_dicts()
        vec, x = part["vec"].to_numpy(), part["x"].to_numpy()
        return [{"vec": vec[j], "x": x[j], "id": int(part["id"][j])} for j in range(len(part))]


if __name__ == "__main__":
    tally = common.Tally()
    compare = functools.partial(common.compare, tally)
    compare("polars row() python values", Rows)
    compare("polars row() numpy values", NumpyRows)
    compare("polars nullable column (raises)", lambda: Rows(["id", "maybe"]),
            configs=common.ERROR_CONFIGS)
    compare("polars date column (raises)", lambda: Rows(["id", "day"]),
            configs=common.ERROR_CONFIGS)
    compare("polars rows, list collate_fn", Rows, collate_fn=list)
    by_forkserver = common.forkserver(common.LOADER_CONFIGS)
    compare("polars __getitems__ to_dicts", Bulk, configs=by_forkserver)
    compare("polars __getitems__ numpy rows", lambda: Bulk(as_numpy=True),
            configs=[by_forkserver[0], by_forkserver[2], by_forkserver[3]])
    tally.done()
