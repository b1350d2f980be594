"""Scenario 7: leaves and samples a user plausibly returns (namedtuple, dataclass, structured
arrays, bytes/str, None, Decimal, Fraction; batch_size=None's default_convert), and training-loop
behaviours: len(loader), break and re-iterate, two loaders alive at once, Ctrl-C (SIGINT from a
timer while next() waits) caught and iterated on: the batches must be torch's order, none lost
or repeated."""

import collections
import dataclasses
import decimal
import fractions
import os
import signal
import sys
import threading
import time

import numpy as np
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(__file__))
from common import compare, first_diff, plain, report_end, seeded, shm, variants

from arena_loader import ArenaLoader

N = 13
Point = collections.namedtuple("Point", ["xy", "label", "name"])


@dataclasses.dataclass
class Record:
    x: np.ndarray
    label: int


STRUCT = np.dtype([("a", np.int32), ("b", np.float64), ("c", "S3")])


class Leaves:
    def __init__(self, how):
        self.how = how

    def __len__(self):
        return N

    def __getitem__(self, i):
        how = self.how
        if how == "namedtuple":
            return Point(np.full(2, i, np.float32), i, f"p{i}")
        if how == "dataclass":
            return Record(np.full(2, i, np.float32), i)
        if how == "structured":
            return np.array((i, i / 2, b"ab"), dtype=STRUCT)
        if how == "bytes/str":
            return {"b": f"b{i}".encode(), "s": f"s{i}", "t": (f"t{i}", b"u")}
        if how == "None leaf":
            return {"x": i, "y": None}
        if how == "None sample":
            return None if i == 3 else i
        if how == "Decimal":
            return {"x": decimal.Decimal(i) / 3}
        if how == "Fraction":
            return {"x": fractions.Fraction(i, 3)}
        if how == "tuple of mixed":
            return np.arange(3) + i, i, f"n{i}", [i, i + 0.5], {"k": np.int16(i)}
        raise ValueError(how)


class Slow:
    """Samples that take a while, so a timer's SIGINT lands inside next()."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        time.sleep(0.004)
        return np.full(3, i, np.int64)


def make(cls, dataset, **kw):
    """A loader; ours with output="torch" (numpy samples: numpy batches otherwise)."""
    return cls(dataset, **kw, **({"output": "torch"} if cls is ArenaLoader else {}))


INSIDE_NEXT = [False]


def on_sigint(signum, frame):
    """Ctrl-C only while next() runs: one that lands in this loop's own code is dropped (a
    few bytecodes after next() returns remain a window the harness cannot close)."""
    if INSIDE_NEXT[0]:
        INSIDE_NEXT[0] = False
        raise KeyboardInterrupt


def order(cls, kw, interrupts):
    """Batches of 2 epochs, with up to ``interrupts`` SIGINTs sent ~7 ms into next()."""
    loader = make(cls, Slow(), **kw)
    seen, caught = [], 0
    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        for _ in range(2):
            iterator = iter(loader)
            while True:
                timer = None
                if caught < interrupts:
                    timer = threading.Timer(0.007, os.kill, (os.getpid(), signal.SIGINT))
                    timer.start()
                try:
                    INSIDE_NEXT[0] = True
                    batch = next(iterator)
                    INSIDE_NEXT[0] = False
                except StopIteration:
                    break
                except KeyboardInterrupt:
                    caught += 1
                    continue
                finally:
                    INSIDE_NEXT[0] = False
                    if timer is not None:
                        timer.join()
                seen.append(np.asarray(batch)[:, 0].tolist())
    finally:
        signal.signal(signal.SIGINT, previous)
    if cls is ArenaLoader:
        loader.close()
    return seen, caught


def loop_checks():
    for nw, pw in ((0, False), (2, False), (2, True)):
        kw = dict(batch_size=3, shuffle=True, num_workers=nw, persistent_workers=pw)
        kw_n = dict(kw, generator=torch.Generator().manual_seed(8))
        # len(), with and without drop_last and a sampler
        lens = [(len(cls(Slow(), **dict(kw, batch_size=5, drop_last=d))),
                 len(cls(Slow(), batch_size=5, sampler=range(0, 24, 2), num_workers=nw)))
                for cls in (DataLoader, ArenaLoader) for d in (False, True)]
        print(f"[7 len(loader) nw={nw} pw={pw}] {'SAME' if lens[:2] == lens[2:] else lens}")
        # break after 2 batches, then a full epoch
        runs = []
        for cls in (DataLoader, ArenaLoader):
            loader = make(cls, Slow(), **dict(kw, generator=torch.Generator().manual_seed(8)))
            got = []
            for i, b in enumerate(loader):
                got.append(plain(b))
                if i == 1:
                    break
            got += [plain(b) for b in loader]
            runs.append(got)
        d = first_diff(runs[0], runs[1])
        print(f"[7 break and re-iterate nw={nw} pw={pw}] {'SAME' if d is None else 'DIFF ' + d}")
        # two loaders alive at once, zipped
        runs = []
        for cls in (DataLoader, ArenaLoader):
            a = make(cls, Slow(), **dict(kw, generator=torch.Generator().manual_seed(8)))
            b = make(cls, Leaves("namedtuple"), batch_size=2, num_workers=nw)
            runs.append([(plain(x), plain(y)) for _ in range(2) for x, y in zip(a, b)])
        d = first_diff(runs[0], runs[1])
        print(f"[7 two loaders zipped nw={nw} pw={pw}] {'SAME' if d is None else 'DIFF ' + d}")
        # Ctrl-C inside next(): ours must keep torch's uninterrupted order
        # (torch's own DataLoader is not run interrupted: it may lose or repeat batches, and
        # with persistent workers it once waited forever in _try_get_data after a Ctrl-C)
        want, _ = order(DataLoader, kw_n, 0)
        ours, caught = order(ArenaLoader, dict(kw_n, generator=torch.Generator().manual_seed(8)), 6)
        status = "SAME" if ours == want else f"DIFF ours {ours} want {want}"
        print(f"[7 Ctrl-C x{caught} in next() nw={nw} pw={pw}] {status}", flush=True)


if __name__ == "__main__":
    before = shm()
    if sys.argv[1:] == ["loop"]:
        loop_checks()
        report_end(before)
        sys.exit()
    base = dict(batch_size=4, shuffle=True)
    for tag, kw in variants(base):
        for how in ("namedtuple", "dataclass", "structured", "bytes/str", "None leaf",
                    "None sample", "Decimal", "Fraction", "tuple of mixed"):
            compare(f"7 {how} {tag}", Leaves(how), seeded(kw), extra={"output": "torch"})
        for how in ("namedtuple", "structured", "tuple of mixed", "bytes/str", "Decimal"):
            compare(f"7 {how} batch_size=None {tag}", Leaves(how),
                    seeded(dict(kw, batch_size=None)), extra={"output": "torch"})
    loop_checks()
    report_end(before)
