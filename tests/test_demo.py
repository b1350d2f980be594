"""The README's main job runs and reports both loaders."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(120)
def test_demo_reports_arena_and_torch_throughput():
    """`python -m arena_loader.demo` on tiny data prints a row per loader and their ratio."""
    result = subprocess.run(
        [sys.executable, "-m", "arena_loader.demo", "--samples", "256", "--shape", "3,32,32",
         "--batch-size", "16", "--epochs", "2", "--workers", "2"],
        capture_output=True, text=True, timeout=110, check=False,
    )
    assert result.returncode == 0, result.stderr
    rows = {}
    for line in result.stdout.splitlines():
        match = re.match(r"(arena_loader\.ArenaLoader|torch DataLoader|copy limit \(1 thread\))"
                         r"\s+([\d.]+)\s+([\d.]+)", line)
        if match:
            rows[match.group(1)] = float(match.group(2))
    assert set(rows) == {"arena_loader.ArenaLoader", "torch DataLoader",
                         "copy limit (1 thread)"}, result.stdout
    assert all(gbps > 0 for gbps in rows.values())
    assert re.search(r"ArenaLoader / torch DataLoader, steady state: [\d.]+x", result.stdout)


@pytest.mark.timeout(60)
def test_readme_quick_start_runs(tmp_path):
    """The README's quick-start block runs as written."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.DOTALL).group(1)
    script = tmp_path / "quick_start.py"
    script.write_text(code)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=50, check=False)
    assert result.returncode == 0, result.stderr
