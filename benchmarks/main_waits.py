"""Where the main process's CPU goes on tiny rows (float32[16], batch 256, 2 persistent
workers): its CPU per batch in a plain loop, then, under cProfile over 3 more epochs, the
share of its time spent in ``next()``'s spin (``sched_yield``) and the doorbell writes
(``os.write`` to a worker that had taken every published entry and went to sleep) per batch.

    .venv/bin/python benchmarks/main_waits.py

Result (2026-11-26, 2-core Intel Xeon, two runs): 20.8 and 24.7 us of main CPU a batch at
17.4k and 15.1k batches/s; under cProfile 42% and 38% of the main process's time in
``sched_yield``, doorbell writes for 27% and 19% of batches: the workers often wait for the
window (torch's ``prefetch_factor * num_workers`` batches), not the consumer for them.
docs/benchmarks.md, "The red CI run, and issue 24's memory split by process".
"""

from __future__ import annotations

import cProfile
import pstats
import time

from arena_loader import ArenaLoader
from arena_loader.bench.workloads import PooledArrays


def main() -> None:
    loader = ArenaLoader(PooledArrays(131072, (16,), "float32"), batch_size=256,
                         num_workers=2, persistent_workers=True)
    for _ in loader:  # warm-up: workers started, slab sized
        pass
    cpu, wall, batches = time.process_time(), time.perf_counter(), 0
    for _ in loader:
        batches += 1
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    print(f"plain loop: {cpu / batches * 1e6:.1f} us of main CPU a batch, "
          f"{batches / wall:,.0f} batches/s")
    profile, batches = cProfile.Profile(), 0
    profile.enable()
    for _ in range(3):
        for _ in loader:
            batches += 1
    profile.disable()
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    total = sum(entry[2] for entry in stats.values())
    yields = sum(entry[2] for key, entry in stats.items() if key[2].endswith("sched_yield>"))
    writes = sum(entry[1] for key, entry in stats.items()
                 if key[2] == "<built-in method posix.write>")
    print(f"under cProfile, {batches} batches: sched_yield {yields / total:.0%} of the main "
          f"process's time; {writes} doorbell writes ({writes / batches:.0%} of batches)")
    loader.close()


if __name__ == "__main__":
    main()
