"""Zero copy, slot reuse and the slots-exhausted error."""

from __future__ import annotations

import gc
import time
import warnings

import numpy as np
import pytest

from arena_loader import ArenaLoader, SlotsExhaustedError, get_worker_info
from arena_loader._pool import SlotLease

from .datasets import ImageDataset, assert_epoch_equal, reference_epoch

pytestmark = pytest.mark.timeout(60)


def lease_of(array: np.ndarray) -> SlotLease:
    """Walk the base chain of a batch view down to the lease that owns its slot."""
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, SlotLease), f"base chain ends in {type(base)}"
    return base


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_are_views_into_the_slab(num_workers):
    """Yielded arrays share memory with the slab and are based on a slot lease (from the
    second epoch; the first batches of the first, loaded before the slab is sized by them,
    are in segments of their own)."""
    dataset = ImageDataset(12, shape=(4, 4), dtype=np.float32)
    with ArenaLoader(dataset, batch_size=4, num_workers=num_workers) as loader:
        assert sum(1 for _ in loader) == 3
        count = 0
        for batch in loader:
            count += 1
            snapshot = loader.snapshot()
            lease = lease_of(batch)
            start = lease.slot * snapshot.slot_nbytes
            assert batch.__array_interface__["data"][0] == snapshot.slab_address + start
            assert start + batch.nbytes <= snapshot.slab_nbytes
        assert count == 3
        del batch


def test_result_messages_carry_no_array_bytes():
    """Each worker message is tiny next to the batch it announces: arrays never travel."""
    dataset = ImageDataset(64, shape=(3, 32, 32), dtype=np.uint8)  # 3 KB a sample
    with ArenaLoader(dataset, batch_size=16, num_workers=2) as loader:
        iterator = iter(loader)
        batches = 0
        for batch in iterator:
            assert batch.nbytes == 16 * 3 * 32 * 32
            batches += 1
        stats = iterator.stats
    assert stats["results_received"] == batches == 4
    assert stats["result_bytes"] / stats["results_received"] < 512  # vs 49,152 array bytes


@pytest.mark.parametrize("num_workers, worker_mode", [(0, "process"), (2, "process"),
                                                      (2, "thread")])
def test_held_batches_keep_their_contents_while_iteration_continues(num_workers, worker_mode):
    """Batches kept by the consumer are never overwritten by later batches."""
    dataset = ImageDataset(40, shape=(6,), dtype=np.int64)
    expected = reference_epoch(dataset, 2, False)
    with ArenaLoader(dataset, batch_size=2, num_workers=num_workers, slots=8,
                     worker_mode=worker_mode) as loader:
        kept = {}
        for i, batch in enumerate(loader):
            if i % 5 == 0:  # keep every fifth batch: 4 held at most, the rest recycle
                kept[i] = batch
            for j, held in kept.items():
                np.testing.assert_array_equal(held, expected[j], err_msg=f"held batch {j}")
        assert len(kept) == 4
        del kept, batch


@pytest.mark.parametrize("num_workers, persistent, worker_mode", [
    (0, False, "process"), (1, False, "process"), (1, True, "process"), (2, False, "process"),
    (3, False, "process"), (3, True, "process"), (2, False, "thread"), (2, True, "thread")])
def test_held_batch_limit_raises_and_names_itself(num_workers, persistent, worker_mode):
    """Keeping `held_batch_limit` batches alive makes the next next() raise, not hang; freeing
    resumes. Persistent workers are checked in their second epoch (the reset path)."""
    dataset = ImageDataset(30, shape=(2,), dtype=np.int64)
    limit = 2 * num_workers + 2 if num_workers else 3
    with ArenaLoader(dataset, batch_size=2, num_workers=num_workers, held_batch_limit=limit,
                     prefetch_factor=2 if num_workers else None,
                     persistent_workers=persistent, worker_mode=worker_mode) as loader:
        if persistent:
            assert sum(1 for _ in loader) == 15
        iterator = iter(loader)
        held = [next(iterator) for _ in range(limit)]
        start = time.monotonic()
        with pytest.raises(SlotsExhaustedError, match=rf"holds {limit} batches.*"
                                                      rf"held_batch_limit={limit}"):
            next(iterator)
        assert time.monotonic() - start < 1.0
        # No batch was lost: after dropping one, iteration resumes where it stopped.
        del held[0]
        following = next(iterator)
        np.testing.assert_array_equal(following, reference_epoch(dataset, 2, False)[limit])
        del held, following, iterator


def test_batches_in_reference_cycles_are_collected_before_raising():
    """A batch reachable only through a garbage cycle does not count as held."""
    dataset = ImageDataset(10, shape=(2,), dtype=np.int64)
    with ArenaLoader(dataset, batch_size=1, held_batch_limit=2) as loader:
        gc.disable()
        try:
            for batch in loader:
                cycle: list = [batch]
                cycle.append(cycle)  # only the garbage collector can free this batch
                del cycle
        finally:
            gc.enable()
        del batch


def test_batch_outlives_closed_loader_with_valid_data():
    """A batch kept after close() still reads the right values (the mapping stays)."""
    dataset = ImageDataset(8, shape=(3,), dtype=np.int64)
    loader = ArenaLoader(dataset, batch_size=4, num_workers=2)
    first = next(iter(loader))
    loader.close()
    gc.collect()
    np.testing.assert_array_equal(first, reference_epoch(dataset, 4, False)[0])
    first += 1  # still writable memory, not unmapped
    del first


class _GrowingRows:
    """12 samples; those of the last batch (batch_size 4) are 8 times wider than the rest,
    whose batches fill one page."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return np.full(1024 if i >= 8 else 128, i, dtype=np.float64)


def _in_slab(batch, snapshot) -> bool:
    start = snapshot.slab_address
    return start <= batch.ctypes.data < start + snapshot.slab_nbytes


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers, persistent", [(0, False), (2, False), (2, True)])
def test_slab_grows_once_when_a_batch_outgrows_its_slot(num_workers, persistent):
    """Slots are the first batch's size (page-rounded); a larger batch goes to a segment, and
    the next epoch's slab fits it (grown once, with headroom): every batch is then in a slot."""
    with ArenaLoader(_GrowingRows(), batch_size=4, num_workers=num_workers,
                     persistent_workers=persistent, output="numpy") as loader:
        def epoch():  # per batch: a copy, whether it was in a slot, the slot size
            seen = []
            for batch in loader:
                snapshot = loader.snapshot()
                seen.append((batch.copy(), _in_slab(batch, snapshot), snapshot.slot_nbytes))
                slabs.add((snapshot.slab_address, snapshot.slot_nbytes))
                del batch
            return seen

        slabs: set = set()
        first = epoch()
        assert first[-1][2] == 4096  # 4 x 128 float64: one page, no headroom
        # (With workers, the first batches may come before the slab is sized: segments.)
        assert [in_slab for _, in_slab, _ in first][num_workers:] == [True, True, False][
            num_workers:]
        largest = max(batch.nbytes for batch, _, _ in first)
        slabs.clear()
        for _ in range(2):
            again = epoch()
            for (batch, in_slab, slot_nbytes), (expected, _, _) in zip(again, first, strict=True):
                np.testing.assert_array_equal(batch, expected)
                assert in_slab and slot_nbytes >= largest * 1.25, (slot_nbytes, largest)
        assert len(slabs) == 1, slabs  # grown once: epochs 2 and 3 use the same slab


@pytest.mark.timeout(60)
def test_slots_of_equal_batches_are_their_size():
    """Batches of one shape: a slot is a batch, rounded to whole pages, nothing more."""
    with ArenaLoader(_GrowingRows(), batch_size=4, num_workers=0, output="numpy") as loader:
        iterator = iter(loader)
        batch = next(iterator)
        assert loader.snapshot().slot_nbytes == batch.nbytes == 4096
        del batch, iterator


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_new_slab_reserves_no_slot_before_it_is_used(num_workers):
    """The first batch sizes the slab while the first read-ahead window is in one-off
    segments: the slab then reserves only the slot handed out since, not all ``slots``
    (they would sit on top of those segments); each slot is reserved when first used."""
    dataset = ImageDataset(64, shape=(64, 64), dtype=np.float32)
    with ArenaLoader(dataset, batch_size=4, num_workers=num_workers, slots=6,
                     output="numpy") as loader:
        iterator = iter(loader)
        first = next(iterator)
        snapshot = loader.snapshot()
        assert snapshot.slab_nbytes == 6 * snapshot.slot_nbytes
        assert snapshot.backed_slots == 1
        del first
        for batch in iterator:
            del batch
        snapshot = loader.snapshot()
        assert snapshot.backed_slots == sum(1 for n in snapshot.slot_leases if n) <= 6


class WorkerTagged:
    """Sample i: 512 int64s, each the id of the worker that loaded it."""

    def __len__(self) -> int:
        return 240

    def __getitem__(self, index: int) -> np.ndarray:
        return np.full(512, get_worker_info().id, np.int64)


@pytest.mark.timeout(60)
def test_each_slot_stays_with_one_worker_when_the_slots_allow():
    """With room for each worker's read-ahead and the batch handed out (2 workers x 3 <= 7
    slots, a count the free list's order alone would hand to each worker in turn), every
    slot carries the batches of one worker only, epoch after epoch."""
    writers: dict[int, set[int]] = {}
    with ArenaLoader(WorkerTagged(), batch_size=2, num_workers=2, slots=7,
                     persistent_workers=True, output="numpy") as loader:
        for _ in range(3):
            for batch in loader:
                snapshot = loader.snapshot()
                offset = batch.ctypes.data - (snapshot.slab_address or 0)
                if snapshot.slab_address and 0 <= offset < snapshot.slab_nbytes:
                    writers.setdefault(offset // snapshot.slot_nbytes, set()).update(
                        np.unique(batch).tolist())
                del batch
    assert len(writers) == 7
    assert all(len(ids) == 1 for ids in writers.values()), writers


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_no_room_for_a_slot_at_its_first_use_is_an_error_that_loses_no_batch(monkeypatch,
                                                                            num_workers):
    """/dev/shm fills up between sizing the slab and a slot's first use: next() raises
    ShmCapacityError naming the slot and the fix; once there is room again the epoch goes on
    with every batch, in order, none twice."""
    from arena_loader import ShmCapacityError, _slab

    dataset = ImageDataset(40, shape=(8, 8), dtype=np.float32)
    expected = reference_epoch(dataset, 4, False)
    real = _slab.Slab.back

    def no_room(slab, start, nbytes, what="the slab"):  # (segments still find room)
        raise _slab._capacity_error(nbytes, None, "posix_fallocate: No space left on device",
                                    what=what)

    monkeypatch.setattr(_slab.Slab, "back", no_room)
    got = []
    with ArenaLoader(dataset, batch_size=4, num_workers=num_workers, output="numpy") as loader:
        iterator = iter(loader)
        with pytest.raises(ShmCapacityError, match=r"slot \d of the slab .*needs .*--shm-size"):
            while True:
                got.append(np.array(next(iterator)))
        monkeypatch.setattr(_slab.Slab, "back", real)
        got += [np.array(batch) for batch in iterator]
    assert len(got) == len(expected)
    for batch, reference in zip(got, expected):
        np.testing.assert_array_equal(batch, reference)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("slots", [2, 3, 4, 5])
def test_a_for_loop_with_fewer_slots_than_the_read_ahead_needs_no_extra_segment(slots):
    """``slots`` below ``prefetch_factor * num_workers + 2``: when the batch a ``for`` loop
    still holds and the one being taken leave no slot for the next send, that send waits for
    the next ``next()``. Every batch of an epoch on a sized slab is in a slot, none in a
    one-off segment (sending it to a segment at every ``next()`` made image batches 3x
    slower), and the epoch is the reference's."""
    dataset = ImageDataset(96, shape=(16, 16), dtype=np.float32)
    expected = reference_epoch(dataset, 4, False)
    with ArenaLoader(dataset, batch_size=4, num_workers=2, prefetch_factor=2, slots=slots,
                     persistent_workers=True, output="numpy") as loader:
        for batch in loader:  # the first batches size the slab (in segments meanwhile)
            del batch
        for epoch in range(2):
            before = sum(loader.snapshot().slot_leases)
            assert_epoch_equal(loader, expected, f"epoch {epoch}")
            assert sum(loader.snapshot().slot_leases) - before == len(expected)


@pytest.mark.timeout(60)
def test_a_consumer_that_drops_each_batch_keeps_the_whole_read_ahead_with_one_spare_slot():
    """``slots = prefetch_factor * num_workers + 1`` (the bench's setting) and a consumer
    that drops each batch before asking for the next: after every ``next()`` the window is
    torch's whole read-ahead, 4 batches sent and not taken, in slots."""
    dataset = ImageDataset(96, shape=(16, 16), dtype=np.float32)
    with ArenaLoader(dataset, batch_size=4, num_workers=2, prefetch_factor=2, slots=5,
                     persistent_workers=True, output="numpy") as loader:
        for batch in loader:  # the first batches size the slab
            del batch
        before = sum(loader.snapshot().slot_leases)
        iterator = iter(loader)
        sent = []
        for _ in range(12):
            batch = next(iterator)
            state = loader.snapshot().iterators[-1]
            sent.append(len(state.in_flight) + len(state.ready))
            del batch
        assert sent == [4] * 12
        assert sum(loader.snapshot().slot_leases) - before == 12
        del iterator


@pytest.mark.timeout(60)
def test_one_slot_held_by_a_for_loop_sends_the_next_batch_to_a_segment_not_into_a_wait():
    """``slots=1``: the loop holds the only slot while asking for the next batch, which
    nothing else will free: the batch goes to a one-off segment at once (waiting for the slot
    would hang ``next()``), and every epoch is the reference's."""
    dataset = ImageDataset(40, shape=(8, 8), dtype=np.float32)
    expected = reference_epoch(dataset, 4, False)
    with ArenaLoader(dataset, batch_size=4, num_workers=2, slots=1, persistent_workers=True,
                     output="numpy") as loader:
        for epoch in range(2):
            assert_epoch_equal(loader, expected, f"epoch {epoch}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_for_loop_keeping_its_last_batch_is_not_warned_about_held_batches(num_workers):
    """``slots=1``: a ``for`` loop that keeps its last batch while asking for the next holds
    one batch, as every loop does: its batches go to segments, with no warning. Holding two
    (the gradient-accumulation pattern) is what the held-batches warning is for."""
    dataset = ImageDataset(40, shape=(8, 8), dtype=np.float32)
    expected = reference_epoch(dataset, 4, False)
    with ArenaLoader(dataset, batch_size=4, num_workers=num_workers, slots=1,
                     output="numpy") as loader:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            previous = None
            for i, batch in enumerate(loader):
                if previous is not None:
                    np.testing.assert_array_equal(previous, expected[i - 1])
                previous = batch
            assert not caught, [str(warning.message) for warning in caught]
            del previous, batch
            iterator = iter(loader)
            first, second = next(iterator), next(iterator)
            assert not caught, [str(warning.message) for warning in caught]
            third = next(iterator)
        [warning] = caught
        assert str(warning.message).startswith("your code holds 2 batches")
        assert "pass slots= more than 1 " in str(warning.message)
        for got, reference in zip((first, second, third), expected):
            np.testing.assert_array_equal(got, reference)
        del iterator


class _RandomGrowingRows:
    """Rows of 4 float64 for the first 8 indices, then 20,000 (they outgrow the first slots),
    each with a draw from ``random`` and from numpy's global RNG in the worker."""

    def __len__(self):
        return 32

    def __getitem__(self, i):
        import random

        return np.full(4 if i < 8 else 20_000, i, np.float64), random.random(), np.random.rand()


def _padded(batch):
    import torch

    rows = np.zeros((len(batch), max(len(row) for row, _, _ in batch)))
    for r, (row, _, _) in enumerate(batch):
        rows[r, :len(row)] = row
    return (torch.from_numpy(rows), torch.tensor([a for _, a, _ in batch]),
            torch.tensor([b for _, _, b in batch]))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("worker_mode", ["process", "thread"])
def test_persistent_workers_go_on_across_a_slab_regrow_as_torchs_do(worker_mode):
    """The slab grows at the epoch after a batch outgrew its slot; persistent workers are
    handed the grown slab and go on (they were replaced: worker_init_fn ran again and the
    workers' random streams started again from their seeds, so epoch 2 repeated epoch 1's
    draws, unlike torch's): same pids, worker_init_fn once each, and every epoch's batches
    equal torch's DataLoader's (random draws included: process workers seed theirs as
    torch's do; thread workers share the process's)."""
    import mmap

    import torch

    calls = np.frombuffer(mmap.mmap(-1, 16), np.int64, count=2)

    def init(worker_id):
        calls[worker_id] += 1

    def epochs(loader_class):
        torch.manual_seed(0)
        calls[:] = 0
        extra = {"worker_mode": worker_mode} if loader_class is ArenaLoader else {}
        loader = loader_class(_RandomGrowingRows(), batch_size=4, num_workers=2,
                              persistent_workers=True, collate_fn=_padded, worker_init_fn=init,
                              **extra)
        got, pids, slot_sizes = [], set(), set()
        for _ in range(3):
            iterator = iter(loader)
            got.append([tuple(t.tolist() for t in (b[0][:, 0], b[1], b[2])) for b in iterator])
            if loader_class is ArenaLoader:
                pids.add(tuple(iterator.worker_pids))
                slot_sizes.add(loader.snapshot().slot_nbytes)
        if loader_class is ArenaLoader:
            loader.close()
        return got, calls.tolist(), pids, slot_sizes

    theirs, their_calls, _, _ = epochs(torch.utils.data.DataLoader)
    ours, our_calls, pids, slot_sizes = epochs(ArenaLoader)
    assert len(slot_sizes) == 2, slot_sizes  # the slab grew
    assert len(pids) == 1, pids
    assert our_calls == their_calls == [1, 1]
    if worker_mode == "thread":
        ours, theirs = ([[rows for rows, _, _ in epoch] for epoch in got]
                        for got in (ours, theirs))
    assert ours == theirs


@pytest.mark.timeout(60)
def test_a_persistent_worker_dead_before_a_regrow_is_reported_and_the_next_epoch_runs():
    """A worker killed between epochs when the slab is due to grow: the hand-off skips it
    (sending it the grown slab raised BrokenPipeError out of iter(), at every epoch after),
    the epoch raises WorkerCrashedError naming it, and the next epoch runs on new workers."""
    import os
    import signal

    # (torch imported before the fork: _padded's import in each worker took 6-13 s on the
    # loaded 2-core machine with this test run alone, past timeout=10)
    import torch  # noqa: F401

    from arena_loader import WorkerCrashedError

    with ArenaLoader(_RandomGrowingRows(), batch_size=4, num_workers=2, persistent_workers=True,
                     collate_fn=_padded, timeout=10) as loader:
        iterator = iter(loader)
        assert sum(1 for _ in iterator) == 8
        victim = iterator.worker_pids[1]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 10  # dead (a zombie: not reaped, its status kept)
        while time.monotonic() < deadline and _state(victim) not in ("Z", None):
            time.sleep(0.01)
        del iterator
        with pytest.raises(WorkerCrashedError, match=rf"worker 1 \(pid {victim}\) was killed"):
            list(loader)
        firsts = [float(batch[0][0, 0]) for batch in loader]
        assert firsts == [float(i) for i in range(0, 32, 4)]


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def _shared_bytes(pids) -> int:
    """Pages of shared memory these processes hold (each object once): the bench's count."""
    from arena_loader.bench.harness import shm_objects

    objects: dict = {}
    for pid in pids:
        objects.update(shm_objects(pid))
    return sum(objects.values())


@pytest.mark.timeout(60)
def test_the_first_batches_in_segments_count_against_slots_while_they_live():
    """The first read-ahead window goes to one-off segments (no slab yet); while they live,
    each counts against ``slots`` as a slot would, so the first epoch's shared memory stays
    within ``slots`` batches, as later epochs' does: with ``slots=5`` a ``for`` loop held 6
    batches' pages for a moment (4 segments and 2 slots; 192 MB against the steady 160 with
    32 MB batches). Measured after each ``next()`` with the loop's last batch still held,
    once the workers have written what they were sent (a slot's pages are reserved as it is
    handed out, a segment's as its worker writes it)."""
    import os

    dataset = ImageDataset(320, shape=(64, 64), dtype=np.float32)  # 256 KB batches
    expected = reference_epoch(dataset, 16, False)
    got, peak = [], 0
    with ArenaLoader(dataset, batch_size=16, num_workers=2, prefetch_factor=2, slots=5,
                     output="numpy") as loader:
        iterator = iter(loader)
        batch = next(iterator)
        for step in range(len(expected) - 1):
            got.append(np.array(batch))
            held, batch = batch, next(iterator)  # (the loop's last batch, kept during next())
            if step < 6:  # the segments' lifetime, and after
                time.sleep(0.25)
                pids = [os.getpid(), *loader.snapshot().iterators[-1].worker_pids]
                peak = max(peak, _shared_bytes(pids))
            del held
        got.append(np.array(batch))
        del batch, iterator
        slot_nbytes = loader.snapshot().slot_nbytes
    assert len(got) == len(expected)
    for mine, reference in zip(got, expected):
        np.testing.assert_array_equal(mine, reference)
    # (less than a batch of slack: the order ring and the segments' page rounding)
    assert peak < 5 * slot_nbytes + slot_nbytes // 2, (peak / slot_nbytes, slot_nbytes)
