"""Why one worker on the image workload stays near 0.5x the bench's copy limit: the copy
limit writes each batch into private memory that numpy backs with transparent huge pages,
while every loader with worker processes must write into shared memory, which this kernel
backs with 4 KB pages (``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` reads
``[never]`` here). One thread, the image batch (64 x uint8 3x224x224 = 9.6 MB, rows from a
pool of 64), ``np.concatenate(rows, out=...)`` into a ring of 4 buffers of each kind:

    .venv/bin/python benchmarks/shm_write_limit.py

Result (2026-11-25, 2-core AMD EPYC, quiet): private memory with huge pages (np.zeros, the
copy limit's buffers) 456-487 us per batch (20-21 GB/s); private without huge pages
710-799 us; shared memory (a /dev/shm object, or an anonymous MAP_SHARED mapping) 857-922 us
(10.5-11.2 GB/s). ArenaLoader with one worker: 1,042 batches/s median in the same session's
bench (~960 us per batch), i.e. at the shared-memory write rate. docs/benchmarks.md,
"Engine v3, third stage".
"""

from __future__ import annotations

import mmap
import os
import time

import numpy as np

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
    rows = [pool[(i * 7) % 64] for i in range(BATCH)]
    try:
        thp = open("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read().strip()
    except OSError:
        thp = "unknown"
    print(f"shmem huge pages: {thp}")
    cases = {"private, np.zeros (huge pages where numpy asks for them)":
             [np.zeros(NBYTES, np.uint8) for _ in range(4)]}
    shared = mmap.mmap(-1, 4 * NBYTES)  # MAP_SHARED | MAP_ANONYMOUS: shmem
    array = np.frombuffer(shared, np.uint8)
    cases["shared, anonymous MAP_SHARED"] = [array[i * NBYTES:(i + 1) * NBYTES] for i in range(4)]
    fd = os.open(f"/dev/shm/arena_loader_limit_{os.getpid()}", os.O_CREAT | os.O_RDWR, 0o600)
    os.unlink(f"/dev/shm/arena_loader_limit_{os.getpid()}")
    os.ftruncate(fd, 4 * NBYTES)
    dev_shm = mmap.mmap(fd, 4 * NBYTES)
    os.close(fd)
    array = np.frombuffer(dev_shm, np.uint8)
    cases["shared, a /dev/shm object (the slab's kind)"] = [
        array[i * NBYTES:(i + 1) * NBYTES] for i in range(4)]
    for name, buffers in cases.items():
        us = per_batch_us(rows, buffers)
        print(f"{name}: {us:.0f} us per batch, {NBYTES / us / 1e3:.1f} GB/s")
    del cases, array


if __name__ == "__main__":
    main()
