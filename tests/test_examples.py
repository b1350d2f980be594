"""The examples in examples/ run to completion on a CPU and their models learn."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from . import zygote

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, *args: str) -> tuple[float, float]:
    """Run an example (in an interpreter with torch imported: tests/zygote.py); return its
    first and last epoch losses."""
    result = zygote.run([str(EXAMPLES / name), *args], timeout=100, preload="torch")
    assert result.returncode == 0, result.stderr[-3000:]
    match = re.search(r"loss first=([\d.]+) last=([\d.]+)", result.stdout)
    assert match, result.stdout
    return float(match.group(1)), float(match.group(2))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("worker_mode", ["process", "thread"])
def test_train_numeric_example_reduces_the_loss(worker_mode):
    """examples/train_numeric.py trains to a clearly lower cross-entropy."""
    first, last = run_example("train_numeric.py", "--epochs", "3", "--samples", "8192",
                              "--worker-mode", worker_mode)
    assert last < 0.5 * first


@pytest.mark.timeout(120)
def test_train_memmap_example_reduces_the_loss():
    """examples/train_memmap.py trains over .npy files to a much lower squared error."""
    first, last = run_example("train_memmap.py", "--epochs", "2", "--samples", "12000")
    assert last < 0.1 * first


@pytest.mark.timeout(120)
def test_a_torch_script_switched_by_one_import_sees_the_same_batches_and_losses():
    """examples/switch_from_torch.py with torch's DataLoader and with ArenaLoader (only the
    import differs): same number of batches, same shuffled order, same losses, and the model
    learns."""
    outputs = {}
    for loader in ("torch", "arena"):
        result = zygote.run([str(EXAMPLES / "switch_from_torch.py"), loader], timeout=100,
                            preload="torch")
        assert result.returncode == 0, result.stderr[-3000:]
        outputs[loader] = result.stdout.strip().rpartition(" time ")[0].partition(" ")[2]
    assert outputs["torch"] == outputs["arena"]
    assert outputs["arena"].startswith("batches 128 ")
    first, last = (float(v) for v in re.findall(r"-loss ([\d.]+)", outputs["arena"]))
    assert last < 0.5 * first  # the model learns from the batches it is given
