"""Soak: many epochs with injected faults (tests/soak.py), in a process of its own; nothing
may accumulate. The default run is short; `--runslow` adds a ten-times longer one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .soak import EVENTS
from .test_fault_matrix import REPO_ROOT

WARMUP_EPOCHS = 10  # both loaders have made their slab and started workers by then
RSS_GROWTH_BOUND = 16 * 2**20  # generous: the report's own samples grow a few hundred KB


def run_soak(epochs: int, timeout_s: float) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "tests.fault_driver", "soak", str(epochs)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s, check=False)
    assert result.returncode == 0 and result.stderr == "", (result.returncode, result.stderr)
    return json.loads(result.stdout.splitlines()[-1])


def assert_flat(report: dict) -> None:
    epochs = report["epochs"]
    assert report["wrong"] == []
    assert report["counts"] == {event: epochs // len(EVENTS) for event in EVENTS}
    assert report["raised"] == {"ValueError": report["counts"]["raise"],
                                "WorkerCrashedError": report["counts"]["kill"]
                                + report["counts"]["exit3"]}
    steady = report["samples"][WARMUP_EPOCHS:]
    # Descriptors and shared memory depend on which loader ran last and how its epoch
    # ended, so each is compared as the highest value over one full cycle of both loaders
    # and all events, first cycle against last: a leak raises it every cycle.
    cycle = 2 * len(EVENTS)

    def first_and_last_peak(key):
        values = [sample[key] for sample in steady]
        return max(values[:cycle]), max(values[-cycle:])

    assert max(s["rss"] for s in steady) - steady[0]["rss"] < RSS_GROWTH_BOUND
    first, last = first_and_last_peak("fds")
    assert last <= first, [s["fds"] for s in steady]
    first, last = first_and_last_peak("shmem")
    assert last <= first + 4096
    assert all(s["slabs"] == 2 and s["shm_objects"] == 0 for s in steady)  # one per loader
    assert all(s["rings"] <= 1 for s in steady)  # the persistent loader's live iterator
    assert all(s["children"] <= 2 and s["zombies"] == 0 for s in steady)
    closed = report["closed"]
    assert (closed["children"], closed["zombies"], closed["slabs"], closed["rings"],
            closed["shm_objects"]) == (0, 0, 0, 0, 0)
    assert closed["fds"] <= report["samples"][0]["fds"]


@pytest.mark.timeout(90)
def test_soak_with_injected_faults_stays_flat():
    """150 epochs over two loaders (persistent and not) with sample errors, SIGKILLed and
    exiting workers and breaks: every batch correct, every fault raised as its error, and
    RSS, descriptors, shared memory, slabs and children flat; nothing left after close."""
    assert_flat(run_soak(150, timeout_s=80))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_long_soak_with_injected_faults_stays_flat():
    """The same for 1,500 epochs."""
    assert_flat(run_soak(1500, timeout_s=850))
