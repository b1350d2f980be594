"""How does throughput scale with num_workers 1..4 on image-like batches, for ArenaLoader,
torch's default collate, queue pickling and SPDL's arena (on a 2-core machine, 3 and 4
workers oversubscribe the cores)?

    .venv/bin/python benchmarks/worker_scaling.py [--out DIR] [any arena-loader bench flag]

Latest result: the same cases in the full run, docs/benchmarks.md ("Full run", scaling).
"""

import sys

from arena_loader.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["--workloads", "image", "--scaling", "1,2,3,4",
                           "--loaders", "ArenaLoader,torch default collate,queue pickling,"
                           "SPDL arena", "--out", "bench-out/scaling", *sys.argv[1:]]))
