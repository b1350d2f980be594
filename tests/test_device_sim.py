"""The device leg under numba's CUDA simulator: contents, order, slot and buffer lifecycles,
fallbacks. The simulator must be chosen before numba.cuda is first imported, so this module
runs in its own interpreter (``test_device.py::test_device_leg_passes_under_the_simulator``
starts it with ``NUMBA_ENABLE_CUDASIM=1``); in a plain run it is skipped."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import threading
import time
import warnings
import weakref

import numpy as np
import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    pytest.skip("needs NUMBA_ENABLE_CUDASIM=1 before numba.cuda is imported; "
                "test_device.py runs this module that way", allow_module_level=True)

from arena_loader import ArenaLoader, LoaderClosedError, SlotsExhaustedError
from arena_loader._device import cuda as device_cuda
from arena_loader._device.ring import DeviceRing

from .conftest import live_children, our_threads, run_in_threads, wait_until
from .datasets import (
    CountedBatches,
    ImageDataset,
    NestedDataset,
    RaisingDataset,
    ShardedStream,
    SlowDataset,
    assert_batches_equal,
    assert_epoch_equal,
    draws_per_next,
    host_copy,
    host_epoch,
    reference_epoch,
)
from .test_pin_stage import (
    ctrl_c_at_each_line_after_the_first_error,
    host_idle,
    loader_worker_pids,
)

pytestmark = pytest.mark.timeout(60)


def address(device_array) -> int:
    """Where a (simulated) device array's memory starts."""
    # The simulator's device array answers for the numpy array it wraps.
    return device_array.__array_interface__["data"][0]


class GatedEvent:
    """A CUDA event whose copy "completes" only when the test opens it; logs its streams."""

    def __init__(self, gated: bool = True):
        self.opened = threading.Event()
        self.recorded_on: list = []
        self.waited_on: list = []
        self.waiting = False
        self.gated = gated
        if not gated:
            self.opened.set()

    def record(self, stream=0):
        if self.recorded_on and self.gated:
            self.opened.clear()  # recorded again (a reused event): pending until opened again
        self.recorded_on.append(stream)

    def wait(self, stream=0):
        self.waited_on.append(stream)

    def synchronize(self):
        self.waiting = True
        assert self.opened.wait(20), "the test never completed this copy"

    @property
    def is_copy(self) -> bool:
        """Recorded on the loader's copy stream (fences are recorded on the consumer's, 0)."""
        return any(not isinstance(stream, int) for stream in self.recorded_on)


class EventLog(list):
    """Every event the device code made, in order; ``gated=False`` completes copies at once."""

    gated = True


@pytest.fixture
def gated_events(monkeypatch):
    events = EventLog()

    def new_event():
        events.append(GatedEvent(events.gated))
        return events[-1]

    monkeypatch.setattr(device_cuda, "new_event", new_event)
    yield events
    for event in events:  # never leave the device thread blocked
        event.opened.set()


@pytest.fixture
def pinned_in_place(monkeypatch):
    """Registration succeeds (the simulator has no mempin): records what was pinned."""
    pinned: list = []

    class Registration:
        def __init__(self, array):
            self.nbytes = array.nbytes

    def register(array):
        pinned.append(Registration(array))
        return pinned[-1]

    monkeypatch.setattr(device_cuda, "register", register)
    return pinned


def copy_events(events):
    return [event for event in events if event.is_copy]


@pytest.mark.filterwarnings("ignore:pin_memory=True. page-locking:UserWarning")
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("pin_memory", [False, True])
def test_device_batches_match_host_batches_in_order(num_workers, pin_memory):
    """Nested dict/tuple/namedtuple batches arrive on the device with the host loader's
    contents, in the same shuffled order; strings stay Python objects."""
    dataset = NestedDataset(23)
    options = dict(batch_size=4, shuffle=True, num_workers=num_workers)
    expected = host_epoch(dataset, generator=7, **options)
    with ArenaLoader(dataset, generator=7, pin_memory=pin_memory, device="cuda",
                     **options) as loader:
        batches = list(loader)
        assert len(batches) == len(expected) == 6
        for i, (batch, reference) in enumerate(zip(batches, expected)):
            assert not isinstance(batch["image"], np.ndarray)
            assert hasattr(batch["pair"][0], "copy_to_host")
            assert_batches_equal(host_copy(batch), reference, f"batch {i}")


@pytest.mark.parametrize("slots", [2, 3, 5])
def test_fewer_slots_with_a_device_deliver_every_batch_in_order(slots):
    """A device stage (which holds host batches while it copies them) with fewer slots than
    its read-ahead: a send that finds no free slot waits or goes to a segment, never hangs,
    and two epochs arrive with the host loader's contents in order."""
    dataset = NestedDataset(40)
    options = dict(batch_size=4, num_workers=2, persistent_workers=True)
    expected = host_epoch(dataset, **options)
    with ArenaLoader(dataset, device="cuda", slots=slots, **options) as loader:
        for epoch in range(2):
            assert_epoch_equal(loader, expected, f"epoch {epoch}")


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("dataset, options", [
    (NestedDataset(5), dict(batch_size=None)),
    (ShardedStream(22), dict(batch_size=4)),
], ids=["unbatched", "iterable"])
def test_unbatched_and_iterable_datasets_reach_the_device(num_workers, dataset, options):
    """batch_size=None keeps Python numbers as numbers and arrays on the device; an
    iterable-style dataset's batches arrive like the host loader's."""
    expected = host_epoch(dataset, num_workers=num_workers, **options)
    with ArenaLoader(dataset, num_workers=num_workers, device="cuda", **options) as loader:
        batches = [host_copy(batch) for batch in loader]
    assert len(batches) == len(expected) > 0
    for i, (batch, reference) in enumerate(zip(batches, expected)):
        assert_batches_equal(batch, reference, f"batch {i}")
    if options["batch_size"] is None:
        assert isinstance(batches[0]["label"], int) and isinstance(batches[0]["point"].x, float)


@pytest.mark.parametrize("pinned", [False, True], ids=["pageable", "pinned_in_place"])
def test_host_slot_returns_to_workers_only_after_its_copy_event(pinned, gated_events,
                                                                request):
    """Copying straight from the slab, a slot stays leased until its copy's event has
    completed, even after the consumer has the device batch."""
    if pinned:
        request.getfixturevalue("pinned_in_place")
    dataset = ImageDataset(12, shape=(4, 4))
    expected = host_epoch(dataset, batch_size=2)
    with ArenaLoader(dataset, batch_size=2, slots=4, device="cuda",
                     pin_memory=pinned) as loader:
        iterator = iter(loader)
        first = next(iterator)
        # The thread copied batch 1 too and now waits for batch 0's copy to complete.
        assert wait_until(lambda: copy_events(gated_events)
                          and copy_events(gated_events)[0].waiting)
        held = loader.snapshot()
        assert held.slot_states[:2] == ("leased", "leased")
        copy_events(gated_events)[0].opened.set()
        # Released: free, or (a freed slot is handed out first) carrying a later batch.
        assert wait_until(lambda: loader.snapshot().slot_states[0] == "free"
                          or loader.snapshot().slot_leases[0] > held.slot_leases[0])
        # Batch 1's copy is still "in flight": its slot has carried no other batch.
        now = loader.snapshot()
        assert now.slot_states[1] == "leased" and now.slot_leases[1] == held.slot_leases[1]
        for event in gated_events:
            event.opened.set()
        rest = []
        for batch in iterator:
            for event in gated_events:
                event.opened.set()
            rest.append(host_copy(batch))
    for i, (batch, reference) in enumerate(zip([host_copy(first), *rest], expected)):
        assert_batches_equal(batch, reference, f"batch {i}")
    assert len(rest) == len(expected) - 1


def test_staging_fallback_warns_once_and_frees_the_slot_once_staged(gated_events):
    """Without page-locking (the simulator has no mempin), pin_memory copies through pinned
    staging buffers: one warning per loader, and a slot is free as soon as it is staged."""
    dataset = ImageDataset(12, shape=(4, 4))
    with pytest.warns(UserWarning, match=r"pin_memory=True: page-locking the \d+-byte slab in "
                                         r"place failed .*staging buffers") as caught:
        loader = ArenaLoader(dataset, batch_size=2, slots=4, device="cuda", pin_memory=True)
        iterator = iter(loader)
        next(iterator)
    assert len(caught) == 1
    with loader:
        assert wait_until(lambda: copy_events(gated_events)
                          and copy_events(gated_events)[0].waiting)
        # Batch 0's copy has not completed, yet batches 0 and 1 are staged: both slots free.
        assert loader.snapshot().leased_slots == 0
        for event in gated_events:
            event.opened.set()
        rest = _drain(iterator, gated_events)
        assert len(rest) == 5
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a second epoch and a second arena: no new warning
            first = iter(loader)
            second = iter(loader)  # a private arena of its own: pinning fails again, silently
            assert len(_drain(second, gated_events)) == 6
            assert len(_drain(first, gated_events)) == 6


def _drain(iterator, gated_events) -> list:
    batches = []
    for batch in iterator:
        for event in gated_events:
            event.opened.set()
        batches.append(host_copy(batch))
    return batches


def test_pinned_slab_is_registered_once_and_unregistered_at_close(pinned_in_place):
    """pin_memory page-locks the whole slab once, in place (no warning); close() lifts it."""
    dataset = ImageDataset(10, shape=(8,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = ArenaLoader(dataset, batch_size=2, pin_memory=True, device="cuda")
        for _ in range(2):
            assert len(list(loader)) == 5
    assert len(pinned_in_place) == 1
    assert pinned_in_place[0].nbytes == loader.snapshot().slab_nbytes
    registration = weakref.ref(pinned_in_place.pop())
    loader.close()
    gc.collect()
    assert registration() is None, "the slab is still registered after close()"


def test_pin_memory_without_device_never_page_locks_the_slab(pinned_in_place):
    """pin_memory alone keeps numpy batches, views of a slab that stays pageable: a slot is
    rewritten once its batch is dropped, which a page-locked slot would let an asynchronous
    copy still read (docs/design.md, "pin_memory without a device")."""
    dataset = ImageDataset(6, shape=(3,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no accelerator for torch here; numpy not pinned
        with ArenaLoader(dataset, batch_size=3, pin_memory=True) as loader:
            batches = list(loader)
            assert all(isinstance(batch, np.ndarray) for batch in batches)
            np.testing.assert_array_equal(batches[1][0], dataset[3])
            assert pinned_in_place == [] and not loader.snapshot().pinned
            del batches


def test_held_device_batches_keep_their_buffers_and_contents():
    """A device buffer is not overwritten while the consumer references its batch."""
    dataset = ImageDataset(40, shape=(16,))
    expected = host_epoch(dataset, batch_size=2)
    with ArenaLoader(dataset, batch_size=2, slots=8, device="cuda") as loader:
        held, later = [], []
        for i, batch in enumerate(loader):
            if i < 5:
                held.append(batch)
            else:
                later.append(address(batch))
                for j, old in enumerate(held):
                    np.testing.assert_array_equal(old.copy_to_host(), expected[j])
        assert len({address(batch) for batch in held}) == 5
        assert not {address(batch) for batch in held} & set(later)


def test_released_buffers_are_reused_behind_a_fence_on_the_consumer_stream(gated_events):
    """A dropped batch's buffer is copied into again, but only after a fence recorded on the
    consumer's stream (work queued on the old batch finishes first)."""
    gated_events.gated = False
    dataset = ImageDataset(30, shape=(16,))
    addresses = []
    with ArenaLoader(dataset, batch_size=2, slots=8, device="cuda") as loader:
        for batch in loader:
            addresses.append(address(batch))
            del batch
    assert len(addresses) == 15
    assert len(set(addresses)) < 8, "released buffers were never reused"
    fences = [event for event in gated_events if not event.is_copy]
    assert fences and all(set(event.recorded_on) == {0} for event in fences)
    # Events are made once per buffer and recorded again: no event per batch.
    assert len(gated_events) <= 2 * 8 and any(len(e.recorded_on) > 1 for e in gated_events)
    assert any(not isinstance(stream, int) for fence in fences for stream in fence.waited_on), \
        "no copy waited on a fence before reusing a buffer"


def test_device_lease_death_returns_its_buffer_behind_a_fence():
    """The ring alone: a buffer comes back exactly when its lease dies (not while any view
    of it lives), FREE behind the fence recorded then, and is the one taken next."""
    ring = DeviceRing(2)
    index, fence = ring.take(64)
    assert fence is None
    lease = ring.lease(index)
    ring.hand_out(index)
    view = device_cuda.DeviceFields(lease).field(8, 16, np.dtype(np.float32), (2, 2))
    del lease
    gc.collect()
    assert ring.held() == 1 and ring.fence_released(0) == 0  # the view keeps the lease
    second, _ = ring.take(64)
    assert second != index and ring.take(64) is None  # the limit: nothing free
    del view
    gc.collect()
    assert ring.fence_released(0) == 1 and ring.held() == 0
    again, fence = ring.take(64)
    assert again == index and fence is not None, "a dead lease did not return its buffer"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_dropped_device_batch_frees_its_buffer_while_the_next_one_loads(num_workers):
    """The device thread keeps no reference to a batch it queued: dropped by the consumer
    while the thread waits for the next host batch, its buffer comes back (with
    held_batch_limit=1, each next() after dropping the last batch succeeds)."""
    dataset = SlowDataset(16, slow_indices=range(16), delay_s=0.05, shape=(4,))
    options = dict(batch_size=2, num_workers=num_workers, held_batch_limit=1, device="cuda",
                   prefetch_factor=1 if num_workers else None)
    firsts = []
    with ArenaLoader(dataset, **options) as loader:
        iterator = iter(loader)
        for _ in range(8):
            batch = next(iterator)  # the thread is loading the next one (0.1 s)
            firsts.append(int(batch.copy_to_host()[0][0]))
            del batch
        assert sum(1 for _ in iterator) == 0
    assert firsts == [dataset[i][0] for i in range(0, 16, 2)]


def take_until_refused(iterator, held: list, taken: list) -> str:
    """Keep every batch in ``held`` (its first value in ``taken``) until next() raises
    SlotsExhaustedError; the number of held batches the error names."""
    while True:
        try:
            held.append(next(iterator))  # (no local: the error's traceback would keep it)
        except SlotsExhaustedError as error:
            return re.search(r"holds (\d+) batches", str(error)).group(1)
        taken.append(int(host_copy(held[-1])[0][0]))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_host_and_device_count_held_batches_alike_for_held_batch_limit(num_workers):
    """held_batch_limit=3 means the same on the host and on the GPU: three batches held, the
    next next() raises naming 3; each batch dropped (or only in a reference cycle) lets
    exactly one more come; nothing is lost. Batches queued or being copied are not held."""
    dataset = ImageDataset(40, shape=(4,))
    counts = {}
    for device in (None, "cuda"):
        with ArenaLoader(dataset, batch_size=2, num_workers=num_workers, held_batch_limit=3,
                         device=device) as loader:
            iterator = iter(loader)
            held, taken = [], []
            refused = [(take_until_refused(iterator, held, taken), len(held))]
            del held[0]
            refused.append((take_until_refused(iterator, held, taken), len(held)))
            cycle = [held.pop()]
            cycle.append(cycle)  # held only by a garbage cycle: collected before raising
            del cycle
            refused.append((take_until_refused(iterator, held, taken), len(held)))
            held.clear()
            taken.extend(int(host_copy(batch)[0][0]) for batch in iterator)
            counts[device] = refused
            assert taken == [dataset[i][0] for i in range(0, 40, 2)], device
    assert counts[None] == counts["cuda"] == [("3", 3)] * 3, counts


@pytest.mark.parametrize("num_workers", [0, 1])
def test_holding_device_batches_grows_and_held_batch_limit_raises_naming_it(num_workers):
    """Keeping device batches works (more buffers are allocated, as torch's memory grows);
    with held_batch_limit it is a SlotsExhaustedError naming that option, not a hang, and
    dropping them lets the epoch go on with no batch lost."""
    dataset = ImageDataset(20, shape=(4,))
    options = dict(batch_size=2, slots=3, num_workers=num_workers,
                   prefetch_factor=1 if num_workers else None, device="cuda")
    with ArenaLoader(dataset, **options) as loader:
        kept = list(loader)
        assert [b.copy_to_host()[0][0] for b in kept] == [dataset[i][0] for i in range(0, 20, 2)]
    with ArenaLoader(dataset, held_batch_limit=3, **options) as loader:
        iterator = iter(loader)
        held = [next(iterator) for _ in range(3)]
        # Raised by the device stage, which counts batches on the GPU (the host side counts
        # none: the slot it is still copying from is not the user's).
        with pytest.raises(SlotsExhaustedError, match=r"3 batches on the GPU.*held_batch_limit=3"):
            next(iterator)
        np.testing.assert_array_equal(held[2].copy_to_host()[0], dataset[4])
        del held
        assert sum(1 for _ in iterator) == 7  # one batch held at a time


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataset_error_is_raised_at_its_batch_and_loading_goes_on(num_workers):
    """A failing batch raises its own error from next() in order; later batches arrive."""
    dataset = RaisingDataset(12, bad={5})
    with ArenaLoader(dataset, batch_size=2, num_workers=num_workers, device="cuda") as loader:
        iterator = iter(loader)
        got = [next(iterator).copy_to_host() for _ in range(2)]
        with pytest.raises(ValueError, match="sample 5 is corrupt"):
            next(iterator)
        got += [batch.copy_to_host() for batch in iterator]
    assert len(got) == 5
    np.testing.assert_array_equal(got[2][0], dataset[6])


def test_copy_error_is_raised_by_every_next_and_a_dropped_iterator_stops_its_workers(
        monkeypatch):
    """A failure in the device thread (a CUDA error) reaches next(), again on each call, with
    where in the thread it failed; close is clean. The stage kept the one error object and
    raised it each time, so its traceback came to hold the iterator, which the stage's
    finalizer keeps: a dropped iterator was never collected and its workers and slab lived
    on (now each next() raises a copy)."""
    def broken(buffer, source, stream):
        raise RuntimeError("CUDA_ERROR_ILLEGAL_ADDRESS (simulated)")

    monkeypatch.setattr(device_cuda, "copy_to_buffer", broken)
    with ArenaLoader(ImageDataset(8), batch_size=2, num_workers=2, device="cuda") as loader:
        iterator = iter(loader)
        for _ in range(2):
            with pytest.raises(RuntimeError, match="simulated") as raised:
                next(iterator)
        notes = "".join(getattr(raised.value, "__notes__", ()))
        del iterator, raised
        gc.collect()
        assert wait_until(lambda: not live_children(), timeout_s=3)
    assert "in _copy_all" in notes  # where in the device thread it failed


@pytest.mark.parametrize("num_workers", [0, 2])
def test_close_and_abandon_mid_epoch_join_the_device_thread(num_workers):
    """close() mid-epoch stops the device thread; next() then says the iterator was closed;
    an abandoned iterator's thread is joined when it is collected."""
    dataset = ImageDataset(40, shape=(4,))
    loader = ArenaLoader(dataset, batch_size=2, num_workers=num_workers, device="cuda")
    iterator = iter(loader)
    kept = next(iterator)
    assert [t.name for t in our_threads()].count("arena_loader-device") == 1
    abandoned = iter(loader)
    next(abandoned)
    del abandoned
    gc.collect()
    assert wait_until(lambda: [t.name for t in our_threads()].count("arena_loader-device") == 1)
    loader.close()
    with pytest.raises(LoaderClosedError):
        next(iterator)
    np.testing.assert_array_equal(kept.copy_to_host()[1], dataset[1])


@pytest.mark.parametrize("shuffle", [False, True])
def test_state_dict_counts_device_batches_received_not_those_copied_ahead(shuffle):
    """The device thread takes batches ahead of the consumer; state_dict() says where the
    consumer is (it refused device= before): resumed from it, a loader yields the rest of
    the epoch, batch for batch, and the next epoch as an uninterrupted run would."""
    import torch

    dataset = ImageDataset(40)
    options = dict(batch_size=4, num_workers=2, device="cuda", shuffle=shuffle)
    torch.manual_seed(5)
    with ArenaLoader(dataset, **options) as loader:
        whole = [host_copy(b) for _ in range(2) for b in loader]
    torch.manual_seed(5)
    with ArenaLoader(dataset, **options) as loader:
        iterator = iter(loader)
        head = [host_copy(next(iterator)) for _ in range(3)]

        def handed_out() -> int:  # batches the host iterator gave the device thread
            pending = [idx for it in loader.snapshot().iterators
                       for idx in (*it.in_flight, *it.ready)]
            return min(pending, default=10)

        assert wait_until(lambda: handed_out() >= 3 + 2)  # two copied ahead, queued
        state = loader.state_dict()
        del iterator
    assert (state["batches_yielded"], state["next_idx"]) == (3, 3)
    torch.manual_seed(6)
    with ArenaLoader(dataset, **options) as loader:
        loader.load_state_dict(state)
        tail = [host_copy(b) for _ in range(2) for b in loader]
    assert len(head) + len(tail) == len(whole)
    for i, (got, expected) in enumerate(zip(head + tail, whole, strict=True)):
        assert_batches_equal(got, expected, f"batch {i}")


@pytest.mark.parametrize("persistent_workers", [False, True])
def test_the_device_thread_draws_from_the_sampler_no_further_ahead_than_torch(
        persistent_workers):
    """Batches the device thread took ahead of next() count against the read-ahead, as
    torch's pin thread's do: after iter() and after each next(), the sampler has given
    prefetch_factor * num_workers batches more than next() returned (torch's rule, checked
    against torch in test_pin_stage), in every epoch of persistent workers too."""
    dataset, sampler = ImageDataset(24, shape=(4,)), CountedBatches(12, 2)
    with ArenaLoader(dataset, batch_sampler=sampler, num_workers=2, device="cuda",
                     persistent_workers=persistent_workers) as loader:
        for _ in range(2 if persistent_workers else 1):
            assert draws_per_next(loader, sampler, settle_s=0.02) == [
                min(4 + k, 12) for k in range(13)]


def test_persistent_workers_keep_delivering_across_abandoned_epochs():
    """With persistent workers, an epoch left half-way does not disturb the next ones."""
    dataset = ImageDataset(16, shape=(4,))
    expected = host_epoch(dataset, batch_size=2)
    with ArenaLoader(dataset, batch_size=2, num_workers=2, persistent_workers=True,
                     device="cuda") as loader:
        first = iter(loader)
        next(first)
        next(first)
        for epoch in range(2):
            assert_epoch_equal(loader, expected, f"epoch {epoch}")
        with pytest.raises(LoaderClosedError):
            next(first)


def test_torch_output_on_the_simulator_is_refused_with_the_reason():
    """output='torch' needs __cuda_array_interface__, which the simulator lacks."""
    with pytest.raises(ValueError, match=r"output='torch' with device='cuda' needs a real GPU"):
        ArenaLoader(ImageDataset(4), device="cuda", output="torch")


def test_consumer_stream_is_wrapped_once_per_loader(monkeypatch):
    """numba's default stream is made once per consumer, not at every next() (each makes a
    new object with driver calls; the real-GPU path, forced here past the simulator's 0)."""
    made = []
    monkeypatch.setattr(device_cuda, "SIMULATED", False)
    monkeypatch.setattr(device_cuda.cuda, "default_stream",
                        lambda: made.append(object()) or made[-1], raising=False)
    streams = device_cuda.ConsumerStreams(0, to_torch=False)
    got = [streams.current() for _ in range(3)]
    assert len(made) == 1 and got == [made[0]] * 3
    assert device_cuda.ConsumerStreams(0, to_torch=False).current() is not made[0]


def test_device_index_beyond_the_gpus_names_device():
    """The simulator has one GPU: cuda:1 is an error naming device and the valid range."""
    with pytest.raises(ValueError, match=r"device must name one of the 1 GPUs \(cuda:0 to "
                                         r"cuda:0\), got 'cuda:1'"):
        ArenaLoader(ImageDataset(4), device="cuda:1")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_interpreter_exits_cleanly_mid_epoch_on_the_device(num_workers):
    """Leaving a device epoch unfinished and never calling close() exits 0, silently."""
    code = ("from arena_loader import ArenaLoader\n"
            "from tests.datasets import ImageDataset\n"
            f"loader = ArenaLoader(ImageDataset(64), batch_size=2, num_workers={num_workers}, "
            "device='cuda', pin_memory=True)\n"
            "iterator = iter(loader)\n"
            "batch = next(iterator)\n"
            "assert batch.copy_to_host().shape == (2, 3, 8, 8)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=root,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", result.stderr


class _WiderAfterFirst:
    """Batch 0 (samples 0-1) fits the first batch's slot; later batches are wider, so they go
    to one-off segments, which a pinned slab cannot copy from: they are staged."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return np.full(8 if i < 2 else 64, i, dtype=np.float32)


def test_pinned_slab_with_larger_batches_stages_them(pinned_in_place):
    """A copy straight from the pinned slab, then copies of larger batches through staging
    buffers: each lands intact (staging buffers are counted apart from direct copies)."""
    dataset = _WiderAfterFirst()
    with ArenaLoader(dataset, batch_size=2, num_workers=0, device="cuda",
                     pin_memory=True) as loader:
        got = [batch.copy_to_host() for batch in loader]
    expected = [np.stack([dataset[i], dataset[i + 1]]) for i in range(0, 8, 2)]
    assert len(got) == len(expected)
    for ours, theirs in zip(got, expected):
        np.testing.assert_array_equal(ours, theirs)


def test_two_threads_next_on_a_device_iterator_hand_out_each_batch_once(gated_events,
                                                                         monkeypatch):
    """Two threads calling next() on one device iterator (as on a host one): both could take
    the first copied batch before either removed it from the queue, and each handed it out
    (here the two meet in the wait on that batch's copy event). One next() at a time now, as
    on the host and with pin_memory: every batch goes to one thread."""
    import contextlib

    gated_events.gated = False
    dataset = ImageDataset(16, shape=(2,), dtype=np.int64)
    with ArenaLoader(dataset, batch_size=2, num_workers=2, device="cuda") as loader:
        iterator = iter(loader)
        next(iterator).copy_to_host()  # the stage runs: the next copies queue up
        both, first, got = threading.Barrier(2), [], [[], []]

        def wait(self, stream=0):
            self.waited_on.append(stream)
            if self.is_copy and not first:
                first.append(self)
            if first and self is first[0]:
                with contextlib.suppress(threading.BrokenBarrierError):
                    both.wait(timeout=1.0)  # (alone: the other next() waits for this one)

        def consume(k):
            for batch in iterator:
                got[k].append(batch.copy_to_host())

        monkeypatch.setattr(GatedEvent, "wait", wait)
        run_in_threads(consume)
        rows = sorted(int(row[0]) for batches in got for batch in batches for row in batch)
        assert rows == sorted(int(dataset[i][0]) for i in range(2, 16))


def test_an_error_at_the_first_batch_leaves_the_device_threads_read_ahead_open():
    """As through the pin thread (test_pin_stage): the first batch, taken by the first next()
    before the device thread starts, raises; the rest of the epoch still arrives with a
    window of one batch (the window stayed full of the failed batch, and next() hung)."""
    dataset = RaisingDataset(24, bad={2})
    with ArenaLoader(dataset, batch_size=2, sampler=[2, 5, 8, 11, 14, 17], num_workers=1,
                     prefetch_factor=1, device="cuda") as loader:
        iterator = iter(loader)
        with pytest.raises(ValueError, match="sample 2 is corrupt"):
            next(iterator)
        rest = [host_copy(batch) for batch in iterator]
    assert len(rest) == 2
    for batch, indices in zip(rest, ([8, 11], [14, 17])):
        assert_batches_equal(batch, np.stack([dataset[i] for i in indices]))


def test_a_training_step_longer_than_timeout_is_no_timeout_through_the_device_thread():
    """As through the pin thread (test_pin_stage): with a window of one batch the device
    thread's wait for the next host batch is for the consumer's step, which raised
    LoaderTimeoutError once longer than ``timeout``."""
    dataset = ImageDataset(8)
    with ArenaLoader(dataset, batch_size=2, num_workers=1, prefetch_factor=1, device="cuda",
                     timeout=0.2) as loader:
        iterator = iter(loader)
        got = [host_copy(next(iterator))]
        time.sleep(0.5)  # the training step
        got += [host_copy(batch) for batch in iterator]
    assert len(got) == 4
    for start, batch in zip(range(0, 8, 2), got):
        assert_batches_equal(batch, np.stack([dataset[i] for i in range(start, start + 2)]))


@pytest.mark.timeout(40)
def test_ctrl_c_as_the_first_batchs_error_leaves_the_device_next_losing_nothing():
    """As through the pin thread (test_pin_stage): a Ctrl-C at each line run once the first
    batch, taken before the device thread starts, raised: the error once, and the epoch
    goes on (an interrupt as it was counted as received lost it, and the next next() hung
    with a window of one batch)."""
    dataset = RaisingDataset(8, bad={0})
    with ArenaLoader(dataset, batch_size=2, sampler=[0, 1, 2, 3, 4, 5], num_workers=1,
                     prefetch_factor=1, device="cuda", persistent_workers=True) as loader:
        ctrl_c_at_each_line_after_the_first_error(
            loader, lambda batch: int(host_copy(batch)[0, 0, 0, 0]),
            [int(dataset[i][0, 0, 0]) for i in (2, 4)], first=2, step=3)  # (pin: 1, 4, ...)


def test_an_epoch_abandoned_while_the_device_thread_waits_for_room_keeps_its_workers(
        monkeypatch):
    """As through the pin thread (test_pin_stage): the device thread, a batch ahead with a
    window of one, waits for room its consumer makes; iter() stops that wait, and the next
    epoch runs on the same persistent workers (the thread outlasted its 10 s join, and the
    persistent iterator was closed under it). The stop must wake the wait (the host's poll
    made longer than the join here)."""
    from arena_loader import _stage
    from arena_loader._pipeline import consumer

    monkeypatch.setattr(consumer, "POLL_S", 30.0)
    monkeypatch.setattr(_stage, "SHARED_JOIN_S", 2.0)
    dataset = ImageDataset(8)
    with ArenaLoader(dataset, batch_size=2, num_workers=1, prefetch_factor=1, device="cuda",
                     persistent_workers=True) as loader:
        abandoned = iter(loader)
        next(abandoned)
        pids = loader_worker_pids(loader)
        assert wait_until(lambda: host_idle(loader), timeout_s=5)
        time.sleep(0.05)  # (the thread, having taken batch 1, now waits for room)
        assert_epoch_equal(loader, reference_epoch(dataset, 2, False))
        assert loader_worker_pids(loader) == pids


@pytest.mark.filterwarnings("ignore:pin_memory=True. page-locking:UserWarning")
def test_a_staging_buffer_is_refilled_only_once_the_copy_from_it_completed(gated_events,
                                                                          monkeypatch):
    """Without page-locking, pin_memory stages each batch into one of two pinned buffers
    while the copy from the other may still run: a buffer is staged into again only once the
    copy that read it has completed (waited for by the device thread), or that copy reads
    the next batch's bytes on a GPU (here each copy's source is checked against the copies
    completed so far)."""
    gated_events.gated = False  # (copies complete at once: only the waits are counted)
    completed, sources, early = [0], [], []
    synchronize = GatedEvent.synchronize

    def counted(event):
        synchronize(event)
        completed[0] += event.is_copy

    def copy_to_buffer(buffer, source, stream, real=device_cuda.copy_to_buffer):
        address = source.__array_interface__["data"][0]
        last = max((k for k, seen in enumerate(sources) if seen == address), default=None)
        if last is not None and last >= completed[0]:  # copy `last` may still read it
            early.append((len(sources), last))
        sources.append(address)
        real(buffer, source, stream)

    monkeypatch.setattr(GatedEvent, "synchronize", counted)
    monkeypatch.setattr(device_cuda, "copy_to_buffer", copy_to_buffer)
    dataset = ImageDataset(12, shape=(4, 4))
    with ArenaLoader(dataset, batch_size=2, device="cuda", pin_memory=True) as loader:
        assert_epoch_equal(loader, reference_epoch(dataset, 2, False))
    assert early == []
    assert len(sources) == 6 and len(set(sources)) == 2
