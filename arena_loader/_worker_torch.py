"""torch inside a worker, when the program uses it: set up as torch's own workers set it up
(one intra-op thread, its RNG seeded) and answering ``torch.utils.data.get_worker_info()``."""

from __future__ import annotations

import sys
from typing import Any

from .worker_info import WorkerInfo


def set_up_torch(seed: int, info: WorkerInfo, imported_now: bool, torch: Any) -> None:
    """torch in a worker as in torch's own: one intra-op thread, its RNG seeded (as its
    import completes: ``imported_now``; seed_worker seeded a loaded one) and its
    get_worker_info() answering. Inside the importer's ``import torch``: never raises."""
    try:
        if imported_now:
            torch.set_num_threads(1)
            torch.manual_seed(seed)
        publish_to_torch(info)
    except Exception:  # (a torch too old or too new for these calls: ours answer, not torch's)
        pass


def limit_torch_threads() -> None:
    """One intra-op thread per worker, as torch's own workers do: N workers each running
    torch's full thread pool oversubscribe the cores, and an OpenMP pool inherited from a
    parent that used it can hang the first parallel op of a forked child."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def publish_to_torch(info: WorkerInfo) -> None:
    """Make ``torch.utils.data.get_worker_info()`` answer too, when the program uses torch: a
    dataset written for torch's DataLoader shards by it, and must not see None in a worker
    (every worker would then yield the whole dataset)."""
    try:
        from torch.utils.data._utils import worker as torch_worker

        # Private: get_worker_info() returns this module global, and torch has no public
        # way to set it (its own worker loop assigns it the same way).
        torch_worker._worker_info = torch_worker.WorkerInfo(
            id=info.id, num_workers=info.num_workers, seed=info.seed, dataset=info.dataset)
    except (ImportError, AttributeError, TypeError):
        pass  # a torch without that private hook: only arena_loader.get_worker_info() answers
