"""The slab: one POSIX shared-memory object holding every slot.

Created with posix_ipc, its pages reserved with ``os.posix_fallocate`` before anything is
written to them (so a full ``/dev/shm`` is an error, never a SIGBUS when a page is first
touched mid-epoch): all at once, or with ``lazy=True`` part by part (``back``, an arena's
slots as they are first used), mapped with ``mmap``, and its name unlinked before this
constructor returns. Workers receive the open file
descriptor (inherited on fork, passed over the spawn/forkserver channel otherwise), so a name
exists only for the microseconds between creating and unlinking it; a worker SIGKILLed inside
that window leaves it to the main process, which removes a reaped worker's names
(``remove_names_of``; docs/design.md, "Slab").

Every shared mapping is made by ``map_shared`` (errors become ``ShmCapacityError``) and
registered with ``_forksafe``, so that a forked child keeps private copies of the batches it
can see and drops the rest (docs/design.md, "Fork safety").
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import weakref
from multiprocessing import reduction

import numpy as np
import posix_ipc

from . import _forksafe
from ._shm_errors import FIXES, SEGMENT_SPACE_FIX, SPACE_FIX, errno_of
from .errors import ShmCapacityError

SHM_DIR = "/dev/shm"
NAME_PREFIX = "arena_loader_"


def shm_available_bytes() -> int:
    stats = os.statvfs(SHM_DIR)
    return stats.f_bavail * stats.f_frsize


def shm_available_inodes() -> int:
    return os.statvfs(SHM_DIR).f_favail


def _capacity_error(nbytes: int, slots: int | None, cause: str,
                    err: int = errno.ENOSPC, what: str = "the slab") -> ShmCapacityError:
    per_slot = f" ({slots} slots of {nbytes // slots:,} bytes)" if slots else ""
    fix = FIXES.get(err, SPACE_FIX)
    if err == errno.ENOSPC and what == SEGMENT:
        fix = SEGMENT_SPACE_FIX
    if err == errno.ENOSPC:
        return ShmCapacityError(
            err, f"{what} needs {nbytes:,} bytes{per_slot} of shared memory but {SHM_DIR} "
                 f"has {shm_available_bytes():,} bytes available ({cause}); fix: {fix}")
    return ShmCapacityError(
        err, f"{what} needs {nbytes:,} bytes{per_slot} of shared memory, but {cause}; "
             f"fix: {fix}")


CREATE_NEW = posix_ipc.O_CREX


def open_shared(tag: str = "") -> int:
    """A new, already unlinked POSIX shared-memory object of size 0: its close-on-exec
    descriptor. Any failure (no inode left in /dev/shm, no descriptor left) is a
    ShmCapacityError. ``tag`` goes into the name (``/proc/<pid>/maps`` shows what it is)."""
    if shm_available_inodes() == 0:
        raise ShmCapacityError(
            errno.ENOSPC, f"{SHM_DIR} has no free inode left for a shared-memory object (it "
                          f"holds {os.statvfs(SHM_DIR).f_files:,}); fix: delete stale files in "
                          f"{SHM_DIR}, or remount it with more inodes (mount -o "
                          "remount,nr_inodes=...)")
    name = f"/{NAME_PREFIX}{os.getpid()}_{tag}{secrets.token_hex(6)}"
    try:
        # Created, unlinked and returned in one statement: no line of Python runs between
        # the steps (nothing else opens it by name; shm_open sets close-on-exec, so a program
        # exec'd by user code does not hold it). One line, too: a trace function's line
        # event at a continuation line's return escapes this try (CPython 3.11).
        return (shm := posix_ipc.SharedMemory(name, CREATE_NEW, mode=0o600)).unlink() or shm.fd
    except (OSError, posix_ipc.Error) as exc:
        err = errno_of(exc) if isinstance(exc, OSError) else errno.EACCES
        raise ShmCapacityError(err, f"creating a shared-memory object in {SHM_DIR} failed "
                                    f"({exc}); fix: {FIXES.get(err, SPACE_FIX)}") from exc
    except BaseException:
        # Python runs a signal handler once a C call returns, so Ctrl-C can still land inside
        # that statement, after shm_open and before the unlink: the name goes here, and the
        # descriptor, which no variable may hold yet, is found by its name. A process
        # SIGKILLed there leaves the name to its reaper: ``remove_names_of``.
        _unlink(name)
        _close_descriptors_of(name)
        raise


def _close_descriptors_of(name: str) -> None:
    target = f"{SHM_DIR}{name}"
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") in (target, f"{target} (deleted)"):
                os.close(int(fd))
        except OSError:
            pass  # closed meanwhile (the listing's own descriptor)


def _unlink(name: str) -> None:
    try:
        posix_ipc.unlink_shared_memory(name)
    except (posix_ipc.ExistentialError, posix_ipc.PermissionsError):
        pass  # never created, or already removed (by a reaper: ``remove_names_of``)


def remove_names_of(pid: int) -> None:
    """Remove the shared-memory names that process ``pid``, now dead, left in /dev/shm: it
    unlinks each name within microseconds of creating it (``open_shared``), but a SIGKILL
    can land in between, and nothing else would ever remove the name. Only for a process
    the caller has reaped: a live one's name is in use."""
    prefix = f"{NAME_PREFIX}{pid}_"
    try:
        names = [name for name in os.listdir(SHM_DIR) if name.startswith(prefix)]
    except OSError:
        return
    for name in names:
        _unlink("/" + name)


def size_shared(fd: int, nbytes: int, slots: int | None = None,
                what: str = "the slab", reserve: bool = True) -> None:
    """Give ``fd`` its size. ``reserve``: every page now (``back_shared``), so a full
    /dev/shm is a ShmCapacityError here and never a SIGBUS when a page is first written;
    otherwise only the size (``ftruncate``), after checking that /dev/shm has room for all of
    it, and the owner reserves each part before its first write. ``what`` names it in
    errors."""
    if nbytes > shm_available_bytes():
        raise _capacity_error(nbytes, slots, "checked before allocating", what=what)
    if reserve:
        back_shared(fd, 0, nbytes, slots, what)
        return
    try:
        os.ftruncate(fd, nbytes)
    except OSError as exc:  # EFBIG under RLIMIT_FSIZE
        raise _capacity_error(nbytes, slots, f"ftruncate: {exc.strerror}", errno_of(exc),
                              what=what) from exc


def back_shared(fd: int, start: int, nbytes: int, slots: int | None = None,
                what: str = "the slab") -> None:
    """Reserve the pages of ``nbytes`` bytes of ``fd`` from ``start``: a full ``/dev/shm``
    is a ShmCapacityError naming ``what``, never a SIGBUS at the first write."""
    try:
        os.posix_fallocate(fd, start, nbytes)
    except OSError as exc:
        raise _capacity_error(nbytes, slots, f"posix_fallocate: {exc.strerror}",
                              errno_of(exc), what=what) from exc


def map_shared(fd: int, nbytes: int, slots: int | None = None,
               what: str = "the slab") -> mmap.mmap:
    """Map ``nbytes`` of shared memory ``fd``; every failure (ENOMEM under RLIMIT_AS, ...) is
    a ShmCapacityError. The mapping is registered with ``_forksafe`` (a forked child drops
    what of it no batch it holds needs)."""
    try:
        mapping = mmap.mmap(fd, nbytes)
    except OSError as exc:
        raise _capacity_error(nbytes, slots, f"mmap: {exc.strerror}", errno_of(exc),
                              what=what) from exc
    _forksafe.register_mapping(mapping, _forksafe.mapping_address(mapping), nbytes)
    _forksafe.register_descriptor(mapping, fd)  # mmap holds a duplicate of fd
    return mapping


class SlabHandle:
    """What a worker needs to map the slab: an open descriptor and the size.

    ``nbytes`` is 0 for a slab reserved before the first batch's layout is known; the worker
    then keeps the descriptor and maps it when told the size (docs/design.md, "Data flow").
    Pickling it (spawn / forkserver) duplicates the descriptor into the child through
    multiprocessing's fd passing; under fork the descriptor is simply inherited.
    """

    def __init__(self, fd: int, nbytes: int):
        self.fd = fd
        self.nbytes = nbytes

    def __reduce__(self):
        return _rebuild_handle, (reduction.DupFd(self.fd), self.nbytes)

    def map(self, nbytes: int | None = None) -> mmap.mmap:
        return map_shared(self.fd, self.nbytes if nbytes is None else nbytes)


def _rebuild_handle(dup_fd, nbytes: int) -> SlabHandle:
    fd = dup_fd.detach()
    os.set_inheritable(fd, False)  # received inheritable; a program exec'd must not hold it
    return SlabHandle(fd, nbytes)


class Slab:
    """The main process's side: creates, maps and (later) releases the shared memory.

    ``Slab(nbytes)`` allocates at once. ``Slab.reserve()`` makes the object with no space yet,
    so that workers can be started holding its descriptor before the layout is known;
    ``allocate(nbytes)`` then gives it its size, once.
    """

    def __init__(self, nbytes: int, *, slots: int | None = None, lazy: bool = False):
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        self._create()
        self.allocate(nbytes, slots=slots, lazy=lazy)

    @classmethod
    def reserve(cls) -> Slab:
        slab = cls.__new__(cls)
        slab._create()
        return slab

    def _create(self) -> None:
        # The descriptor is closed with the object if close() never runs (a Slab dropped by
        # an interrupted claim): made and handed to its finalizer in one statement.
        self._fd_closer = weakref.finalize(self, os.close, fd := open_shared())
        self._fd_closer.atexit = False
        self._fd = fd
        _forksafe.register_descriptor(self, self._fd)
        self._mmap: mmap.mmap | None = None
        self.nbytes = 0
        # Leases and consumer views keep this array (and so the mapping) alive.
        self.array: np.ndarray | None = None

    def allocate(self, nbytes: int, *, slots: int | None = None, lazy: bool = False) -> None:
        """Give the slab its size and map it; a full ``/dev/shm`` is a ShmCapacityError.
        ``lazy``: check that ``/dev/shm`` has room for all of it, but reserve no page yet;
        the owner reserves each part before its first write (``back``). Allocating it again
        at the same size does nothing (a claim that an interrupt cut short is made again)."""
        if not self.closed and self.nbytes == nbytes:
            return
        if self.closed or self.nbytes:
            raise ValueError("the slab is closed or already allocated")
        try:
            size_shared(self._fd, nbytes, slots, reserve=not lazy)
            mapping = map_shared(self._fd, nbytes, slots)
        except Exception:  # no room: the slab is no use (an interrupt leaves it reserved)
            self.close()
            raise
        # One statement: interrupted before it, the mapping is dropped and a retry remaps.
        self._mmap, self.nbytes, self.array = mapping, nbytes, np.frombuffer(mapping, np.uint8)

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def back(self, start: int, nbytes: int, what: str = "the slab") -> None:
        """Reserve the pages of ``[start, start + nbytes)`` now (see ``allocate(lazy=True)``);
        done again, it changes nothing."""
        if self.closed:
            raise ValueError("the slab is closed")
        back_shared(self._fd, start, nbytes, what=what)

    def handle(self) -> SlabHandle:
        if self.closed:
            raise ValueError("the slab is closed")
        return SlabHandle(self._fd, self.nbytes)

    def close(self) -> None:
        """Close the descriptor; the mapping goes away once no view of it is left."""
        if self._fd >= 0:
            self._fd = -1
            self._fd_closer()  # closes it, once
        # The mmap cannot be closed while views exist (BufferError); dropping our references
        # lets the last view unmap it. Closing it under a live view would turn reads into
        # segfaults.
        self.array = None  # type: ignore[assignment]
        mapping, self._mmap = self._mmap, None
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:
                pass  # views remain: they hold the mmap, which unmaps when the last one dies


class Segment:
    """A one-off shared-memory segment for one batch that has no slot or does not fit one.

    Created, unlinked at once and preallocated like the slab (``open_shared``,
    ``size_shared``, ``map_shared``: a full ``/dev/shm`` or any other OS limit is a
    ShmCapacityError, never a SIGBUS). A worker hands its descriptor to the main process with
    ``send_segment``, which maps it as the batch's storage (docs/design.md, "Slot budget").
    """

    def __init__(self, nbytes: int):
        self.nbytes = max(nbytes, 1)
        self.fd = -1
        try:  # the descriptor closed on any failure, Ctrl-C included
            self.fd = open_shared()
            size_shared(self.fd, self.nbytes, what=SEGMENT)
            self._mmap = map_shared(self.fd, self.nbytes, what=SEGMENT)
        except BaseException:
            if self.fd >= 0:
                os.close(self.fd)
            raise
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)

    def close_fd(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        """Close the descriptor and this process's mapping (the receiver has its own)."""
        self.close_fd()
        self.array = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:
            pass  # a view escaped (the dataset kept its read_into output): unmapped with it


SEGMENT = "a batch's shared-memory segment"


def map_new_segment(nbytes: int) -> np.ndarray:
    """A segment made and mapped in this process (``num_workers=0``, thread workers)."""
    # One statement: the mapping (the array's base) keeps the memory, the descriptor goes.
    return (segment := Segment(nbytes)).close_fd() or segment.array
