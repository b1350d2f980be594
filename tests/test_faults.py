"""Engine faults outside the dataset's arrays: samplers, pickling, threads, slow loads."""

from __future__ import annotations

import dis
import faulthandler
import functools
import gc
import linecache
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import weakref

import numpy as np
import psutil
import pytest

from arena_loader import ArenaLoader, LoaderClosedError, WorkerCrashedError

from . import zygote
from .conftest import live_children, our_slab_mappings, wait_until
from .datasets import ImageDataset, Release, SlowDataset, SuicidalDataset, reference_epoch

pytestmark = pytest.mark.timeout(60)


class SlowSampler:
    """Yields 0..n-1, sleeping ``delay_s`` (or until ``released.set()``) before index
    ``slow_at``."""

    def __init__(self, n: int, slow_at: int, delay_s: float):
        self.n, self.slow_at, self.delay_s = n, slow_at, delay_s
        self.released = Release()

    def __iter__(self):
        for i in range(self.n):
            if i == self.slow_at:
                self.released.sleep(self.delay_s)
            yield i

    def __len__(self):
        return self.n


class FailingSampler(SlowSampler):
    def __iter__(self):
        for i in range(self.n):
            if i == self.slow_at:
                raise LookupError(f"sampler broke at {i}")
            yield i


def test_slow_sampler_stalls_next_as_torch_and_close_from_another_thread_returns_at_once():
    """The sampler runs inside next(), as torch's does, so a sampler stuck in user code holds
    up that next() (`timeout` bounds the wait for workers, not user code in this process);
    close() from another thread still returns at once, and the stuck next() then raises
    LoaderClosedError instead of using the closed workers."""
    dataset = ImageDataset(40)
    sampler = SlowSampler(40, slow_at=12, delay_s=2.0)
    loader = ArenaLoader(dataset, batch_size=2, num_workers=1, timeout=0.3, sampler=sampler)
    iterator = iter(loader)
    outcome: list = []

    def consume(it=iterator):
        try:
            while True:
                next(it)
        except BaseException as exc:  # the outcome under test
            outcome.append(exc)

    consumer = threading.Thread(target=consume)
    consumer.start()
    time.sleep(0.5)  # the consumer is inside the sampler's 2 s sleep by now
    assert consumer.is_alive() and not outcome
    start = time.monotonic()
    loader.close()
    assert time.monotonic() - start < 1.0
    assert not live_children()  # close() stopped the worker while next() was stuck
    sampler.released.set()  # the sampler returns (sooner than its 2 s): next() goes on
    consumer.join(timeout=5)
    assert not consumer.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], LoaderClosedError), outcome
    del iterator


@pytest.mark.parametrize("num_workers", [0, 2])
def test_sampler_error_is_raised_after_the_batches_before_it(num_workers):
    """An exception from the sampler comes after every batch sampled before it, then the
    epoch ends. The sampler's own frame is in its traceback, or with workers (where it was
    raised while batches were drawn ahead) in its traceback's text, kept as a note (on Python
    3.10 too: ``_messages.add_note``)."""
    dataset = ImageDataset(40, shape=(1,), dtype=np.int64)
    expected = reference_epoch(dataset, 2, False)
    with ArenaLoader(dataset, batch_size=2, num_workers=num_workers,
                     sampler=FailingSampler(40, slow_at=21, delay_s=0)) as loader:
        iterator = iter(loader)
        for i in range(10):
            np.testing.assert_array_equal(next(iterator), expected[i])
        with pytest.raises(LookupError, match="sampler broke at 21") as caught:
            next(iterator)
        notes = getattr(caught.value, "__notes__", [])
        if num_workers == 0:
            text = "".join(traceback.format_tb(caught.value.__traceback__))
        else:
            assert len(notes) == 1 and "drawn ahead" in notes[0], notes
            text = notes[0]
        assert 'raise LookupError(f"sampler broke at {i}")' in text
        with pytest.raises(StopIteration):
            next(iterator)
        del iterator


class _RaisingOnceIterator:
    """0 .. 9, an iterator object (not a generator): raises once at 5, and would go on."""

    def __init__(self):
        self.i, self.raised = 0, False

    def __iter__(self):
        return self

    def __next__(self):
        if self.i == 5 and not self.raised:
            self.raised = True
            raise LookupError("sampler broke at 5")
        if self.i >= 10:
            raise StopIteration
        self.i += 1
        return self.i - 1


class _SamplerRaisingOnce:
    def __len__(self):
        return 10

    def __iter__(self):
        return _RaisingOnceIterator()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_sampler_whose_iterator_raises_once_ends_the_epoch_there(num_workers):
    """A sampler's iterator that raises and could go on (an object, not a generator): the
    epoch ends after its error, as torch's BatchSampler (a generator, finished by the error)
    ends it; the indices drawn for the failed batch are not handed out."""
    import torch.utils.data

    def outcomes(loader):
        found, iterator = [], iter(loader)
        for _ in range(8):
            try:
                found.append(np.asarray(next(iterator)).tolist())
            except StopIteration:
                return found
            except LookupError as exc:
                found.append(str(exc))
        return found

    expected = [[0, 1], [2, 3], "sampler broke at 5"]
    assert outcomes(torch.utils.data.DataLoader(list(range(10)), batch_size=2,
                                                sampler=_SamplerRaisingOnce())) == expected
    with ArenaLoader(list(range(10)), batch_size=2, num_workers=num_workers,
                     sampler=_SamplerRaisingOnce()) as loader:
        assert outcomes(loader) == expected


class NegativeLength(ImageDataset):
    """A dataset whose ``__len__`` is wrong: ``len()`` raises ValueError."""

    def __len__(self):
        return -1


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("make", [
    lambda: dict(dataset=NegativeLength(8)),             # our sampler's first draw
    lambda: dict(dataset=ImageDataset(8), sampler=10)],  # iter(sampler) itself
    ids=["len", "sampler-not-iterable"])
def test_a_sampler_failing_at_its_first_draw_ends_the_epoch_as_torchs(num_workers, make):
    """A sampler that raises before its first batch (``len(dataset)`` raising, a sampler that
    is not iterable) raises once; the next ``next()`` ends the epoch, as torch's (whose
    BatchSampler generator is finished then). Before: with ``num_workers=0`` every later
    ``next()`` raised it again, so a loop that logs errors and goes on never ended."""
    import torch.utils.data

    kwargs = make()
    if num_workers == 0:  # (torch's, with workers, raises it from iter() instead)
        iterator = iter(torch.utils.data.DataLoader(batch_size=2, **kwargs))
        with pytest.raises((ValueError, TypeError)):
            next(iterator)
        with pytest.raises(StopIteration):
            next(iterator)
    with ArenaLoader(batch_size=2, num_workers=num_workers, **make()) as loader:
        iterator = iter(loader)
        with pytest.raises((ValueError, TypeError)):
            next(iterator)
        with pytest.raises(StopIteration):
            next(iterator)
        del iterator


def test_new_epoch_after_a_crash_reuses_the_loader_slab():
    """After WorkerCrashedError, a new iter() gets the loader's own slab back (no second
    one), with every slot free again."""
    with ArenaLoader(SuicidalDataset(20, fatal_index=7), batch_size=2, num_workers=2,
                     slots=5) as loader:
        crashed = iter(loader)
        with pytest.raises(WorkerCrashedError):
            for batch in crashed:
                del batch
        gc.collect()
        snapshot = loader.snapshot()
        assert snapshot.slot_nbytes is not None and not snapshot.in_use
        assert snapshot.free_slots == 5
        loader.dataset.fatal_index = -1
        assert sum(1 for _ in loader) == 10
        assert len(our_slab_mappings()) == 1  # still one slab, though `crashed` is alive
        del crashed


class _DiesAt(ImageDataset):
    """The worker that loads ``fatal_index`` writes its pid to ``pid_path`` and is SIGKILLed."""

    def __init__(self, n: int, fatal_index: int, pid_path: str):
        super().__init__(n)
        self.fatal_index, self.pid_path = fatal_index, pid_path

    def __getitem__(self, index: int) -> np.ndarray:
        if index == self.fatal_index:
            faulthandler.disable()  # pytest's handler would print this worker's stack
            with open(self.pid_path, "w") as stamp:
                stamp.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(index)


class _DrawsOnceDead:
    """Batches of two; drawing batch ``hold_at`` waits until the worker named in ``pid_path``
    is dead (a zombie: not yet reaped), so the records it sent before all wait unread."""

    def __init__(self, batches: int, pid_path: str, hold_at: int):
        self.batches, self.pid_path, self.hold_at = batches, pid_path, hold_at

    def __len__(self) -> int:
        return self.batches

    def _dead(self) -> bool:
        try:
            with open(self.pid_path) as stamp:
                return psutil.Process(int(stamp.read())).status() == psutil.STATUS_ZOMBIE
        except (FileNotFoundError, ValueError):
            return False  # not written yet (or half)
        except psutil.NoSuchProcess:
            return True

    def __iter__(self):
        for i in range(self.batches):
            if i == self.hold_at:
                assert wait_until(self._dead)
            yield [2 * i, 2 * i + 1]


@pytest.mark.parametrize("in_order", [True, False])
def test_batches_a_worker_sent_before_it_died_come_before_the_crash(tmp_path, in_order):
    """A worker sends batches 0-3 and is killed loading batch 4; next() looks only once it is
    dead (the sampler waits for that as the window fills). Every batch it sent is handed out,
    in order and intact, before WorkerCrashedError. in_order=False: the first wait sees the
    records and the exit at once, so the session has failed before batch 0 is handed out."""
    pid_path = str(tmp_path / "pid")
    expected = reference_epoch(ImageDataset(16), 2, False)
    with ArenaLoader(_DiesAt(16, 8, pid_path), num_workers=1, prefetch_factor=6,
                     batch_sampler=_DrawsOnceDead(8, pid_path, hold_at=5),
                     in_order=in_order) as loader:
        iterator = iter(loader)
        received = []
        with pytest.raises(WorkerCrashedError, match=r"worker 0 \(pid \d+\) was killed by "
                                                     r"SIGKILL while loading batch idx=4 "):
            for batch in iterator:
                received.append(np.array(batch))
        assert len(received) == 4
        for got, ref in zip(received, expected):
            np.testing.assert_array_equal(got, ref)
        del iterator


class _RaisesOnLoad:
    def __reduce__(self):
        return (_explode, ())


def _explode():
    raise ValueError("cannot rebuild this object")


@pytest.mark.parametrize("leaf, pattern", [
    (lambda i: (lambda: i), r"(?s)Caught .*(Pickling|Attribute)Error.*idx=1"),
    (lambda i: _RaisesOnLoad(), r"non-array values of batch idx=1 \(indices \[2, 3\]\) did "
                                r"not unpickle"),
])
def test_object_leaves_that_do_not_pickle_fail_only_their_batch(leaf, pattern):
    """An object leaf that cannot be pickled in the worker, or unpickled in the main process,
    is that batch's error; the following batches still arrive."""
    class Dataset(ImageDataset):
        def __getitem__(self, i):
            return {"x": super().__getitem__(i), "extra": leaf(i) if i == 3 else str(i)}

    with ArenaLoader(Dataset(8), batch_size=2, num_workers=2) as loader:
        iterator = iter(loader)
        assert next(iterator)["extra"] == ["0", "1"]
        with pytest.raises(Exception, match=pattern) as info:
            next(iterator)
        assert type(info.value) is not Exception
        assert [next(iterator)["extra"] for _ in range(2)] == [["4", "5"], ["6", "7"]]
        gc.collect()
        assert loader.snapshot().assigned_slots == 0
        del iterator


class UnpicklableError(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a}/{b}")


def test_exception_that_cannot_be_rebuilt_becomes_runtime_error():
    """A worker exception whose type cannot take one message is raised as RuntimeError that
    names the original type and keeps its traceback."""
    class Dataset(ImageDataset):
        def __getitem__(self, i):
            if i == 2:
                raise UnpicklableError("a", "b")
            return super().__getitem__(i)

    with ArenaLoader(Dataset(6), batch_size=2, num_workers=1) as loader:
        with pytest.raises(RuntimeError, match=r"(?s)Caught .*UnpicklableError in DataLoader "
                                               r"worker process 0.*a/b"):
            list(loader)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_getitems_returning_the_wrong_count_is_named(num_workers):
    """__getitems__ must return one sample per index; otherwise a ValueError says so."""
    class Dataset(ImageDataset):
        def __getitems__(self, indices):
            return [self[i] for i in indices[:-1]]

    with ArenaLoader(Dataset(6), batch_size=3, num_workers=num_workers) as loader:
        with pytest.raises(ValueError, match=r"__getitems__ returned 2 samples for 3 indices"):
            list(loader)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batch_size_none_applies_collate_fn_to_each_sample(num_workers):
    """batch_size=None with a collate_fn: it is applied to every single sample, as torch."""
    dataset = ImageDataset(5, shape=(3,), dtype=np.int64)
    with ArenaLoader(dataset, batch_size=None, num_workers=num_workers,
                     collate_fn=lambda s: {"sum": s.sum(), "x": s * 2}) as loader:
        items = [(int(item["sum"]), np.array(item["x"])) for item in loader]
    assert len(items) == 5
    for i, (total, doubled) in enumerate(items):
        assert total == int(dataset[i].sum())
        np.testing.assert_array_equal(doubled, dataset[i] * 2)


@pytest.mark.parametrize("pin", [False, True])
def test_close_from_another_thread_wakes_a_waiting_next(request, pin):
    """close() from another thread makes a next() that waits for a slow batch raise
    LoaderClosedError promptly; with pin_memory=True too, where next() waits on the pin
    thread (``Tensor.pin_memory`` a copy here)."""
    if pin:
        request.getfixturevalue("fake_pinning")
    dataset = SlowDataset(10, range(2, 10), 5)
    loader = ArenaLoader(dataset, batch_size=2, num_workers=1, pin_memory=pin,
                         output="torch" if pin else None)
    iterator = iter(loader)
    next(iterator)
    closer = threading.Timer(0.3, loader.close)
    closer.start()
    start = time.monotonic()
    with pytest.raises(LoaderClosedError):
        next(iterator)
    assert time.monotonic() - start < 1.0
    dataset.release()  # (the close() still joining the stuck worker returns sooner)
    closer.join()
    del iterator


def test_batches_in_reference_cycles_are_collected_with_workers():
    """With workers too, batches reachable only through garbage cycles do not count."""
    with ArenaLoader(ImageDataset(30), batch_size=1, num_workers=2, slots=5) as loader:
        gc.disable()
        try:
            count = 0
            for batch in loader:
                cycle: list = [batch]
                cycle.append(cycle)
                del cycle
                count += 1
        finally:
            gc.enable()
        assert count == 30
        del batch


def test_out_of_order_delivery_lets_fast_batches_overtake_a_slow_one():
    """in_order=False: a slow batch is delivered after batches sent later."""
    dataset = SlowDataset(16, {2}, 0.5, shape=(1,), dtype=np.int64)
    with ArenaLoader(dataset, batch_size=2, num_workers=2, in_order=False) as loader:
        order = [int(batch[0, 0]) // 2 for batch in
                 (np.array(b) for b in loader)]
    starts = [int(dataset[2 * k][0]) // 2 for k in range(8)]
    assert sorted(order) == sorted(starts)
    assert order.index(starts[1]) > order.index(starts[2])  # batch 1 was overtaken


def test_first_batch_objects_that_do_not_pickle_fail_only_that_batch():
    """The first batch (the one whose layout sizes the slab) with an unpicklable object leaf
    is that batch's error; its slot comes back and the epoch goes on."""
    class Dataset(ImageDataset):
        def __getitem__(self, i):
            # Sample 1's, not 0's: the first sample's str makes the leaf a list of objects (as
            # in torch's default_collate), which then fails to pickle.
            return {"x": super().__getitem__(i), "tag": (lambda: i) if i == 1 else str(i)}

    with ArenaLoader(Dataset(6), batch_size=2, num_workers=1, slots=3) as loader:
        iterator = iter(loader)
        with pytest.raises((AttributeError, pickle.PicklingError),
                           match=r"worker process 0\.\n.* while loading batch idx=0 "
                                 r"\(indices \[0, 1\]\)"):
            next(iterator)
        assert [next(iterator)["tag"] for _ in range(2)] == [["2", "3"], ["4", "5"]]
        with pytest.raises(StopIteration):
            next(iterator)
        gc.collect()
        assert loader.snapshot().free_slots == 3
        del iterator


def test_close_while_the_first_batch_loads_leaves_the_loader_clean():
    """close() from another thread while a worker loads batch 0 (whose layout sizes the
    slab): next() raises LoaderClosedError, no slab stays claimed or holds a filled slot, and
    the next iterator loads the whole epoch."""
    loader = ArenaLoader(SlowDataset(8, {0}, 0.4), batch_size=2, num_workers=1, slots=4)
    iterator = iter(loader)
    closer = threading.Timer(0.1, iterator.close)
    closer.start()
    with pytest.raises(LoaderClosedError):
        next(iterator)
    closer.join()
    snapshot = loader.snapshot()
    assert not snapshot.in_use
    assert snapshot.slab_nbytes is None  # the layout was never learned: no slab was sized
    assert sum(1 for _ in loader) == 4
    assert loader.snapshot().free_slots == 4
    loader.close()
    del iterator


def test_epoch_end_is_stop_iteration_even_if_the_sampler_ends_slowly():
    """The consumer holds every slot and the batch sampler is slow to say it is done: the
    result is StopIteration, not SlotsExhaustedError."""
    class SlowEnd:
        batch_size = 2  # so the loader streams it rather than listing it up front

        def __iter__(self):
            yield [0, 1]
            yield [2, 3]
            yield [4, 5]
            time.sleep(0.3)

        def __len__(self):
            return 3

    with ArenaLoader(ImageDataset(6), batch_sampler=SlowEnd(), num_workers=1,
                     prefetch_factor=1, slots=3) as loader:
        iterator = iter(loader)
        held = [next(iterator) for _ in range(3)]  # every slot now held by the consumer
        with pytest.raises(StopIteration):
            next(iterator)
        del held, iterator


def test_session_close_in_a_forked_child_does_not_touch_the_parents_workers():
    """A finalizer copied into a forked process (as into a worker of another loader) must not
    stop the parent's workers."""
    with ArenaLoader(ImageDataset(20), batch_size=2, num_workers=2) as loader:
        iterator = iter(loader)
        next(iterator)
        child = os.fork()
        if child == 0:
            try:
                iterator.close()  # runs the iterator's finalizer, as GC in that child would
            finally:
                os._exit(0)
        os.waitpid(child, 0)
        assert sum(1 for _ in iterator) == 9
        del iterator


def test_crashed_iterator_is_collected_once_dropped():
    """After WorkerCrashedError (raised again, as an equal copy, by every next()), dropping the
    iterator frees it and closes its session: the error the session keeps must not pin the
    iterator through a traceback, or each crashed epoch would leak its pipes and frames."""
    with ArenaLoader(SuicidalDataset(20, fatal_index=-1), batch_size=2, num_workers=2) as loader:
        assert sum(1 for _ in loader) == 10  # sizes the loader's slab, which stays open
        fds = len(os.listdir("/proc/self/fd"))
        loader.dataset.fatal_index = 7
        iterator = iter(loader)
        with pytest.raises(WorkerCrashedError) as first:
            for _ in iterator:
                pass
        with pytest.raises(WorkerCrashedError) as again:
            next(iterator)
        assert str(again.value) == str(first.value) and again.value.pid == first.value.pid
        assert [epoch.phase for epoch in loader.snapshot().iterators] == ["failed"]
        collected = weakref.ref(iterator)
        del iterator, first, again
        gc.collect()
        assert collected() is None
        assert loader.snapshot().iterators == ()
        # Its session was closed: every pipe it opened is closed again.
        assert len(os.listdir("/proc/self/fd")) == fds


class UnpicklableThirdBatch:
    """Batches of two indices; the third holds a lock, which does not pickle."""

    def __iter__(self):
        yield [0, 1]
        yield [2, 3]
        yield [4, threading.Lock()]

    def __len__(self):
        return 3


def test_an_iterator_failed_by_indices_that_do_not_pickle_is_collected_once_dropped():
    """The pickling error, kept to raise at every later next(), is kept without its traceback:
    its frames held the iterator (and the session's finalizer holds the error), so a dropped
    iterator lived on, and so did the view of the last batch handed out, its slot leased."""
    dataset = ImageDataset(8, shape=(2,), dtype=np.float32)
    with ArenaLoader(dataset, batch_sampler=UnpicklableThirdBatch(), num_workers=1,
                     prefetch_factor=1, slots=3) as loader:
        for _ in range(2):  # the second epoch's batches are in the slab the first sized
            iterator = iter(loader)
            with pytest.raises(TypeError, match="pickle"):
                for batch in iterator:
                    del batch
            del iterator
            gc.collect()
            snapshot = loader.snapshot()
            assert snapshot.iterators == () and snapshot.free_slots == loader.slots, snapshot



def test_ctrl_c_as_a_batch_is_sent_gives_its_slot_back_at_once(monkeypatch):
    """A Ctrl-C as a batch's entry is published (the ring not taking it): the slot taken for
    it is free again at once, not left assigned to nobody until no slot is free; the batch
    goes out at the next next(), and the epoch is whole."""
    from arena_loader._pipeline.crew import Crew
    from arena_loader._pipeline.order import EntryKind

    publish = Crew.publish
    armed = []

    def interrupted_once(self, worker, kind, *args, **kwargs):
        if armed and kind is not EntryKind.ATTACH:
            armed.clear()
            raise KeyboardInterrupt
        return publish(self, worker, kind, *args, **kwargs)

    monkeypatch.setattr(Crew, "publish", interrupted_once)
    dataset = ImageDataset(8, shape=(2,), dtype=np.float32)
    with ArenaLoader(dataset, batch_size=2, num_workers=1, prefetch_factor=1,
                     slots=3) as loader:
        expected = reference_epoch(dataset, 2, False)
        assert sum(1 for _ in loader) == 4  # sizes the slab: the next epoch is in its slots
        iterator = iter(loader)
        got = [np.array(next(iterator))]
        armed.append(True)
        with pytest.raises(KeyboardInterrupt):
            got.append(np.array(next(iterator)))
        snapshot = loader.snapshot()
        assert snapshot.slot_states.count("assigned") == len(snapshot.iterators[0].in_flight), \
            snapshot
        got += [np.array(batch) for batch in iterator]
        assert len(got) == len(expected)
        assert all(np.array_equal(a, b) for a, b in zip(got, expected))


def _interrupt_a_slot_take(monkeypatch) -> list:
    """Once the returned list holds an item, the next slot taken raises KeyboardInterrupt
    right after the take (the slot left assigned to nobody)."""
    from arena_loader._pool import SlotPool

    acquire = SlotPool.acquire
    armed: list = []

    def taken_then_interrupted(self, *args, **kwargs):
        slot = acquire(self, *args, **kwargs)
        if armed and slot is not None:
            armed.clear()
            raise KeyboardInterrupt
        return slot

    monkeypatch.setattr(SlotPool, "acquire", taken_then_interrupted)
    return armed


def test_a_slot_left_assigned_by_a_ctrl_c_as_it_was_taken_is_used_again_at_once(monkeypatch):
    """num_workers=0: a Ctrl-C right after a slot was taken, before next() recorded it,
    leaves the slot assigned to nobody; the next next() finds no free slot, recovers that
    one and loads into it (not into a one-off segment with the slab's slot held idle)."""
    armed = _interrupt_a_slot_take(monkeypatch)
    dataset = ImageDataset(6, shape=(2,), dtype=np.float32)
    with ArenaLoader(dataset, batch_size=2, num_workers=0, slots=1) as loader:
        expected = reference_epoch(dataset, 2, False)
        iterator = iter(loader)
        got = [np.array(next(iterator))]  # sizes the slab
        armed.append(True)
        with pytest.raises(KeyboardInterrupt):
            next(iterator)
        batch = next(iterator)
        assert loader.snapshot().held_segments == 0  # in the slot, which it recovered
        got.append(np.array(batch))
        del batch
        got += [np.array(batch) for batch in iterator]
        assert len(got) == len(expected)
        assert all(np.array_equal(a, b) for a, b in zip(got, expected))


@pytest.mark.filterwarnings("ignore:your code holds 2 batches:UserWarning")  # (the read-ahead's)
def test_with_workers_a_slot_left_assigned_by_a_ctrl_c_as_it_was_taken_is_recovered(
        monkeypatch):
    """Workers: a Ctrl-C right after the window took a slot for a batch it was sending
    leaves that slot assigned to nobody; once the consumer holds every other slot, the next
    send recovers it (not a one-off segment beside the slab's idle slot)."""
    armed = _interrupt_a_slot_take(monkeypatch)
    dataset = ImageDataset(12, shape=(2,), dtype=np.float32)
    expected = reference_epoch(dataset, 2, False)
    with ArenaLoader(dataset, batch_size=2, num_workers=1, prefetch_factor=1,
                     slots=3) as loader:
        assert sum(1 for _ in loader) == 6  # sizes the slab
        iterator = iter(loader)
        armed.append(True)
        with pytest.raises(KeyboardInterrupt):
            next(iterator)  # its first send took a slot and was interrupted
        held = [next(iterator) for _ in range(3)]  # every slot: the third recovered
        assert loader.snapshot().held_segments == 0
        got = [np.array(batch) for batch in held] + [np.array(b) for b in iterator]
        assert len(got) == len(expected)
        assert all(np.array_equal(a, b) for a, b in zip(got, expected))
        del held, iterator


def test_interrupt_while_handing_out_a_batch_gives_its_slot_back(monkeypatch):
    """Ctrl-C landing after a batch is taken but before it is handed over: KeyboardInterrupt
    reaches the caller, the batch is handed out by the next next() (not lost), and every slot
    is free again at the end of the epoch."""
    from arena_loader._layout import Plan

    class Tagged(ImageDataset):
        def __getitem__(self, i):
            return {"x": super().__getitem__(i), "tag": str(i)}

    real_objects, calls = Plan.objects, []

    def interrupted_once(plan, storage):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # while the batch's object leaves are unpickled
        return real_objects(plan, storage)

    monkeypatch.setattr(Plan, "objects", interrupted_once)
    with ArenaLoader(Tagged(8), batch_size=2, num_workers=1, slots=3,
                     persistent_workers=True) as loader:
        iterator = iter(loader)
        assert next(iterator)["tag"] == ["0", "1"]
        with pytest.raises(KeyboardInterrupt):
            next(iterator)
        # The interrupted batch is not lost: it is the next one.
        assert [next(iterator)["tag"] for _ in range(3)] == [["2", "3"], ["4", "5"], ["6", "7"]]
        with pytest.raises(StopIteration):
            next(iterator)
        gc.collect()
        assert loader.snapshot().free_slots == 3
        del iterator


class SlowRows(ImageDataset):
    def __getitem__(self, index):
        time.sleep(0.05)
        return super().__getitem__(index)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_no_room_for_the_slab_gives_every_batch_a_segment(monkeypatch, num_workers):
    """/dev/shm too full for the slab when the first batch arrives (but not for one batch):
    every batch goes to a segment of its own, epochs stay whole and correct, persistent
    workers included, and nothing is left behind."""
    import arena_loader._slab as slab_module
    from arena_loader import ShmCapacityError

    def no_room(self, nbytes, *, slots=None, lazy=False):
        self.close()
        raise ShmCapacityError(28, "no room for the slab (test)")

    monkeypatch.setattr(slab_module.Slab, "allocate", no_room)
    dataset = SlowRows(8, shape=(4,), dtype=np.int64)
    expected = reference_epoch(dataset, 2, False)
    options = dict(persistent_workers=True) if num_workers else {}
    with ArenaLoader(dataset, batch_size=2, num_workers=num_workers, **options) as loader:
        for _ in range(2):
            for batch, reference in zip(loader, expected, strict=True):
                np.testing.assert_array_equal(batch, reference)
        assert loader.snapshot().slab_nbytes is None


def exit_worker_one_soon(worker_id):
    if worker_id == 1:
        time.sleep(0.3)
        os._exit(3)


def test_worker_dying_while_the_slab_is_sized_is_a_worker_crash(monkeypatch):
    """A worker that dies while the main process sizes the slab for the first batch (a slow
    posix_fallocate) is reported as WorkerCrashedError with its exit code, not as a raw
    BrokenPipeError from telling it to attach."""
    from arena_loader._arena import ArenaSource

    real_claim = ArenaSource.claim

    def slow_claim(self, slot_nbytes=None, slab=None):
        time.sleep(0.6)
        return real_claim(self, slot_nbytes, slab)

    monkeypatch.setattr(ArenaSource, "claim", slow_claim)
    with ArenaLoader(ImageDataset(8), batch_size=2, num_workers=2,
                     worker_init_fn=exit_worker_one_soon) as loader:
        with pytest.raises(WorkerCrashedError, match=r"worker 1 \(pid \d+\) exited with code 3"):
            list(loader)


class _Indexed:
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return np.full(2, i, dtype=np.int64)


_COMPREHENSIONS: dict = {}  # code object -> its inlined comprehensions' bytecode ranges


def _in_inlined_comprehension(frame) -> bool:
    """The frame runs a list, dict or set comprehension inlined in it (Python 3.12+, PEP 709).
    An exception a trace function raises at a line event there skips the enclosing function's
    ``except`` and ``with`` exits (seen on 3.12.1 and 3.13.0: workers orphaned, a lock left
    held), while a real Ctrl-C there runs them (its KeyboardInterrupt comes at an instruction,
    through the exception table): not a fault to inject."""
    if sys.version_info < (3, 12):
        return False
    code = frame.f_code
    ranges = _COMPREHENSIONS.get(code)
    if ranges is None:
        ranges, start, open_loops = [], 0, 0
        for instruction in dis.get_instructions(code):
            # (one LOAD_FAST_AND_CLEAR per loop variable, one END_FOR per loop: nested ones
            # close with the outermost)
            if instruction.opname == "LOAD_FAST_AND_CLEAR":
                start = instruction.offset if open_loops == 0 else start
                open_loops += 1
            elif instruction.opname == "END_FOR" and open_loops:
                open_loops -= 1
                if open_loops == 0:
                    ranges.append((start, instruction.offset))
        _COMPREHENSIONS[code] = ranges
    return any(start <= frame.f_lasti <= end for start, end in ranges)


_NOP = dis.opmap["NOP"]


def _starts_with_nop(frame) -> bool:
    """The line the frame is at starts with a NOP, where CPython handles no signal."""
    code = frame.f_code.co_code
    return 0 <= frame.f_lasti < len(code) and code[frame.f_lasti] == _NOP


_NOT_TARGETS: dict = {}  # (code object, instruction offset) -> _not_a_target's answer


def _not_a_target(frame) -> bool:
    """The line the frame is at is no point to inject a Ctrl-C at (``_InterruptAt``): a `with`
    or `try:` line, one that starts with a NOP, or one inside an inlined comprehension.
    Answered once per instruction: a sweep asks at every line of every next(), and working
    it out each time took ~20% of a sweep's CPU."""
    key = (frame.f_code, frame.f_lasti)
    answer = _NOT_TARGETS.get(key)
    if answer is None:
        answer = _NOT_TARGETS[key] = linecache.getline(
            frame.f_code.co_filename, frame.f_lineno).lstrip().startswith(("with ", "try:")) \
            or _starts_with_nop(frame) or _in_inlined_comprehension(frame)
    return answer


class _InterruptAt:
    """A trace function raising KeyboardInterrupt at the k-th line run in arena_loader's own
    code (our samplers' too: ``SlicedBatches``) in the main thread, once per armed next()."""

    def __init__(self, k: int):
        self.k, self.count, self.armed = k, 0, True
        self.pid = os.getpid()  # a worker forked while tracing inherits the trace: not there

    def __call__(self, frame, event, arg):
        if event == "call":
            name = frame.f_code.co_filename
            # Not the at-fork hooks either: os.fork runs them with the fork half done, and
            # an interrupt there leaves their state to the next fork (a known window).
            return self if ("arena_loader" in name and "_forksafe" not in name) else None
        if event == "line" and self.armed and os.getpid() == self.pid \
                and threading.current_thread() is threading.main_thread():
            # sys.settrace reports a `with` line again while an exception leaves its block,
            # before __exit__ runs; a real Ctrl-C cannot land there (CPython calls __exit__
            # without checking for signals), so that point is not a fault to inject.
            # Nor a `try:` line: CPython 3.11 runs a NOP there, where no signal is handled
            # (the eval loop checks for them at calls and backward jumps), yet a trace
            # function's exception raised at it inside a `with` block, after a conditional
            # return, escapes the block's exception table: its lock stays held (a hang).
            # Likewise a line that starts with a NOP, such as a `return` right after a `try`
            # body in a `with` block (CPython 3.11): the NOP is outside the exception table,
            # so the trace's exception skipped the `with`'s exit and left session.lock held
            # (seen only with a pin or device thread: the main thread re-enters that RLock).
            if _not_a_target(frame):
                return self
            self.count += 1
            if self.count == self.k:
                self.armed = False
                raise KeyboardInterrupt
        return self


@pytest.mark.timeout(60)
def test_ctrl_c_as_a_built_batch_is_stashed_counts_it_once_in_the_state():
    """Workers: KeyboardInterrupt on the line of ``Handout.hand_over`` that stashes a built batch
    (counted as handed out the line before): the next next() returns that batch, and a
    state_dict() taken then resumes at the batch after it, as without the interrupt (the
    interrupt's handler counts a batch only if the position has not moved)."""
    from arena_loader._pipeline import handout

    path = handout.__file__
    target = "self.stash, self.failed, self.taken = [batch], failed, None"
    armed = [True]

    def tracer(frame, event, arg):
        if event == "call":
            return tracer if frame.f_code.co_filename == path else None
        if event == "line" and armed and linecache.getline(
                path, frame.f_lineno).strip() == target:
            armed.clear()
            raise KeyboardInterrupt
        return tracer

    dataset = ImageDataset(16, shape=(2,), dtype=np.int64)
    expected = [batch.tolist() for batch in reference_epoch(dataset, 2, False)]
    with ArenaLoader(dataset, batch_size=2, num_workers=2) as loader:
        iterator = iter(loader)
        got = [next(iterator).tolist()]
        sys.settrace(tracer)
        try:
            with pytest.raises(KeyboardInterrupt):
                next(iterator)
        finally:
            sys.settrace(None)
        assert not armed
        got.append(next(iterator).tolist())  # the stashed batch
        state = loader.state_dict()
        del iterator
    with ArenaLoader(dataset, batch_size=2, num_workers=2) as loader:
        loader.load_state_dict(state)
        got += [batch.tolist() for batch in loader]
    assert got == expected


def _interrupted(call, k):
    """``call()`` with KeyboardInterrupt injected at its k-th line of arena_loader code:
    (its result, False) or (None, True) when interrupted (the interrupt itself is not kept:
    its traceback would keep the call's frames alive)."""
    tracer = _InterruptAt(k)
    sys.settrace(tracer)
    try:
        return call(), False
    except KeyboardInterrupt:
        return None, True
    finally:
        sys.settrace(None)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("num_workers, persistent, threads, pin, device", [
    (0, False, 1, False, None), (2, False, 1, False, None), (2, True, 1, False, None),
    (2, False, 2, False, None), (0, False, 1, True, None), (2, True, 1, True, None),
    (0, False, 1, False, "cuda"), (2, True, 1, False, "cuda")])
def test_ctrl_c_at_any_line_of_next_iter_and_close_loses_nothing(num_workers, persistent,
                                                                  threads, pin, device):
    """KeyboardInterrupt injected at the k-th line of arena_loader code in next() (k = 1, 2,
    3, ... over successive calls, past the longest next()), in iter() and in close(), over
    several epochs: each epoch yields every batch once, in order; every slot is free after
    it; close() called again after an interrupted one leaves no worker alive. Run in a fresh
    interpreter: descriptors an interrupt leaves to the garbage collector must not reach the
    next tests' workers. ``threads``: worker_threads, each worker's threads sharing a batch.
    ``pin``: pin_memory=True (tensors; ``Tensor.pin_memory`` a copy): next() pins without
    workers, and takes the pin thread's copies with them. ``device``: the device stage,
    under numba's CUDA simulator."""
    _in_fresh_interpreter(
        f"_ctrl_c_matrix({num_workers}, {persistent}, {threads}, {pin}, {device!r})", 140,
        simulator=device is not None, torch=pin)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name, step", [("in_process", 1), ("workers", 4), ("persistent", 4)])
def test_ctrl_c_in_iter_after_load_state_dict_keeps_the_resumed_epoch(name, step):
    """After ``load_state_dict()``, KeyboardInterrupt injected in ``iter()`` at line 1, then
    (the user calls it again) at line 1 + step, 1 + 2 * step, ... past its last line: the
    iterator finally made yields the rest of the saved epoch, then the next epoch, loaded by
    the same workers with the same seeds as the uninterrupted run (the loaded state was
    dropped once iter() had drawn the workers' seed: a second iter() began a new epoch)."""
    _in_fresh_interpreter(f"_ctrl_c_in_resumed_iter({name!r}, {step})", 80, torch=True)


def _ctrl_c_in_resumed_iter(name, step):
    import torch

    from tests import resume_driver as driver

    torch.manual_seed(5)
    whole = driver.run_whole(name)
    torch.manual_seed(5)
    first, state = driver.run_and_stop(name, 2)
    assert first == whole[:2]
    with driver.make_loader(name) as loader:
        loader.load_state_dict(state)
        iterator, k = None, 1
        while iterator is None:  # iter() interrupted: the user calls it again
            iterator, _ = _interrupted(lambda: iter(loader), k)
            k += step
        got = [driver.rows(batch) for batch in iterator]
        del iterator
        got += [driver.rows(batch) for batch in loader]
    assert k > 100, k  # every line of iter() was a target (it runs over 100)
    assert got == whole[2:], (k, len(got), len(whole) - 2)
    assert wait_until(lambda: not live_children(), timeout_s=5), live_children()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("persistent", [False, True])
def test_ctrl_c_while_a_worker_is_forked_is_raised_not_lost(persistent):
    """A SIGINT that arrives while a worker is being forked (made to land in an at-fork hook,
    where Python swallows a KeyboardInterrupt) is raised by the loop all the same; the next
    epoch is whole and nothing outlives the loader. (Lost 4 of 80 real Ctrl-Cs before.)"""
    _in_fresh_interpreter(f"_ctrl_c_during_worker_fork({persistent})", 50)


def _ctrl_c_during_worker_fork(persistent):
    forks = []

    def interrupt_at_the_first_fork():  # (a hook for good: hence a fresh interpreter)
        forks.append(os.getpid())
        if len(forks) == 1:
            os.kill(os.getpid(), signal.SIGINT)

    os.register_at_fork(after_in_parent=interrupt_at_the_first_fork)
    expected = list(range(40))
    with ArenaLoader(_Indexed(), batch_size=2, num_workers=2, timeout=10,
                     persistent_workers=persistent) as loader:
        got = []
        try:
            for batch in loader:
                got.extend(int(row[0]) for row in batch)
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError(f"the Ctrl-C during a worker's fork was lost: got {got}")
        assert got == expected[:len(got)]
        for _ in range(2):
            assert [int(row[0]) for batch in loader for row in batch] == expected
    assert not live_children()


def _in_fresh_interpreter(call: str, timeout_s: float, simulator: bool = False,
                          torch: bool = False) -> None:
    """Run ``call`` (a function of this module) in a new interpreter (forked from a warm
    one: tests/zygote.py); it must return. ``simulator``: under numba's CUDA simulator.
    ``torch``: ``call`` imports torch. What is imported by then (numba's simulator, torch)
    is frozen out of the collector, as conftest does for the tests: a matrix's gc.collect()
    after each epoch or k then walks only what the loaders made, not torch's objects (~0.2 s
    a collection: most of a matrix's time)."""
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"} if simulator else None
    result = zygote.run(
        ["-c", f"import gc, tests.test_faults as t; gc.collect(); gc.freeze(); t.{call}; "
               "print('matrix ok')"],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=timeout_s,
        env=env, preload="sim" if simulator else "torch" if torch else "base")
    assert result.returncode == 0 and "matrix ok" in result.stdout, result.stderr[-3000:]


class _IndexedTensors(_Indexed):
    def __getitem__(self, i):
        import torch

        return torch.full((2,), i, dtype=torch.int64)


def _fake_pinning():
    """For a fresh interpreter: torch sees a GPU, and ``pin_memory()`` copies (in the main
    thread, or in the pin thread, where no Ctrl-C can land)."""
    import torch

    torch.cuda.is_available = lambda: True
    torch.Tensor.pin_memory = lambda tensor, device=None: tensor.clone()


def _ctrl_c_matrix(num_workers, persistent, threads=1, pin=False, device=None):
    expected = list(range(0, 40, 2))
    longest = 0  # lines of the longest next(): k must reach past it
    k = 0
    if pin:
        _fake_pinning()
    options = dict(batch_size=2, num_workers=num_workers, timeout=10 if num_workers else 0,
                   persistent_workers=persistent, worker_threads=threads, pin_memory=pin,
                   device=device)
    dataset = _IndexedTensors() if pin else _Indexed()
    with ArenaLoader(dataset, **options) as loader:
        for epoch in range(4):
            # After the abandoned epoch, iter() drains it: interrupted at every line of that,
            # from the first.
            step = 1 if persistent and epoch == 2 else 29
            iterator, iter_k = None, 1 if step == 1 else 1 + 13 * epoch
            while iterator is None:  # iter() interrupted: the user calls it again
                iterator, _ = _interrupted(lambda: iter(loader), iter_k)
                iter_k += step
            got = []
            # Persistent workers: epoch 1 is left after 5 batches, so the next iter() drains
            # batches still in flight (interrupted at its lines like any other iter()).
            stop_after = 5 if persistent and epoch == 1 else None
            while len(got) != stop_after:
                k += 1
                tracer = _InterruptAt(k)
                sys.settrace(tracer)
                try:
                    batch = next(iterator)
                except KeyboardInterrupt:
                    continue
                except StopIteration:
                    break
                finally:
                    sys.settrace(None)
                longest = max(longest, tracer.count)
                got.append(int(batch[0, 0]))
                del batch
            assert got == expected[:stop_after], (epoch, got)
            del iterator
            gc.collect()
            snapshot = loader.snapshot()
            if snapshot.slab_nbytes is not None and stop_after is None:
                assert snapshot.free_slots == loader.slots, (epoch, snapshot.slot_states)
        assert k > longest, (k, longest)  # every line of next() was a target at least once
    for close_k in (3, 9, 17, 40):  # each on a fresh loader whose workers run
        loader = ArenaLoader(dataset, **options)
        iterator = iter(loader)
        next(iterator)
        _, interrupted = _interrupted(loader.close, close_k)
        if not interrupted:
            loader.close()
            break
        loader.close()  # called again: it finishes the interrupted close
        del iterator
        assert wait_until(lambda: not live_children(), timeout_s=5), (close_k,
                                                                    live_children())


class _UserSampler:
    """A user's sampler (not one of ours): the loader groups its indices into batches."""

    def __init__(self, n: int):
        self.n, self.start = n, 0

    def __iter__(self):
        while self.start < self.n:
            self.start += 1
            yield self.start - 1
        self.start = 0

    def __len__(self):
        return self.n


class _PositionSampler(_UserSampler):
    """A sampler that states its own position (torchdata's Stateful, no set_epoch): the
    loader records its state after each batch drawn, in Python, beside the draw."""

    def state_dict(self):
        return {"start": self.start}

    def load_state_dict(self, state):
        self.start = state["start"]


@pytest.mark.timeout(170)
@pytest.mark.parametrize("persistent, pin, device, step", [
    (True, True, None, 5), (True, False, "cuda", 3),
    # every k (44, 23, 17 s on the 2-core machine), and pinning without persistent workers
    # (the same lines of next()): --runslow
    pytest.param(False, True, None, 11, marks=pytest.mark.slow),
    pytest.param(True, True, None, 1, marks=pytest.mark.slow),
    pytest.param(False, True, None, 1, marks=pytest.mark.slow),
    pytest.param(True, False, "cuda", 1, marks=pytest.mark.slow)])
def test_ctrl_c_at_any_line_of_a_staged_next_loses_nothing(persistent, pin, device, step):
    """pin_memory or device with workers: every next() of an epoch interrupted at its k-th
    line of arena_loader code, for every ``step``-th k until an epoch's next() calls are all
    shorter (every k with --runslow). The matrix above interrupts each call once at a k that
    grows by one per call, so k is past the first next() (the stage's start, the workers')
    before the steady calls come, and the lines those run in the main thread (the stage's
    next_batch, the host window's refill from the consumer, TopUp.refill) were never a
    target. Each epoch yields every batch once, in order, with every slot free after it.
    Fresh interpreter."""
    _in_fresh_interpreter(
        f"_ctrl_c_staged_matrix({persistent}, {pin}, {device!r}, {step})", 160,
        simulator=device is not None, torch=pin)


def _ctrl_c_staged_matrix(persistent, pin, device, step):
    expected = list(range(0, 40, 2))
    if pin:
        _fake_pinning()
    dataset = _IndexedTensors() if pin else _Indexed()
    with ArenaLoader(dataset, batch_size=2, num_workers=2, timeout=10,
                     persistent_workers=persistent, pin_memory=pin, device=device) as loader:
        k, interrupts = 0, 1
        while interrupts:  # the last epoch: no next() reached its k-th line
            k += step
            assert k < 2000, "a next() of over 2000 lines, or one interrupted for good"
            got, interrupts = _every_next_interrupted_at(loader, k, len(expected))
            assert got == expected, (k, interrupts, got)
            gc.collect()
            snapshot = loader.snapshot()
            if snapshot.slab_nbytes is not None:
                assert snapshot.free_slots == loader.slots, (k, snapshot.slot_states)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("sampler", [None, _UserSampler, _PositionSampler])
def test_ctrl_c_at_any_line_of_next_loses_no_batch(num_workers, sampler):
    """KeyboardInterrupt injected at the k-th line of arena_loader code in each next() (for
    many k): every interrupt reaches the caller, and the epoch still yields every batch
    exactly once, in order, with no hang. Also with a user's sampler, whose indices the
    loader groups into batches, and one whose state it records per batch drawn (a Stateful
    one): an interrupt in the grouping ended the epoch there, silently, and one in the
    recording lost the batch drawn."""
    expected = list(range(0, 40, 2))
    for k in range(1, 60, 4):
        with ArenaLoader(_Indexed(), batch_size=2, num_workers=num_workers,
                         sampler=sampler(40) if sampler is not None else None,
                         timeout=10 if num_workers else 0) as loader:
            got, interrupts = _every_next_interrupted_at(loader, k, len(expected))
        assert got == expected, (k, interrupts, got)


def _every_next_interrupted_at(loader, k, batches):
    """One epoch of ``loader``, each ``next()`` interrupted at its k-th line of arena_loader
    code (and called again): (each batch's first value, how many interrupts)."""
    iterator, got, interrupts = iter(loader), [], 0
    tracer = _InterruptAt(k)
    while len(got) <= batches:
        sys.settrace(tracer)
        try:
            batch = next(iterator)
        except KeyboardInterrupt:
            interrupts += 1
            continue
        except StopIteration:
            break
        finally:
            sys.settrace(None)
        got.append(int(batch[0, 0]))
        del batch
        tracer.count, tracer.armed = 0, True
    return got, interrupts


class _FailsAt13(_Indexed):
    def __len__(self):
        return 20  # 10 batches: every next() of an epoch is interrupted, so time goes as len

    def __getitem__(self, i):
        if i == 13:
            raise ValueError("sample 13 is broken")
        return np.full(2, i, dtype=np.int64)


@pytest.mark.timeout(170)
@pytest.mark.parametrize("num_workers, persistent, threads", [
    (0, False, 1), (2, True, 1), (2, False, 1), (2, True, 2)])
def test_ctrl_c_at_any_line_of_next_loses_no_batch_error(num_workers, persistent, threads):
    """Every next() interrupted once at its k-th line of arena_loader code, for every k up to
    past the longest next(), while one batch fails (sample 13): each epoch still yields every
    other batch once, in order, and the failed batch's error exactly once, in its place
    (an interrupt while the error is on its way out must not swallow it; nor one while a
    batch stashed by an earlier interrupt is handed out), and a state_dict() after each
    counts what came out, the error too, once. Fresh interpreter, as above."""
    # Without persistent workers each k starts workers: every third line (the lines of
    # next() itself are every one's target with persistent workers). The two persistent
    # cases run the same next() in the main process (threads differ in the workers only):
    # one takes the odd lines, the other the even ones.
    step, first = (3, 1) if num_workers and not persistent else (2, threads) if persistent \
        else (1, 1)
    _in_fresh_interpreter(
        f"_ctrl_c_error_matrix({num_workers}, {persistent}, {threads}, {step}, {first})", 160)


def _ctrl_c_error_matrix(num_workers, persistent=False, threads=1, step=1, first=1):
    expected = [i if i != 12 else "ValueError" for i in range(0, 20, 2)]
    longest, k = 0, first - step
    with ArenaLoader(_FailsAt13(), batch_size=2, num_workers=num_workers,
                     timeout=10 if num_workers else 0,
                     persistent_workers=persistent, worker_threads=threads) as loader:
        while k <= longest + 3:
            k += step
            tracer = _InterruptAt(k)
            got, iterator = [], iter(loader)
            while True:
                sys.settrace(tracer)
                try:
                    batch = next(iterator)
                    outcome = int(batch[0, 0])
                    del batch
                except KeyboardInterrupt:
                    continue  # the user goes on; the next call runs uninterrupted
                except StopIteration:
                    break
                except ValueError as exc:
                    assert "sample 13 is broken" in str(exc), exc
                    outcome = "ValueError"
                finally:
                    sys.settrace(None)
                longest = max(longest, tracer.count)
                got.append(outcome)
                # The error counts as its batch: a state_dict() now resumes after it.
                assert loader.state_dict()["batches_yielded"] == len(got), (k, got)
                tracer.count, tracer.armed = 0, True
            assert got == expected, (k, got)
            del iterator
            gc.collect()
            snapshot = loader.snapshot()
            if snapshot.slab_nbytes is not None:
                assert snapshot.free_slots == loader.slots, (k, snapshot.slot_states)


def test_a_worker_that_dies_while_next_waits_on_another_is_reported_at_once():
    """next() in order waits on the worker that owes its batch only (another's record would
    wake it for nothing), but every worker's exit still wakes it: worker 1 killed while
    worker 0 is 20 s into batch 0 is reported at once, as torch reports it, not after."""
    dataset = SlowDataset(16, slow_indices={0}, delay_s=20.0)
    loader = ArenaLoader(dataset, batch_size=2, num_workers=2)
    iterator = iter(loader)
    victim = loader.snapshot().iterators[0].worker_pids[1]
    killer = threading.Timer(0.5, os.kill, (victim, signal.SIGKILL))
    killer.start()
    start = time.monotonic()
    with pytest.raises(WorkerCrashedError, match=rf"worker 1 \(pid {victim}\) was killed by "
                                                 "SIGKILL"):
        next(iterator)
    assert time.monotonic() - start < 5.0
    killer.join()
    dataset.release()  # (close() then need not wait for worker 0's join timeout)
    loader.close()
    del iterator
    assert not live_children() and not our_slab_mappings()


class _Stream:
    """An iterable-style dataset of ``n`` samples. With ``interrupt_at``, its iterator raises
    KeyboardInterrupt once, just before reading that sample (a Ctrl-C inside the dataset's
    own read, which reads a sample whole or not at all)."""

    def __init__(self, n: int, interrupt_at: int | None = None):
        self.n, self.interrupt_at = n, interrupt_at

    def __iter__(self):
        return _StreamIterator(self.n, self.interrupt_at)


class _StreamIterator:
    def __init__(self, n, interrupt_at):
        self.n, self.position, self.interrupt_at = n, 0, interrupt_at

    def __next__(self):
        if self.position == self.interrupt_at:
            self.interrupt_at = None
            raise KeyboardInterrupt
        if self.position == self.n:
            raise StopIteration
        self.position += 1
        return np.full(2, self.position - 1, dtype=np.int64)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("batch_size, n", [(3, 40), (None, 13)])
def test_ctrl_c_in_next_loses_no_sample_of_an_iterable_dataset(batch_size, n):
    """Found by a chaos soak (seed 203): with num_workers=0 and an iterable-style dataset, a
    Ctrl-C after the batch's samples were read from the stream, before the batch was kept
    (e.g. while its sample positions were listed), lost the whole batch; one inside the
    dataset's own read lost the samples read before it in that batch. Now KeyboardInterrupt
    at the k-th line of arena_loader code in each next() (for every k past the longest
    next()), or in the stream's own read of any sample: the epoch still yields every sample
    once, in order, in batches of ``batch_size`` (the last one short). Without batching, a
    stream of 13 samples (the first next(), steady ones, the last and the end; 40 made it
    the suite's longest test, each k an epoch of 40 next() calls)."""
    rows = batch_size or 1
    expected = [list(range(s, min(s + rows, n))) for s in range(0, n, rows)]

    def epoch(dataset, k):
        with ArenaLoader(dataset, batch_size=batch_size, num_workers=0) as loader:
            iterator, got, tracer = iter(loader), [], _InterruptAt(k)
            longest = 0
            while len(got) <= len(expected):
                sys.settrace(tracer)
                try:
                    batch = next(iterator)
                except KeyboardInterrupt:
                    continue
                except StopIteration:
                    break
                finally:
                    sys.settrace(None)
                longest = max(longest, tracer.count)
                got.append(np.asarray(batch).reshape(-1, 2)[:, 0].tolist())
                tracer.count, tracer.armed = 0, True
                del batch
            del iterator
        return got, longest

    k, longest = 0, 1
    while k <= longest:
        k += 1
        got, longest_now = epoch(_Stream(n), k)
        longest = max(longest, longest_now)
        assert got == expected, (k, got)
    for at in (0, 1, 2, 7, n - 1, n):
        got, _ = epoch(_Stream(n, interrupt_at=at), 10_000)
        assert got == expected, (at, got)


class _SignallingBatches:
    """A batch_sampler in C alone: every ``every``-th draw sends this process a real SIGINT
    from C (libc's kill, which unlike os.kill does not handle it), so CPython raises the
    KeyboardInterrupt where it next looks for signals: as the draw returns to our code."""

    batch_size = 4

    def __init__(self, n: int, every: int):
        import ctypes
        import itertools

        self.batches = [list(range(i, min(i + 4, n))) for i in range(0, n, 4)]
        self.signals = map(ctypes.CDLL(None).kill, itertools.repeat(os.getpid()),
                           itertools.cycle([0] * (every - 1) + [int(signal.SIGINT)]))

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        import operator

        return map(operator.itemgetter(0), zip(self.batches, self.signals))


def _ctrl_c_as_the_sampler_returns(num_workers):
    loader = ArenaLoader(_Indexed(), batch_sampler=_SignallingBatches(40, every=7),
                         num_workers=num_workers)
    got, interrupts = [], 0
    for _ in range(2):
        iterator = None
        while iterator is None:
            try:
                iterator = iter(loader)
            except KeyboardInterrupt:
                interrupts += 1
        while True:
            try:
                batch = next(iterator)
            except KeyboardInterrupt:
                interrupts += 1
                continue
            except StopIteration:
                break
            got.extend(int(row[0]) for row in batch)
    loader.close()
    assert interrupts >= 2 and got == list(range(40)) * 2, (interrupts, got)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_ctrl_c_as_the_sampler_returns_a_batch_loses_none(num_workers):
    """A real SIGINT that CPython handles just as the batch sampler's next() returns (it looks
    for signals after every call into C) keeps the batch just drawn: the next next() hands
    it out, and both epochs give every sample once, in order. (Fresh interpreter: the
    signals are real.)"""
    _in_fresh_interpreter(f"_ctrl_c_as_the_sampler_returns({num_workers})", timeout_s=50)


def _first_rows_under_profile(iterator, make_profiler, install=sys.setprofile,
                              errors: tuple = ()) -> list:
    """Each batch's first value over the rest of ``iterator``'s epoch, every ``next()`` run
    under the profile function ``make_profiler()`` gave (a new one after each batch; after
    an interrupt the user calls ``next()`` again, under the same one); ``install``:
    ``sys.settrace`` for a trace function; a batch's error of a type in ``errors`` is
    recorded by its type's name, in the batch's place."""
    got, profiler = [], make_profiler()
    while True:
        install(profiler)
        try:
            batch = iterator.__next__()
        except KeyboardInterrupt:
            continue
        except StopIteration:
            return got
        except errors as exc:
            batch = type(exc).__name__
        finally:
            install(None)
        got.append(batch if isinstance(batch, str) else int(batch[0, 0]))
        profiler = make_profiler()
        del batch


class _InterruptAtCReturn:
    """A profile function raising KeyboardInterrupt as the k-th call into C that next()'s
    hand-out frames make returns: where CPython itself handles a real signal (a trace
    function's line events cannot land there)."""

    FRAMES = ("__next__", "next_batch")

    def __init__(self, k: int):
        self.k, self.count, self.armed = k, 0, True

    def __call__(self, frame, event, arg):
        if event == "c_return" and self.armed and frame.f_code.co_name in self.FRAMES \
                and "arena_loader" in frame.f_code.co_filename:
            self.count += 1
            if self.count == self.k:
                self.armed = False
                raise KeyboardInterrupt


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_ctrl_c_as_next_hands_out_its_batch_loses_none(num_workers):
    """KeyboardInterrupt raised as each call into C of next()'s last lines returns (the
    stash's pop, the lock's exit): the batch is the next next()'s. (A pop there lost it: the
    chaos soak's seed 676, one batch of an epoch.)"""
    expected = list(range(0, 40, 2))
    with ArenaLoader(_Indexed(), batch_size=2, num_workers=num_workers) as loader:
        for k in range(1, 6):
            iterator = iter(loader)
            got = _first_rows_under_profile(iterator, functools.partial(_InterruptAtCReturn, k))
            assert got == expected, (k, got)
            del iterator


class _IndexedWithABadOne(_Indexed):
    def __getitem__(self, i):
        if i == 10:
            raise ValueError("sample 10 is bad")
        return super().__getitem__(i)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_ctrl_c_as_next_raises_a_batchs_error_loses_neither(num_workers):
    """KeyboardInterrupt raised as each call into C of next()'s last lines returns, when the
    batch is an error: the error is raised once, by this next() or the next one, and the
    batches around it come in order. (Raised by the stash's pop, an interrupt as the pop
    returned lost the error: the next next() went on with the batch after it.)"""
    expected = [*range(0, 10, 2), "ValueError", *range(12, 40, 2)]
    with ArenaLoader(_IndexedWithABadOne(), batch_size=2, num_workers=num_workers) as loader:
        for k in range(1, 6):
            iterator = iter(loader)
            got = _first_rows_under_profile(iterator, functools.partial(_InterruptAtCReturn, k),
                                            errors=(ValueError,))
            assert got == expected, (k, got)
            del iterator


class _InterruptAsADescriptorArrives:
    """A profile function raising KeyboardInterrupt once, as the call that takes a segment's
    descriptor off a worker's socket returns (where CPython handles a real signal)."""

    def __init__(self):
        self.fired = False

    def __call__(self, frame, event, arg):
        if event == "c_return" and not self.fired \
                and getattr(arg, "__name__", "") in ("recvmsg", "extend") \
                and frame.f_code.co_name in ("receive", "recv_fds"):
            self.fired = True
            raise KeyboardInterrupt


@pytest.mark.timeout(30)
@pytest.mark.parametrize("worker_mode", ["process", "thread"])
def test_a_ctrl_c_as_a_segment_descriptor_arrives_loses_no_batch(worker_mode):
    """The first batches travel in one-off segments, their descriptors over a socket: a
    KeyboardInterrupt as one is taken off it keeps the descriptor (a signal handled as
    recvmsg returned inside socket.recv_fds dropped it, and the next next() waited for it
    forever: chaos seed 1186), and the epoch gives every batch once, in order."""
    with ArenaLoader(_Indexed(), batch_size=2, num_workers=2, worker_mode=worker_mode,
                     timeout=10) as loader:
        iterator, profiler = iter(loader), _InterruptAsADescriptorArrives()
        got = _first_rows_under_profile(iterator, lambda: profiler)
        del iterator
    assert profiler.fired and got == list(range(0, 40, 2))


class _InterruptInTheDraw:
    """Raises KeyboardInterrupt once, at the k-th ``event`` in the sampler's code
    (``samplers.py``, ``_epoch_batches.py``): ``"c_return"`` as a profile function (a call into
    C returning, where CPython handles a real signal), ``"line"`` as a trace function."""

    def __init__(self, k: int, event: str):
        self.k, self.event, self.count, self.fired = k, event, 0, False

    def __call__(self, frame, event, arg):
        name = frame.f_code.co_filename
        if event == self.event and not self.fired \
                and name.endswith(("samplers.py", "_epoch_batches.py")):
            self.count += 1
            if self.count == self.k:
                self.fired = True
                raise KeyboardInterrupt
        return self


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("event", ["c_return", "line"])
def test_a_ctrl_c_in_a_torch_generators_draw_loses_no_batch(num_workers, event):
    """shuffle=True with the caller's torch.Generator: the sampler draws torch's chunks as
    torch does, as the epoch reaches them (inside next()). A KeyboardInterrupt anywhere in
    that code leaves the epoch whole: every batch once, in torch's order, and the generator
    where torch leaves it. (Drawn by generators, an interrupt finished them and the rest of
    the epoch was lost, silently: chaos seeds 702422293 and 83118498.)"""
    import torch

    def epoch_of(loader_class, generator, **options):
        return [int(b[0, 0]) for b in loader_class(_Indexed(), batch_size=2, shuffle=True,
                                                 generator=generator, **options)]

    reference = torch.Generator().manual_seed(7)
    expected = epoch_of(torch.utils.data.DataLoader, reference)
    install = sys.setprofile if event == "c_return" else sys.settrace
    fired = 0
    for k in range(1, 13, 2):
        generator = torch.Generator().manual_seed(7)
        hook = _InterruptInTheDraw(k, event)
        with ArenaLoader(_Indexed(), batch_size=2, shuffle=True, generator=generator,
                         num_workers=num_workers, timeout=10 if num_workers else 0) as loader:
            iterator = iter(loader)
            got = _first_rows_under_profile(iterator, lambda hook=hook: hook, install)
            del iterator
        fired += hook.fired
        assert got == expected, (k, got)
        assert torch.equal(generator.get_state(), reference.get_state()), k
    assert fired >= 3, fired


class _ColumnsDataset(ImageDataset):
    """__getitems__ returning one dict of columns (an Arrow/pandas-style batched read)."""

    def __getitems__(self, indices):
        return {"x": np.stack([self[i] for i in indices]), "a": indices, "b": indices,
                "c": indices}


class _GeneratorDataset(ImageDataset):
    def __getitems__(self, indices):
        return (self[i] for i in indices)


@pytest.mark.parametrize("num_workers", [0, 1])
@pytest.mark.parametrize("batch_size", [3, 4])
def test_getitems_returning_a_dict_of_columns_is_named(num_workers, batch_size):
    """A dict from __getitems__ under default collation is named with the fix (a collate_fn),
    also when it happens to have one key per index (it raised a bare KeyError: 0 then, as
    torch's default_collate does)."""
    with ArenaLoader(_ColumnsDataset(8), batch_size=batch_size,
                     num_workers=num_workers) as loader:
        with pytest.raises(TypeError, match=r"__getitems__ returned a dict \(keys \['x', 'a', "
                                            r"'b', 'c'\]\).*pass a collate_fn") as info:
            list(loader)
    assert isinstance(info.value, ValueError)  # as the wrong-count error, caught as before


@pytest.mark.parametrize("num_workers", [0, 1])
def test_getitems_returning_a_generator_is_named(num_workers):
    """A generator from __getitems__ is a TypeError (as torch's) that names __getitems__."""
    with ArenaLoader(_GeneratorDataset(6), batch_size=3, num_workers=num_workers) as loader:
        with pytest.raises(TypeError, match=r"__getitems__ returned a generator.*list of samples"):
            list(loader)


GC_SIGNAL_SCRIPT = """
import gc, signal, sys, time
import arena_loader  # registers its gc callbacks
swallowed = []
sys.unraisablehook = lambda unraisable: swallowed.append(unraisable.exc_type)
class Tick(Exception):
    pass
def on_alarm(*_):
    raise Tick
signal.signal(signal.SIGALRM, on_alarm)
heap = [(i, [i]) for i in range(150_000)]  # each collection takes milliseconds
raised = 0
for _ in range(15):
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.0005)  # once, inside the collection
        gc.collect()
        time.sleep(1)  # (a collection shorter than that: the signal ends this sleep)
    except Tick:
        raised += 1
print(raised, len(swallowed))
"""


@pytest.mark.timeout(60)
def test_a_signal_that_arrives_during_a_garbage_collection_is_not_swallowed():
    """A signal handled at a Python gc callback raises inside it, and gc swallows what a
    callback raises: with such a callback of ours, nearly every Ctrl-C pressed during a
    collection was ignored in any program that imported arena_loader. Here a timer's handler
    raises in each of 15 collections of a large heap: each raise must reach the loop."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", GC_SIGNAL_SCRIPT], capture_output=True,
                          text=True, timeout=50)
    assert done.returncode == 0, done.stderr[-2000:]
    raised, swallowed = map(int, done.stdout.split())
    assert (raised, swallowed) == (15, 0)


LOOP_SIGNAL_SCRIPT = """
import signal, sys, time
import numpy as np
from arena_loader import ArenaLoader
swallowed, armed, fired = [], [False], [0]
sys.unraisablehook = lambda unraisable: swallowed.append(repr(unraisable.object)[:80])
def on_alarm(*_):
    if armed[0]:  # one interrupt per arming: the loop below re-arms after each batch
        armed[0] = False
        fired[0] += 1
        raise KeyboardInterrupt
loader = ArenaLoader(np.arange(2**21, dtype=np.float32).reshape(-1, 4), batch_size=8)
it = iter(loader)
seen = [next(it)[0, 0]]  # (the slab is made: the loop below is the per-batch path)
signal.signal(signal.SIGALRM, on_alarm)
caught, end = 0, time.monotonic() + 1.5
signal.setitimer(signal.ITIMER_REAL, 0.0003, 0.0003)
while True:
    try:
        armed[0] = True
        for batch in it:  # (next(it) would lose one: an interrupt as next() returns)
            seen.append(batch[0, 0])  # (no call between the batch's arrival and this)
            armed[0] = True
            if time.monotonic() > end:
                break
        armed[0] = False
        break
    except KeyboardInterrupt:
        caught += 1
signal.setitimer(signal.ITIMER_REAL, 0)
order = [int(v) // 32 for v in seen]
print(fired[0], caught, len(seen), order == list(range(len(order))), swallowed[:3])
"""


@pytest.mark.timeout(60)
def test_ctrl_cs_between_batches_all_reach_the_loop():
    """Every batch's death ran a Python weak-reference callback of ours (the fork registry's):
    a Ctrl-C that arrived just before was raised inside it, and swallowed (one in 25 in a
    tight loop). Here a timer raises KeyboardInterrupt every 0.3 ms for 1.5 s of tiny
    batches (num_workers=0, one epoch): each reaches the loop, no batch is lost or repeated."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", LOOP_SIGNAL_SCRIPT], capture_output=True,
                          text=True, timeout=50)
    assert done.returncode == 0, done.stderr[-2000:]
    fired, caught, batches, in_order, swallowed = done.stdout.split(maxsplit=4)
    assert int(fired) > 500 and int(batches) > 500, done.stdout
    assert (int(caught), in_order, swallowed.strip()) == (int(fired), "True", "[]"), done.stdout


def test_a_finalizers_ctrl_c_that_cannot_be_sent_again_leaves_the_handler_as_it_was(monkeypatch):
    """No thread for the re-send (``Thread.start`` refuses at interpreter exit): the error
    goes up, and SIGINT's handler is the program's again, not the one that only records."""
    from arena_loader import _forksafe

    def no_thread():
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(_forksafe, "redeliver", no_thread)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(RuntimeError, match="new thread"):
        with _forksafe.interrupts_deferred(in_finalizer=True):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.timeout(60)
def test_a_ctrl_c_while_a_dropped_iterator_joins_its_workers_reaches_the_program(monkeypatch):
    """`it = iter(loader)` in a loop (a notebook cell) drops the old iterator, whose finalizer
    joins its workers for tens of ms: a Ctrl-C then (the kernel's interrupt button) was raised
    inside the finalizer and swallowed ("Exception ignored in: <finalize object>"), so the loop
    went on and the cell hung until a second interrupt (trial24). It reaches the program once
    the workers are down and the finalizer has returned, and the loader goes on with whole
    epochs."""
    from arena_loader._process import WorkerGroup

    original = WorkerGroup.shutdown

    def interrupted(self, graceful=True):
        signal.raise_signal(signal.SIGINT)  # the Ctrl-C, as the finalizer joins the workers
        return original(self, graceful)

    loader = ArenaLoader(ImageDataset(16), batch_size=4, num_workers=2)
    it = iter(loader)
    next(it)
    monkeypatch.setattr(WorkerGroup, "shutdown", interrupted)
    caught = 0
    start = time.monotonic()
    try:
        it = None  # the finalizer runs here; the Ctrl-C comes once it has returned,
        time.sleep(5)  # and interrupts a wait already begun, as a Ctrl-C does
    except KeyboardInterrupt:
        caught += 1
    waited = time.monotonic() - start
    monkeypatch.undo()
    assert caught == 1 and waited < 2, waited
    assert wait_until(lambda: not live_children())
    expected = reference_epoch(ImageDataset(16), 4, False)
    got = list(loader)
    assert len(got) == len(expected) and all(np.array_equal(a, b) for a, b in zip(got, expected))
    del got
    loader.close()


@pytest.mark.timeout(60)
def test_a_finalizers_ctrl_c_reaches_the_program_however_late_the_finalizer_returns(monkeypatch):
    """The Ctrl-C held during a dropped iterator's finalizer is sent again only once the
    finalizer has returned, however long the main thread takes to get there. It was sent a
    fixed 1 ms after the re-send's thread started: a main thread descheduled for longer (a
    busy machine) got it while the handler that only records was still in place, or inside
    the finalizer, and it was lost (the test above failed in 4 of 8 full runs on the 2-core
    machine with other work on it). Here the main thread stops 50 ms after starting it,
    still in the finalizer."""
    from arena_loader import _forksafe
    from arena_loader._process import WorkerGroup

    original, resend = WorkerGroup.shutdown, _forksafe.redeliver

    def interrupted(self, graceful=True):
        signal.raise_signal(signal.SIGINT)
        return original(self, graceful)

    def descheduled(slept=[]):  # noqa: B006 (once: the finalizer's first re-send)
        resend()
        if not slept:
            slept.append(True)
            time.sleep(0.05)

    loader = ArenaLoader(ImageDataset(16), batch_size=4, num_workers=2)
    it = iter(loader)
    next(it)
    monkeypatch.setattr(WorkerGroup, "shutdown", interrupted)
    monkeypatch.setattr(_forksafe, "redeliver", descheduled)
    caught = 0
    start = time.monotonic()
    try:
        it = None
        time.sleep(5)
    except KeyboardInterrupt:
        caught += 1
    waited = time.monotonic() - start
    monkeypatch.undo()
    loader.close()
    assert caught == 1 and waited < 2, waited


def _interrupt_sweep():
    """benchmarks/interrupt_sweep.py (its harness: a KeyboardInterrupt as the k-th call into C
    of an arena_loader frame returns), loaded by path."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "interrupt_sweep.py"
    spec = importlib.util.spec_from_file_location("interrupt_sweep", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers, in_order, step, every_next", [
    (0, True, 1, False), (0, True, 1, True), (2, True, 7, False), (2, False, 7, False)])
def test_a_ctrl_c_at_any_call_into_c_loses_no_batch_and_strands_no_slot(
        num_workers, in_order, step, every_next):
    """KeyboardInterrupts at the k-th C return of an epoch (or of each next()), for every k
    (every 7th with workers, whose epochs make ~1,000), anywhere in arena_loader's frames:
    every batch once (in order with in_order), and every slot free after the epoch. Found by
    this sweep: the Reorderer's ``done.pop`` returning lost the batch (the epoch waited for
    it); records an interrupt left unparsed or unfiled in the reader were reported by no poll
    (in_order=False waited for good); with num_workers=0 a slot taken as the interrupt came
    stayed ASSIGNED (every later batch in a one-off segment)."""
    sweep, expected = _interrupt_sweep(), list(range(0, 40, 2))
    k, count = 0, 1
    with ArenaLoader(sweep.Indexed(), batch_size=2, num_workers=num_workers, in_order=in_order,
                     persistent_workers=num_workers > 0, timeout=5 if num_workers else 0) \
            as loader:
        while k < count:
            k += step
            for _ in range(2 if every_next else 1):
                got, count, _ = sweep.epoch(loader, k, every_next)
                assert (got if in_order else sorted(got)) == expected, (k, got)
                snapshot = loader.snapshot()
                if snapshot.free_slots != loader.slots:  # (a collection costs ~50 ms here)
                    gc.collect()
                    snapshot = loader.snapshot()
                assert snapshot.free_slots == loader.slots, (k, snapshot.slot_states)
    assert k > (30 if every_next else 300), k  # (every C return of an epoch or next())
