"""The slab: one POSIX shared-memory object holding every slot.

Created with posix_ipc, preallocated with ``os.posix_fallocate`` (so a full ``/dev/shm`` is
an error here, never a SIGBUS when a page is first touched mid-epoch), mapped with ``mmap``,
and its name unlinked before this constructor returns. Workers receive the open file
descriptor (inherited on fork, passed over the spawn/forkserver channel otherwise), so no name
exists that a killed process could leak (docs/design.md, "Slab").
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
from multiprocessing import reduction

import numpy as np
import posix_ipc

from .errors import ShmCapacityError

SHM_DIR = "/dev/shm"
NAME_PREFIX = "arena_loader_"


def shm_available_bytes() -> int:
    stats = os.statvfs(SHM_DIR)
    return stats.f_bavail * stats.f_frsize


def _capacity_error(nbytes: int, slots: int | None, cause: str) -> ShmCapacityError:
    available = shm_available_bytes()
    per_slot = f" ({slots} slots of {nbytes // slots:,} bytes)" if slots else ""
    return ShmCapacityError(
        errno.ENOSPC,
        f"the slab needs {nbytes:,} bytes{per_slot} of shared memory but {SHM_DIR} has "
        f"{available:,} bytes available ({cause}); fix: give the container more shared memory "
        "(docker run --shm-size=...), pass fewer `slots`, or use smaller batches",
    )


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
        return mmap.mmap(self.fd, self.nbytes if nbytes is None else nbytes)


def _rebuild_handle(dup_fd, nbytes: int) -> SlabHandle:
    return SlabHandle(dup_fd.detach(), nbytes)


class Slab:
    """The main process's side: creates, maps and (later) releases the shared memory.

    ``Slab(nbytes)`` allocates at once. ``Slab.reserve()`` makes the object with no space yet,
    so that workers can be started holding its descriptor before the layout is known;
    ``allocate(nbytes)`` then gives it its size, once.
    """

    def __init__(self, nbytes: int, *, slots: int | None = None):
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        self._create()
        self.allocate(nbytes, slots=slots)

    @classmethod
    def reserve(cls) -> Slab:
        slab = cls.__new__(cls)
        slab._create()
        return slab

    def _create(self) -> None:
        name = f"/{NAME_PREFIX}{os.getpid()}_{secrets.token_hex(6)}"
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600)
        # Nothing else opens the slab by name: unlinking now means no crash can leak it.
        shm.unlink()
        self._fd = shm.fd
        self._mmap: mmap.mmap | None = None
        self.nbytes = 0
        # Leases and consumer views keep this array (and so the mapping) alive.
        self.array: np.ndarray | None = None

    def allocate(self, nbytes: int, *, slots: int | None = None) -> None:
        """Give the slab its size and map it; a full ``/dev/shm`` is a ShmCapacityError."""
        if self.closed or self.nbytes:
            raise ValueError("the slab is closed or already allocated")
        try:
            if nbytes > shm_available_bytes():
                raise _capacity_error(nbytes, slots, "checked before allocating")
            try:
                os.posix_fallocate(self._fd, 0, nbytes)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                    cause = f"posix_fallocate: {exc.strerror}"
                    raise _capacity_error(nbytes, slots, cause) from exc
                raise
            self._mmap = mmap.mmap(self._fd, nbytes)
        except BaseException:
            self.close()
            raise
        self.nbytes = nbytes
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def handle(self) -> SlabHandle:
        if self.closed:
            raise ValueError("the slab is closed")
        return SlabHandle(self._fd, self.nbytes)

    def close(self) -> None:
        """Close the descriptor; the mapping goes away once no view of it is left."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
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
