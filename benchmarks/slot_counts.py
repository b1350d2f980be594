"""Image batches (uint8 3x224x224, batch 64 = 9.6 MB, 2 workers, prefetch_factor=2,
persistent) at each slot count from 2 to the default (6): batches per second against the
default, the share of batches that went to a one-off segment instead of a slot, and the
slots whose pages were reserved (the slab's memory). Each case in a fresh interpreter, the
cases alternated round by round; ratios are within-round, medians over rounds.

    .venv/bin/python benchmarks/slot_counts.py [--rounds 3] [--epochs 20]

Result (2026-11-26, 2-core Intel Xeon): docs/benchmarks.md, "Fewer slots".
"""

from __future__ import annotations

import json
import statistics
import time

from _alternate import alternate, case_parser

CASES = {"default (6)": None, **{f"slots={n}": n for n in (5, 4, 3, 2)}}


def measure(slots: int | None, epochs: int) -> dict:
    import numpy as np

    from arena_loader import ArenaLoader
    from arena_loader.bench.workloads import PooledArrays

    dataset = PooledArrays(4096, (3, 224, 224), np.uint8)
    with ArenaLoader(dataset, batch_size=64, num_workers=2, prefetch_factor=2, slots=slots,
                     persistent_workers=True, output="numpy") as loader:
        for _batch in loader:  # warm-up epoch: its first batches size the slab
            pass
        carried = sum(loader.snapshot().slot_leases)
        batches, began = 0, time.perf_counter()
        for _ in range(epochs):
            for _batch in loader:
                batches += 1
        rate = batches / (time.perf_counter() - began)
        snapshot = loader.snapshot()
        in_slots = sum(snapshot.slot_leases) - carried
    return {"rate": rate, "segments": 1 - in_slots / batches,
            "backed_mb": snapshot.backed_slots * snapshot.slot_nbytes / 1e6}


def main() -> None:
    args = case_parser(__doc__).parse_args()
    if args.case:
        print(json.dumps(measure(CASES[args.case], args.epochs)))
        return
    runs = {name: [json.loads(line) for line in lines] for name, lines in
            alternate(__file__, list(CASES), args.rounds, args.epochs).items()}
    default = [run["rate"] for run in runs[next(iter(CASES))]]
    for name, got in runs.items():
        ratios = [run["rate"] / base for run, base in zip(got, default)]
        print(f"{name:12s} {statistics.median(r['rate'] for r in got):7,.0f} batches/s  "
              f"{statistics.median(ratios):.3f}x the default [{min(ratios):.3f}-"
              f"{max(ratios):.3f}]  in segments {max(r['segments'] for r in got):6.1%}  "
              f"slab reserved {max(r['backed_mb'] for r in got):5.1f} MB")
    print(json.dumps(runs))


if __name__ == "__main__":
    main()
