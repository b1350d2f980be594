"""Train a torch regression model on ``.npy`` files on disk, memory-mapped by ArenaLoader.

The example writes a synthetic dataset (inputs and targets) to a temporary directory with
``np.save``, then trains over ``MemmapDataset``: each worker maps the files itself (only
paths, dtypes, shapes and offsets are pickled, so this works with spawn too) and gathers rows
straight into the slab. Runs in a few seconds on a CPU:

    python examples/train_memmap.py [--epochs 3] [--samples 30000]
        [--multiprocessing-context spawn]

It prints one line per epoch and finally ``loss first=<..> last=<..>``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

from arena_loader import ArenaLoader, MemmapDataset


def write_dataset(directory: Path, n: int, features: int) -> dict[str, Path]:
    """inputs.npy (float32[n, features]) and targets.npy (float32[n, 1]), a noisy linear map."""
    rng = np.random.default_rng(1)
    inputs = rng.uniform(-1, 1, size=(n, features)).astype(np.float32)
    weights = rng.standard_normal((features, 1)).astype(np.float32)
    targets = inputs @ weights + 0.01 * rng.standard_normal((n, 1)).astype(np.float32)
    paths = {"inputs": directory / "inputs.npy", "targets": directory / "targets.npy"}
    np.save(paths["inputs"], inputs)
    np.save(paths["targets"], targets)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=30_000)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--multiprocessing-context", default=None)
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)  # a model this small gains nothing from more; leave cores to workers
    model = nn.Linear(32, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    with tempfile.TemporaryDirectory(prefix="arena_loader_example_") as tmp:
        dataset = MemmapDataset(write_dataset(Path(tmp), args.samples, 32))
        with ArenaLoader(dataset, batch_size=128, shuffle=True, generator=0,
                         num_workers=args.num_workers, slots=16,
                         multiprocessing_context=args.multiprocessing_context,
                         output="torch") as loader:
            for epoch in range(args.epochs):
                total, count = 0.0, 0
                for batch in loader:
                    inputs, targets = batch["inputs"], batch["targets"]
                    loss = nn.functional.mse_loss(model(inputs), targets)
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    total += loss.item() * len(targets)
                    count += len(targets)
                losses.append(total / count)
                print(f"epoch {epoch}: mean squared error {losses[-1]:.5f} over {count} samples")
    print(f"loss first={losses[0]:.5f} last={losses[-1]:.5f}")


if __name__ == "__main__":
    main()
