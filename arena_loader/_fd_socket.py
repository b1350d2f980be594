"""Descriptors over a worker's socket (a ``SOCK_SEQPACKET`` pair per worker, one message per
descriptor, each tagged): a one-off segment's, from the worker to the main process
(``send_segment`` / ``SegmentReceiver``), and a grown slab's, from the main process to its
persistent workers (``send_slab`` / ``receive_slab``)."""

from __future__ import annotations

import array
import functools
import os
import socket
import struct
from collections import deque

import numpy as np

from ._slab import SEGMENT, Segment, Slab, map_shared

_FD_TAG = struct.Struct("<q")
_FD_BYTES = array.array("i").itemsize  # one descriptor per message


def send_segment(sock: socket.socket, idx: int, segment: Segment) -> None:
    """Pass the segment's descriptor to the main process, tagged with its batch ``idx``."""
    socket.send_fds(sock, [_FD_TAG.pack(idx)], [segment.fd])


def send_slab(sock: socket.socket, generation: int, slab: Slab) -> None:
    """Pass a grown slab's descriptor to a worker (the main process's end of its socket),
    tagged with its ``generation``; an ATTACH entry naming that generation follows."""
    socket.send_fds(sock, [_FD_TAG.pack(generation)], [slab.handle().fd])


def receive_slab(sock: socket.socket, generation: int) -> int:
    """A worker: the descriptor of slab ``generation`` (sent before its ATTACH entry). One
    sent again after an interrupt, or of an older generation, is closed on the way."""
    while True:
        data, fds, _flags, _address = socket.recv_fds(sock, _FD_TAG.size, 1)
        if not data and not fds:
            raise EOFError("the main process's descriptor socket closed")
        tag = _FD_TAG.unpack(data)[0] if len(data) == _FD_TAG.size else None
        if tag == generation and fds:
            return fds[0]
        for fd in fds:
            os.close(fd)


class SegmentReceiver:
    """The main process's end of one worker's descriptor socket. Each received descriptor is
    kept (``received``) until its batch has taken its mapping (``forget``), so an interrupt
    anywhere in between loses no segment, and asking again for a batch never waits for a
    descriptor already taken off the socket. A message is taken off the socket by C alone
    (``deque.extend`` over ``recvmsg``): CPython handles a signal as a call into C returns,
    and one handled as ``socket.recv_fds``'s ``recvmsg`` returned dropped the descriptor, so
    the next ``next()`` waited for it forever (a chaos soak's seed 1186)."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._raw: deque[tuple] = deque()  # recvmsg's results, not yet parsed
        self.received: deque[tuple[bytes, list[int]]] = deque()
        self._recvmsg = functools.partial(sock.recvmsg, _FD_TAG.size,
                                          socket.CMSG_LEN(_FD_BYTES))

    def receive(self, idx: int, nbytes: int) -> np.ndarray:
        """Map the segment the worker sent for batch ``idx``: its bytes, as an array whose base
        owns the mapping (unmapped when the last view of the batch dies). Descriptors of
        batches the worker failed to report are closed on the way."""
        while True:
            self._parse()
            for data, fds in self.received:
                if fds and len(data) == _FD_TAG.size and _FD_TAG.unpack(data)[0] == idx:
                    return np.frombuffer(map_shared(fds[0], max(nbytes, 1), what=SEGMENT),
                                         dtype=np.uint8)
            self._raw.extend(map(self._recvmsg, (0,)))  # (flags 0) kept as recvmsg returns
            if not self._raw[-1][0] and not self._raw[-1][1]:
                self._raw.pop()
                raise EOFError("the worker's descriptor socket closed")

    def _parse(self) -> None:
        """Each message recvmsg returned, as (tag, descriptors), moved in one statement with no
        call (so an interrupt neither drops nor doubles one)."""
        while self._raw:
            data, ancdata = self._raw[0][:2]
            fds = array.array("i")
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
            received, rest = self.received + deque([(data, fds.tolist())]), deque(self._raw)
            rest.popleft()
            self.received, self._raw = received, rest

    def forget(self, idx: int) -> None:
        """Close batch ``idx``'s descriptor (its mapping holds the memory) and every one
        before it that no batch asked for (a worker sends its batches' segments in idx
        order within an epoch; the session clears what is left between epochs)."""
        self._parse()
        while self.received:
            data, fds = self.received[0]
            tag = _FD_TAG.unpack(data)[0] if len(data) == _FD_TAG.size else None
            if tag is not None and tag > idx:
                return
            while fds:  # dropped in the statement that closes it: an interrupted forget
                os.close(fds.pop())  # never closes a descriptor twice
            self.received.popleft()

    def close(self) -> None:
        self.forget(2**62)
