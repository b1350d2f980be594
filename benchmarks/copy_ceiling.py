"""How fast can this machine copy image rows at all? The ceiling for any loader that writes
each byte once, and the three things that move it: the destination's pages, where the source
sits against the destination's cache lines, and which loop copies.

    .venv/bin/python benchmarks/copy_ceiling.py
    .venv/bin/python benchmarks/copy_ceiling.py --processes 2 --offsets 0,16

Copies 64 rows of uint8 3x224x224 (one 9.6 MB batch) row by row into a ring of 16 batch
buffers, 128 batches per process, in 1 (and with --processes N, then N concurrent)
processes. Destinations: ``anon`` (a numpy array: private memory, which numpy asks to back
with transparent huge pages), ``anon-4k`` (private memory refused huge pages,
``MADV_NOHUGEPAGE``) and ``slab`` (an arena_loader slab: POSIX shared memory, 4 KB pages
where ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` says never). Sources start on a
cache line plus each ``--offsets`` bytes (glibc's malloc puts many arrays at 16). Copies:
``memmove`` (numpy's assignment of a same-dtype row) and ``cast`` (the row written into the
destination seen as int8: numpy's cast loop, as ``arena_loader._layout.rowcopy`` does for
rows of 32 KB and more). Prints GB/s per process and in total.

Latest results (2-core AMD EPYC VM, 2026-11-27, one process; GB/s, this VM is noisy, so
compare figures only within one run):

    source offset       0               16
    copy          memmove  cast    memmove  cast
    anon            18.9   18.2      11.6   18.0
    anon-4k         14.9   16.0      10.5   16.5
    slab            15.7   16.4      10.9   14.2

So here: huge pages are worth ~1.2x, a source off the destination's cache-line offset costs
``memmove`` (glibc's ``rep movsb``) ~0.7x, and the cast loop does not care (docs/benchmarks.md,
"Rows copied by the cast loop").
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import time

import numpy as np

from arena_loader._slab import Slab
from arena_loader.bench.harness import environment
from arena_loader.bench.workloads import placed

SHAPE = (64, 3, 224, 224)
RING = 16
TARGETS = ("anon", "anon-4k", "slab")
COPIES = ("memmove", "cast")


def copy_rows(target: str, copy: str, offset: int, batches: int, results: mp.Queue) -> None:
    src = placed(np.random.default_rng(0).integers(0, 256, size=SHAPE, dtype=np.uint8), offset)
    slab = anon = None
    nbytes = RING * src.nbytes
    if target == "slab":
        slab = Slab(nbytes)
        dst = slab.array[:nbytes].reshape(RING, *SHAPE)
    elif target == "anon-4k":
        anon = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
        anon.madvise(mmap.MADV_NOHUGEPAGE)
        dst = np.frombuffer(anon, np.uint8).reshape(RING, *SHAPE)
    else:  # on a cache line, as the slab's rows are (numpy's own start is 16 bytes past one)
        raw = np.ones(nbytes + 64, dtype=np.uint8)
        start = -raw.ctypes.data % 64
        dst = raw[start:start + nbytes].reshape(RING, *SHAPE)
    for k in range(RING):  # warm: every page mapped before timing
        np.copyto(dst[k], src)
    into = dst.view(np.int8) if copy == "cast" else dst
    start = time.perf_counter()
    for k in range(batches):
        out = into[k % RING]
        for row in range(SHAPE[0]):
            out[row] = src[row]
    results.put(batches * src.nbytes / (time.perf_counter() - start) / 1e9)
    del dst, into, out
    if slab is not None:
        slab.close()
    if anon is not None:
        anon.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--batches", type=int, default=128)
    parser.add_argument("--offsets", default="0,16",
                        help="source offsets past a cache line, comma-separated")
    args = parser.parse_args()
    env = environment()
    print(f"{env['cpu_model']}, {env['cores']} cores, /dev/shm {env['dev_shm_gib']} GiB, "
          f"load {env['load_average_at_start']}, numpy {env['versions']['numpy']}")
    print(f"{'target':<9}{'copy':<9}{'offset':>7}{'processes':>10}  {'GB/s each':<24}"
          f"{'total':>8}")
    for target in TARGETS:
        for offset in (int(x) for x in args.offsets.split(",")):
            for copy in COPIES:
                for count in sorted({1, args.processes}):
                    results: mp.Queue = mp.Queue()
                    procs = [mp.Process(target=copy_rows,
                                        args=(target, copy, offset, args.batches, results))
                             for _ in range(count)]
                    for proc in procs:
                        proc.start()
                    rates = [results.get(timeout=300) for _ in procs]
                    for proc in procs:
                        proc.join()
                    each = ", ".join(f"{r:.2f}" for r in rates)
                    print(f"{target:<9}{copy:<9}{offset:>7}{count:>10}  {each:<24}"
                          f"{sum(rates):>8.2f}", flush=True)


if __name__ == "__main__":
    main()
