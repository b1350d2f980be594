"""Thread workers (worker_mode="thread"): named threads of this process, joined by close(),
with the same errors as processes and no effect on the process-wide RNGs."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import random
import sys
import threading
import time

import numpy as np
import pytest

from arena_loader import (
    ArenaLoader,
    ArrayDataset,
    WorkerCrashedError,
    _thread_start,
    get_worker_info,
)

from .conftest import (
    interrupted_in_thread_start,
    live_children,
    our_shm_mappings,
    our_slab_mappings,
    our_threads,
)
from .datasets import ImageDataset, ShardedStream, SlowDataset, reference_epoch

pytestmark = pytest.mark.timeout(60)

_STUCK_MESSAGE = ("thread worker(s) {} still in user code after being asked to stop; left "
                  "running as daemon thread(s) until the dataset returns (a thread cannot be "
                  "killed)")


class ExitingDataset(ImageDataset):
    """Raises SystemExit (a BaseException, which ends a thread) for one index."""

    def __init__(self, n: int, fatal_index: int):
        super().__init__(n)
        self.fatal_index = fatal_index

    def __getitem__(self, index: int) -> np.ndarray:
        if index == self.fatal_index:
            sys.exit(3)
        return super().__getitem__(index)


class ThreadRecordingDataset(ImageDataset):
    """Records the name of the thread that loads each sample and its worker info."""

    def __init__(self, n: int):
        super().__init__(n, shape=(2,), dtype=np.int64)
        self.seen: list[tuple[str, int | None]] = []

    def __getitem__(self, index: int) -> np.ndarray:
        info = get_worker_info()
        self.seen.append((threading.current_thread().name, None if info is None else info.id))
        return super().__getitem__(index)


def test_thread_workers_are_named_threads_joined_by_close():
    """Workers are threads arena_loader-worker-<id> of this process; close() joins them all."""
    dataset = ThreadRecordingDataset(24)
    loader = ArenaLoader(dataset, batch_size=2, num_workers=3, worker_mode="thread",
                         persistent_workers=True)
    iterator = iter(loader)
    next(iterator)
    names = {t.name for t in our_threads()}
    assert {"arena_loader-worker-0", "arena_loader-worker-1", "arena_loader-worker-2"} <= names
    assert iterator.worker_pids == [os.getpid()] * 3
    assert not live_children()
    rest = list(iterator)
    assert len(rest) == 11
    loader.close()
    assert not our_threads()
    # Every sample came from a worker thread, which get_worker_info() named correctly.
    loaders = {name: worker for name, worker in dataset.seen}
    assert loaders == {f"arena_loader-worker-{i}": i for i in range(3)}
    del rest


def test_ctrl_c_as_a_thread_worker_is_made_leaves_no_thread_half_started(monkeypatch):
    """A Ctrl-C inside ``Thread.start()`` of a thread worker at iter(), once threading has
    entered it in its table of threads being started and before the OS thread is made: that
    thread stayed in the table for good (in ``threading.enumerate()``), holding its order ring
    (mapped until exit). It is now run, called off (it ends at once); the next iter() is
    whole."""
    monkeypatch.setattr(_thread_start, "BEGIN_WAIT_S", 0.1)  # (it never began)
    dataset = ImageDataset(8, shape=(2,), dtype=np.int64)
    loader = ArenaLoader(dataset, batch_size=2, num_workers=2, worker_mode="thread")
    with interrupted_in_thread_start("arena_loader-worker-1") as fired, \
            pytest.raises(KeyboardInterrupt):
        iter(loader)
    assert fired
    assert [batch.tolist() for batch in loader] == [
        [dataset[i].tolist() for i in range(b, b + 2)] for b in range(0, 8, 2)]
    loader.close()
    gc.collect()
    assert not our_threads()
    assert not our_shm_mappings()


def test_thread_workers_leave_the_process_rngs_alone():
    """Thread workers seed nothing global: random and numpy streams continue undisturbed."""
    random.seed(11)
    np.random.seed(11)
    expected = (random.random(), np.random.random())
    random.seed(11)
    np.random.seed(11)
    with ArenaLoader(ImageDataset(20), batch_size=2, num_workers=2, worker_mode="thread",
                     worker_init_fn=lambda worker_id: None) as loader:
        assert len(list(loader)) == 10
    assert (random.random(), np.random.random()) == expected


def test_thread_that_ends_raises_worker_crashed_and_shuts_down():
    """A BaseException ending a worker thread is a WorkerCrashedError naming the thread and
    its batch; batches before it come first; the other threads are joined."""
    dataset = ExitingDataset(20, fatal_index=9)
    expected = reference_epoch(ImageDataset(20), 2, False)
    with ArenaLoader(dataset, batch_size=2, num_workers=2, worker_mode="thread") as loader:
        iterator = iter(loader)
        received = []
        with pytest.raises(WorkerCrashedError, match=r"worker thread 0 \(pid \d+\) ended by "
                                                     r"SystemExit\(3\) while loading batch "
                                                     r"idx=4 \(indices \[8, 9\]\)"):
            for batch in iterator:
                received.append(np.array(batch))
        assert len(received) <= 4  # those received before the crash, in order
        for got, ref in zip(received, expected):
            np.testing.assert_array_equal(got, ref)
        with pytest.raises(WorkerCrashedError):
            next(iterator)
        assert not [t for t in our_threads() if t.name.startswith("arena_loader-worker")]
        # A new epoch starts fresh threads and loads what it can until the same sample.
        assert np.array_equal(next(iter(loader)), expected[0])
        del iterator


def test_close_gives_up_on_a_thread_stuck_in_user_code_within_bounds(monkeypatch, caplog):
    """A thread cannot be killed: close() waits a bounded time, names it, and returns;
    the thread exits by itself once the dataset returns, touching nothing else."""
    monkeypatch.setattr("arena_loader._threads.JOIN_TIMEOUT_S", 0.2)
    dataset = SlowDataset(8, {2}, 2.0)
    loader = ArenaLoader(dataset, batch_size=2, num_workers=1, worker_mode="thread")
    iterator = iter(loader)
    next(iterator)
    time.sleep(0.2)  # the thread is now inside the slow sample
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="arena_loader"):
        loader.close()
    assert time.monotonic() - start < 1.5
    assert [record.getMessage() for record in caplog.records if "still in user code" in
            record.getMessage()] == [_STUCK_MESSAGE.format("arena_loader-worker-0")]
    dataset.release()  # the sample returns: the thread exits by itself (conftest checks)
    del iterator


def test_slot_a_stuck_thread_may_write_is_never_reused(monkeypatch):
    """The slot a stuck thread is still loading stays out of use, so when the thread finally
    writes it, no batch of a later epoch is overwritten."""
    monkeypatch.setattr("arena_loader._threads.JOIN_TIMEOUT_S", 0.2)
    dataset = SlowDataset(12, (), 1.0, shape=(2,), dtype=np.int64)
    expected = reference_epoch(ImageDataset(12, shape=(2,), dtype=np.int64), 2, False)
    with ArenaLoader(dataset, batch_size=2, num_workers=1, worker_mode="thread",
                     slots=8) as loader:
        assert sum(1 for _ in loader) == 6  # sizes the slab: later batches go to slots
        dataset.slow_indices = frozenset({2})
        iterator = iter(loader)
        next(iterator)
        time.sleep(0.2)  # the thread is now inside the slow sample of batch idx=1
        iterator.close()
        (stuck,) = our_threads()  # the new epoch's worker has the same name: keep this one
        assert stuck.name == "arena_loader-worker-0" and stuck.is_alive()
        assert loader.snapshot().assigned_slots == 1
        held = list(loader)  # a new epoch, while the stuck thread finishes and writes
        stuck.join(timeout=5)
        assert not stuck.is_alive()
        assert len(held) == len(expected)
        for i, (batch, ref) in enumerate(zip(held, expected)):
            np.testing.assert_array_equal(batch, ref, err_msg=f"batch {i}")
        del held, iterator


def test_gil_free_gather_in_threads_matches_the_arrays():
    """Many thread workers gathering from one ArrayDataset give exact, complete epochs."""
    x = np.arange(5000 * 16, dtype=np.float32).reshape(5000, 16)
    y = np.arange(5000)
    with ArenaLoader(ArrayDataset(x, y), batch_size=256, shuffle=True, num_workers=4,
                     worker_mode="thread", persistent_workers=True) as loader:
        for _ in range(2):
            seen = []
            for batch_x, batch_y in loader:
                np.testing.assert_array_equal(batch_x, x[batch_y])
                seen.append(np.array(batch_y))
            assert np.array_equal(np.sort(np.concatenate(seen)), y)


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(worker_mode="threads"), r"worker_mode must be one of \('process', 'thread'\), got "
                                  r"'threads'"),
    (dict(worker_mode="thread", num_workers=2, multiprocessing_context="spawn"),
     r"multiprocessing_context must be None with worker_mode='thread', got 'spawn'"),
])
def test_bad_worker_mode_options_are_rejected(kwargs, pattern):
    """worker_mode is validated at construction with the rule and the fix."""
    with pytest.raises(ValueError, match=pattern):
        ArenaLoader(ImageDataset(4), **kwargs)


def test_iterable_datasets_need_process_workers():
    """Iterable-style datasets shard by torch's process-wide worker info: threads refused."""
    with pytest.raises(ValueError, match=r"worker_mode must be 'process' for an iterable-style "
                                         r"dataset, got 'thread'"):
        ArenaLoader(ShardedStream(8), batch_size=2, num_workers=2, worker_mode="thread")


@pytest.mark.timeout(30)
def test_crash_with_a_forked_child_alive_still_ends_every_other_thread(caplog):
    """A child forked while thread workers run (a fork Pool of the user's, another loader's
    workers) inherits their pipes: it must not keep an idle thread from reading EOF when a
    crash closes them (it was left running, "stuck in user code", with the slab, for as long
    as the child lived, and next() waited out a whole join timeout first)."""
    loader = ArenaLoader(ExitingDataset(20, fatal_index=9), batch_size=2, num_workers=2,
                         worker_mode="thread")
    iterator = iter(loader)
    next(iterator)
    with _forked_child():
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="arena_loader"), \
                pytest.raises(WorkerCrashedError, match="worker thread 0"):
            for _ in iterator:
                pass
        assert time.monotonic() - start < 1.5
        assert not [t for t in our_threads() if t.name.startswith("arena_loader-worker")]
        assert "still in user code" not in caplog.text
    del iterator, loader


@contextlib.contextmanager
def _forked_child():
    """A child forked now that holds what it inherited until the block ends (then it leaves
    without running pytest's exit); yields its pid."""
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.read(go_r, 1)
        finally:
            os._exit(0)
    try:
        yield pid
    finally:
        os.write(go_w, b"\0")
        os.waitpid(pid, 0)
        for fd in (go_r, go_w):
            os.close(fd)


class ExitingWhileHandlingDataset(ImageDataset):
    """Ends a thread with SystemExit raised while handling another error (``except ...:
    sys.exit(1)``): the SystemExit's context has a traceback through the worker's frames."""

    def __getitem__(self, index: int) -> np.ndarray:
        if index == 5:
            try:
                raise KeyError(index)
            except KeyError:
                sys.exit(3)
        return super().__getitem__(index)


def test_a_kept_crash_error_keeps_no_slab_of_a_closed_loader():
    """A WorkerCrashedError the user keeps (a log, pytest.raises, sys.last_value) holds
    nothing of the closed loader: the ending exception's context kept the thread's frames,
    with their slot views, so the slab stayed mapped for as long as the error lived."""
    loader = ArenaLoader(ExitingWhileHandlingDataset(12, shape=(4,)), batch_size=2,
                         num_workers=1, worker_mode="thread")
    iterator = iter(loader)
    with pytest.raises(WorkerCrashedError) as kept:
        for batch in iterator:
            del batch
    assert isinstance(kept.value.__cause__.__context__, KeyError)  # still told
    loader.close()
    del iterator, loader
    gc.collect()
    assert not our_slab_mappings()


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(int(target[len("socket:["):-1]))
    return inodes


@pytest.mark.timeout(30)
@pytest.mark.filterwarnings("ignore:your code holds")
@pytest.mark.parametrize(("worker_mode", "fatal_index"),
                         [("thread", None), ("thread", 9), ("process", None)])
def test_a_forked_child_holds_no_descriptor_socket_of_the_workers(worker_mode, fatal_index):
    """A child forked while workers send one-off segments (here the consumer holds every
    slot) inherited the main process's end of each worker's descriptor socket (a thread
    worker's end too): the descriptors sent and not yet received (batches loaded ahead,
    records unread) stayed queued there, so their shared memory outlived close() for as long
    as the child lived (a fork Pool: until it ends). A thread's crash still raises at once."""
    before = _socket_inodes(os.getpid())
    loader = ArenaLoader(ExitingDataset(40, fatal_index=fatal_index if fatal_index else -1),
                         batch_size=2, num_workers=1, worker_mode=worker_mode, slots=2)
    iterator = iter(loader)
    held = [next(iterator) for _ in range(3)]  # every slot held: the next batches go to segments
    time.sleep(0.2)  # the worker loads the window ahead; its segments wait on the socket
    ours = _socket_inodes(os.getpid()) - before  # the workers' descriptor sockets
    assert ours
    with _forked_child() as pid:
        if fatal_index is not None:
            start = time.monotonic()
            with pytest.raises(WorkerCrashedError, match="worker thread 0"):
                for _ in iterator:
                    pass
            assert time.monotonic() - start < 1.5
        start = time.monotonic()
        del held
        iterator.close()
        closing_s = time.monotonic() - start
        held_by_child = ours & _socket_inodes(pid)
    del iterator, loader
    assert closing_s < 1.0
    assert not held_by_child, "the forked child holds the main process's end of the sockets"


@pytest.mark.timeout(60)
def test_a_thread_that_ends_is_seen_while_a_child_forked_as_it_started_holds_its_pipes(
        monkeypatch):
    """A child that another thread forked while a thread worker started, before its pipes
    were registered with _forksafe (a fork Pool starting then), holds the thread's result
    pipe open: when the thread ended, its EOF never came, and next() waited for as long as
    the child lived (here until `timeout`: LoaderTimeoutError). Its end is now read from the
    thread itself: WorkerCrashedError."""
    from arena_loader import _threads

    real, forked, children = _threads.register_descriptor, contextlib.ExitStack(), []

    def fork_in_another_thread_first(owner, fd):
        if not children:
            thread = threading.Thread(
                target=lambda: children.append(forked.enter_context(_forked_child())))
            thread.start()
            thread.join()
        real(owner, fd)

    monkeypatch.setattr(_threads, "register_descriptor", fork_in_another_thread_first)
    loader = ArenaLoader(ExitingDataset(8, fatal_index=0), batch_size=2, num_workers=1,
                         worker_mode="thread", timeout=20)
    with forked, pytest.raises(WorkerCrashedError, match="worker thread 0"):
        next(iter(loader))
    loader.close()
