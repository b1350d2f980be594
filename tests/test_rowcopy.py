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
from arena_loader._layout.rowcopy import ROW_MIN, CastRows, LoopChoice, RowClass
from arena_loader.bench.workloads import placed

pytestmark = pytest.mark.timeout(60)

DTYPES = ["u1", "i1", "u2", "i2", "i4", "u8", "i8", "f2", "f4", "f8", "c8", "?", "M8[ns]",
          "m8[s]"]


class Decided(LoopChoice):
    """Every class of row sizes has chosen ``cast`` (True: the cast loop)."""

    def __init__(self, cast: bool = True):
        super().__init__()
        self.cast = cast

    def of(self, row_nbytes):
        row_class = RowClass()
        row_class.cast = self.cast
        return row_class


@pytest.fixture
def cast_loop(monkeypatch):
    """This process has chosen the cast loop."""
    monkeypatch.setattr(rowcopy, "CHOICE", Decided())


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
    have the batch's row shape and land as garbage), a non-array (a nested list holding 200
    for an int8 batch: the cast to its uint8 view would take it), a float among integers, a
    row too many: refused, nothing claimed written."""
    shape = large_shape("f4")
    float32 = np.zeros((2, *shape), np.float32)
    cast = CastRows.of(float32)
    wide = np.ones((shape[0], 2 * shape[1]), np.float16)  # as uint32: shape (4, n), as a row
    assert cast.sources([np.ones(shape, np.float32), wide]) is None
    assert not cast.write([np.ones(shape, np.float32), wide])
    assert not cast.write([np.ones(shape, np.float32), np.ones(shape).tolist()])
    assert not cast.write_row(0, wide)
    small = np.zeros((2, *large_shape("i1")), np.int8)
    listed = np.full(small.shape[1:], 200).tolist()  # out of int8's range: numpy raises
    assert not CastRows.of(small).write([np.zeros(small.shape[1:], np.int8), listed])
    assert not CastRows.of(small).write([np.zeros(small.shape[1:], np.int8),
                                         np.zeros(small.shape[1:], np.float32)])
    assert not CastRows.of(small).write([np.zeros(small.shape[1:], np.int8)] * 3)  # 3 rows, 2


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
        done = write(self, samples)
        calls.append("batch" if done else "declined")
        return done

    def counted_row(self, row, sample):
        done = write_row(self, row, sample)
        calls.append("row" if done else "declined")
        return done

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
    assert calls and "declined" not in calls, "the dicts' image rows (38 KB) missed the cast loop"


def test_a_class_chooses_by_the_median_of_timed_writes_alternating_between_the_two():
    for cast_s, plain_s, chosen in ((1.0, 1.4, True), (1.4, 1.0, False)):
        row_class = RowClass()
        turns = []
        while row_class.cast is None:
            turns.append(row_class.next_cast)
            slow = 10.0 if len(turns) == 3 else 1.0  # one outlier: the median ignores it
            row_class.record(row_class.next_cast, 100,
                             slow * (cast_s if turns[-1] else plain_s))
        assert turns == [True, False] * LoopChoice.TRIES
        assert row_class.cast is chosen
        row_class.record(True, 100, 1e-9)  # decided: later timings change nothing
        assert row_class.cast is chosen


def test_row_sizes_learn_apart_and_a_class_the_cast_loop_cannot_take_keeps_memmove():
    """Two large fields of a batch (an image, a mask) alternate each in its own class, so
    each loop is timed on each; a class whose samples the cast loop refuses (float16 rows in
    a float32 batch) times memmove alone and settles on it after GIVE_UP writes."""
    choice = LoopChoice()
    assert choice.of(150_000) is choice.of(140_000) is not choice.of(40_000)
    shape = large_shape("f4")
    out = np.zeros((2, *shape), np.float32)
    halves = [np.ones(shape, np.float16)] * 2
    row_class = choice.of(out.nbytes // 2)
    cast = CastRows(out, out.view(np.int32), np.dtype(np.uint32), row_class)
    for _ in range(LoopChoice.GIVE_UP + 1):  # the first write, to memory not written before,
        assert cast.write(halves)  # is not timed
    assert row_class.cast is False and row_class.rates[True] == []
    np.testing.assert_array_equal(out, np.ones((2, *shape)))


def test_a_workers_threads_never_time_and_take_the_cast_loop_only_once_learned():
    row_class = RowClass()
    out = np.zeros((3, *large_shape("u1")), np.uint8)
    cast = CastRows(out, out.view(np.int8), None, row_class)
    sample = np.full(out.shape[1:], 7, np.uint8)
    assert not cast.write_row(0, sample)  # learning: the caller's plain path writes it
    assert row_class.rates == {True: [], False: []} and not row_class.written
    row_class.cast = True
    assert cast.write_row(1, sample) and (out[1] == 7).all()


def test_a_process_learns_its_loop_from_its_first_large_writes(monkeypatch):
    """With nothing learned, a loader's large batches are written by both loops in turn,
    each timed, and correctly, until the choice is made; chosen memmove, no CastRows is
    made at all."""
    timed: list[bool] = []

    class Counted(RowClass):
        def record(self, cast, nbytes, seconds):
            if self.cast is None:
                timed.append(cast)
            super().record(cast, nbytes, seconds)

    class Choice(LoopChoice):
        def of(self, row_nbytes):
            return self._classes.setdefault(row_nbytes.bit_length(), Counted())

    choice = Choice()
    monkeypatch.setattr(rowcopy, "CHOICE", choice)
    samples = random_bits("u1", large_shape("u1"), 48, 16)
    for k, batch in enumerate(ArenaLoader(Listed(samples), batch_size=4)):
        assert batch.tobytes() == np.stack(samples[4 * k: 4 * k + 4]).tobytes()
    row_class = choice.of(samples[0].nbytes)
    assert row_class.cast is not None
    assert timed == [True, False] * LoopChoice.TRIES
    row_class.cast = False
    assert CastRows.of(np.zeros((4, *large_shape("u1")), np.uint8)) is None


def test_a_write_into_memory_not_written_before_is_not_timed(monkeypatch):
    """Its page faults would outweigh the loop: the first write to an address is left out,
    the second is timed (and the turn passes to the other loop)."""
    choice = LoopChoice()
    monkeypatch.setattr(rowcopy, "CHOICE", choice)
    samples = random_bits("u2", large_shape("u2"), 3, 16)
    cast = CastRows.of(np.zeros((3, *samples[0].shape), np.uint16))
    assert cast.write(samples) and cast.row_class.next_cast is True
    assert cast.write(samples) and cast.row_class.next_cast is False
    np.testing.assert_array_equal(cast.out, np.stack(samples))


def test_rows_planned_while_another_thread_offers_its_row_are_all_written(monkeypatch,
                                                                         cast_loop):
    """RowWriter: a thread that finds the batch planned writes its row, even while the
    planning thread is still working out how (a slow ``CastRows.of``): a row seen planned
    before its cast was set used to be skipped, and the batch went out with a stale row."""
    import threading
    import time

    from arena_loader._rows import RowWriter

    of = CastRows.of.__func__
    planning = threading.Event()

    def slow_of(cls, out):
        planning.set()
        time.sleep(0.2)
        return of(cls, out)

    monkeypatch.setattr(CastRows, "of", classmethod(slow_of))
    samples = random_bits("u1", large_shape("u1"), 2, 0)
    storage = np.zeros(2 * samples[0].nbytes + 4096, np.uint8)
    writer = RowWriter([0, 1], lambda nbytes: storage[:nbytes])
    first = threading.Thread(target=writer.offer, args=(0, samples[0]))
    first.start()
    assert planning.wait(5)
    writer.offer(1, samples[1])
    first.join(5)
    assert writer.done()
    assert storage[: 2 * samples[0].nbytes].tobytes() == np.stack(samples).tobytes()
