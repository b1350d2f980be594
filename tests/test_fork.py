"""Fork safety and OS limits: a batch or a loader that crosses a fork never corrupts, never
hangs; OS limits are clear errors (docs/reliability.md, "Fork and OS limits")."""

from __future__ import annotations

import contextlib
import copy
import errno
import gc
import json
import multiprocessing
import os
import pickle
import resource
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from arena_loader import (
    ArenaLoader,
    DescriptorLimitError,
    LoaderForkedError,
    ShmCapacityError,
    WorkerCrashedError,
    _forksafe,
    _slab,
)
from arena_loader._pipeline.order import ORDER_TAG
from arena_loader._slab import NAME_PREFIX, SHM_DIR, Slab

from .conftest import live_children, our_slab_mappings, wait_until
from .datasets import SuicidalDataset
from .test_fault_matrix import REPO_ROOT
from .test_threads import _forked_child

pytestmark = pytest.mark.timeout(60)

FORK = multiprocessing.get_context("fork")
SHAPE = (4, 3)
CHILD_TIMEOUT_S = 20.0


class FullDataset:
    """Sample ``i`` is ``np.full(SHAPE, i)``: any byte from another sample shows."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.ndarray:
        return np.full(SHAPE, index, dtype=np.int64)


def expected_batch(indices) -> np.ndarray:
    return np.stack([np.full(SHAPE, i, dtype=np.int64) for i in indices])


def assert_epoch(loader: ArenaLoader, n: int, batch_size: int) -> None:
    batches = [np.array(b) for b in loader]
    assert len(batches) == -(-n // batch_size)
    for k, batch in enumerate(batches):
        np.testing.assert_array_equal(
            batch, expected_batch(range(k * batch_size, min(n, (k + 1) * batch_size))))


# -- running a check in a forked child -----------------------------------------------------

# What a forked child checks: set before the fork, read in the child (fork copies it).
_HELD: list = []


def _held_contents() -> list:
    return [np.array(b).tolist() for b in _HELD]


def _child_after_go(go, results) -> None:
    go.wait(CHILD_TIMEOUT_S)
    results.put(_held_contents())


class ForkedChild:
    """A child forked now (``via``: os.fork, a fork-context Process, a fork-context Pool)
    that reports ``_held_contents()`` when told to."""

    def __init__(self, via: str):
        self.via = via
        if via == "os.fork":
            self._go_r, self._go_w = os.pipe()
            self._out_r, out_w = os.pipe()
            self.pid = os.fork()
            if self.pid == 0:  # the child: wait, report, leave without running pytest's exit
                code = 1
                try:
                    os.read(self._go_r, 1)
                    os.write(out_w, pickle.dumps(_held_contents()))
                    code = 0
                finally:
                    os._exit(code)
            os.close(out_w)
        elif via == "process":
            self._go, self._results = FORK.Event(), FORK.SimpleQueue()
            self._process = FORK.Process(target=_child_after_go, args=(self._go, self._results))
            self._process.start()
        else:
            self._pool = FORK.Pool(1)
            self._pool.apply(os.getpid)  # its worker is forked and running

    def report(self) -> list:
        if self.via == "os.fork":
            os.write(self._go_w, b"\0")
            chunks = []
            while chunk := os.read(self._out_r, 1 << 16):
                chunks.append(chunk)
            _, status = os.waitpid(self.pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
            for fd in (self._go_r, self._go_w, self._out_r):
                os.close(fd)
            return pickle.loads(b"".join(chunks))
        if self.via == "process":
            self._go.set()
            result = self._results.get()
            self._process.join(CHILD_TIMEOUT_S)
            assert self._process.exitcode == 0
            return result
        result = self._pool.apply_async(_held_contents).get(CHILD_TIMEOUT_S)
        self._pool.terminate()
        self._pool.join()
        return result


FORK_VIA = ["os.fork", "process", "pool"]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("via", FORK_VIA)
def test_forked_child_keeps_its_batches_while_the_parent_reuses_their_slots(via, num_workers):
    """A child forked while the parent holds batches reads them unchanged after the parent
    dropped them and refilled every slot many times over."""
    n, batch_size = 64, 4
    loader = ArenaLoader(FullDataset(n), batch_size=batch_size, num_workers=num_workers,
                         slots=max(2, 2 * num_workers + 1),
                         timeout=10 if num_workers else 0)
    iterator = iter(loader)
    _HELD[:] = [next(iterator), next(iterator)]
    try:
        child = ForkedChild(via)
    finally:
        _HELD.clear()
    # With 2 * num_workers + 1 slots, 14 more batches reuse the dropped batches' slots.
    rest = [np.array(b) for b in iterator]
    assert len(rest) == n // batch_size - 2
    report = child.report()
    assert report == [expected_batch(range(0, 4)).tolist(), expected_batch(range(4, 8)).tolist()]
    loader.close()


@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (2, False), (2, True)])
@pytest.mark.parametrize("via", ["os.fork", "process"])
def test_loader_used_in_a_forked_child_starts_its_own_arena_and_workers(via, num_workers,
                                                                       persistent):
    """A loader used before a fork is used in the child: complete, correct epochs there on
    workers of the child's own (never the parent's), within ``timeout``; the parent's loader
    goes on unharmed."""
    n, batch_size = 24, 4
    loader = ArenaLoader(FullDataset(n), batch_size=batch_size, num_workers=num_workers,
                         persistent_workers=persistent, timeout=5 if num_workers else 0)
    assert_epoch(loader, n, batch_size)
    parent_workers = set(getattr(iter(loader), "worker_pids", [])) if persistent else set()

    def in_child() -> dict:
        started = time.monotonic()
        epochs = []
        for _ in range(2):
            iterator = iter(loader)
            epochs.append([np.array(b).tolist() for b in iterator])
            workers = set(getattr(iterator, "worker_pids", []))
        loader.close()
        return {"epochs": epochs, "workers": sorted(workers),
                "seconds": time.monotonic() - started}

    result = run_in_child(via, in_child)
    reference = [expected_batch(range(k, min(n, k + batch_size))).tolist()
                 for k in range(0, n, batch_size)]
    assert result["epochs"] == [reference, reference]
    assert result["seconds"] < 10
    assert not set(result["workers"]) & parent_workers
    assert_epoch(loader, n, batch_size)
    if persistent:
        assert set(iter(loader).worker_pids) == parent_workers
    loader.close()


class _GatedSampler:
    """A stateful sampler whose first call of ``gate`` (the parent's) waits for ``release``:
    a thread in ``iter(loader)`` or ``state_dict()`` stays there while the test forks. A
    child's copy has been called already."""

    def __init__(self, n: int, gate: str):
        self.n, self.gate, self.calls = n, gate, 0
        self.entered, self.release = threading.Event(), threading.Event()

    def _called(self, name: str) -> None:
        if name == self.gate:
            self.calls += 1
            if self.calls == 1:
                self.entered.set()
                self.release.wait(CHILD_TIMEOUT_S)

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        self._called("__iter__")
        return iter(range(self.n))

    def state_dict(self) -> dict:
        self._called("state_dict")
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _child_use(loader, first: str) -> list:
    """What the child does with the parent's loader: ``first``, then a whole epoch."""
    if first == "state_dict":
        assert loader.state_dict()["batches_yielded"] == 0
    elif first == "load_state_dict":
        loader.load_state_dict({})
    elif first == "copy":  # (__getstate__ reads the loaded state under the lock)
        loader = copy.copy(loader)
    return [np.array(b).tolist() for b in loader]


@pytest.mark.parametrize("gate, first", [
    ("__iter__", "iter"), ("state_dict", "iter"), ("state_dict", "state_dict"),
    ("state_dict", "load_state_dict"), ("state_dict", "copy")])
def test_a_loader_used_in_a_child_forked_while_another_thread_holds_its_locks(gate, first):
    """The one-iter()-at-a-time lock and the resume lock, held at the fork by another thread
    of the parent (in ``iter(loader)``, in ``state_dict()``), are held for good in the
    child: the child's iter(), state_dict(), load_state_dict() and copies take locks of its
    own, and it loads its epoch (as torch's DataLoader does) instead of waiting for ever."""
    sampler = _GatedSampler(8, gate)
    loader = ArenaLoader(FullDataset(8), batch_size=4, sampler=sampler, num_workers=2)
    parents = []
    thread = threading.Thread(target=lambda: parents.append(
        [np.array(b).tolist() for b in loader] if gate == "__iter__" else loader.state_dict()))
    thread.start()
    results = FORK.SimpleQueue()
    try:
        assert sampler.entered.wait(CHILD_TIMEOUT_S)
        child = FORK.Process(target=lambda: results.put(_child_use(loader, first)))
        child.start()
        child.join(5)
        hung = child.is_alive()
        if hung:
            child.kill()
            child.join()
    finally:
        sampler.release.set()
        thread.join(CHILD_TIMEOUT_S)
        loader.close()
    reference = [expected_batch(range(0, 4)).tolist(), expected_batch(range(4, 8)).tolist()]
    assert not hung, f"the child's {first}() waited for a lock the parent's thread held"
    assert child.exitcode == 0 and results.get() == reference
    assert len(parents) == 1 and (gate != "__iter__" or parents[0] == reference)


def _run_and_report(function, results) -> None:
    try:
        results.put(("ok", function()))
    except BaseException as exc:
        results.put(("error", f"{type(exc).__module__}.{type(exc).__name__}: {exc}"))


def run_in_child(via: str, function):
    """``function()``'s return value (or its error text, as ('error', text)) from a child
    forked via ``via``."""
    if via == "os.fork":
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                queue = _PipeQueue(write_fd)
                _run_and_report(function, queue)
            finally:
                os._exit(0)
        os.close(write_fd)
        chunks = []
        while chunk := os.read(read_fd, 1 << 16):
            chunks.append(chunk)
        os.close(read_fd)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        status_name, value = pickle.loads(b"".join(chunks))
    else:
        results = FORK.SimpleQueue()
        process = FORK.Process(target=_run_and_report, args=(function, results))
        process.start()
        process.join(CHILD_TIMEOUT_S)
        assert process.exitcode == 0
        status_name, value = results.get()
    if status_name == "error":
        return ("error", value)
    return value


class _PipeQueue:
    def __init__(self, fd: int):
        self.fd = fd

    def put(self, value) -> None:
        os.write(self.fd, pickle.dumps(value))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_parent_iterator_used_in_a_forked_child_raises_loader_forked_error(num_workers):
    """An iterator made before the fork raises LoaderForkedError in the child at once (it
    never reads the parent's pipes or slots), naming both pids and the fix."""
    loader = ArenaLoader(FullDataset(16), batch_size=4, num_workers=num_workers,
                         persistent_workers=num_workers > 0,
                         timeout=5 if num_workers else 0)
    iterator = iter(loader)
    first = next(iterator)

    def in_child():
        started = time.monotonic()
        try:
            next(iterator)
        except LoaderForkedError as exc:
            return str(exc), time.monotonic() - started
        return "no error", 0.0

    message, seconds = run_in_child("os.fork", in_child)
    assert f"created in process {os.getpid()}" in message
    assert "call iter(loader) in this process" in message
    assert seconds < 1
    np.testing.assert_array_equal(first, expected_batch(range(4)))
    rest = [np.array(b) for b in iterator]  # the parent's iterator is unharmed
    assert [r.tolist() for r in rest] == [expected_batch(range(k, k + 4)).tolist()
                                          for k in (4, 8, 12)]
    loader.close()


class OuterDataset:
    """Each sample iterates an inner ArenaLoader (num_workers=0) and checks every batch."""

    def __init__(self, n: int, inner: ArenaLoader):
        self.n, self.inner = n, inner

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.ndarray:
        for _ in range(3):
            for k, batch in enumerate(self.inner):
                if not np.array_equal(batch, expected_batch(range(2 * k, 2 * k + 2))):
                    raise AssertionError(f"inner batch {k} corrupted: {batch[:, 0, 0]}")
        return np.full(SHAPE, index, dtype=np.int64)


def test_nested_loader_in_forked_workers_gets_an_arena_per_worker():
    """A dataset iterating an inner loader the main process already used: every forked
    outer worker builds its own inner arena, so no two write the same slots."""
    inner = ArenaLoader(FullDataset(16), batch_size=2, slots=2)
    assert_epoch(inner, 16, 2)
    outer = ArenaLoader(OuterDataset(24, inner), batch_size=2, num_workers=2, timeout=20)
    assert_epoch(outer, 24, 2)
    outer.close()
    inner.close()


# -- descriptors ---------------------------------------------------------------------------


def _inheritable_fds() -> list[str]:
    found = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            inheritable = os.get_inheritable(fd)
        except OSError:
            continue  # the listing's own descriptor
        if fd > 2 and inheritable:
            found.append(f"{fd} -> {target}")
    return found


def _slab_fds() -> list[str]:
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if f"{SHM_DIR}/{NAME_PREFIX}" in target and ORDER_TAG not in target:
            found.append(target)
    return found


def _order_ring_fds() -> list[str]:
    return [os.readlink(f"/proc/self/fd/{name}") for name in os.listdir("/proc/self/fd")
            if ORDER_TAG in _readlink_or_empty(f"/proc/self/fd/{name}")]


def _readlink_or_empty(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


class DescriptorReport:
    """Sample ``i``: ``np.full(SHAPE, i)`` (so the slab is mapped) and a JSON report of this
    worker's inheritable descriptors, slab descriptors and slab mappings. ``ignore``: the
    descriptors the test process was given by whoever started it (not the loader's)."""

    def __init__(self, ignore: tuple[int, ...]):
        self.ignore = ignore

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> dict:
        from multiprocessing import resource_tracker

        with open("/proc/self/maps") as maps:
            slab_names = {line.split()[5] for line in maps
                          if f"{SHM_DIR}/{NAME_PREFIX}" in line and ORDER_TAG not in line}
        # The standard library's tracker pipe is inherited on purpose; it has no public name.
        tracker_fd = getattr(resource_tracker._resource_tracker, "_fd", None)
        inheritable = [fd for fd in _inheritable_fds()
                       if int(fd.split()[0]) not in (tracker_fd, *self.ignore)]
        return {"x": np.full(SHAPE, index, dtype=np.int64),
                "report": json.dumps({"inheritable": inheritable, "slab_fds": _slab_fds(),
                                      "mapped_slabs": sorted(slab_names),
                                      "order_ring_fds": _order_ring_fds()})}


# Inheritable descriptors that whoever started pytest gave it: not the loader's.
INHERITED_FROM_HARNESS = tuple(int(fd.split()[0]) for fd in _inheritable_fds())


def _loader_inheritable_fds() -> list[str]:
    return [fd for fd in _inheritable_fds() if int(fd.split()[0]) not in INHERITED_FROM_HARNESS]


@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_every_loader_descriptor_is_close_on_exec_and_workers_hold_no_other_slab(context):
    """In the main process and in every worker, no descriptor the loader opened survives an
    exec; a worker holds no other loader's slab descriptor and maps only its own slab."""
    other = ArenaLoader(FullDataset(8), batch_size=2)  # another loader's slab, open and mapped
    held = next(iter(other))
    (other_slab,) = {line.split()[5] for line in our_slab_mappings()}
    loader = ArenaLoader(DescriptorReport(INHERITED_FROM_HARNESS), batch_size=None, num_workers=2,
                         multiprocessing_context=context, timeout=30)
    reports = [json.loads(str(b["report"])) for b in loader]
    assert len(reports) == 4
    for report in reports:
        assert report["inheritable"] == []
        # Its own slab only (once mapped, the mmap's duplicate descriptor); never `other`'s.
        assert len(report["slab_fds"]) == 1
        assert other_slab not in report["slab_fds"][0]
        assert other_slab not in report["mapped_slabs"]
        assert len(report["order_ring_fds"]) == 1  # its loader's ring (the mmap's duplicate)
    # A later epoch's workers start with the slab sized (by the first epoch's first batch):
    # each holds exactly its mapping's duplicate descriptor. While they run, and after the
    # epoch, the main process holds no inheritable descriptor of the loader's either.
    iterator = iter(loader)
    later = [json.loads(str(next(iterator)["report"]))]
    assert _loader_inheritable_fds() == []
    later += [json.loads(str(b["report"])) for b in iterator]
    assert _loader_inheritable_fds() == []
    assert len(later) == 4
    for report in later:
        assert [fd.split()[0] for fd in report["slab_fds"]] == report["mapped_slabs"]
    loader.close()
    other.close()
    del held


@pytest.fixture
def descriptor_limit():
    """Lower this process's soft RLIMIT_NOFILE for the test; restored afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    def lower(limit: int) -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))

    yield lower
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_too_many_workers_for_the_descriptor_limit_is_a_clear_error(descriptor_limit):
    """`ulimit -n 64` with 16 workers: DescriptorLimitError (an OSError, EMFILE) naming
    num_workers and `ulimit -n`, before any worker starts; a smaller num_workers works."""
    # 64, or more if this process already holds many: 2 workers must still fit under it.
    limit = max(64, _open_fd_count() + 32)
    descriptor_limit(limit)
    loader = ArenaLoader(FullDataset(8), batch_size=2, num_workers=16, slots=40, timeout=10)
    # (4 per worker, and a margin of 16; counted before a worker starts: "are open already")
    with pytest.raises(DescriptorLimitError, match=rf"num_workers=16 needs about 80 more file "
                       rf"descriptors.*`ulimit -n` allows {limit} \(\d+ are open already\)"
                       r".*smaller num_workers") as caught:
        next(iter(loader))
    assert caught.value.errno == errno.EMFILE
    assert not live_children()
    loader.close()
    small = ArenaLoader(FullDataset(8), batch_size=2, num_workers=2, timeout=10)
    assert_epoch(small, 8, 2)
    small.close()


@pytest.fixture
def descriptors_above_fd_setsize():
    """This process holds 1100 more open descriptors, so every pipe made next is numbered
    above select(2)'s FD_SETSIZE (1024), as in a program whose libraries keep many files
    open (a mosaicml-streaming run did: examples/trial15/README.md)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = _open_fd_count() + 1100 + 256
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {need}")
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    yield
    for fd in held:
        os.close(fd)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.timeout(20)
@pytest.mark.parametrize("persistent", [False, True])
def test_pipes_numbered_above_fd_setsize_work(descriptors_above_fd_setsize, persistent):
    """A worker that outruns the loop sleeps on its doorbell pipe, numbered above 1024 here:
    it waits with poll(2) (select.select raised "filedescriptor out of range in select()" in
    the worker, a WorkerCrashedError at next()); two epochs come whole."""
    loader = ArenaLoader(FullDataset(16), batch_size=4, num_workers=1,
                         persistent_workers=persistent, timeout=10)
    for _ in range(2):
        batches = []
        for batch in loader:
            time.sleep(0.005)  # longer than the worker's spin: it goes to sleep on the pipe
            batches.append(np.array(batch).tolist())
        assert batches == [expected_batch(range(k, k + 4)).tolist() for k in range(0, 16, 4)]
    loader.close()
    assert wait_until(lambda: not live_children())


@pytest.mark.timeout(20)
def test_fork_with_held_batches_above_fd_setsize(descriptors_above_fd_setsize):
    """A fork while batches are held makes the parent wait on a pipe (numbered above 1024
    here) until the child has copied them: poll(2), not select, and the child reads them."""
    loader = ArenaLoader(FullDataset(8), batch_size=4, num_workers=0)
    iterator = iter(loader)
    _HELD[:] = [next(iterator)]
    try:
        child = ForkedChild("os.fork")
    finally:
        _HELD.clear()
    assert child.report() == [expected_batch(range(4)).tolist()]
    assert [np.array(b).tolist() for b in iterator] == [expected_batch(range(4, 8)).tolist()]
    loader.close()


def test_emfile_while_starting_workers_is_a_descriptor_limit_error(monkeypatch):
    """An EMFILE met while starting workers (the pre-check passed) is the same clear error,
    and the workers already started are stopped."""
    from arena_loader import _process

    real = _process.worker_pipes
    calls = iter(range(100))

    def pipes_until_the_third(context):
        if next(calls) == 2:
            raise OSError(errno.EMFILE, "Too many open files")
        return real(context)

    monkeypatch.setattr(_process, "worker_pipes", pipes_until_the_third)
    loader = ArenaLoader(FullDataset(8), batch_size=2, num_workers=4, timeout=10)
    with pytest.raises(DescriptorLimitError, match=r"num_workers=4 .*`ulimit -n`"):
        next(iter(loader))
    loader.close()


# -- OS limits on shared memory ---------------------------------------------------------------


def _raise(err: int, text: str):
    def fail(*args, **kwargs):
        raise OSError(err, text)
    return fail


@pytest.mark.parametrize(("target", "err", "fix"), [
    ("mmap", errno.ENOMEM, "`ulimit -v`"),
    ("mmap", errno.EPERM, "writable tmpfs"),
    ("mmap", errno.EMFILE, "`ulimit -n`"),
    ("fallocate", errno.EFBIG, "`ulimit -f`"),
    ("fallocate", errno.ENOSPC, "--shm-size"),
    ("fallocate", errno.ENOMEM, "`ulimit -v`"),
])
def test_failure_to_size_or_map_shared_memory_is_a_capacity_error(monkeypatch, target, err,
                                                                  fix):
    """ENOMEM, EPERM, EMFILE from mmap and EFBIG, ENOSPC, ENOMEM from posix_fallocate are
    ShmCapacityError with that errno, the bytes needed and the fix; nothing is left open."""
    if target == "mmap":
        monkeypatch.setattr(_slab.mmap, "mmap", _raise(err, os.strerror(err)))
    else:
        monkeypatch.setattr(os, "posix_fallocate", _raise(err, os.strerror(err)))
    with pytest.raises(ShmCapacityError, match=rf"needs 8,192 bytes \(2 slots of 4,096 bytes\)"
                       rf".*{os.strerror(err)}.*fix: .*{fix}") as caught:
        Slab(8192, slots=2)
    assert caught.value.errno == err


@pytest.mark.parametrize(("failure", "err", "match"), [
    ("no inode", errno.ENOSPC, r"/dev/shm has no free inode.*nr_inodes"),
    ("no descriptor", errno.EMFILE, r"maximum number of files open.*`ulimit -n`"),
    ("permission", errno.EACCES, r"Permission denied.*writable tmpfs"),
])
def test_failure_to_create_shared_memory_is_a_capacity_error(monkeypatch, failure, err, match):
    """/dev/shm out of inodes, no descriptor left, no permission: ShmCapacityError with the
    errno and the fix, at the first batch of a loader too."""
    if failure == "no inode":
        monkeypatch.setattr(_slab, "shm_available_inodes", lambda: 0)
    else:
        # posix_ipc's own errors: an OSError without errno, or its PermissionsError.
        error = (OSError("This process already has the maximum number of files open")
                 if failure == "no descriptor" else _slab.posix_ipc.PermissionsError(
                     "Permission denied"))

        def create(*args, **kwargs):
            raise error
        monkeypatch.setattr(_slab.posix_ipc, "SharedMemory", create)
    with pytest.raises(ShmCapacityError, match=match) as caught:
        Slab(4096)
    assert caught.value.errno == err
    loader = ArenaLoader(FullDataset(8), batch_size=2)
    with pytest.raises(ShmCapacityError, match=match):
        next(iter(loader))
    loader.close()


OS_LIMITS_SCRIPT = r"""
import json, resource, sys
import numpy as np
from arena_loader import ArenaLoader, ShmCapacityError

class Big:  # batches of 32 rows of 8 MiB (256 MiB), written in place by read_into
    def __len__(self): return 64
    def __getitem__(self, i): return np.full((1 << 20,), i, dtype=np.int64)
    def read_into(self, indices, out): out[...] = indices[:, None]

def attempt(limit, value):
    soft, hard = resource.getrlimit(limit)
    resource.setrlimit(limit, (value, hard))
    try:
        loader = ArenaLoader(Big(), batch_size=32, num_workers=int(sys.argv[1]),
                             timeout=20 if int(sys.argv[1]) else 0)
        try:
            next(iter(loader))
            return {"raised": None}
        except ShmCapacityError as exc:
            return {"raised": "ShmCapacityError", "errno": exc.errno, "message": str(exc)}
        finally:
            resource.setrlimit(limit, (soft, hard))
            loader.close()
    finally:
        resource.setrlimit(limit, (soft, hard))

with open("/proc/self/status") as status:
    vm_kib = next(int(l.split()[1]) for l in status if l.startswith("VmSize:"))
results = {
    # posix_fallocate past RLIMIT_FSIZE: EFBIG (Python ignores the SIGXFSZ it sends).
    "fsize": attempt(resource.RLIMIT_FSIZE, 1 << 20),
    # mmap past RLIMIT_AS: ENOMEM; 160 MiB of headroom (threads' stacks and malloc arenas
    # need some) is less than a 256 MiB batch.
    "as": attempt(resource.RLIMIT_AS, (vm_kib << 10) + (160 << 20)),
}
print(json.dumps(results))
"""


@pytest.mark.parametrize("num_workers", [0, 2])
def test_real_rlimits_give_capacity_errors_not_signals(num_workers):
    """In a subprocess under a real RLIMIT_FSIZE and RLIMIT_AS, the first next() raises
    ShmCapacityError (EFBIG, ENOMEM) naming the fix; the process is not killed by a signal
    and leaves no /dev/shm object."""
    # One malloc arena: each thread's would reserve 64 MiB of the limited address space.
    env = {**os.environ, "MALLOC_ARENA_MAX": "1"}
    result = subprocess.run([sys.executable, "-c", OS_LIMITS_SCRIPT, str(num_workers)],
                            capture_output=True, text=True, timeout=30, cwd=REPO_ROOT, env=env)
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome["fsize"]["errno"] == errno.EFBIG, outcome
    assert "`ulimit -f`" in outcome["fsize"]["message"]
    assert outcome["as"]["errno"] == errno.ENOMEM, outcome
    assert "`ulimit -v`" in outcome["as"]["message"]
    assert "segment needs 268,435,456 bytes" in outcome["as"]["message"]
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(NAME_PREFIX)]


# -- teardown without the cyclic garbage collector ---------------------------------------------


def _open_fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def gc_disabled():
    gc.collect()
    gc.disable()
    yield
    gc.enable()


@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_dropped_loaders_stop_their_workers_without_the_cyclic_gc(gc_disabled, num_workers,
                                                                  persistent):
    """With gc disabled, loaders (and mid-epoch iterators) dropped without close() stop their
    workers and unmap their slabs when the last reference goes: children, mappings and
    descriptors stay flat over many loaders."""
    peaks = {"children": 0, "mappings": 0}
    fds = []
    for round_number in range(8):
        loader = ArenaLoader(FullDataset(16), batch_size=4, num_workers=num_workers,
                             persistent_workers=persistent,
                             timeout=10 if num_workers else 0)
        iterator = iter(loader)
        batch = next(iterator)
        np.testing.assert_array_equal(batch, expected_batch(range(4)))
        peaks["children"] = max(peaks["children"], len(live_children()))
        peaks["mappings"] = max(peaks["mappings"], len(our_slab_mappings()))
        if round_number % 2:
            del iterator  # dropped mid-epoch, then the loader
        del batch, loader
        iterator = None
        assert wait_until(lambda: not live_children(), timeout_s=3)
        assert our_slab_mappings() == []
        fds.append(_open_fd_count())
    assert peaks["children"] <= num_workers
    # The slab, and batches loaded before it was sized (one-off segments, at most the
    # read-ahead: prefetch_factor * num_workers).
    assert peaks["mappings"] <= 1 + 2 * num_workers
    assert max(fds) == fds[0], fds


class ClosingSampler:
    """Indices 0..n-1 over and over, from a generator whose ``finally`` notes its close."""

    def __init__(self, n: int):
        self.n, self.events = n, []

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        self.events.append("start")
        try:
            index = 0
            while True:
                yield index % self.n
                index += 1
        finally:
            self.events.append("closed")


@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_a_dropped_iterator_lets_go_of_the_samplers_iterator_as_torchs_does(
        gc_disabled, num_workers, persistent):
    """torch's iterator dropped mid-epoch frees its sampler iterator with it: a generator's
    ``finally`` runs at once, and mmengine's InfiniteSampler (whose iterators all delegate to
    one generator) then yields nothing more; a persistent one lets it go at the next
    ``iter()``. ArenaLoader's does the same without waiting for the cyclic GC."""
    from torch.utils.data import DataLoader

    events = {}
    for kind in (DataLoader, ArenaLoader):
        sampler = ClosingSampler(16)
        loader = kind(FullDataset(16), sampler=sampler, batch_size=4, num_workers=num_workers,
                      persistent_workers=persistent)
        iterator = iter(loader)
        next(iterator)
        del iterator
        dropped = list(sampler.events)
        iterator = iter(loader)
        next(iterator)
        events[kind] = (dropped, list(sampler.events))
        del iterator
        if kind is ArenaLoader:
            loader.close()
    closed = ["start"] if persistent else ["start", "closed"]
    assert events[DataLoader] == (closed, ["start", "closed", "start"])
    assert events[ArenaLoader] == events[DataLoader]


# -- the registry itself ---------------------------------------------------------------------


def test_registered_one_off_mapping_is_private_in_a_forked_child():
    """Another mapping (a future one-off segment) registered with map_shared and
    keep_across_fork: the child keeps the registered view, the rest is dropped there."""
    fd = _slab.open_shared()
    try:
        _slab.size_shared(fd, 3 * 4096)
        mapping = _slab.map_shared(fd, 3 * 4096)
    finally:
        os.close(fd)
    array = np.frombuffer(mapping, dtype=np.uint8)
    visible = array[4096 + 100: 4096 + 300]
    visible[:] = 7

    class Owner:
        pass

    owner = Owner()
    _forksafe.keep_across_fork(owner, visible.ctypes.data, visible.nbytes)
    _HELD[:] = [visible]
    try:
        child = ForkedChild("os.fork")
    finally:
        _HELD.clear()
    visible[:] = 9  # the parent writes after the fork: the child must not see it
    assert child.report() == [[7] * 200]
    del owner, visible, array
    mapping.close()
    assert our_slab_mappings() == []



class _InterruptedChildWrites:
    """``os`` for ``_forksafe``, whose write() raises KeyboardInterrupt in a forked child: a
    Ctrl-C landing on the child's "batches copied" byte."""

    def __init__(self, parent_pid: int):
        self._parent_pid = parent_pid

    def __getattr__(self, name):
        return getattr(os, name)

    def write(self, fd, data):
        if os.getpid() != self._parent_pid:
            raise KeyboardInterrupt
        return os.write(fd, data)


@pytest.mark.timeout(60)
def test_a_child_interrupted_in_its_at_fork_hook_does_not_stall_the_parent(monkeypatch):
    """A Ctrl-C in a freshly forked worker's hook, at the byte that tells the parent its held
    batches are copied, still closes the pipe: the parent's fork returns at once (it waited
    the whole 10 s COPY_TIMEOUT_S per worker before), and every epoch is whole."""
    from arena_loader import _forksafe

    monkeypatch.setattr(_forksafe, "os", _InterruptedChildWrites(os.getpid()))
    with ArenaLoader(FullDataset(8), batch_size=2, num_workers=2) as loader:
        held = next(iter(loader))  # held across the next fork: the parent waits for the copy
        for _ in range(2):
            start = time.monotonic()
            iterator = iter(loader)
            first = next(iterator)
            assert time.monotonic() - start < _forksafe.COPY_TIMEOUT_S / 2
            rest = [batch for batch in iterator]
            assert len(rest) + 1 == 4 and first.shape == held.shape
            del first, rest, iterator
    assert not live_children()


class _Finalized:
    """Cyclic garbage whose finalizer records the pid it runs in."""

    def __init__(self, path: str):
        self.path, self.cycle = path, self

    def __del__(self):
        with open(self.path, "a") as log:
            log.write(f"{os.getpid()}\n")


class _CollectingDataset:
    """Each sample runs a full collection in the worker, as a busy dataset's allocations do."""

    def __len__(self):
        return 8

    def __getitem__(self, index):
        gc.collect()
        return np.full(3, index, np.int64)


def test_forked_workers_run_no_finalizer_of_the_parents_garbage(tmp_path):
    """Garbage the main process had not collected when the workers forked is the parent's:
    its finalizers never run in a worker (a worker's collection would otherwise run them,
    e.g. an abandoned torch iterator's, which then tries to stop workers that are not the
    worker's), and the parent still runs them."""
    log = tmp_path / "finalized"
    enabled = gc.isenabled()
    gc.disable()  # (the garbage must still be there when the workers fork)
    try:
        _Finalized(str(log))
        with ArenaLoader(_CollectingDataset(), batch_size=2, num_workers=2,
                         multiprocessing_context="fork") as loader:
            assert [int(b[0, 0]) for b in loader] == [0, 2, 4, 6]
    finally:
        if enabled:
            gc.enable()
    gc.collect()
    assert log.read_text().split() == [str(os.getpid())]


@contextlib.contextmanager
def _another_thread_forks_as_a_worker_starts():
    """As this thread's next fork (a fork-started worker) returns, another thread forks a
    child (a user's fork Pool starting, say): it inherits the worker's ends of its pipes that
    this process has not closed yet, multiprocessing's exit sentinel among them, and holds
    them until the block ends. (The hook is registered now, after every library's: the
    locks their before-fork hooks take, which the other thread's fork takes too, are
    released by then. os.register_at_fork has no way back: it stays, idle.)"""
    with contextlib.ExitStack() as children:
        pids: list[int] = []
        armed = [threading.get_ident()]

        def fork_in_another_thread() -> None:
            if armed and armed[0] == threading.get_ident():
                armed.clear()
                thread = threading.Thread(
                    target=lambda: pids.append(children.enter_context(_forked_child())))
                thread.start()
                thread.join(timeout=10)

        os.register_at_fork(after_in_parent=fork_in_another_thread)
        try:
            yield pids
        finally:
            armed.clear()


def test_a_batch_another_thread_drops_during_a_fork_keeps_its_slot_until_the_child_copied_it(
        monkeypatch):
    """A batch held at a fork and dropped by another thread while the child has not yet
    copied it (here the child's copy starts 0.3 s late): its slot stays leased until the
    child says it has its copy, so no worker refills it under the copy."""
    real = _forksafe._make_private

    def late(start: int, end: int) -> None:
        time.sleep(0.3)
        real(start, end)

    monkeypatch.setattr(_forksafe, "_make_private", late)  # (the child's copy of the module)
    with ArenaLoader(FullDataset(8), batch_size=2) as loader:
        iterator = iter(loader)
        holder, held = [next(iterator)], []

        def drop_as_the_child_copies() -> None:
            assert wait_until(live_children, timeout_s=5)  # (the child, forked now)
            holder.clear()
            gc.collect()
            held.append(loader.snapshot().held_batches)

        thread = threading.Thread(target=drop_as_the_child_copies)
        thread.start()
        with _forked_child():
            thread.join(timeout=10)
        assert held == [1]
        assert loader.snapshot().held_batches == 0


def test_a_child_forked_after_the_workers_holds_no_shared_memory_descriptor_of_the_loader():
    """The slab's and order ring's descriptors are handed over to the fork-started worker
    being forked, and to no later child of the same thread (os.fork, a fork Pool): there they
    point at /dev/null, so the child keeps none of the loader's shared memory alive. (A
    batch is held: the fork returns once the child's at-fork hook is done.)"""
    loader = ArenaLoader(FullDataset(8), batch_size=2, num_workers=1,
                         multiprocessing_context="fork")
    iterator = iter(loader)
    batch = next(iterator)
    with _forked_child() as pid:
        held = []
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                held.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    del batch
    iterator.close()
    loader.close()
    assert not [target for target in held if target.startswith(f"{SHM_DIR}/{NAME_PREFIX}")]


@pytest.mark.parametrize("sigchld", [signal.SIG_DFL, signal.SIG_IGN], ids=["default", "ignored"])
def test_a_dead_worker_is_seen_while_another_threads_child_holds_its_pipes(sigchld):
    """A worker killed while a child that another thread forked as the worker started is
    alive: that child holds the write ends of the worker's exit sentinel and result pipe, so
    neither showed the death. next() waited for as long as the child lived (here, until
    `timeout`: LoaderTimeoutError, "which is still running"), where torch's DataLoader raises
    at once. The worker's exit status is read now: WorkerCrashedError. With SIGCHLD ignored
    (the kernel reaps the worker: no exit status, and is_alive() stays True) its pid is
    asked."""
    loader = ArenaLoader(SuicidalDataset(8, fatal_index=0), batch_size=2, num_workers=1,
                         multiprocessing_context="fork", timeout=20)
    with _another_thread_forks_as_a_worker_starts() as children:
        previous = signal.signal(signal.SIGCHLD, sigchld)
        try:
            with pytest.raises(WorkerCrashedError, match="was killed by SIGKILL"
                               if sigchld == signal.SIG_DFL else "exit status lost"):
                next(iter(loader))
        finally:
            signal.signal(signal.SIGCHLD, previous)  # (the child is reaped by its waitpid)
        assert len(children) == 1
    loader.close()


def test_an_epoch_ends_at_once_while_another_threads_child_holds_a_workers_sentinel(
        monkeypatch):
    """Workers' exits at an epoch's end, while a child that another thread forked as a worker
    started is alive (it holds that worker's exit sentinel open): each was joined by its
    sentinel, which never showed the exit, so the epoch ended only after the whole join
    timeout (2 s; here raised to 20 s; torch's DataLoader waits its 5 s). Their exit statuses
    are read as they are joined."""
    monkeypatch.setattr("arena_loader._process.JOIN_TIMEOUT_S", 20.0)
    loader = ArenaLoader(FullDataset(8), batch_size=2, num_workers=2,
                         multiprocessing_context="fork")
    with _another_thread_forks_as_a_worker_starts() as children:
        start = time.monotonic()
        assert_epoch(loader, 8, 2)
        assert time.monotonic() - start < 10.0
        assert len(children) == 1
    loader.close()
