"""fastai 2.8 with torch's DataLoader objects, the "pure PyTorch to fastai" pattern:
``DataLoaders(train_loader, valid_loader)``, ``Learner(dls, model, ...)``, ``fit(2)``, then
``validate()`` and ``get_preds(dl=valid_loader)``; once with torch's DataLoader and once with
ArenaLoader, the other options alike. Compared: every batch a callback sees (``before_batch``:
``xb``, ``yb``, types and values, training and validation), the recorder's losses and
accuracy per epoch, ``validate()``'s and ``get_preds``' results; then leftovers. fastai never
closes the loaders.

Samples are ``(x, y)`` tuples of tensors, or of a numpy array and an int (``Arrays``: with
``output=None`` ArenaLoader gives numpy, which fastai's ``accuracy`` cannot take).
"""

from __future__ import annotations

import common
import numpy as np
import torch
from common import CONFIGS, Tally, describe, error, shm_names, wants
from fastai.basics import SGD, Callback, DataLoaders, Learner, accuracy
from torch.utils.data import DataLoader, Dataset

from arena_loader import ArenaLoader


class Pairs(Dataset):
    def __init__(self, n: int, numpy: bool = False):
        self.rows, self.numpy = common.Tensors(n), numpy

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        s = self.rows[i]
        return (s["x"].numpy(), int(s["y"])) if self.numpy else (s["x"], s["y"])


class Seen(Callback):
    def __init__(self):
        self.batches = []

    def before_batch(self):
        self.batches.append((self.training, describe(self.xb), describe(self.yb)))


def run(loader_cls, options: dict, extra: dict, numpy: bool, generator: bool) -> dict:
    common.seed_all()
    kw = dict(options, **extra)
    train_kw = dict(kw, shuffle=True)
    if generator:
        train_kw["generator"] = torch.Generator().manual_seed(7)
    train = loader_cls(Pairs(40, numpy), batch_size=8, **train_kw)
    valid = loader_cls(Pairs(20, numpy), batch_size=8, **kw)
    seen = Seen()
    learn = Learner(DataLoaders(train, valid), common.model(),
                    loss_func=torch.nn.functional.cross_entropy, opt_func=SGD, lr=0.3,
                    metrics=accuracy, cbs=[seen])
    out: dict = {}
    try:
        with learn.no_logging():
            learn.fit(2)
            out["recorder"] = [[round(float(v), 5) for v in r] for r in learn.recorder.values]
            out["validate"] = [round(float(v), 5) for v in learn.validate()]
            preds, targs = learn.get_preds(dl=valid)
            out["preds"] = np.round(preds.numpy(), 5).tolist()
            out["targs"] = describe(targs)
    except Exception as exc:
        out["error"] = error(exc)
    out["batches"] = seen.batches
    return out


def main() -> None:
    tally = Tally()
    for config, options in CONFIGS.items():
        for generator in (False, True):
            for numpy, outputs in ((False, (None,)), (True, (None, "torch"))):
                for output in outputs:
                    name = (f"fastai/{'Arrays' if numpy else 'Tensors'}/{config}/"
                            f"{'gen' if generator else 'global'}/output={output}")
                    if not wants(name):
                        continue
                    before = shm_names()
                    extra = {"output": output} if output else {}
                    want = run(DataLoader, options, {}, numpy, generator)
                    got = run(ArenaLoader, options, extra, numpy, generator)
                    if numpy and output is None and "error" in got and "error" not in want:
                        # documented (docs/migrating.md): numpy samples give numpy batches
                        # by default; fastai's model call and metrics need tensors
                        tally.add("numpy", name, got["error"])
                        continue
                    tally.check(name, want, got, before,
                                f"{len(got['batches'])} batches {got.get('error', '')}")
    tally.done()


if __name__ == "__main__":
    main()
