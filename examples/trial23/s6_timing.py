"""s6: the time each idiom takes through torch's DataLoader and ArenaLoader, side by side
(the best of ``REPEATS`` runs, the loaders made beforehand; a ratio over 3 is flagged
``SLOW``). 400 samples of trial22's kind in batches of 4: 100 tiny batches an epoch, so
what is timed is each loader's per-batch and per-``iter()`` overhead, not loading.

    PYTHONPATH=$PYTHONPATH:/tmp/trial23-site python s6_timing.py [substring]
"""

from __future__ import annotations

import io
import itertools
import sys
import time
import warnings

import torch
from common import CONFIGS, ONLY, Sized
from prefetch_generator import BackgroundGenerator
from s3_threads import QueuePrefetcher
from torch.utils.data import DataLoader
from tqdm import tqdm

from arena_loader import ArenaLoader

REPEATS = 3
N, BS = 400, 4


def drain(iterable) -> None:
    for _ in iterable:
        pass


IDIOMS = {
    "for loop (1 epoch)": lambda a, b: drain(a),
    "next(iter(loader)) x20": lambda a, b: [next(iter(a)) for _ in range(20)],
    "islice(loader, 5) x5": lambda a, b: [list(itertools.islice(a, 5)) for _ in range(5)],
    "zip(a, b)": lambda a, b: drain(zip(a, b)),
    "tee, one after the other": lambda a, b: [drain(t) for t in itertools.tee(a)],
    "cycle, 2 epochs": lambda a, b: drain(itertools.islice(itertools.cycle(a), 2 * N // BS)),
    "list(loader)": lambda a, b: list(a),
    "BackgroundGenerator": lambda a, b: drain(BackgroundGenerator(a, max_prefetch=2)),
    "queue prefetcher": lambda a, b: drain(QueuePrefetcher(a, 2)),
    "tqdm": lambda a, b: drain(tqdm(a, file=io.StringIO())),
    "sum(b['y'].sum() for b)": lambda a, b: sum(x["y"].sum() for x in a),
}


def best_s(fn, *args) -> float:
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return min(times)


def loaders(cls: type, nw: int, pw: bool, seed: int) -> tuple:
    return tuple(cls(Sized(N), batch_size=BS, shuffle=True, num_workers=nw,
                     persistent_workers=pw, generator=torch.Generator().manual_seed(seed + k))
                 for k in range(2))


def main() -> None:
    warnings.simplefilter("ignore")  # (ours: the held-batches warning of list / tee / cycle)
    rows = []
    for nw, pw in CONFIGS:
        config = f"nw={nw}" + (" pw" if pw else "")
        made = {cls: loaders(cls, nw, pw, 0) for cls in (DataLoader, ArenaLoader)}
        for name, fn in IDIOMS.items():
            if ONLY and ONLY not in name:
                continue
            t, a = (best_s(fn, *made[cls]) for cls in (DataLoader, ArenaLoader))
            flag = "SLOW" if a > 3 * t else ""
            print(f"[{name} {config}] torch {t * 1e3:.1f} ms ours {a * 1e3:.1f} ms "
                  f"({a / t:.2f}x) {flag}", flush=True)
            rows.append((name, config, f"{t * 1e3:.1f}", f"{a * 1e3:.1f}", f"{a / t:.2f}x",
                         flag))
        for pair in made.values():
            for loader in pair:
                if isinstance(loader, ArenaLoader):
                    loader.close()
                elif getattr(loader, "_iterator", None) is not None:
                    loader._iterator._shutdown_workers()
    print("RESULTS")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    sys.exit(main())
