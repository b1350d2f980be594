"""The benchmark suite (`arena-loader bench`): every compared loader delivers the same
batches, and the CLI writes a JSON with every loader and metric, a table and a chart."""

from __future__ import annotations

import functools
import gc
import importlib
import importlib.util
import json
import os
import pickle
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from arena_loader.bench import cli, harness, report
from arena_loader.bench.cli import unavailable
from arena_loader.bench.floor import FloorLoader
from arena_loader.bench.harness import (
    METRICS,
    Budget,
    CaseResult,
    measure,
    measure_apart,
    proportional_bytes,
)
from arena_loader.bench.loaders import (
    ARENA,
    BENCH_EXTRA,
    COPY,
    COPY_SHARED,
    FLOOR,
    GRAIN,
    LOADERS,
    NODES,
    SPDL,
    STATEFUL,
    TORCH,
    CopyLimit,
    Setup,
    numpy_collate,
)
from arena_loader.bench.workloads import (
    ALIGN,
    Detection,
    DictSamples,
    JpegImages,
    MemmapImages,
    PooledArrays,
    RemoteSamples,
    Sizes,
    Tokens,
    standard_workloads,
)

from . import zygote

ROOT = Path(__file__).parent.parent
# One worker per loader (two for torch's wide row): what the CLI's tests check (every case's
# row, metric, table, chart) is the same with any count, and each case's workers are its
# cost (Grain spawns each one: ~1 s of CPU). Every loader with two workers:
# test_every_compared_loader_delivers_the_reference_batches.
TINY = ["--quick", "--scale", "0.02", "--image-shape", "3,8,8", "--large-batch-mb", "0.25",
        "--jpeg-side", "16", "--rounds", "1", "--min-seconds", "0", "--min-batches", "1",
        "--workers", "1", "--worker-threads", "2", "--wide-workers", "2"]


def as_numpy(batch):
    """A copy: loaders reuse their buffers once a batch is dropped."""
    if isinstance(batch, dict):
        return {key: as_numpy(value) for key, value in batch.items()}
    return np.array(batch.numpy() if hasattr(batch, "numpy") else batch)


def rows(batches) -> list[tuple]:
    """Each sample of some batches as a tuple of its fields' bytes (order-free checks)."""
    out = []
    for batch in batches:
        fields = [batch[key] for key in sorted(batch)] if isinstance(batch, dict) else [batch]
        out += [tuple(field[i].tobytes() for field in fields) for i in range(len(fields[0]))]
    return out


def assert_same(batch, expected):
    if isinstance(expected, dict):
        assert set(batch) == set(expected)
        for key in expected:
            assert_same(batch[key], expected[key])
        return
    np.testing.assert_array_equal(as_numpy(batch), expected)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", LOADERS, ids=[kind.name for kind in LOADERS])
def test_every_compared_loader_delivers_the_reference_batches(kind, tmp_path, monkeypatch):
    """Each loader, over two epochs, yields exactly numpy_collate of the dataset in order
    (whole batches and a last partial one; the floor on fixed-shape samples only; Grain as
    many dataset samples per epoch, each worker batching every 2nd record of its stream).
    Then, as the bench stops a measurement, part of a third epoch and close(): no loader may
    leave a worker behind (torchdata's process workers used to hang at exit flushing their
    queue; conftest's check finds a survivor)."""
    if kind.missing():
        pytest.skip(kind.missing())
    if kind.name == GRAIN:
        _as_if_jax_were_installed(monkeypatch)
    memmap = MemmapImages.create(str(tmp_path), 45, (3, 4, 4))
    datasets = [PooledArrays(72, (5,), np.float32), memmap]
    if not kind.fixed_shape_only:
        datasets.insert(1, DictSamples(37, (2, 3, 3)))
    try:
        for dataset in datasets:
            expected = [numpy_collate([dataset[i] for i in range(s, min(s + 8, len(dataset)))])
                        for s in range(0, len(dataset), 8)]
            loader = kind.build(dataset, Setup(batch_size=8, workers=2))
            # Grain starts its workers for each epoch of a dataset of a last partial batch
            # (~2 s): its second epoch of that path is the memmap one's; dicts once.
            epochs = 1 if kind.name == GRAIN and isinstance(dataset, DictSamples) else 2
            try:
                for _ in range(epochs):
                    batches = [as_numpy(batch) for batch in loader]
                    if kind.name == GRAIN:  # each worker batches its own share of records
                        got = rows(batches)
                        assert len(got) == len(dataset) and set(got) <= set(rows(expected))
                        continue
                    assert len(batches) == len(expected)
                    for batch, reference in zip(batches, expected):
                        assert_same(batch, reference)
                if dataset is datasets[0]:  # stopped mid-epoch, then closed (finally)
                    for count, _ in enumerate(loader):
                        if count == 3:
                            break
            finally:
                loader.close()
    finally:
        memmap.remove()


def _as_if_jax_were_installed(monkeypatch) -> None:
    """With jax installed, grain 0.2.18's profiler reads an absl flag in its loader's thread,
    which raises UnparsedFlagAccessError in a program that never parsed absl's flags (the
    bench): what importing jax sets in grain (private: no public switch), with the flags
    unparsed."""
    from absl import flags
    from grain._src.core import profiler

    monkeypatch.setattr(profiler, "_framework", "jax")
    monkeypatch.setattr(profiler, "_subprocess_hooks_loaded", True)
    flags.FLAGS.unparse_flags()


@pytest.mark.timeout(30, method="thread")  # a wait on that lock ignores SIGALRM's timeout
def test_torchdata_nodes_close_survives_a_worker_killed_holding_the_stop_lock(monkeypatch):
    """torchdata's process workers poll a multiprocessing Event; one killed by close() while
    inside is_set() leaves the Event's lock taken for good, and torchdata's _shutdown()
    (close(), then __del__ at the next gc) would wait on it forever: a CI run hung so. The
    first kill here also kills a process that holds that lock; close() and gc still return."""
    kind = next(k for k in LOADERS if k.name == NODES)
    if kind.missing():
        pytest.skip(kind.missing())
    import multiprocessing as mp

    loader = kind.build(PooledArrays(64, (3, 4, 4), np.uint8), Setup(batch_size=4, workers=2))
    iterator = iter(loader)
    next(iterator)
    mapper = loader._node._it._it
    stop, real_kill, poisoned = mapper._mp_stop, mp.process.BaseProcess.kill, []

    def kill_holding_the_lock(worker):
        if not poisoned:  # a process takes the Event's lock and dies holding it
            ready = mp.get_context("fork").Event()
            holder = mp.get_context("fork").Process(
                target=_hold_forever, args=(stop._cond, ready), daemon=True)
            holder.start()
            assert ready.wait(10)
            real_kill(holder)
            holder.join()
            poisoned.append(holder)
        real_kill(worker)

    monkeypatch.setattr(mp.process.BaseProcess, "kill", kill_holding_the_lock)
    loader.close()
    assert poisoned, "close() killed no worker: the case this test is about did not arise"
    del iterator, mapper, loader
    gc.collect()  # torchdata's __del__ runs _shutdown() again


def _hold_forever(lock, ready) -> None:
    lock.acquire()
    ready.set()
    while True:
        os.pause()


@pytest.mark.timeout(60)
def test_measure_reports_every_metric_with_the_bytes_delivered():
    """measure() runs the warm-up epoch, then at least the budget's batches, and fills in
    every metric; bytes and batches agree with the dataset."""
    dataset = PooledArrays(96, (3, 4, 4), np.uint8)
    kind = next(k for k in LOADERS if k.name == ARENA)
    figures = measure(lambda: kind.build(dataset, Setup(batch_size=16, workers=1)),
                      Budget(min_seconds=0.0, min_batches=9))
    assert set(METRICS) <= set(figures)
    assert figures["batches_per_epoch"] == 6
    assert figures["bytes_per_epoch"] == 96 * 3 * 4 * 4
    assert figures["epochs"] == 2  # 9 batches: one whole epoch of 6, then 3 of the next
    gbps, rate = figures["steady_gbps"], figures["steady_batches_per_s"]
    assert gbps * 1e9 / rate == pytest.approx(16 * 3 * 4 * 4)
    assert figures["first_batch_s"] <= figures["first_epoch_s"]
    assert figures["peak_rss_main_mb"] > 0 and figures["peak_memory_mb"] > 0
    assert 0 <= figures["sampler_cores"] < 1


LEFT_BEHIND: list[np.ndarray] = []  # what a loader keeps in its process after close()


class LeavesMemoryBehind:
    """A 'loader' of four small batches that, like some peers, leaves 64 MB in the process
    that built it."""

    def __init__(self) -> None:
        LEFT_BEHIND.append(np.ones(64 * 2**20, np.uint8))  # pages touched: resident

    def __iter__(self):
        return iter([np.zeros(8, np.uint8)] * 4)

    def close(self) -> None:
        pass


def _fails_to_build():
    raise ValueError("no such dataset file: /nowhere")


def _fails_after_starting_a_process():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with open(os.environ["ARENA_TEST_PID_FILE"], "w") as out:
        out.write(str(child.pid))
    raise ValueError("the loader failed after starting a worker")


@pytest.mark.timeout(60)
def test_each_case_runs_apart_and_leaves_nothing_to_the_next():
    """measure_apart() measures in a child of its own: what a case leaves in its process is
    gone before the next case, whose figures count the parent's memory just as much; a
    failure comes back with its traceback."""
    try:
        budget = Budget(min_seconds=0.0, min_batches=4)
        first = measure_apart(LeavesMemoryBehind, budget)
        assert LEFT_BEHIND == []  # built in the child, gone with it
        second = measure_apart(LeavesMemoryBehind, budget)
        assert LEFT_BEHIND == []
        parent_mb = proportional_bytes(os.getpid()) / 1e6
        for figures in (first, second):
            assert figures["strays"] == []
            # (Proportional counts: the case's share of library pages falls while other
            # processes map them too, e.g. a test beside it starting torch: 61.7 of the 67.1
            # MB read once in a full run; a case whose memory went uncounted reads ~0.)
            assert figures["peak_added_mb"] >= 64 * 2**20 / 1e6 * 0.85
            assert figures["peak_memory_mb"] >= parent_mb * 0.9 + 64  # the parent counted
        # The second case starts where the first did, not 64 MB higher.
        assert abs(second["peak_memory_mb"] - first["peak_memory_mb"]) < 32
        with pytest.raises(RuntimeError, match="ValueError: no such dataset file"):
            measure_apart(_fails_to_build, budget)
    finally:
        gc.unfreeze()  # measure_apart froze this process's objects, as the CLI's main undoes


@pytest.mark.timeout(60)
def test_a_failed_case_leaves_no_process_behind(tmp_path, monkeypatch):
    """A case that fails after its loader started a process: the process is killed before
    the case's own process exits (its orphan would outlive the bench)."""
    pid_file = tmp_path / "pid"
    monkeypatch.setenv("ARENA_TEST_PID_FILE", str(pid_file))
    # The stray sleeps 60 s: the 5 s a closed loader's workers are given to exit would only
    # be waited out before the kill this test is about.
    monkeypatch.setattr(harness, "stray_processes",
                        functools.partial(harness.stray_processes, wait_s=0.2))
    try:
        with pytest.raises(RuntimeError, match="failed after starting a worker"):
            measure_apart(_fails_after_starting_a_process, Budget(min_seconds=0.0))
        started = int(pid_file.read_text())
        assert not psutil.pid_exists(started) or psutil.Process(started).status() == (
            psutil.STATUS_ZOMBIE)
    finally:
        gc.unfreeze()  # measure_apart froze this process's objects, as the CLI's main undoes


def test_proportional_samples_wait_until_the_sampler_stays_within_its_share_of_a_core():
    """A page-table walk that took t seconds is followed by a wait of t / PSS_DUTY, never
    shorter than the base interval nor longer than the longest one."""
    base = harness.PSS_EVERY * harness.SAMPLE_INTERVAL_S
    assert harness.pss_interval_s(0.0001) == base
    assert harness.pss_interval_s(0.003) == pytest.approx(0.003 / harness.PSS_DUTY)
    assert base < 0.003 / harness.PSS_DUTY < harness.PSS_MAX_INTERVAL_S
    assert harness.pss_interval_s(1.0) == harness.PSS_MAX_INTERVAL_S


def _case(loader: str, rates: list[float], memory: list[float], first: list[float],
          workload: str = "image", others: list[float] | None = None) -> dict:
    result = CaseResult(workload, loader, 2)
    for rate, mb, first_s, cores in zip(rates, memory, first, others or [0.0] * len(rates)):
        result.rounds.append({
            "batches_per_epoch": 4, "bytes_per_epoch": 400, "epochs": 1, "seconds": 1.0,
            "steady_batches_per_s": rate, "steady_gbps": rate * 1e-6, "first_epoch_s": first_s,
            "first_batch_s": first_s / 2, "cpu_s_per_gb": 1.0, "peak_rss_main_mb": mb,
            "peak_rss_workers_mb": 0.0, "peak_shm_mb": 0.0, "peak_memory_mb": mb,
            "peak_added_mb": mb, "others_cores": cores, "sampler_cores": 0.01})
    return result.as_dict()


def test_ratios_are_medians_of_within_round_arena_over_other_ratios():
    """Speed reads ArenaLoader / other per round (the median of those, with min-max), not a
    ratio of medians; a slow round on both sides does not move it."""
    results = [_case(ARENA, [100, 10, 90], [300, 300, 300], [1, 1, 1]),
               _case(TORCH, [10, 1, 30], [600, 600, 600], [2, 2, 2])]
    speed = report.ratios(results)["image"][TORCH]["steady_batches_per_s"]
    assert speed["rounds"] == [10.0, 10.0, 3.0]
    assert (speed["median"], speed["min"], speed["max"]) == (10.0, 3.0, 10.0)


def test_memory_and_time_targets_read_arena_over_torch_with_upper_limits():
    """A memory or first-epoch target is ArenaLoader / torch against `<=` its limit: a ratio
    under the limit is met (the old report showed torch / ArenaLoader, read backwards)."""
    results = [_case(ARENA, [80, 80, 80], [330, 330, 330], [1, 1, 1]),
               _case(TORCH, [10, 10, 10], [300, 300, 300], [2, 2, 2]),
               _case(ARENA, [10, 10, 10], [110, 110, 110], [1, 1, 1], workload="text"),
               _case(TORCH, [5, 5, 5], [100, 100, 100], [1, 1, 1], workload="text")]
    by_text = {t["target"]: t for t in report.targets(results)}
    memory = by_text["image peak memory: ArenaLoader / torch default collate <= 1x"]
    assert memory["ratio"]["median"] == pytest.approx(1.1) and memory["met"] is False
    text = by_text["text peak memory: ArenaLoader / torch default collate <= 1.2x"]
    assert text["ratio"]["median"] == pytest.approx(1.1) and text["met"] is True
    first = by_text["image first epoch time: ArenaLoader / torch default collate <= 1x"]
    assert first["ratio"]["median"] == 0.5 and first["met"] is True
    speed = by_text["image batches/s: ArenaLoader / torch default collate >= 10x"]
    assert speed["ratio"]["median"] == 8.0 and speed["met"] is False
    assert by_text["image batches/s: ArenaLoader / SPDL arena >= 1.5x"]["ratio"] is None
    assert all(" >= " in t["target"] or " <= " in t["target"] for t in by_text.values())


def test_one_worker_targets_read_the_scaling_runs_one_worker_row_over_each_copy_limit():
    """Issue 21's one-worker target: the scaling run's 1-worker ArenaLoader row over the copy
    limit (private memory) and over the copy into shared memory, round by round; the
    2-worker row of the comparison is not it."""
    results = [_case(ARENA, [900, 900, 900], [1, 1, 1], [1, 1, 1]),
               _case(COPY, [100, 200, 100], [1, 1, 1], [1, 1, 1]),
               _case(COPY_SHARED, [80, 80, 40], [1, 1, 1], [1, 1, 1])]
    one = _case(ARENA, [90, 90, 90], [1, 1, 1], [1, 1, 1])
    scaling = [dict(_case(ARENA, [500] * 3, [1] * 3, [1] * 3), workers=3), dict(one, workers=1)]
    by_text = {t["target"]: t for t in report.targets(results, scaling)}
    private = by_text["image batches/s: ArenaLoader 1 worker / copy limit >= 0.9x"]
    assert private["ratio"]["rounds"] == [0.9, 0.45, 0.9] and private["met"] is True
    shared = by_text["image batches/s: ArenaLoader 1 worker / copy limit (shared memory) >= 0.9x"]
    assert shared["ratio"]["median"] == pytest.approx(1.125) and shared["met"] is True
    assert report.targets(results)[-1]["ratio"] is None  # no scaling run: not measured
    alone = [dict(one, workers=1), *results[1:]]  # a run with one worker: its own row
    assert report.targets(alone)[-1]["ratio"]["median"] == pytest.approx(1.125)


def test_the_shared_copy_limit_writes_memory_another_process_sees():
    """The copy limit into shared memory writes pages a forked process shares (MAP_SHARED):
    what a child writes into the ring, the parent reads; the private ring stays private."""
    dataset = PooledArrays(16, (4,), np.float32)
    for shared in (True, False):
        loader = CopyLimit(dataset, batch_size=4, shared=shared)
        batch = next(iter(loader))
        pid = os.fork()
        if pid == 0:
            batch[...] = 7.0
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        assert (batch == 7.0).all() == shared
        loader.close()


@pytest.mark.timeout(30)
def test_floor_closed_mid_epoch_leaves_no_worker():
    """The floor loader stops its workers when closed in the middle of an epoch (its
    workers wait on a credit pipe that close() ends)."""
    loader = FloorLoader(PooledArrays(64 * 8, (4,), np.float32), batch_size=8, depth=1)
    epoch = iter(loader)
    first = next(epoch)
    np.testing.assert_array_equal(first, PooledArrays(8, (4,), np.float32).pool[:8])
    del first, epoch
    loader.close()
    loader.close()  # idempotent


def test_pools_start_on_cache_lines_in_this_process_and_once_unpickled():
    """Every pool array starts on a 64-byte boundary, and still does after pickling (how
    spawned workers get the dataset): a row read from 16 bytes past one copies ~1.2x slower,
    and where numpy's allocation lands varies from run to run."""
    datasets = [PooledArrays(8, (3, 5, 7), np.uint8), PooledArrays(8, (3,), np.float32),
                DictSamples(8, (3, 5, 7)), Tokens(8), Detection(8),
                RemoteSamples(8, (3, 5, 7), wait_ms=0.0)]
    for dataset in datasets:
        for copy in (dataset, *(pickle.loads(pickle.dumps(dataset)) for _ in range(4))):
            arrays = [v for v in vars(copy).values() if isinstance(v, np.ndarray)]
            arrays += [a for v in vars(copy).values() if isinstance(v, list) for a in v]
            assert arrays, type(dataset).__name__
            assert all(a.ctypes.data % ALIGN == 0 for a in arrays if a.nbytes), type(copy)
            sample, expected = copy[3], dataset[3]
            if isinstance(sample, tuple):  # Detection: (image, targets)
                sample, expected = sample[0], expected[0]
            assert_same(sample, as_numpy(expected))


def test_a_measurement_disturbed_by_other_processes_is_taken_again(monkeypatch):
    """A measurement during which other processes took more than --others-limit cores is
    taken again, at most CASE_RETRIES times a case and --retries times a run, and the least
    disturbed one is kept; a window too short to judge is not taken again."""
    others = iter([0.9, 0.5, 0.7, 0.1, 0.9, 0.9, 0.2])
    monkeypatch.setattr(cli, "measure_apart", lambda build, budget: {
        "others_cores": next(others), "seconds": 1.0, "strays": []})
    args = cli.parser().parse_args(["--others-limit", "0.15", "--retries", "3"])
    args.retries_left = args.retries

    def once():
        return cli._measure_quiet(None, None, None, Budget(), args)

    kept = once()  # 0.9, 0.5, 0.7: its own limit of 2 retries reached
    assert (kept["others_cores"], kept["retries"]) == (0.5, 2)
    assert once() == {"others_cores": 0.1, "seconds": 1.0, "retries": 0}
    kept = once()  # 0.9, then the run's last retry: 0.9
    assert (kept["others_cores"], kept["retries"], args.retries_left) == (0.9, 1, 0)
    assert once()["retries"] == 0  # 0.2: nothing left to retry with
    monkeypatch.setattr(cli, "measure_apart", lambda build, budget: {
        "others_cores": 5.0, "seconds": 0.01, "strays": []})
    args.retries_left = 4
    assert once()["retries"] == 0
    rows = [_case(ARENA, [1, 1], [1, 1], [1, 1], others=[0.0, 0.4])]
    assert cli.disturbed(rows, 0.15) == ["image ArenaLoader w=2 round 2: 0.40 cores"]


def test_decode_and_remote_workloads_make_fixed_shape_uint8_images():
    """jpeg decodes PIL-made JPEGs of varied sizes to uint8 3xSxS; remote returns images
    after its wait; both are whole batches, and remote declares its thread workers."""
    jpeg = JpegImages(4, side=24, pool=4)
    assert len({len(data) for data in jpeg.jpegs}) > 1  # varied sizes
    assert jpeg[0].shape == (3, 24, 24) and jpeg[0].dtype == np.uint8
    assert jpeg[0].flags.c_contiguous
    remote = RemoteSamples(4, (3, 8, 8), wait_ms=1.0)
    assert remote[1].shape == (3, 8, 8)
    workloads = {w.name: w for w in standard_workloads(Sizes(scale=0.01))}
    assert workloads["remote"].threads and not workloads["jpeg"].threads
    assert all(w.samples % w.batch_size == 0 for w in workloads.values())


def test_peers_are_not_installed_only_without_the_bench_extra():
    """SPDL, Grain and torchdata are part of the bench extra; when one is missing, the
    reason names the extra's install command (or the Python version it does not run on)."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    bench = re.search(r"^bench = \[(.*?)\]", pyproject, re.DOTALL | re.MULTILINE).group(1)
    for package in ("spdl==", "grain==", "torchdata==", "pillow"):
        assert f'"{package}' in bench, package
    kinds = {k.name: k for k in LOADERS}
    for name in (SPDL, GRAIN, STATEFUL, NODES):
        reason = kinds[name].missing()
        assert reason is None or BENCH_EXTRA in reason or (
            sys.version_info >= (3, 13) and "does not run on Python 3.13+" in reason), (
            name, reason)
    workloads = {w.name: w for w in standard_workloads(Sizes(scale=0.01))}
    assert "fixed-shape" in unavailable(kinds[FLOOR], workloads["text"], quick=False) or (
        "collate_fn" in unavailable(kinds[FLOOR], workloads["text"], quick=False))
    assert unavailable(kinds[FLOOR], workloads["dict"], quick=False).startswith("one fixed")
    assert unavailable(kinds[GRAIN], workloads["dict"], quick=True) == (
        "full run only (not in --quick)")


def test_readme_installs_the_bench_extra_and_ci_runs_the_readme_tests():
    """The README's main-job command installs `.[bench]` (every peer) and runs the quick
    bench; .ci/run runs exactly the README's test command."""
    readme = (ROOT / "README.md").read_text()
    commands = [c.strip() for c in re.findall(r"```bash\n(.*?)```", readme, re.DOTALL)]
    main_job = next(c for c in commands if c.endswith("arena-loader bench --quick"))
    assert "'.[bench]'" in main_job
    tests = next(c for c in commands if c.endswith("python -m pytest"))
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()


@pytest.mark.timeout(150)
def test_bench_cli_quick_writes_every_loader_and_metric(tmp_path):
    """`arena-loader bench --quick` on tiny sizes: JSON with every loader on every workload
    and every metric per round (or why a loader could not run), a table on stdout, a PNG
    chart, and the command that reproduces it."""
    result = zygote.run(["-m", "arena_loader._cli", "bench", *TINY, "--out", str(tmp_path)],
                        timeout=140, cwd=ROOT, preload="torch")
    assert result.returncode == 0, result.stderr
    out = json.loads((tmp_path / "bench.json").read_text())
    names = [kind.name for kind in LOADERS]
    assert out["loaders"] == names
    assert set(out["workloads"]) == {"image", "large", "tiny", "dict", "memmap", "text",
                                     "detect", "jpeg", "remote"}
    threads = {kind.name for kind in LOADERS if kind.threads}
    for workload in out["workloads"]:
        rows = {r["loader"]: r for r in out["results"] if r["workload"] == workload}
        expected = {kind.name for kind in LOADERS if not kind.only or workload in kind.only}
        if workload != "remote":
            expected -= threads
        assert set(rows) == expected, workload
        for name, row in rows.items():
            if row["available"]:
                missing = [m for m in METRICS if row.get(m) is None]
                assert not missing, (workload, name, missing)
                assert len(row["steady_batches_per_s"]["rounds"]) == 1
            else:
                assert row["reason"], (workload, name)
    image = {r["loader"]: r for r in out["results"] if r["workload"] == "image"}
    assert image[FLOOR]["available"] and image[ARENA]["available"]
    assert {"cpu_model", "cores", "dev_shm_gib", "dev_shm_huge", "versions"} <= set(
        out["environment"])
    assert {"spdl", "grain", "torchdata", "pillow"} <= set(out["environment"]["versions"])
    assert out["settings"]["command"].startswith("arena-loader bench --quick")
    assert len(out["targets"]) == (len(report.TARGETS) + len(report.HYBRID_TARGETS)
                                   + len(report.ONE_WORKER_TARGETS))
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Targets" in result.stdout and ARENA in result.stdout
    assert "round 1/1" in result.stderr  # progress lines while it runs
    # benchmarks/summary.py: a row per workload ArenaLoader ran, the figures bench.json holds
    summary = _load_script("summary").summary(out)
    for workload, peers in out["ratios"].items():
        speed = peers["torch default collate"]["steady_batches_per_s"]
        assert f"| {workload} | " in summary and f"{speed['median']:.3g}x [" in summary
    for target in out["targets"]:  # each with its figure and report's verdict (n/a: none)
        assert (f"| {target['target']} | {report.times(target['ratio'])} | "
                f"{report.verdict(target)} |") in summary


@pytest.mark.timeout(60)
def test_bench_rounds_go_over_every_workload_in_turn(tmp_path):
    """Round 1 of every workload comes before round 2 of any: a workload's rounds are spread
    over the run, each on its dataset made anew."""
    result = zygote.run(
        ["-m", "arena_loader._cli", "bench", *TINY, "--rounds", "2", "--workloads",
         "tiny,memmap", "--loaders", "ArenaLoader", "--out", str(tmp_path)],
        timeout=50, cwd=ROOT, preload="torch")
    assert result.returncode == 0, result.stderr
    order = re.findall(r"^round (\d)/2 (\w+)", result.stderr, re.MULTILINE)
    assert order == [("1", "tiny"), ("1", "memmap"), ("2", "tiny"), ("2", "memmap")]
    out = json.loads((tmp_path / "bench.json").read_text())
    assert all(len(r["steady_batches_per_s"]["rounds"]) == 2 for r in out["results"]
               if r["available"])


def test_console_script_is_the_cli_main():
    """pyproject's `arena-loader` entry point names the function the CLI test runs."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    scripts = re.search(r"\[project\.scripts\]\n(.*?)\n\n", pyproject, re.DOTALL).group(1)
    assert scripts == 'arena-loader = "arena_loader._cli:main"'
    module, function = scripts.split('"')[1].split(":")
    assert callable(getattr(importlib.import_module(module), function))


def test_bench_rejects_an_unknown_loader_name(capsys):
    """--loaders with a name that is not a compared loader says which names exist."""
    from arena_loader.bench.cli import main

    with pytest.raises(SystemExit, match="--loaders must name some of"):
        main(["--loaders", "ArenaLoader,fastest", "--out", "/nonexistent"])


# Bytes written at a time where a test counts an object's pages: 2 MB, the largest page
# /dev/shm gives (mounted huge=within_size or always), so the counts hold with any page size.
PAGES = 2 << 20


def test_shared_memory_held_by_a_file_descriptor_alone_counts():
    """An unlinked /dev/shm object that a process holds open but maps nowhere (a batch in
    torch's queue: the worker's resource sharer keeps its fd until the main process takes
    it) counts its pages; one mapped and open counts once."""
    import mmap
    import os

    import posix_ipc

    held = posix_ipc.SharedMemory(f"/arena_loader_test_fd_{os.getpid()}", posix_ipc.O_CREX)
    held.unlink()
    try:
        os.ftruncate(held.fd, 8 << 20)
        os.pwrite(held.fd, b"x" * PAGES, 0)
        inode = os.fstat(held.fd).st_ino
        assert harness.shm_objects(os.getpid())[inode] == PAGES
        with mmap.mmap(held.fd, 8 << 20) as mapping:  # mapped and open: its pages, once
            mapping[PAGES: 2 * PAGES] = b"y" * PAGES
            assert harness.shm_objects(os.getpid())[inode] == 2 * PAGES
    finally:
        os.close(held.fd)
    assert inode not in harness.shm_objects(os.getpid())


def test_shared_memory_counts_the_pages_an_object_has_not_the_size_it_maps():
    """A /dev/shm object mapped at 8 MB with its first 2 MB written counts 2 MB: the bench's
    memory is what the objects hold (a slab reserves its slots as they are used)."""
    import mmap
    import os

    import posix_ipc

    shm = posix_ipc.SharedMemory(f"/arena_loader_test_{os.getpid()}", posix_ipc.O_CREX)
    shm.unlink()
    try:
        os.ftruncate(shm.fd, 8 << 20)
        inode = os.fstat(shm.fd).st_ino
        mapping = mmap.mmap(shm.fd, 8 << 20)
    finally:
        os.close(shm.fd)
    try:
        mapping[:PAGES] = b"x" * PAGES
        with open("/proc/self/maps") as maps:
            (span,) = [line.split()[0] for line in maps if line.split()[4:5] == [str(inode)]]
        try:
            os.stat(f"/proc/self/map_files/{span}")
        except PermissionError:
            pytest.skip("/proc/<pid>/map_files cannot be read here: mapped sizes are counted")
        assert harness.shm_objects(os.getpid())[inode] == PAGES
    finally:
        mapping.close()


def test_a_mapping_of_a_process_that_exits_as_it_is_read_is_not_counted_at_its_size(
        monkeypatch):
    """A worker exiting while the sampler reads its mappings (a loader's close): its
    ``/proc/<pid>/map_files`` entries answer ESRCH (or ENOENT once unmapped). Those mappings
    are going, and counted at the size mapped they read a slab of 5 slots with 4 reserved as
    5 (a sampled 160 MB where the pages were 128, in 1 of ~450 samples of a process exiting);
    the object's pages count through whatever still holds it. Where ``map_files`` cannot be
    read at all (EACCES), the size mapped is still the figure."""
    import errno
    import mmap

    mapping = mmap.mmap(-1, 8 << 20)
    try:
        mapping[:PAGES] = b"x" * PAGES
        address = ctypes_address(mapping)
        with open("/proc/self/maps") as maps:
            (key,) = [("anon", int(line.split()[4])) for line in maps
                      if int(line.split("-")[0], 16) == address]
        real_stat = os.stat
        for error, expected in ((errno.ESRCH, None), (errno.ENOENT, None),
                                (errno.EACCES, 8 << 20)):
            def stat(path, *args, error=error, **kwargs):
                if "/map_files/" in str(path):
                    raise OSError(error, os.strerror(error), path)
                return real_stat(path, *args, **kwargs)

            monkeypatch.setattr(harness.os, "stat", stat)
            try:
                got = harness.shm_objects(os.getpid()).get(key)
            finally:
                monkeypatch.setattr(harness.os, "stat", real_stat)
            assert got == expected, errno.errorcode[error]
    finally:
        mapping.close()


def ctypes_address(mapping) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(mapping))


def test_anonymous_shared_memory_counts_its_pages_once_across_a_fork():
    """An ``mmap(-1, n)`` ring (the floor's slab, the shared copy limit's ring) is shared
    memory outside /dev/shm that smaps_rollup's Pss_Anon leaves out: it counts its written
    pages, under one key in the parent and in a forked child that maps it too."""
    import ctypes
    import mmap

    mapping = mmap.mmap(-1, 8 << 20)
    try:
        mapping[:PAGES] = b"x" * PAGES
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        with open("/proc/self/maps") as maps:  # this mapping's key (other tests' may live on)
            (key,) = [("anon", int(line.split()[4])) for line in maps
                      if int(line.split("-")[0], 16) == address]
        mine = harness.shm_objects(os.getpid())[key]
        if mine == 8 << 20:
            pytest.skip("/proc/<pid>/map_files cannot be read here: mapped sizes are counted")
        assert mine == PAGES
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # holds the mapping until killed
            os.close(read)
            os.close(write)
            time.sleep(5)
            os._exit(0)
        os.close(write)
        try:
            os.read(read, 1)  # EOF once the child closed its end: it runs, mapping inherited
            assert harness.shm_objects(pid)[key] == mine
        finally:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            os.close(read)
    finally:
        mapping.close()


def test_the_environment_names_the_huge_page_option_dev_shm_is_mounted_with(tmp_path):
    """The bench's head says whether the slab could get 2 MB pages: /dev/shm's ``huge=``
    option, the last mount on the path winning, "never" when the option is absent."""
    mounts = tmp_path / "mounts"
    plain = "tmpfs /dev/shm tmpfs rw,nosuid,nodev,size=24684084k 0 0"
    other = "tmpfs /mnt/hs tmpfs rw,relatime,size=2097152k,huge=always 0 0"
    cases = {
        (plain,): "never",
        (plain, other): "never",
        (plain, "tmpfs /dev/shm tmpfs rw,relatime,huge=within_size,size=1k 0 0"): "within_size",
        ("tmpfs /dev/shm tmpfs rw,huge=advise 0 0", plain): "never",
        (other,): "unknown",
    }
    for lines, expected in cases.items():
        mounts.write_text("\n".join(lines) + "\n")
        assert harness.shm_huge_pages(str(mounts)) == expected, lines
    assert harness.shm_huge_pages(str(tmp_path / "absent")) == "unknown"


def _load_script(name):
    """A script of benchmarks/, loaded by path (the folder is no package)."""
    path = ROOT / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
