"""An arena: the slab of ``slots`` equal byte budgets and the pool that owns them; plus the
loader-level source that keeps one arena across epochs and counts the batches the consumer
holds outside it (docs/design.md, "Slot budget")."""

from __future__ import annotations

import functools
import os
import threading
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from . import _forksafe
from ._layout import Plan
from ._leases import HeldLimit
from ._messages import listed
from ._output import (
    NUMPY_UNPINNED,
    converted_field,
    make_converter,
    numeric_tensor_field,
    raw_field,
    tensor_field,
)
from ._pool import SlotPool, SlotState
from ._slab import Slab
from .errors import LoaderClosedError, SlotsExhaustedError, forked_iterator_error
from .snapshot import IteratorSnapshot, LoaderSnapshot

# A slot's budget is the first batch's size in whole pages (one shape wastes nothing). A larger
# batch takes a one-off segment, and the next claim of the arena (the next epoch) grows the slab
# once, to the largest such batch times this (docs/design.md, "Slot budget").
SLOT_HEADROOM = 1.25
PAGE = 4096
CLOSED = "this ArenaLoader was closed; create a new one"


def slot_budget(nbytes: int, headroom: float = 1.0) -> int:
    return max(PAGE, -(-int(nbytes * headroom) // PAGE) * PAGE)


class PinnedRegion(Protocol):
    """Page-locking of a slab (``_device.HostPinner``); ``close`` lifts it."""

    def close(self) -> None: ...


# Page-locks a whole slab array in place; None when that failed (docs/design.md, "Device copies").
Pinner = Callable[[np.ndarray], "PinnedRegion | None"]


class SegmentLease:
    """The ``.base`` of every view of a batch stored in a one-off segment; counted while alive
    as a batch the consumer holds outside the slab."""

    __slots__ = ("__weakref__", "_bytes")

    def __init__(self, storage: np.ndarray):
        self._bytes = storage  # keeps the mapping alive while any view exists

    @property
    def __array_interface__(self) -> dict:
        return self._bytes.__array_interface__


@dataclass(frozen=True)
class LeasedSlot:
    """A delivered batch before assembly, for the device copy stage: the lease on its storage
    (``np.asarray(lease)`` is its bytes) and its plan."""

    lease: Any
    plan: Plan
    objects: list
    pinned: bool  # the storage is page-locked in place (a slot of a pinned slab)

    @property
    def nbytes(self) -> int:
        return self.plan.nbytes

    def assemble(self, storage: Any, convert: Callable[[Any], Any] | None = None) -> Any:
        """The batch as views of ``storage`` (a copy of the slot, e.g. on a GPU); ``convert``
        makes each field a tensor, and a field stored as raw bits (bfloat16, say) then gets
        its torch dtype back, as on the host."""
        return self.plan.assemble(storage, self.objects,
                                  None if convert is None else functools.partial(
                                      converted_field, convert),
                                  host_bytes=np.asarray(self.lease))


class Arena:
    def __init__(self, slot_nbytes: int, slots: int, slab: Slab | None = None,
                 pinner: Pinner | None = None):
        """``slab``: a reserved slab that workers already hold, allocated here (closed if that
        fails); by default a new one. ``pinner`` page-locks the slab."""
        self.slot_nbytes = slot_nbytes
        self.slots = slots
        reserved = slab is not None
        # Lazy: /dev/shm must have room for every slot, but a slot's pages are reserved only
        # when it is first handed out (SlotPool's backer); page-locking needs them all now.
        lazy = pinner is None
        if slab is None:
            slab = Slab(slots * slot_nbytes, slots=slots, lazy=lazy)
        else:
            slab.allocate(slots * slot_nbytes, slots=slots, lazy=lazy)
        self.slab = slab
        self.pool = SlotPool(self.slab.array, slot_nbytes, slots,
                             self._back_slot if lazy else None)
        self._pinned = None
        if pinner is not None:
            try:
                self._pinned = pinner(self.slab.array)
            except BaseException as exc:
                # Ctrl-C: the workers' reserved slab stays open, for the claim made again.
                if not (reserved and isinstance(exc, KeyboardInterrupt)):
                    self.close()
                raise

    def _back_slot(self, slot: int) -> None:
        if self.slab.closed:  # close() from another thread while next() loads (num_workers=0)
            raise LoaderClosedError(CLOSED)
        self.slab.back(slot * self.slot_nbytes, self.slot_nbytes,
                       what=f"slot {slot} of the slab ({self.slots} slots)")

    @property
    def pinned(self) -> bool:
        return self._pinned is not None

    @property
    def slab_address(self) -> int | None:
        """Where the slab starts in this process; None once it is closed."""
        array = self.slab.array
        return None if array is None else array.ctypes.data

    def slot_bytes(self, slot: int) -> np.ndarray:
        start, array = slot * self.slot_nbytes, self.slab.array
        if array is None:  # closed from another thread since the slot was acquired
            raise LoaderClosedError(CLOSED)
        return array[start: start + self.slot_nbytes]

    def close(self) -> None:
        """No new batch can be made; the mapping lives on only in views still referenced."""
        # Unpin before the slab may be unmapped. Copies from it have completed: the device
        # stage synchronizes its copies before its thread ends, and it ends before this runs.
        pinned, self._pinned = getattr(self, "_pinned", None), None
        if pinned is not None:
            pinned.close()
        self.pool.close()
        self.slab.close()


class ArenaSource:
    """The loader's arena, sized from the first batch and kept across epochs; and the
    delivery of batches to the consumer (views, tensors, or leases for a device stage).

    One iterator at a time uses the arena; a second live iterator of the same loader gets a
    private one, closed when that iterator gives it back.
    """

    def __init__(self, slots: int, pinner: Pinner | None = None, lease_only: bool = False,
                 output: str | None = None, held_batch_limit: int | None = None,
                 pin_batch: Callable[[Any, list], Any] | None = None):
        self.slots = slots
        self.held_batch_limit = held_batch_limit
        self._limit = HeldLimit(held_batch_limit,
                                keep=" (keep copies with np.array(x) / x.clone())")
        self._pinner = pinner
        self._lease_only = lease_only
        self._output = output
        # output="torch" imports torch now, not at the first batch: a Ctrl-C landing in an import
        # inside next() leaves torch half-imported for good (every later next() fails, the batch
        # lost). output=None converts only tensor samples (torch is loaded).
        self._to_torch = None if output == "numpy" or lease_only else make_converter(
            "torch", lazy=output != "torch")
        # pin_memory without a device: the batch's tensors copied into torch's page-locked
        # memory (_output.tensor_pinner); its slot goes back as the views die.
        self._pin_batch = pin_batch
        self._warned_unpinned = False
        # A warning found while a batch was handed out, given at the start of the next
        # next() (warn_pending): a warnings filter that makes it an error there loses nothing.
        self.pending_warning: str | None = None
        self.slot_nbytes: int | None = None  # fixed by the first arena
        self._arena: Arena | None = None
        self._claimed = False
        self._closed = False
        self._lock = threading.Lock()
        # A weak reference to each segment batch handed out whose views are alive. Its
        # callback, this set's discard, is a C-level call (in whatever thread drops the last
        # view): no lock the dropping thread might hold, and no interrupt can cut it short (a
        # Python finalizer would swallow a Ctrl-C there and count the batch held forever).
        self._held_segments: set[weakref.ref] = set()
        self._delivered = 0  # batches handed out (or being): tells an unused iterator
        self._warned = False
        self._pid = os.getpid()
        self._outgrown = 0  # the largest batch that did not fit its slot (note_outgrown)

    def note_outgrown(self, nbytes: int) -> None:
        """A batch of ``nbytes`` did not fit its slot (it went to a segment): the next claim
        of the arena grows the slab to fit it."""
        self._outgrown = max(self._outgrown, nbytes)

    def outgrown(self, arena: Arena) -> bool:
        """A batch larger than ``arena``'s slots came: claimed again, it grows."""
        return self._outgrown > arena.slot_nbytes

    def claim(self, slot_nbytes: int | None = None, slab: Slab | None = None) -> Arena | None:
        """The loader's arena, or a private one if it is in use; None while no budget is
        known. ``slab``: the reserved slab the caller's workers hold, which the arena must
        then use (with ``slot_nbytes``, the budget learned from the caller's first batch)."""
        if os.getpid() != self._pid:  # this arena's slots are the parent's (its lock, too)
            raise forked_iterator_error(self._pid)
        with self._lock:
            if self._closed:
                if slab is not None:
                    slab.close()
                raise LoaderClosedError(CLOSED)
            if self._arena is None:
                if slot_nbytes is None and self.slot_nbytes is None:
                    return None
                budget = self.slot_nbytes or slot_nbytes
                # One statement (the budget is kept only once a slab of it exists): an
                # interrupt leaves no arena half recorded.
                self._arena, self.slot_nbytes, self._claimed = (
                    Arena(budget, self.slots, slab, self._pinner), budget, True)
                return self._arena
            if slab is not None and self._arena.slab is slab:
                self._claimed = True  # a claim of this slab that an interrupt cut short
                return self._arena
            if not self._claimed and slab is None:
                if self._outgrown > self._arena.slot_nbytes:  # grow once, while unclaimed
                    grown, old = slot_budget(self._outgrown, SLOT_HEADROOM), self._arena
                    self._arena, self.slot_nbytes = Arena(grown, self.slots, None,
                                                          self._pinner), grown
                    old.close()  # held batches keep their mapping; its slots are not reused
                self._claimed = True
                return self._arena
            budget = self.slot_nbytes
        return Arena(slot_nbytes or budget, self.slots, slab, self._pinner)

    def unclaim(self, arena: Arena) -> None:
        with self._lock:
            if arena is self._arena:
                self._claimed = False
                if not self._closed:
                    return
                self._arena = None  # the loader was closed while this session used it
        arena.close()

    def snapshot(self, iterators: tuple[IteratorSnapshot, ...]) -> LoaderSnapshot:
        """The loader's slab and slots now (``ArenaLoader.snapshot``); changes nothing."""
        with self._lock:
            arena, in_use, closed = self._arena, self._claimed, self._closed
        states = tuple(state.value for state in arena.pool.states()) if arena else ()
        segments = len(self._held_segments)
        return LoaderSnapshot(
            closed=closed, slots=self.slots, slot_nbytes=self.slot_nbytes,
            slab_nbytes=arena.slab.nbytes if arena else None,
            slab_address=arena.slab_address if arena else None,
            pinned=arena is not None and arena.pinned, in_use=in_use, slot_states=states,
            held_batches=states.count(SlotState.LEASED.value) + segments,
            held_segments=segments, iterators=iterators,
            backed_slots=arena.pool.backed() if arena else 0,
            slot_leases=arena.pool.leases() if arena else ())

    # -- held batches --------------------------------------------------------------------

    def delivered_count(self) -> int:
        """Batches ``deliver`` has handed out (or begun to) over this source's life."""
        return self._delivered

    def held(self, arena: Arena | None) -> int:
        """Batches the consumer holds: leased slots plus batches in segments."""
        return (arena.pool.held() if arena is not None else 0) + len(self._held_segments)

    def holds_the_last_slot(self, arena: Arena) -> bool:
        """No slot free, one batch held at most, no held_batch_limit (lock-free: a hint)."""
        return self.held_batch_limit is None and not self._held_segments and (
            arena.pool.full_with_one_held())

    def over_limit(self, arena: Arena | None) -> bool:
        return self._limit.reached(functools.partial(self.held, arena))

    def limit_error(self, arena: Arena | None) -> SlotsExhaustedError:
        return self._limit.error(self.held(arena))

    def check_limit(self, arena: Arena | None) -> None:
        """At next(): a SlotsExhaustedError while the consumer holds ``held_batch_limit``
        batches (after collecting garbage once: views in reference cycles)."""
        self._limit.check(functools.partial(self.held, arena))

    def note_overflow(self, arena: Arena | None) -> None:
        """A batch goes to a segment because every slot is held: warn, once per loader."""
        held = 0 if self._warned else self.held(arena)
        if held < 2:
            return
        self._warned = True
        warnings.warn(
            f"your code holds {held} batches from this ArenaLoader (every one of its "
            f"{self.slots} slots is in use), so new batches go to extra shared memory, which "
            "grows while they are held and is freed when they are dropped. To keep memory "
            "flat, keep copies of what you need (np.array(x), x.clone(), x.item()); where a "
            "training framework holds them (gradient accumulation keeps a step's batches), "
            f"pass slots= more than {self.slots} (the batches held at once plus the read-"
            "ahead); to get an error instead, pass held_batch_limit=N", UserWarning, stacklevel=4)

    def acquire_or_overflow(self, arena: Arena) -> int | None:
        """num_workers=0: a free slot, or None: the batch goes to a segment (no garbage
        collection here: it would cost a collection per batch while the user keeps batches).
        Raises when the consumer holds ``held_batch_limit`` batches."""
        slot = arena.pool.acquire()
        if slot is None and arena.pool.reconcile(set()):
            # A slot that an interrupt left ASSIGNED as it was taken (num_workers=0 owns no
            # slot between batches: each is written, then leased, within one next()).
            slot = arena.pool.acquire()
        if slot is None:
            if self.over_limit(arena):
                raise self.limit_error(arena)
            self.note_overflow(arena)
        return slot

    # -- delivery ------------------------------------------------------------------------

    def deliver(self, arena: Arena | None, slot: int | None, storage: np.ndarray | None,
                plan: Plan, idx: int, indices: Any, live_objects: list | None = None) -> Any:
        """Hand batch ``idx`` to the consumer: from a FILLED ``slot`` of ``arena`` (leased
        now) or from a segment's ``storage``; its object leaves ``live_objects`` if given."""
        lease: Any = None
        try:
            if slot is not None:
                lease = arena.pool.lease(slot)  # Ctrl-C inside: undone there
                pinned = self._lease_only and arena.pinned
            else:
                lease = SegmentLease(storage)
                # A child forked while the batch is held keeps a private copy of it.
                _forksafe.keep_across_fork(lease, storage.ctypes.data, plan.nbytes)
                held = self._held_segments  # (the reference hashes now, while alive)
                held.add(weakref.ref(lease, held.discard))
                pinned = False
            self._delivered += 1
            host = np.asarray(lease)
            try:
                objects = live_objects if live_objects is not None else (
                    plan.objects(host) if plan.objects_len else [])
            except Exception as exc:
                raise RuntimeError(
                    f"the non-array values of batch idx={idx} (indices {listed(indices)!r}) "
                    f"did not unpickle in the main process: {exc!r}; return only numbers, "
                    "arrays, str or bytes from the dataset, or objects that unpickle") from exc
            if self._lease_only:
                return LeasedSlot(lease, plan, objects, pinned)
            to_torch = self._to_torch is not None and (self._output == "torch" or plan.torch)
            if to_torch and not (plan.collated or plan.converted):
                # A collate_fn's batch is handed out as the collate_fn made it (as torch
                # does): its tensors as tensors, its numpy arrays as numpy (or tensors, for
                # output="torch"). One tensor per field: one in two places is one object.
                batch = plan.assemble(host, objects, tensor_field if self._output is None
                                      else numeric_tensor_field)
            else:
                # (batch_size=None: a tensor is one object in its places, as default_convert
                # hands it out; a numpy array gets a tensor per place, as its as_tensor does.)
                batch = plan.assemble(host, objects, tensor_field if to_torch and plan.converted
                                      else raw_field if plan.raw else None)
                if to_torch:
                    # (object leaves handed out as they came: only batches that have any)
                    kept = frozenset(id(objects[i]) for i in plan.leaf_objects) \
                        if plan.leaf_objects else frozenset()
                    batch = self._to_torch(batch, plan.collated, plan.converted, kept,
                                           self._output == "torch")
            if self._pin_batch is not None:
                numpy_left: list = []
                batch = self._pin_batch(batch, numpy_left)
                if numpy_left and not self._warned_unpinned:
                    self._warned_unpinned = True
                    self.pending_warning = NUMPY_UNPINNED  # given by the next next()
            return batch
        except KeyboardInterrupt:
            if slot is not None and lease is not None:  # not handed out: FILLED again, kept
                arena.pool.unlease(lease)
            raise

    def warn_pending(self, stacklevel: int) -> None:
        """Give the pending warning (the caller checked ``pending_warning``), before the
        ``next()`` that gives it has taken any batch."""
        message, self.pending_warning = self.pending_warning, None
        if message is not None:
            warnings.warn(message, UserWarning, stacklevel=stacklevel + 1)

    def close(self) -> None:
        """No new arena; the loader's own is closed now, or by ``unclaim`` if a session still
        uses it (its workers may be starting with the slab's descriptor)."""
        with self._lock:
            self._closed = True
            if self._arena is not None and not self._claimed:
                self._arena.close()
                self._arena = None

