"""The plan on the wire: a fixed-size header and one small record per field; each structure
is pickled once per worker and then named by its id (up to ``STRUCTURES_KEPT`` of them: the
oldest one's id is given to a new one past that, so a collate_fn whose every batch has a
structure of its own costs a bounded amount of memory on both sides)."""

from __future__ import annotations

import operator
import pickle
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import LayoutError
from .plan import FieldPlacement, Plan

HEADER = struct.Struct("<qiiBBxxIIIqqq")
_FIELD = struct.Struct("<qBBH")  # offset, kind, ndim, dtype descriptor bytes
RECORD_MAGIC = b"R"
FLAG_TORCH = 1
FLAG_SEGMENT = 2  # the storage is a one-off segment whose descriptor follows on the side
FLAG_COLLATED = 4
FLAG_CONVERTED = 8  # one unbatched sample, no collate_fn (Plan.converted)
# A field in several places: after the fields, the leaves' count, then each leaf's field
FLAG_POSITIONS = 16
# Structures a worker names by id (and the main process keeps, per worker). Most loaders
# have one; a batch whose leaves repeat one array in places that vary (``_one_field_per_
# object``: a pooled dataset's sample drawn twice into one batch) has a structure of its own.
STRUCTURES_KEPT = 64
INLINE = 0xFFFFFFFF  # a structure sent with its record and kept by no one


class PlanEncoder:
    """A worker's side: plans as records; each structure is sent once and then named by id."""

    def __init__(self) -> None:
        # structure -> its id, oldest first (dicts keep insertion order)
        self._structure_ids: dict[Any, int] = {}
        self._dtype_bytes: dict[tuple[np.dtype, str], bytes] = {}
        self._last: tuple[Any, bytes] = (None, b"")  # batches of one shape share a Plan

    def encode(self, plan: Plan, idx: int, slot: int, worker_id: int, segment: bool) -> bytes:
        key = (plan, idx, slot, worker_id, segment)
        last_key, record = self._last
        if last_key is not None and all(map(operator.is_, key, last_key)):
            return record
        record = self._encode(plan, idx, slot, worker_id, segment)
        self._last = (key, record)
        return record

    def _encode(self, plan: Plan, idx: int, slot: int, worker_id: int, segment: bool) -> bytes:
        try:
            ids = self._structure_ids
            sid = ids.get(plan.spec)
            structure = b""
            if sid is None:
                structure = _pickle_structure(plan.spec)
                # The oldest structure's id, once STRUCTURES_KEPT are named: the decoder
                # replaces what it kept under it as it reads this record.
                sid = len(ids) if len(ids) < STRUCTURES_KEPT else ids.pop(next(iter(ids)))
                ids[plan.spec] = sid
        except TypeError:  # a structure that does not hash (unhashable keys): send it each time
            sid, structure = INLINE, _pickle_structure(plan.spec)
        positions = plan.positions
        flags = (FLAG_TORCH if plan.torch else 0) | (FLAG_SEGMENT if segment else 0) | (
            FLAG_COLLATED if plan.collated else 0) | (FLAG_CONVERTED if plan.converted else 0) | (
            FLAG_POSITIONS if positions is not None else 0)
        parts = [RECORD_MAGIC, HEADER.pack(idx, slot, worker_id, 0, flags, len(plan.fields), sid,
                                           len(structure), plan.nbytes, plan.objects_offset,
                                           plan.objects_len), structure]
        dtype_bytes, append = self._dtype_bytes, parts.append
        for f in plan.fields:
            key = (f.dtype, f.torch_dtype)
            descr = dtype_bytes.get(key)
            if descr is None:
                descr = dtype_bytes[key] = _dtype_descr(f.dtype) + f.torch_dtype.encode()
            shape = f.shape
            append(_FIELD.pack(f.offset, f.kind, len(shape), len(descr)))
            append(descr)
            append(_shape_struct(len(shape)).pack(*shape))
        if positions is not None:
            append(_shape_struct(len(positions) + 1).pack(len(positions), *positions))
        return b"".join(parts)


def _pickle_structure(spec: Any) -> bytes:
    try:
        return pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise LayoutError(
            f"the batch's structure cannot be pickled to the main process ({exc}): a dict, "
            "namedtuple or dataclass type in it cannot be pickled; define that type at module "
            "level (not inside a function)") from exc


def _load_structure(pickled: bytes, idx: int, worker_id: int) -> Any:
    try:
        return pickle.loads(pickled)
    except (AttributeError, ImportError) as exc:  # a type the worker has and we have not
        raise LayoutError(
            f"batch idx={idx} from worker {worker_id} has a structure the main process cannot "
            f"rebuild ({exc}): a namedtuple, dataclass or Mapping type in it exists in the "
            "worker but cannot be imported here; define that type at module level of a module "
            "the main process imports (not in worker_init_fn or in code only workers run)"
        ) from exc


@dataclass(frozen=True)
class Record:
    """A decoded worker record: batch ``idx`` is in ``slot`` (or a segment) with ``plan``;
    ``ended``: the worker's iterator ended instead (no batch)."""

    idx: int
    slot: int
    worker_id: int
    ended: bool
    segment: bool
    plan: Plan | None


class PlanDecoder:
    """The main process's side, one per worker (structure ids are per worker)."""

    def __init__(self) -> None:
        self._structures: dict[int, Any] = {}
        self._dtypes: dict[bytes, tuple[np.dtype, str]] = {}  # descriptor -> (dtype, torch)

    @property
    def kept(self) -> int:
        """Structures kept (at most ``STRUCTURES_KEPT``)."""
        return len(self._structures)

    def decode(self, payload: bytes) -> Record:
        if payload[:1] != RECORD_MAGIC or len(payload) < 1 + HEADER.size:
            raise ValueError(f"not a batch record ({len(payload)} bytes starting "
                             f"{payload[:8]!r})")
        (idx, slot, worker_id, status, flags, nfields, sid, structure_len, nbytes,
         objects_offset, objects_len) = HEADER.unpack_from(payload, 1)
        if status == 1:
            return Record(idx, slot, worker_id, True, False, None)
        pos = 1 + HEADER.size
        if structure_len:
            spec = _load_structure(payload[pos: pos + structure_len], idx, worker_id)
            pos += structure_len
            if sid != INLINE:
                self._structures[sid] = spec
        else:
            spec = self._structures[sid]
        fields = []
        dtypes, field_size, unpack_field = self._dtypes, _FIELD.size, _FIELD.unpack_from
        for _ in range(nfields):
            offset, kind, ndim, descr_len = unpack_field(payload, pos)
            pos += field_size
            descr = payload[pos: pos + descr_len]
            pos += descr_len
            known = dtypes.get(descr)
            if known is None:
                dtype_bytes, _, raw = bytes(descr).partition(b"\0")
                known = dtypes[descr] = (_dtype_from_descr(dtype_bytes), raw.decode())
            shape = _shape_struct(ndim).unpack_from(payload, pos)
            pos += 8 * ndim
            fields.append(FieldPlacement(known[0], shape, offset, kind, known[1]))
        positions = None
        if flags & FLAG_POSITIONS:
            (count,) = _shape_struct(1).unpack_from(payload, pos)
            positions = _shape_struct(count).unpack_from(payload, pos + 8)
            pos += 8 * (count + 1)
        if pos != len(payload):
            raise ValueError(f"batch record of {len(payload)} bytes has {len(payload) - pos} "
                             "bytes after its last field")
        plan = Plan(spec, tuple(fields), objects_offset, objects_len, nbytes,
                    bool(flags & FLAG_TORCH), bool(flags & FLAG_COLLATED),
                    bool(flags & FLAG_CONVERTED), positions=positions)
        return Record(idx, slot, worker_id, False, bool(flags & FLAG_SEGMENT), plan)


_SHAPE_STRUCTS: dict[int, struct.Struct] = {}


def _shape_struct(ndim: int) -> struct.Struct:
    packer = _SHAPE_STRUCTS.get(ndim)
    if packer is None:
        packer = _SHAPE_STRUCTS[ndim] = struct.Struct(f"<{ndim}q")
    return packer


def _dtype_descr(dtype: np.dtype) -> bytes:
    # Simple dtypes by their str ('<f4', '<U12'); structured ones pickled. A NUL ends it.
    if dtype.fields is None and dtype.subdtype is None:
        return dtype.str.encode() + b"\0"
    return b"P" + pickle.dumps(dtype).hex().encode() + b"\0"


def _dtype_from_descr(descr: bytes) -> np.dtype:
    if descr[:1] == b"P":
        return pickle.loads(bytes.fromhex(descr[1:].decode()))
    return np.dtype(descr.decode())

