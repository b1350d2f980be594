"""How does ArenaLoader compare with every baseline on image-like batches at 2 workers?
(steady-state GB/s, first epoch, CPU per GB, peak memory at the same prefetch depth)

    .venv/bin/python benchmarks/image_throughput.py [--out DIR] [any arena-loader bench flag]

uint8 3x224x224 samples, batch 64 (9.6 MB), 4,096 samples, 2 workers, prefetch_factor 2,
1 warm-up + 5 steady epochs.

Latest result (2026-11-22 05:20 UTC, this command; shared 2-core Xeon VM, load average 3.8
at the start: noisy, compare only within one run; columns as in docs/benchmarks.md, mem MB =
peak PSS of all processes + shm):

    loader                 w      GB/s [min-max]  batch/s epoch1 s CPU s/GB mem MB Arena x
    ArenaLoader            2   2.87 [1.47-4.80]       297     0.45     0.30    296       1
    ArenaLoader torch      2   2.34 [2.22-2.94]       243     0.47     0.31    297    1.23
    torch default collate  2   0.64 [0.56-0.93]        66     0.94     1.63    296    4.48
    torch numpy collate    2   0.20 [0.15-0.20]        20     5.23     4.94    365   14.53
    queue pickling         2   0.16 [0.14-0.20]        16     3.07     5.46    381   18.34
    SPDL arena             2   1.30 [1.04-1.93]       135     0.82     0.59    365    2.20
    copy limit             1   3.83 [2.25-4.51]       398     0.34     0.19    294    0.75

    image-like steady state >= 10x torch default collate      4.48x MISSED  CPU/GB 5.52x
    image-like steady state >= 30x queue pickling            18.34x MISSED  CPU/GB 18.48x
    image-like steady state >= 1.5x SPDL arena                2.20x met     CPU/GB 1.99x
    image-like steady state >= 0.7x the copy limit            0.75x met     CPU/GB 0.65x
    first epoch incl. start-up faster than torch              2.11x met     CPU/GB -
    peak memory (private RSS + shm) <= torch's                0.999x MISSED  CPU/GB -
"""

import sys

from arena_loader.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["--workloads", "image", "--scaling", "", "--out", "bench-out/image",
                           *sys.argv[1:]]))
