"""Tiny numeric rows: ArenaLoader(ArrayDataset) against torch's DataLoader, and thread against
process workers on the same workloads. Reports samples/s; asserts nothing.

    .venv/bin/python benchmarks/numeric_throughput.py [--samples 131072] [--epochs 5]

Workloads (every loader sees the same arrays, batch 256 unless noted, shuffled, 2 workers,
persistent; one warm-up epoch, then the median epoch of ``--epochs``):

- ``tiny``: float32[16] rows plus an int64 label. ArenaLoader over ``ArrayDataset(x, y)``
  (compiled gather into the slot) vs torch ``DataLoader`` over a map-style dataset returning
  ``(x[i], y[i])`` (default collate), torch ``num_workers`` 0 and 2.
- ``per-sample``: the same rows through a plain ``__getitem__`` dataset (one Python call and
  one row copy per sample, holding the GIL): what threads cannot parallelise.
- ``wide``: uint8[3, 64, 64] rows, batch 64, through ``ArrayDataset`` (bigger copies, GIL
  released during the gather).

Latest results (2-core shared VM, 2026-11-22, other agents running: noisy, compare only within
one run; samples/s, median epoch; 1-minute load average 7.1 and 8.1 after runs 2 and 3; run 1
was on the commit before rebasing onto the worker-learned layout):

                                          run 1 (04:57)   run 2 (05:08)    run 3 (05:09)
    tiny: float32[16], batch 256, 131,072 samples
      torch DataLoader, num_workers=0              131,573          249,773           71,217
      torch DataLoader, num_workers=2               98,375           56,418           49,115
      ArenaLoader(ArrayDataset), 0 workers       2,423,566        1,299,023        1,071,484
      ArenaLoader(ArrayDataset), 2 process       1,396,131          304,456          438,904
      ArenaLoader(ArrayDataset), 2 thread        1,492,247          364,826          590,970
      ratio, 0 workers / best torch                  18.4x             5.2x            15.0x
      ratio, 2 process / torch 2 workers             14.2x             5.4x             8.9x
      ratio, 2 thread / torch 2 workers              15.2x             6.5x            12.0x
    per-sample: RowDataset, batch 256
      ArenaLoader, 2 process                       259,757           96,412          115,392
      ArenaLoader, 2 thread                        163,252           89,035          124,605
    wide: uint8[3, 64, 64], batch 64, 16,384 samples
      ArenaLoader(ArrayDataset), 2 process         149,843           74,151           80,407
      ArenaLoader(ArrayDataset), 2 thread          140,836          118,907           97,412

The >= 20x target over torch was not reached on this machine: 5-18x depending on the load
other agents put on the 2 cores during the run. With workers, tiny batches are bound by the
main process's per-batch work (sampler, dispatch, receive, lease: ~3,000-5,500 batches/s),
not by the gather; at 0 workers the largest single cost left is the batch sampler building a
Python list of 256 ints per batch.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable

import numpy as np

from arena_loader import ArenaLoader, ArrayDataset


class RowDataset:
    """Map-style: one Python call per sample, returning views of the arrays' rows."""

    def __init__(self, x: np.ndarray, y: np.ndarray):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]


def epoch_rates(loader: Iterable, samples: int, epochs: int) -> float:
    """Median samples/s over ``epochs`` epochs after one warm-up epoch."""
    rates = []
    for epoch in range(epochs + 1):
        start = time.perf_counter()
        count = 0
        for batch_x, _ in loader:
            count += len(batch_x)
        elapsed = time.perf_counter() - start
        assert count == samples, (count, samples)
        if epoch:  # the first epoch starts workers and compiles the gather
            rates.append(count / elapsed)
    return statistics.median(rates)


def arena(dataset, batch_size: int, workers: int, mode: str) -> Callable[[], ArenaLoader]:
    return lambda: ArenaLoader(dataset, batch_size=batch_size, shuffle=True, generator=0,
                               num_workers=workers, worker_mode=mode,
                               persistent_workers=workers > 0, slots=16)


def torch_loader(dataset, batch_size: int, workers: int):
    import torch.utils.data

    return lambda: torch.utils.data.DataLoader(
        dataset, batch_size=batch_size, shuffle=True, num_workers=workers,
        persistent_workers=workers > 0)


def run(name: str, make: Callable, samples: int, epochs: int) -> float:
    loader = make()
    try:
        rate = epoch_rates(loader, samples, epochs)
    finally:
        close = getattr(loader, "close", None)
        if close is not None:
            close()
    print(f"  {name:<44}{rate:>14,.0f}", flush=True)
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=131072)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    n, epochs = args.samples, args.epochs
    import torch

    print(f"python {platform.python_version()}, numpy {np.__version__}, torch "
          f"{torch.__version__}, {os.cpu_count()} CPUs, {sys.platform}")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 16), dtype=np.float32)
    y = rng.integers(0, 10, n)
    wide = rng.integers(0, 256, (n // 8, 3, 64, 64), dtype=np.uint8)
    wide_y = np.arange(n // 8)
    rates = {}
    print(f"tiny: float32[16], batch 256, {n:,} samples (samples/s)")
    for workers in (0, 2):
        rates[f"torch {workers}"] = run(f"torch DataLoader, num_workers={workers}",
                                        torch_loader(RowDataset(x, y), 256, workers), n, epochs)
    for workers, mode in ((0, "process"), (2, "process"), (2, "thread")):
        rates[f"arena {workers} {mode}"] = run(
            f"ArenaLoader(ArrayDataset), {workers} {mode}",
            arena(ArrayDataset(x, y), 256, workers, mode), n, epochs)
    best_torch = max(rates["torch 0"], rates["torch 2"])
    for key in ("arena 0 process", "arena 2 process", "arena 2 thread"):
        same = rates[f"torch {key.split()[1]}"]
        print(f"  ratio {key}: {rates[key] / best_torch:.1f}x best torch, "
              f"{rates[key] / same:.1f}x torch with the same num_workers")
    print("per-sample: RowDataset (__getitem__ per sample), batch 256 (samples/s)")
    for mode in ("process", "thread"):
        run(f"ArenaLoader(RowDataset), 2 {mode}", arena(RowDataset(x, y), 256, 2, mode), n,
            epochs)
    print(f"wide: uint8[3, 64, 64], batch 64, {n // 8:,} samples (samples/s)")
    for mode in ("process", "thread"):
        run(f"ArenaLoader(ArrayDataset), 2 {mode}",
            arena(ArrayDataset(wide, wide_y), 64, 2, mode), n // 8, epochs)


if __name__ == "__main__":
    main()
