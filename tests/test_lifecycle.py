"""Start-up, epochs, persistent workers and teardown: nothing survives a loader."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import psutil
import pytest

from arena_loader import ArenaLoader, LoaderClosedError, WorkerCrashedError
from arena_loader._slab import NAME_PREFIX

from .conftest import live_children, our_slab_mappings, wait_until
from .datasets import ImageDataset, RaisingDataset, reference_epoch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.timeout(60)


def test_close_is_idempotent_and_stops_workers():
    """close() twice is fine; workers are gone after the first."""
    loader = ArenaLoader(ImageDataset(20), batch_size=2, num_workers=2)
    iterator = iter(loader)
    next(iterator)
    pids = iterator.worker_pids
    assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
    loader.close()
    loader.close()
    assert not live_children()
    with pytest.raises(LoaderClosedError, match="closed"):
        next(iterator)
    with pytest.raises(LoaderClosedError, match="create a new one"):
        iter(loader)


def test_context_manager_closes_after_break():
    """Leaving a `with` block mid-epoch stops the workers and unmaps the slab."""
    with ArenaLoader(ImageDataset(50), batch_size=2, num_workers=3) as loader:
        for i, _batch in enumerate(loader):
            if i == 2:
                break
        del _batch
    assert not live_children()
    gc.collect()
    assert not our_slab_mappings()


def test_abandoned_iterator_is_cleaned_up_by_garbage_collection():
    """Dropping the last reference to a mid-epoch iterator joins its workers."""
    loader = ArenaLoader(ImageDataset(50), batch_size=2, num_workers=2)
    iterator = iter(loader)
    batch = next(iterator)
    pids = iterator.worker_pids
    del iterator, batch
    gc.collect()
    assert wait_until(lambda: not any(psutil.pid_exists(p) for p in pids))
    # The loader is still usable for a new epoch.
    assert sum(1 for _ in loader) == 25


def test_abandoned_loader_is_cleaned_up_by_garbage_collection():
    """Dropping the loader (never closed) releases workers, slab and mapping."""
    loader = ArenaLoader(ImageDataset(50), batch_size=2, num_workers=2,
                         persistent_workers=True)
    for _ in loader:
        break
    del loader, _
    gc.collect()
    assert wait_until(lambda: not live_children())
    assert not our_slab_mappings()


@pytest.mark.parametrize("worker_mode", ["process", "thread"])
def test_break_then_new_epoch_starts_from_the_beginning(worker_mode):
    """After a break, the next iter() yields the full epoch again."""
    dataset = ImageDataset(21, shape=(2,), dtype=np.int64)
    expected = reference_epoch(dataset, 4, False)
    with ArenaLoader(dataset, batch_size=4, num_workers=2, worker_mode=worker_mode) as loader:
        for i, _ in enumerate(loader):
            if i == 1:
                break
        for i, batch in enumerate(loader):
            np.testing.assert_array_equal(batch, expected[i])
        assert i == len(expected) - 1


@pytest.mark.parametrize("worker_mode", ["process", "thread"])
@pytest.mark.parametrize("interrupt_at", [None, 1])
def test_persistent_workers_survive_epochs(interrupt_at, worker_mode):
    """persistent_workers=True keeps the same worker processes across epochs, even after a
    break mid-epoch, and every epoch is complete and correct."""
    dataset = ImageDataset(30, shape=(3,), dtype=np.int64)
    expected = reference_epoch(dataset, 4, False)
    with ArenaLoader(dataset, batch_size=4, num_workers=2, persistent_workers=True,
                     worker_mode=worker_mode) as loader:
        iterator = iter(loader)
        next(iterator)  # a loader's first epoch starts its workers at the first next()
        pids = iterator.worker_pids
        assert len(pids) == 2
        for i, _ in enumerate(iterator, start=1):
            if i == interrupt_at:
                break
        for epoch in range(3):
            again = iter(loader)
            assert again is iterator and again.worker_pids == pids
            count = 0
            for i, batch in enumerate(again):
                np.testing.assert_array_equal(batch, expected[i], err_msg=f"epoch {epoch}")
                count += 1
            assert count == len(expected)
        del batch


def _through(iterable):
    yield from iterable  # gen.close() (or the generator collected) calls its close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["close", "collected"])
def test_a_generator_closed_mid_epoch_keeps_the_persistent_workers_and_the_order(how):
    """``yield from loader`` in a generator closed mid-epoch (``close()``, or dropped) calls
    the epoch iterator's close(), which torch's iterator does not have: ours stopped the
    loader's persistent workers, so the next epoch started new ones from a new seed draw, in
    another order than torch's. The workers and the next epoch stay as with the generator
    left open."""
    torch = pytest.importorskip("torch")  # (an int seed's order does not take the worker seed)
    dataset = ImageDataset(30, shape=(3,), dtype=np.int64)

    def next_epoch(close: bool) -> tuple[list, bool]:
        with ArenaLoader(dataset, batch_size=4, shuffle=True, num_workers=2,
                         persistent_workers=True,
                         generator=torch.Generator().manual_seed(0)) as loader:
            first = iter(loader)
            next(first)
            pids = first.worker_pids
            del first
            gen = _through(loader)
            next(gen)
            if close and how == "close":
                gen.close()
            elif close:
                del gen
                gc.collect()
            again = iter(loader)
            return [b.tolist() for b in again], again.worker_pids == pids

    order, same_workers = next_epoch(close=True)
    assert order == next_epoch(close=False)[0]
    assert same_workers


def test_non_persistent_workers_exit_when_the_epoch_ends():
    """Without persistent_workers, workers are joined as soon as the epoch is exhausted."""
    with ArenaLoader(ImageDataset(10), batch_size=2, num_workers=2) as loader:
        iterator = iter(loader)
        next(iterator)
        pids = iterator.worker_pids
        assert len(pids) == 2
        assert sum(1 for _ in iterator) == 4
        assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                       for p in pids)
        with pytest.raises(StopIteration):
            next(iterator)


def test_empty_dataset_yields_nothing():
    """A dataset of length 0 gives an empty epoch and starts no worker."""
    with ArenaLoader(ImageDataset(0), batch_size=4, num_workers=2) as loader:
        assert list(loader) == []
        assert len(loader) == 0


def test_two_live_iterators_of_one_loader_are_independent():
    """A second iter() while the first is alive gets its own slab; both are correct."""
    dataset = ImageDataset(12, shape=(2,), dtype=np.int64)
    expected = reference_epoch(dataset, 3, False)
    with ArenaLoader(dataset, batch_size=3, num_workers=1) as loader:
        first, second = iter(loader), iter(loader)
        for i, (a, b) in enumerate(zip(first, second)):
            np.testing.assert_array_equal(a, expected[i])
            np.testing.assert_array_equal(b, expected[i])
        assert i == len(expected) - 1
        for exhausted in (first, second):
            with pytest.raises(StopIteration):
                next(exhausted)
        del a, b, first, second


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_spawn_and_forkserver_workers_load_correct_batches(context):
    """Non-fork start methods receive the slab descriptor and load correct batches."""
    dataset = ImageDataset(10, shape=(2, 2), dtype=np.float64)
    expected = reference_epoch(dataset, 3, False)
    with ArenaLoader(dataset, batch_size=3, num_workers=2,
                     multiprocessing_context=context) as loader:
        for i, batch in enumerate(loader):
            np.testing.assert_array_equal(batch, expected[i])
        assert i == len(expected) - 1
        del batch


class LockedDataset(ImageDataset):
    """Holds a lock (an open database handle): it does not pickle for a spawned worker."""

    def __init__(self, n):
        super().__init__(n)
        self.lock = threading.Lock()


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_a_dataset_that_does_not_pickle_for_spawn_leaves_no_descriptor_open(context):
    """The start of a worker whose dataset does not pickle raises pickle's error (torch's
    type and text) and closes the pipes and socket made for it then, as for a worker that
    started. Before: the worker's ends stayed open until collected (a ResourceWarning:
    unclosed socket)."""
    loader = ArenaLoader(LockedDataset(4), batch_size=2, num_workers=1,
                         multiprocessing_context=context)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        opened = []
        for _ in range(2):  # (the first may start the start method's own helper process)
            before = len(os.listdir("/proc/self/fd"))
            with pytest.raises(TypeError, match=r"cannot pickle '_thread\.lock' object"):
                iter(loader)  # (the error, held by pytest, holds the frames that made them)
            opened.append(len(os.listdir("/proc/self/fd")) - before)
        assert opened[1] <= 0, opened
        loader.close()
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], caught


@pytest.mark.timeout(60)
def test_main_process_killed_leaves_no_worker_or_shared_memory():
    """SIGKILL of the main process: its workers exit within 2 s and nothing stays in /dev/shm."""
    script = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {os.getcwd()!r})
        from tests.datasets import ImageDataset
        from arena_loader import ArenaLoader
        loader = ArenaLoader(ImageDataset(10_000), batch_size=2, num_workers=2,
                             persistent_workers=True)
        it = iter(loader)
        next(it)
        print(" ".join(map(str, it.worker_pids)), flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert wait_until(lambda: not any(_running(p) for p in pids), timeout_s=2.0), \
            "workers outlived the killed main process by more than 2 s"
        assert not [n for n in os.listdir("/dev/shm")
                    if n.startswith(f"{NAME_PREFIX}{proc.pid}_")]
    finally:
        proc.kill()
        proc.wait()


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_used_as_a_temporary_in_a_for_loop(num_workers):
    """`for b in ArenaLoader(...)` keeps the loader alive for the whole loop."""
    dataset = ImageDataset(9, shape=(2,), dtype=np.int64)
    expected = reference_epoch(dataset, 2, False)
    count = 0
    for i, batch in enumerate(ArenaLoader(dataset, batch_size=2, num_workers=num_workers)):
        gc.collect()
        np.testing.assert_array_equal(batch, expected[i])
        count += 1
    assert count == len(expected)
    del batch


@pytest.mark.parametrize("num_workers, worker_mode", [(0, "process"), (2, "process"),
                                                      (2, "thread")])
def test_error_in_the_first_batch_is_raised_by_next_and_iteration_continues(num_workers,
                                                                           worker_mode):
    """iter() loads nothing; a failing first batch raises at next(), and the next next()
    yields batch 1 (the layout is learnt from it), with no slot lost."""
    dataset = RaisingDataset(8, bad={1})
    expected = reference_epoch(ImageDataset(8), 2, False)
    with ArenaLoader(dataset, batch_size=2, num_workers=num_workers, slots=5,
                     worker_mode=worker_mode) as loader:
        iterator = iter(loader)
        with pytest.raises(ValueError, match="sample 1 is corrupt"):
            next(iterator)
        for i in range(1, 4):
            np.testing.assert_array_equal(next(iterator), expected[i])
        with pytest.raises(StopIteration):
            next(iterator)
        del iterator
        gc.collect()
        assert loader.snapshot().free_slots == 5


@pytest.mark.parametrize("break_first", [False, True])
def test_persistent_loader_recovers_after_a_worker_is_killed_between_epochs(break_first):
    """A worker SIGKILLed between epochs: the next epoch raises WorkerCrashedError (or, if
    the previous epoch was interrupted, replaces the workers), and the loader then delivers
    complete epochs again with no slot lost."""
    dataset = ImageDataset(24, shape=(2,), dtype=np.int64)
    expected = reference_epoch(dataset, 2, False)
    with ArenaLoader(dataset, batch_size=2, num_workers=2, persistent_workers=True,
                     slots=6) as loader:
        iterator = iter(loader)
        for i, _ in enumerate(iterator):
            if break_first and i == 0:
                break
        victim = iterator.worker_pids[1]
        os.kill(victim, signal.SIGKILL)
        assert wait_until(lambda: not _running(victim))
        if break_first:  # the interrupted epoch's drain finds the dead worker and replaces it
            for _ in loader:
                pass
        else:
            killed = rf"\(pid {victim}\) was killed by SIGKILL"
            with pytest.raises(WorkerCrashedError, match=killed):
                for _ in loader:
                    pass
        for _epoch in range(2):
            for i, batch in enumerate(loader):
                np.testing.assert_array_equal(batch, expected[i])
            assert i == len(expected) - 1
        del batch, iterator, _
        gc.collect()
        assert loader.snapshot().free_slots == 6


@pytest.mark.parametrize("persistent, context", [(True, "fork"), (False, "fork"),
                                                 (False, "spawn")])
def test_interpreter_exit_mid_epoch_is_clean(persistent, context):
    """A script that exits mid-epoch without close() ends promptly, silently, and its
    workers are gone."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.getcwd()!r})
        from tests.datasets import ImageDataset
        from arena_loader import ArenaLoader
        if __name__ == "__main__":
            loader = ArenaLoader(ImageDataset(1000), batch_size=2, num_workers=2,
                                 persistent_workers={persistent},
                                 multiprocessing_context={context!r})
            iterator = iter(loader)
            batch = next(iterator)
            print(" ".join(map(str, iterator.worker_pids)), flush=True)
    """)
    _exits_silently_leaving_no_worker(script)


def _exits_silently_leaving_no_worker(script: str) -> None:
    """``script`` (which prints its 2 workers' pids) exits with status 0, writes nothing to
    stderr, and its workers are gone within 2 s."""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=30, check=False)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    pids = [int(p) for p in result.stdout.split()]
    assert len(pids) == 2
    assert wait_until(lambda: not any(_running(p) for p in pids), timeout_s=2.0)


def test_interpreter_exit_while_a_daemon_thread_iterates_is_silent():
    """A script whose daemon thread is inside next() when the main thread ends exits at once,
    prints nothing (the thread ends with SystemExit, which threading does not print) and
    leaves no worker."""
    script = textwrap.dedent(f"""
        import sys, threading, time
        sys.path.insert(0, {os.getcwd()!r})
        from tests.datasets import SlowDataset
        from arena_loader import ArenaLoader
        loader = ArenaLoader(SlowDataset(100, range(4, 100), 30), batch_size=2, num_workers=2)
        started = threading.Event()

        def train():
            for _ in loader:
                started.set()

        threading.Thread(target=train, daemon=True).start()
        started.wait(20)
        time.sleep(0.2)  # the thread now waits in next() for a batch that takes 30 s
        print(" ".join(map(str, loader.snapshot().iterators[0].worker_pids)), flush=True)
    """)
    _exits_silently_leaving_no_worker(script)


def test_ctrl_c_while_waiting_for_a_batch_interrupts_and_cleans_up():
    """SIGINT to the main process while next() waits raises KeyboardInterrupt there; the
    workers (which ignore SIGINT) are then stopped by close()."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {os.getcwd()!r})
        from tests.datasets import SlowDataset
        from arena_loader import ArenaLoader

        loader = ArenaLoader(SlowDataset(100, range(2, 100), 30), batch_size=2, num_workers=2)
        iterator = iter(loader)
        next(iterator)
        print(" ".join(map(str, iterator.worker_pids)), flush=True)
        try:
            next(iterator)
        except KeyboardInterrupt:
            loader.close()
            print("interrupted", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=15)
        assert proc.returncode == 0 and "interrupted" in out
        assert not any(_running(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()


SIGCHLD_IGNORED_SCRIPT = r"""
import json, os, signal, sys, time
import numpy as np
from arena_loader import ArenaLoader, WorkerCrashedError

class Rows:
    def __len__(self): return 16
    def __getitem__(self, i):
        if KILL[0] and i == 9:
            os.kill(os.getpid(), signal.SIGKILL)
        return np.full(3, i)

KILL = [False]
SIGNALLED = []  # (pid, signal) of every signal this process sends

def kill(pid, sig, real=os.kill):
    if sig and os.getpid() == MAIN:
        SIGNALLED.append((pid, sig))
    real(pid, sig)

if __name__ == "__main__":
    import arena_loader._process
    MAIN = os.getpid()
    os.kill = kill
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps children at once
    loader = ArenaLoader(Rows(), batch_size=4, num_workers=2)
    fds, epoch_s = [], []
    for _ in range(6):
        start = time.monotonic()
        assert [int(b[0, 0]) for b in loader] == [0, 4, 8, 12]
        epoch_s.append(time.monotonic() - start)
        fds.append(len(os.listdir("/proc/self/fd")))
    signalled = list(SIGNALLED)
    # From here on every pid is taken by another process as soon as ours exits (the kernel
    # reuses a reaped pid): no exit may be missed, and no signal may reach that process.
    arena_loader._process.pid_exists = lambda pid: True
    KILL[0] = True
    try:
        list(loader)
        crash = crash_pid = None
    except WorkerCrashedError as exc:
        crash, crash_pid = str(exc), exc.pid
    loader.close()
    print(json.dumps({"fds": fds, "crash": crash, "epoch_s": epoch_s, "signalled": signalled,
                      "crashed_signalled": [s for p, s in SIGNALLED if p == crash_pid]}))
"""


@pytest.mark.timeout(90)
def test_sigchld_ignored_by_the_program_leaks_nothing_and_crashes_say_why(tmp_path):
    """A program that sets SIGCHLD to SIG_IGN (its children are reaped by the kernel, so
    their exit status is lost): epochs leak no descriptor, and a killed worker is reported as
    exited, naming SIGCHLD, not as "still running"; an epoch's end does not wait out the
    join timeouts. No worker that exited is signalled, even once another process holds its
    pid (faked: every pid reads as taken). Before: each epoch's end sent SIGTERM then
    SIGKILL to the pids of its workers, which had exited on their own (is_alive() stays True
    without the exit status), and so would to whatever process had taken a pid since; with
    a pid taken, the killed worker read as "still running"."""
    script = tmp_path / "sigchld.py"
    script.write_text(SIGCHLD_IGNORED_SCRIPT)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=80, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert max(report["fds"]) == report["fds"][0], report["fds"]
    assert "exit status lost" in report["crash"] and "SIGCHLD" in report["crash"]
    assert "still running" not in report["crash"]
    assert report["signalled"] == [] and report["crashed_signalled"] == [], report
    # Workers' exits are seen at once (not after a join timeout at each shutdown step).
    assert max(report["epoch_s"]) < 4.0, report["epoch_s"]


@pytest.mark.timeout(60)
def test_ctrl_c_during_worker_shutdown_still_stops_every_worker(monkeypatch):
    """A KeyboardInterrupt landing while close() joins the workers (one busy in a 30 s sample,
    so it would not read its Stop for that long) reaches the caller, and no worker is left
    running: they are killed at once, so a later close() is a no-op."""
    import multiprocessing.process

    from .datasets import SlowDataset

    loader = ArenaLoader(SlowDataset(16, {4}, 30.0), batch_size=2, num_workers=2)
    iterator = iter(loader)
    next(iterator)
    time.sleep(0.3)  # worker 0 is now inside sample 4
    pids = iterator.worker_pids
    real_join, calls = multiprocessing.process.BaseProcess.join, []

    def interrupted_join(self, timeout=None):
        calls.append(self.pid)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real_join(self, timeout)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "join", interrupted_join)
    with pytest.raises(KeyboardInterrupt):
        iterator.close()
    monkeypatch.undo()
    assert wait_until(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status()
                                      != psutil.STATUS_ZOMBIE for p in pids), timeout_s=5)
    loader.close()


@pytest.mark.timeout(60)
def test_close_while_a_persistent_epoch_begins_is_loader_closed_error(monkeypatch):
    """close() from another thread just as iter() restarts the persistent workers' epoch (the
    interleaving the race test below met about once in a hundred trials): iter() raises
    LoaderClosedError, not an AttributeError on the iterator that close() dropped."""
    from arena_loader._pipeline.iterator import MultiProcessIterator

    loader = ArenaLoader(ImageDataset(8, shape=(4,)), batch_size=2, num_workers=2,
                         persistent_workers=True)
    assert sum(1 for _ in loader) == 4
    reset = MultiProcessIterator.reset

    def reset_then_closed(self, plan):
        reset(self, plan)
        loader.close()  # what the other thread does at this moment

    monkeypatch.setattr(MultiProcessIterator, "reset", reset_then_closed)
    with pytest.raises(LoaderClosedError):
        iter(loader)
    assert not live_children()


@pytest.mark.timeout(120)
def test_close_racing_iteration_from_another_thread_is_only_ever_loader_closed_error():
    """close() from another thread at a random moment of iter()/next() (first epoch or later,
    persistent or not): the iterating thread finishes its epoch or gets LoaderClosedError,
    never another error or a hang, and nothing is left behind."""
    import random
    import threading

    rng = random.Random(7)
    outcomes: dict[str, int] = {}
    for trial in range(24):
        loader = ArenaLoader(ImageDataset(8, shape=(4,)), batch_size=2, num_workers=2,
                             persistent_workers=trial % 2 == 1)
        if trial % 4 >= 2:
            assert sum(1 for _ in loader) == 4  # the slab is sized: the other start path
        result: list[str] = []

        def iterate(loader=loader, result=result):
            try:
                for _ in loader:
                    pass
                result.append("finished")
            except LoaderClosedError:
                result.append("closed")
            except BaseException as exc:  # what must not happen
                result.append(f"{type(exc).__name__}: {exc}")

        thread = threading.Thread(target=iterate)
        thread.start()
        time.sleep(rng.random() * 0.05)
        loader.close()
        thread.join(timeout=20)
        assert not thread.is_alive(), f"trial {trial}: the iterating thread hangs"
        outcomes[result[0]] = outcomes.get(result[0], 0) + 1
    assert set(outcomes) <= {"finished", "closed"}, outcomes


class _ClosesTheLoaderAt:
    """``dataset[at]`` closes ``loader`` from another thread (and waits for it): a close()
    that lands while a ``num_workers=0`` next() is loading a batch."""

    def __init__(self, at: int):
        self.at, self.loader = at, None

    def __len__(self):
        return 12

    def __getitem__(self, i):
        if i == self.at:
            import threading

            closer = threading.Thread(target=self.loader.close)
            closer.start()
            closer.join()
        return np.full(4, i, dtype=np.int64)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("at", [0, 2, 4])  # the claim; a slot never used; a used slot
def test_close_from_another_thread_while_num_workers_0_loads_is_loader_closed_error(at):
    """Found by a chaos soak: close() from another thread while the consumer's next() loads a
    batch in process (num_workers=0) made that next() raise ValueError('the slab is closed')
    (a slot not yet backed) or TypeError (a slot of the closed slab), not LoaderClosedError.
    The batches before come whole, then LoaderClosedError, then the closed iterator ends."""
    dataset = _ClosesTheLoaderAt(at)
    loader = ArenaLoader(dataset, batch_size=2, num_workers=0)
    dataset.loader = loader
    iterator, got = iter(loader), []
    with pytest.raises(LoaderClosedError):
        for batch in iterator:
            got.append(batch[:, 0].tolist())
            del batch
    assert got == [[i, i + 1] for i in range(0, at, 2)]
    with pytest.raises(StopIteration):
        next(iterator)
    del iterator
    loader.close()
    assert not our_slab_mappings()


class _SlowReadInto:
    """Batch protocol: ``read_into`` of the batch holding index ``slow`` says so (``writing``),
    then waits ``delay_s`` before writing its rows: a close() lands while a ``num_workers=0``
    next() writes its slot."""

    def __init__(self, n: int, slow: int, delay_s: float):
        import threading

        self.n, self.slow, self.delay_s = n, slow, delay_s
        self.writing = threading.Event()

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.full(4, i, dtype=np.int64)

    def read_into(self, indices, out):
        if self.slow in indices:
            self.writing.set()
            time.sleep(self.delay_s)
        out[:] = indices[:, None]


@pytest.mark.timeout(30)
@pytest.mark.filterwarnings("ignore:your code holds")
def test_an_iterator_closed_while_another_thread_writes_its_slot_keeps_the_slot_till_done():
    """close() of a num_workers=0 iterator from another thread while its next() wrote a slot
    (a slow read_into) freed that slot and gave the slab back at once: the loader's next
    iterator took the slot, and the batch it handed out changed as the old next() went on
    writing (which then raised RuntimeError "... arena_loader bug"). That next() now raises
    LoaderClosedError and gives its slot and the slab back as it returns; every batch of the
    next epoch stays as it was handed out."""
    import threading

    dataset = _SlowReadInto(12, slow=2, delay_s=1.0)
    loader = ArenaLoader(dataset, batch_size=2, slots=2)
    iterator = iter(loader)
    first = next(iterator)  # held: its slot stays leased, the next batch takes the other
    outcome: list = []

    def load():
        try:
            outcome.append(next(iterator))
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=load)
    thread.start()
    assert dataset.writing.wait(10)
    iterator.close()
    again = iter(loader)
    batch = next(again)
    copy = batch.copy()
    thread.join(timeout=10)
    assert not thread.is_alive()
    np.testing.assert_array_equal(batch, copy)  # unchanged since it was handed out
    assert [type(got) for got in outcome] == [LoaderClosedError]
    rest = [b[:, 0].tolist() for b in again]
    assert [batch[:, 0].tolist(), *rest] == [[i, i + 1] for i in range(0, 12, 2)]
    assert first[:, 0].tolist() == [0, 1]
    with pytest.raises(StopIteration):
        next(iterator)
    outcome.clear()
    del first, batch, again
    loader.close()
    gc.collect()
    assert not our_slab_mappings()


@pytest.mark.timeout(60)
def test_an_epoch_end_interrupted_while_giving_the_slab_back_is_finished_later(monkeypatch):
    """num_workers=0: a Ctrl-C inside the epoch's end, while the iterator gives the slab
    back to the loader, is finished by the next next() (StopIteration again), so close()
    closes the slab: no descriptor or mapping of it stays (a finalizer's own call forgot the
    give-back before running it, and the slab stayed open for good)."""
    from arena_loader._arena import ArenaSource

    real, calls = ArenaSource.unclaim, []

    def interrupted_once(self, arena):
        calls.append(arena)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(self, arena)

    monkeypatch.setattr(ArenaSource, "unclaim", interrupted_once)
    loader = ArenaLoader(ImageDataset(6, shape=(4,)), batch_size=2)
    iterator = iter(loader)
    assert len([batch for _, batch in zip(range(3), iterator)]) == 3
    with pytest.raises(KeyboardInterrupt):
        next(iterator)  # the epoch's end, interrupted in unclaim
    with pytest.raises(StopIteration):
        next(iterator)
    assert len(calls) == 2 and loader.snapshot().in_use is False
    loader.close()
    del iterator
    gc.collect()
    assert not our_slab_mappings()


def test_iter_interrupted_after_its_workers_started_stops_them_at_once():
    """A Ctrl-C as iter() sends the first window (here raised by the batch sampler's second
    draw), after the workers started: they are stopped before the interrupt leaves iter(),
    not when the half-made iterator is collected, which the interrupt's traceback (kept by
    ``except ... as``, a notebook's ``sys.last_traceback``) delays."""

    class InterruptedAtTheSecondDraw:
        def __iter__(self):
            yield [0, 1]
            raise KeyboardInterrupt

        def __len__(self):
            return 2

    loader = ArenaLoader(ImageDataset(4), batch_sampler=InterruptedAtTheSecondDraw(),
                         num_workers=2)
    with pytest.raises(KeyboardInterrupt) as interrupted:
        iter(loader)
    assert interrupted.value.__traceback__ is not None  # (it holds the iterator's frame)
    assert not live_children()
    loader.close()
