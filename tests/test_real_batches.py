"""Batches as real training code makes them (issue "Real batches"): shapes that change every
batch, batches the loop keeps, torch datasets as they are. Each case runs the same script
with torch's DataLoader and with ArenaLoader (num_workers 0 and 2) and compares."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import textwrap
import warnings
from dataclasses import dataclass

import numpy as np
import pytest

from arena_loader import ArenaLoader, SlotsExhaustedError
from arena_loader._pipeline.order import ORDER_TAG

torch = pytest.importorskip("torch")
from torch.nn.utils.rnn import pad_sequence  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

pytestmark = pytest.mark.timeout(60)
WORKERS = [0, 2]


class Tokens(torch.utils.data.Dataset):
    """Text-like samples: int64 token ids of length 3..40 and a label."""

    def __len__(self):
        return 48

    def __getitem__(self, i):
        n = 3 + (i * 7) % 38
        return torch.arange(i, i + n, dtype=torch.int64), i % 3


def pad_collate(batch):
    seqs, labels = zip(*batch)
    return (pad_sequence(seqs, batch_first=True), torch.tensor([len(s) for s in seqs]),
            torch.tensor(labels))


def pad_time_first(batch):
    return pad_sequence([s for s, _ in batch])


class Detection(torch.utils.data.Dataset):
    """Images of varying size with a varying number of boxes, as detection datasets give."""

    def __len__(self):
        return 20

    def __getitem__(self, i):
        h, w = 8 + i % 5, 6 + i % 3
        image = torch.full((3, h, w), float(i))
        boxes = torch.arange(4 * (i % 4), dtype=torch.float32).reshape(-1, 4) + i
        return image, {"boxes": boxes, "labels": torch.ones(i % 4, dtype=torch.int64),
                       "image_id": i}


def detection_collate(batch):
    return tuple(zip(*batch))


def list_collate(batch):
    return [s for s, _ in batch]


class Promoting:
    """int then float samples (torch's default_collate promotes), float32 then float64."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return {"n": i if i % 2 else float(i),
                "x": np.full(2, i, np.float32 if i % 3 else np.float64),
                "t": torch.full((2,), i, dtype=torch.bfloat16)}


class Strings:
    """numpy strings of different widths (Hugging Face's numpy format for text)."""

    def __len__(self):
        return 10

    def __getitem__(self, i):
        return {"text": np.array(["w" * (1 + i)]), "label": np.int64(i)}


@dataclass
class Batch:
    x: torch.Tensor
    n: int


def dataclass_collate(samples):
    return Batch(torch.stack([s for s, _ in samples if len(s) >= 0][:1] * 2), len(samples))


class PrebatchedStream(torch.utils.data.IterableDataset):
    """A pre-batched pipeline: each worker yields batches of its shard, the last partial."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        items = list(range(worker, 23, workers))
        for start in range(0, len(items), 5):
            yield np.array(items[start: start + 5], dtype=np.int64)


def as_torch(value):
    """A batch with numpy leaves turned into tensors (strings stay), for comparison."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value) if value.dtype.kind in "biufc" else value
    if isinstance(value, dict):
        return {k: as_torch(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(as_torch(v) for v in value)
    return value


def assert_same(ours, theirs, where="batch", strict=False):
    """The same values, dtypes and shapes, numpy leaves taken as tensors; ``strict``: the
    same types too (containers, leaves, dict keys: 1 is not True) and requires_grad."""
    if strict:
        assert type(ours) is type(theirs), f"{where}: {type(ours)} is not {type(theirs)}"
    else:
        ours = as_torch(ours)
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor), f"{where}: {type(ours)} is not a tensor"
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (
            f"{where}: {ours.dtype}{list(ours.shape)} != {theirs.dtype}{list(theirs.shape)}")
        assert not strict or ours.requires_grad == theirs.requires_grad, where
        assert torch.equal(ours, theirs), where
    elif isinstance(theirs, dict):
        assert list(ours) == list(theirs), where
        assert not strict or list(map(type, ours)) == list(map(type, theirs)), where
        for key in theirs:
            assert_same(ours[key], theirs[key], f"{where}[{key!r}]", strict)
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_same(a, b, f"{where}[{i}]", strict)
    elif isinstance(theirs, np.ndarray):
        np.testing.assert_array_equal(ours, theirs)
    else:
        assert ours == theirs, where


def compare(dataset, num_workers, **options):
    expected = list(DataLoader(dataset, num_workers=num_workers, **options))
    with ArenaLoader(dataset, num_workers=num_workers, **options) as loader:
        for epoch in range(2):
            got = list(loader)
            assert len(got) == len(expected)
            for i, (ours, theirs) in enumerate(zip(got, expected)):
                assert_same(ours, theirs, f"epoch {epoch} batch {i}")
    return got


class MemmapRows:
    """Rows of an ``np.memmap`` file (a dataset reading a large array from disk): each
    sample an ``np.memmap``, an ndarray subclass, and a label."""

    def __init__(self, path):
        rows = np.memmap(path, dtype=np.float32, mode="w+", shape=(24, 5))
        rows[:] = np.arange(120, dtype=np.float32).reshape(24, 5)
        rows.flush()
        self.rows = np.memmap(path, dtype=np.float32, mode="r", shape=(24, 5))

    def __len__(self):
        return 24

    def __getitem__(self, index):
        return self.rows[index], index


@pytest.mark.parametrize("num_workers", WORKERS)
def test_memmap_rows_batch_as_torch_batches_them(num_workers, tmp_path):
    """np.memmap rows (an ndarray subclass) take the general path: stacked as arrays (once
    written as if they were numbers, which failed every batch)."""
    compare(MemmapRows(tmp_path / "rows.f32"), num_workers, batch_size=8)


@pytest.mark.parametrize("num_workers", WORKERS)
def test_pad_to_longest_batch_first(num_workers):
    got = compare(Tokens(), num_workers, batch_size=5, collate_fn=pad_collate)
    assert len({b[0].shape for b in got}) > 1, "every batch had the same shape"


@pytest.mark.parametrize("num_workers", WORKERS)
def test_pad_to_longest_time_first(num_workers):
    compare(Tokens(), num_workers, batch_size=4, collate_fn=pad_time_first)


@pytest.mark.parametrize("num_workers", WORKERS)
def test_list_of_variable_length_tensors_stays_a_list(num_workers):
    got = compare(Tokens(), num_workers, batch_size=6, collate_fn=list_collate)
    assert isinstance(got[0], list) and len({len(t) for t in got[0]}) > 1


@pytest.mark.parametrize("num_workers", WORKERS)
def test_detection_tuple_zip_collate(num_workers):
    got = compare(Detection(), num_workers, batch_size=4, collate_fn=detection_collate)
    images, targets = got[1]
    assert isinstance(images, tuple) and isinstance(targets[0], dict)
    assert targets[0]["boxes"].shape[1:] == (4,) and isinstance(targets[0]["image_id"], int)


@pytest.mark.parametrize("num_workers", WORKERS)
def test_default_collate_promotes_dtypes_and_keeps_bfloat16(num_workers):
    got = compare(Promoting(), num_workers, batch_size=3)
    assert got[0]["t"].dtype == torch.bfloat16


class NarrowFirst:
    """Tensor rows whose first dtype is the narrowest of its batch of 3: int32 then int64,
    float16 then float32."""

    def __len__(self):
        return 6

    def __getitem__(self, i):
        first = i % 3 == 0
        return {"u": torch.full((2,), i, dtype=torch.int32 if first else torch.int64),
                "v": torch.full((2,), i / 2, dtype=torch.float16 if first else torch.float32)}


@pytest.mark.parametrize("num_workers", WORKERS)
def test_tensor_rows_promote_past_the_first_rows_dtype_as_torch_does_in_its_main_process(
        num_workers):
    """torch's default_collate promotes (int32 and int64 rows: int64) in the main process;
    its workers stack into the first row's dtype (docs/migrating.md, "Shapes"). Ours
    promotes with workers too."""
    expected = list(DataLoader(NarrowFirst(), batch_size=3))
    with ArenaLoader(NarrowFirst(), batch_size=3, num_workers=num_workers) as loader:
        got = list(loader)
    assert len(got) == len(expected) == 2
    for i, (ours, theirs) in enumerate(zip(got, expected)):
        assert_same(ours, theirs, f"batch {i}")
    assert got[0]["u"].dtype == torch.int64 and got[0]["v"].dtype == torch.float32


class StackRefuses:
    """float32[2] tensor rows; sample 5 has 3 values, and every row ``i % 3 == 1`` needs
    grad (torch.stack refuses to write either into an ``out=`` tensor)."""

    def __len__(self):
        return 9

    def __getitem__(self, i):
        row = torch.full((3 if i == 5 else 2,), float(i))
        return row.requires_grad_(True) if i % 3 == 1 else row


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", WORKERS)
def test_tensor_rows_that_one_stack_refuses_are_walked(num_workers):
    """Tensor rows of one dtype are written into the slot by one torch.stack; a batch whose
    rows it refuses is walked row by row: a row that needs grad is stored detached, with its
    values, and a row of another shape is the SampleShapeError naming the sample."""
    from arena_loader.errors import SampleShapeError

    with ArenaLoader(StackRefuses(), batch_size=3, num_workers=num_workers) as loader:
        iterator = iter(loader)
        assert np.asarray(next(iterator)).tolist() == [[0, 0], [1, 1], [2, 2]]
        with pytest.raises(SampleShapeError, match=r"sample 5: field sample has shape \[3\]"):
            next(iterator)
        assert np.asarray(next(iterator)).tolist() == [[6, 6], [7, 7], [8, 8]]


@pytest.mark.parametrize("num_workers", WORKERS)
def test_numpy_strings_of_different_widths(num_workers):
    expected = [f"{'w' * (1 + i)}" for i in range(10)]
    with ArenaLoader(Strings(), batch_size=4, num_workers=num_workers) as loader:
        texts = [t for batch in loader for t in batch["text"][:, 0].tolist()]
        labels = [int(v) for batch in loader for v in batch["label"]]
    assert texts == expected and labels == list(range(10))


@pytest.mark.parametrize("num_workers", WORKERS)
def test_prebatched_iterable_with_partial_last_batches(num_workers):
    compare(PrebatchedStream(), num_workers, batch_size=None)


@pytest.mark.parametrize("num_workers", WORKERS)
def test_collate_fn_returning_a_dataclass(num_workers):
    with ArenaLoader(Tokens(), batch_size=2, num_workers=num_workers,
                     collate_fn=dataclass_collate) as loader:
        batches = list(loader)
    assert all(isinstance(b, Batch) and b.n == 2 for b in batches)
    assert torch.equal(batches[3].x[0], Tokens()[6][0])


@dataclass
class Sized:
    x: torch.Tensor


def sized_collate(samples):
    batch = Sized(pad_sequence([s for s, _ in samples], batch_first=True))
    batch.batch_size = [len(samples)]  # state beyond the fields, as a tensorclass's
    return batch


@pytest.mark.parametrize("num_workers", WORKERS)
def test_collate_fn_returning_a_dataclass_with_more_state_than_its_fields(num_workers):
    """Handed out whole, as torch hands it out (rebuilt from its fields, it lost batch_size:
    a tensordict tensorclass came back with batch_size [], trial17)."""
    options = dict(batch_size=4, num_workers=num_workers, collate_fn=sized_collate)
    expected = list(DataLoader(Tokens(), **options))
    with ArenaLoader(Tokens(), **options) as loader:
        got = list(loader)
    assert len(got) == len(expected) == 12
    for ours, theirs in zip(got, expected):
        assert type(ours) is Sized and vars(ours).keys() == vars(theirs).keys()
        assert ours.batch_size == theirs.batch_size == [4] and torch.equal(ours.x, theirs.x)


@pytest.mark.parametrize("num_workers", WORKERS)
def test_torch_dataset_batches_are_tensors_by_default(num_workers):
    with ArenaLoader(Tokens(), batch_size=3, num_workers=num_workers,
                     collate_fn=pad_collate) as loader:
        x, _lengths, labels = next(iter(loader))
    assert isinstance(x, torch.Tensor) and isinstance(labels, torch.Tensor)
    assert (x.float() @ torch.ones(x.shape[1])).shape == (3,)


class Rows:
    def __len__(self):
        return 256

    def __getitem__(self, i):
        return np.full(4, i, np.float32), i


@pytest.mark.parametrize("num_workers", WORKERS)
def test_keeping_every_batch_works_warns_once_and_memory_returns(num_workers):
    with ArenaLoader(Rows(), batch_size=4, num_workers=num_workers) as loader:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kept = [y for _, y in loader]  # what a metrics loop keeps
        held_warnings = [w for w in caught if "batches from this ArenaLoader" in str(w.message)]
        assert len(held_warnings) == 1, [str(w.message) for w in caught]
        assert "np.array" in str(held_warnings[0].message)
        assert "held_batch_limit" in str(held_warnings[0].message)
        assert f"pass slots= more than {loader.slots}" in str(held_warnings[0].message)
        assert np.concatenate(kept).tolist() == list(range(256))
        assert loader.snapshot().held_batches >= 60
        peak = _shm_mapped_bytes()
        del kept
        assert loader.snapshot().held_batches == 0
        # The segments went with the batches: only the slab is mapped now.
        slab = loader.snapshot().slab_nbytes
        assert _shm_mapped_bytes() <= slab + 4096 < peak
        # A second epoch keeping one small view per batch, persistent or not, works too.
        kept = [x[0] for x, _ in loader]
        assert [int(v[0]) for v in kept] == list(range(0, 256, 4))


@pytest.mark.parametrize("num_workers", WORKERS)
def test_held_batch_limit_is_a_hard_cap_that_names_itself(num_workers):
    with ArenaLoader(Rows(), batch_size=4, num_workers=num_workers,
                     held_batch_limit=5) as loader:
        kept = []
        iterator = iter(loader)
        with pytest.raises(SlotsExhaustedError, match="held_batch_limit=5"):
            for batch in iterator:
                kept.append(batch)
        assert len(kept) == 5
        kept.clear()
        rest = [int(x[0, 0]) for x, _ in iterator]  # the batch that was refused is not lost
        assert rest == list(range(20, 256, 4))


def test_eight_workers_and_small_slots_work_with_defaults():
    with ArenaLoader(Rows(), batch_size=16, num_workers=8) as loader:
        assert loader.slots == 2 * 8 + 1
        assert [int(x[0, 0]) for x, _ in loader] == list(range(0, 256, 16))
    with ArenaLoader(Rows(), batch_size=16, num_workers=2, slots=2) as loader:
        assert [int(x[0, 0]) for x, _ in loader] == list(range(0, 256, 16))


class CountingRows(Rows):
    """Counts the samples loaded, across workers, in shared memory."""

    def __init__(self):
        self.loaded = multiprocessing.Value("i", 0)

    def __getitem__(self, i):
        with self.loaded.get_lock():
            self.loaded.value += 1
        return super().__getitem__(i)


@pytest.mark.parametrize("loader_type", [DataLoader, ArenaLoader])
def test_read_ahead_is_bounded_as_torch(loader_type):
    dataset = CountingRows()
    loader = loader_type(dataset, batch_size=1, num_workers=2, prefetch_factor=2)
    iterator = iter(loader)
    next(iterator)
    import time

    time.sleep(0.5)  # let the workers load all they are allowed to
    # torch: prefetch_factor * num_workers batches requested, one of them handed out, plus
    # the one requested when it was.
    assert dataset.loaded.value <= 2 * 2 + 1
    del iterator
    if hasattr(loader, "close"):
        loader.close()


class TorchOps(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        x = torch.randn(1, 2, 32)
        y = torch.nn.functional.conv1d(x, torch.randn(3, 2, 3))
        return torch.tensor([torch.get_num_threads(), y.shape[-1]])


def test_workers_use_one_torch_thread_and_conv_after_fork_does_not_hang():
    torch.nn.functional.conv1d(torch.randn(1, 2, 4096), torch.randn(3, 2, 3))  # parent pool
    with ArenaLoader(TorchOps(), batch_size=2, num_workers=2, timeout=30) as loader:
        rows = torch.cat(list(loader))
    assert rows[:, 0].tolist() == [1, 1, 1, 1] and rows[:, 1].tolist() == [30] * 4


class BarrierDataset:
    """Every worker must be running at once: a barrier across the two workers."""

    def __init__(self):
        self.barrier = multiprocessing.Barrier(2)

    def __len__(self):
        return 4

    def __getitem__(self, i):
        self.barrier.wait(timeout=20)
        return np.int64(i)


def test_all_workers_start_at_iter_so_a_cross_worker_barrier_does_not_deadlock():
    with ArenaLoader(BarrierDataset(), batch_size=1, num_workers=2, timeout=30) as loader:
        assert [int(b[0]) for b in loader] == [0, 1, 2, 3]


def test_set_start_method_is_honoured(tmp_path):
    script = textwrap.dedent("""
        import multiprocessing, os, numpy as np
        from arena_loader import ArenaLoader

        class Parent:
            def __len__(self): return 2
            def __getitem__(self, i):
                return np.int64(os.getppid() == PARENT and FORKED_MARK[0])

        PARENT, FORKED_MARK = os.getpid(), [0]
        if __name__ == "__main__":
            multiprocessing.set_start_method("spawn")
            FORKED_MARK[0] = 1  # seen by a forked worker, not by a spawned one
            with ArenaLoader(Parent(), batch_size=2, num_workers=1) as loader:
                print(int(next(iter(loader)).sum()))
    """)
    path = tmp_path / "start_method.py"
    path.write_text(script)
    result = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "0"


def _shm_mapped_bytes() -> int:
    total = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            # Slabs and segments: the order ring beside them is a few fixed KB per iterator.
            if "/dev/shm/arena_loader_" in line and ORDER_TAG not in line:
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                total += end - start
    return total


@pytest.mark.parametrize("num_workers", WORKERS)
def test_one_view_kept_per_epoch_over_20_persistent_epochs(num_workers):
    options = dict(persistent_workers=True) if num_workers else {}
    with ArenaLoader(Rows(), batch_size=64, num_workers=num_workers, **options) as loader:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kept = [next(iter(loader))[0][3] for _ in range(20)]
            baseline = _shm_mapped_bytes()
            assert [float(v[0]) for v in kept] == [3.0] * 20
            del kept
            import gc

            gc.collect()
            assert _shm_mapped_bytes() <= baseline
            # Memory is back to the slab alone: an epoch holding nothing needs no segment.
            slab = loader.snapshot().slab_nbytes
            assert sum(1 for _ in loader) == 4 and _shm_mapped_bytes() <= slab + 4096


class Growing:
    """Batches of 1 KB to 4 MB: messages must not grow with them."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return np.full(256 * 4**(i % 7), i, np.float32)


def test_no_array_bytes_travel_in_messages_as_batches_grow():
    with ArenaLoader(Growing(), batch_size=None, num_workers=2,
                     collate_fn=lambda x: [x, x[:3]]) as loader:
        iterator = iter(loader)
        sizes = [batch[0].nbytes for batch in iterator]
        stats = iterator.stats
    assert max(sizes) >= 4 * 2**20
    assert stats["result_bytes"] / stats["results_received"] < 600


class BadStream(torch.utils.data.IterableDataset):
    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        for i in range(6):
            bad = i >= 4 and (info is None or info.id == 1)
            yield np.zeros(3 if bad else 2)


class OneBadItemStream(torch.utils.data.IterableDataset):
    def __iter__(self):
        for i in range(6):
            yield np.zeros(3 if i == 4 else 2)


def test_an_iterable_error_in_a_later_batch_names_the_items_by_their_stream_position():
    """num_workers=0: a sample of the third batch is named by its place in the stream
    (items 4 and 5), not its place in the batch."""
    from arena_loader import SampleShapeError

    with ArenaLoader(OneBadItemStream(), batch_size=2) as loader, \
            pytest.raises(SampleShapeError, match=r"sample item 5 of the iterator: field sample "
                                                  r"has shape \[2\] but sample item 4 of the"):
        for batch in loader:
            del batch


@pytest.mark.parametrize("num_workers", WORKERS)
def test_iterable_errors_name_the_worker_and_the_stream_position(num_workers):
    from arena_loader import LayoutError

    with ArenaLoader(BadStream(), batch_size=6, num_workers=num_workers) as loader:
        if num_workers == 0:
            with pytest.raises(LayoutError, match=r"sample item 4 of the iterator"):
                list(loader)
            return
        with pytest.raises(LayoutError, match=r"sample item 4 of worker 1's iterator: field "
                                              r"sample has shape \[3\]"):
            list(loader)


def test_num_workers_0_iterator_read_from_two_threads_delivers_each_batch_once():
    import threading

    with ArenaLoader(Rows(), batch_size=2, output="numpy") as loader:
        iterator = iter(loader)
        seen: list[int] = []

        def drain():
            for x, _ in iterator:
                seen.append(int(x[0, 0]))

        threads = [threading.Thread(target=drain) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
    assert sorted(seen) == list(range(0, 256, 2))


# ---------------------------------------------------------------------------------------------
# Tensor samples: flat samples of fields typed by the layout earlier batches learned
# (_layout/learned.py), and by the general path when a batch differs from the last.

class Drifting:
    """(float32[3] tensor, 0-d int64 tensor, int) samples, 4 to a batch, whose batches 2 to 5
    each differ from the one before in one way: an int32 label, a float32[5] feature, a
    Python float among the ints, a dict key True where the others have 1 (``as_dict``); the
    last batch has 2 rows."""

    def __init__(self, as_dict: bool = False) -> None:
        self.as_dict = as_dict

    def __len__(self):
        return 26

    def __getitem__(self, i):
        batch = i // 4
        x = torch.arange(5 if batch == 3 else 3, dtype=torch.float32) + i
        y = torch.tensor(i % 7, dtype=torch.int32 if batch == 2 else torch.int64)
        n = i + 0.5 if batch == 4 and i % 4 == 2 else i
        if self.as_dict:
            return {True if batch == 5 else 1: x, "y": y, "n": n}
        return x, y, n


def tensor_datasets():
    """torch's TensorDataset (0-d labels), (tensor, int) tuples, {"x": tensor, "y": int}
    dicts, and the drifting samples above as tuples and as dicts."""
    features, labels = torch.randn(26, 4), torch.randint(0, 10, (26,))
    return {"TensorDataset": torch.utils.data.TensorDataset(features, labels),
            "tuple": ListOf(lambda i: (features[i], int(labels[i]))),
            "dict": ListOf(lambda i: {"x": features[i], "y": i}),
            "drifting": Drifting(), "drifting dict": Drifting(as_dict=True)}


class ListOf:
    def __init__(self, make) -> None:
        self.make = make

    def __len__(self):
        return 26

    def __getitem__(self, i):
        return self.make(i)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("options", [dict(num_workers=0), dict(num_workers=2),
                                     dict(num_workers=2, worker_mode="thread")],
                         ids=["inprocess", "processes", "threads"])
def test_tensor_samples_batch_as_torchs_dataloader_batches_them(options):
    """Every batch of two epochs of tensor samples is torch's, leaf for leaf (type, dtype,
    shape, values), batches that differ from the one before included."""
    for name, dataset in tensor_datasets().items():
        expected = list(DataLoader(dataset, batch_size=4))
        with ArenaLoader(dataset, batch_size=4, **options) as loader:
            for epoch in range(2):
                got = list(loader)
                assert len(got) == len(expected) == 7, name
                for i, (ours, theirs) in enumerate(zip(got, expected)):
                    assert_same(ours, theirs, f"{name} epoch {epoch} batch {i}", strict=True)


class GradFirst:
    """float32[2] tensor rows; in batch 1 (of 2 rows) the first row needs grad."""

    def __len__(self):
        return 6

    def __getitem__(self, i):
        row = torch.full((2,), float(i))
        return (row.requires_grad_(True) if i == 2 else row), i


def test_a_first_row_that_needs_grad_after_learned_batches_is_stacked_as_torch_stacks_it():
    """A batch whose first tensor needs grad after batches of plain ones: torch stacks it,
    grad and all (torch's workers refuse it: compared in the main process only)."""
    expected = list(DataLoader(GradFirst(), batch_size=2))
    with ArenaLoader(GradFirst(), batch_size=2) as loader:
        got = list(loader)
    assert got[1][0].requires_grad and not got[0][0].requires_grad
    for i, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        assert_same(ours, theirs, f"batch {i}", strict=True)


class BigIntLater:
    """(tensor, int) samples; sample 9 is 2**63, which int64 cannot hold."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.zeros(2), 2**63 if i == 9 else i


@pytest.mark.parametrize("num_workers", WORKERS)
def test_an_int_past_int64_after_learned_batches_names_its_sample(num_workers):
    from arena_loader.errors import LayoutError

    with ArenaLoader(BigIntLater(), batch_size=4, num_workers=num_workers) as loader:
        iterator = iter(loader)
        assert next(iterator)[1].tolist() == [0, 1, 2, 3]
        assert next(iterator)[1].tolist() == [4, 5, 6, 7]
        with pytest.raises(LayoutError, match=r"sample 9: field sample\[1\] is 9\d{18}, outside"):
            next(iterator)
