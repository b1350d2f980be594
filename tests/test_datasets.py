"""Array-backed datasets and the batch protocol: the compiled gather writes exactly the rows
of ``array[indices]`` into the slot, for every dtype, shape and worker kind."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from arena_loader import ArenaLoader, ArrayDataset, BatchReadable, LayoutError, MemmapDataset
from arena_loader._gather import gather_rows

from .datasets import ProtocolDataset, make_array

pytestmark = pytest.mark.timeout(60)

DTYPES = [np.uint8, np.int8, np.int16, np.uint16, np.int32, np.int64, np.float16, np.float32,
          np.float64, np.complex64, np.complex128, np.bool_, "S3", "<M8[s]"]
TRAILING_SHAPES = [(), (1,), (16,), (3, 5), (2, 3, 4), (0,)]
WORKERS = [(0, "process"), (2, "process"), (2, "thread")]


def rows_array(n: int, shape: tuple[int, ...], dtype) -> np.ndarray:
    """``n`` distinct rows of ``shape`` and ``dtype``."""
    dtype = np.dtype(dtype)
    values = np.stack([make_array(i, shape, np.int64) for i in range(n)]) + np.arange(n).reshape(
        (n,) + (1,) * len(shape))
    if dtype.kind == "b":
        return (values % 2 == 1)
    return values.astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", TRAILING_SHAPES)
def test_gather_rows_equals_fancy_indexing_for_every_dtype_and_shape(dtype, shape):
    """Sequential, shuffled, repeated and negative indices give exactly array[indices]."""
    source = rows_array(23, shape, dtype)
    rng = np.random.default_rng(0)
    for indices in (np.arange(23), rng.permutation(23), np.array([5, 5, 0, 22]),
                    np.array([-1, -23, 3]), np.array([7])):
        out = np.empty((len(indices), *shape), source.dtype)
        gather_rows(source, indices, out)
        np.testing.assert_array_equal(out, source[indices])


@pytest.mark.parametrize("make_source", [
    lambda a: a[::3],  # strided rows
    lambda a: a[:, 1:4],  # contiguous bytes inside each row, row stride larger than the row
    lambda a: np.asfortranarray(a),  # row bytes scattered: numpy's take
    lambda a: a[:, ::2],  # strided inside rows
    lambda a: a[::-1],  # negative row stride
], ids=["rows-strided", "columns-sliced", "fortran", "inner-strided", "reversed"])
def test_gather_rows_handles_non_contiguous_sources(make_source):
    """Views that are not C-contiguous are gathered correctly, without copying them first."""
    source = make_source(rows_array(30, (6,), np.float32))
    indices = np.array([0, len(source) - 1, 2, -2, 1])
    out = np.empty((5, *source.shape[1:]), source.dtype)
    gather_rows(source, indices, out)
    np.testing.assert_array_equal(out, source[indices])


@pytest.mark.parametrize("fortran", [False, True], ids=["compiled", "numpy-take"])
@pytest.mark.parametrize("bad", [10, -11, 2**40])
def test_out_of_range_index_names_the_index_and_length(bad, fortran):
    """An index outside [-n, n) is an IndexError naming it, the array and its length, on the
    compiled path and on numpy's take for scattered rows (whose wrap mode would otherwise
    read -11 as row 9)."""
    source = rows_array(10, (2,), np.int32)
    if fortran:
        source = np.asfortranarray(source)
    out = np.empty((3, 2), np.int32)
    with pytest.raises(IndexError, match=rf"index {bad} is out of range for arrays\[1\] with "
                                         r"10 rows"):
        gather_rows(source, np.array([1, bad, 2]), out, "arrays[1]")


def test_out_with_the_wrong_shape_or_dtype_is_rejected():
    """read_into's destination must match the rows it receives."""
    source = rows_array(10, (2,), np.int32)
    with pytest.raises(ValueError, match=r"out for array must be int32\[2, 2\], got int64"):
        gather_rows(source, [0, 1], np.empty((2, 2), np.int64))


def test_array_dataset_samples_are_tuples_or_dicts_like_tensor_dataset():
    """dataset[i] is (x[i], y[i]) or {"x": x[i], ...}; negative indices count from the end."""
    x, y = rows_array(5, (3,), np.float32), np.arange(5)
    dataset = ArrayDataset(x, y)
    assert len(dataset) == 5 and isinstance(dataset, BatchReadable)
    sample = dataset[-1]
    assert isinstance(sample, tuple)
    np.testing.assert_array_equal(sample[0], x[4])
    assert sample[1] == 4
    named = ArrayDataset({"x": x, "y": y})
    assert named[2].keys() == {"x", "y"} and named[2]["y"] == 2
    with pytest.raises(IndexError, match="index 5 is out of range for ArrayDataset with 5"):
        dataset[5]


def test_array_dataset_rejects_arrays_of_different_lengths_naming_the_array():
    """Unequal lengths, 0-d and object arrays are errors naming the offending array."""
    with pytest.raises(ValueError, match=r"arrays\[1\] has 4 but arrays\[0\] has 5"):
        ArrayDataset(np.zeros(5), np.zeros(4))
    with pytest.raises(ValueError, match=r"arrays\['y'\] has 4 but arrays\['x'\] has 5"):
        ArrayDataset({"x": np.zeros(5), "y": np.zeros(4)})
    with pytest.raises(ValueError, match=r"arrays\[0\] must have at least one dimension"):
        ArrayDataset(np.float32(3))
    with pytest.raises(TypeError, match=r"arrays\[0\] must have a numeric"):
        ArrayDataset(np.array([object(), 1]))
    with pytest.raises(ValueError, match="needs at least one array"):
        ArrayDataset()


@pytest.mark.parametrize("num_workers, worker_mode", WORKERS)
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("dtype, shape", [(np.float32, (16,)), (np.uint8, (3, 4, 5)),
                                          (np.int64, ()), (np.complex64, (2,)),
                                          (np.bool_, (7,))])
def test_loader_batches_are_the_rows_of_the_arrays(num_workers, worker_mode, shuffle, dtype,
                                                   shape):
    """Every batch is exactly (x[indices], y[indices]), the partial last batch included."""
    n, batch_size = 37, 8
    x = rows_array(n, shape, dtype)
    y = np.arange(n, dtype=np.int64) * 3
    with ArenaLoader(ArrayDataset(x, y), batch_size=batch_size, shuffle=shuffle, generator=1,
                     num_workers=num_workers, worker_mode=worker_mode) as loader:
        seen = []
        for batch_x, batch_y in loader:
            indices = batch_y // 3
            assert batch_x.dtype == x.dtype and batch_x.shape == (len(indices), *shape)
            np.testing.assert_array_equal(batch_x, x[indices])
            seen.extend(indices.tolist())
    assert len(seen) == n and sorted(seen) == list(range(n))
    assert (seen == list(range(n))) is not shuffle
    assert len(seen) % batch_size == 5  # the partial last batch of 5 rows was delivered


class _Bfloat16Rows:
    """read_into with a field of a torch dtype numpy lacks: ``out`` holds its bits (int16)."""

    def __len__(self):
        return 4

    def __getitem__(self, index):
        import torch

        return {"x": torch.full((2,), index + 0.5, dtype=torch.bfloat16)}

    def read_into(self, indices, out):
        import torch

        rows = torch.stack([self[int(i)]["x"] for i in indices])
        out["x"][...] = rows.view(torch.int16).numpy()


def test_read_into_a_field_of_a_dtype_numpy_lacks_gives_that_dtype_back():
    """A bfloat16 field written by read_into as its bits comes back a bfloat16 tensor (the
    batch plan keeps the torch dtype's name beside the int16 it is stored as)."""
    torch = pytest.importorskip("torch")
    with ArenaLoader(_Bfloat16Rows(), batch_size=2) as loader:
        batches = [batch["x"] for batch in loader]
    assert [(b.dtype, b.tolist()) for b in batches] == [
        (torch.bfloat16, [[0.5, 0.5], [1.5, 1.5]]), (torch.bfloat16, [[2.5, 2.5], [3.5, 3.5]])]


@pytest.mark.parametrize("num_workers, worker_mode", WORKERS)
def test_read_into_replaces_per_sample_calls(num_workers, worker_mode):
    """A dataset with read_into gets one call per batch, plus one dataset[i] for the layout."""
    dataset = ProtocolDataset(20)
    with ArenaLoader(dataset, batch_size=6, num_workers=num_workers,
                     worker_mode=worker_mode) as loader:
        batches = [{k: np.array(v) for k, v in batch.items()} for batch in loader]
        calls = dataset.calls if worker_mode == "thread" or num_workers == 0 else None
    assert [b["index"].tolist() for b in batches] == [list(range(s, min(s + 6, 20)))
                                                      for s in range(0, 20, 6)]
    for batch in batches:
        np.testing.assert_array_equal(batch["square"], batch["index"] ** 2)
        assert batch["square"].dtype == np.float64 and batch["index"].dtype == np.int64
    if calls is not None:  # counters live in this process only for in-process loading
        assert calls == {"getitem": 1, "read_into": 4}


class _ArgumentTypes(ProtocolDataset):
    """Records what read_into and __getitem__ are given (in this process)."""

    def __init__(self, n):
        super().__init__(n)
        self.seen = []

    def __getitem__(self, index):
        self.seen.append(("getitem", type(index)))
        return super().__getitem__(index)

    def read_into(self, indices, out):
        # (a view: a slice of the epoch's order; a list turned into an array owns its data)
        self.seen.append(("read_into", type(indices), indices.dtype, indices.base is not None,
                          indices.tolist()))
        super().read_into(indices, out)


@pytest.mark.parametrize("shuffle", [False, True])
def test_in_process_read_into_gets_the_sampler_batches_as_int64_arrays(shuffle):
    """num_workers=0: read_into is given each batch of the sampler as an int64 array (the
    sampler's own array, never a list made and turned back), __getitem__ a Python int."""
    dataset = _ArgumentTypes(20)
    # generator=0: numpy's permutation (with torch imported and no generator, shuffling
    # follows torch's global RNG, drawn through torch as its sampler draws: lists)
    with ArenaLoader(dataset, batch_size=6, shuffle=shuffle, generator=0) as loader:
        rows = [batch["index"].tolist() for batch in loader]
    assert dataset.seen[0] == ("getitem", int)
    reads = dataset.seen[1:]
    assert all(r[:4] == ("read_into", np.ndarray, np.int64, True) for r in reads), reads
    assert [r[4] for r in reads] == rows
    assert sorted(i for row in rows for i in row) == list(range(20))


def test_custom_collate_fn_uses_per_sample_getitem():
    """With a collate_fn the batch protocol is bypassed: collate_fn sees the samples."""
    x = rows_array(10, (2,), np.int32)
    with ArenaLoader(ArrayDataset(x), batch_size=4,
                     collate_fn=lambda samples: np.stack([s[0] for s in samples]) * 2) as loader:
        batches = [np.array(b) for b in loader]
    np.testing.assert_array_equal(np.concatenate(batches), x * 2)


def test_read_into_with_non_numeric_leaves_is_a_layout_error():
    """read_into cannot fill strings; the error names the leaf and the fix."""
    dataset = ProtocolDataset(10, with_name=True)
    with ArenaLoader(dataset, batch_size=4) as loader, \
            pytest.raises(LayoutError, match=r"read_into, but leaves \[\"sample\['name'\]\"\]"):
        next(iter(loader))


def test_out_of_range_sampler_index_fails_only_that_batch():
    """A sampler index past the end raises IndexError at its batch; the next batch is fine."""
    x = rows_array(10, (2,), np.int32)
    with ArenaLoader(ArrayDataset(x), batch_sampler=[[0, 1], [2, 10], [3]],
                     num_workers=1) as loader:
        iterator = iter(loader)
        np.testing.assert_array_equal(next(iterator)[0], x[[0, 1]])
        with pytest.raises(IndexError, match=r"index 10 is out of range for arrays\[0\] with 10"):
            next(iterator)
        np.testing.assert_array_equal(next(iterator)[0], x[[3]])


def save_arrays(tmp_path, n=50):
    x = rows_array(n, (4, 3), np.float32)
    y = np.arange(n, dtype=np.int16)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    return x, y


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_memmap_dataset_works_with_spawn_and_pickles_only_paths(tmp_path, context):
    """Workers under spawn/forkserver reopen the files; the pickle holds no array bytes."""
    x, _ = save_arrays(tmp_path)
    dataset = MemmapDataset({"x": tmp_path / "x.npy", "y": str(tmp_path / "y.npy")})
    dataset[0]  # opened here: pickling must still leave the arrays out
    assert len(pickle.dumps(dataset)) < 1000 < x.nbytes
    with ArenaLoader(dataset, batch_size=16, shuffle=True, num_workers=2,
                     multiprocessing_context=context) as loader:
        seen = []
        for batch in loader:
            np.testing.assert_array_equal(batch["x"], x[batch["y"]])
            seen.extend(batch["y"].tolist())
    assert sorted(seen) == list(range(50))


def test_memmap_dataset_accepts_numpy_memmaps_and_rejects_slices(tmp_path):
    """A memmap as opened is described by file, dtype, shape and offset; a slice is refused."""
    raw = rows_array(12, (5,), np.int32)
    path = tmp_path / "raw.bin"
    header = b"0123456789abcdef"
    path.write_bytes(header + raw.tobytes())
    mapped = np.memmap(path, dtype=np.int32, mode="r", offset=len(header), shape=(12, 5))
    dataset = MemmapDataset(mapped)
    restored = pickle.loads(pickle.dumps(dataset))
    out = (np.empty((3, 5), np.int32),)
    restored.read_into(np.array([11, 0, 4]), out)
    np.testing.assert_array_equal(out[0], raw[[11, 0, 4]])
    with pytest.raises(ValueError, match=r"arrays\[0\] must be a numpy.memmap as opened"):
        MemmapDataset(mapped[2:])
    with pytest.raises(ValueError, match=r"arrays\[0\] must be a readable .npy file"):
        MemmapDataset(path)
    del mapped


def test_memmap_dataset_rejects_fortran_order_and_unequal_lengths(tmp_path):
    """Fortran-ordered files and files of different lengths are named with the fix."""
    np.save(tmp_path / "f.npy", np.asfortranarray(np.zeros((4, 3))))
    with pytest.raises(ValueError, match="Fortran order; save it as"):
        MemmapDataset(tmp_path / "f.npy")
    np.save(tmp_path / "a.npy", np.zeros(4))
    np.save(tmp_path / "b.npy", np.zeros(5))
    with pytest.raises(ValueError, match=r"arrays\[1\] has 5 but arrays\[0\] has 4"):
        MemmapDataset(tmp_path / "a.npy", tmp_path / "b.npy")


def test_array_dataset_pickles_its_arrays_once():
    """After a batch, pickling (spawn) carries each array once and still gathers correctly."""
    x = rows_array(1000, (8,), np.float64)
    dataset = ArrayDataset(x)
    dataset.read_into(np.array([3, 1]), (np.empty((2, 8)),))
    payload = pickle.dumps(dataset)
    assert x.nbytes < len(payload) < 1.5 * x.nbytes
    out = (np.empty((2, 8)),)
    pickle.loads(payload).read_into(np.array([999, -1000]), out)
    np.testing.assert_array_equal(out[0], x[[999, 0]])


def test_gather_is_compiled_in_the_parent_before_fork_workers_start():
    """Forked workers inherit the compiled gather: the main process compiles it first (checked
    in a fresh interpreter, where nothing else compiled it)."""
    script = textwrap.dedent("""
        import numpy as np
        from arena_loader import ArenaLoader, ArrayDataset
        x = np.arange(120, dtype=np.uint16).reshape(40, 3)
        with ArenaLoader(ArrayDataset(x), batch_size=4, num_workers=2,
                         multiprocessing_context="fork") as loader:
            first = next(iter(loader))[0]
            assert (first == x[:4]).all()
            from arena_loader import _gather
            # The part under test: its numba kernel (private to _gather) compiled once.
            print("signatures", len(_gather._gather_byte_rows.signatures))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert "signatures 1" in result.stdout
