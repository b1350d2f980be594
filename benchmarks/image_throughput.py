"""How does ArenaLoader compare with every baseline on image-like batches at 2 workers?
(batches/s, first epoch, CPU per GB, peak memory at the same prefetch depth)

    .venv/bin/python benchmarks/image_throughput.py [--out DIR] [any arena-loader bench flag]

uint8 3x224x224 samples, batch 64 (9.6 MB), 4,096 samples, 2 workers, prefetch_factor 2;
every loader (torch, SPDL, Grain, torchdata, queue pickling, copy limit, floor) in rounds of
a warm-up epoch + >= 1.5 s and >= 50 batches, ratios ArenaLoader / other within each round.

Latest result: the same cases in the full run, docs/benchmarks.md ("Full run", image).
"""

import sys

from arena_loader.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["--workloads", "image", "--scaling", "", "--out", "bench-out/image",
                           *sys.argv[1:]]))
