"""Where does a batch's time go: main-process CPU and workers' CPU per batch, at the
throughput reached, for the variable-shape workloads (text, detection) and tiny rows.

    .venv/bin/python benchmarks/cpu_per_batch.py [text|detect|tiny ...]

2 workers, persistent, 1 warm-up epoch then 4 measured epochs. If neither the main process
nor the workers are near 100% busy at the batches/s reached, the pipeline is latency bound
(wake-ups between threads and processes), not CPU bound. Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import psutil

from arena_loader import ArenaLoader
from arena_loader.bench.workloads import (
    Detection,
    PooledArrays,
    Tokens,
    detection_collate,
    pad_collate,
)

WORKLOADS = {
    "text": lambda: (Tokens(8192), 64, pad_collate),
    "detect": lambda: (Detection(2048), 16, detection_collate),
    "tiny": lambda: (PooledArrays(65536, (16,), np.float32), 256, None),
}


def measure(name: str) -> str:
    dataset, batch_size, collate_fn = WORKLOADS[name]()
    with ArenaLoader(dataset, batch_size=batch_size, num_workers=2, persistent_workers=True,
                     collate_fn=collate_fn) as loader:
        for _ in loader:
            pass
        me = psutil.Process()

        def workers_cpu() -> float:
            return sum(sum(child.cpu_times()[:2]) for child in me.children())

        main0, workers0, start = time.process_time(), workers_cpu(), time.perf_counter()
        batches = 0
        for _ in range(4):
            for _ in loader:
                batches += 1
        elapsed = time.perf_counter() - start
        main_us = (time.process_time() - main0) / batches * 1e6
        workers_us = (workers_cpu() - workers0) / batches * 1e6
    return (f"{name}: {batches / elapsed:,.0f} batches/s; main CPU {main_us:.0f} us/batch; "
            f"workers CPU {workers_us:.0f} us/batch (2 workers together)")


if __name__ == "__main__":
    for workload in sys.argv[1:] or list(WORKLOADS):
        print(measure(workload))
