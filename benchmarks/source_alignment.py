"""Why the dict workload's ArenaLoader rate differed from run to run: where the dataset's
rows start against a 64-byte cache line. The dict workload (image uint8 3x224x224, label,
features float32[128], batch 64, 1,024 samples), its image pool copied to start 0, 8, 16, 32
and 48 bytes past a line, ArenaLoader with 2 workers measured as the bench does (a warm-up
epoch, then >= 0.8 s and >= 20 batches), the offsets interleaved over rounds:

    .venv/bin/python benchmarks/source_alignment.py [--rounds 3]

Result (2026-11-25 04:28 UTC, 2-core AMD EPYC, quiet), median [min-max] of 3 rounds:
0 bytes 1,737 [1,313-1,839] batches/s, 32 bytes 1,736 [1,581-1,835]; 8 bytes 1,403
[1,133-1,425], 16 bytes 1,353 [1,302-1,371], 48 bytes 1,375 [1,212-1,513]. numpy puts a
large array 16 bytes past a line when glibc maps it, and 0, 16, 32 or 48 past one when
glibc's heap serves it, which earlier frees decide; in three `arena-loader bench --quick`
runs (before this fix, with a logging patch) the dict pool landed at 48 (1,086-1,192
batches/s), 0 (1,375-1,479) and 32 (1,438-1,460) bytes. The bench's pools start on a line
since (``arena_loader.bench.workloads.aligned``); docs/benchmarks.md, "Stability".
"""

from __future__ import annotations

import argparse
import statistics

from arena_loader.bench.harness import Budget, measure
from arena_loader.bench.loaders import LOADERS, Setup
from arena_loader.bench.workloads import DictSamples, placed

OFFSETS = (0, 8, 16, 32, 48)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    kind = next(k for k in LOADERS if k.name == "ArenaLoader")
    rates: dict[int, list[float]] = {offset: [] for offset in OFFSETS}
    for _ in range(args.rounds):
        for offset in OFFSETS:
            dataset = DictSamples(1024, (3, 224, 224))
            dataset.images = placed(dataset.images, offset)
            figures = measure(lambda dataset=dataset: kind.build(dataset, Setup(64, 2)),
                              Budget(min_seconds=0.8, min_batches=20))
            rates[offset].append(figures["steady_batches_per_s"])
    for offset, values in rates.items():
        print(f"image rows {offset:>2} bytes past a cache line: "
              f"{statistics.median(values):,.0f} batches/s median "
              f"[{min(values):,.0f}-{max(values):,.0f}]")


if __name__ == "__main__":
    main()
