"""How much does the number of slots a worker rotates through cost a copy-bound worker?

    .venv/bin/python benchmarks/slot_rotation.py                # 2 and 3 slots, 3 rounds
    .venv/bin/python benchmarks/slot_rotation.py --slots 2,3,4 --rounds 5

No loader: ``--workers`` forked processes each copy image batches (64 rows of uint8
3x224x224, 9.6 MB, gathered from a 64-row pool as floor.py's dataset gives them) into slots of
their own in one shared anonymous mapping, round-robin over ``slots`` slots, and report their
CPU per batch. floor.py's worker rotates 2 slots (``depth=2``: the one it writes, the one handed
out); ArenaLoader's default keeps torch's read-ahead (``prefetch_factor * num_workers`` batches
in flight) plus the batch handed out, 3 slots a worker with 2 workers. Cases alternate within a
round, each in fresh processes.

Results (2026-11-26, 2-core AMD EPYC VM, one 32 MB L3; docs/benchmarks.md, thirteenth session),
us of CPU per batch, each worker, 2 slots against 3: 913-1,075 against 1,054-1,272 (a first
script, 3 alternations, quiet machine); median 779 against 935, then 880 against 897
(`--batches 600 --rounds 2`, two other test runs beside it). With 9.6 MB slots the third
leaves less of the L3 to the lines being written, by 2-20% here. With glibc's non-temporal
stores from 64 KB up (`GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=0x10000`, a row
is 147 KB) 904 against 891: no faster.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time

import numpy as np

SHAPE = (3, 224, 224)
ROWS = 64


def _worker(w: int, slots: int, batches: int, pool: np.ndarray, slab: np.ndarray,
            out_fd: int) -> None:
    nbytes = ROWS * pool[0].nbytes
    outs = [np.ndarray((ROWS, *SHAPE), np.uint8, slab, (w * slots + j) * nbytes)
            for j in range(slots)]
    for out in outs:  # every page faulted in before the clock starts
        out[...] = 0
    order = np.random.default_rng(w).permutation(2048)
    start = time.process_time()
    for b in range(batches):
        first = (b % 32) * ROWS
        rows = [pool[i % 64] for i in order[first: first + ROWS].tolist()]
        outs[b % slots][...] = rows
    os.write(out_fd, f"{1e6 * (time.process_time() - start) / batches:.1f}\n".encode())


def measure(slots: int, workers: int, batches: int, pool: np.ndarray) -> list[float]:
    """CPU us per batch of each of ``workers`` concurrent processes rotating ``slots``."""
    mapping = mmap.mmap(-1, workers * slots * ROWS * pool[0].nbytes)
    slab = np.frombuffer(mapping, np.uint8)
    read_fd, write_fd = os.pipe()
    pids = []
    for w in range(workers):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _worker(w, slots, batches, pool, slab, write_fd)
            except BaseException:
                code = 1
            os._exit(code)
        pids.append(pid)
    os.close(write_fd)
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"a worker of the {slots}-slot case failed")
    with os.fdopen(read_fd) as results:
        figures = [float(line) for line in results.read().split()]
    del slab
    mapping.close()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", default="2,3", help="slot counts to compare (comma-separated)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batches", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    counts = [int(n) for n in args.slots.split(",")]
    pool = np.random.default_rng(0).integers(0, 256, size=(64, *SHAPE), dtype=np.uint8)
    per_count: dict[int, list[float]] = {n: [] for n in counts}
    for r in range(args.rounds):
        for n in counts if r % 2 == 0 else counts[::-1]:
            figures = measure(n, args.workers, args.batches, pool)
            per_count[n].extend(figures)
            print(f"round {r + 1}: {n} slots a worker: "
                  + ", ".join(f"{f:,.0f}" for f in figures) + " us of CPU a batch", flush=True)
    for n, figures in per_count.items():
        print(f"{n} slots a worker: median {statistics.median(figures):,.0f} us a batch "
              f"[{min(figures):,.0f}-{max(figures):,.0f}] over {len(figures)} worker runs")


if __name__ == "__main__":
    main()
