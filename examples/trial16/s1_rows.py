"""trial16 s1: large rows (>= 32 KB per sample field) and rows just below, of many dtypes,
placed many ways, through torch's DataLoader and ArenaLoader, compared bit for bit.

    /work/main/.venv/bin/python examples/trial16/s1_rows.py [name-filter]
"""

from __future__ import annotations

import functools
import os
import sys

import numpy as np
import torch
from torch.utils.data import Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import run_cases

SCRATCH = "/tmp/trial16"
os.makedirs(SCRATCH, exist_ok=True)
N = 10  # samples: batches of 4, 4, 2 per epoch
LARGE, SMALL, EXACT = 36 * 1024, 30 * 1024, 32 * 1024  # bytes per row

DTYPES = ["uint8", "int8", "int16", "uint16", "int32", "int64", "float16", "float32",
          "float64", "bool", "complex64", "complex128"]


def shape_for(dtype, nbytes):
    n = nbytes // np.dtype(dtype).itemsize
    return (n // 64, 64)


def bits(dtype, shape, seed):
    """Random bit patterns (floats: NaN payloads, signalling NaNs, -0.0, +-inf, subnormals)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, count * dtype.itemsize, dtype=np.uint8)
    if dtype.kind == "b":
        raw = raw & 1
    a = raw.view(dtype).reshape(shape)
    if dtype.kind in "fc":
        flat = a.reshape(-1)
        part = dtype.itemsize if dtype.kind == "f" else dtype.itemsize // 2
        ints = {2: np.uint16, 4: np.uint32, 8: np.uint64}[part]
        comp = flat.view(ints)  # the float components
        specials = {np.uint16: [0x7E01, 0x7C01, 0x8000, 0x7C00, 0xFC00, 0x0001, 0xFE55],
                    np.uint32: [0x7FC00001, 0x7F800001, 0x80000000, 0x7F800000, 0xFF800000, 1,
                                0xFFC12345],
                    np.uint64: [0x7FF8000000000001, 0x7FF0000000000001, 1 << 63, 0x7FF0000000000000,
                                0xFFF0000000000000, 1, 0xFFF8DEADBEEF0001]}[ints]
        comp[:len(specials)] = specials
    return a


class Fn(Dataset):
    def __init__(self, make, n=N):
        self.make, self.n = make, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.make(i)


# --- placements ------------------------------------------------------------------------
def fresh(dtype, nbytes, i):
    return bits(dtype, shape_for(dtype, nbytes), i).copy()


OFFSETS = (0, 8, 16, 48)


def at_offset(dtype, nbytes, i):
    """The sample placed at a byte offset (0, 8, 16, 48 by index) of a larger fresh buffer."""
    a = bits(dtype, shape_for(dtype, nbytes), i)
    off = OFFSETS[i % 4]
    buf = np.empty(a.nbytes + 128, np.uint8)
    start = (-buf.ctypes.data) % 64 + off
    view = buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    view[...] = a
    return view


class Preloaded(Dataset):
    def __init__(self, dtype, nbytes, n=N):
        self.big = np.stack([bits(dtype, shape_for(dtype, nbytes), i) for i in range(n)])

    def __len__(self):
        return len(self.big)

    def __getitem__(self, i):
        return self.big[i]


class Memmapped(Dataset):
    def __init__(self, dtype, nbytes, n=N, offset=16):
        shape = shape_for(dtype, nbytes)
        path = f"{SCRATCH}/mm_{dtype}_{nbytes}.bin"
        data = np.stack([bits(dtype, shape, i) for i in range(n)])
        with open(path, "wb") as f:
            f.write(b"\0" * offset + data.tobytes())
        self.mm = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(n, *shape))

    def __len__(self):
        return len(self.mm)

    def __getitem__(self, i):
        return self.mm[i]


def fortran(dtype, nbytes, i):
    return np.asfortranarray(bits(dtype, shape_for(dtype, nbytes), i))


def transposed(dtype, nbytes, i):
    return bits(dtype, shape_for(dtype, nbytes), i).T  # non-contiguous view


def strided(dtype, nbytes, i):
    a = bits(dtype, (shape_for(dtype, nbytes)[0] * 2, 64), i)
    return a[::2]  # every other row: a positive-stride gap


def broadcast(dtype, nbytes, i):
    shape = shape_for(dtype, nbytes)
    return np.broadcast_to(bits(dtype, (1, shape[1]), i), shape)  # stride 0, read-only


def tensor(dtype, nbytes, i, layout="plain"):
    if dtype == "bfloat16":
        a = bits("int16", shape_for("int16", nbytes), i)
        t = torch.from_numpy(a.copy()).view(torch.bfloat16)
    else:
        t = torch.from_numpy(bits(dtype, shape_for(dtype, nbytes), i).copy())
    if layout == "t":
        return t.t()
    if layout == "channels_last":
        h = t.shape[0]
        return t.reshape(1, 4, h, 16).contiguous(memory_format=torch.channels_last)
    return t


# --- structured samples ---------------------------------------------------------------------
def dict_sample(i):
    return {"image": bits("uint8", (224, 224, 3), i).copy(),
            "label": i * 7 - 20, "mask": bits("bool", (256, 256), i + 100).copy()}


def dict_sample_offsets(i):
    return {"image": at_offset("float32", LARGE, i), "label": np.int64(i),
            "mask": at_offset("bool", EXACT, i + 3)}


def tuple_sample(i):
    return (at_offset("float32", 600 * 1024 // 4 * 4, i), i % 3)


def mixed(dtypes, nbytes, i):
    return fresh(dtypes[i % len(dtypes)], nbytes, i)


def mixed_same_shape(dtypes, i):
    """Mixed dtypes with one shape (elements fixed), each row >= 32 KB."""
    dt = dtypes[i % len(dtypes)]
    return bits(dt, (64, 1024), i).copy()


def late_shape(dtype, i):
    shape = shape_for(dtype, LARGE)
    if i == 6:
        shape = (shape[0] + 1, shape[1])
    return bits(dtype, shape, i).copy()


def late_dtype(i):
    return bits("float32" if i == 5 else "int32", (160, 64), i).copy()


def bool_raw(i):
    """bools whose bytes are not 0/1 (a uint8 buffer viewed as bool)."""
    rng = np.random.default_rng(i)
    return rng.integers(0, 256, 40 * 1024, dtype=np.uint8).view(np.bool_).reshape(640, 64)


def stack_collate(batch):
    return np.stack(batch)


def dict_collate(batch):
    return {"x": np.stack(batch), "first": torch.from_numpy(np.ascontiguousarray(batch[0]))}


def list_collate(batch):
    return [np.ascontiguousarray(b) for b in batch]


def main(filt: str = "") -> None:
    cases = []
    p = functools.partial
    for dt in DTYPES:
        for nbytes, tag in ((LARGE, "36K"), (SMALL, "30K")):
            cases.append((f"offsets {dt} {tag}", p(Fn, p(at_offset, dt, nbytes)),
                          {"expect_cast": nbytes >= EXACT and dt != "complex128"}))
        cases.append((f"fresh {dt} 32K", p(Fn, p(fresh, dt, EXACT)),
                      {"expect_cast": dt != "complex128"}))
    for dt in ("uint8", "float32", "complex64", "float16", "int64", "bool"):
        cases.append((f"preloaded {dt} 36K", p(Preloaded, dt, LARGE), {}))
        cases.append((f"memmap {dt} 36K", p(Memmapped, dt, LARGE), {}))
    for dt in ("float32", "int16", "complex128"):
        cases.append((f"fortran {dt} 36K", p(Fn, p(fortran, dt, LARGE)),
                      {"expect_cast": dt != "complex128"}))
        cases.append((f"transposed {dt} 36K", p(Fn, p(transposed, dt, LARGE)),
                      {"expect_cast": dt != "complex128"}))
        cases.append((f"strided {dt} 36K", p(Fn, p(strided, dt, LARGE)),
                      {"expect_cast": dt != "complex128"}))
        cases.append((f"broadcast {dt} 36K", p(Fn, p(broadcast, dt, LARGE)),
                      {"expect_cast": dt != "complex128"}))
    for dt in ("uint8", "float32", "float16", "bfloat16", "complex64", "bool", "int64"):
        cases.append((f"tensor {dt} 36K", p(Fn, p(tensor, dt, LARGE)), {"expect_cast": False}))
    for dt in ("float32", "bfloat16"):
        cases.append((f"tensor.t() {dt} 36K", p(Fn, p(tensor, dt, LARGE, layout="t")),
                      {"expect_cast": False}))
        cases.append((f"tensor channels_last {dt} 36K",
                       p(Fn, p(tensor, dt, LARGE, layout="channels_last")), {"expect_cast": False}))
    cases += [
        ("dict image/label/mask", p(Fn, dict_sample), {}),
        ("dict offsets f32/np.int64/bool", p(Fn, dict_sample_offsets), {}),
        ("tuple (f32 600K, int)", p(Fn, tuple_sample), {}),
        ("bool bytes not 0/1", p(Fn, bool_raw), {"modes": ("cast", "learn", "memmove")}),
        ("late sample of another shape", p(Fn, p(late_shape, "float32")), {"expect_cast": False}),
        ("late sample of another shape u8", p(Fn, p(late_shape, "uint8")), {"expect_cast": False}),
        ("late float32 among int32", p(Fn, late_dtype), {"expect_cast": False}),
        ("collate np.stack", p(Fn, p(fresh, "float32", LARGE)),
         {"collate_fn": stack_collate, "expect_cast": False}),
        ("collate dict", p(Fn, p(at_offset, "uint16", LARGE)),
         {"collate_fn": dict_collate, "expect_cast": False}),
        ("collate list", p(Fn, p(at_offset, "int8", LARGE)),
         {"collate_fn": list_collate, "expect_cast": False}),
    ]
    for combo in (("int16", "int8"), ("int8", "int16"), ("float16", "float32"),
                  ("float32", "float16"), ("int32", "int16", "uint16", "bool", "int8", "uint8"),
                  ("uint16", "uint8", "bool"), ("int64", "uint32", "int8"), ("uint8", "int8"),
                  ("uint8", "bool"), ("bool", "uint8"), ("float64", "int32"),
                  ("int32", "float32"), ("float32", "int32"), ("complex64", "float32"),
                  ("int16", "uint8", "int16", "int16")):
        cases.append((f"mixed {'/'.join(combo)}", p(Fn, p(mixed_same_shape, combo)),
                      {"expect_cast": combo[0] in ("int16", "int32", "uint16", "int64")}))
    # pre-existing, known leniencies (torch raises): big-endian dtype, negative strides
    cases += [
        ("known: big-endian >f4 36K", p(Fn, lambda i: fresh(">f4", LARGE, i)),
         {"expect_cast": False}),
        ("known: big-endian >i2 36K", p(Fn, lambda i: fresh(">i2", LARGE, i)),
         {"expect_cast": False}),
        ("known: negative stride f32 36K", p(Fn, lambda i: fresh("float32", LARGE, i)[::-1]),
         {"expect_cast": False}),
        ("note: datetime64[ns] 36K", p(Fn, lambda i: fresh("int64", LARGE, i).view("M8[ns]")),
         {"expect_cast": False}),
        ("note: timedelta64[us] 36K", p(Fn, lambda i: fresh("int64", LARGE, i).view("m8[us]")),
         {"expect_cast": False}),
    ]
    run_cases(cases, filt)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
