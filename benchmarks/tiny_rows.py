"""What does each loader cost per batch? Tiny rows: float32[16], batch 256 (16 KB), so the
bytes are nothing and batches/s measures per-batch overhead (dispatch, messages, wake-ups).

    .venv/bin/python benchmarks/tiny_rows.py [--out DIR] [any arena-loader bench flag]

65,536 samples (256 batches an epoch), 2 workers, rounds of a warm-up epoch + >= 1.5 s and
>= 50 batches; the floor row is the least per-batch work a multi-process loader can do.

Latest result: the same cases in the full run, docs/benchmarks.md ("Full run", tiny).
"""

import sys

from arena_loader.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["--workloads", "tiny", "--scaling", "", "--out", "bench-out/tiny",
                           *sys.argv[1:]]))
