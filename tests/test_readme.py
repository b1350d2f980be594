"""The README's code and commands are the ones the tests run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest


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


def test_readme_main_job_is_the_quick_bench():
    """The README's main-job command is `arena-loader bench --quick`, which
    test_bench.py runs on tiny sizes."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    commands = re.findall(r"```bash\n(.*?)```", readme, re.DOTALL)
    assert any(c.strip().endswith(".venv/bin/arena-loader bench --quick") for c in commands)
