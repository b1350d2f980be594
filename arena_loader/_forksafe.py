"""What a fork does to shared memory: a registry of live shared mappings and of the regions in
them that hold batches a user can see, and the ``os.register_at_fork`` hooks that act on it.

In a child forked from this process (``os.fork``, multiprocessing's ``fork``, ``Pool``, our own
fork-started workers):

- every registered *visible region* (a leased slot, later a one-off segment) is replaced, at the
  same address, by a private copy of its contents at the fork: the child's batches keep their
  values whatever the parent does with the slot afterwards;
- the rest of every registered *shared mapping* is replaced by an inaccessible private
  placeholder (``PROT_NONE``), so the child holds no reference to the parent's slabs (their
  memory is freed when the parent is done with them) and can never write into them.

The parent keeps the owners of the visible regions alive until the child says it has copied
them (one byte on a pipe, bounded by ``COPY_TIMEOUT_S``), so no slot leased at the fork is
refilled before the child's copy is taken (docs/design.md, "Fork safety").

Other code that maps shared memory holding user-visible data calls ``register_mapping`` for the
mapping (``_slab.map_shared`` does) and ``keep_across_fork`` for each region a user can see.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import signal
import socket
import threading
import time
import weakref
from typing import Any

import numpy as np

from ._leases import WeakEntries
from ._readable import readable

logger = logging.getLogger("arena_loader")

# The longest a parent waits, after a fork, for the child to copy the batches it can see.
# Copying runs at memory speed (about 1 ms per MiB); the bound only matters for a child whose
# at-fork hooks never run (then the pipe reads EOF at once) or hang.
COPY_TIMEOUT_S = 10.0

_PAGE_NBYTES = mmap.PAGESIZE
_PROT_NONE = 0
_MAP_FIXED = 0x10
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)  # fault the copy's pages in at once
_MREMAP_MAYMOVE = 1
_MREMAP_FIXED = 2
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.mremap.restype = ctypes.c_void_p
_libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int,
                         ctypes.c_void_p]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


class _Registry(WeakEntries):
    """Entries ``(owner, key)`` that last as long as their owner (``WeakEntries``: no lock,
    none to leave locked in a forked child). Owners that are closed (an mmap or a Slab) count
    as gone: the range or inode they named may already belong to something else. (A socket
    has no ``closed``: its ``fileno()`` is -1 once closed.)"""

    def live(self) -> list[tuple[Any, Any]]:
        return [(owner, key) for owner, key in self.items()
                if not getattr(owner, "closed", False)
                and not (isinstance(owner, socket.socket) and owner.fileno() == -1)]


# Shared mappings and visible regions: key (address, nbytes). Shared-memory objects held open
# by a descriptor: key (st_dev, st_ino).
_mappings = _Registry()
_regions = _Registry()
_objects = _Registry()
# Descriptors the thread about to fork hands to the child it starts (a worker's own slab).
_handed_over = threading.local()
# In a child: was it forked by a thread inside ``handing_over`` (a fork-started worker)?
_forked_as_worker = False
# Bumped in every forked child: an object made in generation g is used by its own process
# while ``generation()`` is g (one attribute read; os.getpid() is a system call).
_generation = 0


def generation() -> int:
    return _generation


class ProcessLock:
    """A re-entrant lock of the process that takes it: a forked child's first ``with`` makes
    it a new one. (A lock that another thread of the parent held at the fork is held for good
    in the child, where that thread does not exist: its state_dict(), load_state_dict() or
    copy of the loader waited for ever.)"""

    __slots__ = ("_generation", "_lock")

    def __init__(self) -> None:
        self._lock, self._generation = threading.RLock(), _generation

    def __enter__(self) -> threading.RLock:
        if self._generation != _generation:
            self._lock, self._generation = threading.RLock(), _generation
        lock = self._lock
        lock.acquire()
        return lock

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

# Per thread (two threads may fork at once; only the forking thread survives in the child),
# set between the before-fork and after-fork hooks: (pinned owners, pipe read fd, write fd).
_forking = threading.local()


def register_descriptor(owner: Any, fd: int) -> None:
    """``fd`` (held open by ``owner``, e.g. a ``Slab`` or the ``mmap.mmap`` that dup'ed it)
    refers to shared memory, or to a pipe whose both ends this process holds (a thread
    worker's): a forked child does not keep that object alive (or the pipe open) through it."""
    stats = os.fstat(fd)
    _objects.add(owner, (stats.st_dev, stats.st_ino))


@contextlib.contextmanager
def handing_over(fds: list[int]):
    """A child forked by this thread inside the block keeps ``fds`` (e.g. the slab descriptor
    a fork-started worker maps); other shared-memory descriptors are released there."""
    _handed_over.fds = frozenset(fds)
    try:
        yield
    finally:
        _handed_over.fds = frozenset()


@contextlib.contextmanager
def interrupts_deferred(in_finalizer: bool = False):
    """A Ctrl-C while a worker process starts is raised once it has started, not inside the
    start. During a fork, the main thread's next Python code is in the at-fork hooks (ours,
    logging's), where Python swallows what the SIGINT handler raises ("Exception ignored in"):
    the Ctrl-C was lost, and the training loop went on. And a child forked just as it arrived
    could raise it before its bootstrap and run the caller's code as a second process
    (CPython's race: torch's workers have it too). Inside this block the handler only records
    the signal (a forked child inherits that handler until ``worker_main`` ignores SIGINT); the
    caller's own handler gets it at the end. In another thread there is nothing to do: the
    handler runs in the main thread, outside this thread's hooks. ``in_finalizer``: the block
    is in a finalizer, where what the handler raises would be swallowed too (and so would a
    signal sent again at once: CPython runs a pending handler at the finalizer's next line),
    so another thread sends it once the finalizer has returned (``redeliver``)."""
    caught: list[Any] = []
    previous = None
    # (None: a handler set outside Python, which could not be put back; it is left alone)
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is not None):
        with contextlib.suppress(ValueError):  # (not the main interpreter)
            previous = signal.signal(signal.SIGINT, lambda _signum, frame: caught.append(frame))
    try:
        yield
    finally:
        if previous is not None:
            later = bool(caught) and in_finalizer and callable(previous)
            # (in place before the re-send's thread starts: it may send at once)
            signal.signal(signal.SIGINT, outside_finalizers(previous) if later else previous)
            if later:
                try:
                    redeliver()
                except BaseException:  # (no thread at interpreter exit)
                    signal.signal(signal.SIGINT, previous)
                    raise
            if caught and not later:
                if callable(previous):
                    previous(signal.SIGINT, caught[0])  # (the default raises KeyboardInterrupt)
                elif previous == signal.SIG_DFL:
                    os.kill(os.getpid(), signal.SIGINT)


REDELIVER_DELAY_S = 0.001
_FINALIZE_CALL = weakref.finalize.__call__.__code__


def redeliver() -> None:
    """A SIGINT for the main thread from another thread, a moment later (still in a finalizer
    then, ``outside_finalizers`` sends it on). A signal, not ``_thread.interrupt_main()``,
    which interrupts no blocking call: a main thread already waiting (``next()`` for a slow
    batch, a ``sleep``) got its KeyboardInterrupt only once the wait ended (2 s into a 2 s
    sleep, against 0.1 s)."""
    main = threading.main_thread().ident
    threading.Timer(REDELIVER_DELAY_S, signal.pthread_kill, (main, signal.SIGINT)).start()


def outside_finalizers(previous: Any) -> Any:
    """SIGINT's handler while a finalizer's Ctrl-C is sent again: ``previous``'s once the main
    thread is outside every finalizer, sent again a moment later while it is in one (where
    what a handler raises is swallowed). A fixed 1 ms lost it when the main thread was
    descheduled for longer (a busy machine): it came while the finalizer still ran."""
    def handler(signum: int, frame: Any) -> None:
        inner = frame
        while inner is not None and inner.f_code is not _FINALIZE_CALL:
            inner = inner.f_back
        if inner is not None:
            redeliver()
            return
        signal.signal(signal.SIGINT, previous)
        previous(signum, frame)
    return handler


def register_mapping(owner: Any, address: int, nbytes: int) -> None:
    """A shared mapping at ``address`` (``nbytes`` long), live as long as ``owner`` (usually
    the ``mmap.mmap`` itself). A forked child keeps only the parts of it registered with
    ``keep_across_fork``; the rest becomes inaccessible there."""
    _mappings.add(owner, (address, nbytes))


def keep_across_fork(owner: Any, address: int, nbytes: int) -> None:
    """The ``nbytes`` at ``address`` hold data a user can see (a batch) for as long as
    ``owner`` lives: a child forked meanwhile gets a private copy of them, taken at the fork,
    at the same address. The parent keeps ``owner`` alive until that copy is taken. For a
    numpy view: ``keep_across_fork(owner, view.ctypes.data, view.nbytes)``."""
    if nbytes:
        _regions.add(owner, (address, nbytes))


def kept_regions() -> list[tuple[Any, tuple[int, int]]]:
    """What ``keep_across_fork`` holds now: (owner, (address, nbytes)) for each live owner."""
    return _regions.live()


def mapping_address(mapping: mmap.mmap) -> int:
    return np.frombuffer(mapping, dtype=np.uint8, count=1).ctypes.data


def _page_span(address: int, nbytes: int) -> tuple[int, int]:
    start = address - address % _PAGE_NBYTES
    end = -(-(address + nbytes) // _PAGE_NBYTES) * _PAGE_NBYTES
    return start, end


def _merged_spans(regions: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Page spans covering ``(address, nbytes)`` regions, sorted, overlaps merged."""
    spans: list[tuple[int, int]] = []
    for start, end in sorted(_page_span(address, nbytes) for address, nbytes in regions):
        if spans and start <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(end, spans[-1][1]))
        else:
            spans.append((start, end))
    return spans


def _check(result: int | None, what: str) -> int:
    if result is None or result == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def _make_private(start: int, end: int) -> None:
    """Replace [start, end) by a private copy of its current contents, at the same address."""
    nbytes = end - start
    copy = _check(_libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE,
                             mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_POPULATE, -1, 0), "mmap")
    ctypes.memmove(copy, start, nbytes)
    # mremap moves the copy's pages over the shared ones in one step: no moment exists at which
    # the address reads anything but the batch.
    moved = _libc.mremap(copy, nbytes, nbytes, _MREMAP_MAYMOVE | _MREMAP_FIXED, start)
    if moved is None or moved == _MAP_FAILED:
        _libc.munmap(copy, nbytes)
        _check(moved, "mremap")


def _make_inaccessible(start: int, end: int) -> None:
    """Drop the shared pages of [start, end) but keep the address range reserved: the mmap
    object that owns it still unmaps it later, which must not hit an unrelated mapping."""
    _check(_libc.mmap(start, end - start, _PROT_NONE,
                      mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED
                      | getattr(mmap, "MAP_NORESERVE", 0x4000), -1, 0), "mmap PROT_NONE")


def _privatize_in_child() -> None:
    visible = _merged_spans([region for _, region in _regions.live()])
    for start, end in visible:
        _make_private(start, end)
    for _, (address, nbytes) in _mappings.live():
        cursor, stop = _page_span(address, nbytes)
        for start, end in visible:
            if end <= cursor or start >= stop:
                continue
            if start > cursor:
                _make_inaccessible(cursor, start)
            cursor = max(cursor, end)
        if cursor < stop:
            _make_inaccessible(cursor, stop)
    # Everything registered is private to this process now: a fork from here copies it.
    _regions.clear()
    _mappings.clear()


def _release_inherited_descriptors() -> None:
    """Point every inherited descriptor of a registered shared-memory object (but those handed
    over) at /dev/null: the number stays valid for whoever closes it later (the parent's
    Slab or mmap objects copied here), while the object is no longer held by this child."""
    objects = {key for _, key in _objects.live()}
    _objects.clear()
    if not objects:
        return
    keep = getattr(_handed_over, "fds", frozenset())
    devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd == devnull or fd in keep:
                continue
            try:
                stats = os.fstat(fd)
            except OSError:
                continue  # the listing's own descriptor, already closed
            if (stats.st_dev, stats.st_ino) in objects:
                os.dup2(devnull, fd, inheritable=False)
    finally:
        os.close(devnull)


def _before_fork() -> None:
    _forking.state = None
    owners = [owner for owner, _ in _regions.live()]
    if owners:
        read_fd, write_fd = os.pipe()
        _forking.state = (owners, read_fd, write_fd)


def _after_fork_in_parent() -> None:
    state, _forking.state = getattr(_forking, "state", None), None
    if state is None:
        return
    _, read_fd, write_fd = state
    os.close(write_fd)  # the child's copy is then the only writer: its exit reads as EOF
    try:
        deadline = time.monotonic() + COPY_TIMEOUT_S
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                if readable(read_fd, remaining):
                    os.read(read_fd, 1)
                    return
            except InterruptedError:
                continue
        logger.warning("a forked child did not copy its batches within %s s; the slots it "
                       "may still read can be reused", COPY_TIMEOUT_S)
    finally:
        os.close(read_fd)  # and the pinned owners go with the state


def started_by_fork() -> bool:
    """In a worker: was it forked from the main process (rather than spawned, or forked by
    the forkserver)? Only then is what it inherited exactly the main process's."""
    return _forked_as_worker


def close_on_exec_inherited() -> None:
    """Mark every descriptor above stderr close-on-exec: a spawn or forkserver child receives
    multiprocessing's pipes inheritable, and a program that user code execs (os.system) would
    hold them, keeping the parent from seeing this process's exit."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2:
            try:
                os.set_inheritable(fd, False)
            except OSError:
                pass  # the listing's own descriptor, closed by now


def _after_fork_in_child() -> None:
    global _forked_as_worker, _generation
    _generation += 1
    _forked_as_worker = bool(getattr(_handed_over, "fds", None))
    state, _forking.state = getattr(_forking, "state", None), None
    try:
        _privatize_in_child()
        _release_inherited_descriptors()
    except BaseException:  # an at-fork hook must not raise; the child goes on without it
        logger.exception("arena_loader could not make this forked child's batches private")
    finally:
        if state is not None:
            _, read_fd, write_fd = state
            try:
                try:
                    os.write(write_fd, b"\0")
                except OSError:
                    pass
            finally:  # (even if interrupted: the parent then reads EOF, not a 10 s wait)
                os.close(write_fd)
                os.close(read_fd)


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)
