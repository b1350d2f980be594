"""``ArenaLoader.snapshot()``: the read-only introspection hook that tests and users read
instead of the loader's private attributes."""

from __future__ import annotations

import dataclasses
import gc
import os
import signal

import numpy as np
import pytest

from arena_loader import ArenaLoader, LoaderSnapshot, WorkerCrashedError
from arena_loader.snapshot import SLOT_STATES

from .datasets import ImageDataset, reference_epoch

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_snapshot_follows_the_slab_and_the_slots_of_held_batches(num_workers):
    """No slab before the first batch; then the slab's size, one leased slot per batch held,
    and every slot free once the batches are dropped; close() leaves no slab."""
    dataset = ImageDataset(12, shape=(4,), dtype=np.float32)
    with ArenaLoader(dataset, batch_size=3, num_workers=num_workers, slots=5) as loader:
        before = loader.snapshot()
        assert isinstance(before, LoaderSnapshot)
        assert (before.slot_nbytes, before.slab_nbytes, before.slab_address) == (None,) * 3
        assert before.slot_states == () and before.iterators == () and not before.in_use
        assert sum(1 for _ in loader) == 4  # the first epoch sizes the slab
        sized = loader.snapshot()
        assert sized.slab_nbytes == sized.slots * sized.slot_nbytes == 5 * sized.slot_nbytes
        assert sized.slot_states == ("free",) * 5
        assert SLOT_STATES == ("free", "assigned", "filled", "leased")
        held = [batch for batch in loader]  # every batch of this epoch kept
        snapshot = loader.snapshot()
        assert snapshot.leased_slots == snapshot.held_batches == 4
        assert snapshot.held_segments == 0 and snapshot.free_slots == 1
        assert not snapshot.in_use  # the epoch ended: its iterator gave the slab back
        addresses = {batch.__array_interface__["data"][0] for batch in held}
        assert {address - snapshot.slab_address for address in addresses} <= {
            slot * snapshot.slot_nbytes for slot in range(snapshot.slots)}
        assert len(addresses) == 4  # four batches, four slots
        del held
        gc.collect()
        assert loader.snapshot().free_slots == 5 and loader.snapshot().held_batches == 0
    closed = loader.snapshot()
    assert closed.closed and closed.slab_nbytes is None and closed.slot_states == ()


def test_snapshot_is_a_frozen_copy_and_taking_it_changes_no_batch():
    """A snapshot does not change as the loader goes on, cannot be assigned to, and an epoch
    read with a snapshot before every next() is the same epoch."""
    dataset = ImageDataset(16, shape=(3,), dtype=np.int64)
    expected = reference_epoch(dataset, 2, False)
    with ArenaLoader(dataset, batch_size=2, num_workers=2) as loader:
        iterator = iter(loader)
        first = loader.snapshot()
        in_flight = first.iterators[0].in_flight
        got = []
        for _ in range(len(expected)):
            loader.snapshot()
            got.append(next(iterator).copy())
        assert next(iterator, None) is None  # the epoch ended: the session is finished now
        with pytest.raises(dataclasses.FrozenInstanceError):
            first.slots = 1  # type: ignore[misc]
        assert first.iterators[0].phase == "running"
        assert first.iterators[0].in_flight == in_flight and in_flight
        for batch, reference in zip(got, expected, strict=True):
            np.testing.assert_array_equal(batch, reference)
        del iterator


def test_snapshot_names_worker_pids_phase_and_batches_in_flight():
    """Each live iterator: its workers' pids (those of ``iterator.worker_pids``), the idx of
    the batches they are loading or that wait to be handed out, and the epoch's phase."""
    with ArenaLoader(ImageDataset(20), batch_size=2, num_workers=2) as loader:
        iterator = iter(loader)
        next(iterator)
        (epoch,) = loader.snapshot().iterators
        assert epoch.phase == "running"
        assert epoch.worker_pids == tuple(iterator.worker_pids) and len(epoch.worker_pids) == 2
        owed = epoch.in_flight + epoch.ready
        assert owed and min(owed) == 1 and len(set(owed)) == len(owed)
        assert sum(1 for _ in iterator) == 9
        (epoch,) = loader.snapshot().iterators
        assert (epoch.phase, epoch.in_flight, epoch.ready) == ("finished", (), ())
        del iterator
        gc.collect()
        assert loader.snapshot().iterators == ()


def test_a_worker_killed_by_its_snapshot_pid_fails_the_epoch():
    """The pids are real: killing one fails that epoch with WorkerCrashedError naming it, and
    the snapshot then says "failed"."""
    with ArenaLoader(ImageDataset(40), batch_size=2, num_workers=2) as loader:
        iterator = iter(loader)
        next(iterator)
        victim = loader.snapshot().iterators[0].worker_pids[1]
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(WorkerCrashedError, match=rf"\(pid {victim}\)"):
            for _ in iterator:
                pass
        assert loader.snapshot().iterators[0].phase == "failed"
        del iterator


def test_persistent_workers_are_one_iterator_on_the_same_pids_every_epoch():
    """With persistent workers every epoch reuses one iterator: one snapshot entry, whose
    pids do not change between epochs."""
    with ArenaLoader(ImageDataset(8), batch_size=2, num_workers=2,
                     persistent_workers=True) as loader:
        pids = []
        for _ in range(2):
            assert sum(1 for _ in loader) == 4
            (epoch,) = loader.snapshot().iterators
            pids.append(epoch.worker_pids)
        assert pids[0] == pids[1] and len(pids[0]) == 2
