"""skorch 1.4: ``NeuralNetClassifier(..., iterator_train=X, iterator_valid=X)`` with X torch's
DataLoader and ArenaLoader, the other options alike; compared: every batch the net's
callbacks see (``on_batch_begin``: structure, types, values, order), the history's losses and
accuracy per epoch, ``predict_proba`` and ``predict`` (iterator_valid without a split); then
leftovers. skorch makes each loader once per ``fit`` and never closes it.

``GridSearchCV`` with ``n_jobs`` 1 and 2 (joblib's loky processes) runs the same net.

Cases: X as numpy (skorch's Dataset gives numpy rows: torch's DataLoader collates tensors,
ArenaLoader numpy unless ``output="torch"``), the y-less ``predict`` path (skorch's placeholder
``y`` is a tensor), a seeded generator, ``drop_last``, a skorch ``ValidSplit``.
"""

from __future__ import annotations

import time

import common
import numpy as np
import skorch
import torch
from common import CONFIGS, Tally, describe, error, leftovers, shm_names, wants
from joblib.externals.loky import get_reusable_executor
from skorch.callbacks import Callback
from torch.utils.data import DataLoader

from arena_loader import ArenaLoader


class Seen(Callback):
    def __init__(self):
        self.batches = []

    def on_batch_begin(self, net, batch=None, training=None, **kwargs):
        self.batches.append((training, describe(batch)))


class Module(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = common.model()

    def forward(self, x):
        return torch.softmax(self.net(x), dim=-1)


def data():
    x = np.stack([common.Arrays()[i]["x"] for i in range(common.N)]).astype(np.float32)
    y = (np.arange(common.N) % 3).astype(np.int64)
    return x, y


def run(loader_cls, options: dict, extra: dict, split: bool, generator: bool):
    common.seed_all()
    seen = Seen()
    kw = {f"iterator_train__{k}": v for k, v in {**options, **extra}.items()}
    kw.update({f"iterator_valid__{k}": v for k, v in options.items()})
    kw.update({f"iterator_valid__{k}": v for k, v in extra.items() if k != "drop_last"})
    if generator:
        kw["iterator_train__generator"] = torch.Generator().manual_seed(7)
    net = skorch.NeuralNetClassifier(
        Module, max_epochs=3, lr=0.3, batch_size=7, iterator_train=loader_cls,
        iterator_valid=loader_cls, iterator_train__shuffle=True, callbacks=[seen],
        train_split=skorch.dataset.ValidSplit(5) if split else None, verbose=0, **kw)
    x, y = data()
    out: dict = {}
    try:
        net.fit(x, y)
        out["history"] = [[round(float(e.get(k, -1)), 6) for k in
                           ("train_loss", "valid_loss", "valid_acc")] for e in net.history]
        out["proba"] = np.round(net.predict_proba(x), 6).tolist()
        out["predict"] = net.predict(x).tolist()
    except Exception as exc:
        out["error"] = error(exc)
    out["batches"] = seen.batches
    del net
    return out


def grid(loader_cls, n_jobs: int) -> dict:
    """``GridSearchCV(net, cv=2, n_jobs=n_jobs)``, 2 workers per loader: with n_jobs=2 the
    fits run in joblib's loky worker processes, whose start method is loky's."""
    from sklearn.model_selection import GridSearchCV

    common.seed_all()
    extra = {"iterator_train__output": "torch", "iterator_valid__output": "torch"} \
        if loader_cls is ArenaLoader else {}
    net = skorch.NeuralNetClassifier(
        Module, max_epochs=1, lr=0.3, batch_size=8, iterator_train=loader_cls,
        iterator_valid=loader_cls, iterator_train__num_workers=2,
        iterator_valid__num_workers=2, train_split=None, verbose=0, **extra)
    x, y = data()
    search = GridSearchCV(net, {"lr": [0.3]}, cv=2, n_jobs=n_jobs, scoring="accuracy",
                          error_score="raise")
    started = time.monotonic()
    try:
        search.fit(x, y)
        return {"scores": search.cv_results_["split0_test_score"].round(6).tolist(),
                "seconds": round(time.monotonic() - started, 1)}
    except Exception as exc:
        return {"error": error(exc)}
    finally:  # joblib keeps its loky workers for the next call: not ours to count
        get_reusable_executor().shutdown(wait=True)


def main() -> None:
    tally = Tally()
    for n_jobs in (1, 2):
        name = f"skorch/GridSearchCV/n_jobs={n_jobs}"
        if not wants(name):
            continue
        before = shm_names()
        want, got = grid(DataLoader, n_jobs), grid(ArenaLoader, n_jobs)
        note = f"torch {want.get('seconds', want.get('error'))}, ours {got.get('seconds')} s"
        if "error" in want and "error" not in got:
            # torch's own: its DataLoader cannot start workers in a loky process
            tally.add("torch-fails", name, note)
            for found in leftovers(before):
                tally.add("LEAK", name, found)
            continue
        want.pop("seconds", None), got.pop("seconds", None)
        tally.check(name, want, got, before, note)
    for config, options in CONFIGS.items():
        for label, extra, split, generator in (
            ("shuffle", {}, False, False),
            ("shuffle-generator", {}, False, True),
            ("drop_last", {"drop_last": True}, False, False),
            ("validsplit", {}, True, False),
        ):
            for output in (None, "torch"):
                name = f"skorch/{label}/{config}/output={output}"
                if not wants(name):
                    continue
                before = shm_names()
                want = run(DataLoader, options, extra, split, generator)
                arena_extra = dict(extra, **({"output": output} if output else {}))
                got = run(ArenaLoader, options, arena_extra, split, generator)
                n = sum(1 for _ in got["batches"])
                note = f"{n} batches" + (f" {got['error']}" if "error" in got else "")
                tally.check(name, want, got, before, note)
    tally.done()


if __name__ == "__main__":
    main()
