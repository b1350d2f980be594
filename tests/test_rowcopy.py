"""Large rows copied by numpy's cast loop (``_layout/rowcopy.py``): the same bits as the plain
copy for every dtype it takes, wherever the sample sits, and the plain path for every sample
it cannot take bit for bit; used by the three writers (the straight path, the planner's
equal rows, rows written by a worker's threads) once a process has found it the faster; the
choice learned from the first large writes."""

from __future__ import annotations

import numpy as np
import pytest

from arena_loader import ArenaLoader
from arena_loader._layout import rowcopy
from arena_loader._layout.rowcopy import ROW_MIN, CastRows, LoopChoice
from arena_loader.bench.workloads import placed

pytestmark = pytest.mark.timeout(60)

DTYPES = ["u1", "i1", "u2", "i2", "i4", "u8", "i8", "f2", "f4", "f8", "c8", "?", "M8[ns]",
          "m8[s]"]


@pytest.fixture
def cast_loop(monkeypatch):
    """This process has chosen the cast loop."""
    choice = LoopChoice()
    choice.cast = True
    monkeypatch.setattr(rowcopy, "CHOICE", choice)
    return choice


def random_bits(dtype: str, shape: tuple[int, ...], n: int, offset: int, seed: int = 0) -> list:
    """``n`` samples of random bits (NaN payloads, -0.0, negative numbers), each starting
    ``offset`` bytes past a cache line (glibc's malloc puts many at 16)."""
    dtype_ = np.dtype(dtype)
    raw = np.random.default_rng(seed).integers(0, 256, size=(n, *shape, dtype_.itemsize),
                                               dtype=np.uint8)
    if dtype_.kind == "b":
        raw &= 1  # a bool is 0 or 1
    values = raw.view(dtype_).reshape(n, *shape)
    return [placed(values[i], offset) for i in range(n)]


def large_shape(dtype: str) -> tuple[int, ...]:
    return (4, -(-ROW_MIN // (4 * np.dtype(dtype).itemsize)) + 3)  # just over ROW_MIN


@pytest.mark.parametrize("offset", [0, 16, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_written_by_the_cast_loop_are_the_plain_copy_bit_for_bit(cast_loop, dtype, offset):
    samples = random_bits(dtype, large_shape(dtype), 5, offset)
    out = np.zeros((5, *samples[0].shape), dtype)
    cast = CastRows.of(out)
    assert cast is not None and cast.target.dtype.kind in "iu"
    assert cast.write(samples)
    assert out.tobytes() == np.stack(samples).tobytes()
    out[...] = 0
    for row, sample in enumerate(samples):
        assert cast.write_row(row, sample)
    assert out.tobytes() == np.stack(samples).tobytes()


def test_integers_of_narrower_dtypes_promote_as_the_plain_copy_does(cast_loop):
    """A cast between integers is modular: uint8 / int8 / bool rows written into an int16
    batch seen as uint16 hold the values numpy's promotion gives."""
    shape = large_shape("i2")
    samples = [np.full(shape, -3, np.int16), np.full(shape, 250, np.uint8),
               np.full(shape, -7, np.int8), np.ones(shape, bool)]
    out = np.zeros((4, *shape), np.int16)
    assert CastRows.of(out).write(samples)
    np.testing.assert_array_equal(out, np.stack(samples))


def test_what_the_cast_loop_cannot_copy_bit_for_bit_goes_the_plain_way(cast_loop):
    """A float sample of another dtype (float16 in a float32 batch: seen as uint32 it would
    have the batch's row shape and land as garbage), a non-array, a negative Python int in
    an int batch (out of range for its unsigned view): refused, nothing claimed written."""
    shape = large_shape("f4")
    float32 = np.zeros((2, *shape), np.float32)
    cast = CastRows.of(float32)
    wide = np.ones((shape[0], 2 * shape[1]), np.float16)  # as uint32: shape (4, n), as a row
    assert cast.sources([np.ones(shape, np.float32), wide]) is None
    assert not cast.write([np.ones(shape, np.float32), wide])
    assert not cast.write([np.ones(shape, np.float32), np.ones(shape).tolist()])
    assert not cast.write_row(0, wide)
    ints = np.zeros((2, *large_shape("i4")), np.int32)
    assert not CastRows.of(ints).write([np.zeros(ints.shape[1:], np.int32), -1])
    assert not CastRows.of(ints).write([np.zeros(ints.shape[1:], np.int32)] * 3)  # 3 rows, 2


def test_small_rows_and_dtypes_without_an_integer_of_their_size_keep_memmove():
    small = np.zeros((64, ROW_MIN // 8 - 1), np.float64)
    assert CastRows.of(small) is None
    assert CastRows.of(np.zeros((4, ROW_MIN), ">u2")) is None  # not native
    assert CastRows.of(np.zeros((4, ROW_MIN // 16), "c16")) is None  # 16 bytes
    assert CastRows.of(np.zeros((4, ROW_MIN), [("a", "u1"), ("b", "u1")])) is None
    assert CastRows.of(np.zeros((0, ROW_MIN), "u1")) is None
    assert CastRows.of(np.zeros(ROW_MIN, "u1")) is None  # no rows


class Listed:
    def __init__(self, samples):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


@pytest.mark.parametrize("num_workers, worker_mode, worker_threads",
                         [(0, "process", 1), (1, "thread", 1), (1, "thread", 3)])
def test_each_writer_copies_large_rows_by_the_cast_loop(monkeypatch, cast_loop, num_workers,
                                                        worker_mode, worker_threads):
    """The planner's equal rows (each worker's first batch, num_workers=0, dicts), the
    straight path (later batches) and rows written by a worker's threads all take the cast
    loop for large rows, and their batches are the samples' bits."""
    calls: list[str] = []
    write, write_row = CastRows.write, CastRows.write_row  # (the cast loop: chosen above)

    def counted(self, samples):
        calls.append("batch")
        return write(self, samples)

    def counted_row(self, row, sample):
        calls.append("row")
        return write_row(self, row, sample)

    monkeypatch.setattr(rowcopy.CastRows, "write", counted)
    monkeypatch.setattr(rowcopy.CastRows, "write_row", counted_row)
    samples = random_bits("f4", large_shape("f4"), 12, 16)
    loader = ArenaLoader(Listed(samples), batch_size=4, num_workers=num_workers,
                         worker_mode=worker_mode, worker_threads=worker_threads)
    for _ in range(2):
        for k, batch in enumerate(loader):
            assert batch.tobytes() == np.stack(samples[4 * k: 4 * k + 4]).tobytes()
    kind = "row" if worker_threads > 1 else "batch"
    assert calls.count(kind) >= 6, calls
    images = random_bits("u1", (3, 80, 160), 8, 16)
    dicts = [{"image": image, "label": i} for i, image in enumerate(images)]
    calls.clear()
    for k, batch in enumerate(ArenaLoader(Listed(dicts), batch_size=4, num_workers=num_workers,
                                          worker_mode=worker_mode,
                                          worker_threads=worker_threads)):
        expected = np.stack([d["image"] for d in dicts[4 * k: 4 * k + 4]])
        assert batch["image"].tobytes() == expected.tobytes()
        assert batch["label"].tolist() == list(range(4 * k, 4 * k + 4))
    assert calls, "the dicts' image rows (38 KB) did not take the cast loop"


def test_the_loop_is_chosen_by_the_median_of_timed_writes_alternating_between_the_two():
    for cast_s, plain_s, chosen in ((1.0, 1.4, True), (1.4, 1.0, False)):
        choice = LoopChoice()
        turns = []
        while choice.cast is None:
            turns.append(choice.next_cast)
            # one outlier each way: the median ignores it
            slow = 10.0 if len(turns) == 3 else 1.0
            choice.record(choice.next_cast, 100, slow * (cast_s if turns[-1] else plain_s))
        assert turns == [True, False] * LoopChoice.TRIES
        assert choice.cast is chosen
        choice.record(True, 100, 1e-9)  # decided: later timings change nothing
        assert choice.cast is chosen


def test_a_process_learns_its_loop_from_its_first_large_writes(monkeypatch):
    """With nothing learned, a loader's large batches are written by both loops in turn,
    each timed, and correctly, until the choice is made; chosen memmove, no CastRows is
    made at all."""
    timed: list[bool] = []

    class Counted(LoopChoice):
        def record(self, cast, nbytes, seconds):
            if self.cast is None:
                timed.append(cast)
            super().record(cast, nbytes, seconds)

    choice = Counted()
    monkeypatch.setattr(rowcopy, "CHOICE", choice)
    samples = random_bits("u1", large_shape("u1"), 48, 16)
    for k, batch in enumerate(ArenaLoader(Listed(samples), batch_size=4)):
        assert batch.tobytes() == np.stack(samples[4 * k: 4 * k + 4]).tobytes()
    assert choice.cast is not None
    assert timed == [True, False] * LoopChoice.TRIES
    choice.cast = False
    assert CastRows.of(np.zeros((4, *large_shape("u1")), np.uint8)) is None


def test_a_write_into_memory_not_written_before_is_not_timed(monkeypatch):
    """Its page faults would outweigh the loop: the first write to an address is left out,
    the second is timed (and the turn passes to the other loop)."""
    choice = LoopChoice()
    monkeypatch.setattr(rowcopy, "CHOICE", choice)
    samples = random_bits("u2", large_shape("u2"), 3, 16)
    cast = CastRows.of(np.zeros((3, *samples[0].shape), np.uint16))
    assert cast.write(samples) and choice.next_cast is True
    assert cast.write(samples) and choice.next_cast is False
    np.testing.assert_array_equal(cast.out, np.stack(samples))
