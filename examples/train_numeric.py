"""Train a small torch classifier on a synthetic numeric dataset fed by ArenaLoader.

The data lives in numpy arrays; ``ArrayDataset`` gathers each batch straight into a slot of
the shared-memory slab with a compiled loop, and the model reads the slot as tensors
(``output="torch"``, no copy). Runs in a few seconds on a CPU:

    python examples/train_numeric.py [--epochs 4] [--samples 20000] [--num-workers 2]
        [--worker-mode thread]

It prints one line per epoch and finally ``loss first=<..> last=<..>``.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from torch import nn

from arena_loader import ArenaLoader, ArrayDataset


def make_data(n: int, features: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Points labelled by which of 4 random directions they align with best."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features), dtype=np.float32)
    directions = rng.standard_normal((features, 4)).astype(np.float32)
    y = np.argmax(x @ directions, axis=1).astype(np.int64)
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--worker-mode", choices=["process", "thread"], default="process")
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)  # a model this small gains nothing from more; leave cores to workers
    x, y = make_data(args.samples, 16, seed=0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    loss_fn = nn.CrossEntropyLoss()

    losses = []
    with ArenaLoader(ArrayDataset(x, y), batch_size=256, shuffle=True, generator=0,
                     num_workers=args.num_workers, worker_mode=args.worker_mode,
                     persistent_workers=args.num_workers > 0, slots=16,
                     output="torch") as loader:
        for epoch in range(args.epochs):
            total, count = 0.0, 0
            for inputs, targets in loader:
                # Tensors over the slot: the batch's slot is reused once these are dropped.
                loss = loss_fn(model(inputs), targets)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                total += loss.item() * len(targets)
                count += len(targets)
            losses.append(total / count)
            print(f"epoch {epoch}: mean loss {losses[-1]:.4f} over {count} samples")
    with torch.no_grad():
        accuracy = (model(torch.from_numpy(x)).argmax(1).numpy() == y).mean()
    print(f"accuracy {accuracy:.3f}")
    print(f"loss first={losses[0]:.4f} last={losses[-1]:.4f}")


if __name__ == "__main__":
    main()
