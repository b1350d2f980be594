"""Slot ownership: the one place that knows which slot is where in its lifecycle.

``FREE -> ASSIGNED`` (a task names it) ``-> FILLED`` (its worker reported it) ``-> LEASED``
(handed to the consumer) ``-> FREE`` once every view of the batch has been garbage-collected.
A slot whose task failed or was abandoned goes ``ASSIGNED/FILLED -> FREE`` by ``reclaim``.
Any other transition is a bug and raises (docs/design.md, "Slot lifecycle"). The states,
the free list and the release of dead leases are the lease ring's (``_leases.LeaseRing``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import numpy as np

from ._forksafe import keep_across_fork
from ._leases import LeaseRing, LeaseState
from .errors import LoaderClosedError

SlotState = LeaseState  # a slot's states are the lease ring's


class SlotLease:
    """The consumer's claim on one slot: the ``.base`` of every array view of a batch.

    When the last view dies, this object dies and its pool's weak reference returns the slot.
    """

    __slots__ = ("__array_interface__", "__weakref__", "_bytes", "slot")

    def __init__(self, slot: int, slab_bytes: np.ndarray, interface: dict):
        self.slot = slot
        self._bytes = slab_bytes  # keeps the slab mapping alive while any view exists
        # The slot's bytes, computed once per slot by the pool: an attribute, not a property
        # (numpy reads it on every np.asarray; building it each time cost a microsecond).
        self.__array_interface__ = interface

    def __repr__(self) -> str:
        return f"SlotLease(slot={self.slot})"


class Waker:
    """A self-pipe: lets any thread (even a finalizer inside GC) wake a ``wait()`` loop."""

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        os.set_blocking(self._read_fd, False)
        # Re-entrant: a finalizer may run inside GC while this thread already holds it.
        self._lock = threading.RLock()

    def fileno(self) -> int:
        return self._read_fd

    def wake(self) -> None:
        if os.getpid() != self._pid:
            return  # a lease finalizer run in a forked worker: the pipe is the parent's
        with self._lock:
            if self._write_fd >= 0:
                try:
                    os.write(self._write_fd, b"\0")
                except BlockingIOError:
                    pass  # already full of wake-ups: the reader will wake anyway
                except OSError:
                    pass  # its reader is closed (a close that Ctrl-C cut short): nobody waits

    def drain(self) -> None:
        try:
            while os.read(self._read_fd, 4096):
                pass
        except OSError:  # empty (BlockingIOError), or closed meanwhile
            pass

    def close(self) -> None:
        with self._lock:  # each descriptor forgotten in the statement that takes it
            write_fd, self._write_fd = self._write_fd, -1
            if write_fd >= 0:
                os.close(write_fd)
            read_fd, self._read_fd = self._read_fd, -1
            if read_fd >= 0:
                os.close(read_fd)


class SlotPool(LeaseRing):
    """Owns the slot states of one slab. Thread-safe; a lease's death is lock-free.

    ``backer(slot)`` (when given) reserves a slot's pages the first time it is handed out, so
    a slab sized while the first batches are still in one-off segments holds no memory until
    its slots are used (docs/design.md, "Slab"). Freed slots go to the back of the free list,
    so with the default slot count each slot stays with one worker: orders that use fewer
    slots (the slot freed last first; a used slot before a never-used one) hand slots to
    both workers in turn, which made image batches 20% slower for ~5 epochs, though every
    page fault was in the first (docs/benchmarks.md, "Engine v3, eighth stage")."""

    _kind = "slot"

    def __init__(self, slab_array: np.ndarray, slot_nbytes: int, slots: int,
                 backer: Callable[[int], None] | None = None):
        super().__init__(slots)
        self._backer = backer
        self._backed = [backer is None] * slots
        self._writer = [-1] * slots  # the worker each slot was last handed to (-1: none yet)
        self._leases = [0] * slots  # batches each slot has carried (introspection)
        self._slab_array = slab_array
        self._slab_address = slab_array.ctypes.data
        self.slot_nbytes = slot_nbytes
        self._lock = threading.Lock()
        self.waker: Waker | None = None  # set by whoever waits for free slots
        self._interfaces = [
            slab_array[slot * slot_nbytes: (slot + 1) * slot_nbytes].__array_interface__
            for slot in range(slots)]

    def acquire(self, worker: int = -1, wake: bool = True) -> int | None:
        """A free slot, now ASSIGNED; None when every slot is in use. For ``worker`` (>= 0):
        a free slot handed to that worker last time if there is one (``_keep_with``).
        ``wake``: when none is free, the next slot freed wakes ``waker`` (a ``next()`` that
        will wait for it); without, a failed call arms nothing (each wake is a write to a
        pipe, and the caller may not wait)."""
        with self._lock:
            free = self._free
            if self._released or not free or self._states[free[0]] is not SlotState.FREE:
                self._collect_released()
            if not free:
                if not wake:
                    return None
                # Flag first, then look again: a release that appended after the first look
                # either shows up now or sees the flag and wakes the waiter.
                self._want(True)
                self._collect_released()
                if not self._free:
                    return None
            if self._wanted:
                self._want(False)
            slot = free[0]
            if worker >= 0:
                writer = self._writer[slot]
                if writer != worker and writer >= 0:
                    slot = self._keep_with(worker)
                self._writer[slot] = worker
            if not self._backed[slot]:
                # Raises ShmCapacityError (/dev/shm is full): the slot stays FREE and listed.
                self._backer(slot)
                self._backed[slot] = True
            # Moved, then dropped from the free list: interrupted between, the entry left in
            # the list is no longer FREE and every pick skips it (_keep_with; _collect_released
            # once it heads the list); a caller interrupted before it records the slot leaves
            # it ASSIGNED and unowned, for reconcile().
            self._states[slot] = SlotState.ASSIGNED  # (FREE: checked by whoever picked it)
            if slot == free[0]:
                free.popleft()
            else:  # (only when the head was another worker's)
                free.remove(slot)
            return slot

    def _keep_with(self, worker: int) -> int:
        """The free slot for ``worker`` when the list's head was another worker's: the first
        free one it was handed last, else the head. (Slots never handed out are at the head
        of the list until every one has been.) A slot written by one worker after another
        cost 30-40% more of the workers' CPU per image batch here, for several epochs
        (docs/benchmarks.md, "Engine v3, eighth stage"); with the free list's order alone,
        a slot count that is not a multiple of the workers hands each slot to every worker
        in turn."""
        states, writers = self._states, self._writer
        for slot in self._free:
            # (skipping an entry that an interrupted pick left behind)
            if writers[slot] == worker and states[slot] is SlotState.FREE:
                return slot
        return self._free[0]

    def mark_filled(self, slot: int) -> None:
        """ASSIGNED -> FILLED; a slot already FILLED stays so (a record filed twice)."""
        with self._lock:
            state = self._states[slot]
            if state is SlotState.ASSIGNED:
                self._states[slot] = SlotState.FILLED
            elif state is not SlotState.FILLED:
                self._move(slot, SlotState.ASSIGNED, SlotState.FILLED)  # raises

    def lease(self, slot: int) -> SlotLease:
        lease = None
        try:
            with self._lock:
                if self._slab_array is None:
                    raise LoaderClosedError("the loader was closed; create a new one")
                if self._states[slot] is not SlotState.FILLED:
                    self._move(slot, SlotState.FILLED, SlotState.LEASED)  # raises
                self._states[slot] = SlotState.LEASED
                self._leases[slot] += 1
            lease = SlotLease(slot, self._slab_array, self._interfaces[slot])
            # A process forked while the batch lives gets its own copy of the slot's bytes.
            keep_across_fork(lease, self._slab_address + slot * self.slot_nbytes,
                             self.slot_nbytes)
            self._track(slot, lease)  # its death returns the slot
            return lease
        except BaseException:  # Ctrl-C before the lease was handed back: undo it whole
            self._untrack(slot)
            with self._lock:  # by state, not a flag: Ctrl-C may land right after the move
                if self._states[slot] is SlotState.LEASED:
                    self._states[slot] = SlotState.FILLED
            raise

    def unlease(self, lease: SlotLease) -> None:
        """Undo ``lease`` (the batch was never handed out): its slot is FILLED again."""
        if self.tracks(lease.slot, lease):
            self.take_back(lease.slot)

    def take_back(self, slot: int) -> None:
        """Undo the lease of ``slot`` whose batch was never handed out (the lease object may
        still exist, held by an interrupted frame: its death no longer frees the slot)."""
        if self._untrack(slot):
            with self._lock:
                self._move(slot, SlotState.LEASED, SlotState.FILLED)

    def close(self) -> None:
        """Drop the slab reference: leases already given keep their own."""
        with self._lock:
            self._slab_array = None  # type: ignore[assignment]

    def reclaim(self, slot: int) -> None:
        """Return an ASSIGNED or FILLED slot whose batch will never reach the consumer (one
        already FREE stays so: a record filed twice)."""
        with self._lock:
            state = self._states[slot]
            if state is SlotState.FREE:
                return
            if state not in (SlotState.ASSIGNED, SlotState.FILLED):
                raise RuntimeError(f"slot {slot} cannot be reclaimed from state {state.value}")
            self._states[slot] = SlotState.FREE
            self._free.append(slot)
            wanted = self._wanted
        if wanted and self.waker is not None:
            self.waker.wake()

    def backed(self) -> int:
        """Slots whose pages are reserved (handed out at least once, or all of them)."""
        return sum(self._backed)

    def leases(self) -> tuple[int, ...]:
        """How many batches each slot has carried to the consumer."""
        return tuple(self._leases)

    def full_with_one_held(self) -> bool:
        """No slot free or released, one LEASED at most. Lock-free, so a hint: a release
        racing it may be missed (the caller's send then waits one ``next()`` more)."""
        return not self._free and not self._released and (
            self._states.count(SlotState.LEASED) <= 1)

    def counts(self) -> dict[SlotState, int]:
        with self._lock:
            self._collect_released()
            result = dict.fromkeys(SlotState, 0)
            for state in self._states:
                result[state] += 1
            return result

    def held(self) -> int:
        """LEASED slots: the batches the consumer holds in the slab."""
        with self._lock:
            self._collect_released()
            return super().held()

    def states(self) -> list[SlotState]:
        """Each slot's state, by slot number."""
        with self._lock:
            self._collect_released()
            return list(self._states)

    def state(self, slot: int) -> SlotState:
        with self._lock:
            self._collect_released()
            return self._states[slot]

    def reconcile(self, owned: set[int]) -> int:
        """Free every ASSIGNED or FILLED slot not in ``owned`` (slots whose batch the caller
        lost track of, e.g. to Ctrl-C between two steps) and list every FREE slot as free.
        Returns how many slots were recovered."""
        with self._lock:
            self._collect_released()
            free, states = self._free, self._states
            # An entry a take that Ctrl-C cut short left listed behind the head (no longer
            # FREE) goes: unowned, its slot is recovered below like any other.
            for slot in [slot for slot in free if states[slot] is not SlotState.FREE]:
                free.remove(slot)
            listed = set(free)
            recovered = [slot for slot, state in enumerate(self._states)
                         if slot not in listed and (state is SlotState.FREE or (
                             state in (SlotState.ASSIGNED, SlotState.FILLED)
                             and slot not in owned))]
            for slot in recovered:
                self._states[slot] = SlotState.FREE
            self._free.extend(recovered)
            return len(recovered)
