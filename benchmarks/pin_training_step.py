"""A training loop fed with ``pin_memory=True`` batches: ``x = x.cuda(non_blocking=True)``,
then a GPU step (a chain of float16 matmuls) ending in ``.item()``, as most loops log the
loss. Milliseconds per step for torch's DataLoader, ArenaLoader (its pin thread copies each
batch into page-locked memory during the step), and ArenaLoader with the copy in ``next()``
(the code path before the pin thread, patched back in), for a few step lengths.

    .venv/bin/python benchmarks/pin_training_step.py [--batch-mib 16,4] [--matmuls 0,45,150]

Needs a CUDA GPU and a CUDA build of torch (exits saying so otherwise). H200 figures are in
docs/benchmarks.md (tenth session): with a 4.5 ms step and 16 MiB batches the copy in
``next()`` took 7.41 ms a step, slower than torch's 7.29; the pin thread 4.83.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

MIB = 1 << 20
BATCH = 16
BATCHES = 240


class Samples:
    """``n`` uint8 tensors of ``nbytes``; loading one costs nothing but the copy."""

    def __init__(self, n: int, nbytes: int):
        import torch

        self.n = n
        self.sample = torch.arange(nbytes, dtype=torch.uint8)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        return self.sample


def loaders(torch, batch_mib: int) -> dict:
    from arena_loader import ArenaLoader

    dataset = Samples(BATCHES * BATCH, batch_mib * MIB // BATCH)
    common = dict(batch_size=BATCH, num_workers=2, persistent_workers=True, pin_memory=True,
                  prefetch_factor=2)
    arena = ArenaLoader(dataset, slots=6, **common)
    in_next = ArenaLoader(dataset, slots=6, **common)
    # The copy in next() (ArenaSource pins each batch as it is handed out): no pin thread.
    in_next._source._pin_batch, in_next._pinning = in_next._pin_batch, None
    return {"torch DataLoader": torch.utils.data.DataLoader(dataset, **common),
            "ArenaLoader (pin thread)": arena, "ArenaLoader (copy in next)": in_next}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-mib", default="16,4", help="comma-separated batch sizes")
    parser.add_argument("--matmuls", default="0,45,150",
                        help="comma-separated step lengths, in 2048x2048 float16 matmuls")
    parser.add_argument("--rounds", type=int, default=3, help="timed epochs, after one warm-up")
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        sys.exit("pin_training_step.py needs torch (a CUDA build) and measured nothing.")
    if not torch.cuda.is_available():
        sys.exit("pin_training_step.py needs a CUDA GPU and measured nothing: torch finds none.")
    weight = torch.randn(2048, 2048, device="cuda", dtype=torch.float16)

    def step(x, matmuls: int) -> float:
        y = weight
        for _ in range(matmuls):
            y = torch.tanh(y @ weight)  # tanh keeps the values finite
        return (y.sum() + x.view(-1)[0]).item()

    def resident_ms(matmuls: int, steps: int = 60) -> float:
        x = torch.zeros(MIB, dtype=torch.uint8, device="cuda")
        step(x, matmuls)
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(steps):
            step(x, matmuls)
        return (time.perf_counter() - began) / steps * 1e3

    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; batch "
          f"{BATCH} samples, {BATCHES} batches an epoch, 2 workers; ms per step, median "
          f"[min-max] of {args.rounds} epochs", flush=True)
    for batch_mib in (int(v) for v in args.batch_mib.split(",")):
        made = loaders(torch, batch_mib)
        for matmuls in (int(v) for v in args.matmuls.split(",")):
            times: dict[str, list[float]] = {name: [] for name in made}
            for round_ in range(args.rounds + 1):
                for name, loader in made.items():
                    torch.cuda.synchronize()
                    began, steps = time.perf_counter(), 0
                    for x in loader:
                        x = x.cuda(non_blocking=True)
                        if matmuls:
                            step(x, matmuls)
                        steps += 1
                    torch.cuda.synchronize()
                    if round_:
                        times[name].append((time.perf_counter() - began) / steps * 1e3)
            alone = f"{resident_ms(matmuls):.2f} ms on data already on the GPU" if matmuls \
                else "no step"
            print(f"{batch_mib} MiB batches, {matmuls} matmuls a step ({alone}):", flush=True)
            for name, values in times.items():
                print(f"  {name:28s} {statistics.median(values):6.2f} ms/step "
                      f"[{min(values):.2f}-{max(values):.2f}]", flush=True)
        for loader in made.values():
            if hasattr(loader, "close"):
                loader.close()


if __name__ == "__main__":
    main()
