"""Cheaper forks for the suite's long-lived processes: their memory moved onto 2 MiB pages.

The suite forks ~2,000 loader workers from its two pytest processes (and more from the warm
interpreters, tests/zygote.py), each ~200-350 MB once torch is imported. A fork copies the
parent's page tables, and the child's exit and both sides' first writes after it go through
them again: the kernel's share of that is most of the suite's system time (measured on the
2-core machine: fork, exit and copy-on-write faults took ~100 of its ~400 s of CPU). On
2 MiB pages the tables are 512 times smaller: a fork and exit of a process with torch cost
~15 ms instead of ~30.

``collapse()`` asks the kernel (``MADV_COLLAPSE``, Linux 6.1+) to move what is already in
the process's private anonymous memory onto huge pages, once, where it is called. It changes
no setting: memory allocated later (by this process or the workers it forks) is paged as
before, and where the kernel cannot or will not (another OS, an older kernel, THP disabled,
no free 2 MiB page) it does nothing. What the tests see of the loader does not change: the
workers still share the parent's pages copy-on-write.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

MADV_COLLAPSE = 25  # (linux/mman.h)
HUGE = 2 << 20
_collapsed_at = 0  # the process's anonymous memory at the last collapse()


def collapse() -> int:
    """Move this process's private anonymous memory (its heap, Python's arenas, the
    libraries' zeroed data) onto 2 MiB pages where the kernel can; the bytes moved."""
    global _collapsed_at
    _collapsed_at = anonymous_bytes()
    if not sys.platform.startswith("linux"):
        return 0
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        madvise = libc.madvise
        with open("/proc/self/maps") as maps:
            lines = maps.readlines()
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    moved = 0
    for line in lines:
        fields = line.split()
        span, perms, path = fields[0], fields[1], fields[5] if len(fields) > 5 else ""
        if not perms.startswith("rw") or perms[3] != "p" or path not in ("", "[heap]"):
            continue
        start, end = (int(x, 16) for x in span.split("-"))
        start = -(-start // HUGE) * HUGE
        end = end // HUGE * HUGE
        if end > start and madvise(start, end - start, MADV_COLLAPSE) == 0:
            moved += end - start
    return moved


def collapse_grown(by: int = 32 << 20) -> None:
    """``collapse()`` again once the process's anonymous memory has grown ``by`` bytes since
    the last one (a test imported a library: numba, the bench's peers, Lightning)."""
    if _collapsed_at and anonymous_bytes() - _collapsed_at >= by:
        collapse()


def anonymous_bytes() -> int:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
