"""Fixtures shared by every test: each test must leave no process, thread, shared-memory
object or slab mapping of ours behind."""

from __future__ import annotations

import contextlib
import gc
import linecache
import os
import signal
import sys
import threading
import time

import psutil
import pytest

from arena_loader._pipeline.order import ORDER_TAG
from arena_loader._slab import NAME_PREFIX, SHM_DIR

from . import hugepages, zygote

# Ctrl-C is part of what the suite tests. Started with SIGINT ignored (a background job of a
# non-interactive shell, `nohup ... &`), Python installs no handler for it, and nor do the
# interpreters the tests start, which inherit the ignored signal: every KeyboardInterrupt test
# would fail. Handled here, it is reset to its default in what the tests start.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_finish(session):
    # Everything imported by now (the test modules, torch, numba, numpy) is long-lived:
    # moved out of the collector's generations, each test's gc.collect() walks only what the
    # tests made (a full collection over torch's objects costs ~0.1 s, twice per test).
    gc.collect()
    gc.freeze()
    # Forked ~1,000 times by each of the two pytest processes: its memory on 2 MiB pages
    # makes each fork, and the worker's exit, about half as costly (tests/hugepages.py).
    hugepages.collapse()


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False,
                     help="also run tests marked slow (soak and speed runs)")


# The suite's longest tests (4 to 47 s each on the 2-core machine), longest first. They run
# spread over the first four fifths of the suite, none in its last fifth: pytest-xdist
# (--dist loadgroup, pyproject) hands out one test at a time to whichever process is free,
# so the suite ends on short tests and neither process waits long for the other's last one.
# Spread, not all first: two of them at once (each several processes busy) would leave the
# short tests, many of which wait, to run side by side later with cores idle. A name no
# longer here only runs in its place; update the list from a run's --durations. Those of
# them that grow the test process (GROWS_MEMORY, below) run with the others of that list at
# the suite's end instead, their long ones first.
LONGEST_FIRST = (
    "test_bench.py::test_bench_cli_quick_writes_every_loader_and_metric",
    "test_device.py::test_device_leg_passes_under_the_simulator",
    "test_examples.py::test_a_torch_script_switched_by_one_import_sees_the_same_batches_and_losses",
    "test_faults.py::test_ctrl_c_at_any_line_of_next_loses_no_batch_error",
    "test_bench.py::test_every_compared_loader_delivers_the_reference_batches",
    "test_examples.py::test_train_memmap_example_reduces_the_loss",
    "test_workers.py::test_torch_rng_is_seeded_per_worker_even_under_spawn",
    "test_faults.py::test_ctrl_c_at_any_line_of_a_staged_next_loses_nothing",
    "test_soak.py::test_soak_with_injected_faults_stays_flat",
    "test_faults.py::test_ctrl_c_at_any_line_of_next_iter_and_close_loses_nothing",
    "test_faults.py::test_a_ctrl_c_at_any_call_into_c_loses_no_batch_and_strands_no_slot",
    "test_iterable.py::test_spawn_workers_shard_and_stop_cleanly",
    "test_parity3.py::test_lightning_trains_on_the_order_torchs_dataloader_gives",
    "test_faults.py::test_ctrl_c_in_next_loses_no_sample_of_an_iterable_dataset",
    "test_examples.py::test_train_numeric_example_reduces_the_loss",
    "test_output.py::test_output_torch_imports_torch_with_the_loader_not_inside_next",
    "test_capacity.py::test_batch_larger_than_shm_fails_at_its_batch_without_sigbus",
    "test_resume.py::test_resumed_run_equals_uninterrupted_run",
    "test_lifecycle.py::test_close_racing_iteration_from_another_thread_is_only_ever_loader_closed_error",
    "test_datasets.py::test_memmap_dataset_works_with_spawn_and_pickles_only_paths",
    "test_iterable.py::test_the_epoch_ends_without_a_wait_when_the_streams_end",
    "test_fork.py::test_every_loader_descriptor_is_close_on_exec_and_workers_hold_no_other_slab",
    "test_faults.py::test_a_signal_that_arrives_during_a_garbage_collection_is_not_swallowed",
    "test_datasets.py::test_gather_is_compiled_in_the_parent_before_fork_workers_start",
    "test_bench.py::test_bench_rounds_go_over_every_workload_in_turn",
)


# Tests that leave the test process larger for good: the peer loaders' libraries the bench
# compares (Grain, torchdata, SPDL), numba's compiler (the gather kernel, loaded from its
# cache or compiled), torch's pin-memory and optimizer paths, Lightning. A test that starts
# workers forks this process, and a fork and its exit cost CPU in proportion to the process's
# private memory (measured on the 2-core machine: 17 ms at 233 MB, 53 ms at 654 MB); the suite
# forks ~2,000 workers. Run last, these leave the others forking a ~330 MB process instead
# of one that had grown to 430-510 MB.
GROWS_MEMORY = (
    "test_bench.py::test_every_compared_loader_delivers_the_reference_batches",
    "test_bench.py::test_pools_start_on_cache_lines_in_this_process_and_once_unpickled",
    "test_datasets.py",
    "test_threads.py",
    "test_device.py::test_pin_memory",
    "test_parity3.py::test_lightning_trains_on_the_order_torchs_dataloader_gives",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def name(item):
        return item.nodeid.partition("[")[0].rpartition("/")[2]

    def grows(item):
        return name(item).startswith(GROWS_MEMORY)

    longest = sorted((item for item in items if name(item) in rank), key=lambda i: rank[name(i)])
    last = [item for item in longest if grows(item)]
    longest = [item for item in longest if not grows(item)]
    last += [item for item in items if name(item) not in rank and grows(item)]
    rest = [item for item in items if name(item) not in rank and not grows(item)]
    gap = len(rest) * 4 // 5 / max(1, len(longest))
    items[:] = rest
    for k, item in reversed(list(enumerate(longest))):  # (from the back: indices hold)
        items.insert(round(k * gap), item)
    items += last  # (their long ones first)
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: pass --runslow to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session):
    zygote.stop_all()  # (the warm interpreters' loops end)


def our_shm_objects() -> list[str]:
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(NAME_PREFIX))


def our_shm_mappings() -> list[str]:
    """This process's mappings of our shared memory: slabs, segments and order rings."""
    with open("/proc/self/maps") as maps:
        return [line.strip() for line in maps if f"{SHM_DIR}/{NAME_PREFIX}" in line]


def our_shm_descriptors() -> list[str]:
    """This process's open descriptors of our shared memory (unlinked ones included)."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (the listing's own descriptor, closed by now)
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(f"{SHM_DIR}/{NAME_PREFIX}"):
                held.append(f"{fd} -> {target}")
    return held


def our_slab_mappings() -> list[str]:
    """This process's mappings of our slabs and segments (not of the order rings)."""
    return [line for line in our_shm_mappings() if ORDER_TAG not in line]


# Helpers that the standard library starts once per interpreter (for spawn / forkserver) and
# keeps for its lifetime; they are not ours.
_STDLIB_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def _descendant_pids() -> list[int] | None:
    """This process's descendants, from each thread's ``/proc/.../children`` (the kernel's
    list of the processes that thread forked); None where the kernel has no such file.
    psutil's ``children(recursive=True)`` reads every process's ``stat`` on the machine
    instead: ~4 ms, in every test's teardown."""
    found, parents = [], [os.getpid()]
    while parents:
        pid = parents.pop()
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue  # (exited meanwhile)
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as listing:
                    children = [int(child) for child in listing.read().split()]
            except FileNotFoundError:
                if pid == os.getpid() and not found:
                    return None  # (no CONFIG_PROC_CHILDREN)
                continue
            except OSError:
                continue
            found += children
            parents += children
    return found


def live_children() -> list[psutil.Process]:
    alive = []
    pids = _descendant_pids()
    if pids is None:
        children = psutil.Process().children(recursive=True)
    else:
        children = []
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                children.append(psutil.Process(pid))
    for child in children:
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            cmdline = " ".join(child.cmdline())
        except psutil.NoSuchProcess:
            continue
        if not any(helper in cmdline for helper in _STDLIB_HELPERS) and (
                child.pid not in zygote.warm_pids()):
            alive.append(child)
    return alive


def our_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("arena_loader")]


@contextlib.contextmanager
def interrupted_in_thread_start(name: str):
    """A KeyboardInterrupt inside ``Thread.start()`` of the first thread named ``name``, where
    a real Ctrl-C can land once the thread is in threading's table of threads being started
    (as the table's lock is released) and before the OS thread is made."""
    fired: list[str] = []

    def local(frame, event, arg):
        if event == "line" and not fired and "_start_new_thread(" in linecache.getline(
                frame.f_code.co_filename, frame.f_lineno):
            fired.append(name)
            raise KeyboardInterrupt
        return local

    def tracer(frame, event, arg):
        if event == "call" and frame.f_code is threading.Thread.start.__code__ \
                and getattr(frame.f_locals.get("self"), "name", None) == name:
            return local
        return None

    sys.settrace(tracer)
    try:
        yield fired
    finally:
        sys.settrace(None)


def run_in_threads(target, count: int = 2, timeout_s: float = 20.0) -> None:
    """``target(k)`` for k in ``range(count)``, each in a thread of its own, all at once;
    joined, none left hanging."""
    threads = [threading.Thread(target=target, args=(k,)) for k in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout_s)
    assert not any(thread.is_alive() for thread in threads), "a thread hangs"


def wait_until(predicate, timeout_s: float = 5.0, interval_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


@pytest.fixture(autouse=True)
def no_leaks():
    """After the test: no child process, dispatch thread, /dev/shm object, slab mapping or
    descriptor."""
    yield
    gc.collect()
    assert wait_until(lambda: not live_children()), (
        f"child processes survived the test: {[(p.pid, p.name()) for p in live_children()]}")
    assert wait_until(lambda: not our_threads()), f"threads survived: {our_threads()}"
    # A name exists only between O_CREX and unlink (microseconds): one seen here may be a
    # test running beside this one (pytest-xdist); a leak stays.
    if not wait_until(lambda: not our_shm_objects(), timeout_s=1.0):
        leaked = our_shm_objects()
        for name in leaked:  # removed, so that one leak fails one test and not every later one
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(SHM_DIR, name))
        pytest.fail(f"shared-memory objects leaked: {leaked}")
    gc.collect()
    assert not our_shm_mappings(), f"shared memory still mapped: {our_shm_mappings()}"
    assert not our_shm_descriptors(), f"shared memory still open: {our_shm_descriptors()}"
    # What survived is long-lived too (modules the test imported: the bench's peers, numba's
    # simulator, ...), frozen as at collection's end: each teardown scans only what the next
    # test makes. (Frozen only at collection's end, a worker that had run the bench tests
    # held ~500k objects and each teardown took 0.14 s: 120 s of the suite's 230.)
    gc.freeze()
    hugepages.collapse_grown()  # (what such a module added, on 2 MiB pages too)


@pytest.fixture
def fake_pinning(monkeypatch):
    """torch sees a GPU, and ``Tensor.pin_memory()`` makes a copy (torch's CPU build has no
    page-locked memory): records each tensor it copied."""
    torch = pytest.importorskip("torch")
    copied: list = []

    def pin_memory(tensor, device=None):
        copied.append(tuple(tensor.shape))  # (not the tensor: it would keep its slot)
        return tensor.clone()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    return copied
