"""Module-level datasets (so spawn and forkserver workers can import them) and the
in-process reference that every loader batch is compared with."""

from __future__ import annotations

import collections
import errno
import faulthandler
import mmap
import os
import signal
import sys
import threading
import time
from typing import Any

import numpy as np

Point = collections.namedtuple("Point", ["x", "y"])


def make_array(index: int, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A deterministic array whose every element depends on ``index``."""
    count = int(np.prod(shape))
    values = (np.arange(count, dtype=np.int64) * 7 + index * 1000003) % 251
    if np.dtype(dtype).kind == "b":
        return (values % 2 == 1).reshape(shape)
    return values.astype(dtype).reshape(shape)


class ImageDataset:
    """Plain arrays: ``dataset[i]`` is an array of ``shape`` and ``dtype``."""

    def __init__(self, n: int, shape: tuple[int, ...] = (3, 8, 8), dtype: Any = np.uint8):
        self.n, self.shape, self.dtype = n, shape, dtype

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < self.n:
            raise IndexError(f"index {index} out of range for {self.n} samples")
        return make_array(index, self.shape, self.dtype)


class NestedDataset:
    """Dict / tuple / namedtuple samples with several dtypes, Python numbers and strings."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict:
        return {
            "image": make_array(index, (2, 5, 3), np.uint8),
            "pair": (make_array(index, (4,), np.float32), np.int16(index)),
            "point": Point(x=float(index) / 2, y=make_array(index, (2, 2), np.int64)),
            "label": index,
            "flag": index % 3 == 0,
            "name": f"sample-{index}",
        }


class Release:
    """A sleep that the test can end early: a flag in an anonymous shared mapping, which
    forked workers (and threads) share. A test whose slow sample only has to outlast what it
    checks (a timeout, a close() from another thread) sets it once it has checked: the
    worker then returns from the sample and a close() need not wait its join timeout
    (``JOIN_TIMEOUT_S``, 2 s) to kill it. Unpickled (a spawned worker): a flag of its own,
    never set."""

    def __init__(self) -> None:
        self._flag = mmap.mmap(-1, 1)

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self._flag = mmap.mmap(-1, 1)

    def set(self) -> None:
        self._flag[0] = 1

    def clear(self) -> None:
        self._flag[0] = 0

    def sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self._flag[0]:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, 0.01))


class SlowDataset(ImageDataset):
    """Sleeps ``delay_s`` before returning any sample whose index is in ``slow_indices``, or
    until ``release()``."""

    def __init__(self, n: int, slow_indices, delay_s: float, **kwargs: Any):
        super().__init__(n, **kwargs)
        self.slow_indices, self.delay_s = frozenset(slow_indices), delay_s
        self.released = Release()

    def __getitem__(self, index: int) -> np.ndarray:
        if index in self.slow_indices:
            self.released.sleep(self.delay_s)
        return super().__getitem__(index)

    def release(self) -> None:
        """Every slow sample, now and later, returns at once."""
        self.released.set()


class RaisingDataset(ImageDataset):
    """Raises ``ValueError`` for the indices in ``bad``."""

    def __init__(self, n: int, bad: set[int]):
        super().__init__(n)
        self.bad = bad

    def __getitem__(self, index: int) -> np.ndarray:
        if index in self.bad:
            raise ValueError(f"sample {index} is corrupt")
        return super().__getitem__(index)


class ShapeChangingDataset(ImageDataset):
    """Sample ``odd_index`` has a different shape (or dtype) from the others."""

    def __init__(self, n: int, odd_index: int, odd_shape=None, odd_dtype=None):
        super().__init__(n)
        self.odd_index, self.odd_shape, self.odd_dtype = odd_index, odd_shape, odd_dtype

    def __getitem__(self, index: int) -> np.ndarray:
        if index == self.odd_index:
            return make_array(index, self.odd_shape or self.shape, self.odd_dtype or self.dtype)
        return super().__getitem__(index)


class SuicidalDataset(ImageDataset):
    """The worker that loads ``fatal_index`` kills itself with ``signum``, after writing the
    wall-clock time of its death to ``stamp_path`` if given."""

    def __init__(self, n: int, fatal_index: int, signum: int = signal.SIGKILL,
                 stamp_path: str | None = None):
        super().__init__(n)
        self.fatal_index, self.signum, self.stamp_path = fatal_index, signum, stamp_path

    def __getitem__(self, index: int) -> np.ndarray:
        if index == self.fatal_index:
            faulthandler.disable()  # pytest's handler would print this worker's stack
            if self.stamp_path is not None:
                with open(self.stamp_path, "w") as stamp:
                    stamp.write(repr(time.time()))
            os.kill(os.getpid(), self.signum)
        return super().__getitem__(index)


class KilledWhileMakingSegment(ImageDataset):
    """The worker that loads ``fatal_index`` is SIGKILLed inside the window that
    ``open_shared`` keeps as short as it can: its shared-memory object made under our name
    prefix and its pid, not yet unlinked."""

    def __init__(self, n: int, fatal_index: int):
        super().__init__(n)
        self.fatal_index = fatal_index

    def __getitem__(self, index: int) -> np.ndarray:
        if index == self.fatal_index:
            import posix_ipc

            from arena_loader._slab import NAME_PREFIX
            posix_ipc.SharedMemory(f"/{NAME_PREFIX}{os.getpid()}_caught", posix_ipc.O_CREX)
            faulthandler.disable()
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(index)


def stack_reference(samples: list) -> Any:
    """What default collation must give: ``np.stack`` per leaf, lists for strings."""
    first = samples[0]
    if isinstance(first, dict):
        return {key: stack_reference([s[key] for s in samples]) for key in first}
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(stack_reference(list(items)) for items in zip(*samples)))
    if isinstance(first, (tuple, list)):
        return type(first)(stack_reference(list(items)) for items in zip(*samples))
    if isinstance(first, str):
        return list(samples)
    return np.stack([np.asarray(s) for s in samples])


def assert_batches_equal(actual: Any, expected: Any, where: str = "batch") -> None:
    """Same nested structure, same dtypes and shapes, same values."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), where
        for key in expected:
            assert_batches_equal(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, tuple):
        assert type(actual) is type(expected) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_batches_equal(a, e, f"{where}[{i}]")
    elif isinstance(expected, (list, str, int, float, complex)):  # bool is an int
        assert type(actual) is type(expected) and actual == expected, where
    else:
        assert isinstance(actual, np.ndarray), f"{where}: {type(actual)}"
        assert actual.dtype == expected.dtype, f"{where}: {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{where}: {actual.shape} != {expected.shape}"
        np.testing.assert_array_equal(actual, expected, err_msg=where)


def host_copy(batch: Any) -> Any:
    """A batch with every array copied to a host numpy array (device arrays, CUDA tensors and
    slab views alike), structure kept: nothing of the loader's outlives it."""
    if isinstance(batch, dict):
        return {key: host_copy(value) for key, value in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(host_copy(value) for value in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(host_copy(value) for value in batch)
    if hasattr(batch, "copy_to_host"):  # a numba device array (or the simulator's)
        return batch.copy_to_host()
    if hasattr(batch, "is_cuda"):  # a torch tensor
        return batch.cpu().numpy()
    if isinstance(batch, np.ndarray):
        return batch.copy()
    return batch


def assert_epoch_equal(loader: Any, expected: list, where: str = "epoch") -> None:
    """One epoch of ``loader`` (a ``for`` loop, which holds each batch while asking for the
    next), copied to the host, equals ``expected`` batch for batch."""
    batches = [host_copy(batch) for batch in loader]
    assert len(batches) == len(expected), f"{where}: {len(batches)} != {len(expected)} batches"
    for i, (batch, reference) in enumerate(zip(batches, expected)):
        assert_batches_equal(batch, reference, f"{where} batch {i}")


def host_epoch(dataset: Any, **loader_options: Any) -> list:
    """One epoch of a host (device=None) ArenaLoader, copied out of the slab."""
    from arena_loader import ArenaLoader

    with ArenaLoader(dataset, **loader_options) as loader:
        return [host_copy(batch) for batch in loader]


def reference_epoch(dataset: Any, batch_size: int, drop_last: bool,
                    order: list[int] | None = None) -> list:
    order = list(range(len(dataset))) if order is None else order
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    if drop_last and batches and len(batches[-1]) < batch_size:
        batches.pop()
    return [stack_reference([dataset[i] for i in b]) for b in batches]


class WorkerProbeDataset(ImageDataset):
    """Each sample records the loading worker's info and a draw from numpy's global RNG.

    Under torch's DataLoader it reads torch's ``get_worker_info()``, so both can be compared.
    """

    def __getitem__(self, index: int) -> dict:
        from arena_loader import get_worker_info

        info = get_worker_info()
        torch_data = sys.modules.get("torch.utils.data")
        if info is None and torch_data is not None:
            info = torch_data.get_worker_info()
        return {"worker": -1 if info is None else info.id,
                "num_workers": 0 if info is None else info.num_workers,
                # A string: the seed may not fit an int64.
                "seed": "" if info is None else str(info.seed),
                "holds_dataset": info is not None and info.dataset is self,
                "draw": np.random.randint(0, 2**31)}


class BatchedFetchDataset(ImageDataset):
    """Implements ``__getitems__`` and marks samples fetched through it."""

    def __getitems__(self, indices: list[int]) -> list[np.ndarray]:
        return [self[i] + 1 for i in indices]


class CountedBatches:
    """A batch sampler of ``batches`` batches of ``size`` consecutive indices that counts the
    batches the loader has drawn from it (``drawn``)."""

    def __init__(self, batches: int, size: int):
        self.batches, self.size, self.drawn = batches, size, 0

    def __iter__(self) -> Any:
        for batch in range(self.batches):
            self.drawn += 1
            yield list(range(batch * self.size, (batch + 1) * self.size))

    def __len__(self) -> int:
        return self.batches


def draws_per_next(loader: Any, sampler: CountedBatches, settle_s: float = 0.05) -> list[int]:
    """How many batches ``loader`` has drawn from ``sampler`` after ``iter()`` and after each
    ``next()`` of one epoch, each read ``settle_s`` later (time for a stage thread to run
    ahead)."""
    sampler.drawn = 0
    iterator = iter(loader)
    time.sleep(settle_s)
    counts = [sampler.drawn]
    for _ in iterator:
        time.sleep(settle_s)
        counts.append(sampler.drawn)
    return counts


def fail_init(worker_id: int) -> None:
    raise FileNotFoundError(errno.ENOENT, f"cannot open shard for worker {worker_id}")


def _torch_worker_info() -> Any:
    """torch's get_worker_info(): a dataset written for torch's DataLoader shards by it."""
    import torch.utils.data

    return torch.utils.data.get_worker_info()


class ShardedStream:
    """Iterable-style: samples ``0 .. n-1``, sharded ``start::num_workers`` by torch's
    ``get_worker_info()``; ``lengths`` (per worker id) makes uneven shards instead."""

    def __init__(self, n: int, lengths: tuple[int, ...] | None = None,
                 fail_at: int | None = None, fail_in_iter: bool = False):
        self.n, self.lengths = n, lengths
        self.fail_at, self.fail_in_iter = fail_at, fail_in_iter

    def __len__(self) -> int:
        return self.n if self.lengths is None else sum(self.lengths)

    def _mine(self) -> list[int]:
        info = _torch_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        if self.lengths is None:
            return list(range(worker, self.n, workers))
        start = sum(self.lengths[:worker])
        count = sum(self.lengths[worker::workers]) if workers == 1 else self.lengths[worker]
        return list(range(start, start + count))

    def __iter__(self):
        if self.fail_in_iter:
            raise PermissionError("cannot open the stream's shard")
        for index in self._mine():
            if index == self.fail_at:
                raise ValueError(f"corrupt record {index}")
            yield {"x": make_array(index, (3, 4), np.float32), "index": index}


def as_torch_iterable(stream: ShardedStream) -> Any:
    """The same stream as a ``torch.utils.data.IterableDataset``."""
    import torch.utils.data

    class TorchShardedStream(torch.utils.data.IterableDataset):
        def __len__(self):
            return len(stream)

        def __iter__(self):
            return iter(stream)

    return TorchShardedStream()


class ProtocolDataset:
    """A user dataset implementing the batch protocol: ``{"index", "square"}`` samples,
    ``read_into`` fills whole batches; counts calls of each path (per process)."""

    def __init__(self, n: int, with_name: bool = False):
        self.n, self.with_name = n, with_name
        self.calls = {"getitem": 0, "read_into": 0}
        self._lock = threading.Lock()  # thread workers share this object

    def __len__(self) -> int:
        return self.n

    def _count(self, path: str) -> None:
        with self._lock:
            self.calls[path] += 1

    def __getitem__(self, index: int) -> dict:
        self._count("getitem")
        sample = {"index": index, "square": float(index) ** 2}
        if self.with_name:
            sample["name"] = f"sample-{index}"
        return sample

    def read_into(self, indices: np.ndarray, out: dict) -> None:
        self._count("read_into")
        out["index"][:] = indices
        out["square"][:] = indices.astype(np.float64) ** 2

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
