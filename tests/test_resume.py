"""Mid-epoch resume (docs/design.md, "Resuming"): a run stopped after k batches, its
state_dict() pickled, and resumed in a fresh interpreter gives, batch for batch, what an
uninterrupted run gives, for the rest of that epoch and the next."""

from __future__ import annotations

import json
import pickle
import random
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch

from arena_loader import ArenaLoader, get_worker_info, samplers
from tests import resume_driver, zygote
from tests.resume_driver import (
    BATCH_SIZE,
    CONFIGS,
    SAMPLES,
    make_loader,
    resume,
    rows,
    run_and_stop,
    run_whole,
)

REPO = Path(__file__).resolve().parent.parent
SEED = 20240611


@pytest.mark.timeout(150)
def test_resumed_run_equals_uninterrupted_run(tmp_path):
    """Every configuration (resume_driver.CONFIGS), stopped after 0, 2, a middle (iterable:
    3) or the last batch of the first epoch (state taken after its end), then resumed in a
    fresh interpreter: the batches (samples, worker, worker seed) equal an uninterrupted
    run's. One interpreter resumes every configuration's states, each configuration's apart
    (its start, importing torch, was most of the time when each had its own); every
    configuration is checked, and the failure names each one that differs."""
    runs, failures = {}, []
    for name in sorted(CONFIGS):
        try:
            torch.manual_seed(SEED)
            whole = resume_driver.run_whole(name)
            first_epoch = len(whole) // 2 if "iterable" not in name else None
            stops = [0, 2, first_epoch if first_epoch else 3, None]
            heads, states = [], []
            for stop_after in stops:
                torch.manual_seed(SEED)
                head, state = resume_driver.run_and_stop(name, stop_after)
                assert head == whole[:len(head)], f"stopped after {stop_after}: the run differs"
                heads.append(head)
                states.append(state)
            runs[name] = (whole, stops, heads, states)
        except Exception:
            failures.append(f"{name}: {traceback.format_exc()}")
    states_path, out_path = tmp_path / "states.pkl", tmp_path / "resumed.pkl"
    states_path.write_bytes(pickle.dumps({name: run[3] for name, run in runs.items()}))
    done = zygote.run(["-m", "tests.resume_driver", str(states_path), str(out_path)], cwd=REPO,
                      timeout=120, preload="torch")
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = pickle.loads(out_path.read_bytes())
    for name, (whole, stops, heads, _) in runs.items():
        if isinstance(resumed[name], str):
            failures.append(f"{name}: resuming raised {resumed[name]}")
            continue
        for stop_after, head, tail in zip(stops, heads, resumed[name], strict=True):
            if head + tail != whole:
                failures.append(f"{name}, stopped after {stop_after} batches: resumed {tail} "
                                f"instead of {whole[len(head):]}")
    assert not failures, "\n".join(failures)


class CountingDataset(resume_driver.WhoLoads):
    """Records the samples it loads (in-process: the test can read them)."""

    def __init__(self, samples: int = SAMPLES):
        self.samples, self.loaded = samples, []

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> np.ndarray:
        self.loaded.append(index)
        return super().__getitem__(index)


def _stop(loader: ArenaLoader, batches: int) -> tuple[list, dict]:
    head = []
    for batch in loader:
        head.append(rows(batch))
        if len(head) == batches:
            break
    return head, loader.state_dict()


def test_resume_skips_batches_without_loading_them():
    """The batches handed out before the state are skipped by index: not one of their
    samples is loaded again."""
    torch.manual_seed(SEED)
    with ArenaLoader(CountingDataset(), batch_size=BATCH_SIZE, shuffle=True) as loader:
        head, state = _stop(loader, 3)
    dataset = CountingDataset()
    torch.manual_seed(SEED + 1)
    with ArenaLoader(dataset, batch_size=BATCH_SIZE, shuffle=True) as loader:
        loader.load_state_dict(state)
        tail = [rows(b) for b in loader]
    assert sorted(dataset.loaded) == sorted(row[0] for batch in tail for row in batch)
    assert sorted(row[0] for batch in head + tail for row in batch) == list(range(SAMPLES))


@pytest.mark.timeout(60)
def test_state_counts_batches_received_not_prefetched():
    """With workers loading ahead, the state counts the batches next() returned."""
    with make_loader("workers") as loader:
        iterator = iter(loader)
        next(iterator)
        assert resume_driver.wait_for_prefetch(loader)  # batches 1.. sent ahead, loading
        time.sleep(0.2)
        state = loader.state_dict()
        assert (state["batches_yielded"], state["next_idx"]) == (1, 1)
        del iterator


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["workers", "iterable_stateful"])
def test_state_dict_is_plain_json_data(name):
    """Mid-epoch, the state is plain data: it survives a JSON round trip and still resumes."""
    torch.manual_seed(SEED)
    whole = resume_driver.run_whole(name, epochs=1)
    torch.manual_seed(SEED)
    with make_loader(name) as loader:
        _, state = _stop(loader, 2)
    assert resume(name, json.loads(json.dumps(state)), epochs=1) == whole[2:]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("name", "overrides", "differs"), [
    ("in_process", {"batch_size": 5}, "batch_size is 4 in the state and 5 here"),
    ("in_process", {"dataset": "short"}, f"dataset_length is {SAMPLES} in the state and "
                                         f"{SAMPLES - 1} here"),
    ("iterable_stateful", {"num_workers": 1}, "num_workers is 2 in the state and 1 here"),
    ("in_process", {"drop_last": True}, "drop_last is False in the state and True here"),
    ("in_order_generator", {"generator": None}, "generators is"),
])
def test_mismatched_state_is_an_error_naming_what_differs(name, overrides, differs):
    """A state from a loader built otherwise is refused, naming the difference."""
    with make_loader(name) as loader:
        state = loader.state_dict()
    with make_loader(name, **overrides) as other, pytest.raises(ValueError, match=differs):
        other.load_state_dict(state)


@pytest.mark.timeout(60)
def test_a_state_whose_base_seed_does_not_replay_is_an_error():
    """Resuming replays the epoch's draws, and the workers' base seed drawn must be the one
    saved: a state whose seed does not replay (edited, or saved by a loader drawing
    otherwise) is a ValueError at iter(), not an epoch silently seeded otherwise."""
    torch.manual_seed(SEED)
    with make_loader("workers") as loader:
        _, state = _stop(loader, 2)
    assert state["drew_base_seed"] and state["base_seed"] is not None
    state["base_seed"] = (state["base_seed"] + 1) % 2**63
    with make_loader("workers") as loader:
        loader.load_state_dict(state)
        with pytest.raises(ValueError, match="base seed must be replayed"):
            iter(loader)


def test_empty_state_changes_nothing():
    """torchdata's rule: load_state_dict({}) is a no-op."""
    torch.manual_seed(SEED)
    whole = resume_driver.run_whole("in_process", epochs=1)
    torch.manual_seed(SEED)
    with make_loader("in_process") as loader:
        loader.load_state_dict({})
        assert [rows(b) for b in loader] == whole


@pytest.mark.timeout(60)
def test_stateless_iterable_workers_send_no_state():
    """Workers send their replica's state only for datasets with state_dict: a dataset
    without one costs not one record more."""
    records = {}
    for name in ("iterable_stateless", "iterable_stateful"):
        # One worker, one sample per batch, one batch read ahead: a record count that
        # timing moves by at most the read-ahead's one ended mark (and its state record).
        with make_loader(name, num_workers=1, batch_size=1, prefetch_factor=1) as loader:
            iterator = iter(loader)
            batches = sum(1 for _ in iterator)
            records[name] = iterator.stats["results_received"]
    assert batches == SAMPLES
    assert batches <= records["iterable_stateless"] <= batches + 2  # a record per batch
    # With state_dict, one state record more per batch.
    assert 2 * batches <= records["iterable_stateful"] <= 2 * batches + 4


class ResumePointStream(torch.utils.data.IterableDataset):
    """torchdata's documented Stateful pattern: ``load_state_dict`` leaves a resume point
    that the next ``__iter__`` consumes; otherwise ``__iter__`` starts over."""

    def __init__(self):
        self.i, self._resume = 0, None

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        self.i = self._resume if self._resume is not None else worker
        self._resume = None
        while self.i < 8:
            i = self.i
            self.i += workers
            yield i

    def state_dict(self) -> dict:
        return {"i": self.i}

    def load_state_dict(self, state: dict) -> None:
        self._resume = state["i"]


@pytest.mark.timeout(60)
def test_persistent_workers_resumed_between_epochs_start_the_next_epoch_whole():
    """A state taken between epochs with persistent workers, resumed: the next epoch is the
    uninterrupted run's, as with torchdata's StatefulDataLoader (the end-of-epoch states were
    loaded into the new replicas, and the resumed epoch was empty)."""
    options = dict(batch_size=2, num_workers=2, persistent_workers=True)
    with ArenaLoader(ResumePointStream(), **options) as loader:
        assert len(list(loader)) == 4
        state = loader.state_dict()
        uninterrupted = [b.tolist() for b in loader]
    with ArenaLoader(ResumePointStream(), **options) as loader:
        loader.load_state_dict(state)
        assert [b.tolist() for b in loader] == uninterrupted
    assert sorted(i for batch in uninterrupted for i in batch) == list(range(8))


@pytest.mark.timeout(60)
def test_a_state_taken_early_in_a_later_epoch_resumes_the_workers_not_yet_heard_from():
    """A state taken in the second epoch after one batch (worker 0's): worker 1 has handed
    out nothing of this epoch, so its replica resumes from the epoch's start, not from its
    state at the end of the last epoch (the Stateful pattern's end point: loaded, worker 1's
    share of the resumed epoch was empty)."""
    options = dict(batch_size=2, num_workers=2)
    with ArenaLoader(ResumePointStream(), **options) as loader:
        assert len(list(loader)) == 4
        iterator = iter(loader)
        head = [next(iterator).tolist()]
        state = loader.state_dict()
        rest = [b.tolist() for b in iterator]
    with ArenaLoader(ResumePointStream(), **options) as loader:
        loader.load_state_dict(state)
        assert [b.tolist() for b in loader] == rest
    assert sorted(i for batch in head + rest for i in batch) == list(range(8))


@pytest.mark.parametrize("name", ["workers", "iterable_stateful"])
def test_state_dict_right_after_load_state_dict_is_the_loaded_state(name):
    """As torchdata's StatefulDataLoader: until the loaded state's epoch hands out a batch
    (before iter(), or with an iterator dropped unused), state_dict() is that state, not
    this loader's own position."""
    torch.manual_seed(SEED)
    with make_loader(name) as loader:
        _, state = _stop(loader, 2)
    with make_loader(name) as loader:
        loader.load_state_dict(state)
        assert loader.state_dict() == state
        unused = iter(loader)
        assert loader.state_dict() == state
        del unused


def test_a_state_taken_in_a_resumed_epoch_names_that_epoch_and_resumes_again():
    """A state taken after batches of a resumed epoch: its epoch and batch count are that
    epoch's (as an uninterrupted run's state), and it resumes in turn."""
    torch.manual_seed(SEED)
    whole = resume_driver.run_whole("in_process")
    per_epoch = len(whole) // 2
    torch.manual_seed(SEED)
    with make_loader("in_process") as loader:
        list(loader)
        _, state = _stop(loader, 2)  # epoch 1, two batches in
    with make_loader("in_process") as loader:
        loader.load_state_dict(state)
        iterator = iter(loader)
        assert rows(next(iterator)) == whole[per_epoch + 2]
        again = loader.state_dict()
        del iterator
    assert (again["epoch"], again["batches_yielded"]) == (1, 3)
    with make_loader("in_process") as loader:
        loader.load_state_dict(again)
        assert [rows(b) for b in loader] == whole[per_epoch + 3:]
        assert loader.state_dict()["epoch"] == 2


def test_a_second_load_state_dict_after_a_resumed_epoch_began_is_the_one_resumed():
    """load_state_dict(a), batches of that epoch, then load_state_dict(b) (a checkpoint
    restored again): the next iter() resumes b, not a new epoch."""
    torch.manual_seed(SEED)
    whole = resume_driver.run_whole("in_process", epochs=1)
    torch.manual_seed(SEED)
    with make_loader("in_process") as loader:
        _, at_two = _stop(loader, 2)
    torch.manual_seed(SEED)
    with make_loader("in_process") as loader:
        _, at_three = _stop(loader, 3)
    with make_loader("in_process") as loader:
        loader.load_state_dict(at_two)
        iterator = iter(loader)
        assert [rows(next(iterator)) for _ in range(2)] == whole[2:4]
        del iterator
        loader.load_state_dict(at_three)
        assert [rows(b) for b in loader] == whole[3:]


@pytest.mark.timeout(60)
def test_an_epoch_being_iterated_goes_on_after_load_state_dict_and_a_new_iter():
    """Persistent workers: load_state_dict() and a new iter() while an iterator is still in
    its epoch (torchdata's load_state_dict drops only the loader's reference to it): the new
    iterator gets new workers, and the old one finishes its epoch on its own, not closed."""
    with ArenaLoader(_Rows(), batch_size=8, shuffle=True, num_workers=2,
                     persistent_workers=True,
                     generator=torch.Generator().manual_seed(SEED)) as loader:
        state = loader.state_dict()  # before the first epoch
        first = [b[:, 0].tolist() for b in loader]
        old = iter(loader)
        seen = [next(old)[:, 0].tolist() for _ in range(3)]
        loader.load_state_dict(state)
        new = iter(loader)
        assert next(new)[:, 0].tolist() == first[0]
        seen += [b[:, 0].tolist() for b in old]
        assert sorted(i for b in seen for i in b) == list(range(64))
        assert [b[:, 0].tolist() for b in new] == first[1:]
        del old, new


@pytest.mark.parametrize(("how", "num_workers"), [("deepcopy", 0), ("pickle", 1)])
def test_a_copy_of_a_loader_after_load_state_dict_resumes_as_torchdatas_does(how,
                                                                             num_workers):
    """A loader copied (``copy.deepcopy``; pickled, as ``mp.spawn`` does) after
    ``load_state_dict()`` and before its next ``iter()``: torchdata's StatefulDataLoader's
    copy keeps the loaded state (its ``next_iter_state``) and resumes it, and so does ours
    now. The copy started the epoch afresh: the state was left out with the resume
    bookkeeping (process-bound) and not loaded again."""
    import copy

    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    clone = copy.deepcopy if how == "deepcopy" else (lambda x: pickle.loads(pickle.dumps(x)))
    dataset = [np.int64(i) for i in range(12)]

    def copy_resumed(loader_class: type) -> list:
        def make():
            return loader_class(dataset, batch_size=2, num_workers=num_workers)

        loader = make()
        iterator = iter(loader)
        next(iterator), next(iterator)
        state = loader.state_dict()
        del iterator
        loader = make()
        loader.load_state_dict(state)
        twin = clone(loader)
        return [[np.asarray(b).tolist() for b in one] for one in (twin, loader, twin)]

    rest = [[4, 5], [6, 7], [8, 9], [10, 11]]
    whole = [[0, 1], [2, 3], *rest]
    assert copy_resumed(stateful.StatefulDataLoader) == [rest, rest, whole]
    assert copy_resumed(ArenaLoader) == [rest, rest, whole]


def test_matches_torchdata_stateful_dataloader():
    """Code written for torchdata's StatefulDataLoader switches by one import: the same
    calls, stopped and resumed at the same batch, give the same batches, for the rest of the
    epoch and the next. (Sequential order: torchdata's own RandomSampler draws another
    permutation than torch's, which ours follows.)"""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    dataset = [np.int64(i) for i in range(SAMPLES)]

    def stop_and_resume(loader_class: type) -> list:
        def make():
            return loader_class(dataset, batch_size=BATCH_SIZE, drop_last=True)

        loader = make()
        head = []
        for batch in loader:
            head.append(np.asarray(batch).tolist())
            if len(head) == 3:
                break
        state = pickle.loads(pickle.dumps(loader.state_dict()))
        loader = make()
        loader.load_state_dict(state)
        return head + [np.asarray(b).tolist() for _ in range(2) for b in loader]

    ours = stop_and_resume(ArenaLoader)
    assert ours == stop_and_resume(stateful.StatefulDataLoader)
    assert len(ours) == 2 * (SAMPLES // BATCH_SIZE)


class _Rows:
    def __len__(self):
        return 64

    def __getitem__(self, index):
        return np.full(2, index, np.int64)


class _BatchesInterruptedOnce:
    """Batches of 4 in order; the draw of batch ``at`` raises KeyboardInterrupt (a Ctrl-C
    landing while next() draws the sampler to top up the read-ahead window), once."""

    batch_size = 4  # (known: the epoch is not listed up front to size the slots)

    def __init__(self, at=None):
        self.at = at

    def __len__(self):
        return 16

    def __iter__(self):
        for k in range(16):
            if k == self.at:
                self.at = None
                raise KeyboardInterrupt
            yield list(range(4 * k, 4 * k + 4))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [2])
def test_ctrl_c_while_next_draws_the_sampler_then_state_dict_loses_no_batch(workers):
    """Ctrl-C inside next() while it draws the sampler (after taking its batch): the batch is
    not counted as handed out, so a state_dict saved in the handler resumes at it."""
    got, state = [], None
    with ArenaLoader(_Rows(), batch_sampler=_BatchesInterruptedOnce(at=6),
                     num_workers=workers) as loader:
        iterator = iter(loader)
        try:
            for batch in iterator:
                got.append(int(batch[0, 0]) // 4)
        except KeyboardInterrupt:
            state = loader.state_dict()
        del iterator
    assert state is not None and got, got
    with ArenaLoader(_Rows(), batch_sampler=_BatchesInterruptedOnce(),
                     num_workers=workers) as resumed:
        resumed.load_state_dict(state)
        rest = [int(batch[0, 0]) // 4 for batch in resumed]
    assert got + rest == list(range(16)), (got, rest)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["in_process", "workers", "persistent"])
def test_state_dict_after_an_epoch_resumes_at_the_next_epoch(name):
    """state_dict() taken once an epoch ended (StopIteration): a loader given it yields the
    whole next epoch, the one the first loader yields next (not an empty rest of the last)."""
    torch.manual_seed(SEED)
    with make_loader(name) as loader:
        first = [rows(b) for b in loader]
        state = loader.state_dict()
        second = [rows(b) for b in loader]
    with make_loader(name) as resumed:
        resumed.load_state_dict(state)
        again = [rows(b) for b in resumed]
    assert first and again == second, (len(again), len(second))


class ArgumentStateStream(torch.utils.data.IterableDataset):
    """mosaicml-streaming's and litdata's ``StreamingDataset`` shape: methods named
    ``state_dict`` / ``load_state_dict`` whose ``state_dict`` needs arguments (the loader's
    sample count), which torch's DataLoader never calls. Not torchdata's ``Stateful``."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()  # torch's, as those libraries ask
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter(range(worker, 12, workers))

    def state_dict(self, num_samples: int, from_beginning: bool) -> dict:
        raise AssertionError("called by the loader")

    def load_state_dict(self, state: dict) -> None:
        raise AssertionError("called by the loader")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
def test_state_dict_with_required_arguments_is_not_torchdatas_protocol(workers):
    """A dataset whose ``state_dict`` takes arguments loads as with torch's DataLoader (it
    was called with none after every batch: TypeError), and resumes by skipping."""
    torch_batches = [b.tolist() for b in torch.utils.data.DataLoader(
        ArgumentStateStream(), batch_size=2, num_workers=workers)]
    with ArenaLoader(ArgumentStateStream(), batch_size=2, num_workers=workers) as loader:
        iterator = iter(loader)
        head = [next(iterator).tolist() for _ in range(3)]
        state = loader.state_dict()
        assert head + [b.tolist() for b in iterator] == torch_batches
    with ArenaLoader(ArgumentStateStream(), batch_size=2, num_workers=workers) as loader:
        loader.load_state_dict(state)
        assert [b.tolist() for b in loader] == torch_batches[3:]


class _CountingIterator:
    """An iterator with torchdata's Stateful methods (its dataset has none): 0, 1, ... 9."""

    def __init__(self):
        self.i = 0

    def __next__(self):
        if self.i >= 10:
            raise StopIteration
        self.i += 1
        return self.i - 1

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, state):
        self.i = state["i"]


class _StatefulIteratorStream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return _CountingIterator()


class _OwnIteratorStream(torch.utils.data.IterableDataset):
    """Its own iterator: ``__iter__`` starts it over and returns it (a hand-written stream)."""

    def __init__(self):
        self.i = 0

    def __iter__(self):
        self.i = 0
        return self

    __next__ = _CountingIterator.__next__
    state_dict = _CountingIterator.state_dict
    load_state_dict = _CountingIterator.load_state_dict


class _ContinuingStream(_OwnIteratorStream):
    """Its own iterator, never starting over: each epoch is the next three numbers."""

    def __init__(self):
        self.i, self.end = 0, 0

    def __iter__(self):
        self.end = self.i + 3
        return self

    def __next__(self):
        if self.i >= self.end:
            raise StopIteration
        self.i += 1
        return self.i - 1

    def state_dict(self):
        return {"i": self.i, "end": self.end}

    def load_state_dict(self, state):
        self.i, self.end = state["i"], state["end"]


_TEN_IN_TWOS = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]


def test_a_stream_that_is_its_own_iterator_carries_its_state_into_the_next_epoch():
    """``num_workers=0``: a state taken at an epoch's end, resumed, goes on as the dataset
    object went on (torchdata's StatefulDataLoader gives [3, 4, 5] too), mid-epoch also."""
    with ArenaLoader(_ContinuingStream(), batch_size=1) as loader:
        assert [b.tolist() for b in loader] == [[0], [1], [2]]
        at_end = loader.state_dict()
        iterator = iter(loader)
        assert next(iterator).tolist() == [3]
        mid = loader.state_dict()
        del iterator
    for state, rest in ((at_end, [[3], [4], [5]]), (mid, [[4], [5]])):
        with ArenaLoader(_ContinuingStream(), batch_size=1) as loader:
            loader.load_state_dict(state)
            assert [b.tolist() for b in loader] == rest
            assert [b.tolist() for b in loader] == [[6], [7], [8]]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("dataset", [_StatefulIteratorStream, _OwnIteratorStream])
def test_an_iterators_own_state_resumes_it(dataset, workers):
    """torchdata's order for a replica: the dataset's state, then ``iter()``, then the
    iterator's state. An iterator with state of its own resumes where it was, not from its
    start; so does a dataset that is its own iterator, whose state torchdata takes as the
    iterator's (loaded after ``iter()``, which starts it over: loaded before, the resumed
    epoch began again at [0, 1]). A state taken at the epoch's end starts the next epoch
    whole: the ended iterator's state is not carried into it (with ``num_workers=0`` the
    next epoch was empty)."""
    def batches(loader, stop=None):
        iterator = iter(loader)
        return [next(iterator).tolist() for _ in range(stop)] if stop else \
            [b.tolist() for b in iterator]

    for stop, tail in ((2, _TEN_IN_TWOS[2:]), (5, []), (None, _TEN_IN_TWOS)):
        with ArenaLoader(dataset(), batch_size=2, num_workers=workers) as loader:
            assert batches(loader, stop) == _TEN_IN_TWOS[:stop]
            state = loader.state_dict()
        with ArenaLoader(dataset(), batch_size=2, num_workers=workers) as loader:
            loader.load_state_dict(state)
            assert [batches(loader), batches(loader)] == [tail, _TEN_IN_TWOS], stop


def test_a_state_dict_with_no_signature_to_read_is_torchdatas_protocol():
    """A ``state_dict`` whose signature cannot be read (a builtin, as a compiled extension's
    method may be) is trusted to take no arguments: its state is saved, not skipped."""
    from arena_loader._resume_stream import is_stateful

    class BuiltinState:
        state_dict = dict  # (inspect.signature(dict) raises ValueError)

        def load_state_dict(self, state):
            pass

    class ArgumentState(BuiltinState):
        def state_dict(self, num_samples):
            return {}

    assert is_stateful(BuiltinState())
    assert not is_stateful(ArgumentState())


class _YieldCountingDistributedSampler:
    """torchdata's ``StatefulDistributedSampler``, in plain Python: the order comes from the
    seed and ``set_epoch``; ``state_dict()`` is the indices yielded this iteration, reset only
    when the next iteration starts drawing (a generator), and ``load_state_dict`` leaves a
    resume point that the next ``__iter__`` skips to."""

    def __init__(self, size: int):
        self.size, self.epoch, self.yielded, self.next_yielded = size, 0, 0, None

    def __len__(self):
        return self.size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        self.yielded, self.next_yielded = self.next_yielded or 0, None
        order = np.random.default_rng(self.epoch).permutation(self.size).tolist()
        for index in order[self.yielded:]:
            self.yielded += 1
            yield index

    def state_dict(self) -> dict:
        return {"yielded": self.yielded}

    def load_state_dict(self, state: dict) -> None:
        self.next_yielded = state["yielded"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("taken_after", [0, 2])
def test_stateful_distributed_sampler_resumes_after_the_first_epoch(workers, taken_after):
    """A DistributedSampler-like sampler with torchdata's position state, resumed in its
    second epoch: the rest of that epoch, then the next, as uninterrupted (the state taken at
    the epoch's start said the first epoch had ended, and loaded it emptied the epoch)."""
    def make():
        sampler = _YieldCountingDistributedSampler(11)
        return ArenaLoader(list(range(11)), batch_size=3, sampler=sampler,
                           num_workers=workers), sampler

    def epoch(loader, sampler, number):
        sampler.set_epoch(number)
        return [np.asarray(b).tolist() for b in loader]

    loader, sampler = make()
    with loader:
        whole = [epoch(loader, sampler, number) for number in range(3)]
    loader, sampler = make()
    with loader:
        epoch(loader, sampler, 0)
        sampler.set_epoch(1)
        batches = iter(loader)
        head = [np.asarray(next(batches)).tolist() for _ in range(taken_after)]
        state = pickle.loads(pickle.dumps(loader.state_dict()))
        del batches
    assert head == whole[1][:taken_after]
    loader, sampler = make()
    with loader:
        loader.load_state_dict(state)
        assert [epoch(loader, sampler, 1), epoch(loader, sampler, 2)] == \
            [whole[1][taken_after:], whole[2]]


class _SelfCountingStatefulSampler:
    """A sampler written to torchdata's ``Stateful`` contract, with no ``set_epoch``: each
    ``iter()`` is its next epoch (a new permutation); ``state_dict()`` says where it is (its
    epoch and the indices yielded), and the ``iter()`` after ``load_state_dict()`` goes on
    from there, as torchdata's StatefulDataLoader resumes it."""

    def __init__(self, size: int):
        self.size, self.epoch, self.yielded, self.resume_at = size, -1, 0, None

    def __len__(self):
        return self.size

    def __iter__(self):
        if self.resume_at is None:
            self.epoch, self.yielded = self.epoch + 1, 0
        order, self.resume_at = self._order(), None
        for index in order[self.yielded:]:
            self.yielded += 1
            yield index

    def _order(self) -> list:
        return np.random.default_rng(self.epoch).permutation(self.size).tolist()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "yielded": self.yielded}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.yielded = state["epoch"], state["yielded"]
        self.resume_at = state["yielded"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("wrapped", [False, True])
def test_a_stateful_sampler_without_set_epoch_resumes_mid_epoch_from_its_own_position(
        workers, wrapped):
    """A Stateful sampler without set_epoch (itself, or inside a batch_sampler), resumed
    mid-way through its second epoch: the rest of that epoch, then the next, as uninterrupted.
    Its state as of the last batch received is saved and loaded, as torchdata's
    StatefulDataLoader does (saved at the epoch's start, it said the first epoch had ended,
    and loaded it emptied the rest of the resumed epoch)."""
    from torch.utils.data import BatchSampler

    def make():
        sampler = _SelfCountingStatefulSampler(11)
        chosen = (dict(batch_sampler=BatchSampler(sampler, 3, False)) if wrapped
                  else dict(sampler=sampler, batch_size=3))
        return ArenaLoader(list(range(11)), num_workers=workers, **chosen)

    whole, resumed = _whole_and_resumed_in_the_second_epoch(make)
    assert resumed == whole


class _PrivateEpochStatefulSampler:
    """Stateful, with a ``set_epoch`` that keeps its epoch privately (no int ``epoch``
    attribute): not DistributedSampler's kind, so its own state, the indices yielded,
    resumes it, as torchdata's StatefulDataLoader resumes any Stateful sampler."""

    def __init__(self, size: int):
        self.size, self._epoch, self.yielded, self.resume_at = size, 0, 0, None

    def __len__(self):
        return self.size

    def set_epoch(self, epoch: int) -> None:
        self._epoch = epoch

    def __iter__(self):
        start, self.resume_at = self.resume_at or 0, None
        self.yielded = start
        for index in np.random.default_rng(self._epoch).permutation(self.size)[start:]:
            self.yielded += 1
            yield int(index)

    def state_dict(self) -> dict:
        return {"epoch": self._epoch, "yielded": self.yielded}

    def load_state_dict(self, state: dict) -> None:
        self._epoch, self.resume_at = state["epoch"], state["yielded"]


@pytest.mark.parametrize("sampler", [
    lambda: samplers.RandomSampler(range(11), generator=0),
    lambda: samplers.SubsetRandomSampler(list(range(11)), generator=0),
    lambda: samplers.WeightedRandomSampler([1.0 + i for i in range(11)], 11, generator=0),
], ids=["RandomSampler", "SubsetRandomSampler", "WeightedRandomSampler"])
def test_our_numpy_drawn_samplers_resume_in_a_later_epoch(sampler):
    """Our random samplers with a seed draw from numpy generators of their own: the state
    holds each as of the epoch's start, so a resume in the second epoch draws that epoch's
    order, not the first's again."""
    def make():
        return ArenaLoader(list(range(11)), sampler=sampler(), batch_size=3)

    whole, resumed = _whole_and_resumed_in_the_second_epoch(make)
    assert resumed == whole


def test_a_stateful_sampler_with_a_set_epoch_of_its_own_resumes_from_its_own_position():
    """A Stateful sampler whose ``set_epoch`` keeps no int ``epoch`` resumes from its state
    as of the last batch received (taken for DistributedSampler's kind, its epoch was read
    as None and given back to ``set_epoch``: another order)."""
    def make():
        return ArenaLoader(list(range(11)), sampler=_PrivateEpochStatefulSampler(11),
                           batch_size=3)

    whole, resumed = _whole_and_resumed_in_the_second_epoch(make)
    assert resumed == whole


def _whole_and_resumed_in_the_second_epoch(make, reseed=lambda: None):
    """Three epochs of ``make()``'s loader, and the same cut after two batches of the second
    epoch and resumed by a new loader from its state (``reseed`` runs before each of the
    three loaders: RNGs as a new process has them)."""
    def rows(batches):
        return [np.asarray(b).tolist() for b in batches]

    reseed()
    with make() as loader:
        whole = [rows(loader) for _ in range(3)]
    reseed()
    with make() as loader:
        first = rows(loader)
        batches = iter(loader)
        head = [np.asarray(next(batches)).tolist() for _ in range(2)]
        state = pickle.loads(pickle.dumps(loader.state_dict()))
        del batches
    torch.manual_seed(SEED + 1)  # another process: its RNG is elsewhere
    with make() as loader:
        loader.load_state_dict(state)
        return whole, [first, head + rows(loader), rows(loader)]


class _GlobalDrawSampler:
    """A sampler with no ``generator`` attribute that draws from torch's global RNG, as
    torchsampler's ImbalancedDatasetSampler (``torch.multinomial``) does."""

    def __len__(self):
        return 12

    def __iter__(self):
        return iter(torch.randperm(12).tolist())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("sampler", [_GlobalDrawSampler,
                                     lambda: torch.utils.data.RandomSampler(range(12))],
                         ids=["no_generator_attribute", "generator_None"])
def test_a_sampler_drawing_from_torchs_global_rng_resumes_beside_the_loaders_generator(
        workers, sampler):
    """The loader has a ``generator`` (its workers' seeds), the sampler none of its own and
    draws from torch's global RNG: the state holds that RNG as of the epoch's start, so the
    resumed epoch, in a process whose global RNG is elsewhere, is the uninterrupted one (it
    was held only when the loader or a sampler said ``generator=None``; a sampler with no
    ``generator`` attribute, torchsampler's, was missed)."""
    def make():
        return ArenaLoader(list(range(12)), sampler=sampler(), batch_size=3,
                           num_workers=workers, generator=torch.Generator().manual_seed(1))

    whole, resumed = _whole_and_resumed_in_the_second_epoch(
        make, reseed=lambda: torch.manual_seed(SEED))
    assert resumed == whole


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["in_process", "persistent"])
def test_an_iterator_dropped_unused_leaves_the_loaded_state_to_the_next_iter(name):
    """Lightning calls iter() once on a loader that is not a torch DataLoader and drops the
    iterator: after load_state_dict() that probe leaves the state to the next iter(). Once
    the resumed epoch has handed out a batch, or ended with none left, the next iter() begins
    the following epoch (the state is not replayed again)."""
    torch.manual_seed(SEED)
    whole = run_whole(name)
    per_epoch = len(whole) // 2
    for stop_after in (2, per_epoch):  # mid-epoch; after the last batch, before its end
        torch.manual_seed(SEED)
        _, state = run_and_stop(name, stop_after)
        with make_loader(name) as loader:
            loader.load_state_dict(state)
            iter(loader)  # the probe, dropped
            assert loader.state_dict()["next_idx"] == stop_after
            resumed = iter(loader)
            if stop_after < per_epoch:
                assert rows(next(resumed)) == whole[stop_after]
            else:
                assert list(resumed) == []
            del resumed  # left after one batch, or ended: the next iter() begins epoch 1
            assert [rows(batch) for batch in loader] == whole[per_epoch:], stop_after


class UnevenShards:
    """An iterable-style dataset whose worker k yields ``sizes[k]`` items (k * 1000 + i);
    ``log``: a file each ``__iter__`` appends its worker's id to."""

    def __init__(self, sizes: list[int], log: Path | None = None):
        self.sizes = sizes
        self.log = log

    def __iter__(self):
        worker = get_worker_info().id
        if self.log is not None:
            with open(self.log, "a") as log:
                log.write(f"{worker}\n")
        return iter(range(worker * 1000, worker * 1000 + self.sizes[worker]))


@pytest.mark.timeout(60)
def test_a_worker_whose_stream_ended_before_the_state_starts_the_next_epoch_whole(tmp_path):
    """Persistent workers, a stateless iterable: worker 0's stream had ended when the state
    was taken, so it is not asked in the resumed epoch (its ``__iter__`` is not called, as
    in the uninterrupted run, where its iterator had ended); its iterator of the next epoch
    starts afresh instead of skipping the batch it had handed out in the interrupted one."""
    def rows(batches):
        return [batch.tolist() for batch in batches]

    options = dict(batch_size=2, num_workers=3, persistent_workers=True)
    with ArenaLoader(UnevenShards([2, 6, 0]), **options) as loader:
        whole = rows(loader) + rows(loader)
        iterator = iter(loader)
        head = rows(next(iterator) for _ in range(3))
        state = loader.state_dict()
        del iterator
    assert state["workers"][0]["ended"]
    assert state["batches_yielded"] == 3 < state["next_idx"]  # (ended marks: idx, no batch)
    log = tmp_path / "iters.log"
    with ArenaLoader(UnevenShards([2, 6, 0], log), **options) as loader:
        loader.load_state_dict(state)
        iterator = iter(loader)
        tail = rows([next(iterator)])
        assert loader.state_dict()["batches_yielded"] == 4  # (resumed: ended marks not counted)
        tail += rows(iterator)
        resumed_epoch_iters = log.read_text().split()
        tail += rows(loader)
    assert head + tail == whole
    assert "0" not in resumed_epoch_iters  # (its one __iter__ is the next epoch's)
    assert log.read_text().split().count("0") == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("persistent", [False, True])
def test_load_state_dict_from_another_thread_leaves_the_epoch_being_iterated_whole(persistent):
    """load_state_dict() while another thread iterates an epoch (a checkpoint restored
    meanwhile; the same in one thread): that epoch goes on to its end, as torchdata's
    StatefulDataLoader's does (its load_state_dict only drops the loader's reference to the
    iterator), and the next iter() is the loaded state's. With persistent workers their
    iterator was closed under the iterating thread: LoaderClosedError at its next next()."""
    import threading

    loader = ArenaLoader(_Rows(), batch_size=8, shuffle=True,
                         num_workers=2, persistent_workers=persistent,
                         generator=torch.Generator().manual_seed(SEED))
    state = loader.state_dict()  # before the first epoch
    first = [b[:, 0].tolist() for b in loader]
    iterator = iter(loader)
    seen = [next(iterator)[:, 0].tolist() for _ in range(3)]
    restorer = threading.Thread(target=loader.load_state_dict, args=(state,))
    restorer.start()
    restorer.join(timeout=10)
    assert not restorer.is_alive()
    seen += [b[:, 0].tolist() for b in iterator]
    assert sorted(i for b in seen for i in b) == list(range(64))
    assert [b[:, 0].tolist() for b in loader] == first  # the loaded state: epoch 0 again
    del iterator
    loader.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("persistent", [False, True])
def test_a_state_saved_by_another_thread_as_iter_begins_an_epoch_resumes_it(persistent,
                                                                         monkeypatch):
    """state_dict() from another thread (a checkpointing thread) while iter() began an epoch,
    after it had recorded the epoch's start and before it drew the workers' base seed: the
    state held the last epoch's seed, and resuming it raised ValueError ("state_dict's base
    seed must be replayed ..."). The state is now taken before that step or once it is done,
    and resumes the epoch as the uninterrupted run gives it."""
    import threading

    from arena_loader._resume import LoaderResume

    def make():
        return ArenaLoader(_Rows(), batch_size=8, shuffle=True, num_workers=2,
                           persistent_workers=persistent,
                           generator=torch.Generator().manual_seed(SEED))

    loader = make()
    [b[:, 0].tolist() for b in loader]
    saved: list = []
    saver = threading.Thread(target=lambda: saved.append(loader.state_dict()))
    real = LoaderResume.base_seed

    def base_seed_while_another_thread_saves(self, seeds, reuse):
        saver.start()
        saver.join(timeout=0.5)  # (it now waits for iter() to have drawn)
        return real(self, seeds, reuse)

    monkeypatch.setattr(LoaderResume, "base_seed", base_seed_while_another_thread_saves)
    iterator = iter(loader)
    monkeypatch.undo()
    saver.join(timeout=10)
    second = [b[:, 0].tolist() for b in iterator]
    third = [b[:, 0].tolist() for b in loader]
    loader.close()
    (state,) = saved
    assert (state["epoch"], state["batches_yielded"]) == (1, 0)
    resumed = make()
    resumed.load_state_dict(state)
    assert [b[:, 0].tolist() for b in resumed] == second
    assert [b[:, 0].tolist() for b in resumed] == third
    del iterator
    resumed.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_state_saved_while_another_thread_is_handed_a_batch_resumes_after_it(
        num_workers, monkeypatch):
    """state_dict() from a checkpointing thread while next() hands out a batch of an
    iterable-style dataset: the state held the workers' replicas as of one batch and the
    position as of the next, so resuming it loaded that batch again. The state is read again
    until no batch was handed out meanwhile: it resumes after the last batch handed out."""
    import threading

    from arena_loader._resume_stream import WorkerPosition

    from .datasets import ShardedStream

    def make():
        return ArenaLoader(ShardedStream(16), batch_size=2, num_workers=num_workers)

    def indices(batches):
        return [batch["index"].tolist() for batch in batches]

    with make() as loader:
        whole = indices(loader)
        iterator = iter(loader)
        got = indices(next(iterator) for _ in range(2))
        real, handed = WorkerPosition.as_state, []

        def as_state_while_a_batch_is_handed_out(self):
            state = real(self)
            if not handed:  # the consumer's next() runs between two reads of the state
                handed.append(threading.Thread(
                    target=lambda: got.extend(indices([next(iterator)]))))
                handed[0].start()
                handed[0].join(timeout=10)
            return state

        monkeypatch.setattr(WorkerPosition, "as_state", as_state_while_a_batch_is_handed_out)
        state = loader.state_dict()
        monkeypatch.undo()
        iterator.close()
    assert len(got) == 3
    with make() as resumed:
        resumed.load_state_dict(state)
        assert got + indices(resumed) == whole


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_state_saved_in_the_epoch_after_a_loaded_end_of_epoch_state_resumes_that_epoch(
        num_workers):
    """A loader made from a state saved at an epoch's end, then ``set_epoch(1)`` (a
    DistributedSampler's next epoch) and a batch: a state saved now resumes epoch 1's order.
    It recorded the loaded state's sampler epoch (0), so the resume gave epoch 0's batches
    (found by benchmarks/chaos.py --seed 1910)."""
    from torch.utils.data import DistributedSampler

    def make():
        sampler = DistributedSampler(range(16), num_replicas=1, rank=0, shuffle=True, seed=5)
        return ArenaLoader(np.arange(16), batch_size=4, sampler=sampler,
                           num_workers=num_workers)

    twin = DistributedSampler(range(16), num_replicas=1, rank=0, shuffle=True, seed=5)
    twin.set_epoch(1)
    epoch1 = list(twin)
    with make() as first:
        first.set_epoch(0)
        list(first)
        end_of_epoch0 = first.state_dict()
    with make() as second:
        second.load_state_dict(end_of_epoch0)
        second.set_epoch(1)
        iterator = iter(second)
        assert next(iterator).tolist() == epoch1[:4]
        mid_epoch1 = second.state_dict()
        del iterator
    with make() as third:
        third.load_state_dict(mid_epoch1)
        assert [batch.tolist() for batch in third] == [epoch1[4:8], epoch1[8:12], epoch1[12:]]


class _OwnOrderSampler(_SelfCountingStatefulSampler):
    """The same, with each epoch's order from randomness of its own, unseeded: only its
    state (which holds the order) says what it gives next."""

    def __init__(self, size: int):
        super().__init__(size)
        self.order, self._rng = None, random.Random()  # (from the OS: another every run)

    def _order(self) -> list:
        if self.resume_at is None:
            self.order = self._rng.sample(range(self.size), self.size)
        return self.order

    def state_dict(self) -> dict:
        return dict(super().state_dict(), order=self.order)

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.order = state["order"]


@pytest.mark.timeout(60)
def test_a_sampler_with_its_own_order_resumes_from_its_state_as_of_the_last_batch_received(
        fake_pinning):
    """Workers draw ahead of the consumer; the sampler's state as of the last batch the
    consumer received is what state_dict() saves (an order that no replay can make again
    resumes only so), not dropped when the next batch is drawn: through the pin thread, the
    consumer's next() moves the position first and then draws."""
    def make():
        return ArenaLoader(list(range(12)), sampler=_OwnOrderSampler(12), batch_size=2,
                           num_workers=2, pin_memory=True, output="torch")

    with make() as loader:
        iterator = iter(loader)
        head = [next(iterator) for _ in range(2)]
        state = pickle.loads(pickle.dumps(loader.state_dict()))
        rest = [np.asarray(b).tolist() for b in iterator]
    assert len(head) == 2 and len(rest) == 4
    with make() as loader:
        loader.load_state_dict(state)
        assert [np.asarray(b).tolist() for b in loader] == rest


class RaisesAt:
    """Rows ``[i, i]``; sample ``bad`` raises."""

    def __init__(self, n: int, bad: int):
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index):
        if index == self.bad:
            raise ValueError(f"bad sample {index}")
        return np.array([index, index])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_state_dict_after_a_failed_batch_resumes_where_the_iterator_goes_on(num_workers):
    """After a batch whose loading raised, ``next()`` goes on with the batch after it (as
    torch's); a ``state_dict()`` taken then resumes there too, with or without workers.
    (``num_workers=0`` counted only the batches it built: the resumed loader loaded the
    failed batch again and raised again.)"""
    def first_column(batch):
        return [int(v) for v in np.asarray(batch)[:, 0]]

    with ArenaLoader(RaisesAt(12, bad=5), batch_size=2, num_workers=num_workers) as loader:
        iterator = iter(loader)
        head = [first_column(next(iterator)) for _ in range(2)]
        with pytest.raises(ValueError, match="bad sample 5"):
            next(iterator)
        state = loader.state_dict()
        rest = [first_column(batch) for batch in iterator]
    assert head == [[0, 1], [2, 3]] and rest == [[6, 7], [8, 9], [10, 11]]
    with ArenaLoader(RaisesAt(12, bad=5), batch_size=2, num_workers=num_workers) as resumed:
        resumed.load_state_dict(state)
        assert [first_column(batch) for batch in resumed] == rest
