"""Who waits for whom on tiny rows (float32[16], batch 256, 2 persistent workers, fork).

The main process: its CPU per batch in a plain loop, then, under cProfile over 3 more
epochs, the share of its time in ``next()``'s spin (``sched_yield``) and the doorbell writes
(``os.write`` to a worker that had taken every published entry and went to sleep) per
batch. The workers, in a second loader whose workers inherit a timed ``spin_while_equal``
and ``OrderReader._sleep`` (fork): how often a worker found no published entry, and how
long it waited for one.

    .venv/bin/python benchmarks/tiny_waits.py

Result (2026-11-26, 2-core Intel Xeon, three runs): main process 20.8-24.7 us of CPU a
batch at 15.1-17.4k batches/s; under cProfile 38-42% of its time in ``sched_yield``,
doorbell writes for 19-27% of batches. Workers (timed, 13.6-14.9k batches/s): no entry
waiting at 44-50% of entries, a wait of 79-89 us by median (p90 88-222) ending in the spin,
2-12 sleeps in 1,250 entries. Each side waits for the other a large part
of the time: the per-batch path is bound by the handoffs between three busy processes on two
cores under the in-order window (torch's ``prefetch_factor * num_workers`` batches), not by
either side's CPU. docs/benchmarks.md, "The red CI run, and issue 24's memory split by
process".
"""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import statistics
import tempfile
import time

from arena_loader import ArenaLoader
from arena_loader._pipeline import order as order_module
from arena_loader.bench.workloads import PooledArrays


def tiny_loader() -> ArenaLoader:
    return ArenaLoader(PooledArrays(131072, (16,), "float32"), batch_size=256, num_workers=2,
                       persistent_workers=True, multiprocessing_context="fork")


def main_process() -> None:
    loader = tiny_loader()
    for _ in loader:  # warm-up: workers started, slab sized
        pass
    cpu, wall, batches = time.process_time(), time.perf_counter(), 0
    for _ in loader:
        batches += 1
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    print(f"main process, plain loop: {cpu / batches * 1e6:.1f} us of CPU a batch, "
          f"{batches / wall:,.0f} batches/s")
    profile, batches = cProfile.Profile(), 0
    profile.enable()
    for _ in range(3):
        for _ in loader:
            batches += 1
    profile.disable()
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    total = sum(entry[2] for entry in stats.values())
    yields = sum(entry[2] for key, entry in stats.items() if key[2].endswith("sched_yield>"))
    writes = sum(entry[1] for key, entry in stats.items()
                 if key[2] == "<built-in method posix.write>")
    print(f"main process under cProfile, {batches} batches: sched_yield {yields / total:.0%} "
          f"of its time; {writes} doorbell writes ({writes / batches:.0%} of batches)")
    loader.close()


def workers(folder: str) -> None:
    spin, sleep, take = (order_module.spin_while_equal, order_module.OrderReader._sleep,
                         order_module.OrderReader.next_entry)
    record: dict = {"entries": 0, "spins": [], "sleeps": []}

    def timed_spin(counter, index, value):
        began = time.perf_counter()
        ended_in_spin = spin(counter, index, value)
        record["spins"].append((time.perf_counter() - began, ended_in_spin))
        return ended_in_spin

    def timed_sleep(self, timeout_s):
        began = time.perf_counter()
        try:
            return sleep(self, timeout_s)
        finally:
            record["sleeps"].append(time.perf_counter() - began)

    def counted_take(self, timeout_s):
        entry = take(self, timeout_s)
        record["entries"] += 1
        if record["entries"] % 250 == 0:  # workers never return to us: save as they go
            with open(os.path.join(folder, f"{os.getpid()}.json"), "w") as out:
                json.dump(record, out)
        return entry

    order_module.spin_while_equal = timed_spin
    order_module.OrderReader._sleep, order_module.OrderReader.next_entry = (timed_sleep,
                                                                            counted_take)
    try:
        loader = tiny_loader()
        batches, began = 0, time.perf_counter()
        for _ in range(5):
            for _ in loader:
                batches += 1
        print(f"workers timed: {batches / (time.perf_counter() - began):,.0f} batches/s")
        loader.close()
    finally:
        order_module.spin_while_equal = spin
        order_module.OrderReader._sleep, order_module.OrderReader.next_entry = sleep, take
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name)) as saved:
            got = json.load(saved)
        waits = [seconds for seconds, ended_in_spin in got["spins"] if ended_in_spin]
        waits.sort()
        median = statistics.median(waits) * 1e6 if waits else 0.0
        p90 = waits[int(len(waits) * 0.9)] * 1e6 if waits else 0.0
        print(f"worker pid {name[:-5]}: no entry waiting at {len(got['spins'])} of "
              f"{got['entries']} entries; waits ended in the spin {len(waits)} "
              f"(median {median:.0f} us, p90 {p90:.0f}); sleeps {len(got['sleeps'])}")


if __name__ == "__main__":
    main_process()
    with tempfile.TemporaryDirectory() as folder:
        workers(folder)
