"""Tiny rows (float32[16], batch 256, 2 workers, shuffled, persistent): ArenaLoader at the
default read-ahead against a deeper one and against more slots, each case in a fresh
interpreter, the cases alternated round by round; the figure is the median over rounds of
the within-round ratio to the default.

    .venv/bin/python benchmarks/read_ahead.py [--rounds 3] [--epochs 20]

Result (2026-11-26, 2-core Intel Xeon, 3 rounds): docs/benchmarks.md, "The GPU checks
again, and four levers measured on the CPU".
"""

from __future__ import annotations

import json
import statistics
import time

from _alternate import alternate, case_parser

CASES = {  # name: ArenaLoader keywords
    "default (prefetch_factor=2, 6 slots)": {},
    "prefetch_factor=4 (10 slots)": {"prefetch_factor": 4},
    "prefetch_factor=2, 12 slots": {"slots": 12},
}


def measure(options: dict, epochs: int) -> float:
    import numpy as np

    from arena_loader import ArenaLoader
    from arena_loader.bench.workloads import PooledArrays

    dataset = PooledArrays(131072, (16,), np.float32)
    with ArenaLoader(dataset, batch_size=256, num_workers=2, shuffle=True,
                     persistent_workers=True, **options) as loader:
        for _batch in loader:  # warm-up epoch
            pass
        batches, began = 0, time.perf_counter()
        for _ in range(epochs):
            for _batch in loader:
                batches += 1
        return batches / (time.perf_counter() - began)


def main() -> None:
    args = case_parser(__doc__).parse_args()
    if args.case:
        print(measure(CASES[args.case], args.epochs))
        return
    rates = {name: [float(line) for line in lines] for name, lines in
             alternate(__file__, list(CASES), args.rounds, args.epochs).items()}
    default = rates[next(iter(CASES))]
    for name, got in rates.items():
        ratios = [a / b for a, b in zip(got, default)]
        print(f"{name:38s} {statistics.median(got):9,.0f} batches/s  "
              f"{statistics.median(ratios):.3f}x the default [{min(ratios):.3f}-"
              f"{max(ratios):.3f}]")
    print(json.dumps(rates))


if __name__ == "__main__":
    main()
