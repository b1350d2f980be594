"""A short wait that gives the CPU away instead of sleeping (docs/design.md, "Spinning before
sleeping").

A process that sleeps on a pipe and is woken by the other side's write pays a wake-up on both
sides (measured here: a round trip between two processes costs 22 us of CPU and 64 us of wall
time). When the other side is about to answer (a worker that has just taken its last entry,
``next()`` waiting for a batch that is being written), it is cheaper to yield the CPU a few
times and look again: a yield with nothing else to run returns at once, and one with another
process ready (on a machine with fewer cores than processes, often the very process we wait
for) runs that process first. Bounded by ``SPIN_YIELDS`` yields and ``SPIN_S`` seconds, then
the caller sleeps as before; every counter read is one aligned load of shared memory.
Only between processes: a thread worker shares the GIL with ``next()``, and spinning there
would take turns at it instead.

``next()`` then naps (``nap_while_equal``) when its last wait also outlasted the spin
(``CompletionReader.spin_for``): when batches take longer than the spin (one
worker on 9.6 MB images: ~0.8 ms each) the main process would sleep on the result pipe, and
the worker's write of every record would pay for waking it: 52 us of the worker's time per
batch against 6.5 us when nobody sleeps on the pipe (measured on the 2-core machine). Short
timed sleeps, up to ``NAPS_S``, wake the main process on its own core instead; past that it
sleeps on the pipe as before (a wake-up is then under 3% of a batch's time).
"""

from __future__ import annotations

import os
import time
from typing import Any

SPIN_YIELDS = 500
SPIN_S = 500e-6


def spin_while_equal(counter: Any, index: int, value: int) -> bool:
    """Yield the CPU while ``counter[index] == value``; True once it differs, False when the
    spin ends first (the caller then sleeps)."""
    deadline = time.monotonic() + SPIN_S
    for _ in range(SPIN_YIELDS):
        os.sched_yield()
        if counter[index] != value:
            return True
        if time.monotonic() > deadline:
            break
    return False


NAP_S = 50e-6  # (the kernel's timer slack makes each about 0.1 ms)
NAPS_S = 2e-3


def nap_while_equal(counter: Any, index: int, value: int) -> bool:
    """Sleep ``NAP_S`` at a time while ``counter[index] == value``; True once it differs,
    False after ``NAPS_S`` (the caller then sleeps until it is woken)."""
    deadline = time.monotonic() + NAPS_S
    while time.monotonic() < deadline:
        time.sleep(NAP_S)
        if counter[index] != value:
            return True
    return False
