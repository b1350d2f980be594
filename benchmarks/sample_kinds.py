"""Does the advantage hold beyond plain images? Large float32 batches (32 MB), dict samples
(image + int label + float vector) and a numpy.memmap-backed dataset on disk.

    .venv/bin/python benchmarks/sample_kinds.py [--out DIR] [any arena-loader bench flag]

Every loader, 2 workers, 1 warm-up + 5 steady epochs.

Latest result (2026-11-22 05:13 UTC, the same cases in the full run `arena-loader bench`,
not yet re-run alone; shared 2-core Xeon VM, load average 5.22 at the start: noisy, compare
only within one run; columns as in docs/benchmarks.md, mem MB = peak PSS of all processes +
shm):

    large: 512 samples, float32[250000], batch 32 (32.0 MB)
    loader                 w      GB/s [min-max]  batch/s epoch1 s CPU s/GB mem MB Arena x
    ArenaLoader            2   3.97 [3.43-4.52]       124     0.40     0.28    497       1
    ArenaLoader torch      2   3.62 [3.23-4.11]       113     0.39     0.29    496    1.10
    torch default collate  2   0.84 [0.71-1.12]        26     0.61     1.27    469    4.74
    torch numpy collate    2   0.20 [0.19-0.29]         6     3.18     5.91    660   19.89
    queue pickling         2   0.24 [0.24-0.42]         7     1.52     4.45    809   16.63
    SPDL arena             2   1.72 [1.56-1.89]        54     0.54     0.59    703    2.31
    copy limit             1   2.60 [2.22-4.03]        81     0.27     0.24    482    1.53

    dict: 4096 samples, {image uint8 3x224x224, label int, features float32[128]}, batch 64
    loader                 w      GB/s [min-max]  batch/s epoch1 s CPU s/GB mem MB Arena x
    ArenaLoader            2   3.95 [2.75-6.49]       409     0.35     0.26    350       1
    ArenaLoader torch      2   3.28 [2.52-4.48]       339     0.46     0.30    350    1.20
    torch default collate  2   0.62 [0.52-0.74]        64     1.09     1.93    355    6.35
    torch numpy collate    2   0.31 [0.29-0.55]        33     1.62     2.81    445   12.56
    queue pickling         2   0.34 [0.28-0.48]        36     1.34     2.82    450   11.47
    SPDL arena             2   4.58 [2.39-5.05]       474     0.54     0.40    415    0.86
    copy limit             1   3.07 [2.47-3.23]       318     0.27     0.19    306    1.29

    memmap: 2048 samples, numpy.memmap file of uint8 3x224x224, batch 64
    loader                 w      GB/s [min-max]  batch/s epoch1 s CPU s/GB mem MB Arena x
    ArenaLoader            2   2.21 [1.71-2.88]       229     0.32     0.38    677       1
    ArenaLoader torch      2   3.26 [1.55-4.27]       338     0.32     0.36    677    0.68
    torch default collate  2   1.41 [1.08-1.54]       147     0.50     1.25    662    1.56
    torch numpy collate    2   0.53 [0.45-0.74]        55     0.73     1.95    735    4.20
    queue pickling         2   0.29 [0.25-0.50]        30     0.80     3.01    748    7.73
    SPDL arena             2   2.29 [1.05-3.71]       238     0.48     0.58    722    0.96
    copy limit             1   2.84 [1.62-4.52]       294     0.10     0.26    614    0.78
"""

import sys

from arena_loader.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["--workloads", "large,dict,memmap", "--scaling", "",
                           "--out", "bench-out/sample_kinds", *sys.argv[1:]]))
