"""Where a loader's peak memory is, process by process, counted as the bench counts it
(``arena_loader.bench.harness``: Pss_Anon + Pss_File of each process, each /dev/shm object
once): image batches (uint8 3x224x224, batch 64, 2 workers), ArenaLoader with the bench's
``slots=5`` against torch's DataLoader, over 2 epochs, sampled every 8 batches.

    .venv/bin/python benchmarks/memory_by_process.py

Result (2026-11-24, 2-core AMD EPYC; two runs): ArenaLoader main 125-130 MB, workers 59-69
each, shared memory 55 (the 48 MB slab of 5 preallocated slots + one first-epoch segment);
torch main 127-146, workers 64-88 each, shared memory 18-27 (the batches alive at once).
Added up, these per-part peaks are 0.88-1.15x torch's (a sum of peaks, not the peak of the
sum); the bench's 50 ms sampler of the total gives 1.02-1.12x. What ArenaLoader holds more of
is shared memory: the slab. docs/benchmarks.md, "Engine v3, second stage".

Again 2026-11-25 (2-core Intel Xeon; shared memory now counted by the pages each object has,
and the slab's slots reserved as they are first used): ArenaLoader main 125, workers 59 and
59, shared memory 55 (all 5 slots are in use in steady state: window 4 + the batch held);
torch main 146, workers 89 and 89, shared memory 18-28 (two runs). docs/benchmarks.md,
"Engine v3, sixth stage".

Again 2026-11-26, seventh session, with /dev/shm objects held open by a descriptor counted
too (torch's batches in its queue): ArenaLoader main 125, workers 59-60 and 59, shared memory
46; torch main 122, workers 64 and 64, shared memory **46** (two runs each; the 18-28 above
left out torch's queued batches). docs/benchmarks.md, "Shared memory held by a file
descriptor".
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import psutil

from arena_loader import ArenaLoader
from arena_loader.bench.harness import proportional_bytes, shm_objects
from arena_loader.bench.workloads import PooledArrays


def peak_by_process(loader) -> dict[str, int]:
    me, peak = psutil.Process(), {}
    for _ in range(2):
        for n, batch in enumerate(loader):
            del batch
            if n % 8 != 3:
                continue
            now, shm = {"main": proportional_bytes(me.pid)}, {}
            for i, process in enumerate([me, *me.children(recursive=True)]):
                try:
                    if i:
                        now[f"worker {i}"] = proportional_bytes(process.pid)
                    for inode, nbytes in shm_objects(process.pid).items():
                        shm[inode] = max(shm.get(inode, 0), nbytes)
                except (OSError, psutil.Error):
                    continue
            now["shared memory"] = sum(shm.values())
            for key, value in now.items():
                peak[key] = max(peak.get(key, 0), value)
    return peak


def measure(name: str) -> None:
    import torch.utils.data  # both runs import torch: the same main-process baseline

    dataset = PooledArrays(2048, (3, 224, 224), np.uint8)
    if name == "ArenaLoader":
        loader = ArenaLoader(dataset, batch_size=64, num_workers=2, slots=5, output="numpy")
    else:
        loader = torch.utils.data.DataLoader(dataset, batch_size=64, num_workers=2)
    peak = peak_by_process(loader)
    parts = ", ".join(f"{key} {value / 2**20:.0f}" for key, value in peak.items())
    print(f"{name}: peak MB by process: {parts}", flush=True)


def main() -> None:
    if len(sys.argv) > 1:
        measure(sys.argv[1])
        return
    for name in ("ArenaLoader", "torch DataLoader"):  # each in a fresh interpreter
        subprocess.run([sys.executable, __file__, name], check=True)


if __name__ == "__main__":
    main()
