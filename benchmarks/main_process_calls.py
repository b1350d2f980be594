"""What one tiny-row batch (float32[16], batch 256) costs each side. Main process, 2
persistent workers: function calls per ``next()`` (Python and C, counted with
``sys.setprofile`` over 20 steady-state calls) and user/system CPU per batch (``getrusage``
over 4 epochs of 256 batches), beside the same loop's batches/s. A worker's pieces, timed in
this process on one batch: fetching the samples, planning them (default collation), writing
them into storage, and the floor's single ``np.concatenate`` for comparison.

    .venv/bin/python benchmarks/main_process_calls.py

Result (2026-11-24, 2-core AMD EPYC, quiet): 96-101 calls per next() (the first stage of
engine v3 made ~115); 26-46 us user + 1-20 us system per batch at 7,200-10,200 batches/s;
worker pieces: fetch 35 us, plan 10 us (22 at the first stage), write 31 us, the floor's
concatenate 26 us.
docs/benchmarks.md, "Engine v3, second stage".
"""

from __future__ import annotations

import collections
import resource
import sys
import time

import numpy as np

from arena_loader import ArenaLoader
from arena_loader._layout import prepare_samples
from arena_loader.bench.workloads import PooledArrays


def per_call_us(call, repeats: int = 3000) -> float:
    call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return 1e6 * (time.perf_counter() - start) / repeats


def worker_pieces(dataset: PooledArrays) -> None:
    indices = np.random.default_rng(0).permutation(len(dataset))[:256].tolist()
    samples = [dataset[i] for i in indices]
    prepared = prepare_samples(samples, indices)
    storage = np.zeros(prepared.nbytes, np.uint8)
    out = storage[: 256 * 16 * 4].view(np.float32)
    print(f"worker pieces per batch: fetch {per_call_us(lambda: [dataset[i] for i in indices]):.0f}"
          f" us, plan {per_call_us(lambda: prepare_samples(samples, indices)):.0f} us, write "
          f"{per_call_us(lambda: prepared.write(storage)):.0f} us; the floor's concatenate "
          f"{per_call_us(lambda: np.concatenate(samples, out=out, casting='no')):.0f} us")


def main() -> None:
    dataset = PooledArrays(65536, (16,), np.float32)
    with ArenaLoader(dataset, batch_size=256, num_workers=2, shuffle=True,
                     persistent_workers=True, output="numpy") as loader:
        iterator = iter(loader)
        for _ in range(50):
            next(iterator)
        calls: collections.Counter = collections.Counter()

        def count(frame, event, arg):
            if event == "call":
                calls[f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}"] += 1
            elif event == "c_call":
                calls[f"C:{getattr(arg, '__qualname__', arg)}"] += 1

        steps = 20
        sys.setprofile(count)
        for _ in range(steps):
            batch = next(iterator)
            del batch
        sys.setprofile(None)
        del iterator
        print(f"{sum(calls.values()) / steps:.0f} calls per next(); the most frequent:")
        for name, n in calls.most_common(12):
            print(f"  {n / steps:5.1f}  {name}")
        for _ in loader:  # a fresh epoch for the timed part
            pass
        before, start, batches = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), 0
        for _ in range(4):
            for batch in loader:
                batches += 1
                del batch
        after, seconds = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - start
    user = 1e6 * (after.ru_utime - before.ru_utime) / batches
    system = 1e6 * (after.ru_stime - before.ru_stime) / batches
    print(f"{batches / seconds:,.0f} batches/s; main process {user:.0f} us user + "
          f"{system:.0f} us system per batch")
    worker_pieces(dataset)


if __name__ == "__main__":
    main()
