"""The benchmark suite (`arena-loader bench`): every compared loader delivers the same
batches, and the CLI writes a JSON with every loader and metric, a table and a chart."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from arena_loader.bench import report
from arena_loader.bench.harness import METRICS, measure
from arena_loader.bench.loaders import ARENA, LOADERS, TORCH, Setup, numpy_collate
from arena_loader.bench.workloads import DictSamples, MemmapImages, PooledArrays

ROOT = Path(__file__).parent.parent
TINY = ["--quick", "--scale", "0.02", "--image-shape", "3,8,8", "--large-batch-mb", "0.25",
        "--repeats", "1"]


def as_numpy(batch):
    """A copy: loaders reuse their buffers once a batch is dropped."""
    if isinstance(batch, dict):
        return {key: as_numpy(value) for key, value in batch.items()}
    return np.array(batch.numpy() if hasattr(batch, "numpy") else batch)


def assert_same(batch, expected):
    if isinstance(expected, dict):
        assert set(batch) == set(expected)
        for key in expected:
            assert_same(batch[key], expected[key])
        return
    np.testing.assert_array_equal(as_numpy(batch), expected)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", LOADERS, ids=[kind.name for kind in LOADERS])
def test_every_compared_loader_delivers_the_reference_batches(kind, tmp_path):
    """Each loader, over two epochs, yields exactly numpy_collate of the dataset in order."""
    if kind.missing():
        pytest.skip(kind.missing())
    memmap = MemmapImages.create(str(tmp_path), 45, (3, 4, 4))
    try:
        for dataset in (PooledArrays(70, (5,), np.float32), DictSamples(37, (2, 3, 3)), memmap):
            expected = [numpy_collate([dataset[i] for i in range(s, min(s + 8, len(dataset)))])
                        for s in range(0, len(dataset), 8)]
            loader = kind.build(dataset, Setup(batch_size=8, workers=2))
            try:
                for _ in range(2):
                    batches = [as_numpy(batch) for batch in loader]
                    assert len(batches) == len(expected)
                    for batch, reference in zip(batches, expected):
                        assert_same(batch, reference)
            finally:
                loader.close()
    finally:
        memmap.remove()


@pytest.mark.timeout(60)
def test_measure_reports_every_metric_with_the_bytes_delivered():
    """measure() counts every byte of every epoch and fills in each metric."""
    dataset = PooledArrays(100, (3, 4, 4), np.uint8)
    kind = next(k for k in LOADERS if k.name == ARENA)
    figures = measure(lambda: kind.build(dataset, Setup(batch_size=16, workers=1)), repeats=2)
    assert set(METRICS) <= set(figures)
    assert figures["batches_per_epoch"] == 7
    assert figures["bytes_per_epoch"] == 100 * 3 * 4 * 4
    assert len(figures["epoch_s"]) == 2
    assert figures["first_batch_s"] <= figures["first_epoch_s"]
    gbps = figures["steady_gbps"]
    assert gbps["min"] <= gbps["median"] <= gbps["max"]
    assert figures["peak_rss_main_mb"] > 0 and figures["peak_memory_mb"] > 0


def test_targets_are_arena_over_baseline_ratios_from_the_same_run():
    """A target's ratio is ArenaLoader's figure over the baseline's, and None if absent."""
    def row(loader, gbps, first_s, memory_mb, cpu_s_per_gb):
        return {"workload": "image", "loader": loader, "workers": 2, "available": True,
                "steady_gbps": {"median": gbps}, "steady_batches_per_s": {"median": gbps},
                "first_epoch_s": first_s, "peak_memory_mb": memory_mb,
                "cpu_s_per_gb": cpu_s_per_gb}

    results = [row(ARENA, 8.0, 0.5, 300.0, 0.25), row(TORCH, 2.0, 1.0, 600.0, 1.5)]
    by_text = {t["target"]: t for t in report.targets(results)}
    torch_speed = by_text["image-like steady state >= 10x torch default collate"]
    assert torch_speed["ratio"] == 4.0 and torch_speed["met"] is False
    assert torch_speed["cpu_ratio"] == 6.0
    assert by_text["first epoch incl. start-up faster than torch"]["ratio"] == 2.0
    assert by_text["peak memory (private RSS + shm) <= torch's"]["met"] is True
    assert by_text["image-like steady state >= 30x queue pickling"]["ratio"] is None
    assert report.ratios(results) == {"image": {TORCH: 4.0}}


@pytest.mark.timeout(120)
def test_bench_cli_quick_writes_every_loader_and_metric(tmp_path):
    """`arena-loader bench --quick` on tiny sizes: JSON with every loader on every workload
    and every metric (or why a loader could not run), a table on stdout, a PNG chart."""
    result = subprocess.run(
        [sys.executable, "-m", "arena_loader._cli", "bench", *TINY, "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=110, check=False, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    out = json.loads((tmp_path / "bench.json").read_text())
    names = [kind.name for kind in LOADERS]
    assert out["loaders"] == names
    assert set(out["workloads"]) == {"image", "large", "tiny", "dict", "memmap", "text", "detect"}
    for workload in out["workloads"]:
        rows = {r["loader"]: r for r in out["results"] if r["workload"] == workload}
        assert set(rows) == set(names), workload
        for name, row in rows.items():
            if row["available"]:
                missing = [m for m in METRICS if row.get(m) is None]
                assert not missing, (workload, name, missing)
            else:
                assert row["reason"], (workload, name)
    assert {(r["loader"], r["workers"]) for r in out["scaling"]} >= {(ARENA, 1), (ARENA, 2)}
    assert {"cpu_model", "cores", "dev_shm_gib", "versions"} <= set(out["environment"])
    assert len(out["targets"]) == len(report.TARGETS)
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Targets" in result.stdout and ARENA in result.stdout
    assert "[ 1/" in result.stderr  # progress lines while it runs


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
