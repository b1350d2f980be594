"""What runs inside workers: worker info, seeding, worker_init_fn, batched fetch."""

from __future__ import annotations

import errno

import numpy as np
import pytest

from arena_loader import ArenaLoader, get_worker_info

from .conftest import live_children
from .datasets import BatchedFetchDataset, ImageDataset, WorkerProbeDataset, fail_init

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("worker_mode", ["process", "thread"])
def test_worker_info_names_the_loading_worker(worker_mode):
    """get_worker_info() is None in the main process and names the worker inside one."""
    assert get_worker_info() is None
    with ArenaLoader(WorkerProbeDataset(24), batch_size=2, num_workers=3,
                     worker_mode=worker_mode) as loader:
        batches = [(b["worker"].tolist(), b["num_workers"].tolist()) for b in loader]
    # Every batch, the first (whose layout sizes the slab) included, is loaded round-robin.
    assert len(batches) == 12
    for idx, (workers, counts) in enumerate(batches):
        assert workers == [idx % 3] * 2 and counts == [3, 3]
    assert get_worker_info() is None


def test_workers_draw_different_random_numbers_and_seeds_reproduce():
    """numpy draws differ between workers; a generator seed reproduces them exactly."""
    def draws(seed):
        with ArenaLoader(WorkerProbeDataset(40), batch_size=4, num_workers=2,
                         generator=seed) as loader:
            return {int(w): d for b in loader
                    for w, d in zip(b["worker"].tolist(), b["draw"].tolist())}

    first, again, other = draws(5), draws(5), draws(6)
    assert first.keys() == {0, 1} and first[0] != first[1]
    assert first == again
    assert first != other


class _InitArgProbe(ImageDataset):
    """Each sample: the loading worker's id and what ``_record_init_arg`` was called with."""

    init_arg = -1

    def __getitem__(self, index: int) -> dict:
        return {"worker": get_worker_info().id, "init_arg": self.init_arg}


def _record_init_arg(worker_id: int) -> None:
    get_worker_info().dataset.init_arg = worker_id  # (this worker's copy of the dataset)


def _fail_init_in_worker_1(worker_id: int) -> None:
    if worker_id == 1:
        fail_init(worker_id)


def test_worker_init_fn_error_names_the_worker_it_failed_in():
    """Only worker 1's worker_init_fn raises: the error names worker 1, not another."""
    with ArenaLoader(ImageDataset(8), batch_size=2, num_workers=2,
                     worker_init_fn=_fail_init_in_worker_1) as loader:
        with pytest.raises(FileNotFoundError) as info:
            list(loader)
    assert info.value.worker_id == 1
    assert str(info.value).startswith("Caught FileNotFoundError in DataLoader worker process 1.")


def _init_raising_stop_iteration(worker_id: int) -> None:
    raise StopIteration("no shard for this worker")


def test_worker_init_fn_raising_stop_iteration_is_a_runtime_error_not_an_empty_epoch():
    """StopIteration out of worker_init_fn reaches next() as a RuntimeError (the worker's
    traceback in it): raised as itself, it would end the epoch as if it were empty."""
    with ArenaLoader(ImageDataset(8), batch_size=2, num_workers=1,
                     worker_init_fn=_init_raising_stop_iteration) as loader:
        with pytest.raises(RuntimeError, match=r"(?s)^Caught StopIteration in DataLoader "
                                               r"worker process 0\..*no shard for this worker"):
            list(loader)


def test_worker_init_fn_is_called_with_its_workers_id():
    """worker_init_fn(worker_id) gets the id of the worker it runs in, as torch's does: a
    dataset that opens shard ``worker_id`` there must not have every worker open shard 0."""
    with ArenaLoader(_InitArgProbe(12), batch_size=2, num_workers=3,
                     worker_init_fn=_record_init_arg) as loader:
        batches = [(b["worker"].tolist(), b["init_arg"].tolist()) for b in loader]
    assert {worker for workers, _ in batches for worker in workers} == {0, 1, 2}
    assert all(workers == args for workers, args in batches), batches


@pytest.mark.parametrize("worker_mode", ["process", "thread"])
@pytest.mark.parametrize("num_workers", [1, 3])
def test_worker_init_fn_error_is_raised_with_its_type(num_workers, worker_mode):
    """An exception in worker_init_fn reaches next() with its type, worker id and worker
    traceback, after every worker is stopped; it is fatal for the epoch (raised again), and
    the loader stays usable once the init succeeds."""
    failing = {"init": True}

    def init(worker_id):
        if failing["init"]:
            fail_init(worker_id)

    with ArenaLoader(ImageDataset(8), batch_size=2, num_workers=num_workers,
                     worker_init_fn=init, worker_mode=worker_mode) as loader:
        iterator = iter(loader)
        pattern = (r"(?s)^Caught FileNotFoundError in DataLoader worker process \d\.\n"
                   r"builtins.FileNotFoundError while starting.*cannot open shard")
        with pytest.raises(FileNotFoundError, match=pattern) as info:
            for _ in iterator:
                pass
        assert not live_children()
        error = info.value
        assert error.errno == errno.ENOENT  # kept, while str() starts with torch's words
        assert 0 <= error.worker_id < num_workers and error.batch_idx is None
        assert f"cannot open shard for worker {error.worker_id}" in str(error)
        assert ", in fail_init\n" in str(error) and isinstance(error.__cause__, OSError)
        with pytest.raises(OSError) as again:
            next(iterator)
        assert type(again.value) is type(error) and str(again.value) == str(error)
        assert again.value.errno == errno.ENOENT
        del iterator, info, again, error
        failing["init"] = False  # forked workers of the next epoch see the new value
        assert sum(1 for _ in loader) == 4


@pytest.mark.parametrize("num_workers, worker_mode", [(0, "process"), (2, "process"),
                                                      (2, "thread")])
def test_dataset_getitems_is_used_for_batched_fetch(num_workers, worker_mode):
    """A dataset with __getitems__ is fetched a batch at a time, as torch does."""
    dataset = BatchedFetchDataset(10, shape=(2,), dtype=np.int64)
    with ArenaLoader(dataset, batch_size=4, num_workers=num_workers,
                     worker_mode=worker_mode) as loader:
        batches = [np.array(batch) for batch in loader]
    assert len(batches) == 3
    for start, batch in zip(range(0, 10, 4), batches):
        expected = np.stack([dataset[i] + 1 for i in range(start, min(start + 4, 10))])
        np.testing.assert_array_equal(batch, expected)


class BatchedReadDataset:
    """__getitems__ as one batched read (h5py/zarr/pandas style): it returns one structure for
    the whole batch, not one sample per index."""

    def __init__(self, n: int) -> None:
        self.x = np.arange(n * 2, dtype=np.float32).reshape(n, 2)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.x[index]

    def __getitems__(self, indices: list) -> dict:
        return {"x": self.x[np.asarray(indices)], "indices": list(indices)}


def _keep_batch(batch: dict) -> dict:
    return {"x": np.array(batch["x"]), "indices": batch["indices"]}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_getitems_result_goes_to_the_collate_fn_as_it_is(num_workers):
    """With a collate_fn, what __getitems__ returns is handed to it unchanged, as torch's
    fetcher does, even when it is not one sample per index."""
    dataset = BatchedReadDataset(10)
    with ArenaLoader(dataset, batch_size=4, num_workers=num_workers,
                     collate_fn=_keep_batch) as loader:
        batches = list(loader)
    assert [batch["indices"] for batch in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    for batch in batches:
        np.testing.assert_array_equal(batch["x"], dataset.x[batch["indices"]])


class IndexKinds:
    """Sample ``i``: its value and the type of the index the dataset was given."""

    def __len__(self) -> int:
        return 20

    def __getitem__(self, index) -> dict:
        return {"x": np.int64(index), "kind": type(index).__name__}


class ArrayBatches:
    """A batch_sampler yielding numpy index arrays: an int32 or uint8 index file's batches,
    or strided views of an int64 order (``order[k::3]``)."""

    def __init__(self, dtype, strided: bool = False):
        self.dtype, self.strided = dtype, strided

    def __len__(self) -> int:
        return 3

    def __iter__(self):
        order = np.arange(19, -1, -1).astype(self.dtype)
        if self.strided:
            return iter([order[k::3] for k in range(3)])
        return iter(np.array_split(order, 3))


@pytest.mark.parametrize(("dtype", "strided"), [(np.int32, False), (np.uint8, False),
                                                 (np.int16, False), (np.int64, True),
                                                 (np.int64, False)])
def test_a_batch_sampler_of_numpy_arrays_of_any_int_dtype_gives_torchs_batches(dtype,
                                                                              strided):
    """A batch_sampler's index arrays reach the workers as the arrays they are: the dataset
    gets their numpy scalars, as torch's gets them (and as with num_workers=0). They were
    written into the order ring as if int64 (a worker died on 'bytes length not a multiple
    of item size', or read other indices), a strided view raised TypeError from next(), and
    int64 ones reached the dataset as Python ints."""
    from torch.utils.data import DataLoader

    def batches(kind):
        loader = kind(IndexKinds(), batch_sampler=ArrayBatches(dtype, strided), num_workers=2)
        try:
            return [(np.asarray(b["x"]).tolist(), b["kind"]) for b in loader]
        finally:
            getattr(loader, "close", lambda: None)()

    expected = batches(DataLoader)
    assert expected[0][1][0] == np.dtype(dtype).name
    assert batches(ArenaLoader) == expected


class TorchDrawDataset(ImageDataset):
    """Sample ``i``: a draw from torch's global RNG in the loading worker; whether torch was
    loaded in that worker before it; what torch's get_worker_info() and thread count say."""

    def __getitem__(self, index: int) -> list[int]:
        import sys

        loaded = "torch" in sys.modules
        import torch

        info = torch.utils.data.get_worker_info()
        return [int(torch.randint(0, 2**62, ()).item()), int(loaded), info.id,
                info.num_workers, torch.get_num_threads(), get_worker_info().id]


@pytest.mark.timeout(90)
def test_torch_rng_is_seeded_per_worker_even_under_spawn():
    """torch draws in the dataset differ between workers and reproduce with a seed, also in
    a spawned interpreter that imports torch only inside __getitem__: there they are the
    draws forked workers make with the same seed (torch seeds each worker's RNG with
    base_seed + worker id whatever the start method). And a spawned worker of a program that
    uses torch does not import torch (~3 s of CPU each) before its dataset does; once that
    imports it, torch is set up as in torch's own workers: get_worker_info() answers and
    torch runs one intra-op thread. One spawned run: each spawned worker imports torch."""
    import torch  # the main program uses torch: the workers' torch RNG must be seeded

    def rows(seed, context="fork"):
        with ArenaLoader(TorchDrawDataset(4), batch_size=None, num_workers=2,
                         multiprocessing_context=context, sampler=[0, 1, 2, 3],
                         generator=torch.Generator().manual_seed(seed)) as loader:
            return [[int(v) for v in row] for row in loader]

    first = [row[0] for row in rows(3)]
    assert len(set(first)) == 4  # two per worker, all different
    assert [row[0] for row in rows(3)] == first and [row[0] for row in rows(4)] != first
    spawned = rows(3, "spawn")
    assert [row[0] for row in spawned] == first
    assert [row[1] for row in spawned] == [0, 0, 1, 1]  # each worker's first sample imports it
    assert [row[2:] for row in spawned] == [[0, 2, 1, 0], [1, 2, 1, 1], [0, 2, 1, 0],
                                            [1, 2, 1, 1]]


MAIN_CLASS_PROGRAM = '''
import numpy as np
from arena_loader import ArenaLoader, WorkerCrashedError

class NotebookDataset:  # defined in __main__, as a notebook cell or `python -c` defines it
    def __len__(self):
        return 4
    def __getitem__(self, i):
        return np.full(3, i, dtype=np.float32)

try:
    list(ArenaLoader(NotebookDataset(), batch_size=2, num_workers=1,
                     multiprocessing_context=%r))
except WorkerCrashedError as exc:
    print("CRASHED", exc)
'''


@pytest.mark.timeout(60)
@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_spawned_worker_of_a_main_defined_dataset_names_the_class_and_the_fix(context):
    """A dataset class defined in an interactive __main__ (a Jupyter notebook, `python -c`)
    cannot be unpickled by a spawn / forkserver worker, which dies with code 1 before loading
    anything: the error names the class and the fix (a module file, or fork), not a failing
    sample, and keeps torch's words."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", MAIN_CLASS_PROGRAM % context],
                         capture_output=True, text=True, timeout=50).stdout
    assert out.startswith("CRASHED"), out
    assert "NotebookDataset" in out and "__main__" in out
    assert "multiprocessing_context='fork'" in out and ".py file" in out
    assert "to see the failing sample's error" not in out
    assert "exited unexpectedly" in out  # torch's words
