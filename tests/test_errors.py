"""Errors that name what went wrong: worker exceptions, layout mismatches, dead workers."""

from __future__ import annotations

import collections
import os
import re
import signal
import threading
import time

import numpy as np
import psutil
import pytest

from arena_loader import (
    ArenaLoader,
    LayoutError,
    LoaderTimeoutError,
    SampleTypeError,
    WorkerCrashedError,
)
from arena_loader._slab import NAME_PREFIX

from .datasets import (
    ImageDataset,
    KilledWhileMakingSegment,
    RaisingDataset,
    ShapeChangingDataset,
    SlowDataset,
    SuicidalDataset,
    reference_epoch,
)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("num_workers, worker_mode", [(0, "process"), (2, "process"),
                                                      (2, "thread")])
def test_worker_exception_keeps_type_and_iteration_continues(num_workers, worker_mode):
    """A ValueError in __getitem__ is re-raised as ValueError naming worker, idx and indices;
    the next next() yields the following batch, as in torch."""
    dataset = RaisingDataset(12, bad={5})
    expected = reference_epoch(ImageDataset(12), 2, False)
    with ArenaLoader(dataset, batch_size=2, num_workers=num_workers,
                     worker_mode=worker_mode) as loader:
        iterator = iter(loader)
        for i in range(2):
            np.testing.assert_array_equal(next(iterator), expected[i])
        with pytest.raises(ValueError, match="sample 5 is corrupt") as info:
            next(iterator)
        if num_workers:
            message = str(info.value)
            assert "worker process 0." in message and "idx=2" in message and "[4, 5]" in message
            assert "Traceback" in message and "__getitem__" in message
            assert isinstance(info.value.__cause__, ValueError)
        for i in range(3, 6):
            np.testing.assert_array_equal(next(iterator), expected[i])
        del iterator


@pytest.mark.parametrize("num_workers, worker_mode", [(0, "process"), (2, "process"),
                                                      (2, "thread")])
def test_mismatched_sample_shape_names_index_field_shapes_and_fix(num_workers, worker_mode):
    """A sample shaped unlike its batch's first raises LayoutError with both indices, the
    field, both shapes and the fix, for its batch only: the following batch still loads."""
    dataset = ShapeChangingDataset(12, odd_index=7, odd_shape=(3, 8, 9))
    reference = reference_epoch(ImageDataset(12), 4, False)
    with ArenaLoader(dataset, batch_size=4, num_workers=num_workers,
                     worker_mode=worker_mode) as loader:
        iterator = iter(loader)
        np.testing.assert_array_equal(next(iterator), reference[0])
        with pytest.raises(LayoutError, match=r"sample 7: field sample has shape \[3, 8, 9\] "
                                              r"but sample 4 has \[3, 8, 8\].*pad.*collate_fn"):
            next(iterator)
        np.testing.assert_array_equal(next(iterator), reference[2])
        del iterator


class _LengthPerIndex:
    """Sample i: ``lengths.get(i, 3)`` float32 values equal to i."""

    def __init__(self, n: int, lengths: dict):
        self.n, self.lengths = n, lengths

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.ndarray:
        return np.full(self.lengths.get(index, 3), index, np.float32)


@pytest.mark.parametrize("worker_mode, worker_threads", [("process", 1), ("thread", 2)])
def test_a_batch_that_fails_as_it_is_written_leaves_the_next_of_its_structure_whole(
        worker_mode, worker_threads):
    """A batch whose rows turn out unequal as they are written (after it was planned) fails
    alone: the worker's next batch of the same structure and another shape still loads (its
    structure was recorded as sent with the failed batch's plan, which never went out, and
    every later next() raised KeyError: 0)."""
    dataset = _LengthPerIndex(6, {1: 5, 2: 4, 3: 4})
    with ArenaLoader(dataset, batch_size=2, num_workers=1, worker_mode=worker_mode,
                     worker_threads=worker_threads) as loader:
        iterator = iter(loader)
        with pytest.raises(LayoutError, match=r"sample 1: field sample has shape \[5\]"):
            next(iterator)
        np.testing.assert_array_equal(next(iterator), [[2.0] * 4, [3.0] * 4])
        np.testing.assert_array_equal(next(iterator), [[4.0] * 3, [5.0] * 3])
        with pytest.raises(StopIteration):
            next(iterator)
        del iterator


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_sample_of_another_dtype_is_promoted_as_torch_does(num_workers):
    """A float32 sample among uint8 ones: the batch is float32, as torch's default_collate
    stacks it; the other batches stay uint8."""
    torch = pytest.importorskip("torch")
    dataset = ShapeChangingDataset(12, odd_index=7, odd_dtype=np.float32)
    with ArenaLoader(dataset, batch_size=4, num_workers=num_workers, output="numpy") as loader:
        batches = list(loader)
    expected = [torch.utils.data.default_collate([torch.from_numpy(dataset[i])
                                                  for i in range(b, b + 4)])
                for b in (0, 4, 8)]
    assert [b.dtype for b in batches] == [np.uint8, np.float32, np.uint8]
    for ours, theirs in zip(batches, expected):
        np.testing.assert_array_equal(ours, theirs.numpy())


class MissingKeyDataset:
    """Dict samples; sample 3 lacks the nested key 'd'."""

    def __len__(self):
        return 6

    def __getitem__(self, i):
        sample = {"a": np.zeros(2), "b": {"c": np.ones(1), "d": i}}
        if i == 3:
            del sample["b"]["d"]
        return sample


@pytest.mark.parametrize("num_workers", [0, 2])
def test_nested_structure_mismatch_names_the_path(num_workers):
    """A missing key in a later dict sample is reported with the sample index, path and fix;
    the batch after it still loads."""
    with ArenaLoader(MissingKeyDataset(), batch_size=2, num_workers=num_workers) as loader:
        iterator = iter(loader)
        assert next(iterator)["b"]["d"].tolist() == [0, 1]
        with pytest.raises(LayoutError, match=r"sample 3: sample\['b'\] must be a mapping "
                                              r"with keys \['c', 'd'\].*got keys \['c'\]; return "
                                              r"the same structure"):
            next(iterator)
        assert next(iterator)["b"]["d"].tolist() == [4, 5]
        del iterator


class WrongContainerDataset:
    """Dict samples; sample 3 is ``kind``: a dict without the key 'y', a dict with 'label'
    instead, a tuple of the values, or a generator."""

    def __init__(self, kind: str):
        self.kind = kind

    def __len__(self):
        return 6

    def __getitem__(self, i):
        if i != 3:
            return {"x": np.full(2, i), "y": i}
        return {"missing": {"x": np.full(2, i)}, "renamed": {"x": np.full(2, i), "label": i},
                "tuple": (np.full(2, i), i), "generator": (v for v in (i, i))}[self.kind]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind, torch_error", [("missing", KeyError), ("renamed", KeyError),
                                               ("tuple", TypeError),
                                               ("generator", TypeError)])
def test_a_sample_of_another_structure_is_the_error_class_torch_raises(num_workers, kind,
                                                                       torch_error):
    """A later sample that lacks a key of the first is a ``KeyError`` (torch's
    ``default_collate`` looks the key up in it), one that is not a mapping at all a
    ``TypeError`` (torch subscripts it): the class torch raises, so ``except KeyError`` keeps
    working, and a LayoutError naming the sample and the fix; the next batch still loads."""
    import torch.utils.data

    with pytest.raises(torch_error):
        list(torch.utils.data.DataLoader(WrongContainerDataset(kind), batch_size=2))
    with ArenaLoader(WrongContainerDataset(kind), batch_size=2,
                     num_workers=num_workers) as loader:
        iterator = iter(loader)
        assert next(iterator)["y"].tolist() == [0, 1]
        with pytest.raises(torch_error) as caught:
            next(iterator)
        assert isinstance(caught.value, LayoutError)
        assert re.search(r"sample 3: sample must be a mapping with keys \['x', 'y'\]",
                         str(caught.value)), str(caught.value)
        assert "return the same structure" in str(caught.value)
        assert not str(caught.value).startswith(("'", '"'))  # a KeyError's text, not its repr
        assert next(iterator)["y"].tolist() == [4, 5]
        del iterator


class ExtraKeyDataset:
    """Dict samples; odd indices carry a key the even ones lack."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> dict:
        sample = {"x": np.full(2, index)}
        if index % 2:
            sample["mask"] = np.ones(2, bool)
        return sample


def test_a_later_sample_with_a_key_the_first_lacks_is_an_error_not_a_dropped_value():
    """torch's default_collate takes the keys of the batch's first sample and drops a later
    sample's extra keys silently (its ``mask`` never reaches the batch); ours names the
    sample, both key lists and the fix (docs/migrating.md): no value is lost unseen."""
    import torch.utils.data

    assert list(next(iter(torch.utils.data.DataLoader(ExtraKeyDataset(), batch_size=4)))) \
        == ["x"]
    with ArenaLoader(ExtraKeyDataset(), batch_size=4) as loader:
        with pytest.raises(LayoutError, match=r"sample 1: sample must be a mapping with keys "
                                              r"\['x'\].*got keys \['x', 'mask'\]; return the "
                                              r"same structure.*or pass a collate_fn"):
            next(iter(loader))


def test_object_dtype_and_none_samples_are_rejected_clearly():
    """Object arrays get torch's TypeError (and a LayoutError) and None samples a LayoutError,
    each saying what to do; a collate_fn's object array is handed out as it is, as torch's."""
    class ObjectArrays:
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return np.array([None, 1], dtype=object)

    class NoneSamples(ImageDataset):
        def __getitem__(self, i):
            return None if i == 1 else super().__getitem__(i)

    with pytest.raises(SampleTypeError, match=r"found object \(sample 0 is an object-dtype"):
        list(ArenaLoader(ObjectArrays(), batch_size=2))
    with pytest.raises(TypeError, match=r"found object \(field sample\['a'\] of sample 0"):
        list(ArenaLoader([{"a": np.array([None], dtype=object)}] * 2, batch_size=2))
    kept = next(iter(ArenaLoader(ObjectArrays(), batch_size=2, collate_fn=np.stack)))
    assert kept.dtype == object and kept.tolist() == [[None, 1], [None, 1]]
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
    assert (f"In torch's words: DataLoader worker (pid(s) {error.pid}) exited unexpectedly; "
            f"DataLoader worker (pid {error.pid}) is killed by signal: "
            f"{signal.strsignal(signum)}. ") in str(error)
    if signum == signal.SIGBUS:
        assert "/dev/shm" in str(error)
    assert detected_after_s < 0.5, f"crash took {detected_after_s:.3f} s to surface"


class _ExitsWithCode(ImageDataset):
    def __init__(self, n: int, code: int):
        super().__init__(n)
        self.code = code

    def __getitem__(self, index: int) -> np.ndarray:
        if index == 5:
            os._exit(self.code)
        return super().__getitem__(index)


@pytest.mark.parametrize("code", [0, 3])
def test_a_worker_that_exits_mid_batch_is_a_crash_naming_its_exit_code(code):
    """A worker gone with an exit status while it owed a batch: the message names the code
    (0 too: not "was killed by" a signal 0), then says it in torch's words."""
    with ArenaLoader(_ExitsWithCode(12, code), batch_size=2, num_workers=1) as loader:
        with pytest.raises(WorkerCrashedError) as info:
            list(loader)
    error = info.value
    assert error.exitcode == code
    assert f"exited with code {code} while loading batch idx=2 (indices [4, 5])" in str(error)
    torch_words = f"DataLoader worker (pid(s) {error.pid}) exited unexpectedly"
    if code:
        torch_words += (f"; DataLoader worker (pid {error.pid}) exited unexpectedly with exit "
                        f"code {code}. Details are lost due to multiprocessing.")
    assert f"In torch's words: {torch_words}" in str(error)


def test_a_worker_that_cannot_map_the_sized_slab_reports_why(monkeypatch):
    """A (forked) worker whose mapping of the slab fails once the first batch sized it:
    its own error reaches next() with its type and worker id, not a bare worker crash."""
    from arena_loader import ShmCapacityError
    from arena_loader._slab import SlabHandle

    real_map = SlabHandle.map

    def no_room(self, nbytes=None):
        if nbytes is None:  # (the order ring's)
            return real_map(self)
        raise ShmCapacityError(12, "mmap: Cannot allocate memory (test)")

    monkeypatch.setattr(SlabHandle, "map", no_room)
    with ArenaLoader(ImageDataset(16), batch_size=2, num_workers=2,
                     multiprocessing_context="fork") as loader:
        with pytest.raises(ShmCapacityError, match=r"(?s)^Caught ShmCapacityError in "
                                                   r"DataLoader worker process \d.*test\)") as info:
            list(loader)
    assert info.value.worker_id in (0, 1) and info.value.batch_idx is None


def test_a_worker_killed_while_making_a_segment_leaves_no_name_in_dev_shm():
    """SIGKILL cannot be caught: a worker killed between creating a shared-memory object and
    unlinking its name leaves the name, and only the main process, which reaps it, can
    remove it. Found in CI: one such name made every later test's leak check fail."""
    dataset = KilledWhileMakingSegment(16, fatal_index=5)
    with ArenaLoader(dataset, batch_size=2, num_workers=2, persistent_workers=True) as loader:
        with pytest.raises(WorkerCrashedError) as info:
            for _ in loader:
                pass
        pid = info.value.pid
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"{NAME_PREFIX}{pid}_")]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("worker_mode", ["process", "thread"])
def test_timeout_raises_runtime_error_naming_seconds(worker_mode):
    """timeout=: a batch slower than the limit raises LoaderTimeoutError (a RuntimeError)."""
    dataset = SlowDataset(8, range(2, 8), 5)
    with ArenaLoader(dataset, batch_size=2, num_workers=1, timeout=0.3,
                     worker_mode=worker_mode) as loader:
        iterator = iter(loader)
        next(iterator)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"timed out after 0.3 seconds") as info:
            next(iterator)
        assert isinstance(info.value, LoaderTimeoutError)
        assert time.monotonic() - start < 2.0
        dataset.release()  # (close() then need not wait for the stuck worker)
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
    assert text.startswith("Caught KeyError in DataLoader worker process 0.\nbuiltins.KeyError "
                           "while loading") and "\\n" not in text


class HoldsALockError(Exception):
    """An error whose instance does not pickle (a lock attribute), as a client library's may."""

    def __init__(self, message):
        super().__init__(message)
        self.lock = threading.Lock()


class UnpicklableErrorDataset(ImageDataset):
    def __getitem__(self, i):
        if i == 3:
            raise HoldsALockError("sample 3 unreadable")
        return super().__getitem__(i)


@pytest.mark.parametrize("worker_mode", ["process", "thread"])
def test_an_error_that_does_not_pickle_keeps_its_type_as_with_torch(worker_mode):
    """torch re-raises a worker's error as its class built from the message
    (``ExceptionWrapper.reraise``: seen raising HoldsALockError with 1 worker), so an error
    whose instance cannot cross processes keeps its type there; ours became RuntimeError."""
    with ArenaLoader(UnpicklableErrorDataset(6), batch_size=2, num_workers=1,
                     worker_mode=worker_mode) as loader:
        with pytest.raises(HoldsALockError) as info:
            list(loader)
    assert "sample 3 unreadable" in str(info.value) and info.value.batch_idx == 1


def test_timeout_message_names_the_worker_and_pid():
    """The timeout error says which batch, worker and pid it was waiting for."""
    dataset = SlowDataset(6, {2}, 5)
    with ArenaLoader(dataset, batch_size=2, num_workers=1, timeout=0.2) as loader:
        iterator = iter(loader)
        next(iterator)
        pid = iterator.worker_pids[0]
        with pytest.raises(LoaderTimeoutError, match=rf"idx=1 \(indices \[2, 3\]\) from worker 0 "
                                                     rf"\(pid {pid}\)"):
            next(iterator)
        dataset.release()
        del iterator


@pytest.mark.timeout(30)
def test_timeout_message_names_only_the_batch_next_waits_for():
    """Several batches in flight, two workers stuck: in order, next() waits for one batch,
    and the timeout error names that one alone (not every batch in flight)."""
    dataset = SlowDataset(8, {2, 4}, 5)
    with ArenaLoader(dataset, batch_size=2, num_workers=2, timeout=0.3) as loader:
        iterator = iter(loader)
        next(iterator)
        pid = iterator.worker_pids[1]
        with pytest.raises(LoaderTimeoutError, match=rf"waiting for batch idx=1 \(indices "
                                                     rf"\[2, 3\]\) from worker 1 \(pid {pid}\), "
                                                     r"which is still running"):
            next(iterator)
        dataset.release()
        del iterator


class CorruptSampleError(Exception):
    """A user-defined exception type: it must come back as itself, not as RuntimeError."""


class HookDataset:
    """``{"i": index, "x": pair}`` samples; with ``hook="__getitems__"`` it also fetches a
    batch at a time. Loading sample 11 fails in ``hook`` when it names one of its methods."""

    def __init__(self, hook: str):
        self.hook = hook
        if hook == "__getitems__":
            self.__getitems__ = self._getitems

    def __len__(self):
        return 24

    def __getitem__(self, i):
        if self.hook == "__getitem__" and i == 11:
            raise CorruptSampleError(f"sample {i} is corrupt")
        return {"i": i, "x": np.full(2, i, np.int64)}

    def _getitems(self, indices):
        if 11 in indices:
            raise CorruptSampleError(f"batch {indices} is corrupt")
        return [self[i] for i in indices]


def failing_collate(samples):
    indices = [s["i"] for s in samples]
    if 11 in indices:
        raise CorruptSampleError(f"cannot collate {indices}")
    return {"i": np.array(indices), "x": np.stack([s["x"] for s in samples])}


@pytest.mark.parametrize("num_workers", [1, 3])
@pytest.mark.parametrize("hook", ["__getitem__", "__getitems__", "collate_fn"])
def test_hook_exception_is_reraised_with_type_worker_idx_indices_and_traceback(hook,
                                                                              num_workers):
    """An exception of a user-defined type in __getitem__, __getitems__ or collate_fn comes
    back as that type, naming worker, batch idx and indices, with the worker traceback and
    attributes; the next next() yields the following batch."""
    dataset = HookDataset(hook)
    collate = failing_collate if hook == "collate_fn" else None
    with ArenaLoader(dataset, batch_size=2, num_workers=num_workers,
                     collate_fn=collate) as loader:
        iterator = iter(loader)
        assert [next(iterator)["i"].tolist() for _ in range(5)] == [[2 * k, 2 * k + 1]
                                                                   for k in range(5)]
        with pytest.raises(CorruptSampleError) as info:
            next(iterator)
        following = [b["i"].tolist() for b in iterator]
        del iterator
    error, worker = info.value, 5 % num_workers
    message = str(error)
    # torch's first line, word for word; then the type, batch and indices
    assert message.startswith(f"Caught CorruptSampleError in DataLoader worker process {worker}.\n"
                              f"{__name__}.CorruptSampleError while loading batch idx=5 "
                              "(indices [10, 11]).\n")
    function, text = {"__getitem__": ("__getitem__", "sample 11 is corrupt"),
                      "__getitems__": ("_getitems", "batch [10, 11] is corrupt"),
                      "collate_fn": ("failing_collate", "cannot collate [10, 11]")}[hook]
    assert ".\nOriginal Traceback (most recent call last):\n" in message
    assert f", in {function}\n" in message
    assert message.rstrip().endswith(f"CorruptSampleError: {text}")
    assert (error.worker_id, error.batch_idx, error.indices) == (worker, 5, [10, 11])
    assert type(error.__cause__) is CorruptSampleError
    assert following == [[2 * k, 2 * k + 1] for k in range(6, 12)]


class ShortDataset(ImageDataset):
    """len() says 10, but only 8 samples load."""

    def __len__(self):
        return 10

    def __getitem__(self, index):
        if index >= 8:
            raise IndexError(f"no sample {index}")
        return super().__getitem__(index)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataset_shorter_than_its_len_names_len_and_fix(num_workers):
    """A dataset whose __getitem__ fails inside range(len(dataset)): IndexError naming the
    indices, the length and the fix, after every batch before it."""
    reference = reference_epoch(ImageDataset(8), 2, False)
    with ArenaLoader(ShortDataset(10), batch_size=2, num_workers=num_workers) as loader:
        iterator = iter(loader)
        for expected in reference:
            np.testing.assert_array_equal(next(iterator), expected)
        with pytest.raises(IndexError, match=r"IndexError loading indices \[8, 9\], which are "
                                             r"within len\(dataset\) = 10; .*make __len__ agree "
                                             r"with __getitem__ \(no sample 8\)"):
            next(iterator)
        with pytest.raises(StopIteration):
            next(iterator)
        del iterator


class OutOfRangeSampler:
    """Yields 0..7 with 8 (len(dataset): the first index outside) in place of 4."""

    def __iter__(self):
        return iter([0, 1, 2, 3, 8, 5, 6, 7])

    def __len__(self):
        return 8


class OutOfRangeBatchSampler:
    def __iter__(self):
        return iter([[0, 1], [2, 3], [8, 5], [6, 7]])

    def __len__(self):
        return 4


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("option", ["sampler", "batch_sampler"])
def test_sampler_out_of_range_names_index_length_and_sampler(option, num_workers):
    """An index outside range(len(dataset)) from a user sampler or batch_sampler: IndexError
    naming the index, the dataset length and the sampler; no other batch is lost."""
    reference = reference_epoch(ImageDataset(8), 2, False)
    sampler = OutOfRangeSampler() if option == "sampler" else OutOfRangeBatchSampler()
    batch_size = 2 if option == "sampler" else 1
    with ArenaLoader(ImageDataset(8), batch_size=batch_size, num_workers=num_workers,
                     **{option: sampler}) as loader:
        _error_in_place(loader, reference[:2], reference[3], IndexError,
                        rf"{option} {type(sampler).__name__} yielded sample index 8 \(in "
                        r"indices \[8, 5\]\), but len\(dataset\) is 8; a sampler must yield")


def _error_in_place(loader, before, after, error, match):
    """The batches ``before``, then ``error`` for one batch, then ``after``: no other batch
    is lost."""
    iterator = iter(loader)
    for expected in before:
        np.testing.assert_array_equal(next(iterator), expected)
    with pytest.raises(error, match=match):
        next(iterator)
    np.testing.assert_array_equal(next(iterator), after)
    del iterator


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_empty_batch_from_a_batch_sampler_names_the_batch_sampler_and_fix(num_workers):
    """A batch_sampler yielding an empty list under default collation: torch's IndexError
    (its default_collate reads the first sample), saying what yielded it and the fix; the
    batches after it load, as torch's. Before: a bare 'list index out of range'."""
    import torch.utils.data

    batches = [[0, 1], [], [2, 3]]
    torch_iterator = iter(torch.utils.data.DataLoader(ImageDataset(4), batch_sampler=batches))
    next(torch_iterator)
    with pytest.raises(IndexError):
        next(torch_iterator)
    reference = reference_epoch(ImageDataset(4), 2, False)
    with ArenaLoader(ImageDataset(4), batch_sampler=batches, num_workers=num_workers) as loader:
        _error_in_place(loader, reference[:1], reference[1], IndexError,
                        r"empty batch \(indices \[\]\).*batch_sampler yielded an empty "
                        r"list.*skip empty batches, or pass a collate_fn")


class BadSampleDataset(ImageDataset):
    """Sample ``bad`` is None or an object-dtype array."""

    def __init__(self, n, bad, kind):
        super().__init__(n, shape=(2,), dtype=np.int64)
        self.bad, self.kind = bad, kind

    def __getitem__(self, index):
        if index == self.bad:
            return None if self.kind == "none" else np.array([None, 1], dtype=object)
        return super().__getitem__(index)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind, bad, pattern", [
    ("none", 3, r"dataset\[3\] returned None; .*filter missing samples"),
    ("none", 0, r"dataset\[0\] returned None; .*filter missing samples"),
    ("object", 3, r"found object \(sample 3 is an object-dtype array \(object\), which "
                  r"default collation cannot batch; convert it to a numeric"),
])
def test_none_or_object_sample_fails_only_its_batch(kind, bad, pattern, num_workers):
    """A None sample (also as the very first, which the layout is learnt from) or a later
    object-dtype sample: LayoutError naming the sample and the fix; every other batch loads."""
    dataset = BadSampleDataset(8, bad, kind)
    reference = reference_epoch(ImageDataset(8, shape=(2,), dtype=np.int64), 2, False)
    bad_idx = bad // 2
    with ArenaLoader(dataset, batch_size=2, num_workers=num_workers) as loader:
        iterator = iter(loader)
        for idx, expected in enumerate(reference):
            if idx == bad_idx:
                with pytest.raises(LayoutError, match=pattern):
                    next(iterator)
            else:
                np.testing.assert_array_equal(next(iterator), expected)
        with pytest.raises(StopIteration):
            next(iterator)
        del iterator


def misfit_collate(samples):
    """Collates like the default, except for the batches starting at 4, 8 and 12."""
    batch = {"x": np.stack(samples)}
    first = int(samples[0][0]) // 10
    if first == 4:
        batch["x"] = batch["x"].astype(np.float32)  # another dtype
    elif first == 8:
        batch = {"y": batch["x"]}  # another structure
    elif first == 12:
        batch["x"] = np.concatenate([batch["x"], batch["x"]])  # more rows than the slot
    return batch


class TensDataset:
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return np.array([10 * i, 10 * i + 1], np.int64)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_collate_fn_output_may_change_dtype_structure_and_rows_every_batch(num_workers):
    """A collate_fn's batch is laid out on its own: another dtype, another structure or more
    rows than earlier batches all arrive as the collate_fn made them."""
    with ArenaLoader(TensDataset(), batch_size=2, num_workers=num_workers,
                     collate_fn=misfit_collate, output="numpy") as loader:
        batches = list(loader)
    for idx, batch in enumerate(batches):
        expected = misfit_collate([TensDataset()[2 * idx], TensDataset()[2 * idx + 1]])
        assert list(batch) == list(expected)
        for key in expected:
            assert batch[key].dtype == expected[key].dtype
            np.testing.assert_array_equal(batch[key], expected[key])
    assert [b.get("x", b.get("y")).shape[0] for b in batches] == [2, 2, 2, 2, 2, 2, 4, 2]


def _make_row_type(worker_id):
    """worker_init_fn: makes this module's ``WorkerRow`` type in the worker only (a schema
    read as the worker opens its file), so the main process has no such attribute."""
    globals()["WorkerRow"] = collections.namedtuple("WorkerRow", "x y")


class WorkerRows:
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int):
        return globals()["WorkerRow"](np.full(3, index), index)


@pytest.mark.parametrize("persistent_workers", [False, True])
def test_a_structure_type_the_main_process_cannot_import_is_one_clear_fatal_error(
        persistent_workers):
    """A namedtuple type that exists only in the workers: next() raises a LayoutError naming
    the batch and the fix (not pickle's bare AttributeError at every next()), and with
    persistent workers the next iter() starts afresh instead of raising it again."""
    with ArenaLoader(WorkerRows(), batch_size=2, num_workers=2, worker_init_fn=_make_row_type,
                     persistent_workers=persistent_workers) as loader:
        for _ in range(2):
            iterator = iter(loader)
            for _ in range(2):
                with pytest.raises(LayoutError, match=r"batch idx=0 from worker 0 has a "
                                   r"structure the main process cannot rebuild \(.*WorkerRow.*"
                                   r"\).*define that type at module level"):
                    next(iterator)
            del iterator
