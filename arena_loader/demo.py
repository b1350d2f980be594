"""The main job: ArenaLoader against torch.utils.data.DataLoader on built-in synthetic data.

    python -m arena_loader.demo            # 4,096 uint8 3x224x224 samples, batch 64, 2 workers
    python -m arena_loader.demo --samples 512 --epochs 2

Both loaders read the same map-style dataset with the same batch size, worker count and
prefetch depth, with persistent workers; each epoch is timed from ``iter()`` to the last
batch. The first epoch includes start-up; later epochs are steady state.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable

import numpy as np

from .loader import ArenaLoader


class SyntheticImages:
    """``n`` uint8 images of ``shape``, served from a small pool so generating them is free."""

    def __init__(self, n: int, shape: tuple[int, ...], pool: int = 64, seed: int = 0):
        self.n = n
        self.images = np.random.default_rng(seed).integers(0, 256, size=(pool, *shape),
                                                           dtype=np.uint8)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.ndarray:
        return self.images[index % len(self.images)]


class CopyLimit:
    """The same batches copied row by row into a preallocated ring of buffers by one thread:
    what a single core can do with no loader at all."""

    def __init__(self, dataset: SyntheticImages, batch_size: int, slots: int):
        self.dataset, self.batch_size = dataset, batch_size
        shape = dataset.images.shape[1:]
        self.buffers = np.zeros((slots, batch_size, *shape), dtype=np.uint8)

    def __iter__(self):
        n = len(self.dataset)
        for k, start in enumerate(range(0, n, self.batch_size)):
            out = self.buffers[k % len(self.buffers)]
            rows = min(self.batch_size, n - start)
            for row in range(rows):
                out[row] = self.dataset[start + row]
            yield out[:rows]


def time_epochs(make_iterable: Callable[[], Iterable], epochs: int, checksum: bool
                ) -> tuple[list[float], int, float]:
    """Seconds per epoch, bytes per epoch, and time to the first batch of the first epoch."""
    loader = make_iterable()
    times, nbytes, first_batch_s = [], 0, float("nan")
    total = 0
    try:
        start_all = time.perf_counter()
        for _ in range(epochs):
            epoch_bytes = 0
            start = time.perf_counter()
            for batch in loader:
                if first_batch_s != first_batch_s:
                    first_batch_s = time.perf_counter() - start_all
                array = batch.numpy() if hasattr(batch, "numpy") else batch
                epoch_bytes += array.nbytes
                if checksum:  # touch one byte per batch: the data must really be there
                    total += int(array.reshape(-1)[-1])
                del batch, array
            times.append(time.perf_counter() - start)
            nbytes = epoch_bytes
    finally:
        close = getattr(loader, "close", None)
        if close is not None:
            close()
    return times, nbytes, first_batch_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--shape", default="3,224,224", help="per-sample uint8 shape")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3, help="at least 2: epoch 1 warms up")
    parser.add_argument("--slots", type=int, default=16)
    args = parser.parse_args(argv)
    if args.epochs < 2:
        parser.error(f"--epochs must be at least 2, got {args.epochs}")
    shape = tuple(int(s) for s in args.shape.split(","))
    dataset = SyntheticImages(args.samples, shape)
    common = dict(batch_size=args.batch_size, num_workers=args.workers,
                  persistent_workers=args.workers > 0)

    loaders: dict[str, Callable[[], Iterable]] = {
        "arena_loader.ArenaLoader": lambda: ArenaLoader(dataset, slots=args.slots, **common),
        "copy limit (1 thread)": lambda: CopyLimit(dataset, args.batch_size, args.slots),
    }
    try:
        import torch
        from torch.utils.data import DataLoader

        torch.set_num_threads(1)
        loaders["torch DataLoader"] = lambda: DataLoader(dataset, **common)
    except ImportError:
        print("torch is not installed: showing ArenaLoader alone (pip install torch==2.13.0)")

    batch_mb = args.batch_size * int(np.prod(shape)) / 1e6
    print(f"dataset: {args.samples} x uint8{list(shape)}, batch {args.batch_size} "
          f"({batch_mb:.1f} MB), {args.workers} workers, {args.epochs} epochs")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"python {platform.python_version()}, numpy {np.__version__}")
    results = {}
    for name, make in loaders.items():
        times, nbytes, first_s = time_epochs(make, args.epochs, checksum=True)
        steady = statistics.median(times[1:])
        results[name] = (nbytes / times[1] / 1e9, nbytes / steady / 1e9, times[0], first_s)
        print(f"  measured {name}")
    header = (f"{'loader':<26} {'epoch 2 GB/s':>13} {'median GB/s':>12} "
              f"{'epoch 1 s':>10} {'first batch s':>14}")
    print("\n" + header + "\n" + "-" * len(header))
    for name, (second, median, first_epoch_s, first_s) in results.items():
        print(f"{name:<26} {second:>13.2f} {median:>12.2f} {first_epoch_s:>10.2f} "
              f"{first_s:>14.3f}")
    arena = results["arena_loader.ArenaLoader"]
    print(f"\nArenaLoader / copy limit (1 thread), steady state: "
          f"{arena[1] / results['copy limit (1 thread)'][1]:.2f}x")
    if "torch DataLoader" in results:
        print(f"ArenaLoader / torch DataLoader, steady state: "
              f"{arena[1] / results['torch DataLoader'][1]:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
