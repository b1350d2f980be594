"""How does throughput scale with num_workers 1..4 on image-like batches, for ArenaLoader,
torch's default collate, queue pickling and SPDL's arena (on a 2-core machine, 3 and 4
workers oversubscribe the cores)?

    .venv/bin/python benchmarks/worker_scaling.py [--out DIR] [any arena-loader bench flag]

Latest result (2026-11-22 05:13 UTC, the same cases in the full run `arena-loader bench`,
not yet re-run alone; shared 2-core Xeon VM, load average 5.22 at the start: noisy, compare
only within one run; columns as in docs/benchmarks.md, mem MB = peak PSS of all processes +
shm):

    loader                 w      GB/s [min-max]  batch/s epoch1 s CPU s/GB mem MB Arena x
    ArenaLoader            1   1.98 [1.49-2.40]       206     0.52     0.30    300
    ArenaLoader            2   5.20 [3.79-7.22]       540     0.47     0.21    298
    ArenaLoader            3   3.83 [3.52-4.29]       398     0.30     0.26    354
    ArenaLoader            4   3.46 [2.82-4.31]       359     0.71     0.22    377
    SPDL arena             1   3.34 [3.21-3.51]       347     0.26     0.30    320
    SPDL arena             2   1.58 [1.32-1.94]       164     0.44     0.44    373
    SPDL arena             3   2.40 [1.62-2.82]       249     0.56     0.42    429
    SPDL arena             4   1.64 [1.60-1.91]       170     0.68     0.59    511
    queue pickling         1   0.27 [0.23-0.30]        28     2.75     3.93    345
    queue pickling         2   0.15 [0.13-0.21]        15     7.28     3.53    428
    queue pickling         3   0.25 [0.23-0.28]        26     2.31     4.09    473
    queue pickling         4   0.20 [0.18-0.30]        21     3.07     3.72    574
    torch default collate  1   0.48 [0.30-0.80]        50     2.27     1.54    296
    torch default collate  2   0.98 [0.71-1.14]       101     0.91     1.45    287
    torch default collate  3   0.96 [0.94-1.02]       100     0.95     1.19    360
    torch default collate  4   0.75 [0.57-0.94]        78     1.23     1.32    365
"""

import sys

from arena_loader.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["--workloads", "image", "--scaling", "1,2,3,4",
                           "--loaders", "ArenaLoader,torch default collate,queue pickling,"
                           "SPDL arena", "--out", "bench-out/scaling", *sys.argv[1:]]))
