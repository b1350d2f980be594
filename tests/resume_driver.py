"""The runs tests/test_resume.py compares: loaders built from a named configuration, run
whole or stopped after k batches (state saved), and resumed in a fresh interpreter:

    python -m tests.resume_driver STATES_PICKLE OUT_PICKLE

resumes each state of STATES_PICKLE (a dict: configuration name -> list of states) for the
rest of its epoch and one more, torch's global RNG scrambled before each, and writes the
batches of each resume to OUT_PICKLE (name -> list), or for a configuration whose resume
raised, the traceback.
Each batch is a list of (sample index, worker id, worker seed) rows: equal batches mean the
same samples, loaded by the same worker, seeded alike."""

from __future__ import annotations

import pickle
import sys
import time
import traceback
from typing import Any

import numpy as np
import torch

from arena_loader import ArenaLoader, get_worker_info
from arena_loader.samplers import DistributedSampler

SAMPLES = 23
BATCH_SIZE = 4
EPOCHS = 2


def _who() -> tuple[int, int]:
    info = get_worker_info()
    return (-1, 0) if info is None else (info.id, info.seed % 2**62)


class WhoLoads:
    """Map-style: sample ``i`` is ``(i, worker id, worker seed)``."""

    def __init__(self, samples: int = SAMPLES):
        self.samples = samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> np.ndarray:
        return np.array((index, *_who()), dtype=np.int64)


class ShardStream:
    """Iterable-style, sharded by worker: worker 0 has two thirds of the samples, so the
    other workers' iterators end first. No state_dict (StatefulShardStream has one)."""

    def __init__(self, samples: int = SAMPLES):
        self.samples = samples
        self.next = 0  # position within this worker's shard

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        cut = self.samples * 2 // 3
        if workers == 1:
            mine = list(range(self.samples))
        else:
            mine = list(range(cut)) if worker == 0 else list(range(cut, self.samples))[
                worker - 1::workers - 1]
        while self.next < len(mine):
            index = mine[self.next]
            self.next += 1
            yield np.array((index, *_who()), dtype=np.int64)
        self.next = 0  # exhausted: the next epoch starts over


class StatefulShardStream(ShardStream):
    def state_dict(self) -> dict:
        return {"next": self.next}

    def load_state_dict(self, state: dict) -> None:
        self.next = state["next"]


CONFIGS = {
    "in_process": {"num_workers": 0, "shuffle": True},
    "workers": {"num_workers": 2, "shuffle": True},
    "persistent": {"num_workers": 2, "shuffle": True, "persistent_workers": True},
    "in_order_generator": {"num_workers": 2, "shuffle": True, "in_order": True,
                           "generator": 7},
    "distributed": {"num_workers": 2, "distributed": True},
    "threads": {"num_workers": 2, "shuffle": True, "worker_mode": "thread"},
    "iterable_stateful": {"num_workers": 2, "dataset": "stateful_stream"},
    "iterable_stateless": {"num_workers": 2, "dataset": "stream"},
    "iterable_in_process": {"num_workers": 0, "dataset": "stateful_stream"},
}


def make_loader(name: str, **overrides: Any) -> ArenaLoader:
    config = {**CONFIGS[name], **overrides}
    dataset_kind = config.pop("dataset", "map")
    dataset: Any = {"map": WhoLoads, "short": lambda: WhoLoads(SAMPLES - 1),
                    "stream": ShardStream,
                    "stateful_stream": StatefulShardStream}[dataset_kind]()
    if config.pop("distributed", False):
        config["sampler"] = DistributedSampler(dataset, num_replicas=2, rank=1, seed=3)
    if config.get("generator") is not None:
        config["generator"] = torch.Generator().manual_seed(config["generator"])
    config.setdefault("batch_size", BATCH_SIZE)
    # (torch refuses a timeout with num_workers=0)
    return ArenaLoader(dataset, timeout=30 if config.get("num_workers") else 0, **config)


def _epoch(loader: ArenaLoader, epoch: int) -> Any:
    if hasattr(loader.sampler, "set_epoch"):
        loader.sampler.set_epoch(epoch)  # as a training loop does for DistributedSampler
    return loader


def wait_for_prefetch(loader: ArenaLoader, timeout_s: float = 10.0) -> bool:
    """Until batches beyond those handed out are sent to workers (in flight)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(it.in_flight for it in loader.snapshot().iterators):
            return True
        time.sleep(0.01)
    return False


def rows(batch: Any) -> list[tuple[int, ...]]:
    return [tuple(int(v) for v in row) for row in np.asarray(batch)]


def run_whole(name: str, epochs: int = EPOCHS) -> list:
    with make_loader(name) as loader:
        return [rows(b) for epoch in range(epochs) for b in _epoch(loader, epoch)]


def run_and_stop(name: str, stop_after: int | None) -> tuple[list, dict]:
    """The first epoch's first ``stop_after`` batches and the state then (None: the whole
    epoch, state taken after its StopIteration)."""
    with make_loader(name) as loader:
        batches = []
        if stop_after == 0:
            return batches, loader.state_dict()
        for batch in _epoch(loader, 0):
            batches.append(rows(batch))
            if len(batches) == stop_after:
                break
        return batches, loader.state_dict()


def resume(name: str, state: dict, epochs: int = EPOCHS) -> list:
    """The batches after ``state``, to the end of epoch ``epochs - 1``."""
    with make_loader(name) as loader:
        loader.load_state_dict(state)
        return [rows(b) for epoch in range(state["epoch"], epochs)
                for b in _epoch(loader, epoch)]


def main(states_path: str, out_path: str) -> None:
    with open(states_path, "rb") as file:
        states = pickle.load(file)
    resumed: dict[str, Any] = {}
    for name, its_states in states.items():
        try:
            resumed[name] = []
            for scramble, state in enumerate(its_states):
                torch.manual_seed(1000 + scramble)  # nothing may depend on this process's RNG
                resumed[name].append(resume(name, state))
        except Exception:  # the configuration's test fails with it; the others go on
            resumed[name] = traceback.format_exc()
    with open(out_path, "wb") as file:
        pickle.dump(resumed, file)


if __name__ == "__main__":
    main(*sys.argv[1:])
