"""Does ``x = x.cuda(non_blocking=True)`` on a ``pin_memory=True`` batch copy that batch, or
whatever its memory holds once the copy runs? The GPU is kept busy (``torch.cuda._sleep``)
so the copies run late, after the loop dropped the host batch; then every batch on the GPU
is compared with the rows it should hold. torch's DataLoader and ArenaLoader, same data.

    .venv/bin/python benchmarks/pinned_non_blocking.py [--batches 128] [--sleep-cycles 2000000]

Needs a CUDA GPU and a CUDA build of torch (exits saying so otherwise). With the slab
page-locked in place (arena_loader before 2a49caa), 244 of 256 batches reached an H200 with
the next batch's rows; since, each batch's tensors are copied into torch's page-locked memory
as torch's pin thread copies them: 0 of 256 (docs/benchmarks.md, ninth session).
"""

from __future__ import annotations

import argparse
import sys
import time

ROW = 1 << 18  # float32 rows of 1 MiB


class Rows:
    """Sample ``i`` is a 1 MiB row of the value ``i``."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        import torch

        return torch.full((ROW,), float(index))


def run(torch, kind: str, pin_memory: bool, sleep_cycles: int, samples: int) -> None:
    if kind == "torch":
        loader = torch.utils.data.DataLoader(Rows(samples), batch_size=4, num_workers=2,
                                             pin_memory=pin_memory)
    else:
        from arena_loader import ArenaLoader

        loader = ArenaLoader(Rows(samples), batch_size=4, num_workers=2, pin_memory=pin_memory)
    pinned, kept = [], []
    began = time.perf_counter()
    for _epoch in range(2):
        for i, x in enumerate(loader):
            pinned.append(bool(x.is_pinned()))
            torch.cuda._sleep(sleep_cycles)  # GPU work queued before the copy
            x = x.cuda(non_blocking=True)  # the host batch's last reference goes here
            kept.append((i, x))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    wrong = sum(not bool((x == torch.arange(4 * i, 4 * i + 4, dtype=torch.float32,
                                            device=x.device)[:, None]).all())
                for i, x in kept)
    if hasattr(loader, "close"):
        loader.close()
    name = "torch DataLoader" if kind == "torch" else "ArenaLoader"
    print(f"{name:16s} pin_memory={pin_memory!s:5s} sleep={sleep_cycles:>9,} cycles: "
          f"{wrong}/{len(kept)} batches wrong on the GPU; is_pinned {sum(pinned)}/{len(pinned)}; "
          f"{seconds:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=128, help="batches of 4 rows an epoch")
    parser.add_argument("--sleep-cycles", type=int, default=2_000_000)
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        sys.exit("pinned_non_blocking.py needs torch (a CUDA build) and measured nothing.")
    if not torch.cuda.is_available():
        sys.exit("pinned_non_blocking.py needs a CUDA GPU and measured nothing: torch finds "
                 "none.")
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    for kind, pin_memory, sleep in [("torch", True, args.sleep_cycles),
                                    ("arena", True, args.sleep_cycles),
                                    ("arena", False, args.sleep_cycles),
                                    ("arena", True, 0)]:
        run(torch, kind, pin_memory, sleep, 4 * args.batches)


if __name__ == "__main__":
    main()
