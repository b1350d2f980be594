"""trial16 s3: the row-copy paths called directly (no loader), many combinations quickly:
CastRows.write / write_row with the cast loop forced, against numpy's plain assignment
(out[...] = rows) and, where torch accepts the rows, torch.stack of torch.as_tensor(row).

Rows: every out dtype the cast loop takes, rows of every dtype that numpy promotes to it
(bools, narrower and other-signed ints, byte-swapped ints, datetime units), at byte offsets
0/1/8/16/48, C/Fortran/transposed/strided/stride-0 layouts, np.memmap, ndarray subclasses.

    /work/main/.venv/bin/python examples/trial16/s3_direct.py
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from arena_loader._layout import rowcopy
from arena_loader._layout.plan import promote_to

warnings.simplefilter("ignore")


class Decided(rowcopy.LoopChoice):
    """Every class of row sizes has chosen the cast loop."""

    def of(self, row_nbytes):
        row_class = rowcopy.RowClass()
        row_class.cast = True
        return row_class

OUT_DTYPES = ["u1", "i1", "u2", "i2", "u4", "i4", "u8", "i8", "f2", "f4", "f8", "c8", "?",
              "M8[ns]", "m8[s]", "M8[D]"]
EXTRA = ["?", "u1", "i1", "u2", "i2", "u4", "i4", "u8", "i8", ">i2", ">u4", ">i8", ">f4",
         "f2", "f4", "c8", "M8[us]", "m8[ms]", "M8[D]", "M8[ns]"]


def row_shape(dtype):
    n = 40 * 1024 // np.dtype(dtype).itemsize
    return (n // 64, 64)


def rand(dtype, shape, seed):
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    if dtype.kind == "b":
        raw &= 1
    return raw.view(dtype).reshape(shape)


def placed(a, how, seed):
    if how == "c":
        return a.copy()
    if how.startswith("off"):
        off = int(how[3:])
        buf = np.empty(a.nbytes + 128, np.uint8)
        start = (-buf.ctypes.data) % 64 + off
        v = buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
        v[...] = a
        return v
    if how == "F":
        return np.asfortranarray(a)
    if how == "T":
        return np.ascontiguousarray(a.T).T
    if how == "strided":
        big = np.repeat(a, 2, axis=0)
        return big[::2]
    if how == "bcast":
        return np.broadcast_to(a[:1], a.shape)
    if how == "memmap":
        path = f"/tmp/trial16/s3_{seed}.bin"
        with open(path, "wb") as f:
            f.write(b"\0" * 8 + a.tobytes())
        return np.memmap(path, dtype=a.dtype, mode="r", offset=8, shape=a.shape)
    if how == "matrix_like_subclass":
        class Sub(np.ndarray):
            pass
        return a.copy().view(Sub)
    raise ValueError(how)


LAYOUTS = ["c", "off0", "off1", "off8", "off16", "off48", "F", "T", "strided", "bcast", "memmap",
           "matrix_like_subclass"]


def torch_stack(rows):
    try:
        return torch.stack([torch.as_tensor(r) for r in rows]), None
    except Exception as exc:
        return None, type(exc).__name__


def main():
    cases = same = 0
    diffs = []
    torch_notes = set()
    seed = 0
    for out_dt in OUT_DTYPES:
        out_dt = np.dtype(out_dt)
        shape = row_shape(out_dt)
        for extra in EXTRA:
            extra = np.dtype(extra)
            rows_dt = [out_dt, extra, out_dt, extra]
            if not promote_to([np.empty(0, d) for d in rows_dt], out_dt):
                continue
            for layout in LAYOUTS:
                seed += 1
                rows = [placed(rand(d, shape, seed * 10 + k), layout if k % 2 else "c",
                               seed * 10 + k) for k, d in enumerate(rows_dt)]
                expect = np.empty((4, *shape), out_dt)
                try:
                    expect[...] = rows
                    err = None
                except Exception as exc:
                    err = type(exc).__name__
                for api in ("write", "write_row"):
                    cases += 1
                    rowcopy.CHOICE = Decided()
                    out = np.zeros((4, *shape), out_dt)
                    cast = rowcopy.CastRows.of(out)
                    if cast is None:
                        diffs.append(f"{out_dt} rows {extra} {layout}: CastRows.of None")
                        continue
                    if api == "write":
                        ok = cast.write(rows)
                        if not ok:
                            out[...] = rows
                    else:
                        for r, row in enumerate(rows):
                            if not cast.write_row(r, row):
                                out[r] = row
                    if err is None and out.tobytes() != expect.tobytes():
                        bad = np.flatnonzero(out.view(np.uint8).reshape(-1)
                                             != expect.view(np.uint8).reshape(-1))
                        diffs.append(f"DIFF {api} out {out_dt} rows {extra} layout {layout}: "
                                     f"{len(bad)} bytes differ")
                    else:
                        same += 1
                # torch's answer, where it has one
                t, terr = torch_stack(rows)
                if t is not None and err is None:
                    tdt = torch.empty(0, dtype=t.dtype).numpy().dtype
                    tb = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                    if tdt != out_dt:
                        torch_notes.add(f"torch.stack types rows {[str(d) for d in rows_dt]} "
                                        f"as {t.dtype}")
                    elif tb != expect.tobytes():
                        torch_notes.add(f"torch.stack bytes differ from numpy for out {out_dt} "
                                        f"rows {extra} layout {layout}")
                elif terr:
                    torch_notes.add(f"torch raises {terr} for rows {extra} (out {out_dt}, "
                                    f"layout {layout})")
    print(f"s3 direct: {cases} cases, {same} equal to numpy's plain assignment, "
          f"{len(diffs)} differ")
    for d in diffs:
        print("  " + d)
    for n in sorted(torch_notes):
        print("  note: " + n)


if __name__ == "__main__":
    main()
