"""How does ArenaLoader compare with every baseline on image-like batches at 2 workers?
(steady-state GB/s, first epoch, CPU per GB, peak memory at the same prefetch depth)

    .venv/bin/python benchmarks/image_throughput.py [--out DIR] [any arena-loader bench flag]

uint8 3x224x224 samples, batch 64 (9.6 MB), 4,096 samples, 2 workers, prefetch_factor 2,
1 warm-up + 5 steady epochs. Latest result: see docs/benchmarks.md ("image" table and
targets), measured with this command.
"""

import sys

from arena_loader.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["--workloads", "image", "--scaling", "", "--out", "bench-out/image",
                           *sys.argv[1:]]))
