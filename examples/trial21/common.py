"""trial21 harness: trial19's (Tally, first_difference, leftovers, seeding, configs), loaded
from there as trial20 loads it, plus a ``describe`` that also spells out what these libraries
put in a batch: tensor subclasses by class name (PyG's ``EdgeIndex``), PyG ``Data`` /
``HeteroData`` / ``Batch`` objects by class, stores and ``to_data_list()``, and ``None``.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "trial19", "common.py")
_spec = importlib.util.spec_from_file_location("trial19_common", _path)
trial19 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trial19)
Tally, CONFIGS, SEED = trial19.Tally, trial19.CONFIGS, trial19.SEED
error, seed_all, shm_names = trial19.error, trial19.seed_all, trial19.shm_names
wants = trial19.wants


def describe(batch: Any) -> Any:
    """A batch as plain Python (trial19's shape: ``("tensor", dtype, values)`` leaves, so its
    ``untyped`` applies), a tensor subclass's class name joined to the dtype."""
    if isinstance(batch, torch.Tensor):
        name = "" if type(batch) is torch.Tensor else "/" + type(batch).__name__
        return ("tensor", f"{batch.dtype}{name}", batch.tolist())
    if isinstance(batch, np.ndarray):
        return ("ndarray", str(batch.dtype), batch.tolist())
    if hasattr(batch, "to_dict") and hasattr(batch, "stores"):       # a PyG Data / Batch
        out = {"class": ("str", type(batch).__name__), "stores": describe(batch.to_dict())}
        if hasattr(batch, "to_data_list"):
            out["num_graphs"] = ("int", batch.num_graphs)
            out["data_list"] = describe(batch.to_data_list())
        return out
    if isinstance(batch, dict):
        return {str(k): describe(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return (type(batch).__name__, [describe(v) for v in batch])
    return (type(batch).__name__, batch)


def stop_torch(loader: Any) -> None:
    """Shut down a torch DataLoader's persistent workers (dropped, torch's take about 10 s to
    go in the leftover check's collection: trial19); ArenaLoaders are left to be dropped, as
    that check is for them. Returns None, for ``loader = stop_torch(loader)``."""
    iterator = getattr(loader, "_iterator", None)
    if isinstance(loader, DataLoader) and iterator is not None:
        iterator._shutdown_workers()
