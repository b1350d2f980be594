"""Shared-memory capacity: a slab larger than /dev/shm is an error up front, never a SIGBUS."""

from __future__ import annotations

import json
import os

import pytest

from arena_loader import ShmCapacityError, _slab
from arena_loader._slab import NAME_PREFIX, SHM_DIR, Slab

from . import zygote
from .fault_driver import HUGE_BATCH, HUGE_ROW
from .test_fault_matrix import REPO_ROOT

pytestmark = pytest.mark.timeout(60)

BATCH_NBYTES = HUGE_BATCH * HUGE_ROW * 8  # 2**14 rows of int64[2**19]: 64 GiB


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batch_larger_than_shm_fails_at_its_batch_without_sigbus(num_workers):
    """A batch larger than /dev/shm: its next() raises ShmCapacityError naming the bytes
    needed, the bytes available and the fixes, and so does the next batch's; the process is
    not killed by SIGBUS and, once the loader is closed, no worker, /dev/shm object, mapping or
    thread is left."""
    result = zygote.run(["-m", "tests.fault_driver", "capacity", str(num_workers)],
                        cwd=REPO_ROOT, timeout=60)
    assert result.returncode == 0 and result.stderr == "", (result.returncode, result.stderr)
    report = json.loads(result.stdout.splitlines()[-1])
    for error in report["outcomes"]:
        assert error["type"] == "arena_loader.errors.ShmCapacityError"
        message = error["message"]
        assert f"a batch's shared-memory segment needs {BATCH_NBYTES:,} bytes of shared " \
               f"memory but {SHM_DIR} has " in message
        assert "bytes available (checked before allocating)" in message
        assert "--shm-size" in message and "smaller batches" in message
    assert len(report["outcomes"]) == 2
    assert report["leftovers"] == {"children": [], "shm_objects": [], "slab_mappings": [],
                                   "threads": []}


def test_posix_fallocate_enospc_from_the_kernel_is_a_capacity_error(monkeypatch):
    """With the statvfs pre-check passed (space taken after it), the kernel's own ENOSPC from
    posix_fallocate on /dev/shm is ShmCapacityError and the object is unlinked. (tmpfs fails
    a request above its total size at once, without allocating anything.)"""
    stats = os.statvfs(SHM_DIR)
    too_big = 2 * stats.f_blocks * stats.f_frsize
    real = _slab.shm_available_bytes
    answers = iter([too_big])  # the pre-check sees room; the error message sees the truth
    monkeypatch.setattr(_slab, "shm_available_bytes", lambda: next(answers, None) or real())
    with pytest.raises(ShmCapacityError, match=rf"needs {too_big:,} bytes .*\(posix_fallocate: "
                                               r"No space left on device\); fix: .*--shm-size"):
        Slab(too_big, slots=4)
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(NAME_PREFIX)]
