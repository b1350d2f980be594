"""Errors that name what went wrong: worker exceptions, layout mismatches, dead workers."""

from __future__ import annotations

import signal
import time

import numpy as np
import psutil
import pytest

from arena_loader import ArenaLoader, LayoutError, LoaderTimeoutError, WorkerCrashedError

from .datasets import (
    ImageDataset,
    RaisingDataset,
    ShapeChangingDataset,
    SlowDataset,
    SuicidalDataset,
    reference_epoch,
)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_worker_exception_keeps_type_and_iteration_continues(num_workers):
    """A ValueError in __getitem__ is re-raised as ValueError naming worker, idx and indices;
    the next next() yields the following batch, as in torch."""
    dataset = RaisingDataset(12, bad={5})
    expected = reference_epoch(ImageDataset(12), 2, False)
    with ArenaLoader(dataset, batch_size=2, num_workers=num_workers) as loader:
        iterator = iter(loader)
        for i in range(2):
            np.testing.assert_array_equal(next(iterator), expected[i])
        with pytest.raises(ValueError, match="sample 5 is corrupt") as info:
            next(iterator)
        if num_workers:
            message = str(info.value)
            assert "worker 0" in message and "idx=2" in message and "[4, 5]" in message
            assert "Traceback" in message and "__getitem__" in message
            assert isinstance(info.value.__cause__, ValueError)
        for i in range(3, 6):
            np.testing.assert_array_equal(next(iterator), expected[i])
        del iterator


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("odd_shape, odd_dtype, expected", [
    ((3, 8, 9), None, r"uint8\[3, 8, 8\].*got uint8\[3, 8, 9\]"),
    (None, np.float32, r"uint8\[3, 8, 8\].*got float32\[3, 8, 8\]"),
])
def test_mismatched_sample_names_index_field_and_shapes(num_workers, odd_shape, odd_dtype,
                                                        expected):
    """A sample unlike the first raises LayoutError with its index, field, expected/actual."""
    dataset = ShapeChangingDataset(12, odd_index=7, odd_shape=odd_shape, odd_dtype=odd_dtype)
    with ArenaLoader(dataset, batch_size=4, num_workers=num_workers) as loader:
        with pytest.raises(LayoutError, match=rf"sample 7: field sample must be {expected}"):
            for _ in loader:
                pass


def test_nested_structure_mismatch_names_the_path():
    """A missing key in a later dict sample is reported with the sample index and path."""
    class Dataset:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            sample = {"a": np.zeros(2), "b": {"c": np.ones(1), "d": i}}
            if i == 3:
                del sample["b"]["d"]
            return sample

    with ArenaLoader(Dataset(), batch_size=2) as loader:
        with pytest.raises(LayoutError, match=r"sample 3: sample\['b'\] must be a mapping "
                                              r"with keys \['c', 'd'\].*got keys \['c'\]"):
            list(loader)


def test_object_dtype_and_none_samples_are_rejected_clearly():
    """Object arrays and None samples get a LayoutError that says what to do."""
    class ObjectArrays:
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return np.array([None, 1], dtype=object)

    class NoneSamples(ImageDataset):
        def __getitem__(self, i):
            return None if i == 1 else super().__getitem__(i)

    with pytest.raises(LayoutError, match="object-dtype"):
        list(ArenaLoader(ObjectArrays(), batch_size=2))
    with pytest.raises(LayoutError, match=r"dataset\[1\] returned None"):
        for _ in ArenaLoader(NoneSamples(4), batch_size=2, num_workers=1):
            pass


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS])
def test_killed_worker_raises_with_pid_and_signal_promptly(signum, tmp_path):
    """A worker killed by a signal surfaces as WorkerCrashedError naming pid, signal and the
    batch it was loading, well under a second after it dies; the other workers are stopped."""
    stamp = tmp_path / "death"
    dataset = SuicidalDataset(40, fatal_index=9, signum=signum, stamp_path=str(stamp))
    with ArenaLoader(dataset, batch_size=2, num_workers=2) as loader:
        iterator = iter(loader)
        next(iterator)
        pids = iterator.worker_pids
        with pytest.raises(WorkerCrashedError) as info:
            for _ in iterator:
                pass
        detected_after_s = time.time() - float(stamp.read_text())
        assert not any(_alive(pid) for pid in pids)
        del iterator
    error = info.value
    assert error.pid in pids and error.exitcode == -signum
    assert f"pid {error.pid}" in str(error) and signal.Signals(signum).name in str(error)
    assert "batch idx=4 (indices [8, 9])" in str(error)
    if signum == signal.SIGBUS:
        assert "/dev/shm" in str(error)
    assert detected_after_s < 0.5, f"crash took {detected_after_s:.3f} s to surface"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_timeout_raises_runtime_error_naming_seconds():
    """timeout=: a batch slower than the limit raises LoaderTimeoutError (a RuntimeError)."""
    with ArenaLoader(SlowDataset(8, range(2, 8), 5), batch_size=2, num_workers=1,
                     timeout=0.3) as loader:
        iterator = iter(loader)
        next(iterator)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"timed out after 0.3 seconds") as info:
            next(iterator)
        assert isinstance(info.value, LoaderTimeoutError)
        assert time.monotonic() - start < 2.0
        del iterator


def test_key_error_from_worker_stays_a_readable_key_error():
    """KeyError keeps its type, and its message shows the worker traceback, not a repr."""
    class Missing(ImageDataset):
        def __getitem__(self, i):
            return {}["missing"] if i == 3 else super().__getitem__(i)

    with ArenaLoader(Missing(6), batch_size=2, num_workers=1) as loader:
        with pytest.raises(KeyError) as info:
            list(loader)
    text = str(info.value)
    assert "Caught builtins.KeyError in DataLoader worker 0" in text and "\\n" not in text


def test_timeout_message_names_the_worker_and_pid():
    """The timeout error says which batch, worker and pid it was waiting for."""
    with ArenaLoader(SlowDataset(6, {2}, 5), batch_size=2, num_workers=1, timeout=0.2) as loader:
        iterator = iter(loader)
        next(iterator)
        pid = iterator.worker_pids[0]
        with pytest.raises(LoaderTimeoutError, match=rf"idx=1 \(indices \[2, 3\]\) from worker 0 "
                                                     rf"\(pid {pid}\)"):
            next(iterator)
        del iterator
