"""trial17 harness, shared by every script here.

Two halves:

* ``keep_run``: a kept-reference run (s1, s2). Batches come from an ArenaLoader with few
  slots; at chosen batches a *consumer* (a function of the batch) makes an object and the
  script drops every reference of its own (``del batch``, ``gc.collect()``), keeps iterating
  so the slot would be reused, and then compares the kept object's bytes with a copy made at
  the time: before and after the loader is closed and deleted (persistent workers: deleted
  without close(), so its finalizer cleans up). It also records whether the object aliases
  the batch's memory, whether it keeps the batch's lease alive, and whether dropping it
  frees the slot.
* ``compare``: one dataset through torch's DataLoader and ArenaLoader with the same options,
  every batch compared by raw bytes, dtype, shape and structure, errors by type (s3-s6).

After every ArenaLoader run: no child process of this script (``psutil``, recursive) and no
new ``/dev/shm`` name with the loader's prefix (``arena_loader._slab.NAME_PREFIX``).
"""

from __future__ import annotations

import collections
import faulthandler
import gc
import os
import sys
import time
import warnings

import numpy as np
import psutil
import torch
from torch.utils.data import DataLoader

from arena_loader import ArenaLoader
from arena_loader._slab import NAME_PREFIX

faulthandler.dump_traceback_later(float(os.environ.get("TRIAL_TIMEOUT", 240)), exit=True)
SEED = 1234
# torch.from_numpy / default_collate on libraries' read-only arrays (polars' and arrow's
# to_numpy views), in the main process and in workers (which import this module too)
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
ONLY = sys.argv[1] if len(sys.argv) > 1 else ""  # run only the cases whose name contains it


# --- what a run leaves behind ------------------------------------------------------------------
def _not_ours(proc: psutil.Process) -> bool:
    """multiprocessing's forkserver / resource tracker: started once per program, shared by
    every loader (and torch's), not a worker of one loader."""
    try:
        line = " ".join(proc.cmdline())
    except psutil.Error:
        return True
    return "forkserver" in line or "resource_tracker" in line


def shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(NAME_PREFIX)}


def leftovers(shm_before: set[str], seconds: float = 5.0) -> list[str]:
    """Children (any state, zombies included) and new prefixed /dev/shm names, polled for up
    to ``seconds`` (a worker may still be exiting)."""
    deadline = time.monotonic() + seconds
    while True:
        gc.collect()
        kids = [p for p in psutil.Process().children(recursive=True) if not _not_ours(p)]
        new = sorted(shm_names() - shm_before)
        if (not kids and not new) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    found = []
    if kids:
        found.append("children " + ", ".join(f"{p.pid}:{_status(p)}" for p in kids))
    if new:
        found.append(f"/dev/shm {new}")
    return found


def _status(proc: psutil.Process) -> str:
    try:
        return proc.status()
    except psutil.Error:
        return "gone"


class Tally:
    """Prints one line per case and counts verdicts."""

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self.batches = 0
        self.started = time.monotonic()

    def add(self, verdict: str, name: str, detail: str = "") -> None:
        self.counts[verdict] += 1
        elapsed = time.monotonic() - self.started
        print(f"{verdict:10} {name}  {detail}  [{elapsed:.0f} s]".rstrip(), flush=True)

    def leaks(self, name: str, shm_before: set[str]) -> None:
        for found in leftovers(shm_before):
            self.add("LEAK", name, found)

    def done(self) -> None:
        parts = " ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))
        print(f"RESULTS {parts} batches={self.batches} "
              f"seconds={time.monotonic() - self.started:.0f}", flush=True)


def wants(name: str) -> bool:
    return ONLY in name


# --- raw bytes of leaves ----------------------------------------------------------------------
def as_numpy(leaf) -> np.ndarray:
    return leaf.detach().numpy() if isinstance(leaf, torch.Tensor) else np.asarray(leaf)


def raw(leaf) -> bytes:
    """A tensor's or array's bytes in C order (bfloat16 through its int16 view)."""
    if isinstance(leaf, torch.Tensor):
        t = leaf.detach().contiguous()
        if t.dtype in (torch.bfloat16, torch.bool) or t.is_quantized:
            t = t.view(torch.uint8) if t.dtype is torch.bool else t.view(torch.int16)
        return t.numpy().tobytes()
    return np.ascontiguousarray(leaf).tobytes()


def address(leaf) -> int:
    if isinstance(leaf, torch.Tensor):
        return leaf.data_ptr()
    return np.asarray(leaf).__array_interface__["data"][0]


def leaves(batch) -> dict[str, object]:
    """The batch's array/tensor leaves by key (the scripts' batches are flat dicts)."""
    return {k: v for k, v in batch.items() if isinstance(v, (np.ndarray, torch.Tensor))}


# --- kept-reference runs ----------------------------------------------------------------------
class Frames:
    """Samples whose bytes name their index: a reused slot shows as changed bytes.
    ``scale`` multiplies the image's width: set it between epochs to make batches outgrow
    the slab (non-persistent workers are forked again each epoch and see the new value)."""

    def __init__(self, n: int = 24, scale: int = 1) -> None:
        self.n, self.scale = n, scale

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        w = 8 * self.scale
        img = (np.arange(3 * 8 * w, dtype=np.float32).reshape(3, 8, w) + 1000.0 * i)
        return {"img": img, "lbl": i, "u8": ((np.arange(40) + 7 * i) % 256).astype(np.uint8)}


class Consumer:
    """``keep(batch)`` makes the object a library would keep; ``read(obj)`` gives its bytes
    per key (compared with the batch's bytes at keep time); ``addresses(obj)`` its data
    pointers per key where it has one (to tell aliasing from copying)."""

    def __init__(self, name, keep, read, addresses=None, outputs=("numpy", "torch"),
                 control=False):
        self.name, self.keep, self.read, self.addresses = name, keep, read, addresses
        self.outputs = outputs
        # The negative control keeps no lease: it must see reused slots (and is not read
        # after close, where its raw pointers would read unmapped memory).
        self.control = control


def per_leaf(name, make, to_bytes, to_address=None, **kw) -> Consumer:
    """A consumer applied to each array leaf of the batch."""
    return Consumer(
        name,
        lambda batch: {k: make(v) for k, v in leaves(batch).items()},
        lambda obj: {k: to_bytes(v) for k, v in obj.items()},
        (lambda obj: {k: to_address(v) for k, v in obj.items()}) if to_address else None,
        **kw,
    )


KEEP_CONFIGS = [
    # (label, num_workers, slots, persistent, grow): grow makes epoch 1's batches 3x larger
    # (one-off segments, then a larger slab from epoch 2 on) while epoch 0's are kept.
    ("nw0-s2", 0, 2, False, False),
    ("nw0-s3-grow", 0, 3, False, True),
    ("nw2-s2-grow", 2, 2, False, True),
    ("nw2-s3-persist", 2, 3, True, False),
]


def _changed(consumer, kept) -> tuple[int, list[str]]:
    changed, notes = 0, []
    for obj, ref, where in kept:
        got = consumer.read(obj)
        bad = [k for k in ref if got.get(k) != ref[k]]
        if bad:
            changed += 1
            notes.append(f"{where}:{','.join(bad)}")
    return changed, notes


def keep_run(tally: Tally, consumer: Consumer, output: str, config, context=None) -> None:
    label, nw, slots, persistent, grow = config
    name = f"{consumer.name} [{output} {label}{' ' + context if context else ''}]"
    if not wants(name):
        return
    before = shm_names()
    dataset = Frames()
    loader = ArenaLoader(dataset, batch_size=4, shuffle=True, num_workers=nw, slots=slots,
                         persistent_workers=persistent, output=output,
                         generator=torch.Generator().manual_seed(SEED),
                         multiprocessing_context=context)
    kept, aliased, copied = [], 0, 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the held-batch warning: holding is the point
            for epoch in range(3):
                dataset.scale = 3 if grow and epoch >= 1 else 1
                for k, batch in enumerate(loader):
                    tally.batches += 1
                    if k == 1 + epoch:
                        ref = {key: raw(v) for key, v in leaves(batch).items()}
                        ptrs = {key: address(v) for key, v in leaves(batch).items()}
                        obj = consumer.keep(batch)
                        if consumer.addresses:
                            same = [consumer.addresses(obj).get(key) == p
                                    for key, p in ptrs.items()]
                            aliased += all(same)
                            copied += not any(same)
                        kept.append((obj, ref, f"e{epoch}b{k}"))
                        del obj, ref, ptrs
                    del batch
                    gc.collect()
            held = loader.snapshot().held_batches
            reuses = sum(loader.snapshot().slot_leases)
            changed, notes = _changed(consumer, kept)
            kept.pop()  # the last kept batch (current slab): dropping it must free its slot
            gc.collect()
            released = held - loader.snapshot().held_batches
            after_close, notes2 = 0, []
            if not persistent:
                loader.close()
            del loader  # persistent: no close(), the loader's finalizer cleans up
            gc.collect()
            if not consumer.control:
                after_close, notes2 = _changed(consumer, kept)
    except Exception as exc:  # a consumer that fails is a finding too
        tally.add("ERROR", name, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        kept.clear()
        tally.leaks(name, before)
        return
    alias = (f"aliased {aliased}/{len(kept) + 1} copied {copied}/{len(kept) + 1}"
             if consumer.addresses else "aliasing n/a")
    detail = (f"kept {len(kept) + 1} held-leases {held} released-on-drop {released}"
              f" slot-leases {reuses} {alias}"
              f" changed-open {changed} changed-after-close {after_close}"
              f"{' ' + ' '.join(notes + notes2) if notes or notes2 else ''}")
    if consumer.control:
        tally.add("CONTROL-SAW-REUSE" if changed else "CONTROL-BLIND", name, detail)
    else:
        tally.add("CHANGED" if changed or after_close else "INTACT", name, detail)
    kept.clear()
    gc.collect()
    tally.leaks(name, before)


def keep_all(consumers, contexts=(None,)) -> None:
    gc.freeze()  # the imports' objects: gc.collect() per batch took 130 ms with them
    tally = Tally()
    for consumer in consumers:
        for output in consumer.outputs:
            for config in KEEP_CONFIGS:
                for context in (contexts if config[1] else (None,)):
                    keep_run(tally, consumer, output, config, context)
    tally.done()


# --- torch's DataLoader beside ArenaLoader ------------------------------------------------------
def canon(x, strict: bool):
    """A comparable form: structure, types (``strict``: tensor vs ndarray, list vs tuple),
    dtypes, shapes and raw bytes."""
    if isinstance(x, (torch.Tensor, np.ndarray, np.generic)):
        kind = type(x).__name__ if strict else "array"
        dtype = str(x.dtype).replace("torch.", "")
        return (kind, dtype, tuple(x.shape), raw(x))
    if hasattr(x, "tensordicts") and hasattr(x, "stack_dim"):  # a LazyStackedTensorDict
        return (type(x).__name__, x.stack_dim, tuple(canon(t, strict) for t in x.tensordicts))
    if hasattr(x, "batch_size") and hasattr(x, "to_dict"):  # a TensorDict / tensorclass
        items = x.to_dict() if type(x).__name__ != "TensorDict" else dict(x.items())
        return (type(x).__name__, tuple(x.batch_size), canon(items, strict))
    if isinstance(x, collections.abc.Mapping):
        return (type(x).__name__ if strict else "map",
                tuple((k, canon(v, strict)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__ if strict else "seq", tuple(canon(v, strict) for v in x))
    return (type(x).__name__, repr(x))


def first_diff(a, b, path="batch") -> str:
    if type(a) is tuple and type(b) is tuple and len(a) == len(b) and a[:1] == b[:1]:
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return first_diff(x, y, f"{path}.{i}")
    return f"{path}: torch {str(a)[:160]} | ours {str(b)[:160]}"


def collect(loader, epochs: int, strict=None) -> list:
    """Every batch of ``epochs`` epochs, canonical (``strict`` given) or as it came (None:
    torch's batches, kept to be put in both forms), then ("RAISED", type, first line) if
    the loader raised."""
    out = []
    try:
        for _ in range(epochs):
            out.extend(batch if strict is None else safe_canon(batch, strict)
                       for batch in loader)
    except Exception as exc:
        out.append(("RAISED", type(exc), str(exc).splitlines()[0][:160] if str(exc) else ""))
    return out


def _canon_all(batches: list, strict: bool) -> list:
    return [b if type(b) is tuple and b[:1] == ("RAISED",) else safe_canon(b, strict)
            for b in batches]


def safe_canon(batch, strict: bool):
    """canon(), or what failed in reading the batch (a harness failure, never counted as the
    loader raising: compared as data, so it must fail alike on both sides)."""
    try:
        return canon(batch, strict)
    except Exception as exc:
        return ("CANON-FAILED", type(exc).__name__, str(exc)[:120])


def verdict(torch_out: list, ours: list) -> tuple[str, str]:
    t_err = torch_out[-1][0] == "RAISED" if torch_out else False
    o_err = ours[-1][0] == "RAISED" if ours else False
    if t_err and o_err:
        if torch_out[:-1] != ours[:-1]:
            return "DIFF", "batches before the error differ"
        same_type = issubclass(ours[-1][1], torch_out[-1][1])
        return ("BOTH-ERR" if same_type else "ERR-TYPE",
                f"torch {torch_out[-1][1].__name__}: {torch_out[-1][2][:90]} | ours "
                f"{ours[-1][1].__name__}: {ours[-1][2][:90]}")
    if t_err or o_err:
        side = torch_out if t_err else ours
        return "ONE-ERR", f"{'torch' if t_err else 'ours'} {side[-1][1].__name__}: {side[-1][2]}"
    if len(torch_out) != len(ours):
        return "DIFF", f"{len(torch_out)} batches vs {len(ours)}"
    for i, (a, b) in enumerate(zip(torch_out, ours)):
        if a != b:
            return "DIFF", f"batch {i}: {first_diff(a, b)}"
    return "SAME", f"{len(ours)} batches"


LOADER_CONFIGS = [
    # (label, options for both loaders, options for ArenaLoader only). Every one but the last
    # shuffles with a seeded torch.Generator; torch runs each with num_workers as given.
    ("nw0", {"num_workers": 0}, {}),
    ("nw2-droplast", {"num_workers": 2, "drop_last": True}, {}),
    ("nw2-persist", {"num_workers": 2, "persistent_workers": True}, {}),
    ("nw2-persist-wt3", {"num_workers": 2, "persistent_workers": True}, {"worker_threads": 3}),
    ("nw2-wt1-seq-droplast", {"num_workers": 2, "drop_last": True, "shuffle": False},
     {"worker_threads": 1}),
]
def forkserver(configs):
    """The same configs, workers started by forkserver (both loaders): for libraries whose
    threads do not survive fork (polars' pool, lance's runtime)."""
    return [(label, {**both, "multiprocessing_context": "forkserver"} if both["num_workers"]
             else both, ours) for label, both, ours in configs]


# Cases where both loaders raise: torch's iterator that raised takes ~10 s to shut its
# workers down (trial13's s17), so these run with and without workers, not every config.
ERROR_CONFIGS = [LOADER_CONFIGS[0], LOADER_CONFIGS[3]]


def compare(tally: Tally, name: str, make_dataset, epochs: int = 2, configs=LOADER_CONFIGS,
            outputs=(None, "torch"), torch_types: bool = True, **options) -> None:
    """``make_dataset()`` gives a fresh dataset per loader; ``options`` go to both loaders.
    Batches of ``output="torch"`` are compared with their types (tensor vs ndarray, list vs
    tuple) unless ``torch_types`` is False: a collate_fn's numpy arrays, which "torch"
    makes tensors by design (README), still compared by dtype, shape and bytes."""
    for label, both, ours_only in configs:
        case = f"{name} [{label}]"
        if not wants(case):
            continue
        opts = {"batch_size": 4, "shuffle": True, **options, **both}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loader = DataLoader(make_dataset(), **opts,
                                generator=torch.Generator().manual_seed(SEED))
            batches = collect(loader, epochs)
            del loader
        reference = {strict: _canon_all(batches, strict) for strict in (False, True)}
        del batches
        for found in leftovers(set(), seconds=5.0):  # torch's workers gone before ours start
            print(f"           (torch's DataLoader left {found})", flush=True)
        for output in outputs:
            before = shm_names()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loader = ArenaLoader(make_dataset(), **opts, **ours_only, output=output,
                                     generator=torch.Generator().manual_seed(SEED))
                ours = collect(loader, epochs, output == "torch" and torch_types)
                loader.close()
                del loader
            ref = reference[output == "torch" and torch_types]
            tally.batches += sum(1 for b in ours if b[0] != "RAISED")
            tally.add(*_named(verdict(ref, ours), f"{case} output={output}"))
            tally.leaks(case, before)


def _named(result: tuple[str, str], name: str) -> tuple[str, str, str]:
    return result[0], name, result[1]
