"""Shared memory over a loader's first epochs, sampled every 3 ms: the moment the first
batches (in one-off segments, made before the slab was sized) and the slab's first slots
live together. The bench's ``large`` workload (float32[250000] rows, batch 32: 32 MB batches,
512 samples, 2 workers, ``prefetch_factor=2``, persistent workers), ArenaLoader with the
bench's ``slots=5`` against torch's DataLoader, a ``for`` loop that drops each batch as the
next comes (the loop variable), 3 epochs; peak per epoch, each /dev/shm object once (pages
it has; ``arena_loader.bench.harness.shm_objects``), over this process and its children.

    .venv/bin/python benchmarks/first_epoch_memory.py [--loader arena|torch] [--rounds 3]

Result (2026-11-27, 2-core AMD EPYC, twenty-first session): docs/benchmarks.md, "The first
epoch's segments count against slots".
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

import numpy as np
import psutil

ROW = 250_000


class Pooled:
    """512 float32[250000] rows from a pool of 8 (the bench's ``PooledArrays``)."""

    def __init__(self, n: int = 512):
        self.n = n
        self.pool = [np.full((ROW,), i, np.float32) for i in range(8)]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return self.pool[i % 8]


def one_run(which: str) -> list[float]:
    from arena_loader.bench.harness import shm_objects

    me = psutil.Process()
    epoch, peaks, stop = [-1], {}, threading.Event()

    def sample() -> None:
        while not stop.is_set():
            objects: dict = {}
            for process in [me, *me.children(recursive=True)]:
                try:
                    objects.update(shm_objects(process.pid))
                except OSError:
                    pass
            peaks[epoch[0]] = max(peaks.get(epoch[0], 0), sum(objects.values()))
            time.sleep(0.003)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    if which == "arena":
        from arena_loader import ArenaLoader
        loader = ArenaLoader(Pooled(), batch_size=32, num_workers=2, prefetch_factor=2, slots=5,
                             persistent_workers=True)
    else:
        import torch.utils.data
        loader = torch.utils.data.DataLoader(Pooled(), batch_size=32, num_workers=2,
                                             prefetch_factor=2, persistent_workers=True)
    for e in range(3):
        epoch[0] = e
        for _batch in loader:  # (the loop variable holds each batch until the next comes)
            pass
        del _batch
    stop.set()
    sampler.join()
    if which == "arena":
        loader.close()
    return [peaks.get(e, 0) / 1e6 for e in range(3)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--loader", choices=["arena", "torch"])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.loader:
        print(" ".join(f"{mb:.0f}" for mb in one_run(args.loader)))
        return
    for r in range(args.rounds):  # each run in a fresh interpreter, loaders alternated
        for which in ("arena", "torch"):
            out = subprocess.run([sys.executable, __file__, "--loader", which], check=True,
                                 capture_output=True, text=True, env=os.environ).stdout.split()
            print(f"round {r + 1} {which:5}: peak shared memory by epoch (MB) {' / '.join(out)}")


if __name__ == "__main__":
    main()
