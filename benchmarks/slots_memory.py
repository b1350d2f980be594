"""Peak memory and speed of ArenaLoader at each slot count against torch's DataLoader, counted
as the bench counts them (``arena_loader.bench.harness``: each case in a forked child, the
proportional memory of every process plus each /dev/shm object mapped or held open once),
on the bench's fixed-shape workloads, with a consumer that does nothing (the bench's) or a
training step of ``--step-ms`` (a sleep while the batch is held) that makes the consumer the
slower side. Cases alternate round by round; ratios are within-round, medians over rounds.

    .venv/bin/python benchmarks/slots_memory.py [--workloads image,large] [--slots 3,4,5]
        [--step-ms 0] [--rounds 3]

Result (2026-11-26, 2-core Intel Xeon): docs/benchmarks.md, "Shared memory held by a file
descriptor".
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

from _alternate import rotation

from arena_loader import ArenaLoader
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


def compare(workload: Any, slots: list[int], step_s: float, rounds: int,
            directory: str) -> None:
    dataset = workload.dataset(directory)
    setup = Setup(batch_size=workload.batch_size, workers=2)

    def arena(n: int) -> Stepped:
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
    args = parser.parse_args()
    import torch  # noqa: F401  (the bench process imports torch: the same baseline for all)

    workloads = {w.name: w for w in standard_workloads(Sizes())}
    directory = tempfile.mkdtemp()
    for name in args.workloads.split(","):
        compare(workloads[name], [int(n) for n in args.slots.split(",")],
                args.step_ms / 1000, args.rounds, directory)


if __name__ == "__main__":
    main()
