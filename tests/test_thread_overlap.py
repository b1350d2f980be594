"""worker_threads=K, batch after batch: a worker begins its next batch (when the main process
has published it) before it sends the last one, so the extra threads go on to the next
batch's rows instead of waiting for the last batch's slowest row. Batches, errors and
one-off segments stay each batch's own."""

from __future__ import annotations

import time
import traceback

import numpy as np
import pytest

from arena_loader import ArenaLoader

from .datasets import assert_batches_equal

pytestmark = pytest.mark.timeout(60)

MODES = ("process", "thread")
SLOW_S = 0.4


class Timed:
    """Sample i: its values, and when its load began and ended (CLOCK_MONOTONIC, one clock
    for every process). Sample i takes ``slow[i]`` seconds (``SLOW_S`` for those in a set),
    the others 10 ms; those in ``bad`` raise; those in ``wide`` have 1,024 values instead of
    4 (a batch of them does not fit a slot sized for 4)."""

    def __init__(self, n: int, slow: set[int] | dict[int, float] = frozenset(),
                 bad: set[int] = frozenset(), wide: set[int] = frozenset()):
        self.slow = slow if isinstance(slow, dict) else dict.fromkeys(slow, SLOW_S)
        self.n, self.bad, self.wide = n, bad, wide

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict:
        start = time.monotonic()
        time.sleep(self.slow.get(index, 0.01))
        if index in self.bad:
            raise ValueError(f"sample {index} is corrupt")
        values = np.arange(1024 if index in self.wide else 4, dtype=np.float32) + index
        return {"x": values, "start": start, "end": time.monotonic()}


def _loader(dataset: Timed, mode: str, **options) -> ArenaLoader:
    return ArenaLoader(dataset, batch_size=4, num_workers=1, worker_threads=4,
                       worker_mode=mode, **options)


@pytest.mark.parametrize("mode", MODES)
def test_extra_threads_load_the_next_batch_while_the_last_ones_slowest_row_loads(mode):
    """Sample 3 (row 3 of batch 0, thread 3) takes 0.4 s: threads 1 and 2 load their rows of
    batch 1 meanwhile (begun once thread 0 has its own row of batch 0, 0.1 s: batch 1 is
    published by then). Before, every thread waited for batch 0's last row before any row of
    batch 1 began."""
    with _loader(Timed(8, slow={0: 0.1, 3: SLOW_S}), mode) as loader:
        first, second = list(loader)
    slowest_end = first["end"][3]
    assert slowest_end - first["start"][3] >= SLOW_S
    assert second["start"][1] < slowest_end - SLOW_S / 2
    assert second["start"][2] < slowest_end - SLOW_S / 2
    rows = np.arange(4, dtype=np.float32) + np.arange(4, 8)[:, None]
    np.testing.assert_array_equal(second["x"], rows)


@pytest.mark.parametrize("mode", MODES)
def test_a_batch_that_fails_while_the_next_loads_fails_alone(mode):
    """Batch 0 fails (sample 1) while batch 1 loads beside its slow sample 3: next() raises
    batch 0's error with its sample index, then gives batch 1 whole, then batch 2."""
    dataset = Timed(12, slow={3}, bad={1})
    with _loader(dataset, mode) as loader:
        iterator = iter(loader)
        with pytest.raises(ValueError, match="sample 1 is corrupt") as caught:
            next(iterator)
        assert "sample index 1 in thread 1 of worker_threads=4" in "".join(
            traceback.format_exception(caught.value))
        rest = [batch["x"].copy() for batch in iterator]
        del iterator
    expected = [np.arange(4, dtype=np.float32) + np.arange(b, b + 4)[:, None] for b in (4, 8)]
    assert len(rest) == 2
    for got, want in zip(rest, expected):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("mode", MODES)
def test_batches_in_one_off_segments_load_side_by_side(mode):
    """One-off segments are each batch's own while the next batch loads: the first window's
    two batches (before the slab is sized; batch 0 with a slow row), and batch 4 (samples
    16-19: 1,024 values, too large for its slot; a slow row) while batch 5 goes to its slot
    (begun once thread 0 has its own row of batch 4, 0.1 s: batch 5 is published by then).
    Every batch comes back whole."""
    dataset = Timed(24, slow={0: 0.1, 3: SLOW_S, 16: 0.1, 19: SLOW_S}, wide=set(range(16, 20)))
    with _loader(dataset, mode) as loader:
        got = [{"x": batch["x"].copy(), "start": batch["start"].copy(),
                "end": batch["end"].copy()} for batch in loader]
    assert len(got) == 6
    for b, batch in enumerate(got):
        want = np.stack([dataset[i]["x"] for i in range(4 * b, 4 * b + 4)])
        assert_batches_equal({"x": batch["x"]}, {"x": want}, f"batch {b}")
    # (the overlaps this test is about did happen)
    assert got[1]["start"][1] < got[0]["end"][3] - SLOW_S / 2
    assert got[5]["start"][1] < got[4]["end"][3] - SLOW_S / 2
