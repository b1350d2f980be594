"""KeyboardInterrupt at every call into C that arena_loader makes: where CPython handles a real
signal (as a call into C returns), which the suite's trace-function matrices cannot reach.

Run from the repository root::

    python benchmarks/interrupt_sweep.py --options "num_workers=2, persistent_workers=True"
    python benchmarks/interrupt_sweep.py --options "num_workers=0" --every-next --step 1
    python benchmarks/interrupt_sweep.py --iterable --options "num_workers=2, in_order=False"
    python benchmarks/interrupt_sweep.py --grow --options "num_workers=2, persistent_workers=True"

Per epoch, a profile function raises ``KeyboardInterrupt`` once, as the k-th C call made by an
arena_loader frame of this process returns (``iter()`` included); with ``--every-next``, as the
k-th of every ``next()`` instead. The user goes on with the same iterator, as after a Ctrl-C.
k runs from 1 (by ``--step``) until it passes the most C returns an epoch (or a ``next()``)
made. Checked per epoch: the batches are torch's DataLoader's on the same dataset, each once
(in order unless ``in_order=False``), nothing raised, and after the epoch (and a garbage
collection) every slot is free. The fourteenth session's sweep found three losses this way
(docs/reliability.md, "Ctrl-C as any call into C"); ``tests/test_faults.py::
test_a_ctrl_c_at_any_call_into_c_loses_no_batch_and_strands_no_slot`` keeps four of its
configurations in the suite.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__" and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from arena_loader import ArenaLoader  # noqa: E402

SAMPLES = 40


class Indexed:
    """Map-style: sample i is [i, i]."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> np.ndarray:
        return np.full(2, index, dtype=np.int64)


class Stream(torch.utils.data.IterableDataset):
    """Iterable-style: sample i is [i, i], sharded over the workers by get_worker_info()."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for index in range(worker, SAMPLES, workers):
            yield np.full(2, index, dtype=np.int64)


class Growing:
    """Map-style, for ``--grow``: rows of 4 float64 for the first 8 indices, 3,000 after (they
    outgrow the first epoch's slots: the next epoch hands the workers a grown slab)."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> np.ndarray:
        return np.full(4 if index < 8 else 3000, index, dtype=np.float64)


def padded(batch: list) -> np.ndarray:
    rows = np.zeros((len(batch), max(len(row) for row in batch)))
    for r, row in enumerate(batch):
        rows[r, :len(row)] = row
    return rows


class InterruptAt:
    """Raises KeyboardInterrupt as the k-th C call of an arena_loader frame returns (in this
    process only: forked workers inherit the profile function)."""

    def __init__(self, k: int) -> None:
        self.k, self.count, self.pid, self.where = k, 0, os.getpid(), None

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "c_return" and "arena_loader" in frame.f_code.co_filename \
                and os.getpid() == self.pid:
            self.count += 1
            if self.count == self.k:
                self.where = (frame.f_code.co_filename.rsplit("arena_loader/", 1)[-1],
                              frame.f_lineno, getattr(arg, "__qualname__", repr(arg)))
                raise KeyboardInterrupt


def epoch(loader: Any, k: int, every_next: bool) -> tuple[list[int], int, list]:
    """One epoch under the interrupts: each batch's first value, the most C returns one
    profile function counted, and where the interrupts landed."""
    hook, iterator, got, most, where = InterruptAt(k), None, [], 0, []
    while True:
        sys.setprofile(hook)
        try:
            if iterator is None:
                iterator = iter(loader)
            batch = iterator.__next__()
        except KeyboardInterrupt:
            where.append(hook.where)
            continue
        except StopIteration:
            return got, max(most, hook.count), where
        finally:
            sys.setprofile(None)
        got.append(int(batch[0, 0]))
        del batch
        if every_next:
            most, hook = max(most, hook.count), InterruptAt(k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--options", default="num_workers=2, persistent_workers=True",
                        help="ArenaLoader keyword options, as Python (batch_size is 2)")
    parser.add_argument("--iterable", action="store_true", help="an iterable-style dataset")
    parser.add_argument("--every-next", action="store_true",
                        help="interrupt every next() at its k-th C return")
    parser.add_argument("--step", type=int, default=3, help="k's step")
    parser.add_argument("--grow", action="store_true",
                        help="batches that outgrow the first epoch's slots (padded rows): each "
                        "k on a fresh loader, whose clean first epoch is followed by the "
                        "interrupted one, where the slab grows")
    args = parser.parse_args()
    options = eval(f"dict({args.options})")  # a command line of the user's own
    if args.grow:
        options.setdefault("collate_fn", padded)
    dataset = Stream() if args.iterable else Growing() if args.grow else Indexed()
    workers = options.get("num_workers", 0)
    reference = [int(b[0, 0]) for b in torch.utils.data.DataLoader(
        dataset, batch_size=2, num_workers=workers, collate_fn=options.get("collate_fn"))]
    in_order = options.get("in_order", True)

    def make() -> Any:
        return ArenaLoader(dataset, batch_size=2, timeout=5 if workers else 0, **options)

    failures: collections.Counter = collections.Counter()
    k, most, epochs, start = 0, 1, 0, time.monotonic()
    loader = make()
    while k < most:
        k += args.step
        if args.grow:  # a fresh loader: its first epoch outgrows the slots, the next grows
            loader.close()
            loader = make()
            list(loader)
        try:
            got, most, where = epoch(loader, k, args.every_next)
        except Exception as exc:  # a hang (timeout) or any error: the sweep goes on
            failures[f"raised {type(exc).__name__}"] += 1
            print(f"k={k}: raised {exc!r:.300}", flush=True)
            loader.close()
            loader = make()
            continue
        epochs += 1
        same = got == reference if in_order else sorted(got) == sorted(reference)
        snapshot = loader.snapshot()
        if snapshot.free_slots != loader.slots:  # (a collection costs ~50 ms with torch)
            gc.collect()
            snapshot = loader.snapshot()
        if not same:
            failures["batches"] += 1
            print(f"k={k}: interrupts at {where}: got {got}", flush=True)
        if snapshot.slab_nbytes is not None and snapshot.free_slots != loader.slots:
            failures["slots"] += 1
            print(f"k={k}: interrupts at {where}: slots {snapshot.slot_states}", flush=True)
    loader.close()
    print(f"{args.options} iterable={args.iterable} every_next={args.every_next}: k up to {k} "
          f"by {args.step}, {epochs} epochs, {time.monotonic() - start:.0f} s, "
          f"failures {dict(failures) or 'none'}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
