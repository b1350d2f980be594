"""Run PyTorch's own DataLoader tests against ArenaLoader, and against torch for the baseline.

By hand (not part of our test suite): it needs torch's ``test/test_dataloader.py``, which the
torch wheel does not ship; take it from the torch source of the release you have installed. The
file imports ``torch.testing._internal`` (in the wheel), which needs ``pip install expecttest``.

    python examples/torch_suite.py run PATH/test_dataloader.py --loader torch --xml torch.xml
    python examples/torch_suite.py run PATH/test_dataloader.py --loader arena --xml arena.xml
    python examples/torch_suite.py compare torch.xml arena.xml

``run`` leaves torch's file unchanged: a ``sitecustomize`` module on ``PYTHONPATH`` replaces
``torch.utils.data.DataLoader`` with ``ArenaLoader(output="torch")`` in every interpreter the
run starts (the pytest process, the spawned processes the tests start, and the
``python -c`` programs some tests run), so ``from torch.utils.data import DataLoader`` in the
file, and in those programs, gets ArenaLoader. Each test has a time limit (pytest-timeout);
arguments after ``--`` go to pytest (``-- -k test_timeout``). ``--workers-via-pids`` runs a
rewritten copy where torch's private ``iterator._workers`` reads the public
``iterator.worker_pids``, to run the rest of the tests that read it. ``compare`` prints the
tests torch passes and ArenaLoader does not, marking those that failed on a torch internal
(out of scope: docs/migrating.md, "torch's own tests").

Latest result (torch 2.13.0 CPU, test/test_dataloader.py of pytorch/pytorch@74436f9, 2 busy
cores, about 8 minutes a run): 178 tests; torch passes 162 (14 skip: CUDA, dill, the slow
test_proper_exit; test_get_worker_info fails for torch itself, as that file expects a
RuntimeError where torch 2.13's frozen WorkerInfo raises FrozenInstanceError); ArenaLoader
passes 158 of those 162; the other 4 read iterator._workers and pass with --workers-via-pids.
With PYTORCH_TEST_WITH_SLOW=1, test_proper_exit (both classes) passes under torch, and under
ArenaLoader with --workers-via-pids (it reads _workers too).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Installed in every interpreter of an `arena` run. The subclass keeps `DataLoader[T]`
# subscriptable and makes output="torch" the default, as a torch user's batches are tensors.
SITECUSTOMIZE = '''\
import os

if os.environ.get("ARENA_TORCH_SUITE") == "arena":
    from typing import TypeVar

    import torch.utils.data

    from arena_loader import ArenaLoader

    T_co = TypeVar("T_co", covariant=True)

    class DataLoader(ArenaLoader[T_co]):
        def __init__(self, *args, output="torch", **kwargs):
            super().__init__(*args, output=output, **kwargs)

    torch.utils.data.DataLoader = DataLoader
'''

# With --workers-via-pids, torch's `iterator._workers` (a list of worker processes) becomes
# this view of the public `iterator.worker_pids`, to run the rest of the tests that read it.
# A worker ArenaLoader has joined is gone and reads as exit code 0 (the loader read the real
# code; a crash would have raised WorkerCrashedError in the test).
PUBLIC_WORKERS = '''
import psutil as _torch_suite_psutil


class _WorkerByPid:
    def __init__(self, pid):
        self.pid, self.exitcode = pid, None

    def join(self, timeout=None):
        try:
            _torch_suite_psutil.Process(self.pid).wait(timeout)
        except _torch_suite_psutil.NoSuchProcess:
            pass
        except _torch_suite_psutil.TimeoutExpired:
            return
        self.exitcode = 0

    def is_alive(self):
        try:
            return _torch_suite_psutil.Process(self.pid).status() != "zombie"
        except _torch_suite_psutil.NoSuchProcess:
            return False

    def terminate(self):
        pass


def _workers_by_pid(iterator):
    return [_WorkerByPid(pid) for pid in iterator.worker_pids]

'''

# Names of torch's DataLoader internals: a test that fails on one of them is out of scope.
TORCH_INTERNALS = re.compile(
    r"_workers\b|_pin_memory_thread|_shutdown_workers|_iterator\b|_get_iterator|"
    r"_DataLoader__initialized|_index_queues|_worker_result_queue")


def rewrite_workers_via_pids(source: str) -> str:
    """torch's test file with each `name._workers` read through `name.worker_pids`."""
    # Appended: the tests look the helper up when they run, after the module has loaded.
    return re.sub(r"(\w+)\._workers\b", r"_workers_by_pid(\1)", source) + PUBLIC_WORKERS


def run(test_file: Path, loader: str, xml: Path, timeout_s: int, workers_via_pids: bool,
        pytest_args: list[str]) -> int:
    """Run torch's test file with pytest under `loader`; write the JUnit XML report."""
    with tempfile.TemporaryDirectory(prefix="torch_suite_") as shim_dir:
        Path(shim_dir, "sitecustomize.py").write_text(SITECUSTOMIZE)
        if workers_via_pids:  # a rewritten copy, same module name (the file imports itself)
            rewritten = Path(shim_dir, "suite", test_file.name)
            rewritten.parent.mkdir()
            rewritten.write_text(rewrite_workers_via_pids(test_file.read_text()))
            test_file = rewritten
        env = dict(os.environ, ARENA_TORCH_SUITE=loader)
        env["PYTHONPATH"] = os.pathsep.join(
            [shim_dir, str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
        command = [sys.executable, "-m", "pytest", str(test_file), "-c", os.devnull,
                   "--rootdir", str(test_file.parent), "-p", "no:cacheprovider",
                   f"--timeout={timeout_s}", f"--junitxml={xml}", "-q", "-rfE", *pytest_args]
        return subprocess.call(command, env=env, cwd=test_file.parent)


def outcomes(xml: Path) -> dict[str, tuple[str, str]]:
    """test id -> (passed | failed | skipped, the failure text) from a JUnit XML report."""
    results = {}
    for case in ElementTree.parse(xml).iter("testcase"):
        test_id = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        status, text = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                status, text = "failed", (child.get("message") or "") + (child.text or "")
            elif child.tag == "skipped":
                status, text = "skipped", child.get("message") or ""
        results[test_id] = (status, text)
    return results


def compare(torch_xml: Path, arena_xml: Path) -> None:
    """Print the counts and each test torch passes that ArenaLoader does not."""
    torch_results, arena_results = outcomes(torch_xml), outcomes(arena_xml)
    torch_passes = sorted(t for t, (status, _) in torch_results.items() if status == "passed")
    both = [t for t in torch_passes if arena_results.get(t, ("missing", ""))[0] == "passed"]
    differ = [t for t in torch_passes if t not in both]
    internals = [t for t in differ if TORCH_INTERNALS.search(arena_results.get(t, ("", ""))[1])]
    print(f"tests: {len(torch_results)}; torch passes {len(torch_passes)}; ArenaLoader passes "
          f"{len(both)} of those; {len(internals)} of the others read torch internals")
    for test_id in differ:
        status, text = arena_results.get(test_id, ("missing", ""))
        tag = "internals" if test_id in internals else status
        last_line = next((line for line in reversed(text.strip().splitlines()) if line.strip()), "")
        print(f"  [{tag}] {test_id}: {last_line.strip()[:160]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="run torch's test file")
    run_parser.add_argument("test_file", type=Path)
    run_parser.add_argument("--loader", choices=["torch", "arena"], required=True)
    run_parser.add_argument("--xml", type=Path, required=True)
    run_parser.add_argument("--timeout-s", type=int, default=240)
    run_parser.add_argument("--workers-via-pids", action="store_true",
                            help="read torch's private iterator._workers through the public "
                                 "iterator.worker_pids (a rewritten copy of the file)")
    compare_parser = commands.add_parser("compare", help="compare two runs' XML reports")
    compare_parser.add_argument("torch_xml", type=Path)
    compare_parser.add_argument("arena_xml", type=Path)
    args, pytest_args = parser.parse_known_args()  # what run does not know goes to pytest
    if args.command == "run":
        sys.exit(run(args.test_file.resolve(), args.loader, args.xml.resolve(), args.timeout_s,
                     args.workers_via_pids, [arg for arg in pytest_args if arg != "--"]))
    if pytest_args:
        parser.error(f"unrecognized arguments: {' '.join(pytest_args)}")
    compare(args.torch_xml, args.arena_xml)


if __name__ == "__main__":
    main()
