"""Waiting for a descriptor to become readable, with ``poll(2)``: ``select(2)`` takes only
descriptors below ``FD_SETSIZE`` (1024), and a program holding many open files (a
mosaicml-streaming dataset's shared memory and shard files, a large tokenizer cache) gives
the pipes a loader makes later, and its forked workers' copies, numbers above that, where
``select.select`` raises ``ValueError: filedescriptor out of range in select()``."""

from __future__ import annotations

import select


def readable(fd: int, timeout_s: float) -> bool:
    """True once ``fd`` has data or is at end of file (``select``'s meaning of readable),
    False after ``timeout_s`` seconds (at once when it is 0 or less)."""
    return _ready(fd, select.POLLIN, timeout_s)


def writable(fd: int, timeout_s: float) -> bool:
    """True once a write to ``fd`` would not block (or would fail: a closed reader), False
    after ``timeout_s`` seconds."""
    return _ready(fd, select.POLLOUT, timeout_s)


def _ready(fd: int, events: int, timeout_s: float) -> bool:
    poller = select.poll()
    poller.register(fd, events)
    return bool(poller.poll(max(0.0, timeout_s) * 1000.0))
