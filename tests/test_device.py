"""The device options in the main test process, which never imports numba's CUDA simulator:
option errors, the no-CUDA paths, import hygiene, and the simulator run of the device leg."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from arena_loader import ArenaLoader

from .datasets import ImageDataset

ROOT = Path(__file__).resolve().parent.parent
DATA = ImageDataset(6, shape=(3,))


@pytest.mark.parametrize("device, error, shown", [
    ("gpu", ValueError, "'gpu'"),
    ("cuda:", ValueError, "'cuda:'"),
    ("cuda:-1", ValueError, "'cuda:-1'"),
    ("cuda:one", ValueError, "'cuda:one'"),
    ("CUDA", ValueError, "'CUDA'"),
    (0, TypeError, "int 0"),
])
def test_bad_device_is_an_error_naming_device(device, error, shown):
    """Anything but None, 'cpu', 'cuda' or 'cuda:N' is rejected before CUDA is looked at."""
    with pytest.raises(error, match=r"device must be None, 'cpu', 'cuda' or 'cuda:N' with N a "
                                    rf"GPU index >= 0, got {shown}; pass device='cuda'"):
        ArenaLoader(DATA, device=device)


def test_device_cpu_gives_host_batches():
    """device='cpu' (as torch users write it) means host batches, as device=None does."""
    with ArenaLoader(DATA, batch_size=3, device="cpu") as loader:
        assert loader.device is None
        batches = [batch.copy() for batch in loader]
    np.testing.assert_array_equal(batches[1][2], DATA[5])


@pytest.fixture
def no_cuda(monkeypatch):
    """CUDA looks absent, whatever this machine has."""
    from arena_loader import _device

    monkeypatch.setattr(_device, "cuda_unavailable_reason", lambda: "no CUDA GPU was found")


def test_pin_memory_without_cuda_warns_like_torch_and_gives_host_batches(no_cuda):
    """No accelerator: pin_memory=True warns (torch's words) as each new iterator is made, as
    torch does (not when persistent workers' iterator is reused), and batches stay on the
    host."""
    no_accelerator = (r"'pin_memory' argument is set as true but no accelerator is found.*"
                      r"no CUDA GPU was found")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing at construction
        loader = ArenaLoader(DATA, batch_size=2, pin_memory=True)
    with loader:
        for _ in range(2):
            with pytest.warns(UserWarning, match=no_accelerator):
                batches = [batch.copy() for batch in loader]
        assert not loader.snapshot().pinned
    assert len(batches) == 3
    np.testing.assert_array_equal(batches[2][1], DATA[5])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ArenaLoader(DATA, batch_size=2, pin_memory=True, num_workers=1,
                         persistent_workers=True) as loader:
            assert [len([b.copy() for b in loader]) for _ in range(3)] == [3, 3, 3]
    assert sum("no accelerator" in str(w.message) for w in caught) == 1


def test_device_without_cuda_is_an_error_naming_device(no_cuda):
    """device='cuda' with no GPU fails at construction, saying why and what to pass."""
    with pytest.raises(RuntimeError, match=r"device='cuda:0' needs a CUDA GPU, but no CUDA GPU "
                                           r"was found; pass device=None for host batches"):
        ArenaLoader(DATA, device="cuda:0")


def test_importing_and_using_the_library_without_gpu_options_never_loads_numba_cuda():
    """numba.cuda is imported only for pin_memory or device, so no GPU is ever needed."""
    code = ("import sys, numpy as np\n"
            "import arena_loader\n"
            "from arena_loader import ArenaLoader\n"
            "with ArenaLoader(np.arange(8.0), batch_size=4) as loader:\n"
            "    assert [float(b.sum()) for b in loader] == [6.0, 22.0]\n"
            "assert 'numba.cuda' not in sys.modules, 'numba.cuda was imported'\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.timeout(300)
def test_device_leg_passes_under_the_simulator():
    """tests/test_device_sim.py, run in an interpreter that starts numba's CUDA simulator."""
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
         "tests/test_device_sim.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in summary and "skipped" not in summary, summary
