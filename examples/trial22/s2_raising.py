"""s2: ``__getitem__`` raises (or kills its process) at sample 9 of 20, batches of 4.

    python s2_raising.py [substring]
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

import torch
from common import BAD, Case, N, compare, report
from torch.utils.data import Dataset


class NeedsArgsError(Exception):
    """A user's exception whose ``__init__`` takes two required arguments (pickling and
    torch's ``ExceptionWrapper`` call ``type(e)(message)``, which fails)."""

    def __init__(self, path, code):
        super().__init__(f"cannot decode {path} (code {code})")
        self.path, self.code = path, code


class HoldsLockError(ValueError):
    """An exception that keeps an unpicklable attribute (a lock, an open handle)."""

    def __init__(self, message):
        super().__init__(message)
        self.lock = threading.Lock()


def local_exception_class():
    class LocalError(RuntimeError):
        pass
    return LocalError


class Raising(Dataset):
    def __init__(self, kind: str, length: int = N):
        self.kind, self.length = kind, length
        self.items = [torch.full((3,), float(i)) for i in range(N)]

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        if i == BAD:
            RAISE[self.kind](i)
        return {"x": self.items[i], "y": i}   # an IndexError past N: a __len__ too long


def raise_(error):
    def act(i):
        raise error
    return act


def segfault(i):
    ctypes.string_at(0)


RAISE = {
    "none": lambda i: None,
    "index": lambda i: [][i],
    "key": raise_(KeyError("img_0009.jpg")),
    "key-multiline": raise_(KeyError("missing\nannotation for img_0009.jpg")),
    "value": raise_(ValueError("bad pixel data in sample 9")),
    "needs-args": raise_(NeedsArgsError("img_0009.jpg", 3)),
    "holds-lock": raise_(HoldsLockError("sample 9 is corrupt")),
    "local-class": lambda i: (_ for _ in ()).throw(local_exception_class()("local")),
    "system-exit": lambda i: sys.exit(3),
    "os-exit": lambda i: os._exit(3),
    "segfault": segfault,
    "memory": raise_(MemoryError()),
    "keyboard": raise_(KeyboardInterrupt()),
    "stop-iteration": raise_(StopIteration()),
    "recursion": raise_(RecursionError("maximum recursion depth exceeded")),
    "no-args": raise_(ValueError()),
    "non-str-args": raise_(OSError(5, "Input/output error", "/data/img_0009.jpg")),
}

WORKERS = ((2, False), (2, True))
CRASH = "a crash ends the iterator; batches done before it come first"
RETRY = "nw=0: an interrupted next() loads its batch again (Ctrl-C loses no batch)"
CASES = [
    Case("len-too-long", lambda: Raising("none", N + 2), names=(r"\b20\b|\b21\b", r"__len__"),
         fix=r"__len__"),
    Case("index-error", lambda: Raising("index")),
    Case("key-error", lambda: Raising("key"), names=(r"img_0009",)),
    Case("key-error-multiline", lambda: Raising("key-multiline"), names=(r"img_0009",)),
    Case("value-error", lambda: Raising("value"), names=(r"sample 9",)),
    Case("needs-init-args", lambda: Raising("needs-args"), names=(r"img_0009",)),
    Case("holds-unpicklable", lambda: Raising("holds-lock"), names=(r"corrupt",)),
    Case("local-exception-class", lambda: Raising("local-class"), names=(r"local",),
         known="torch's worker cannot pickle the class and hangs; ours a RuntimeError",
         hard_s=12),
    Case("system-exit", lambda: Raising("system-exit"), configs=WORKERS,
         names=(r"exit code 3", r"\[8, 9, 10, 11\]"), fix=r"num_workers=0", known=CRASH),
    Case("system-exit-nw0", lambda: Raising("system-exit"), configs=((0, False),),
         known=RETRY),
    Case("os-exit", lambda: Raising("os-exit"), names=(r"exit code 3", r"\[8, 9, 10, 11\]"),
         fix=r"num_workers=0", known=CRASH),
    Case("segfault", lambda: Raising("segfault"), names=(r"SIGSEGV", r"\[8, 9, 10, 11\]"),
         fix=r"num_workers=0", known=CRASH),
    Case("memory-error", lambda: Raising("memory")),
    Case("keyboard-interrupt", lambda: Raising("keyboard"), configs=((0, False),), known=RETRY),
    Case("keyboard-interrupt-worker", lambda: Raising("keyboard"), configs=WORKERS,
         names=(r"\[8, 9, 10, 11\]",), known=CRASH),
    Case("stop-iteration", lambda: Raising("stop-iteration"), names=(r"\[8, 9, 10, 11\]",),
         fix=r"raise IndexError", known="torch ends the epoch silently; ours a RuntimeError"),
    Case("recursion-error", lambda: Raising("recursion")),
    Case("error-without-args", lambda: Raising("no-args")),
    Case("oserror-args", lambda: Raising("non-str-args"), names=(r"img_0009",)),
]

if __name__ == "__main__":
    for case in CASES:
        compare(case)
    report()
