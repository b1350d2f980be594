"""worker_threads=K: K threads per worker share out each batch's samples, write rows straight
into the slot, and change nothing else (batches, order, errors, timeout, crashes, close)."""

from __future__ import annotations

import io
import os
import signal
import threading
import time
import traceback

import numpy as np
import pytest

import arena_loader._fetch as fetch_module
from arena_loader import (
    ArenaLoader,
    LoaderTimeoutError,
    WorkerCrashedError,
    get_worker_info,
)
from arena_loader._sample_threads import Pace, SampleThreads

from .conftest import live_children, our_threads, wait_until
from .datasets import ImageDataset, SuicidalDataset, assert_batches_equal, host_epoch

pytestmark = pytest.mark.timeout(60)

MODES = ("process", "thread")


class Records(ImageDataset):
    """A dict per sample: an image, the index, and which worker thread loaded it."""

    def __getitem__(self, index: int) -> dict:
        info = get_worker_info()
        return {"image": super().__getitem__(index), "index": index,
                "worker": np.int64(info.id), "thread": np.int64(info.thread_id),
                "draw": np.float64(info.rng.random())}


class MixedDataset(ImageDataset):
    """Sample ``odd`` is float64 where the others are uint8 (collation promotes the field),
    sample ``named`` carries a str (an object leaf)."""

    def __init__(self, n: int, odd: int):
        super().__init__(n, shape=(3,), dtype=np.uint8)
        self.odd = odd

    def __getitem__(self, index: int) -> tuple:
        image = super().__getitem__(index)
        if index == self.odd:
            image = image.astype(np.float64) + 0.5
        return image, index


class CorruptError(Exception):
    """A dataset's own error type, with a field."""

    def __init__(self, message: str, index: int = -1):
        super().__init__(message)
        self.index = index


class NotelessError(CorruptError):
    """An error as Python 3.10 makes them: no ``add_note``."""

    add_note = None


class FailingDataset(ImageDataset):
    """Raises ``CorruptError`` for every index in ``bad``: at once for the first, after a short
    wait for the others, so that a later row's error arrives last."""

    def __init__(self, n: int, bad: set[int], error: type[CorruptError] = CorruptError):
        super().__init__(n)
        self.bad, self.error = bad, error

    def __getitem__(self, index: int) -> np.ndarray:
        if index in self.bad:
            if index != min(self.bad):
                time.sleep(0.05)
            raise self.error(f"sample {index} is corrupt", index)
        return super().__getitem__(index)


def _epoch(dataset, **options) -> list:
    return host_epoch(dataset, batch_size=8, num_workers=2, **options)


@pytest.mark.parametrize("mode", MODES)
def test_worker_threads_give_the_same_batches_in_the_same_order(mode):
    """K threads per worker give worker_threads=1's batches, in its order, shuffled too."""
    dataset = ImageDataset(61, shape=(3, 5), dtype=np.float32)
    for options in ({}, {"shuffle": True, "generator": 7}, {"drop_last": True}):
        expected = _epoch(dataset, worker_mode=mode, **options)
        got = _epoch(dataset, worker_mode=mode, worker_threads=3, **options)
        assert len(got) == len(expected)
        for i, (batch, ref) in enumerate(zip(got, expected)):
            assert_batches_equal(batch, ref, f"{options} batch {i}")


def test_rows_are_written_in_place_and_mismatches_collate_as_with_one_thread(monkeypatch):
    """Matching samples are written row by row (no collation pass); a batch with a sample of
    another dtype or an object leaf is collated as worker_threads=1 collates it."""
    calls = []
    original = fetch_module.prepare_samples
    monkeypatch.setattr(fetch_module, "prepare_samples",
                        lambda samples, indices, *live: calls.append(list(indices))
                        or original(samples, indices, *live))
    dataset = ImageDataset(32, shape=(4, 4), dtype=np.int16)
    got = _epoch(dataset, worker_mode="thread", worker_threads=4)
    assert calls == []  # every batch written in place
    for batch, ref in zip(got, _epoch(dataset, worker_mode="thread"), strict=True):
        assert_batches_equal(batch, ref)
    calls.clear()
    mixed = MixedDataset(32, odd=13)
    got = _epoch(mixed, worker_mode="thread", worker_threads=4)
    assert calls == [list(range(8, 16))]  # only the batch with the float sample
    assert got[1][0].dtype == np.float64 and got[0][0].dtype == np.uint8
    for batch, ref in zip(got, _epoch(mixed, worker_mode="thread"), strict=True):
        assert_batches_equal(batch, ref)


class _Misfits:
    """Rows that a row-by-row write would take wrongly: sample 5's image broadcasts into the
    others' shape, sample 10's count is a float among ints, sample 21's id is outside int64.
    Each arrives after its batch's first row (which plans the batch)."""

    def __len__(self):
        return 32

    def __getitem__(self, index):
        if index in (5, 10, 21):
            time.sleep(0.01)
        return {"image": np.full(1 if index == 5 else 4, index, np.int16),
                "count": index + 0.5 if index == 10 else index,
                "id": 2**64 if index == 21 else index}


def _outcomes(loader) -> list:
    """Each batch (as numpy arrays) or its error's type and message, in order."""
    iterator, got = iter(loader), []
    while True:
        try:
            got.append({key: np.array(value) for key, value in next(iterator).items()})
        except StopIteration:
            return got
        except (RuntimeError, TypeError, ValueError) as error:
            got.append((type(error), str(error).partition("\n")[0]))


def test_rows_that_would_broadcast_truncate_or_overflow_collate_as_with_one_thread():
    """Rows written in place only when they match the first exactly: a sample whose image
    would broadcast into the row, a float among ints, an int past int64 each give the batch
    (or its error) that worker_threads=1 gives."""
    options = dict(batch_size=8, num_workers=1, worker_mode="thread", output="numpy")
    with ArenaLoader(_Misfits(), **options) as loader:
        expected = _outcomes(loader)
    with ArenaLoader(_Misfits(), worker_threads=4, **options) as loader:
        got = _outcomes(loader)
    assert [type(item) for item in expected] == [tuple, dict, tuple, dict]
    assert expected[1]["count"].dtype == np.float32
    for mine, reference in zip(got, expected, strict=True):
        if isinstance(reference, tuple):
            assert mine == reference
        else:
            assert_batches_equal(mine, reference)


@pytest.mark.parametrize("mode", MODES)
def test_each_thread_loads_its_share_with_worker_info_and_a_reproducible_rng(mode):
    """get_worker_info() answers in every thread (worker id, thread index, torch's fields);
    thread t loads rows t, t+K, ...; its rng gives the same draws in every run."""
    dataset = Records(48, shape=(2,), dtype=np.uint8)
    runs = [_epoch(dataset, worker_mode=mode, worker_threads=3, generator=5) for _ in range(2)]
    for idx, batch in enumerate(runs[0]):
        assert list(batch["index"]) == list(range(idx * 8, idx * 8 + 8))
        assert set(batch["worker"]) == {idx % 2}
        assert list(batch["thread"]) == [row % 3 for row in range(8)]
    draws = [np.concatenate([b["draw"] for b in run]) for run in runs]
    np.testing.assert_array_equal(draws[0], draws[1])
    assert len(set(draws[0])) == len(draws[0])  # the six threads' streams differ
    other = np.concatenate([b["draw"] for b in _epoch(dataset, worker_mode=mode,
                                                     worker_threads=3, generator=6)])
    assert not np.array_equal(draws[0], other)


def test_collate_fn_gets_the_concurrently_fetched_samples_once_in_order():
    """With a collate_fn, the samples are fetched by the threads and collated once, in
    sample order."""
    seen = []

    def collate(samples):
        seen.append((threading.current_thread().name, [int(s["index"]) for s in samples]))
        return {"index": np.array([s["index"] for s in samples]),
                "thread": np.array([s["thread"] for s in samples])}

    got = _epoch(Records(24, shape=(2,), dtype=np.uint8), worker_mode="thread",
                 worker_threads=4, collate_fn=collate)
    assert [list(b["index"]) for b in got] == [list(range(i, i + 8)) for i in (0, 8, 16)]
    assert list(got[0]["thread"]) == [0, 1, 2, 3, 0, 1, 2, 3]
    assert sorted(s[1][0] for s in seen) == [0, 8, 16]
    assert {name for name, _ in seen} <= {"arena_loader-worker-0", "arena_loader-worker-1"}


@pytest.mark.parametrize("error", [CorruptError, NotelessError])
@pytest.mark.parametrize("mode", MODES)
def test_error_keeps_type_traceback_and_first_sample_index(mode, error):
    """A sample's error comes back with its type, its traceback and the sample index: the
    batch's first failing row, as with one thread; the epoch goes on. Also for an error
    without ``add_note`` (every error on Python 3.10): the index goes into ``__notes__``."""
    dataset = FailingDataset(32, bad={9, 14}, error=error)
    with ArenaLoader(dataset, batch_size=8, num_workers=2, worker_mode=mode,
                     worker_threads=4) as loader:
        iterator = iter(loader)
        next(iterator)
        with pytest.raises(error) as caught:
            next(iterator)
        text = "".join(traceback.format_exception(caught.value))
        assert "sample 9 is corrupt" in text and "sample 14" not in text
        assert "sample index 9 in thread 1 of worker_threads=4" in text
        assert "in __getitem__" in text
        assert caught.value.indices == list(range(8, 16))
        assert len(list(iterator)) == 2
        del iterator


def test_timeout_names_the_batch_a_thread_is_stuck_on():
    """timeout counts as without threads: a sample stuck in one thread is a
    LoaderTimeoutError naming its batch."""
    from .datasets import SlowDataset

    dataset = SlowDataset(16, {5}, 3.0)
    with ArenaLoader(dataset, batch_size=8, num_workers=1, worker_threads=4,
                     timeout=0.5) as loader:
        start = time.monotonic()
        with pytest.raises(LoaderTimeoutError, match=r"idx=0"):
            next(iter(loader))
        assert time.monotonic() - start < 3.0  # before the slow sample returns
        dataset.release()  # (close() then need not wait for the stuck worker)


def test_worker_killed_in_an_extra_thread_raises_worker_crashed():
    """A worker process killed from one of its extra threads is a WorkerCrashedError with
    its pid and signal, as without threads."""
    with ArenaLoader(SuicidalDataset(32, fatal_index=11), batch_size=8, num_workers=2,
                     worker_threads=4) as loader:
        with pytest.raises(WorkerCrashedError, match="SIGKILL") as caught:
            list(loader)
        assert caught.value.exitcode == -signal.SIGKILL
    assert not live_children()


@pytest.mark.parametrize("mode", MODES)
def test_close_stops_every_thread_and_worker(mode):
    """close() mid-epoch leaves no worker process and no thread of ours."""
    loader = ArenaLoader(ImageDataset(64), batch_size=8, num_workers=2, worker_mode=mode,
                         worker_threads=3, persistent_workers=True)
    iterator = iter(loader)
    try:
        next(iterator)
        if mode == "thread":  # worker 1 may still be starting its threads: wait for them
            wanted = {"arena_loader-worker-0-thread-1", "arena_loader-worker-1-thread-2"}
            assert wait_until(lambda: wanted <= {t.name for t in our_threads()})
    finally:
        loader.close()
    assert not our_threads()
    assert not live_children()
    del iterator


def test_worker_threads_option_is_checked_with_the_fix():
    """worker_threads: an int >= 1; > 1 needs workers, a map-style dataset and batches."""
    with pytest.raises(ValueError, match=r"worker_threads must be >= 1, got 0"):
        ArenaLoader(ImageDataset(4), num_workers=1, worker_threads=0)
    with pytest.raises(TypeError, match=r"worker_threads must be an int, got str '2'"):
        ArenaLoader(ImageDataset(4), num_workers=1, worker_threads="2")
    with pytest.raises(ValueError, match=r"worker_threads must be 1 with num_workers=0, got 2"):
        ArenaLoader(ImageDataset(4), worker_threads=2)
    with pytest.raises(ValueError, match=r"worker_threads must be 1 with batch_size=None"):
        ArenaLoader(ImageDataset(4), num_workers=1, batch_size=None, worker_threads=2)

    class Stream:
        def __iter__(self):
            return iter(range(4))

    with pytest.raises(ValueError, match=r"worker_threads must be 1 for an iterable-style "
                                         r"dataset, got 4"):
        ArenaLoader(Stream(), num_workers=1, worker_threads=4)
    assert ArenaLoader(ImageDataset(4), num_workers=1, worker_threads=2).worker_threads == 2


def test_open_file_attribute_warns_that_threads_share_it(tmp_path):
    """A dataset holding an open file (seek + read race between threads) gets a warning
    naming the attribute; worker_threads=1 gets none."""
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(64))

    class FileDataset(ImageDataset):
        def __init__(self):
            super().__init__(8)
            self.handle = open(path, "rb")
            self.lines = iter([1, 2])

    dataset = FileDataset()
    try:
        with pytest.warns(UserWarning, match=r"dataset.handle is an open file object "
                                             r"\(BufferedReader\), dataset.lines is an "
                                             r"iterator .*worker_threads=4"):
            ArenaLoader(dataset, num_workers=1, worker_threads=4)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ArenaLoader(dataset, num_workers=1)
            ArenaLoader(ImageDataset(4), num_workers=1, worker_threads=4)
    finally:
        dataset.handle.close()
    assert isinstance(dataset.handle, io.BufferedReader)



class Unbound:
    """A proxy of a resource not set up yet (a context-local or lazy proxy): every attribute
    it does not have raises, and not AttributeError."""

    def __getattr__(self, name: str):
        raise RuntimeError(f"proxy not bound: no {name}")


class AnswersEverything(dict):
    """An attribute-access dict that answers every name (addict, a mock): not an iterator."""

    def __getattr__(self, name: str):
        return AnswersEverything()


def test_an_attribute_whose_getattr_raises_or_answers_everything_is_no_iterator():
    """The thread-safety check asks an attribute's type for ``__next__``, as ``next()`` does:
    a proxy whose ``__getattr__`` raises does not stop the loader, and a dict that answers
    every name is not warned about. Before: ``hasattr(value, "__next__")`` ran the proxy's
    ``__getattr__``, and its RuntimeError came out of ArenaLoader(); the dict was "an
    iterator"."""
    import warnings

    for handle in (Unbound(), AnswersEverything(a=1)):
        dataset = ImageDataset(8, shape=(2,))
        dataset.handle = handle
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = host_epoch(dataset, batch_size=4, num_workers=1, worker_threads=2)
        assert len(got) == 2

class Hashing(ImageDataset):
    """Each sample hashes ``nbytes`` (hashlib releases the GIL: C work that fills a core) or,
    with ``wait_s``, sleeps instead; it records its lane, its lane's draw and the OS thread
    that loaded it."""

    def __init__(self, n: int, nbytes: int = 0, wait_s: float = 0.0):
        super().__init__(n, shape=(2,), dtype=np.uint8)
        self.payload, self.wait_s = bytes(nbytes), wait_s

    def __getitem__(self, index: int) -> dict:
        import hashlib

        if self.wait_s:
            time.sleep(self.wait_s)
        else:
            hashlib.sha256(self.payload).digest()
        info = get_worker_info()
        return {"index": index, "lane": np.int64(info.thread_id),
                "draw": np.float64(info.rng.random()),
                "tid": np.int64(threading.get_native_id())}


def _threads_per_batch(batches: list) -> list[int]:
    return [len(set(batch["tid"].tolist())) for batch in batches]


def test_threads_that_queue_for_full_cores_give_way_and_batches_stay_the_same(monkeypatch):
    """C work that fills the cores: each worker runs its lanes on fewer threads (one per
    core it has: one on 2 cores), and the batches, each lane's rows and each lane's draws
    are those of a run that keeps every thread."""
    cores = len(os.sched_getaffinity(0))
    lanes = max(4, cores)  # 2 workers x lanes threads: twice the cores
    dataset = Hashing(20 * 8, nbytes=4 << 20)
    options = dict(batch_size=8, num_workers=2, worker_threads=lanes, generator=3)
    paced = host_epoch(dataset, **options)
    assert max(_threads_per_batch(paced[-4:])) <= max(1, cores // 2)
    monkeypatch.setattr(Pace, "SHRINK_QUEUED", 2.0)  # never: workers fork with it
    kept = host_epoch(dataset, **options)
    assert _threads_per_batch(kept) == [min(8, lanes)] * len(kept)
    for batch, ref in zip(paced, kept, strict=True):
        assert list(batch["lane"]) == [row % lanes for row in range(8)]
        assert_batches_equal({k: v for k, v in batch.items() if k != "tid"},
                             {k: v for k, v in ref.items() if k != "tid"})


def test_threads_whose_samples_wait_keep_every_lane_on_its_own_thread():
    """Samples that sleep (storage that waits): every lane keeps a thread of its own."""
    got = host_epoch(Hashing(6 * 8, wait_s=0.02), batch_size=8, num_workers=2,
                     worker_threads=4)
    assert _threads_per_batch(got) == [4] * 6


def test_lanes_run_on_fewer_threads_with_each_lanes_worker_info():
    """With ``active`` below the lane count, thread j runs lanes j, j + active, ... each with
    that lane's get_worker_info(); every lane runs once per batch."""
    from arena_loader.worker_info import set_process_worker_info, thread_info

    infos = [thread_info(0, 0, 1, 0, None, t, 5) for t in range(5)]
    set_process_worker_info(infos[0])
    threads = SampleThreads(infos, paced=False)
    try:
        for active in (1, 2, 5):
            threads.active = active
            ran: list = []

            def task(lane: int, ran: list = ran) -> None:
                ran.append((lane, get_worker_info().thread_id, threading.get_ident()))

            threads.run(task)
            assert sorted(lane for lane, _, _ in ran) == list(range(5))
            assert all(lane == asked for lane, asked, _ in ran)
            assert len({ident for _, _, ident in ran}) == active
            assert get_worker_info() is infos[0]  # the caller's own info is back
    finally:
        threads.close()
        set_process_worker_info(None)


def test_pace_halves_on_queueing_doubles_on_waiting_and_keeps_otherwise():
    """Pace's rule, on what the threads spent (wall, on a core, queued) in ns."""
    pace = Pace(8)

    def spent(*per_thread):
        pace._spent = list(per_thread) + [(0, 0, 0)] * (8 - len(per_thread))

    spent(*[(100, 30, 70)] * 8)  # mostly queued for a core
    assert pace.next_active(8, 100) == 4
    spent((100, 40, 60))
    assert pace.next_active(1, 100) == 1  # never below one
    spent((100, 5, 1), (100, 5, 1))  # mostly asleep, little queueing, cores idle
    assert pace.next_active(2, 100) == 4
    spent(*[(100, 5, 1)] * 8)
    assert pace.next_active(8, 100) == 8  # never above the lanes
    spent((100, 90, 5), (100, 90, 5))  # on a core: neither
    assert pace.next_active(2, 100) == 2
    spent((100, 30, 15))  # asleep but queued too much to grow
    assert pace.next_active(1, 100) == 1
    spent(*[(100, 25, 5)] * 4)  # asleep, but together a core busy (waiting for the GIL)
    assert pace.next_active(4, 100) == 4
    pace.usable = False
    assert pace.next_active(2, 100) == 8


class IndexedRead(ImageDataset):
    """``__getitems__`` reads its rows by fancy indexing, as a dataset over an array does:
    ``x[np.asarray([])]`` is an ``IndexError`` (a float index array)."""

    def __init__(self, n: int):
        super().__init__(n, shape=(3,), dtype=np.int64)
        self.x = np.stack([super(IndexedRead, self).__getitem__(i) for i in range(n)])

    def __getitems__(self, keys: list) -> list:
        return list(self.x[np.asarray(keys)])


@pytest.mark.parametrize("mode", MODES)
def test_a_lane_without_rows_does_not_call_getitems(mode):
    """More lanes than a batch's rows (K above batch_size, or the last partial batch): each
    __getitems__ call has keys, as with one thread and in torch. Before: the lanes without
    rows called __getitems__([]), and a read by x[np.asarray(keys)] failed the batch."""
    dataset = IndexedRead(10)
    for batch_size, lanes in ((2, 4), (4, 3)):  # 10 = 4 + 4 + 2: the last has 2 rows
        expected = host_epoch(dataset, batch_size=batch_size, num_workers=1, worker_mode=mode)
        got = host_epoch(dataset, batch_size=batch_size, num_workers=1, worker_mode=mode,
                         worker_threads=lanes)
        assert len(got) == len(expected)
        for batch, ref in zip(got, expected):
            assert_batches_equal(batch, ref)


class LazyRows:
    """What ``__getitems__`` returns when rows are decoded on access (a lazy batch view):
    taking row ``bad`` raises."""

    def __init__(self, keys: list, bad: int):
        self.keys, self.bad = keys, bad

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> np.ndarray:
        key = self.keys[i]  # (IndexError past the end: how iteration stops)
        if key == self.bad:
            raise CorruptError(f"row {key} does not decode", key)
        return np.full(3, key, np.int64)


class LazyRead(ImageDataset):
    def __getitems__(self, keys: list) -> LazyRows:
        return LazyRows(keys, bad=13)


@pytest.mark.parametrize("mode", MODES)
def test_a_row_that_fails_as_a_lazy_getitems_result_is_read_fails_its_batch(mode):
    """A row of __getitems__'s result that raises as it is taken (in any lane) is its batch's
    error with its type and sample index, as with one thread; the epoch goes on. Before: the
    error escaped the extra thread and ended it, the batch came out with that lane's rows
    never written (stale slot bytes), and the worker's next batch waited for good."""
    dataset = LazyRead(32)
    with ArenaLoader(dataset, batch_size=8, num_workers=1, worker_mode=mode,
                     worker_threads=2, timeout=20) as loader:
        iterator = iter(loader)
        np.testing.assert_array_equal(np.asarray(next(iterator))[:, 0], range(8))
        with pytest.raises(CorruptError, match="row 13 does not decode") as caught:
            next(iterator)
        assert "sample index 13 in thread 1 of worker_threads=2" in "".join(
            traceback.format_exception(caught.value))
        assert [np.asarray(b)[:, 0].tolist() for b in iterator] == [list(range(16, 24)),
                                                                  list(range(24, 32))]
        del iterator


def test_an_error_that_escapes_a_task_in_another_thread_is_raised_by_run():
    """SampleThreads.run raises what a call raised in another thread, and the thread serves
    the next batch. Before: run() returned as if the batch were whole and the thread had
    ended, so the next run() waited for it for good."""
    from arena_loader.worker_info import thread_info

    infos = [thread_info(0, 0, 1, 0, None, t, 3) for t in range(3)]
    threads = SampleThreads(infos, paced=False)
    try:
        def failing(lane: int) -> None:
            if lane == 2:
                raise CorruptError("lane 2 failed", lane)

        with pytest.raises(CorruptError, match="lane 2 failed"):
            threads.run(failing)
        ran: list = []
        threads.run(ran.append)  # every thread still serves
        assert sorted(ran) == [0, 1, 2]
    finally:
        threads.close()


class ColumnRead(ImageDataset):
    """__getitems__ as one batched read returning columns, for a collate_fn to take as is."""

    def __getitems__(self, keys: list) -> dict:
        return {"x": np.stack([self[k] for k in keys]), "keys": list(keys)}


@pytest.mark.parametrize("mode", MODES)
def test_getitems_result_goes_to_the_collate_fn_as_it_is_with_threads(mode):
    """With a collate_fn, what __getitems__ returns for the whole batch is handed to it
    unchanged, as with one thread and in torch. Before: each lane called __getitems__ with its
    share and a dict of columns was a SampleTypeError saying to pass a collate_fn."""
    dataset = ColumnRead(10, shape=(2,), dtype=np.int16)
    got = host_epoch(dataset, batch_size=4, num_workers=1, worker_mode=mode, worker_threads=3,
                     collate_fn=lambda columns: columns)
    assert [batch["keys"] for batch in got] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    for batch in got:
        np.testing.assert_array_equal(batch["x"], np.stack([dataset[k] for k in batch["keys"]]))
