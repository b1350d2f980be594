"""What does each loader cost per batch? Tiny rows: float32[16], batch 256 (16 KB), so the
bytes are nothing and batches/s measures per-batch overhead (dispatch, messages, wake-ups).

    .venv/bin/python benchmarks/tiny_rows.py [--out DIR] [any arena-loader bench flag]

65,536 samples (256 batches an epoch), 2 workers, 1 warm-up + 5 steady epochs.

Latest result (2026-11-22 05:22 UTC, this command; shared 2-core Xeon VM, load average 5.08
at the start: noisy, compare only within one run; columns as in docs/benchmarks.md, mem MB =
peak PSS of all processes + shm):

    loader                 w      GB/s [min-max]  batch/s epoch1 s CPU s/GB mem MB Arena x
    ArenaLoader            2   0.01 [0.01-0.02]       903     0.40    49.11    240       1
    ArenaLoader torch      2   0.02 [0.01-0.03]     1,120     0.25    39.58    257    0.81
    torch default collate  2   0.00 [0.00-0.00]       229     1.66   244.14    248    3.93
    torch numpy collate    2   0.02 [0.02-0.04]     1,405     0.23    41.48    241    0.64
    queue pickling         2   0.03 [0.01-0.03]     1,608     0.23    37.67    236    0.56
    SPDL arena             2   0.02 [0.01-0.02]     1,171     0.36    49.59    250    0.77
    copy limit             1   0.04 [0.03-0.04]     2,219     0.14    13.83    236    0.41

    tiny rows batches/s >= 3x torch                           3.93x met     CPU/GB 4.97x

Why ArenaLoader trails the queue designs here (a chain of thread wake-ups per batch on an
oversubscribed VM): docs/benchmarks.md, "What the profiles showed".
"""

import sys

from arena_loader.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["--workloads", "tiny", "--scaling", "", "--out", "bench-out/tiny",
                           *sys.argv[1:]]))
