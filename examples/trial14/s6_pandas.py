"""Scenario 6: pandas/sklearn: datasets over a DataFrame's rows (Series samples with mixed
dtypes, categorical, datetime64, object and nullable columns; to_dict rows; numeric rows as
float32 arrays), sklearn's StandardScaler/OneHotEncoder in __getitem__, a collate_fn building a
DataFrame, batch_size=None with Series samples."""

import os
import sys
import warnings

import numpy as np
import pandas as pd
from sklearn.preprocessing import OneHotEncoder, StandardScaler

sys.path.insert(0, os.path.dirname(__file__))
from common import compare, report_end, seeded, shm, variants

warnings.simplefilter("ignore")
N = 17
rng = np.random.default_rng(5)
DF = pd.DataFrame({
    "x": rng.standard_normal(N), "y": rng.integers(0, 100, N),
    "cat": pd.Categorical(rng.choice(["a", "b", "c"], N)),
    "when": pd.date_range("2024-01-01", periods=N, freq="h"),
    "name": [f"row{i}" for i in range(N)],
    "maybe": pd.array([i if i % 4 else None for i in range(N)], dtype="Int64"),
    "flag": rng.random(N) > 0.5,
})
NUMERIC = ["x", "y", "flag"]
SCALER = StandardScaler().fit(DF[["x", "y"]])
ONEHOT = OneHotEncoder(sparse_output=False).fit(DF[["cat"]])


class Rows:
    def __init__(self, how):
        self.how = how

    def __len__(self):
        return N

    def __getitem__(self, i):
        row = DF.iloc[i]
        if self.how == "series":
            return row
        if self.how == "numeric series":
            return DF[["x", "y"]].iloc[i]
        if self.how == "dict":  # numbers, str, bool, Timestamp, pd.NA
            return row.to_dict()
        if self.how == "dict no timestamp":
            d = row.to_dict()
            d.pop("when")
            d.pop("maybe")
            return d
        if self.how == "float32":
            return DF[NUMERIC].iloc[i].to_numpy(np.float32), int(row["y"] > 50)
        if self.how == "sklearn":
            frame = DF.iloc[[i]]
            return {"num": SCALER.transform(frame[["x", "y"]])[0].astype(np.float32),
                    "cat": ONEHOT.transform(frame[["cat"]])[0], "code": np.int8(row["cat"] == "a"),
                    "when": np.datetime64(row["when"], "s").astype(np.int64)}
        if self.how == "datetime64":
            return {"when": DF["when"].to_numpy()[i], "x": row["x"]}
        raise ValueError(self.how)


def frame_collate(batch):
    return pd.DataFrame(batch)


def idx_collate(batch):
    return DF.iloc[[r.name for r in batch]].copy(), np.array([r.name for r in batch])


if __name__ == "__main__":
    before = shm()
    base = dict(batch_size=4, shuffle=True)
    torch_out = {"output": "torch"}  # numpy samples: numpy batches otherwise (documented)
    for tag, kw in variants(base):
        for how in ("series", "numeric series", "dict", "dict no timestamp", "float32", "sklearn",
                    "datetime64"):
            compare(f"6 {how} default collate {tag}", Rows(how), seeded(kw), extra=torch_out)
        compare(f"6 series bs=None {tag}", Rows("series"), seeded(dict(kw, batch_size=None)))
        compare(f"6 DataFrame collate_fn {tag}", Rows("series"),
                seeded(dict(kw, collate_fn=frame_collate)))
        compare(f"6 iloc collate {tag}", Rows("series"), seeded(dict(kw, collate_fn=idx_collate)))
    report_end(before)
