"""Peak memory and speed of ArenaLoader at each slot count against torch's DataLoader, counted
as the bench counts them (``arena_loader.bench.harness``: each case in a forked child, the
proportional memory of every process plus each /dev/shm object mapped or held open once),
on the bench's fixed-shape workloads, with a consumer that does nothing (the bench's) or a
training step of ``--step-ms`` (a sleep while the batch is held) that makes the consumer the
slower side. Cases alternate round by round; ratios are within-round, medians over rounds.

    .venv/bin/python benchmarks/slots_memory.py [--workloads image,large] [--slots 3,4,5]
        [--step-ms 0] [--rounds 3] [--drop-pages]
    .venv/bin/python benchmarks/slots_memory.py --fault-cost

``--drop-pages`` tries the lever left for memory: a slot's pages are given back (madvise
MADV_REMOVE) each time the slot is handed out again, so a slot holds memory only from its
write to its release, as torch's per-batch segments do; the worker's write then faults
every page in again. ``--fault-cost`` times that write against one into pages already there
(32 MB, this process alone).

Result (2026-11-26, 2-core Intel Xeon): docs/benchmarks.md, "Shared memory held by a file
descriptor"; ``--drop-pages`` and ``--fault-cost``: "Giving a free slot's pages back".
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import tempfile
import time
from typing import Any

import numpy as np
from _alternate import rotation

from arena_loader import ArenaLoader
from arena_loader._pool import SlotPool
from arena_loader.bench.harness import Budget, measure_apart
from arena_loader.bench.loaders import LOADERS, TORCH, Setup
from arena_loader.bench.workloads import Sizes, standard_workloads


class Stepped:
    """A loader whose consumer spends ``step_s`` on each batch while holding it."""

    def __init__(self, loader: Any, step_s: float):
        self.loader, self.step_s = loader, step_s

    def __iter__(self):
        for batch in self.loader:
            yield batch
            if self.step_s:
                time.sleep(self.step_s)

    def close(self) -> None:
        self.loader.close()


def drop_pages_on_reuse() -> None:
    """From now on (in this process: the measuring child), a slot handed out gives its pages
    back first (an experiment: it reads the pool's private slab address)."""
    acquire = SlotPool.acquire
    if getattr(acquire, "drops_pages", False):
        return  # (wrapped already: a case built twice in one process)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def acquire_dropping(pool: SlotPool, worker: int = -1) -> int | None:
        slot = acquire(pool, worker)
        if slot is not None and libc.madvise(pool._slab_address + slot * pool.slot_nbytes,
                                             pool.slot_nbytes, mmap.MADV_REMOVE):
            raise OSError(ctypes.get_errno(), "madvise(MADV_REMOVE)")
        return slot

    acquire_dropping.drops_pages = True  # type: ignore[attr-defined]
    SlotPool.acquire = acquire_dropping  # type: ignore[method-assign]


def fault_cost(nbytes: int = 32 << 20, repeats: int = 20) -> None:
    """Milliseconds to write ``nbytes`` into shared pages already there, and into pages just
    given back (each write faults them in again), median over ``repeats``."""
    fd = os.memfd_create("slot_pages")
    os.ftruncate(fd, nbytes)
    os.posix_fallocate(fd, 0, nbytes)
    shared = mmap.mmap(fd, nbytes)
    slot, source = np.frombuffer(shared, np.uint8), np.ones(nbytes, np.uint8)
    resident, refaulted, given_back = [], [], []
    for _ in range(repeats):
        slot[:] = source  # pages there (and mapped) from here on
        start = time.perf_counter()
        slot[:] = source
        resident.append(time.perf_counter() - start)
        start = time.perf_counter()
        shared.madvise(mmap.MADV_REMOVE, 0, nbytes)
        given_back.append(time.perf_counter() - start)
        start = time.perf_counter()
        slot[:] = source
        refaulted.append(time.perf_counter() - start)
    ms = {name: 1000 * statistics.median(times) for name, times in
          (("resident", resident), ("given back", given_back), ("refaulted", refaulted))}
    print(f"{nbytes / 2**20:.0f} MB: write into resident pages {ms['resident']:.2f} ms; give "
          f"the pages back {ms['given back']:.2f} ms; write faulting them in "
          f"{ms['refaulted']:.2f} ms ({ms['refaulted'] / ms['resident']:.1f}x)")
    del slot
    shared.close()
    os.close(fd)


def compare(workload: Any, slots: list[int], step_s: float, rounds: int,
            directory: str, drop_pages: bool = False) -> None:
    dataset = workload.dataset(directory)
    setup = Setup(batch_size=workload.batch_size, workers=2)

    def arena(n: int) -> Stepped:
        if drop_pages:
            drop_pages_on_reuse()  # (in the measuring child: the bench process is untouched)
        return Stepped(ArenaLoader(dataset, batch_size=setup.batch_size, num_workers=2,
                                   prefetch_factor=2, persistent_workers=True, slots=n), step_s)

    cases = {f"ArenaLoader slots={n}": (lambda n=n: arena(n)) for n in slots}
    torch_kind = next(kind for kind in LOADERS if kind.name == TORCH)
    cases["torch"] = lambda: Stepped(torch_kind.build(dataset, setup), step_s)
    names = list(cases)
    runs: dict[str, list[dict]] = {case: [] for case in names}
    for round_ in range(rounds):
        for case in rotation(names, round_):
            runs[case].append(measure_apart(cases[case], Budget(1.5, 50)))
    for case, got in runs.items():
        speed = [a["steady_batches_per_s"] / t["steady_batches_per_s"]
                 for a, t in zip(got, runs["torch"])]
        memory = [a["peak_memory_mb"] / t["peak_memory_mb"] for a, t in zip(got, runs["torch"])]
        print(f"{workload.name} step {step_s * 1000:g} ms  {case:20s} "
              f"{statistics.median(r['steady_batches_per_s'] for r in got):8,.0f} batches/s "
              f"({statistics.median(speed):5.2f}x torch)  peak "
              f"{statistics.median(r['peak_memory_mb'] for r in got):4.0f} MB, shared "
              f"{[round(r['peak_shm_mb']) for r in got]}  memory / torch "
              f"{statistics.median(memory):.3f}x [{min(memory):.3f}-{max(memory):.3f}]",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="image,large")
    parser.add_argument("--slots", default="3,4,5")
    parser.add_argument("--step-ms", type=float, default=0.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--drop-pages", action="store_true",
                        help="a slot gives its pages back each time it is handed out again")
    parser.add_argument("--fault-cost", action="store_true",
                        help="only time a write into resident pages against given-back ones")
    args = parser.parse_args()
    if args.fault_cost:
        fault_cost()
        return
    import torch  # noqa: F401  (the bench process imports torch: the same baseline for all)

    workloads = {w.name: w for w in standard_workloads(Sizes())}
    directory = tempfile.mkdtemp()
    for name in args.workloads.split(","):
        compare(workloads[name], [int(n) for n in args.slots.split(",")],
                args.step_ms / 1000, args.rounds, directory, args.drop_pages)


if __name__ == "__main__":
    main()
