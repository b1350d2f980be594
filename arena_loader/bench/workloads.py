"""The benchmark workloads: map-style datasets every loader reads in the same order.

Most samples come from a small pool of pre-generated arrays (or, for ``memmap``, from a file
on disk), so producing a sample costs nothing and the figures measure the loaders themselves.
Every pool array starts on a 64-byte (cache-line) boundary, in the main process and, after
unpickling, in spawned workers (``Aligned``): numpy's allocations start 16 bytes past one or
on one, by the heap's state, and a copy-bound loader reads a misaligned row ~1.2x slower,
which made the same workload's figures differ between runs (docs/benchmarks.md,
"Stability"). Two workloads have the per-sample cost real datasets have: ``jpeg`` decodes a JPEG and
crops/resizes it to 3x224x224 (CPU work in the worker), ``remote`` waits a few ms per sample
with the GIL released (a read from object storage). Every dataset is a module-level class so
spawn and forkserver workers (Grain's) can import it.
"""

from __future__ import annotations

import io
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

POOL = 64
ALIGN = 64  # bytes: a cache line


def aligned(array: np.ndarray) -> np.ndarray:
    """``array`` itself if its data starts on an ``ALIGN``-byte boundary, else a copy that
    does. Which of 0, 16, 32 or 48 bytes past a cache line numpy's allocation lands on
    depends on the heap's state (glibc serves a large array from the heap or from its own
    mapping by a threshold that earlier frees raise), and a row read from 16 or 48 bytes past
    one copies ~1.2x slower than from 0 or 32 (dict workload, ArenaLoader: 1,270-1,350
    against 1,510-1,700 batches/s)."""
    if array.nbytes == 0 or array.ctypes.data % ALIGN == 0:  # nothing to read when empty
        return array
    return placed(array, 0)


def placed(array: np.ndarray, offset: int) -> np.ndarray:
    """A copy of ``array`` whose data starts ``offset`` bytes past an ``ALIGN``-byte
    boundary (benchmarks/source_alignment.py and shm_write_limit.py place it on purpose)."""
    raw = np.empty(array.nbytes + 2 * ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN + offset % ALIGN
    out = raw[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
    out[...] = array
    return out


class Aligned:
    """Keeps every array field (and list of arrays) aligned after unpickling: a spawned or
    forkserver worker (Grain's) unpickles the dataset into fresh, unaligned allocations."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({key: _aligned_fields(value) for key, value in state.items()})


def _aligned_fields(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return aligned(value)
    if isinstance(value, list) and value and all(isinstance(v, np.ndarray) for v in value):
        return [aligned(v) for v in value]
    return value


def _pool(shape: tuple[int, ...], dtype: Any, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "u":
        return aligned(rng.integers(0, 256, size=(POOL, *shape), dtype=dtype))
    if np.dtype(dtype) in (np.float32, np.float64):  # made in its dtype: 3x faster (large)
        return aligned(rng.standard_normal(size=(POOL, *shape), dtype=dtype))
    return aligned(rng.standard_normal(size=(POOL, *shape)).astype(dtype))


class PooledArrays(Aligned):
    """``n`` samples of ``shape`` and ``dtype``: ``dataset[i]`` is pool row ``i % 64``."""

    def __init__(self, n: int, shape: tuple[int, ...], dtype: Any, seed: int = 0):
        self.n = n
        self.pool = _pool(shape, dtype, seed)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.ndarray:
        return self.pool[index % POOL]


class DictSamples(Aligned):
    """``{"image": uint8 image, "label": int, "features": float32 vector}`` per sample."""

    def __init__(self, n: int, image_shape: tuple[int, ...], features: int = 128):
        self.n = n
        self.images = _pool(image_shape, np.uint8, 1)
        self.features = _pool((features,), np.float32, 2)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = index % POOL
        return {"image": self.images[row], "label": index, "features": self.features[row]}


class MemmapImages:
    """uint8 images read from a raw file on disk through ``numpy.memmap`` (opened lazily in
    each process, so the dataset pickles as a path)."""

    def __init__(self, path: str, n: int, shape: tuple[int, ...]):
        self.path, self.n, self.shape = path, n, shape
        self._images: np.memmap | None = None

    @classmethod
    def create(cls, directory: str, n: int, shape: tuple[int, ...]) -> MemmapImages:
        """Write ``n`` images (pool rows, 64 at a time) to a new file in ``directory``."""
        handle, path = tempfile.mkstemp(prefix="arena_bench_", suffix=".u8", dir=directory)
        pool = _pool(shape, np.uint8, 3)
        with os.fdopen(handle, "wb") as out:
            for start in range(0, n, POOL):
                out.write(pool[: min(POOL, n - start)].tobytes())
        return cls(path, n, shape)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_images": None}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.ndarray:
        if self._images is None:
            self._images = np.memmap(self.path, dtype=np.uint8, mode="r",
                                     shape=(self.n, *self.shape))
        return self._images[index]

    def remove(self) -> None:
        self._images = None
        os.unlink(self.path)


class Tokens(Aligned):
    """Text: int64 token ids of 16..512 tokens (a pool of 64 lengths), padded per batch to
    its longest by ``pad_collate``: every batch has another shape."""

    def __init__(self, n: int):
        self.n = n
        rng = np.random.default_rng(4)
        self.pool = [aligned(rng.integers(0, 50_000, size=int(length), dtype=np.int64))
                     for length in rng.integers(16, 513, size=POOL)]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.ndarray:
        return self.pool[index % POOL]


def pad_collate(samples: list[np.ndarray]) -> dict[str, np.ndarray]:
    """Pad to the batch's longest sequence: ids, attention mask and lengths."""
    lengths = np.array([len(s) for s in samples], dtype=np.int64)
    ids = np.zeros((len(samples), int(lengths.max())), dtype=np.int64)
    for row, sample in enumerate(samples):
        ids[row, : len(sample)] = sample
    return {"input_ids": ids, "attention_mask": ids != 0, "lengths": lengths}


class Detection(Aligned):
    """Detection: uint8 images of varying size (3 x 192..320 x 192..320) and 0..15 boxes."""

    def __init__(self, n: int):
        self.n = n
        rng = np.random.default_rng(5)
        self.images = [aligned(rng.integers(0, 256, size=(3, int(h), int(w)), dtype=np.uint8))
                       for h, w in rng.integers(192, 321, size=(POOL, 2))]
        self.boxes = [aligned(rng.random((int(k), 4), dtype=np.float32) * 192)
                      for k in rng.integers(0, 16, size=POOL)]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[np.ndarray, dict[str, Any]]:
        row = index % POOL
        boxes = self.boxes[row]
        return self.images[row], {"boxes": boxes, "labels": np.ones(len(boxes), np.int64),
                                  "image_id": index}


class JpegImages:
    """Image decoding: a pool of 32 JPEGs of varied sizes (128..352 x 128..352, made once
    with PIL at construction), each sample decoded, centre-cropped to a square and resized
    to uint8 3x224x224: the per-sample CPU work of an ImageNet-style pipeline."""

    def __init__(self, n: int, side: int = 224, pool: int = 32, seed: int = 6):
        from PIL import Image

        self.n, self.side = n, side
        rng = np.random.default_rng(seed)
        self.jpegs: list[bytes] = []
        for h, w in rng.integers(128, 353, size=(pool, 2)):
            # A smooth gradient with noise: compresses like a photo, not like white noise.
            y, x = np.mgrid[0:h, 0:w]
            base = np.stack([x * 255 // w, y * 255 // h, (x + y) * 255 // (w + h)], axis=-1)
            noisy = base + rng.integers(-24, 25, size=base.shape)
            image = Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8), "RGB")
            out = io.BytesIO()
            image.save(out, format="JPEG", quality=85)
            self.jpegs.append(out.getvalue())

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.ndarray:
        return decode_crop_resize(self.jpegs[index % len(self.jpegs)], self.side)


def decode_crop_resize(jpeg: bytes, side: int) -> np.ndarray:
    """JPEG bytes -> uint8 (3, side, side): decode, centre square crop, bilinear resize."""
    from PIL import Image

    with Image.open(io.BytesIO(jpeg)) as image:
        image = image.convert("RGB")
        w, h = image.size
        edge = min(w, h)
        left, top = (w - edge) // 2, (h - edge) // 2
        image = image.resize((side, side), Image.BILINEAR,
                             box=(left, top, left + edge, top + edge))
        return np.ascontiguousarray(np.asarray(image).transpose(2, 0, 1))


class RemoteSamples(Aligned):
    """Remote storage: every sample waits ``wait_ms`` with the GIL released (``time.sleep``,
    as a read from object storage does) and returns a uint8 image from a pool. The wait,
    not the CPU, is the cost: the workload threads inside workers are for."""

    def __init__(self, n: int, shape: tuple[int, ...], wait_ms: float = 2.0):
        self.n, self.wait_s = n, wait_ms / 1e3
        self.pool = _pool(shape, np.uint8, 7)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.ndarray:
        time.sleep(self.wait_s)
        return self.pool[index % POOL]


def detection_collate(samples: list) -> tuple:
    """torchvision's detection recipe: a tuple of images and a tuple of targets."""
    return tuple(zip(*samples))


@dataclass(frozen=True)
class Workload:
    """One dataset shape to compare every loader on."""

    name: str
    description: str
    batch_size: int
    samples: int
    make: Callable[[str, int], Any]  # (temp directory, samples) -> dataset
    collate_fn: Callable[[list], Any] | None = None  # loaders without one cannot run it
    # Every sample one array of one shape and dtype: what the floor loader handles.
    fixed_shape: bool = True
    # Thread workers for the rows that wait in threads (remote storage); None: no such rows.
    threads: int | None = None

    def dataset(self, directory: str) -> Any:
        return self.make(directory, self.samples)


@dataclass(frozen=True)
class Sizes:
    """Knobs the CLI exposes (tests shrink them): sample counts scale with ``scale``."""

    scale: float = 1.0
    image_shape: tuple[int, ...] = (3, 224, 224)
    large_batch_mb: float = 32.0
    jpeg_side: int = 224
    remote_wait_ms: float = 2.0
    remote_shape: tuple[int, ...] = (3, 64, 64)
    remote_threads: int = 16


def standard_workloads(sizes: Sizes) -> list[Workload]:
    """The workloads of the standard suite, sized by ``sizes``."""
    image = sizes.image_shape
    image_nbytes = int(np.prod(image))

    def count(full: int, batch: int) -> int:
        # Whole batches only: Grain's persistent stream has no epoch boundary of its own.
        return max(2, int(full * sizes.scale) // batch) * batch

    # Large batches: 32 samples of float32 rows, each large_batch_mb / 32 in size.
    large_row = max(1, int(sizes.large_batch_mb * 1e6 / 32 / 4))
    shape_label = "x".join(map(str, image))
    remote_label = "x".join(map(str, sizes.remote_shape))
    return [
        Workload("image", f"uint8 {shape_label}, batch 64 "
                 f"({64 * image_nbytes / 1e6:.1f} MB)", 64, count(4096, 64),
                 lambda _dir, n: PooledArrays(n, image, np.uint8)),
        Workload("large", f"float32[{large_row}], batch 32 ({32 * large_row * 4 / 1e6:.1f} MB)",
                 32, count(512, 32),
                 lambda _dir, n: PooledArrays(n, (large_row,), np.float32)),
        Workload("tiny", "float32[16], batch 256 (16 KB)", 256, count(65536, 256),
                 lambda _dir, n: PooledArrays(n, (16,), np.float32)),
        Workload("dict", f"{{image uint8 {shape_label}, label int, features float32[128]}}, "
                 "batch 64", 64, count(4096, 64),
                 lambda _dir, n: DictSamples(n, image), fixed_shape=False),
        Workload("memmap", f"numpy.memmap file of uint8 {shape_label}, batch 64", 64,
                 count(2048, 64),
                 lambda directory, n: MemmapImages.create(directory, n, image)),
        Workload("text", "int64 tokens, 16-512 per sample, padded to the batch's longest, "
                 "batch 64", 64, count(8192, 64), lambda _dir, n: Tokens(n), pad_collate,
                 fixed_shape=False),
        Workload("detect", "uint8 images 3x192..320x192..320 + 0..15 boxes, "
                 "collate tuple(zip(*batch)), batch 16", 16, count(1024, 16),
                 lambda _dir, n: Detection(n), detection_collate, fixed_shape=False),
        Workload("jpeg", f"JPEG 128..352 x 128..352 decoded, cropped, resized to uint8 "
                 f"3x{sizes.jpeg_side}x{sizes.jpeg_side}, batch 32", 32, count(1024, 32),
                 lambda _dir, n: JpegImages(n, sizes.jpeg_side)),
        Workload("remote", f"{sizes.remote_wait_ms:g} ms wait per sample (GIL released) + "
                 f"uint8 {remote_label}, batch 16", 16, count(1024, 16),
                 lambda _dir, n: RemoteSamples(n, sizes.remote_shape, sizes.remote_wait_ms),
                 threads=sizes.remote_threads),
    ]

