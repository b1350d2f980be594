"""pin_memory=True with workers: the arena_loader-pin thread copies each batch's tensors into
page-locked memory ahead of next(), as torch's pin thread does (``Tensor.pin_memory`` is a
copy here: torch's CPU build has none). Its Ctrl-C cases are in test_faults' matrix."""

from __future__ import annotations

import gc
import linecache
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

from arena_loader import (
    ArenaLoader,
    LoaderClosedError,
    LoaderTimeoutError,
    WorkerCrashedError,
    _thread_start,
)
from tests import resume_driver

from .conftest import (
    interrupted_in_thread_start,
    live_children,
    our_slab_mappings,
    our_threads,
    run_in_threads,
    wait_until,
)
from .datasets import (
    CountedBatches,
    RaisingDataset,
    Release,
    SuicidalDataset,
    assert_batches_equal,
    draws_per_next,
)
from .test_device import TensorPairs
from .test_faults import _InterruptAt

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pinning_threads(monkeypatch, fake_pinning):
    """``fake_pinning`` that also records the thread each batch's first tensor is pinned in."""
    import torch

    threads: list[str] = []
    pin_memory = torch.Tensor.pin_memory

    def recording(tensor, device=None):
        threads.append(threading.current_thread().name)
        return pin_memory(tensor)

    monkeypatch.setattr(torch.Tensor, "pin_memory", recording)
    return threads


@pytest.mark.parametrize("num_workers, pinned_in", [(0, "MainThread"), (2, "arena_loader-pin")])
def test_batches_are_pinned_ahead_of_next_in_the_pin_thread(pinning_threads, num_workers,
                                                            pinned_in):
    """With workers, batches are pinned in the pin thread, ahead of the next() that returns
    them (so the copy runs during the training step); without, next() pins, as torch's
    single-process iterator does. Values, order and structure do not change."""
    import torch

    with ArenaLoader(TensorPairs(24), batch_size=4, num_workers=num_workers,
                     pin_memory=True) as loader:
        iterator = iter(loader)
        first = next(iterator)
        if num_workers:  # the next batches are pinned while the consumer is elsewhere
            assert wait_until(lambda: len(pinning_threads) >= 2 * 3)
        else:
            time.sleep(0.1)
            assert len(pinning_threads) == 2
        rest = list(iterator)
    assert set(pinning_threads) == {pinned_in}
    assert len(pinning_threads) == 2 * 6
    for i, (images, labels) in enumerate([first, *rest]):
        torch.testing.assert_close(images[:, 0, 0], torch.arange(4 * i, 4 * i + 4.0))
        assert labels.tolist() == list(range(4 * i, 4 * i + 4))


def test_an_iterator_through_the_pin_thread_has_the_loaders_length(fake_pinning):
    """len(iter(loader)) with the pin thread between is the loader's, as torch's iterator's
    (its index sampler's)."""
    with ArenaLoader(TensorPairs(10), batch_size=4, num_workers=2, pin_memory=True) as loader:
        iterator = iter(loader)
        assert len(iterator) == len(loader) == 3
        assert len(list(iterator)) == 3


@pytest.mark.parametrize("name", ["workers", "iterable_stateful"])
def test_state_dict_counts_batches_received_not_those_pinned_ahead(fake_pinning, name):
    """The pin thread takes batches ahead of the consumer; state_dict() still says where the
    consumer is: resumed from it, the run is the uninterrupted run (for iterable-style
    datasets, each worker's state as of the last batch received from it)."""
    import torch

    torch.manual_seed(7)
    whole = resume_driver.run_whole(name)  # (no pinning)
    torch.manual_seed(7)
    with resume_driver.make_loader(name, pin_memory=True, output="torch") as loader:
        iterator = iter(loader)
        head = [resume_driver.rows(next(iterator)) for _ in range(3)]
        # Pinned ahead: two batches queued and one in the thread's hands.
        assert wait_until(lambda: len(fake_pinning) >= 3 + 3)
        state = loader.state_dict()
        del iterator
    assert (state["batches_yielded"], state["next_idx"]) == (3, 3)
    torch.manual_seed(8)  # nothing may depend on this process's RNG
    with resume_driver.make_loader(name, pin_memory=True, output="torch") as loader:
        loader.load_state_dict(state)
        tail = [resume_driver.rows(b) for epoch in range(state["epoch"], resume_driver.EPOCHS)
                for b in loader]
    assert head + tail == whole


@pytest.mark.parametrize("prefetch_factor", [1, 2])
def test_the_pin_thread_draws_from_the_sampler_no_further_ahead_than_torch(fake_pinning,
                                                                         prefetch_factor):
    """Batches the pin thread took ahead of next() count against the read-ahead, as torch's
    do (its main thread sends the next indices as it receives each batch): after iter() and
    after each next(), the sampler has given exactly as many batches as to torch's
    DataLoader, however far the pin thread has run."""
    import torch.utils.data

    options = dict(num_workers=2, prefetch_factor=prefetch_factor)
    sampler = CountedBatches(12, 2)
    expected = draws_per_next(torch.utils.data.DataLoader(
        TensorPairs(24), batch_sampler=sampler, **options), sampler, settle_s=0.02)
    assert expected == [min(2 * prefetch_factor + k, 12) for k in range(13)]  # torch's rule
    with ArenaLoader(TensorPairs(24), batch_sampler=sampler, pin_memory=True,
                     **options) as loader:
        assert draws_per_next(loader, sampler, settle_s=0.02) == expected
        assert len(fake_pinning) == 2 * 12


class OneDrawAtATime(CountedBatches):
    """Batches that take a while to draw, noting the most draws under way at once."""

    def __init__(self, batches: int, size: int):
        super().__init__(batches, size)
        self.inside = self.most_inside = 0

    def __iter__(self):
        for batch in super().__iter__():
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
            time.sleep(0.005)
            self.inside -= 1
            yield batch


def test_the_sampler_runs_in_one_thread_at_a_time_with_the_pin_thread(fake_pinning):
    """next() refills the window as it receives each batch while the pin thread may top it
    up too: the two never draw at once (a draw in each would lose or repeat a batch)."""
    sampler = OneDrawAtATime(40, 2)
    with ArenaLoader(TensorPairs(80), batch_sampler=sampler, num_workers=2,
                     pin_memory=True) as loader:
        labels = [batch[1].tolist() for batch in loader]
    assert labels == [[i, i + 1] for i in range(0, 80, 2)]
    assert sampler.most_inside == 1


class FailsToPin:
    """A collate_fn's batch type whose pin_memory() raises for batch 2."""

    def __init__(self, samples):
        import torch

        self.labels = torch.stack([label for _, label in samples])

    def pin_memory(self):
        if int(self.labels[0]) == 8:
            raise ValueError("batch 2 cannot be pinned")
        self.labels = self.labels.pin_memory()
        return self


def test_an_error_while_pinning_is_that_batchs_and_the_epoch_goes_on(fake_pinning):
    """As in torch's pin thread: the error pinning raised is raised by that batch's next(),
    with its type; the following batches come, in order."""
    with ArenaLoader(TensorPairs(24), batch_size=4, num_workers=2, pin_memory=True,
                     collate_fn=FailsToPin) as loader:
        iterator, got = iter(loader), []
        for _ in range(2):
            got.append(next(iterator).labels.tolist())
        with pytest.raises(ValueError, match="batch 2 cannot be pinned"):
            next(iterator)
        got += [batch.labels.tolist() for batch in iterator]
    assert got == [list(range(i, i + 4)) for i in (0, 4, 12, 16, 20)]


class SlowAt(TensorPairs):
    """``TensorPairs`` whose sample ``slow`` takes ``seconds``."""

    def __init__(self, n: int, slow: int, seconds: float):
        super().__init__(n)
        self.slow, self.seconds = slow, seconds
        self.released = Release()  # (release() ends the wait at once)

    def __getitem__(self, index):
        if index == self.slow:
            self.wait()
        return super().__getitem__(index)

    def wait(self) -> None:
        self.released.sleep(self.seconds)

    def release(self) -> None:
        self.released.set()


def test_timeout_and_a_dead_worker_are_raised_by_next_through_the_pin_thread(fake_pinning):
    """The host iterator's errors reach next() as without the pin thread: a timeout is a
    LoaderTimeoutError naming the batch; a killed worker a WorkerCrashedError, raised again
    by every later next(); after close(), next() is a LoaderClosedError."""
    import torch

    slow = SlowAt(16, 9, 3)
    with ArenaLoader(slow, batch_size=4, num_workers=2, pin_memory=True,
                     timeout=0.5) as loader:
        iterator = iter(loader)
        assert next(iterator)[1].tolist() == [0, 1, 2, 3]
        assert next(iterator)[1].tolist() == [4, 5, 6, 7]
        with pytest.raises(LoaderTimeoutError, match="idx=2"):
            next(iterator)
        slow.release()  # (close() then need not wait for the stuck worker)

    dataset = SuicidalDataset(32, fatal_index=10)
    with ArenaLoader(dataset, batch_size=2, num_workers=2, pin_memory=True,
                     output="torch") as loader:
        iterator = iter(loader)
        received = []
        with pytest.raises(WorkerCrashedError):
            for batch in iterator:
                assert isinstance(batch, torch.Tensor)
                received.append(batch)
        assert len(received) == 5  # every batch before the worker's death
        with pytest.raises(WorkerCrashedError):
            next(iterator)
        loader.close()
        with pytest.raises((WorkerCrashedError, LoaderClosedError)):
            next(iterator)


def test_an_iterator_used_in_a_forked_child_is_a_loader_forked_error(fake_pinning):
    """An iterator made in this process and used in a forked child (whose pin thread did not
    survive the fork) raises LoaderForkedError there, at once; here it goes on."""
    from arena_loader.errors import LoaderForkedError

    from .test_fork import run_in_child

    with ArenaLoader(TensorPairs(16), batch_size=4, num_workers=2, pin_memory=True) as loader:
        iterator = iter(loader)
        assert next(iterator)[1].tolist() == [0, 1, 2, 3]

        def in_child():
            began = time.monotonic()
            try:
                next(iterator)
            except LoaderForkedError as exc:
                return f"{time.monotonic() - began < 0.2} {exc}"
            return "no error"

        message = run_in_child("os.fork", in_child)
        assert message.startswith("True ") and "forked from it" in message, message
        assert [labels.tolist()[0] for _, labels in iterator] == [4, 8, 12]



def test_a_pin_thread_stuck_in_a_slow_batch_leaves_the_next_persistent_epoch_whole(
        fake_pinning, monkeypatch):
    """With persistent workers, iter() stops the pin thread still reading the last epoch; one
    that outlasts its join (a batch slower than SHARED_JOIN_S, shortened here) gets the
    persistent iterator closed, and iter() then starts new workers instead of raising
    LoaderClosedError."""
    from arena_loader import _stage

    class SlowSecondBatch(TensorPairs):
        def __getitem__(self, index):
            if index == 4:
                time.sleep(1.0)
            return super().__getitem__(index)

    monkeypatch.setattr(_stage, "SHARED_JOIN_S", 0.2)
    with ArenaLoader(SlowSecondBatch(16), batch_size=4, num_workers=2, pin_memory=True,
                     persistent_workers=True) as loader:
        abandoned = iter(loader)
        next(abandoned)  # the pin thread now waits for batch 1 (slow)
        labels = [batch[1].tolist() for batch in loader]
    assert labels == [list(range(i, i + 4)) for i in range(0, 16, 4)]


@pytest.mark.timeout(60)
def test_two_threads_first_next_on_a_pinned_iterator_start_one_pin_thread(fake_pinning,
                                                                          monkeypatch):
    """Two threads calling next() on a new pin_memory iterator at once (the first batch slow
    to come, as the workers start): each took a first batch from the workers and started a
    pin thread with it, and when the second took its batch before the first thread had taken
    its own, that one was never handed out (2 runs in 10 of a demo lost a batch). The stage
    starts once: one pin thread, every sample exactly once."""
    import torch

    from .datasets import SlowDataset

    pinned_by: set[int] = set()
    pin_memory = torch.Tensor.pin_memory

    def recording(tensor, device=None):
        pinned_by.add(threading.get_ident())
        return pin_memory(tensor)

    monkeypatch.setattr(torch.Tensor, "pin_memory", recording)
    loader = ArenaLoader(SlowDataset(16, {0}, 0.5, shape=(2,), dtype="int64"), batch_size=2,
                         num_workers=2, pin_memory=True, output="torch")
    iterator = iter(loader)
    together = threading.Barrier(2)
    got: list[list] = [[], []]

    def consume(k):
        together.wait()
        for batch in iterator:
            got[k].append(batch.tolist())

    run_in_threads(consume)
    assert len(pinned_by) == 1
    rows = sorted(tuple(row) for batches in got for batch in batches for row in batch)
    expected = SlowDataset(16, (), 0.0, shape=(2,), dtype="int64")
    assert rows == sorted(tuple(expected[i].tolist()) for i in range(16))
    loader.close()


def test_an_epoch_whose_persistent_workers_load_state_dict_let_go_goes_on_after_iter(
        fake_pinning):
    """load_state_dict() lets go of the persistent workers' iterator: an epoch still being
    iterated goes on to its end on them, as torch's does after ``_iterator = None``, even
    once iter() has begun the loaded state's epoch on new workers. With the pin thread,
    iter() stopped the staged iterator reading the old workers (as it stops one reading the
    workers it is about to reuse): LoaderClosedError at the old epoch's next next()."""
    with ArenaLoader(TensorPairs(32), batch_size=4, num_workers=2, pin_memory=True,
                     persistent_workers=True) as loader:
        state = loader.state_dict()
        old = iter(loader)
        labels = [next(old)[1].tolist() for _ in range(3)]
        loader.load_state_dict(state)
        new = iter(loader)
        labels += [batch[1].tolist() for batch in old]
        assert labels == [list(range(i, i + 4)) for i in range(0, 32, 4)]
        assert [batch[1].tolist() for batch in new] == labels  # the loaded state's epoch
        del old, new


@pytest.mark.parametrize("then", ["next", "close"])
def test_ctrl_c_as_the_pin_thread_is_started_leaves_the_iterator_whole(fake_pinning,
                                                                     monkeypatch, then):
    """A Ctrl-C inside ``Thread.start()`` of the pin thread, before the thread began (its
    Python lines run before the OS thread is made), at the first next(). The next next()
    starts it and the epoch is whole; close() instead closes. Before: the stage kept the
    thread object as started, so every next() raised RuntimeError ('the arena_loader-pin
    thread stopped unexpectedly') and close() raised RuntimeError ('cannot join thread before
    it is started')."""
    real_start = threading.Thread.start
    interrupted: list[str] = []

    def interrupted_once(thread):
        if thread.name == "arena_loader-pin" and not interrupted:
            interrupted.append(thread.name)
            raise KeyboardInterrupt
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", interrupted_once)
    with ArenaLoader(TensorPairs(16), batch_size=4, num_workers=2, pin_memory=True) as loader:
        iterator = iter(loader)
        with pytest.raises(KeyboardInterrupt):
            next(iterator)
        assert interrupted
        if then == "close":
            iterator.close()
            with pytest.raises(LoaderClosedError):
                next(iterator)
        else:
            labels = [batch[1].tolist() for batch in iterator]
            assert labels == [list(range(i, i + 4)) for i in range(0, 16, 4)]
        del iterator


@pytest.mark.parametrize("worker_mode", ["process", "thread"])
def test_an_error_at_the_first_batch_leaves_the_pin_threads_read_ahead_open(fake_pinning,
                                                                            worker_mode):
    """The first next() takes the first batch itself (the pin thread starts after it): when
    that batch raises, the consumer has received it, so it no longer counts against the
    read-ahead. With a window of one batch the epoch went no further: the next next() waited
    for ever on a batch never sent (found by benchmarks/chaos.py)."""
    dataset = RaisingDataset(24, bad={2})
    with ArenaLoader(dataset, batch_size=2, sampler=[2, 5, 8, 11, 14, 17], num_workers=1,
                     prefetch_factor=1, pin_memory=True, output="torch",
                     worker_mode=worker_mode) as loader:
        iterator = iter(loader)
        with pytest.raises(ValueError, match="sample 2 is corrupt"):
            next(iterator)
        rest = [batch.numpy().copy() for batch in iterator]
    assert len(rest) == 2
    for batch, indices in zip(rest, ([8, 11], [14, 17])):
        assert_batches_equal(batch, np.stack([dataset[i] for i in indices]))


@pytest.mark.parametrize("then", ["next", "close"])
def test_ctrl_c_as_the_pin_thread_is_made_leaves_no_thread_half_started(fake_pinning, monkeypatch,
                                                                       then):
    """A Ctrl-C inside ``Thread.start()`` of the pin thread once threading has entered it in
    its table of threads being started and before the OS thread is made: that thread stayed
    in the table for good (in ``threading.enumerate()``), holding the stage and its first
    batch, so the slab stayed mapped after close() until exit. It is now run, called off (it
    ends at once); the next next() starts another and the epoch is whole."""
    monkeypatch.setattr(_thread_start, "BEGIN_WAIT_S", 0.1)  # (it never began)
    loader = ArenaLoader(TensorPairs(16), batch_size=4, num_workers=2, pin_memory=True)
    iterator = iter(loader)
    with interrupted_in_thread_start("arena_loader-pin") as fired, \
            pytest.raises(KeyboardInterrupt):
        next(iterator)
    assert fired
    if then == "next":
        labels = [batch[1].tolist() for batch in iterator]
        assert labels == [list(range(i, i + 4)) for i in range(0, 16, 4)]
    iterator.close()
    loader.close()
    del iterator
    gc.collect()
    assert wait_until(lambda: not our_threads(), timeout_s=2), our_threads()
    assert not our_slab_mappings()


def test_an_unused_iterator_dropped_after_a_later_iter_leaves_the_persistent_workers_on(
        fake_pinning):
    """Persistent workers and a pin thread: an iterator dropped unused after a later iter()
    (no batch handed out; a sequential sampler, so the later iter() drew nothing) gave its
    draws back and closed the persistent workers it had started, which the later iterator
    reads: its first next() raised LoaderClosedError. A later iter() keeps the draws."""
    with ArenaLoader(TensorPairs(16), batch_size=4, num_workers=2, pin_memory=True,
                     persistent_workers=True) as loader:
        unused = iter(loader)
        later = iter(loader)
        del unused
        gc.collect()
        labels = [batch[1].tolist() for batch in later]
        del later
    assert labels == [list(range(i, i + 4)) for i in range(0, 16, 4)]


def test_two_threads_iterating_a_pinned_loader_with_persistent_workers_at_once(fake_pinning):
    """Two threads each run ``for batch in loader`` at once, with persistent workers and a
    pin thread: as when one thread calls iter() twice, the later iter() stops the earlier
    iterator's stage (its next next() raises LoaderClosedError) and its own epoch is whole.
    Before, both iter() calls could stop the stage before either made its own: both stages
    read the one persistent epoch, a batch was handed out twice, and an epoch ended early
    without an error (11 runs in 12 of a demo)."""
    epoch = [list(range(i, i + 2)) for i in range(0, 8, 2)]
    with ArenaLoader(TensorPairs(8), batch_size=2, num_workers=2, pin_memory=True,
                     persistent_workers=True) as loader:
        assert [batch[1].tolist() for batch in loader] == epoch  # the workers are up
        for _ in range(4):
            together, got = threading.Barrier(2), [[], []]

            def run(k, got=got, together=together):
                together.wait()
                try:
                    for batch in loader:
                        got[k].append(batch[1].tolist())
                except LoaderClosedError:
                    got[k].append("closed")

            run_in_threads(run)
            for labels in got:  # the whole epoch, or its start cut short by the other iter()
                assert labels == epoch or (
                    labels[-1] == "closed" and labels[:-1] == epoch[:len(labels) - 1]), got
            assert epoch in got, got


def test_a_training_step_longer_than_timeout_is_no_timeout_through_the_pin_thread(
        fake_pinning):
    """The pin thread waits for the next host batch while the consumer's step runs; with a
    window of one batch nothing is sent until the consumer receives the batch the thread
    took, so that wait is for the consumer, not for a worker. torch's pin thread waits with
    no timeout (its next() times only its own wait): a step longer than ``timeout`` raised
    LoaderTimeoutError naming no batch."""
    with ArenaLoader(TensorPairs(8), batch_size=2, num_workers=1, prefetch_factor=1,
                     pin_memory=True, timeout=0.2) as loader:
        iterator = iter(loader)
        got = [next(iterator)[1].tolist()]
        time.sleep(0.5)  # the training step
        got += [batch[1].tolist() for batch in iterator]
    assert got == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_a_slow_batch_there_before_next_asks_is_no_timeout_through_the_pin_thread(
        fake_pinning):
    """A batch that takes longer than ``timeout`` but is there before the consumer asks for
    it (it came during the training step): torch's next() times only its own wait, and so
    does ours without the pin thread. The pin thread's wait for it was timed from when the
    thread began waiting (during the step), so next() raised LoaderTimeoutError."""
    with ArenaLoader(SlowAt(8, 4, 0.3), batch_size=2, num_workers=1, pin_memory=True,
                     timeout=0.15) as loader:
        iterator = iter(loader)
        got = [next(iterator)[1].tolist()]
        time.sleep(0.6)  # the training step: batch 2 comes during it
        got += [batch[1].tolist() for batch in iterator]
    assert got == [[0, 1], [2, 3], [4, 5], [6, 7]]


class WaitsForFile(SlowAt):
    """``TensorPairs`` whose sample ``slow`` waits until the file ``gate`` exists."""

    def __init__(self, n: int, slow: int, gate: str):
        super().__init__(n, slow, 0)
        self.gate = gate

    def wait(self) -> None:
        deadline = time.monotonic() + 20
        while not os.path.exists(self.gate) and time.monotonic() < deadline:
            time.sleep(0.01)


def test_a_next_cut_short_by_ctrl_c_times_no_wait_after_it_through_the_pin_thread(
        fake_pinning, tmp_path):
    """Ctrl-C in a next() waiting for a slow batch; the user is away for longer than
    ``timeout`` (saving a checkpoint), then asks again and the batch comes at once. torch's
    next() times only its own wait, so it hands the batch over; the pin thread went on
    timing its wait from the interrupted next() and raised LoaderTimeoutError."""
    gate = str(tmp_path / "go")
    with ArenaLoader(WaitsForFile(8, 2, gate), batch_size=2, num_workers=1, pin_memory=True,
                     timeout=0.3) as loader:
        iterator = iter(loader)
        got = [next(iterator)[1].tolist()]
        interrupt = threading.Timer(0.1, signal.pthread_kill,
                                    (threading.main_thread().ident, signal.SIGINT))
        interrupt.start()
        with pytest.raises(KeyboardInterrupt):
            next(iterator)
        time.sleep(0.6)  # away, longer than timeout; nobody waits for the batch meanwhile
        open(gate, "w").close()
        got += [batch[1].tolist() for batch in iterator]
    assert got == [[0, 1], [2, 3], [4, 5], [6, 7]]


class _InterruptAfterError(_InterruptAt):
    """KeyboardInterrupt at the k-th line of arena_loader code that the main thread runs
    once a ``ValueError`` (the batch's error) was raised in it. Not at an ``except`` line:
    matching and binding the exception makes no call, where CPython handles a signal."""

    def __init__(self, k: int):
        super().__init__(k)
        self.seen = False

    def __call__(self, frame, event, arg):
        if event == "exception" and isinstance(arg[1], ValueError) \
                and threading.current_thread() is threading.main_thread():
            self.seen = True
        if event == "line" and (not self.seen or linecache.getline(
                frame.f_code.co_filename, frame.f_lineno).lstrip().startswith("except ")):
            return self
        return super().__call__(frame, event, arg)


@pytest.mark.timeout(40)
def test_ctrl_c_as_the_first_batchs_error_leaves_next_loses_neither_it_nor_the_epoch(
        fake_pinning):
    """The first next() takes the first batch itself (before the pin thread starts): a
    Ctrl-C at each line run once that batch raised. The error is raised once, by this
    next() or the next one, and the epoch goes on. Before: an interrupt as the error was
    being counted as received lost it, and with a window of one batch that batch stayed
    counted against the read-ahead, so the next next() waited for ever."""
    dataset = RaisingDataset(8, bad={0})
    with ArenaLoader(dataset, batch_size=2, sampler=[0, 1, 2, 3, 4, 5], num_workers=1,
                     prefetch_factor=1, pin_memory=True, output="torch",
                     persistent_workers=True) as loader:
        ctrl_c_at_each_line_after_the_first_error(
            loader, lambda batch: int(batch[0, 0, 0, 0]),
            [int(dataset[i][0, 0, 0]) for i in (2, 4)], step=3)  # (the device test: 2, 5, ...)


def ctrl_c_at_each_line_after_the_first_error(loader, first_value, rest, first: int = 1,
                                              step: int = 1) -> None:
    """Epochs of ``loader`` (with persistent workers), the k-th interrupted at the k-th line
    run from its first batch's ``ValueError`` to the end of the next ``next()`` that returns
    a batch, until one is not: each yields that error once, then the batches whose
    ``first_value`` are ``rest``. k = ``first``, then every ``step``-th line."""
    k, interrupts = first - step, 1
    while interrupts:
        k += step
        iterator, got, interrupts = iter(loader), [], 0
        tracer = _InterruptAfterError(k)
        while True:
            sys.settrace(tracer)
            try:
                got.append(first_value(next(iterator)))
                tracer.armed = False  # (up to the end of the first next() after the error)
            except KeyboardInterrupt:
                interrupts += 1
            except ValueError as error:
                got.append(str(error).splitlines()[-1])
            except StopIteration:
                break
            finally:
                sys.settrace(None)
        assert got == ["ValueError: sample 0 is corrupt", *rest], (k, interrupts)
        del iterator
        gc.collect()  # (not in a traced next(): an interrupt in a finalizer is swallowed)


def loader_worker_pids(loader) -> set[int]:
    return {pid for iterator in loader.snapshot().iterators for pid in iterator.worker_pids}


def host_idle(loader) -> bool:
    """No batch in flight or ready: a stage one batch ahead waits for room in the window."""
    return all(not iterator.in_flight and not iterator.ready
               for iterator in loader.snapshot().iterators)


def test_an_epoch_abandoned_while_the_pin_thread_waits_for_room_keeps_its_workers(
        fake_pinning, monkeypatch):
    """With a window of one batch the pin thread, a batch ahead, waits in the host iterator
    for the room only its consumer's next next() makes. The epoch abandoned there, iter()
    stops that wait at once and the next epoch runs on the same persistent workers. Before:
    the thread never saw the stop, iter() waited out the 10 s join and closed the persistent
    iterator under it (new workers); a dropped non-persistent epoch waited out 0.5 s. The
    host's poll is made longer than the join here: the stop must wake the wait, not be seen
    at the wait's next poll."""
    from arena_loader import _stage
    from arena_loader._pipeline import consumer

    monkeypatch.setattr(consumer, "POLL_S", 30.0)
    monkeypatch.setattr(_stage, "SHARED_JOIN_S", 2.0)
    with ArenaLoader(TensorPairs(8), batch_size=2, num_workers=1, prefetch_factor=1,
                     pin_memory=True, persistent_workers=True) as loader:
        abandoned = iter(loader)
        next(abandoned)
        pids = loader_worker_pids(loader)
        assert wait_until(lambda: host_idle(loader), timeout_s=5)
        time.sleep(0.05)  # (the thread, having taken batch 1, now waits for room)
        labels = [batch[1].tolist() for batch in loader]
        assert loader_worker_pids(loader) == pids
    assert labels == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_iter_gives_a_persistent_epochs_pin_thread_its_long_join(fake_pinning, monkeypatch):
    """iter() stops the pin thread still reading the last persistent epoch, waiting for a
    slow batch in flight: it gets SHARED_JOIN_S to finish that batch (closing the persistent
    iterator under it would cost the workers), not the short join of a host the stage owns
    (made shorter than the batch here)."""
    from arena_loader import _stage

    monkeypatch.setattr(_stage, "OWNED_JOIN_S", 0.01)
    with ArenaLoader(SlowAt(8, 2, 0.15), batch_size=2, num_workers=1, pin_memory=True,
                     persistent_workers=True) as loader:
        abandoned = iter(loader)
        next(abandoned)  # the pin thread now waits for batch 1 (slow)
        pids = loader_worker_pids(loader)
        labels = [batch[1].tolist() for batch in loader]
        assert loader_worker_pids(loader) == pids
    assert labels == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_close_of_a_pinned_iterator_still_held_stops_its_workers(fake_pinning):
    """close() of a non-persistent iterator through the pin thread closes the host iterator
    it owns, whether or not the thread was still at work: its workers stop now, not when
    the iterator is collected."""
    with ArenaLoader(TensorPairs(16), batch_size=2, num_workers=2,
                     pin_memory=True) as loader:
        iterator = iter(loader)
        next(iterator)
        assert wait_until(lambda: len(fake_pinning) >= 2 * 4)  # the thread waits for room
        iterator.close()
        assert wait_until(lambda: not live_children()), live_children()
        with pytest.raises(LoaderClosedError):
            next(iterator)


def test_next_after_a_pinned_epoch_ended_raises_stop_iteration_again(fake_pinning):
    """As torch's iterator (and ours without the pin thread): once the epoch ended, every
    next() raises StopIteration, not LoaderClosedError."""
    with ArenaLoader(TensorPairs(4), batch_size=2, num_workers=1, pin_memory=True) as loader:
        iterator = iter(loader)
        assert len(list(iterator)) == 2
        for _ in range(2):
            with pytest.raises(StopIteration):
                next(iterator)


def test_each_timeout_through_the_pin_thread_is_timed_from_its_own_next(fake_pinning):
    """After a LoaderTimeoutError, next() waits again for ``timeout`` and then gets the slow
    batch, as without the pin thread. The thread loads nothing more until the consumer has
    seen an error: went on at once, its next wait was timed from the next() that had timed
    out already, and the next next() raised a second LoaderTimeoutError at once."""
    with ArenaLoader(SlowAt(8, 2, 0.3), batch_size=2, num_workers=1, pin_memory=True,
                     timeout=0.1) as loader:
        iterator, got, waits = iter(loader), [], []
        while True:
            began = time.monotonic()
            try:
                got.append(next(iterator)[1].tolist())
            except LoaderTimeoutError:
                waits.append(time.monotonic() - began)
            except StopIteration:
                break
    assert got == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert waits and min(waits) >= 0.09, waits


def test_the_first_batch_keeps_no_slot_once_the_consumer_dropped_it(fake_pinning):
    """The first next() takes the first batch from the host itself and starts the pin thread
    with it: the stage keeps no reference to it once pinned, so its slot comes back when the
    consumer drops the pinned copy, as every later batch's."""
    with ArenaLoader(TensorPairs(16), batch_size=2, num_workers=1, pin_memory=True) as loader:
        iterator = iter(loader)
        next(iterator)
        next(iterator)
        assert wait_until(lambda: loader.snapshot().held_batches == 0), loader.snapshot()


def test_the_pin_thread_keeps_at_most_two_pinned_batches_ahead(fake_pinning):
    """The pin thread's queue holds PIN_PREFETCH = 2 pinned batches (and it holds one more it
    waits to queue), however large the read-ahead: page-locked memory stays bounded."""
    with ArenaLoader(TensorPairs(32), batch_size=2, num_workers=2, prefetch_factor=4,
                     pin_memory=True) as loader:
        iterator = iter(loader)
        next(iterator)
        assert wait_until(lambda: len(fake_pinning) >= 2 * 4)  # 2 tensors a batch
        assert not wait_until(lambda: len(fake_pinning) > 2 * 4, timeout_s=0.2)
        assert len(list(iterator)) == 15


def test_a_pinned_loader_with_persistent_workers_pickles_after_an_epoch(fake_pinning):
    """Pickled after an epoch (``mp.spawn(fn, args=(loader,))``), a pin_memory loader with
    persistent workers leaves its pin leg behind with its workers (the leg references the
    staged iterator): the copy pins in a thread of its own and gives the same epoch."""
    import pickle

    with ArenaLoader(TensorPairs(8), batch_size=2, num_workers=1, pin_memory=True,
                     persistent_workers=True) as loader:
        first = [batch[1].tolist() for batch in loader]
        with pickle.loads(pickle.dumps(loader)) as twin:
            assert [batch[1].tolist() for batch in twin] == first
        assert [batch[1].tolist() for batch in loader] == first
    assert len(fake_pinning) == 2 * 4 * 3


def test_a_state_saved_at_a_pinned_epochs_end_resumes_at_the_next_epoch(fake_pinning):
    """state_dict() once a pin_memory epoch ended (the position the pin thread carried with
    the epoch's end): a loader loading it starts at the next epoch, as without the thread,
    not with the rest of the ended one (nothing)."""
    import torch

    def make():
        return ArenaLoader(TensorPairs(8), batch_size=2, shuffle=True, num_workers=1,
                           pin_memory=True, generator=torch.Generator().manual_seed(3))

    with make() as loader:
        assert len(list(loader)) == 4
        state = loader.state_dict()
        second = [batch[1].tolist() for batch in loader]
    with make() as loader:
        loader.load_state_dict(state)
        assert [batch[1].tolist() for batch in loader] == second


def test_the_pin_threads_last_result_queued_as_a_wait_of_next_times_out_is_taken(
        fake_pinning, monkeypatch):
    """next()'s wait for the pin thread can time out as the thread's notify crosses it (a
    Condition's wait then says it timed out), and the thread, its last result queued (the
    epoch's end), can end before next() looks: next() takes that result. Before: it took
    the ended thread for one that died without a word and raised RuntimeError ("the
    arena_loader-pin thread stopped unexpectedly"). Every wait times out here (no poll)."""
    from arena_loader import _stage

    monkeypatch.setattr(_stage, "POLL_S", 0.0)
    with ArenaLoader(TensorPairs(4), batch_size=2, num_workers=1, pin_memory=True,
                     persistent_workers=True) as loader:
        for _ in range(5):
            assert [batch[1].tolist() for batch in loader] == [[0, 1], [2, 3]]


def test_an_epoch_whose_window_the_pin_thread_fills_ends_without_a_poll(fake_pinning,
                                                                        monkeypatch):
    """With a window of one batch, the pin thread waits in the host, nothing in flight, for
    the room its consumer makes; the consumer's next() that receives the epoch's last batch
    finds nothing more to send and wakes that wait, so the epoch ends at once (the host's
    poll, made 20 s long here, would end it at the poll)."""
    from arena_loader._pipeline import consumer

    monkeypatch.setattr(consumer, "POLL_S", 20.0)
    with ArenaLoader(TensorPairs(4), batch_size=2, num_workers=1, prefetch_factor=1,
                     pin_memory=True) as loader:
        start = time.monotonic()
        assert [batch[1].tolist() for batch in loader] == [[0, 1], [2, 3]]
        assert time.monotonic() - start < 10.0
