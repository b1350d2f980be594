"""Fresh interpreters for the tests, forked from a warm one: ``run`` stands in for
``subprocess.run([sys.executable, ...])`` where a test needs a process of its own (its
descriptors, signals and interpreter exit) but not a cold start.

A cold start imports what the warm one has imported already: numpy and arena_loader (~0.6 s
of CPU on the 2-core machine), torch (~3 s more, and ~2.3 s for torch._dynamo, which the
first optimizer made imports, torch.optim imported or not), numba's CUDA simulator (~0.8 s).
The suite ran ~40 such interpreters. The warm one (one per pytest process and kind:
``preload`` and the environment variables read at import) forks a child per call; the child
takes the call's argv, environment, working directory and output files, runs it as
``python`` would run it (``-c``, ``-m`` or a script, as ``__main__``) and exits through the
interpreter's own exit (atexit handlers and finalizers run), with the status ``python``
would give. What differs from a cold start is only what is imported
already, so a test that checks what an import does (torch imported or not, numba's CUDA
loaded or not) keeps its own ``subprocess.run``.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Read at import by what the warm interpreter preloads (numba's simulator switch, the OpenMP
# thread count torch's pool takes): part of the interpreter's kind, not set per call.
IMPORT_TIME_ENV = ("NUMBA_ENABLE_CUDASIM", "OMP_NUM_THREADS")
_TESTS = ("numpy", "arena_loader", "tests.datasets", "tests.test_faults")
PRELOADS = {
    "base": _TESTS,
    "torch": (*_TESTS, "torch", "torch.nn", "torch.optim", "torch.utils.data", "torch._dynamo"),
    "sim": (*_TESTS, "numba.cuda"),  # with NUMBA_ENABLE_CUDASIM=1: the simulator
}
_WARM: dict[tuple, subprocess.Popen] = {}


def warm_pids() -> set[int]:
    """The warm interpreters' pids: children of the test process that no test leaked."""
    return {proc.pid for proc in _WARM.values() if proc.poll() is None}


def run(args: list[str], *, timeout: float, preload: str = "base", env: dict | None = None,
        cwd: str | os.PathLike | None = None,
        start_new_session: bool = False) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *args], capture_output=True, text=True, ...)``, in a
    child of a warm interpreter that imported ``PRELOADS[preload]``; the result's ``pid`` is
    the child's. Raises ``subprocess.TimeoutExpired`` (the child killed) past ``timeout``
    seconds."""
    env = dict(os.environ if env is None else env)
    key = (preload, tuple((name, env.get(name)) for name in IMPORT_TIME_ENV))
    warm = _WARM.get(key)
    if warm is None or warm.poll() is not None:
        warm = _WARM[key] = _start(key, env)
    with tempfile.TemporaryDirectory(prefix="zygote-") as scratch:
        out, err = Path(scratch, "out"), Path(scratch, "err")
        request = {"args": list(args), "env": env, "cwd": str(cwd or os.getcwd()),
                   "out": str(out), "err": str(err), "setsid": start_new_session}
        child = None
        try:
            warm.stdin.write(json.dumps(request).encode() + b"\n")
            warm.stdin.flush()
            child = _reply(warm, 30.0)["pid"]
            reply = _reply(warm, timeout)
            if reply is None:  # past the timeout: killed, then reaped by the warm one
                os.kill(child, signal.SIGKILL)
                _reply(warm, 10.0)
                raise subprocess.TimeoutExpired([sys.executable, *args], timeout,
                                                out.read_text(), err.read_text())
            done = subprocess.CompletedProcess([sys.executable, *args], reply["status"],
                                               out.read_text(), err.read_text())
            done.pid = child
            return done
        except BaseException:
            # Anything else (an interrupt, the test's own timeout): the warm one may be
            # mid-call, so it goes, with its child; the next call starts another.
            if child is not None:
                with contextlib.suppress(OSError, ValueError):
                    os.kill(child, signal.SIGKILL)
            _stop(key)
            raise


def stop_all() -> None:
    for key in list(_WARM):
        _stop(key)


def _start(key: tuple, env: dict) -> subprocess.Popen:
    preload, import_env = key
    warm_env = {**env, **{name: value for name, value in import_env if value is not None}}
    for name, value in import_env:
        if value is None:
            warm_env.pop(name, None)
    warm_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO),
                                                          warm_env.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        [sys.executable, "-u", __file__, *PRELOADS[preload]], cwd=REPO, env=warm_env,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    proc.lines = bytearray()  # what was read of its replies past the last whole line
    ready = _reply(proc, 120.0)
    assert ready == {"ready": True}, ready
    return proc


def _stop(key: tuple) -> None:
    proc = _WARM.pop(key, None)
    if proc is None:
        return
    with contextlib.suppress(OSError, ValueError):
        proc.stdin.close()  # (its loop ends at EOF)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.stdout.close()


def _reply(proc: subprocess.Popen, timeout: float) -> dict | None:
    """The warm interpreter's next line, or None past ``timeout`` (read from the descriptor:
    a buffered reader would keep a second line where select cannot see it)."""
    deadline = time.monotonic() + timeout
    fd = proc.stdout.fileno()
    while b"\n" not in proc.lines:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        if select.select([fd], [], [], left)[0]:
            data = os.read(fd, 4096)
            if not data:
                raise RuntimeError(f"the warm interpreter (pid {proc.pid}) exited")
            proc.lines += data
    line, _, rest = bytes(proc.lines).partition(b"\n")
    proc.lines[:] = rest
    return json.loads(line)


# -- the warm interpreter -------------------------------------------------------------------

def _serve(preloads: list[str]) -> dict:
    """Import ``preloads``, then fork a child per request line; report each child's pid, then
    its exit status. Returns (in the child only) the request it is to run."""
    import gc
    import importlib

    for name in preloads:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()  # (as conftest does: a child's collections walk only what it makes)
    from tests import hugepages

    hugepages.collapse()  # (as conftest does: cheaper forks, tests/hugepages.py)
    write = sys.stdout.write
    write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            return request
        write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        write(json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n")
    os._exit(0)


def _become(request: dict) -> None:
    """In the child: take the request's descriptors, environment and directory, and run it
    as ``python *args`` runs it (an exception propagates: the interpreter prints it and
    exits with 1)."""
    import runpy
    import types

    if request["setsid"]:
        os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    err = os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for fd, target in ((null, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    args = request["args"]
    if args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        main = types.ModuleType("__main__")  # no __file__: spawn imports nothing for it
        sys.modules["__main__"] = main
        sys.path[0] = ""
        exec(compile(args[1], "<string>", "exec"), main.__dict__)
    elif args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        sys.path[0] = str(Path(args[0]).resolve().parent)
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    _become(_serve(sys.argv[1:]))
