"""Worker process management: start, message channels, liveness, and bounded shutdown."""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import os
import resource
import signal
import socket
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from ._forksafe import handing_over, interrupts_deferred, register_descriptor
from ._readable import readable
from ._slab import remove_names_of
from ._worker import WorkerSetup, pid_exists, worker_main
from .errors import DescriptorLimitError, WorkerCrashedError

JOIN_TIMEOUT_S = 2.0  # per escalation step: join, then terminate, then kill
# How often a join reads the exit status of workers whose sentinel shows no exit (join_exited).
EXIT_POLL_S = 0.05
# Pipe buffers are raised from Linux's 64 KiB so that a piped index list, or a completion with
# many object leaves, does not block one side while the other is also writing.
PIPE_NBYTES = 1 << 20
# Descriptors the main process keeps per worker (doorbell pipe, result pipe, fd socket,
# sentinel), and a margin for those open while one starts, the order ring and the waker.
FDS_PER_WORKER = 4
FD_HEADROOM = 16


def describe_exit(exitcode: int | None, running: bool = True) -> str:
    if exitcode is None:
        if not running:
            return ("exited, with its exit status lost (this program ignores SIGCHLD, so "
                    "the kernel reaped it; do not set SIGCHLD to SIG_IGN)")
        return "is still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}"
    return f"exited with code {exitcode}"


def torch_crash_text(pid: int | None, exitcode: int | None) -> str:
    """torch's DataLoader wording for a dead worker, so that code and searches keyed on
    torch's text still match: its Python check's (dataloader.py), which reports a death it
    finds on a timeout, then its SIGCHLD handler's (torch/csrc/DataLoader.cpp), which names the
    signal or exit code."""
    text = f"DataLoader worker (pid(s) {pid}) exited unexpectedly"
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.strsignal(-exitcode) or f"Unknown signal: {-exitcode}"
        except ValueError:
            name = f"Unknown signal: {-exitcode}"
        text += f"; DataLoader worker (pid {pid}) is killed by signal: {name}. "
    elif exitcode:
        text += (f"; DataLoader worker (pid {pid}) exited unexpectedly with exit code "
                 f"{exitcode}. Details are lost due to multiprocessing. Rerunning with "
                 "num_workers=0 may give better error trace.")
    return text


def interactive_main_hint(context: Any, setup: WorkerSetup) -> str:
    """Why a spawn / forkserver worker died before loading anything, when it did: the
    dataset's class (or the collate_fn, worker_init_fn) lives in an interactive ``__main__``
    (a Jupyter notebook, ``python -c``), which a fresh interpreter cannot import, so unpickling
    the worker's arguments fails (``Can't get attribute ...``, on the worker's stderr only)."""
    method = getattr(context, "get_start_method", lambda: "fork")()
    if method == "fork" or getattr(sys.modules.get("__main__"), "__file__", None):
        return ""
    dataset = getattr(setup.filler, "dataset", None)
    collate_fn = getattr(setup.filler, "collate_fn", None)
    found = [f"{role} {getattr(obj, '__qualname__', obj)!r}"
             for role, obj in (("the dataset's class", type(dataset)),
                               ("collate_fn", collate_fn), ("worker_init_fn", setup.worker_init_fn))
             if getattr(obj, "__module__", None) == "__main__"]
    if not found:
        return ""
    return (f"; {' and '.join(found)} is defined in __main__ (a notebook or an interactive "
            f"session), which a {method!r} worker cannot import, so it died unpickling it: "
            "define it in a .py file and import it from there, or pass "
            "multiprocessing_context='fork'")


class WorkerGroup:
    """``num_workers`` processes, each with a private doorbell pipe (the order ring's, see
    ``_pipeline.order``) and result pipe. Asking them to stop is the order ring's job (a STOP
    entry); this group joins, terminates and kills."""

    def __init__(self, context: Any, setups: list[WorkerSetup]):
        self.processes: list[Any] = []
        self.main_hint = interactive_main_hint(context, setups[0]) if setups else ""
        self.task_conns: list[Connection] = []
        self.result_conns: list[Connection] = []
        self.fd_sockets: list[socket.socket] = []  # one-off segments' descriptors arrive here
        self.closed = False
        # Held for a whole shutdown: a second caller (close() while the dispatch thread is
        # stopping the group after a crash) returns only once every worker is gone.
        self._shutdown_lock = threading.Lock()
        check_descriptor_limit(len(setups))
        try:
            for setup in setups:
                task_reader, task_writer, result_reader, result_writer = worker_pipes(context)
                fd_main, fd_worker = fd_socket_pair()
                setup = dataclasses.replace(setup, fd_socket=fd_worker)
                process = context.Process(
                    target=worker_main, args=(setup, task_reader, result_writer),
                    name=f"arena_loader-worker-{setup.worker_id}", daemon=True,
                )
                # Recorded before it starts: an interrupt right after start() must still find
                # it to stop (an unrecorded worker would wait forever on a pipe whose write end
                # the next workers inherited).
                self.processes.append(process)
                self.task_conns.append(task_writer)
                self.result_conns.append(result_reader)
                self.fd_sockets.append(fd_main)
                # A child forked meanwhile (a user's, the next workers) must not hold it open:
                # one-off segments sent and not yet received would outlive close().
                register_descriptor(fd_main, fd_main.fileno())
                try:
                    with handing_over([setup.slab.fd, setup.order.fd]), interrupts_deferred():
                        process.start()  # (the descriptors are all it keeps of ours)
                finally:
                    # Close the child's ends here, before the next fork copies them: a dead
                    # worker's result pipe then reads EOF at once (and a start that failed,
                    # the dataset not pickling for spawn, leaves none open).
                    task_reader.close()
                    result_writer.close()
                    fd_worker.close()
            self.pids = [p.pid for p in self.processes]
            self.sentinels = [p.sentinel for p in self.processes]
        except OSError as exc:
            self.shutdown()
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                raise descriptor_limit_error(len(setups), str(exc)) from exc
            raise
        except BaseException:
            self.shutdown(graceful=False)
            raise

    @property
    def _started(self) -> list[Any]:
        """Processes started and not yet closed (a shutdown cut short may have closed some)."""
        started = []
        for process in self.processes:
            try:
                if process.pid is not None:
                    process.is_alive()  # ValueError once closed
                    started.append(process)
            except ValueError:
                pass
        return started


    def crash_error(self, worker_id: int, owed: list[tuple[int, Any]]) -> WorkerCrashedError:
        """The error for a dead worker; ``owed``: (idx, indices) of the batches it had."""
        process = self.processes[worker_id]
        join_exited([process], JOIN_TIMEOUT_S)  # the pipe can close a moment before the exit
        exitcode = process.exitcode
        loading = (" while loading " + ", ".join(f"batch idx={idx} (indices {indices!r})"
                                                  for idx, indices in owed)
                   if owed else " while idle")
        message = (f"DataLoader worker {worker_id} (pid {process.pid}) "
                   f"{describe_exit(exitcode, _running(process))}{loading}"
                   + (self.main_hint if exitcode == 1 and self.main_hint else
                      "; to see the failing sample's error, load those indices with "
                      "num_workers=0"))
        if exitcode == -signal.SIGBUS:
            message += (". A SIGBUS in a worker usually means shared memory ran out: check free "
                        "space in /dev/shm (docker run --shm-size=...) or lower `slots`")
        message += ". In torch's words: " + torch_crash_text(process.pid, exitcode)
        return WorkerCrashedError(message, worker_id=worker_id, pid=process.pid,
                                  exitcode=exitcode)

    def exited(self) -> list[int]:
        """The workers whose process has exited, by its exit status (as torch's liveness
        check reads it): a child that another thread forked while a worker started holds the
        write end of that worker's sentinel and result pipe, which then never show its exit."""
        gone = []
        for worker, process in enumerate(self.processes):
            try:
                if process.pid is not None and not _running(process):
                    gone.append(worker)
            except ValueError:
                pass  # closed by a shutdown in another thread
        return gone

    def shutdown(self, graceful: bool = True) -> None:
        """Stop every worker: join (they were asked to stop), terminate, kill; each step
        bounded. Idempotent. ``graceful=False`` (after a crash, when their work is discarded
        anyway) skips the wait."""
        with self._shutdown_lock:
            if self.closed:
                return
            try:
                self._shutdown(graceful)
            except BaseException:
                # Interrupted (Ctrl-C while joining): no worker may outlive the group, so
                # kill what is left at once, then let the interrupt go on.
                self._kill_now()
                raise
            finally:
                self.closed = True

    def _kill_now(self) -> None:
        for process in self._started:
            try:
                if _running(process):
                    process.kill()
                join_exited([process], JOIN_TIMEOUT_S)
            except (OSError, ValueError, AttributeError):
                pass  # already closed or reaped
        self._close_channels()

    def _close_channels(self) -> None:
        for conn in (*self.task_conns, *self.result_conns, *self.fd_sockets):
            conn.close()
        for process in self._started:
            try:
                reaped = process.exitcode is not None
                if not reaped and _unreaped(process):
                    continue
                # A worker killed (SIGKILL, our terminate) while it made a one-off segment
                # leaves that segment's name behind: only its reaper can remove it.
                remove_names_of(process.pid)
                if reaped:
                    process.close()
                else:
                    # Reaped by someone else (a program that sets SIGCHLD to SIG_IGN has the
                    # kernel reap its children): the exit status is lost, but the process is
                    # gone, so release its sentinel descriptor.
                    # Private: Process.close() refuses a process it could not reap, and
                    # nothing public closes the sentinel descriptor _popen holds.
                    process._popen.close()
            except (OSError, ValueError, AttributeError):
                pass

    def _shutdown(self, graceful: bool) -> None:
        for escalate in (None, "terminate", "kill") if graceful else ("terminate", "kill"):
            alive = [p for p in self._started if _unreaped(p)]
            if not alive:
                break
            if escalate is not None:
                for process in alive:
                    if _running(process):  # (not one that exited: its pid may be another's)
                        getattr(process, escalate)()
            join_exited(alive, JOIN_TIMEOUT_S)
        self._close_channels()


def join_exited(processes: list[Any], timeout: float) -> None:
    """Join ``processes``, all within ``timeout``, reading each one's exit status every
    ``EXIT_POLL_S``: a join waits on the sentinel, which never shows the exit while a child
    forked by another thread holds its write end (``WorkerGroup.exited``)."""
    deadline = time.monotonic() + timeout
    for process in processes:
        while _unreaped(process) and (remaining := deadline - time.monotonic()) > 0:
            process.join(timeout=min(remaining, EXIT_POLL_S))


def _running(process: Any) -> bool:
    """Not exited by its exit status, nor by its sentinel, and its pid still there: in a
    program that ignores SIGCHLD the kernel reaps it, the status is lost and ``is_alive()``
    stays True, and its pid may soon be another process's (which a signal of ours must not
    reach). The sentinel (a pipe whose only write end the worker held) reads as closed once
    it exited, whatever holds its pid; the pid is asked only where a child forked by another
    thread holds that write end too."""
    return process.is_alive() and not readable(process.sentinel, 0) \
        and pid_exists(process.pid)


def _unreaped(process: Any) -> bool:
    """Its exit status may still be read: running, or exited and not reaped by the kernel
    (the sentinel closes a moment before the exit status can be read). With SIGCHLD ignored
    the kernel reaps it at once: it is no child of ours then, whatever holds its pid."""
    if not process.is_alive():
        return False
    if not readable(process.sentinel, 0) or not hasattr(os, "waitid"):
        return pid_exists(process.pid)
    try:  # (WNOWAIT: its status is left for multiprocessing to read)
        os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def check_descriptor_limit(num_workers: int) -> None:
    """Fail before starting any worker when ``num_workers`` would run out of descriptors."""
    soft_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:
        return  # not Linux: the EMFILE itself is converted when it happens
    if soft_limit != resource.RLIM_INFINITY and \
            open_now + num_workers * FDS_PER_WORKER + FD_HEADROOM > soft_limit:
        raise descriptor_limit_error(num_workers, f"{open_now} are open already")


def descriptor_limit_error(num_workers: int, detail: str) -> DescriptorLimitError:
    soft_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    needed = num_workers * FDS_PER_WORKER + FD_HEADROOM
    return DescriptorLimitError(
        errno.EMFILE,
        f"num_workers={num_workers} needs about {needed} more file descriptors in this process, "
        f"but `ulimit -n` allows {soft_limit} ({detail}); raise the limit (`ulimit -n "
        f"{max(4096, 2 * soft_limit)}` in the shell, or resource.setrlimit(resource."
        "RLIMIT_NOFILE, ...)) or pass a smaller num_workers")


def worker_pipes(context: Any) -> tuple[Connection, Connection, Connection, Connection]:
    """A worker's private channels, enlarged: (task reader, task writer, result reader,
    result writer)."""
    task_reader, task_writer = context.Pipe(duplex=False)
    result_reader, result_writer = context.Pipe(duplex=False)
    _enlarge_pipe(task_writer)
    _enlarge_pipe(result_writer)
    return task_reader, task_writer, result_reader, result_writer


def fd_socket_pair() -> tuple[socket.socket, socket.socket]:
    """(main end, worker end) of the socket a worker passes segment descriptors over;
    datagram-like, so each descriptor arrives with its own tag."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def _enlarge_pipe(conn: Connection) -> None:
    try:
        fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, PIPE_NBYTES)
    except (OSError, AttributeError):
        pass  # not Linux, or above /proc/sys/fs/pipe-max-size: keep the default size


def is_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
