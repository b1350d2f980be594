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
import socket
import struct
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


class Segment:
    """A one-off shared-memory segment for one batch that has no slot or does not fit one.

    Created, unlinked at once and preallocated like the slab (a full ``/dev/shm`` is a
    ShmCapacityError, never a SIGBUS); its descriptor is handed to the main process with
    ``send_segment``, which maps it as the batch's storage (docs/design.md, "Slot budget").
    """

    def __init__(self, nbytes: int):
        self.nbytes = max(nbytes, 1)
        name = f"/{NAME_PREFIX}{os.getpid()}_{secrets.token_hex(6)}"
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600)
        shm.unlink()
        self.fd = shm.fd
        try:
            if self.nbytes > shm_available_bytes():
                raise _segment_error(self.nbytes, "checked before allocating")
            try:
                os.posix_fallocate(self.fd, 0, self.nbytes)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                    raise _segment_error(self.nbytes, f"posix_fallocate: {exc.strerror}") from exc
                raise
            self._mmap = mmap.mmap(self.fd, self.nbytes)
        except BaseException:
            os.close(self.fd)
            raise
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)

    def close(self) -> None:
        """Close the descriptor and this process's mapping (the receiver has its own)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.array = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:
            pass  # a view escaped (the dataset kept its read_into output): unmapped with it


def _segment_error(nbytes: int, cause: str) -> ShmCapacityError:
    return ShmCapacityError(
        errno.ENOSPC,
        f"a batch needs a {nbytes:,}-byte shared-memory segment but {SHM_DIR} has "
        f"{shm_available_bytes():,} bytes available ({cause}); fix: give the container more "
        "shared memory (docker run --shm-size=...), use smaller batches, or hold fewer batches "
        "(keep copies: np.array(x) / x.clone())",
    )


_FD_TAG = struct.Struct("<q")


def send_segment(sock: socket.socket, idx: int, segment: Segment) -> None:
    """Pass the segment's descriptor to the main process, tagged with its batch ``idx``."""
    socket.send_fds(sock, [_FD_TAG.pack(idx)], [segment.fd])


def receive_segment(sock: socket.socket, idx: int, nbytes: int) -> np.ndarray:
    """Map the segment a worker sent for batch ``idx``: its bytes, as an array whose base owns
    the mapping (unmapped when the last view of the batch dies). Descriptors left over from
    a batch the worker failed to report are closed on the way."""
    while True:
        data, fds, _, _ = socket.recv_fds(sock, _FD_TAG.size, 1)
        if not fds:
            raise EOFError("the worker's descriptor socket closed")
        fd = fds[0]
        try:
            if len(data) == _FD_TAG.size and _FD_TAG.unpack(data)[0] == idx:
                return np.frombuffer(mmap.mmap(fd, max(nbytes, 1)), dtype=np.uint8)
        finally:
            os.close(fd)


def map_new_segment(nbytes: int) -> np.ndarray:
    """A segment made and mapped in this process (``num_workers=0``, thread workers)."""
    segment = Segment(nbytes)
    try:
        return np.frombuffer(mmap.mmap(segment.fd, segment.nbytes), dtype=np.uint8)
    finally:
        segment.close()
