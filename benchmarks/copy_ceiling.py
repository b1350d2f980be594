"""How fast can this machine copy image rows at all? The ceiling for any loader that writes
each byte once.

    .venv/bin/python benchmarks/copy_ceiling.py

Copies 64 rows of uint8 3x224x224 (one 9.6 MB batch) row by row into a ring of 16 batch
buffers, 128 batches per process, in 1 and then N concurrent processes, into anonymous memory
and into an arena_loader slab (POSIX shared memory). Prints GB/s per process and in total.

Latest results (2-core Intel Xeon VM, 2026-11-22; this VM is noisy, so compare figures only
within one run):

    target  processes  run 1 each (total)    run 2 each (total)    run 3 each (total)
    anon    1          7.99        (7.99)    7.40        (7.40)    8.25        (8.25)
    anon    2          7.97, 7.41  (15.38)   8.07, 7.34  (15.40)   7.62, 8.24  (15.87)
    slab    1          5.67        (5.67)    7.07        (7.07)    7.27        (7.27)
    slab    2          7.46, 6.71  (14.17)   3.06, 3.05  (6.11)    7.31, 6.47  (13.78)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import numpy as np

from arena_loader._slab import Slab
from arena_loader.bench.harness import environment

SHAPE = (64, 3, 224, 224)
RING = 16


def copy_rows(target: str, batches: int, results: mp.Queue) -> None:
    src = np.random.default_rng(0).integers(0, 256, size=SHAPE, dtype=np.uint8)
    slab = None
    if target == "slab":
        slab = Slab(RING * src.nbytes)
        dst = slab.array.reshape(RING, *SHAPE)
    else:
        dst = np.ones((RING, *SHAPE), dtype=np.uint8)
    for k in range(RING):  # warm: every page mapped before timing
        np.copyto(dst[k], src)
    start = time.perf_counter()
    for k in range(batches):
        out = dst[k % RING]
        for row in range(SHAPE[0]):
            out[row] = src[row]
    results.put(batches * src.nbytes / (time.perf_counter() - start) / 1e9)
    del dst, out
    if slab is not None:
        slab.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--batches", type=int, default=128)
    args = parser.parse_args()
    env = environment()
    print(f"{env['cpu_model']}, {env['cores']} cores, /dev/shm {env['dev_shm_gib']} GiB, "
          f"load {env['load_average_at_start']}, numpy {env['versions']['numpy']}")
    print(f"{'target':<8}{'processes':>10}  {'GB/s each':<24}{'total':>8}")
    for target in ("anon", "slab"):
        for count in sorted({1, args.processes}):
            results: mp.Queue = mp.Queue()
            procs = [mp.Process(target=copy_rows, args=(target, args.batches, results))
                     for _ in range(count)]
            for proc in procs:
                proc.start()
            rates = [results.get(timeout=300) for _ in procs]
            for proc in procs:
                proc.join()
            each = ", ".join(f"{r:.2f}" for r in rates)
            print(f"{target:<8}{count:>10}  {each:<24}{sum(rates):>8.2f}")


if __name__ == "__main__":
    main()
