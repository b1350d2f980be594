"""Issue 24's memory target read as it is worded, "private memory of all processes": the USS
(pages no other process maps) of the main process and of every worker, summed, and the summed
PSS beside it, peaks sampled every 50 ms over 3 epochs of the bench's ``remote`` workload (2 ms
of GIL-free waiting per sample, batch 16). Each loader runs in a fresh interpreter that
imports torch, so the main processes start alike.

    .venv/bin/python benchmarks/private_memory.py [--rounds 2]

Result (2026-11-26, 2-core Intel Xeon, two rounds): torch with 16 workers 188-189 MB of USS
at 324-326 batches/s; ArenaLoader with 2 workers x 8 threads 91 MB at 383-385 (0.48x); torch
with 2 workers 87 MB at 57. Summed PSS 351, 244, 246-247 MB. docs/benchmarks.md, "The GPU
checks again, and four levers measured on the CPU".

Split by process (third session, two rounds): the main process's USS is 72-73 MB under torch
with 16 workers, 75 MB under ArenaLoader, 71 MB under torch with 2 workers (219-220 MB before
the loader was built: forking makes most of its pages shared, so they leave its USS); the
workers' USS summed is 121-122, 16 and 16 MB. The main process alone is 0.38x torch-16's sum:
no loader with a main process like torch's gets the sum to 0.3x. docs/benchmarks.md, "The red
CI run, and issue 24's memory split by process".
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time

import psutil

KINDS = ("torch, 16 workers", "ArenaLoader, 2 workers x 8 threads", "torch, 2 workers")


class PeakSampler:
    """Peaks of the summed USS and PSS of this process and its descendants."""

    def __init__(self) -> None:
        self.uss = self.pss = 0
        self.main_uss = self.workers_uss = 0  # the same peaks for the main process, the rest
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            uss = pss = main = 0
            for process in (me, *me.children(recursive=True)):
                try:
                    info = process.memory_full_info()
                except psutil.Error:
                    continue  # a worker that just exited
                uss, pss = uss + info.uss, pss + info.pss
                if process is me:
                    main = info.uss
            self.uss, self.pss = max(self.uss, uss), max(self.pss, pss)
            self.main_uss = max(self.main_uss, main)
            self.workers_uss = max(self.workers_uss, uss - main)
            self._stop.wait(0.05)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def measure(kind: str) -> None:
    import torch.utils.data

    from arena_loader import ArenaLoader
    from arena_loader.bench.workloads import RemoteSamples

    dataset = RemoteSamples(1024, (3, 64, 64), 2.0)
    program_uss = psutil.Process().memory_full_info().uss  # torch imported, no loader yet
    if kind == KINDS[0]:
        loader = torch.utils.data.DataLoader(dataset, batch_size=16, num_workers=16,
                                             persistent_workers=True)
    elif kind == KINDS[1]:
        loader = ArenaLoader(dataset, batch_size=16, num_workers=2, worker_threads=8,
                             persistent_workers=True)
    else:
        loader = torch.utils.data.DataLoader(dataset, batch_size=16, num_workers=2,
                                             persistent_workers=True)
    batches, began = 0, time.perf_counter()
    with PeakSampler() as peak:
        for _ in range(3):
            for _batch in loader:
                batches += 1
    rate = batches / (time.perf_counter() - began)
    print(f"{kind}: {rate:.0f} batches/s, peak summed USS {peak.uss / 2**20:.0f} MB "
          f"(main process {peak.main_uss / 2**20:.0f}, of which {program_uss / 2**20:.0f} "
          f"before the loader was built; workers {peak.workers_uss / 2**20:.0f}), "
          f"summed PSS {peak.pss / 2**20:.0f} MB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kind", choices=KINDS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.kind:
        measure(args.kind)
        return
    for _ in range(args.rounds):
        for kind in KINDS:  # each in a fresh interpreter
            subprocess.run([sys.executable, "-W", "ignore::UserWarning", __file__,
                            "--kind", kind], check=True)


if __name__ == "__main__":
    main()
