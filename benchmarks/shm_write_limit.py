"""What one thread's copy of the image batch costs, by destination memory and by where the
source rows start against a 64-byte cache line. A loader worker writes into shared memory,
which this kernel backs with 4 KB pages (``/sys/kernel/mm/transparent_hugepage/shmem_enabled``
reads ``[never]`` here); the copy limit writes into private memory that numpy backs with
transparent huge pages. One thread, the image batch (64 x uint8 3x224x224 = 9.6 MB, rows from
a pool of 64), ``np.concatenate(rows, axis=0, out=...)`` into a ring of 4 buffers of each kind:

    .venv/bin/python benchmarks/shm_write_limit.py

Result (2026-11-25 03:40-04:30 UTC, 2-core AMD EPYC, quiet; three runs), us per batch:

    source rows at              private, 16 B past   private, on   shared memory
                                a line (np.zeros)    a line        (/dev/shm, on a line)
    a cache line (the bench's)  727-832              471-528       601-760
    16 B past one (where       523-567              719-835       817-1,087
    glibc maps numpy's)

The copy runs at full speed when source and destination start at the same offset in a cache
line: the previous version of this script paired numpy's usual 16-byte-past pool with
``np.zeros`` (also 16 past) against a page-aligned shared mapping, and read 459 us against
929 us as huge pages against 4 KB pages. With both on a line, huge pages save 1.2-1.5x (471-528
against 601-760 us), not 2x. The bench's pools and copy-limit buffers start on cache lines
(``arena_loader.bench.workloads.aligned``); docs/benchmarks.md, "Stability".
"""

from __future__ import annotations

import mmap
import os
import time

import numpy as np

from arena_loader.bench.workloads import aligned, placed

SHAPE, BATCH = (3, 224, 224), 64
NBYTES = BATCH * int(np.prod(SHAPE))


def per_batch_us(rows: list[np.ndarray], buffers: list[np.ndarray], seconds: float = 2.0) -> float:
    outs = [b[:NBYTES].reshape(BATCH * SHAPE[0], *SHAPE[1:]) for b in buffers]
    for out in outs:  # every page touched once before timing
        np.concatenate(rows, axis=0, out=out)
    start, count = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        np.concatenate(rows, axis=0, out=outs[count % len(outs)])
        count += 1
    return 1e6 * (time.perf_counter() - start) / count


def main() -> None:
    pool = np.random.default_rng(0).integers(0, 256, size=(64, *SHAPE), dtype=np.uint8)
    try:
        thp = open("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read().strip()
    except OSError:
        thp = "unknown"
    print(f"shmem huge pages: {thp}")
    zeros = [np.zeros(NBYTES + 64, np.uint8) for _ in range(4)]
    past = [z[(16 - z.ctypes.data) % 64:] for z in zeros]  # 16 B past a line, as calloc gives
    cases = {"private, 16 B past a line": past,
             "private, on a line": [aligned(np.zeros(NBYTES, np.uint8)) for _ in range(4)]}
    fd = os.open(f"/dev/shm/arena_loader_limit_{os.getpid()}", os.O_CREAT | os.O_RDWR, 0o600)
    os.unlink(f"/dev/shm/arena_loader_limit_{os.getpid()}")
    os.ftruncate(fd, 4 * NBYTES)
    dev_shm = mmap.mmap(fd, 4 * NBYTES)
    os.close(fd)
    array = np.frombuffer(dev_shm, np.uint8)
    cases["shared, a /dev/shm object (the slab's kind)"] = [
        array[i * NBYTES:(i + 1) * NBYTES] for i in range(4)]
    for offset in (0, 16):
        source = placed(pool, offset)
        rows = [source[(i * 7) % 64] for i in range(BATCH)]
        for name, buffers in cases.items():
            us = per_batch_us(rows, buffers)
            print(f"source {offset:>2} B past a line -> {name}: {us:.0f} us per batch, "
                  f"{NBYTES / us / 1e3:.1f} GB/s")
    del cases, array


if __name__ == "__main__":
    main()
