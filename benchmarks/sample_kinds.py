"""Does the advantage hold beyond plain images? Large float32 batches (32 MB), dict samples
(image + int label + float vector) and a numpy.memmap-backed dataset on disk.

    .venv/bin/python benchmarks/sample_kinds.py [--out DIR] [any arena-loader bench flag]

Every loader, 2 workers, rounds of a warm-up epoch + >= 1.5 s and >= 50 batches.

Latest result: the same cases in the full run, docs/benchmarks.md ("Full run": large, dict,
memmap).
"""

import sys

from arena_loader.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["--workloads", "large,dict,memmap", "--scaling", "",
                           "--out", "bench-out/sample_kinds", *sys.argv[1:]]))
