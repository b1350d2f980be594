"""Which slots a loader reserves, and how many are in use at once, on the bench's large
workload (float32 rows, batch 32, 32 MB a batch, 2 workers, ``prefetch_factor=2``, the
default 5 slots): after every ``next()``, the slots ASSIGNED (sent), FILLED and LEASED, and
the batch at which each further slot was first reserved, for a consumer that drops each
batch before asking for the next (the bench's loop) and for a ``for`` loop that holds it.

    PYTHONPATH=. .venv/bin/python benchmarks/slots_in_use.py [--epochs 4]

docs/benchmarks.md, "mem26".
"""

from __future__ import annotations

import argparse
import collections

import numpy as np

from arena_loader import ArenaLoader
from arena_loader.bench.workloads import PooledArrays


def run(pattern: str, epochs: int) -> None:
    row = int(32e6 / 32 / 4)
    loader = ArenaLoader(PooledArrays(512, (row,), np.float32), batch_size=32, num_workers=2,
                         prefetch_factor=2, persistent_workers=True)
    reserved: dict[int, tuple[int, int]] = {}
    in_use: collections.Counter = collections.Counter()
    batches = 0
    with loader:
        for epoch in range(epochs):
            for batch in loader:
                snapshot = loader.snapshot()
                reserved.setdefault(snapshot.backed_slots, (epoch, batches))
                states = snapshot.slot_states
                in_use[(states.count("assigned"), states.count("filled"),
                        states.count("leased"))] += 1
                batch.reshape(-1)[-1].item()
                batches += 1
                if pattern == "drop":
                    del batch
        last = loader.snapshot()
    print(f"{pattern}: {last.backed_slots} of {last.slots} slots reserved; batches each slot "
          f"carried {last.slot_leases}")
    print("  slots reserved -> first at (epoch, batch):", reserved)
    print("  (assigned, filled, leased) after next(): batches",
          dict(sorted(in_use.items(), key=lambda item: -item[1])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    for pattern in ("drop", "hold"):
        run(pattern, args.epochs)


if __name__ == "__main__":
    main()
