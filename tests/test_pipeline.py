"""The per-batch path's parts on their own: the order ring, completion records, the reorder
buffer and slot reconciliation (no worker processes)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from arena_loader._layout import PlanEncoder, prepare_samples
from arena_loader._pipeline.completions import (
    LOADED,
    SEGMENT,
    CompletionReader,
    Status,
    encode,
)
from arena_loader._pipeline.order import EntryKind, OrderReader, OrderRing
from arena_loader._pipeline.reorder import Reorderer
from arena_loader._pool import SlotPool, SlotState


@pytest.fixture
def ring_pair():
    """An order ring for 2 workers, and worker 1's reader over this process's mapping."""
    ring = OrderRing(workers=2, depth=3, rows=4)
    pipes = [os.pipe() for _ in range(2)]
    ring.connect([w for _, w in pipes])
    reader = OrderReader(1, 2, ring.depth, ring.entry_nbytes, pipes[1][0], ring.mapping)
    yield ring, reader
    reader.close()
    ring.close()
    for r, w in pipes:
        os.close(r)
        os.close(w)


def test_order_entries_arrive_in_order_with_their_indices_and_kinds(ring_pair):
    """Int indices, keys that are not ints, an index list too large for an entry, and
    control entries all reach the worker in order, with exactly what was published."""
    ring, reader = ring_pair
    keys = ["a", ("b", 2)]
    many = list(range(1000))  # 8000 bytes: more than an entry of 4 rows holds
    sent = [(EntryKind.INDICES, 1, 5, 0, [7, 3, 9, 1]), (EntryKind.INDICES, 3, 6, 0, keys)]
    for kind, idx, slot, epoch, indices in sent:
        assert ring.publish(1, kind, idx, slot, epoch, indices)
    got = [reader.next_entry(0.1) for _ in sent]
    assert [(e.kind, e.idx, e.slot, e.epoch, e.indices) for e in got] == [
        (EntryKind.INDICES, 1, 5, 0, [7, 3, 9, 1]), (EntryKind.PICKLED, 3, 6, 0, keys)]
    assert ring.publish(1, EntryKind.INDICES, 5, 7, 1, many)
    assert ring.publish(1, EntryKind.ATTACH, idx=4096)
    assert ring.publish(1, EntryKind.STOP)
    big, attach, stop = (reader.next_entry(0.1) for _ in range(3))
    assert (big.kind, big.idx, big.epoch, big.indices) == (EntryKind.PIPED, 5, 1, many)
    assert (attach.kind, attach.idx) == (EntryKind.ATTACH, 4096)
    assert stop.kind is EntryKind.STOP
    assert reader.next_entry(0.05) is None  # nothing more: a timeout, not an entry


def test_order_ring_never_overwrites_an_entry_the_worker_has_not_taken(ring_pair):
    """A worker's ring holds `depth` entries: the next publish is refused until the worker
    takes one, and a refused entry does not count as published."""
    ring, reader = ring_pair
    for idx in range(ring.depth):
        assert ring.publish(1, EntryKind.INDICES, idx, idx, 0, [idx])
    seq = ring.published[1]
    assert not ring.publish(1, EntryKind.INDICES, 99, 0, 0, [99])
    assert ring.published[1] == seq and not ring.has_room(1)
    assert reader.next_entry(0.1).indices == [0]
    assert ring.has_room(1)
    assert ring.publish(1, EntryKind.INDICES, 3, 0, 0, [3]) and ring.published[1] > seq
    assert [reader.next_entry(0.1).indices for _ in range(3)] == [[1], [2], [3]]
    assert ring.has_room(0) and ring.published[0] == 0  # the other worker's ring is its own


def test_completion_records_split_across_reads_are_parsed_whole_and_plans_shared():
    """A record cut by the pipe is parsed only once whole; equal plan records give the
    same Plan object; EOF reads as None after the last record."""
    read_fd, write_fd = os.pipe()
    reader = CompletionReader([read_fd])
    plan = prepare_samples([np.zeros(4, np.float32)] * 2, [0, 1]).plan
    body = PlanEncoder().encode(plan, 0, 0, 0, segment=False)
    records = encode(Status.LOADED, 0, 3, body) + encode(Status.SEGMENT, 1, -1, body)
    os.write(write_fd, records[:30])
    assert reader.fill(0) is True and not reader.arrived
    os.write(write_fd, records[30:])
    assert reader.fill(0) is True
    first, second = reader.arrived
    assert (first.status, first.idx, first.slot) == (LOADED, 0, 3)
    assert (second.status, second.idx, second.slot) == (SEGMENT, 1, -1)
    assert first.plan is second.plan and first.plan.fields[0].shape == (2, 4)
    assert reader.records == 2 and reader.nbytes == len(records)
    assert reader.fill(0) is False  # nothing waiting
    os.close(write_fd)
    assert reader.fill(0) is None
    os.close(read_fd)


def test_reorderer_hands_out_in_idx_order_and_takes_back_an_interrupted_batch():
    """in_order: batches leave by idx whatever order they arrive in; one put back is next
    again. in_order=False: arrival order, and one put back is next again there too (not
    behind the batches that arrived after it; two put back, the first one first)."""

    class Done:
        def __init__(self, idx):
            self.idx = idx

    order = Reorderer(in_order=True)
    order.in_flight.update({i: (i % 2, i, [i]) for i in range(3)})
    for idx in (2, 0, 1):
        order.arrive(Done(idx))
    assert not order.in_flight
    taken = []
    while (ready := order.take()) is not None:
        order.taken(ready)
        taken.append(ready)
    assert [r.idx for r in taken] == [0, 1, 2]
    order.unget(taken[2])
    assert order.take() is taken[2]
    unordered = Reorderer(in_order=False)
    for idx in (2, 0, 1):
        unordered.arrive(Done(idx))
    first = unordered.take()
    unordered.taken(first)
    unordered.unget(first)
    assert [unordered.take().idx for _ in range(3)] == [2, 0, 1]
    for idx in (5, 6):  # two taken, then both put back: they come again as they came
        unordered.arrive(Done(idx))
    first, second = unordered.take(), unordered.take()
    unordered.unget(second)
    unordered.unget(first)
    assert [unordered.take().idx for _ in range(2)] == [5, 6]


def test_reconcile_frees_slots_no_batch_owns_and_relists_free_ones():
    """A slot ASSIGNED or FILLED with no owner (its batch lost track of by an interrupt) is
    freed; owned slots keep their state; a FREE slot missing from the free list is listed."""
    pool = SlotPool(np.zeros(4 * 64, np.uint8), 64, 4)
    kept, lost, filled = pool.acquire(), pool.acquire(), pool.acquire()
    pool.mark_filled(filled)
    assert pool.reconcile(owned={kept}) == 2
    assert pool.state(kept) is SlotState.ASSIGNED
    assert {pool.acquire() for _ in range(3)} == {lost, filled, 3}
    assert pool.acquire() is None


def test_a_record_of_no_batch_its_worker_was_loading_is_an_error_never_a_batch():
    """``accept``: a record naming an idx never sent, another worker's batch, or a slot other
    than its batch's raises (the worker process is corrupt) and marks no slot filled (the
    wrong slot's bytes would be handed out as the batch). A record of a batch filed and
    taken already (parsed twice after an interrupt) is dropped; the right one is accepted."""
    from types import SimpleNamespace

    from arena_loader._pipeline.completions import Completion
    from arena_loader._pipeline.intake import accept

    pool = SlotPool(np.zeros(4 * 64, np.uint8), 64, 4)
    arena = SimpleNamespace(pool=pool, slot_nbytes=64)
    mine, other = pool.acquire(), pool.acquire()
    order = Reorderer(in_order=True, first_idx=3)
    order.in_flight.update({3: (0, mine, [6, 7]), 4: (1, other, [8, 9])})
    feed, plan = SimpleNamespace(send_idx=5), SimpleNamespace(nbytes=32)

    def filed(worker, idx, slot):
        return accept(Completion(worker, LOADED, idx, slot, b"", plan), order, feed, None,
                      arena, False)

    for worker, idx, slot in ((0, 3, other), (1, 3, mine), (0, 4, other), (0, 5, mine),
                              (0, 9, mine)):
        with pytest.raises(RuntimeError, match=rf"worker {worker} reported batch idx={idx} in "
                                               rf"slot {slot}, but that is not a batch it was "
                                               "loading .*the worker process is corrupt"):
            filed(worker, idx, slot)
    assert pool.states() == [SlotState.ASSIGNED] * 2 + [SlotState.FREE] * 2
    assert filed(0, 2, mine) is None
    assert filed(0, 3, mine) == (0, mine, [6, 7])
    assert pool.state(mine) is SlotState.FILLED and pool.state(other) is SlotState.ASSIGNED


def test_accept_settles_a_record_filed_already_and_takes_a_batch_that_fills_its_slot():
    """``accept``: a record whose batch is filed but still listed in flight (an arrival cut
    short) is settled, out of flight, and not filed twice; a batch of exactly the slot's
    size is a batch in its slot (not an overflow); while draining, a batch of the last epoch
    leaves flight and gives its slot back."""
    from types import SimpleNamespace

    from arena_loader._pipeline.completions import Completion
    from arena_loader._pipeline.intake import accept

    pool = SlotPool(np.zeros(3 * 64, np.uint8), 64, 3)
    arena = SimpleNamespace(pool=pool, slot_nbytes=64)
    slots = [pool.acquire() for _ in range(3)]
    order = Reorderer(in_order=True)
    order.in_flight.update({idx: (0, slots[idx], [idx]) for idx in range(3)})
    feed = SimpleNamespace(send_idx=3)

    def filed(idx, nbytes, draining=False):
        completion = Completion(0, LOADED, idx, slots[idx], b"", SimpleNamespace(nbytes=nbytes))
        return accept(completion, order, feed, None, arena, draining)

    order.done[0] = object()  # filed; the arrival was cut short before it left flight
    assert filed(0, 32) is None and 0 not in order.in_flight
    assert filed(1, 64) == (0, slots[1], [1]) and pool.state(slots[1]) is SlotState.FILLED
    assert filed(2, 32, draining=True) is None
    assert 2 not in order.in_flight and pool.state(slots[2]) is SlotState.FREE


@pytest.mark.parametrize("drop_last", [False, True])
def test_batch_sampler_slicing_our_samplers_gives_their_order(drop_last):
    """BatchSampler slices our samplers' epoch array: the same batches, in the same order,
    as chunking what the sampler itself yields (seeded RandomSampler, SequentialSampler)."""
    from arena_loader.samplers import BatchSampler, RandomSampler, SequentialSampler

    data = range(103)
    for make in (lambda: RandomSampler(data, generator=7), lambda: SequentialSampler(data)):
        flat = list(make())
        expected = [flat[i: i + 10] for i in range(0, len(flat), 10)]
        if drop_last:
            expected = [b for b in expected if len(b) == 10]
        batches = list(BatchSampler(make(), 10, drop_last))
        assert batches == expected and all(type(i) is int for b in batches for i in b)


class _StopsAtFive:
    def __len__(self):
        return 12

    def __getitem__(self, i):
        if i == 5:
            raise StopIteration  # a dataset's bug: it must not end the epoch silently
        return np.full(2, i)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataset_stop_iteration_is_that_batchs_runtime_error_not_the_end(num_workers):
    """StopIteration from __getitem__ is raised as RuntimeError naming the indices, at its
    batch's turn; the epoch goes on and every other batch arrives."""
    from arena_loader import ArenaLoader

    with ArenaLoader(_StopsAtFive(), batch_size=2, num_workers=num_workers) as loader:
        iterator, got, errors = iter(loader), [], []
        while True:
            try:
                got.append(int(next(iterator)[0, 0]))
            except StopIteration:
                break
            except RuntimeError as exc:
                errors.append(str(exc))
        del iterator
    assert got == [0, 2, 6, 8, 10]
    assert len(errors) == 1 and "StopIteration" in errors[0] and "[4, 5]" in errors[0]


class _FailsAtFiveSecondTime:
    def __init__(self):
        import multiprocessing

        self.fail = multiprocessing.Value("b", 0)  # shared with the (forked) workers

    def __len__(self):
        return 12

    def __getitem__(self, i):
        if i == 5 and self.fail.value:
            raise ValueError("bad sample 5")
        return np.full(2, i)


@pytest.mark.timeout(60)
def test_failed_batch_gives_its_slot_back_in_steady_state():
    """Once the slab exists (second epoch, persistent workers), a batch whose sample raises
    returns its slot: after the epoch every slot is free again."""
    from arena_loader import ArenaLoader

    dataset = _FailsAtFiveSecondTime()
    with ArenaLoader(dataset, batch_size=2, num_workers=2, persistent_workers=True) as loader:
        assert len(list(loader)) == 6
        dataset.fail.value = 1
        iterator = iter(loader)
        with pytest.raises(ValueError, match="bad sample 5"):
            while True:
                next(iterator)
        # At once (not only at the epoch's end): slots in use are exactly the batches owed.
        snapshot = loader.snapshot()
        (epoch,) = snapshot.iterators
        assert snapshot.assigned_slots + snapshot.filled_slots == (
            len(epoch.in_flight) + len(epoch.ready))
        assert sum(1 for _ in iterator) == 3  # the epoch goes on after the error
        del iterator
        import gc

        gc.collect()
        assert loader.snapshot().free_slots == loader.slots


class _KeyEcho:
    """dataset[key] is [key], or [-1] for the key None."""

    def __len__(self):
        return 3

    def __getitem__(self, key):
        return np.array([-1 if key is None else key])


@pytest.mark.timeout(60)
def test_a_none_key_reaches_the_dataset_as_with_torch():
    """batch_size=None and a sampler that yields None: the worker calls dataset[None], as
    torch's DataLoader does (the batch order pickles that key; no int64 entry is made)."""
    from arena_loader import ArenaLoader

    with ArenaLoader(_KeyEcho(), batch_size=None, sampler=[0, None, 2], num_workers=2,
                     output="numpy") as loader:
        assert [int(batch[0]) for batch in loader] == [0, -1, 2]


def _pipe_bytes(fd: int) -> bytes:
    os.set_blocking(fd, False)
    try:
        return os.read(fd, 4096)
    except BlockingIOError:
        return b""


def test_a_busy_worker_costs_no_doorbell_and_a_sleeping_one_is_woken(ring_pair):
    """Publishing to a worker that is not waiting writes nothing on its pipe (it finds the
    entry by the shared counter); a worker waiting for an entry is woken at once."""
    import threading
    import time

    ring, reader = ring_pair
    doorbell_read = reader._doorbell
    assert ring.publish(1, EntryKind.INDICES, 0, 0, 0, [5])
    assert _pipe_bytes(doorbell_read) == b""  # no system call for a worker that is busy
    assert reader.next_entry(0).indices == [5]
    got = []
    waiter = threading.Thread(target=lambda: got.append(reader.next_entry(5.0)))
    waiter.start()
    _wait_until_asleep(ring, 1)
    start = time.monotonic()
    assert ring.publish(1, EntryKind.INDICES, 1, 0, 0, [6])
    waiter.join(5)
    assert got and got[0].indices == [6] and time.monotonic() - start < 0.4  # not its timeout
    assert not ring._sleeping[1]


def test_a_missed_wake_up_is_healed_before_the_main_process_waits(ring_pair):
    """A worker asleep with an entry published and no doorbell (the fence missed, or an
    interrupt between publishing and ringing): wake_sleepers rings it, and only it."""
    ring, reader = ring_pair
    ring._sleeping[1] = 1  # as a worker that went to sleep before the entry was seen
    ring.wake_sleepers()  # nothing published yet: nobody to wake
    assert _pipe_bytes(reader._doorbell) == b""
    ring._sleeping[1] = 0
    assert ring.publish(1, EntryKind.INDICES, 0, 0, 0, [1])  # not asleep: no doorbell
    ring._sleeping[1] = 1
    ring.wake_sleepers()
    assert _pipe_bytes(reader._doorbell) == b"\1"
    ring._sleeping[1] = 0


def test_a_piped_payload_that_was_never_published_is_skipped(ring_pair):
    """Large indices travel on the pipe, tagged with their entry's seq, before the entry is
    published. One written for an entry that an interrupt kept from being published is
    dropped: the worker reads each entry's own payload (the retry's, or a later entry's)."""
    import pickle

    from arena_loader._pipeline import order as order_module

    ring, reader = ring_pair
    many, other = list(range(1000)), list(range(2000, 3000))

    def orphan(seq, indices):
        payload = pickle.dumps(indices, protocol=5)
        os.write(ring._doorbells[1], order_module.PIPED_TAG
                 + order_module._PIPED.pack(seq, len(payload)) + payload)

    orphan(0, many)  # seq 0 interrupted after its payload; retried below, same indices
    assert ring.publish(1, EntryKind.INDICES, 7, 1, 0, many)  # seq 0
    orphan(1, ["never"])  # seq 1 interrupted; its batch went elsewhere
    assert ring.publish(1, EntryKind.INDICES, 8, 2, 0, [3, 4])  # seq 1: small, in the ring
    assert ring.publish(1, EntryKind.INDICES, 9, 3, 0, other)  # seq 2: piped
    got = [reader.next_entry(0.1) for _ in range(3)]
    assert [(e.idx, e.indices) for e in got] == [(7, many), (8, [3, 4]), (9, other)]
    assert reader.next_entry(0.01) is None


def test_a_speculative_read_is_skipped_only_when_nothing_waits():
    """next() reads the owing worker's pipe without a poll only when the worker's counter
    shows bytes not read yet; bytes already read (an interrupt left them unparsed) are
    parsed either way, and a read after a poll is never skipped."""
    read_fd, write_fd = os.pipe()
    sent = np.zeros(1, np.int64)
    reader = CompletionReader([read_fd], sent)
    first, second = encode(Status.ENDED, 0, -1), encode(Status.ENDED, 1, -1)
    os.write(write_fd, first)  # written, counter not moved yet: the read is skipped
    assert reader.fill(0, speculative=True) is False and not reader.arrived
    assert reader.fill(0) is True and [c.idx for c in reader.arrived] == [0]  # after a poll
    reader.arrived.clear()
    sent[0] = len(first)
    reader._buffers[0] += second  # read before an interrupt, not parsed
    assert reader.fill(0, speculative=True) is False
    assert [c.idx for c in reader.arrived] == [1]
    os.write(write_fd, first)
    sent[0] += len(first)
    assert reader.fill(0, speculative=True) is True and len(reader.arrived) == 2
    reader._received[0] -= 5  # an interrupt kept a read from being counted: it lags
    assert reader.fill(0, speculative=True) is False  # read, found nothing ...
    assert reader._received[0] == sent[0]  # ... and counts again from what the worker sent
    os.close(write_fd)
    os.close(read_fd)


class _Rows:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.full(2, i, dtype=np.int64)


@pytest.mark.timeout(60)
def test_a_record_parsed_twice_by_an_interrupt_does_not_reach_the_next_epoch(monkeypatch):
    """A Ctrl-C between a record's parse and its bytes' removal leaves them to be parsed
    again (filed again as a no-op). Left over at an epoch's end (persistent workers), they
    must not be filed in the next epoch, where they answer no batch ("worker is corrupt")."""
    real_parse = CompletionReader._parse
    last_idx = 39 // 4  # 40 samples, batch 4: the epoch's last batch

    def parse_keeping_the_last(self, worker):
        data = bytes(self._buffers[worker])
        count = len(self.arrived)
        real_parse(self, worker)
        if any(c.idx == last_idx for c in list(self.arrived)[count:]):
            self._buffers[worker][:0] = data  # as if interrupted before `del buffer[:pos]`

    monkeypatch.setattr(CompletionReader, "_parse", parse_keeping_the_last)
    from arena_loader import ArenaLoader

    with ArenaLoader(_Rows(40), batch_size=4, num_workers=2, persistent_workers=True,
                     timeout=10) as loader:
        for _ in range(3):
            assert [int(b[0, 0]) for b in loader] == list(range(0, 40, 4))


def test_spinning_looks_again_after_each_yield_and_gives_up_after_its_bound(monkeypatch):
    """spin_while_equal sees a counter that moves while it yields the CPU (another process's
    store), and ends after SPIN_YIELDS yields when nothing moves, so the caller sleeps."""
    from arena_loader._pipeline import spin

    counter = np.zeros(2, np.int64)
    yields = []

    def other_side_stores_on_third_yield():
        yields.append(1)
        if len(yields) == 3:
            counter[1] = 7

    monkeypatch.setattr(spin.os, "sched_yield", other_side_stores_on_third_yield)
    monkeypatch.setattr(spin, "SPIN_S", 60.0)  # the count bounds it here, not the clock
    assert spin.spin_while_equal(counter, 1, 0) is True and len(yields) == 3
    yields.clear()
    assert spin.spin_while_equal(counter, 0, 0) is False
    assert len(yields) == spin.SPIN_YIELDS


def test_next_naps_only_once_waits_outlast_the_spin(monkeypatch):
    """The reader of completion records naps after its spin only when the wait before also
    outlasted the spin: a lone long wait sleeps (woken at once by the record), a run of
    them naps; a wait that the spin ends starts over."""
    from arena_loader._pipeline import completions

    read_fd, write_fd = os.pipe()
    try:
        reader = completions.CompletionReader([read_fd], np.zeros(1, np.int64))
        spins, naps = [], []
        monkeypatch.setattr(completions, "spin_while_equal",
                            lambda *args: spins.pop(0))
        monkeypatch.setattr(completions, "nap_while_equal",
                            lambda *args: naps.append(1) or True)
        spins[:] = [False, False, True, False]
        assert reader.spin_for(0) is False and naps == []  # a first long wait: sleep
        assert reader.spin_for(0) is True and naps == [1]  # the next long one naps
        assert reader.spin_for(0) is True and naps == [1]  # ended by the spin
        assert reader.spin_for(0) is False and naps == [1]  # long again, after a short one
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_napping_looks_again_after_each_nap_and_gives_up_after_its_bound(monkeypatch):
    """nap_while_equal (next()'s wait after the spin) sees a counter that moves between naps,
    and ends after NAPS_S when nothing moves, so the caller sleeps on the pipe."""
    from arena_loader._pipeline import spin

    counter = np.zeros(2, np.int64)
    naps = []
    clock = [0.0]

    def nap(seconds):
        naps.append(seconds)
        clock[0] += seconds
        if len(naps) == 4:
            counter[1] = 7

    monkeypatch.setattr(spin.time, "sleep", nap)
    monkeypatch.setattr(spin.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(spin, "NAP_S", 0.25)  # (sums without rounding: 40 naps make 10 s)
    monkeypatch.setattr(spin, "NAPS_S", 10.0)
    assert spin.nap_while_equal(counter, 1, 0) is True and naps == [spin.NAP_S] * 4
    naps.clear()
    assert spin.nap_while_equal(counter, 0, 0) is False
    assert len(naps) == 40


def test_a_spinning_worker_sleeps_when_nothing_comes_and_wakes_on_its_doorbell():
    """A process worker's reader (spin=True) yields a moment, then sleeps as before: an entry
    published while it sleeps wakes it through the doorbell, not its timeout."""
    import threading
    import time

    ring = OrderRing(workers=1, depth=3, rows=4)
    read_fd, write_fd = os.pipe()
    ring.connect([write_fd])
    reader = OrderReader(0, 1, ring.depth, ring.entry_nbytes, read_fd, ring.mapping, spin=True)
    got = []
    waiter = threading.Thread(target=lambda: got.append(reader.next_entry(5.0)))
    waiter.start()
    _wait_until_asleep(ring, 0)
    assert ring._sleeping[0]  # the spin ended and it sleeps on the pipe
    start = time.monotonic()
    assert ring.publish(0, EntryKind.INDICES, 0, 0, 0, [4, 2])
    waiter.join(5)
    assert got and got[0].indices == [4, 2] and time.monotonic() - start < 0.4
    reader.close()
    ring.close()
    os.close(read_fd)
    os.close(write_fd)


def _wait_until_asleep(ring, worker):
    """Until ``worker``'s reader says it sleeps on its doorbell (5 s at most)."""
    import time

    deadline = time.monotonic() + 5
    while not ring._sleeping[worker] and time.monotonic() < deadline:
        time.sleep(0.001)


class _PopThenInterrupt(dict):
    """``in_flight`` whose ``pop`` of one idx raises ``KeyboardInterrupt`` once the entry is
    removed: what a real SIGINT does there (CPython handles a signal as a call into C
    returns, here ``dict.pop`` inside ``Reorderer.arrive``)."""

    target = -1
    fired = 0

    def pop(self, key, *default):
        value = super().pop(key, *default)
        if key == type(self).target and not type(self).fired:
            type(self).fired += 1
            raise KeyboardInterrupt
        return value


@pytest.mark.timeout(60)
# (idx, samples): the epoch ended early / its last batch was lost / next() waited for good
# (here until `timeout`: the batches after it filled the window, so nothing more was sent)
@pytest.mark.parametrize(("target", "samples"), [(2, 12), (5, 12), (2, 80)])
def test_ctrl_c_as_a_batch_arrives_loses_no_batch(monkeypatch, target, samples):
    """A Ctrl-C handled just as ``Reorderer.arrive`` had popped a batch from ``in_flight``
    left it in neither ``in_flight`` nor ``done``; its record, filed again by the next
    ``next()``, was taken for one filed already and dropped: the last batch was lost without
    a word, an earlier one left ``next()`` waiting for it forever (found by
    benchmarks/chaos.py: seeds 702422293 and 725662815)."""
    from arena_loader import ArenaLoader

    from .datasets import ImageDataset, reference_epoch

    original = Reorderer.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.in_flight = _PopThenInterrupt()

    monkeypatch.setattr(Reorderer, "__init__", init)
    monkeypatch.setattr(_PopThenInterrupt, "target", target)
    monkeypatch.setattr(_PopThenInterrupt, "fired", 0)
    dataset = ImageDataset(samples, shape=(3,), dtype=np.int64)
    with ArenaLoader(dataset, batch_size=2, num_workers=2, timeout=5) as loader:
        iterator, got = iter(loader), []
        for _ in range(20):
            try:
                got.extend(np.array(batch) for batch in iterator)
                break
            except KeyboardInterrupt:
                continue
        del iterator
    assert _PopThenInterrupt.fired == 1
    expected = reference_epoch(dataset, 2, False)
    assert len(got) == len(expected)
    for batch, reference in zip(got, expected):
        np.testing.assert_array_equal(batch, reference)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("in_order", [True, False])
def test_ctrl_c_as_a_worker_s_records_are_read_loses_none(in_order):
    """A Ctrl-C handled at the first point CPython handles one (a call into C returning)
    after a worker's bytes have left its result pipe: ``buffer += os.read(...)`` dropped
    them, their records were never filed, and ``next()`` waited for their batches for good
    (found by benchmarks/chaos.py, seed 702422293: a hang). Simulated with a profile
    function, which raises at the same point (``c_return``) with the call's result dropped,
    as a signal handled there does."""
    import fcntl
    import struct
    import sys
    import termios

    from arena_loader import ArenaLoader

    from .datasets import ImageDataset, reference_epoch

    def unread(fd: int) -> int:
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]

    before: dict = {}
    fired: list = []

    def profile(frame, event, arg):
        code = frame.f_code
        if fired or code.co_name != "fill" or not code.co_filename.endswith("completions.py"):
            return
        fd = frame.f_locals["self"].fds[frame.f_locals["worker"]]
        if event == "call":
            before[frame] = unread(fd)
        elif event == "c_return" and unread(fd) < before.get(frame, 0):
            fired.append(fd)
            raise KeyboardInterrupt

    dataset = ImageDataset(80, shape=(3,), dtype=np.int64)
    with ArenaLoader(dataset, batch_size=2, num_workers=2, timeout=5,
                     in_order=in_order) as loader:
        iterator = iter(loader)
        got = [np.array(next(iterator))]
        time.sleep(0.3)  # the workers' records wait in their pipes
        sys.setprofile(profile)
        try:
            for _ in range(20):
                try:
                    got.extend(np.array(batch) for batch in iterator)
                    break
                except KeyboardInterrupt:
                    continue
        finally:
            sys.setprofile(None)
        del iterator
    assert fired
    expected = reference_epoch(dataset, 2, False)
    key = (lambda batch: batch.tobytes()) if not in_order else None
    got = got if in_order else sorted(got, key=key)
    expected = expected if in_order else sorted(expected, key=key)
    assert len(got) == len(expected)
    for batch, reference in zip(got, expected):
        np.testing.assert_array_equal(batch, reference)
