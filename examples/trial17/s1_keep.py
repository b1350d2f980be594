"""trial17 s1: consumers that keep zero-copy references to a batch (numpy, torch, buffers,
pyarrow, tensordict, a queue read by another thread, pickle protocol 5, a forked child, a
child fed through torch.multiprocessing's queue).

For each consumer, output ("numpy" / "torch") and loader configuration (common.KEEP_CONFIGS):
two batches per epoch over 3 epochs are handed to the consumer, every reference of ours is
dropped, iteration goes on, and the kept objects' bytes are compared with copies made at the
time, with the loader open and again after close() and del. ``control-raw-pointer`` is a
consumer that aliases the memory *without* keeping the lease (a ctypes array at the address):
it must come out CHANGED, which shows the check sees a reused slot.

    .venv/bin/python examples/trial17/s1_keep.py [substring of case names]
"""

from __future__ import annotations

import ctypes
import os
import pickle
import queue
import signal
import threading

import common
import numpy as np
import pyarrow as pa
import torch
from tensordict import TensorDict


def np_leaf(leaf) -> np.ndarray:
    return common.as_numpy(leaf)


def tobytes(x) -> bytes:
    return bytes(memoryview(np.ascontiguousarray(x)).cast("B"))


def mv_address(view: memoryview) -> int:
    return np.frombuffer(view, np.uint8).ctypes.data if view.nbytes else 0


def torch_bytes(t: torch.Tensor) -> bytes:
    return common.raw(t)


# --- whole-batch consumers ------------------------------------------------------------------
def dict_reader(obj):
    return {k: common.raw(v) for k, v in common.leaves(obj).items()}


class ThreadReader:
    """The batch goes into a queue.Queue; a thread takes it from there only when told to
    (after the loader has gone on), and returns its bytes."""

    def __init__(self, batch):
        self.queue: queue.Queue = queue.Queue()
        self.queue.put(batch)

    def read(self):
        result = []

        def take():
            batch = self.queue.get()
            result.append(dict_reader(batch))
            self.queue.put(batch)

        thread = threading.Thread(target=take)
        thread.start()
        thread.join()
        return result[0]


def pickled(batch):
    buffers: list = []
    data = pickle.dumps(dict(batch), protocol=5, buffer_callback=buffers.append)
    return data, buffers


def unpickled(kept):
    data, buffers = kept
    return {k: common.raw(v) for k, v in common.leaves(pickle.loads(data, buffers=buffers)).items()}


def loaded_now(batch):
    data, buffers = pickled(batch)
    return pickle.loads(data, buffers=buffers)  # views of the out-of-band buffers


class ForkedChild:
    """A child forked (os.fork) while the batch is alive; the parent then drops the batch and
    goes on, and the child, asked later (twice: loader open, then closed), sends the bytes it
    sees."""

    def __init__(self, batch):
        go_r, self.go_w = os.pipe()
        self.ans_r, ans_w = os.pipe()
        channel = self.channel()
        self.pid = os.fork()
        if self.pid == 0:  # the child: answer twice, then leave without cleanup
            try:
                seen = self.receive(batch, channel)
                for _ in range(2):
                    os.read(go_r, 1)
                    data = pickle.dumps(dict_reader(seen))
                    os.write(ans_w, len(data).to_bytes(8, "little") + data)
            finally:
                os._exit(0)
        os.close(go_r)
        os.close(ans_w)
        self.asked = 0
        self.send(batch, channel)

    def channel(self):
        return None

    def receive(self, batch, channel):
        return batch  # the child's own copy of the parent's memory

    def send(self, batch, channel):
        pass

    def read(self):
        os.write(self.go_w, b"g")
        size = int.from_bytes(_read_exactly(self.ans_r, 8), "little")
        answer = pickle.loads(_read_exactly(self.ans_r, size))
        self.asked += 1
        if self.asked == 2:
            self.close()
        return answer

    def close(self):
        if self.pid:
            if self.asked < 2:
                os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            os.close(self.go_w)
            os.close(self.ans_r)
            self.pid = 0

    __del__ = close


class TorchQueueChild(ForkedChild):
    """The batch is sent through a ``torch.multiprocessing`` queue to a forked child (torch
    moves a tensor's storage into shared memory of its own on the way)."""

    def channel(self):
        return torch.multiprocessing.get_context("fork").Queue()

    def receive(self, batch, channel):
        return channel.get()

    def send(self, batch, channel):
        channel.put(dict(batch))
        self.queue = channel


def _read_exactly(fd: int, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            raise EOFError("the forked child exited")
        out += chunk
    return out


def td_from(batch):
    tensors = {k: torch.as_tensor(v) for k, v in common.leaves(batch).items()}
    return TensorDict(tensors, batch_size=[len(batch["lbl"])])


def td_read(td):
    return {k: common.raw(td[k]) for k in td.keys()}


def td_addresses(td):
    return {k: td[k].data_ptr() for k in td.keys()}


def raw_pointer(leaf):
    """The negative control: a ctypes array at the leaf's address, keeping nothing alive."""
    a = np_leaf(leaf)
    return (ctypes.c_char * a.nbytes).from_address(a.ctypes.data)


def mapped(start: int, nbytes: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= start and start + nbytes <= hi:
                return True
    return False


def raw_pointer_bytes(c) -> bytes:
    # A one-off segment is unmapped once its (unheld) lease dies: reading would fault.
    return bytes(c) if mapped(ctypes.addressof(c), len(c)) else b"<unmapped>"


CONSUMERS = [
    common.per_leaf("np.from_dlpack", np.from_dlpack, tobytes, lambda a: a.ctypes.data),
    common.per_leaf("torch.from_dlpack", torch.from_dlpack, torch_bytes,
                    lambda t: t.data_ptr()),
    common.per_leaf("torch.as_tensor", torch.as_tensor, torch_bytes, lambda t: t.data_ptr()),
    common.per_leaf("torch.frombuffer", lambda v: torch.frombuffer(np_leaf(v), dtype=torch.uint8),
                    torch_bytes, lambda t: t.data_ptr()),
    common.per_leaf("memoryview", lambda v: memoryview(np_leaf(v)), lambda m: m.tobytes(),
                    mv_address),
    common.per_leaf("memoryview.cast(B)", lambda v: memoryview(np_leaf(v)).cast("B"),
                    lambda m: m.tobytes(), mv_address),
    common.per_leaf("np.ctypeslib.as_ctypes", lambda v: np.ctypeslib.as_ctypes(np_leaf(v)),
                    lambda c: bytes(memoryview(c).cast("B")), ctypes.addressof),
    common.per_leaf("pa.array", lambda v: pa.array(np_leaf(v).reshape(-1)),
                    lambda a: a.buffers()[1].to_pybytes()[:a.nbytes],
                    lambda a: a.buffers()[1].address),
    common.per_leaf("pa.py_buffer", lambda v: pa.py_buffer(np_leaf(v)),
                    lambda b: b.to_pybytes(), lambda b: b.address),
    common.per_leaf("pa.Tensor.from_numpy", lambda v: pa.Tensor.from_numpy(np_leaf(v)),
                    lambda t: tobytes(t.to_numpy()), lambda t: t.to_numpy().ctypes.data),
    common.Consumer("tensordict.TensorDict", td_from, td_read, td_addresses),
    common.Consumer("queue.Queue+thread", ThreadReader, ThreadReader.read),
    common.Consumer("pickle5 out-of-band buffers", pickled, unpickled),
    common.Consumer("pickle5 loaded views", loaded_now, dict_reader,
                    lambda obj: {k: common.address(v) for k, v in common.leaves(obj).items()}),
    common.Consumer("forked child", ForkedChild, ForkedChild.read),
    common.Consumer("torch.multiprocessing.Queue to a child", TorchQueueChild,
                    TorchQueueChild.read),
    common.per_leaf("control-raw-pointer", raw_pointer, raw_pointer_bytes,
                    ctypes.addressof, control=True),
]


if __name__ == "__main__":
    common.keep_all(CONSUMERS)
