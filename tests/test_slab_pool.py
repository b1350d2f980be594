"""The slab (shared memory) and the slot pool (ownership), on their own."""

from __future__ import annotations

import gc
import os

import numpy as np
import posix_ipc
import pytest

from arena_loader import LoaderClosedError, ShmCapacityError
from arena_loader._pool import SlotPool, SlotState
from arena_loader._slab import (
    NAME_PREFIX,
    Segment,
    Slab,
    open_shared,
    remove_names_of,
    shm_available_bytes,
)

from .conftest import our_shm_descriptors


def test_slab_is_unlinked_at_once_and_preallocated():
    """No /dev/shm name exists after construction, yet the memory is allocated and shared."""
    slab = Slab(64 * 4096)
    try:
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(NAME_PREFIX)]
        handle = slab.handle()
        # fallocate reserved the pages: counted in the object's own blocks (512-byte units),
        # not read from /dev/shm's free space, which other processes change meanwhile
        assert os.fstat(handle.fd).st_blocks * 512 >= 64 * 4096
        other = np.frombuffer(handle.map(), dtype=np.uint8)
        slab.array[:4] = [1, 2, 3, 4]
        assert other[:4].tolist() == [1, 2, 3, 4]
        del other
    finally:
        slab.close()
        slab.close()  # idempotent


def test_an_interrupt_between_creating_and_unlinking_leaves_no_name(monkeypatch):
    """Ctrl-C lands right after shm_open returns (Python runs signal handlers once a C call
    returns): the KeyboardInterrupt goes on, and neither the name stays in /dev/shm nor the
    descriptor open (no variable held it yet)."""
    real = posix_ipc.SharedMemory
    made = []

    def made_then_interrupted(name, *args, **kwargs):
        made.append(real(name, *args, **kwargs))
        raise KeyboardInterrupt

    monkeypatch.setattr(posix_ipc, "SharedMemory", made_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        open_shared()
    monkeypatch.undo()
    assert len(made) == 1
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(NAME_PREFIX)]
    assert not our_shm_descriptors()
    fd = open_shared()  # and the next one works
    os.close(fd)


def test_slab_descriptor_is_close_on_exec_also_once_passed_to_a_child():
    """The slab's descriptor, and the copy a spawn/forkserver worker receives by fd passing,
    are not inherited by a program exec'd from that process."""
    import pickle
    from multiprocessing.reduction import ForkingPickler

    slab = Slab(4096)
    try:
        assert not os.get_inheritable(slab.handle().fd)
        # Pickling duplicates the fd as multiprocessing does for a child (DupFd).
        payload = ForkingPickler.dumps(slab.handle())
        received = pickle.loads(payload)
        try:
            assert received.fd != slab.handle().fd
            assert not os.get_inheritable(received.fd)
        finally:
            os.close(received.fd)
    finally:
        slab.close()


def test_leased_slot_is_registered_for_fork_until_its_batch_dies():
    """SlotPool.lease registers the slot's bytes with the fork registry; the entry goes with
    the lease."""
    from arena_loader import _forksafe

    slab_array = np.zeros(4 * 64, dtype=np.uint8)
    pool = SlotPool(slab_array, 64, 4)
    slot = pool.acquire()
    pool.mark_filled(slot)
    before = len(_forksafe.kept_regions())
    lease = pool.lease(slot)
    assert len(_forksafe.kept_regions()) == before + 1
    (region,) = [region for owner, region in _forksafe.kept_regions() if owner is lease]
    assert region == (slab_array[slot * 64:].ctypes.data, 64)
    del lease
    assert len(_forksafe.kept_regions()) == before


def test_slab_larger_than_dev_shm_fails_at_construction():
    """Asking for more than /dev/shm holds raises ShmCapacityError naming bytes and fixes."""
    too_big = shm_available_bytes() * 2 + 4096
    with pytest.raises(ShmCapacityError, match=rf"needs {too_big:,} bytes .*available.*"
                                               r"--shm-size.*fewer `slots`"):
        Slab(too_big, slots=8)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(NAME_PREFIX)]


def test_a_lazy_slab_larger_than_dev_shm_fails_at_construction_too():
    """A lazy slab reserves no page at construction, so only the size check can refuse it:
    one page more than /dev/shm has is refused then, not left to fail at a slot's first use."""
    too_big = shm_available_bytes() + 64 * 4096
    with pytest.raises(ShmCapacityError, match="checked before allocating"):
        Slab(too_big, slots=2, lazy=True)
    assert not our_shm_descriptors()


def test_a_reserved_slab_allocated_again_at_its_size_is_unchanged_and_closed_if_it_fails(
        monkeypatch):
    """``allocate`` made again at the same size (a claim an interrupt cut short) keeps the
    mapping it made; another size is refused. A reserved slab whose allocation fails (no
    room) is closed, its descriptor with it: it is no use to the workers holding it; so is
    a one-off segment's."""
    slab = Slab.reserve()
    slab.allocate(2 * 4096, slots=2)
    array = slab.array
    slab.allocate(2 * 4096, slots=2)
    assert slab.array is array and slab.nbytes == 2 * 4096
    with pytest.raises(ValueError, match="already allocated"):
        slab.allocate(4096)
    slab.close()
    del array  # (the mapping goes with its last view)

    def no_space(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    failing = Slab.reserve()
    with pytest.raises(ShmCapacityError, match="posix_fallocate"):
        failing.allocate(4096)
    assert failing.closed and not our_shm_descriptors()
    with pytest.raises(ShmCapacityError, match="posix_fallocate"):
        Segment(4096)  # (a one-off segment: its descriptor closed too)
    assert not our_shm_descriptors()


def test_the_names_a_dead_process_left_are_removed_and_no_other_process_names():
    """``remove_names_of(pid)`` removes the names made by ``pid`` only: not those of a
    process whose pid starts with the same digits (a live one's name is in use)."""
    pid = os.getpid()
    names = [f"/{NAME_PREFIX}{pid}_probe", f"/{NAME_PREFIX}{pid}7_probe"]
    for name in names:
        os.close(posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=4096).fd)
    try:
        remove_names_of(pid)
        assert [n for n in os.listdir("/dev/shm") if n.startswith(NAME_PREFIX)] == [
            names[1][1:]]
    finally:
        for name in names:
            try:
                posix_ipc.unlink_shared_memory(name)
            except posix_ipc.ExistentialError:
                pass


def test_fallocate_failure_is_a_capacity_error(monkeypatch):
    """ENOSPC from posix_fallocate (space taken after the check) is ShmCapacityError too."""
    def no_space(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(ShmCapacityError, match="posix_fallocate: No space left on device"):
        Slab(4096)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(NAME_PREFIX)]


def test_pool_enforces_the_slot_lifecycle():
    """free -> assigned -> filled -> leased -> free only after the lease dies."""
    slab = np.zeros(3 * 128, dtype=np.uint8)
    pool = SlotPool(slab, 128, 3)
    slot = pool.acquire()
    assert pool.state(slot) is SlotState.ASSIGNED
    with pytest.raises(RuntimeError, match="expected filled"):
        pool.lease(slot)
    pool.mark_filled(slot)
    lease = pool.lease(slot)
    view = np.asarray(lease)
    assert view.base is lease and np.shares_memory(view, slab)
    assert pool.state(slot) is SlotState.LEASED
    with pytest.raises(RuntimeError, match="cannot be reclaimed"):
        pool.reclaim(slot)
    del lease
    assert pool.state(slot) is SlotState.LEASED  # the view still holds it
    del view
    gc.collect()
    assert pool.counts()[SlotState.FREE] == 3  # (the dead lease's slot counted as free)
    assert pool.state(slot) is SlotState.FREE


def test_a_slot_is_marked_filled_only_from_assigned_and_leased_only_while_open():
    """A record for a slot its batch no longer owns (FREE, or the consumer's) is a bug that
    raises, never a slot made FILLED under a live batch (leased twice: two batches in one
    slot); a lease asked after the pool closed is a LoaderClosedError, the slot left FILLED."""
    slab = np.zeros(2 * 128, dtype=np.uint8)
    pool = SlotPool(slab, 128, 2)
    with pytest.raises(RuntimeError, match="slot 0 is free, expected assigned"):
        pool.mark_filled(0)
    slot = pool.acquire()
    pool.mark_filled(slot)
    pool.mark_filled(slot)  # (a record filed twice: stays FILLED)
    lease = pool.lease(slot)
    with pytest.raises(RuntimeError, match="is leased, expected assigned"):
        pool.mark_filled(slot)
    assert pool.state(slot) is SlotState.LEASED
    other = pool.acquire()
    pool.mark_filled(other)
    pool.close()
    with pytest.raises(LoaderClosedError, match="closed"):
        pool.lease(other)
    assert pool.state(other) is SlotState.FILLED
    assert np.asarray(lease).base is lease  # a lease given before the close keeps its bytes
    del lease
    gc.collect()
    assert pool.state(slot) is SlotState.FREE


def test_pool_hands_out_each_slot_once_until_released():
    """acquire() returns None when every slot is taken, and reclaim() frees one."""
    pool = SlotPool(np.zeros(2 * 64, np.uint8), 64, 2)
    first, second = pool.acquire(), pool.acquire()
    assert {first, second} == {0, 1} and pool.acquire() is None
    pool.reclaim(second)
    pool.reclaim(second)  # (a record filed twice: a no-op, the slot listed once)
    assert pool.acquire() == second and pool.acquire() is None


def _leased_pool(slots):
    pool = SlotPool(np.zeros(slots * 64, np.uint8), 64, slots)
    leases = []
    for _ in range(slots):
        slot = pool.acquire()
        pool.mark_filled(slot)
        leases.append(pool.lease(slot))
    return pool, leases


def test_a_lease_dropped_while_a_waiter_wants_a_slot_wakes_it():
    """acquire() found every slot held: the death of any of those leases, or a slot
    reclaimed, wakes the waiter (the session's next() waits on that waker), once it is
    wanted only."""
    class Waker:
        wakes = 0

        def wake(self):
            Waker.wakes += 1

    pool, leases = _leased_pool(2)
    pool.waker = Waker()
    del leases[0]
    assert Waker.wakes == 0  # nobody waits: no wake-up
    assert pool.acquire() == 0 and pool.acquire() is None  # now one waits
    del leases[0]
    assert Waker.wakes == 1 and pool.acquire() == 1
    pool.reclaim(0)
    assert Waker.wakes == 1  # satisfied: no longer wanted
    assert pool.acquire() == 0 and pool.acquire() is None  # every slot taken: one waits
    pool.reclaim(1)  # (a failed or abandoned batch's slot) wakes it too
    assert Waker.wakes == 2 and pool.acquire() == 1


def test_a_waiter_that_wants_a_slot_again_is_woken_by_the_leases_alive_then():
    """Each time acquire() finds no free slot it watches the leases alive at that moment: a
    batch leased after an earlier wait (its slot taken by that waiter) wakes the next one
    when it dies, as the first batches did (a wake-up lost costs next() a poll, 0.5 s)."""
    wakes = []

    class Waker:
        def wake(self):
            wakes.append(1)

    pool, leases = _leased_pool(2)
    pool.waker = Waker()
    assert pool.acquire() is None  # waits on both leases
    del leases[0]
    assert len(wakes) == 1 and pool.acquire() == 0
    pool.mark_filled(0)
    leases.append(pool.lease(0))  # leased after that wait
    assert pool.acquire() is None  # waits again: on slot 1's lease and this one
    del leases[1]
    assert len(wakes) == 2 and pool.acquire() == 0
    pool.reclaim(0)
    del leases[0]  # slot 1's lease: nobody waits now
    assert len(wakes) == 2 and pool.acquire() == 0 and pool.acquire() == 1


def test_a_ctrl_c_while_a_lease_dies_cannot_strand_its_slot():
    """The release runs no Python code that an interrupt could cut short (a
    KeyboardInterrupt in a weak reference's callback is swallowed, the slot left LEASED)."""
    import sys

    pool, leases = _leased_pool(1)

    def interrupt(frame, event, arg):
        if event == "call" and "arena_loader" in frame.f_code.co_filename:
            raise KeyboardInterrupt
        return None

    sys.settrace(interrupt)
    try:
        leases.clear()  # the lease dies here, under a trace that interrupts any call
    finally:
        sys.settrace(None)
    assert pool.state(0) is SlotState.FREE


def _reserved_bytes(arena) -> int:
    return os.fstat(arena.slab.handle().fd).st_blocks * 512


def test_a_dead_lease_recorded_before_its_slot_was_taken_back_frees_no_later_lease():
    """The release of a lease no longer tracked (its slot taken back and leased again
    before the release was collected: a batch dropped in another thread as next() undid its
    hand-out) is stale: the slot stays the later lease's, never freed under its batch."""
    pool, leases = _leased_pool(1)
    del leases[0]  # dies: recorded, not yet collected (no call into the pool since)
    pool.take_back(0)  # the race's other side: LEASED -> FILLED, the old lease untracked
    later = pool.lease(0)
    assert pool.state(0) is SlotState.LEASED and pool.acquire() is None
    del later
    assert pool.state(0) is SlotState.FREE


def test_a_slots_pages_are_reserved_the_first_time_it_is_handed_out():
    """An arena's slab reserves no page up front: a slot's pages are reserved the first time
    it is handed out, once."""
    from arena_loader._arena import Arena

    slot_nbytes = 2 << 20  # the largest page /dev/shm may give: counts hold with any size
    arena = Arena(slot_nbytes, 4)
    try:
        assert _reserved_bytes(arena) == 0 and arena.pool.backed() == 0
        first = arena.pool.acquire()
        assert _reserved_bytes(arena) == slot_nbytes
        second = arena.pool.acquire()
        assert second != first and _reserved_bytes(arena) == 2 * slot_nbytes
        arena.pool.reclaim(first)
        arena.pool.reclaim(second)
        handed = {arena.pool.acquire() for _ in range(4)}
        assert handed == {0, 1, 2, 3} and _reserved_bytes(arena) == 4 * slot_nbytes
        for slot in handed:
            arena.pool.reclaim(slot)
        arena.pool.acquire()
        assert _reserved_bytes(arena) == 4 * slot_nbytes and arena.pool.backed() == 4
    finally:
        arena.close()


def test_a_slot_goes_back_to_the_worker_it_was_handed_to_last():
    """Asked for a worker's batch, the pool hands out a free slot that worker had last, even
    behind another worker's in the free list; else the list's head."""
    from arena_loader._arena import Arena

    arena = Arena(4096, 5)
    try:
        pool = arena.pool
        assert [pool.acquire(0), pool.acquire(1), pool.acquire(0), pool.acquire(1)] == [
            0, 1, 2, 3]
        for slot in (1, 0, 3, 2):
            pool.reclaim(slot)  # the free list is now 4, 1, 0, 3, 2
        assert pool.acquire(0) == 4  # never handed out: at the head, taken as it is
        assert [pool.acquire(0), pool.acquire(1), pool.acquire(1)] == [0, 1, 3]
        pool.reclaim(4)  # 2 (worker 0's), 4 (worker 0's) are free
        assert pool.acquire(1) == 2  # none of worker 1's: the head
        assert pool.acquire() == 4  # no worker named: the head
        assert pool.acquire(0) is None
        assert pool.states().count(SlotState.ASSIGNED) == 5
    finally:
        arena.close()


def test_no_room_when_a_slot_is_first_handed_out_is_a_capacity_error_and_the_slot_stays_free(
        monkeypatch):
    """/dev/shm filled up after the slab was sized: reserving a slot's pages fails with a
    ShmCapacityError naming the slot and the fix (never a SIGBUS at the write), the slot
    stays free, and it is handed out once there is room."""
    from arena_loader._arena import Arena

    arena = Arena(4096, 2)
    try:
        real = os.posix_fallocate

        def no_space(fd, offset, length):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "posix_fallocate", no_space)
        with pytest.raises(ShmCapacityError, match=r"slot 0 of the slab \(2 slots\) needs 4,096 "
                                                   r"bytes .*No space left.*--shm-size"):
            arena.pool.acquire()
        assert arena.pool.states() == [SlotState.FREE, SlotState.FREE]
        assert arena.pool.backed() == 0
        monkeypatch.setattr(os, "posix_fallocate", real)
        assert arena.pool.acquire() == 0 and arena.pool.backed() == 1
    finally:
        arena.close()


def test_a_slot_whose_take_ctrl_c_cut_short_behind_the_free_lists_head_is_reconciled():
    """Ctrl-C in ``acquire`` after the slot (a worker's own, behind the free list's head) is
    marked ASSIGNED and before it leaves the list: nobody owns it, and ``reconcile`` frees
    it. Before, a slot still listed counted as free there, so it stayed ASSIGNED until a
    later take found it at the list's head and a later reconcile ran: with a pin or device
    thread, whose consumer now tops the window up in its own thread, a Ctrl-C there left a
    slot taken past the epoch's end (until the next epoch's)."""
    import linecache
    import sys

    from arena_loader._arena import Arena

    arena = Arena(4096, 4)
    try:
        pool = arena.pool
        assert [pool.acquire(0), pool.acquire(1), pool.acquire(0), pool.acquire(1)] == [
            0, 1, 2, 3]
        pool.reclaim(1)
        pool.reclaim(0)  # the free list is now 1, 0: worker 0's slot behind the head

        def interrupt(frame, event, arg):
            if event == "line" and linecache.getline(
                    frame.f_code.co_filename, frame.f_lineno).strip() == "free.remove(slot)":
                raise KeyboardInterrupt
            return interrupt if "_pool" in frame.f_code.co_filename else None

        sys.settrace(interrupt)
        try:
            with pytest.raises(KeyboardInterrupt):
                pool.acquire(0)
        finally:
            sys.settrace(None)
        assert pool.state(0) is SlotState.ASSIGNED  # taken, and owned by nobody
        assert pool.reconcile(owned={2, 3}) == 1
        assert pool.states() == [SlotState.FREE, SlotState.FREE, SlotState.ASSIGNED,
                                 SlotState.ASSIGNED]
        assert sorted([pool.acquire(), pool.acquire()]) == [0, 1]
        assert pool.acquire() is None  # each slot handed out once
    finally:
        arena.close()
