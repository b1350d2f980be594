"""Randomized chaos soak: random loader options x random faults, each scenario in a fresh child.

Run from the repository root::

    python benchmarks/chaos.py --seconds 600 --seed 1     # scenarios until 600 s have passed
    python benchmarks/chaos.py --only 123456789 -v        # rerun one scenario by its seed

Each scenario's seed is drawn from ``--seed`` and printed; the scenario (options, dataset,
actions) is a function of its seed alone, so ``--only SEED`` replays it (timing-dependent
faults -- a Ctrl-C's moment, a worker killed while busy or idle -- may land differently).
A scenario runs in a child process (``--child SEED``, a new session) with a hard wall-clock
limit (``--limit``, 60 s): past it, the child and its workers dump every thread's stack
(``faulthandler`` on SIGUSR1) and are killed, and the scenario is reported as a HANG.

Randomized: ``num_workers`` 0-3, ``worker_mode`` process/thread, ``worker_threads`` 1-4,
``persistent_workers``, ``prefetch_factor``, ``slots``, ``batch_size``, ``drop_last``,
``shuffle`` with a seeded generator, ``in_order``, ``output`` numpy/torch, ``pin_memory``
(torch's pinning faked as a copy, as tests/conftest.py's ``fake_pinning``, so the pin thread
runs), ``held_batch_limit``, ``timeout``; map-style or iterable datasets; fixed-shape,
variable-length (padded by a ``collate_fn``: batches outgrow their slots, the slab regrows),
dict and tuple samples with strings, a stacking ``collate_fn``. Per epoch one action: a whole
epoch, ``break`` then a new ``iter()``, ``state_dict()`` mid-epoch then resume in a new loader,
``close()`` from another thread, SIGKILL / SIGTERM / SIGSTOP+SIGCONT of a worker, a sample
that raises, a slow sample under ``timeout``; Ctrl-Cs (a real SIGINT, ``pthread_kill`` of the
main thread or ``os.kill`` of the process, at random moments) on top of most of them, caught
around the loop, which goes on with the same iterator; batches kept alive across epochs.
Also (benchmarks/chaos_more.py holds what spawned workers import): a user sampler (a
``batch_sampler`` list of uneven index lists, a sampler whose ``__iter__`` is a generator,
``SubsetRandomSampler`` / ``WeightedRandomSampler`` on a seeded generator, a hand-set
``DistributedSampler`` with ``set_epoch``), a dataset with ``__getitems__``, a
``worker_init_fn`` recording each worker's seeds (and, for one epoch, raising),
``multiprocessing_context`` spawn / forkserver (rare, small, no fault switches: spawn loses the
anonymous mapping), ``device="cuda"`` under numba's CUDA simulator (rare; whole epochs,
break, kept batches, Ctrl-C, ``close()``, resume); and the actions ``interleave`` (a second
loader of its own options iterated in turn with this one), ``abandon`` (the iterator dropped
mid-epoch in a reference cycle, freed by ``gc.collect()``), ``dropload`` (a new loader dropped
mid-epoch while its iterator goes on), ``fork`` (a user ``os.fork()`` mid-epoch: the child
reads every kept batch and leaves by ``os._exit``) and ``stateend`` (``state_dict()`` after the
epoch's end, loaded into a new loader; after an epoch a worker's crash ended early, the new
loader must give the rest of that epoch, as torchdata's StatefulDataLoader does).

Checked: every batch's contents match its samples (each sample encodes its index); the batches
of an epoch are the reference's for their positions (torch's ``randperm`` on the generator's
state at ``iter()``; for iterable datasets, torch's round-robin over the workers' shards), or,
with ``in_order=False``, the same multiset; a fault gives its documented outcome (error type,
the sample named, batches before it first, nothing lost or repeated around a Ctrl-C or a
timeout, a crash raised again by the next ``next()``); kept batches never change (also after
``close()``); after ``close()`` no child process, ``arena_loader`` thread, ``/dev/shm`` name or
mapping of ours; after the child exits (checked by this parent) no process of its session and
no ``/dev/shm`` name of its pids. A user sampler's epoch is what torch's DataLoader
(``num_workers=0``, an index-only dataset) yields from a twin of the sampler in the state it was
in at ``iter()`` (batches may repeat: multisets are compared as counts); workers' seeds follow
torch's rule (``get_worker_info().seed`` = base seed + id, the base seed torch's draw from the
loader's generator or torch's global RNG at ``iter()``; in a process worker
``torch.initial_seed()`` and ``random`` too); a raising ``worker_init_fn`` gives its one
``ValueError`` (batches before it a prefix), raised again by the next ``next()``; the workers
of an abandoned (non-persistent) iterator, or of a dropped loader and iterator, exit; a forked
child sees every kept batch unchanged and exits within 10 s; an epoch after a state loaded at
the end is the one the old loader's generators give. Anything else raised is a failure.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__" and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import chaos_more as more  # noqa: E402
import numpy as np  # noqa: E402

SHM_DIR = "/dev/shm"
PREFIX = "arena_loader_"

# -- samples: each encodes its index, so any batch can be checked on its own ----------------


def values(index: int, n: int) -> np.ndarray:
    out = (np.arange(n, dtype=np.int64) * 7 + index * 1000003) % 251
    out[0] = index
    return out


def var_len(index: int, width: int) -> int:
    return 1 + (index * 37) % width


def make_sample(index: int, kind: str, width: int) -> Any:
    if kind == "var":
        return values(index, var_len(index, width))
    if kind == "dict":
        return {"x": values(index, width), "label": index, "name": f"s{index}",
                "pair": (values(index, 3).astype(np.float32), index * 0.5)}
    if kind == "tuple":
        return (values(index, width), f"n{index}")
    return values(index, width)


class Knobs:
    """Switches shared with every worker (an anonymous shared mapping, inherited by fork):
    whether the bad sample raises, whether the slow one sleeps, a delay for every sample."""

    def __init__(self) -> None:
        import mmap

        self._map = mmap.mmap(-1, 64)
        self.v = np.frombuffer(self._map, np.float64, count=3)

    def set(self, bad: bool = False, slow: bool = False, delay: float = 0.0) -> None:
        self.v[:] = (float(bad), float(slow), delay)


KNOBS = Knobs()


class MapData:
    """Map-style: ``bad`` indices raise ValueError, ``slow`` sleeps ``slow_s`` (when armed)."""

    def __init__(self, n: int, kind: str, width: int, bad: tuple = (), slow: int = -1,
                 slow_s: float = 0.0):
        self.n, self.kind, self.width = n, kind, width
        self.bad, self.slow, self.slow_s = frozenset(bad), slow, slow_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        bad, slow, delay = KNOBS.v
        if delay:
            time.sleep(delay)
        if bad and index in self.bad:
            raise ValueError(f"chaos: sample {index} is bad")
        if slow and index == self.slow:
            time.sleep(self.slow_s)
        return make_sample(index, self.kind, self.width)


class BatchedData(MapData):
    """Map-style with ``__getitems__`` (torch's batched fetch): one call per batch."""

    def __getitems__(self, indices: list) -> list:
        return [self[i] for i in indices]


def _stream_base() -> type:
    import torch.utils.data

    class StreamData(torch.utils.data.IterableDataset):
        """Iterable-style: worker w of W yields the indices i with i % W == w, in order."""

        def __init__(self, n: int, kind: str, width: int):
            self.n, self.kind, self.width = n, kind, width

        def __iter__(self):
            from arena_loader import get_worker_info

            info = get_worker_info()
            wid, count = (0, 1) if info is None else (info.id, info.num_workers)
            return Shard(self, wid, count)

    return StreamData


class Shard:
    """An iterator object, not a generator: a Ctrl-C raised inside a generator finishes it
    (Python's rule, which no loader can undo), here it leaves the position as it was."""

    def __init__(self, data: Any, start: int, step: int):
        self.data, self.next_index, self.step = data, start, step

    def __iter__(self) -> Shard:
        return self

    def __next__(self) -> Any:
        if self.next_index >= self.data.n:
            raise StopIteration
        if KNOBS.v[2]:
            time.sleep(KNOBS.v[2])
        index = self.next_index
        sample = make_sample(index, self.data.kind, self.data.width)
        self.next_index = index + self.step
        return sample


def pad_collate(samples: list) -> dict:
    longest = max(len(s) for s in samples)
    out = np.full((len(samples), longest), -1, dtype=np.int64)
    for row, sample in enumerate(samples):
        out[row, :len(sample)] = sample
    return {"x": out, "len": np.array([len(s) for s in samples], dtype=np.int64)}


def stack_collate(samples: list) -> dict:
    return {"x": np.stack(samples), "tag": "stacked"}


# -- checking batches ---------------------------------------------------------------------


class CorruptError(AssertionError):
    pass


def to_np(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "copy_to_host"):  # a (simulated) numba device array
        return value.copy_to_host()
    if hasattr(value, "numpy") and hasattr(value, "is_cuda"):
        return value.numpy()
    return value


def deep_copy(batch: Any) -> Any:
    if isinstance(batch, dict):
        return {k: deep_copy(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return [deep_copy(v) for v in batch]
    value = to_np(batch)
    return np.array(value, copy=True) if isinstance(value, np.ndarray) else value


def same(a: Any, b: Any) -> bool:
    a, b = to_np(a), to_np(b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(
            same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b))
    return a == b


def _rows(x: Any, width: int) -> list[int]:
    x = np.asarray(to_np(x))
    if x.ndim != 2 or x.shape[1] != width:
        raise CorruptError(f"rows of shape {x.shape}, expected (*, {width})")
    indices = [int(i) for i in x[:, 0]]
    for row, index in zip(x, indices):
        if not np.array_equal(row, values(index, width)):
            raise CorruptError(f"row for sample {index} holds {row[:8]}...")
    return indices


def decode(batch: Any, kind: str, width: int, collate: str | None) -> tuple[int, ...]:
    """The sample indices in ``batch``, after checking every field against them."""
    if kind == "var":
        x, lens = np.asarray(to_np(batch["x"])), np.asarray(to_np(batch["len"]))
        indices = [int(i) for i in x[:, 0]]
        for row, index, length in zip(x, indices, lens):
            if length != var_len(index, width) or not np.array_equal(
                    row[:length], values(index, length)) or (row[length:] != -1).any():
                raise CorruptError(f"padded row for sample {index} (len {length}) holds {row[:8]}")
        if x.shape[1] != max(lens):
            raise CorruptError(f"padded to {x.shape[1]}, longest is {max(lens)}")
        return tuple(indices)
    if collate == "stack":
        if batch.get("tag") != "stacked":
            raise CorruptError(f"tag {batch.get('tag')!r}")
        return tuple(_rows(batch["x"], width))
    if kind == "dict":
        indices = _rows(batch["x"], width)
        labels = [int(v) for v in np.asarray(to_np(batch["label"]))]
        pair_x, halves = batch["pair"]
        ok = (labels == indices and list(batch["name"]) == [f"s{i}" for i in indices]
              and np.array_equal(np.asarray(to_np(pair_x)),
                                 np.stack([values(i, 3).astype(np.float32) for i in indices]))
              and [float(v) for v in np.asarray(to_np(halves))] == [i * 0.5 for i in indices])
        if not ok:
            raise CorruptError(f"dict batch of samples {indices}: fields disagree")
        return tuple(indices)
    if kind == "tuple":
        x, names = batch
        indices = _rows(x, width)
        if list(names) != [f"n{i}" for i in indices]:
            raise CorruptError(f"names {list(names)[:4]} for samples {indices}")
        return tuple(indices)
    return tuple(_rows(batch, width))


# -- the scenario -----------------------------------------------------------------------------


def draw_scenario(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    iterable = rng.random() < 0.2
    workers = rng.choice([0, 1, 2, 2, 3])
    mode = "thread" if workers and not iterable and rng.random() < 0.35 else "process"
    threads = rng.choice([1, 1, 2, 3, 4]) if workers and not iterable else 1
    kind = rng.choice(["fixed", "fixed", "var", "dict", "tuple"])
    collate = "pad" if kind == "var" else ("stack" if kind == "fixed" and rng.random() < 0.3
                                          else None)
    width = rng.choice([3, 16, 300, 5000]) if kind != "var" else rng.choice([8, 64, 3000])
    output = rng.choice(["numpy", "torch"])
    s = {
        "seed": seed, "iterable": iterable, "num_workers": workers, "worker_mode": mode,
        "worker_threads": threads, "kind": kind, "collate": collate, "width": width,
        "n": rng.randrange(5, 90), "batch_size": rng.choice([1, 2, 3, 4, 5, 8]),
        "drop_last": rng.random() < 0.3,
        "shuffle": (not iterable) and rng.random() < 0.6,
        "persistent_workers": bool(workers) and rng.random() < 0.5,
        "prefetch_factor": rng.choice([None, 1, 2, 4]) if workers else None,
        "in_order": rng.random() < 0.8, "output": output,
        "pin_memory": output == "torch" and rng.random() < 0.25,
        "slots": rng.choice([None, None, 1, 2, 3, 4]),
        "held_batch_limit": rng.choice([None, None, 2, 3, 5]),
        "timeout": rng.choice([0, 0, 20.0]) if workers else 0,
        "gen_seed": rng.randrange(2 ** 31),
    }
    actions = ["full", "break", "keep", "ctrlc", "ctrlc", "bad", "state", "close"]
    if workers:
        actions += ["slow", "stopcont"]
        if mode == "process":
            actions += ["sigkill", "sigterm", "sigkill"]
    epochs = []
    for _ in range(rng.randint(2, 4)):
        action = rng.choice(actions)
        if s["iterable"] and action in ("bad", "slow"):
            action = "ctrlc"
        epochs.append({"action": action, "ctrlc": action == "ctrlc" or (
            action in ("full", "break", "keep", "bad", "state") and rng.random() < 0.3),
            "at": rng.random(), "delay": rng.uniform(0.0, 0.5), "r": rng.random(),
            "sigints": [rng.uniform(0.0, 0.08) for _ in range(rng.randint(1, 8))],
            "sample_delay": rng.choice([0.0, 0.0005, 0.002, 0.01]),
            "pthread": rng.random() < 0.5})
        if action == "close":
            break
    s["epochs"] = epochs
    draw_more(s, random.Random(f"more-{seed}"))
    bad = [e for e in epochs if e["action"] == "bad"]
    s["bad"] = [int(bad[0]["r"] * s["n"])] if bad else []
    slow = [e for e in epochs if e["action"] == "slow"]
    s["slow"] = int(slow[0]["r"] * s["n"]) if slow else -1
    if slow:
        s["timeout"] = 0.3
    return s


NEW_ACTIONS = ("interleave", "abandon", "dropload", "fork", "stateend")
SPAWN_FREE = ("bad", "slow")  # their switches are an anonymous mapping, which spawn loses
DEVICE_ACTIONS = ("full", "break", "keep", "ctrlc", "close", "state")


def draw_more(s: dict[str, Any], rng: random.Random) -> None:
    """The sixteenth session's widening, from a stream of its own (older seeds keep their
    options and actions where these leave them): user samplers, worker_init_fn, spawn and
    forkserver, the device leg, getitems, and the actions of NEW_ACTIONS."""
    workers, epochs = s["num_workers"], s["epochs"]
    with_sampler = not s["iterable"] and rng.random() < 0.35
    s["getitems"] = not s["iterable"] and rng.random() < 0.2
    s["context"] = None
    if s["worker_mode"] == "process" and workers and not s["iterable"] and rng.random() < 0.06:
        s.update(context=rng.choice(["spawn", "forkserver"]), num_workers=min(workers, 2),
                 n=min(s["n"], 40))
    s["sampler"] = more.draw_sampler(rng, s["n"]) if with_sampler else None  # (n as cut)
    if s["sampler"]:
        s["shuffle"] = False
    s["device"] = None
    if s["context"] is None and rng.random() < 0.07:
        s.update(device="cuda", output="numpy", pin_memory=False)
    s["init"] = "seed" if s["num_workers"] and rng.random() < 0.35 else None
    for number, e in enumerate(epochs):
        if rng.random() < 0.3:
            e["action"] = rng.choice(NEW_ACTIONS)
            e["ctrlc"] = rng.random() < 0.3
        if s["init"] and rng.random() < 0.1:
            e["action"] = "initfail"
        if s["context"] and e["action"] in SPAWN_FREE:
            e["action"] = "full"
        if s["device"] and e["action"] not in DEVICE_ACTIONS:
            e["action"] = rng.choice(DEVICE_ACTIONS)
        if e["action"] == "interleave":
            e["other"] = {"num_workers": rng.choice([0, 1, 2]),
                          "batch_size": rng.choice([1, 2, 3, 5]),
                          "shuffle": not s["iterable"] and rng.random() < 0.5,
                          "gen_seed": rng.randrange(2 ** 31), "drop_last": rng.random() < 0.3,
                          "persistent_workers": rng.random() < 0.5}
            e["other"]["persistent_workers"] &= e["other"]["num_workers"] > 0
        if e["action"] == "close":
            del epochs[number + 1:]
            break


def loader_kwargs(s: dict[str, Any]) -> dict[str, Any]:
    kwargs = {k: s[k] for k in ("batch_size", "drop_last", "num_workers", "persistent_workers",
                                "prefetch_factor", "in_order", "output", "pin_memory", "slots",
                                "held_batch_limit", "timeout", "worker_mode", "worker_threads")}
    if s["shuffle"]:
        import torch

        kwargs["shuffle"] = True
        kwargs["generator"] = torch.Generator().manual_seed(s["gen_seed"])
    spec = s.get("sampler")
    if spec and spec["kind"] == "batch_list":
        kwargs.update(batch_size=1, drop_last=False)
    for key in ("context", "device"):
        if s.get(key):
            kwargs["multiprocessing_context" if key == "context" else key] = s[key]
    if s["collate"] == "pad":
        kwargs["collate_fn"] = pad_collate
    elif s["collate"] == "stack":
        kwargs["collate_fn"] = stack_collate
    return kwargs


def make_dataset(s: dict[str, Any]) -> Any:
    if s["iterable"]:
        return _stream_base()(s["n"], s["kind"], s["width"])
    data = BatchedData if s.get("getitems") else MapData
    return data(s["n"], s["kind"], s["width"], tuple(s["bad"]), s["slow"], 1.0)


def chunks(order: list[int], bs: int, drop_last: bool) -> list[tuple[int, ...]]:
    out = [tuple(order[i:i + bs]) for i in range(0, len(order), bs)]
    if drop_last and out and len(out[-1]) < bs:
        out.pop()
    return out


def references(s: dict[str, Any], gen_state: Any) -> list[list[tuple[int, ...]]]:
    """The epochs the loader may deliver: torch's draws from the generator's state at iter()
    (with and without the base-seed draw that a new, not a reused, worker iterator makes)."""
    n, bs, drop = s["n"], s["batch_size"], s["drop_last"]
    if s["iterable"]:
        count = max(1, s["num_workers"])
        shards = [chunks(list(range(w, n, count)), bs, drop) for w in range(count)]
        order = []
        for k in range(max(len(sh) for sh in shards)):
            order += [sh[k] for sh in shards if k < len(sh)]
        return [order]
    if not s["shuffle"]:
        return [chunks(list(range(n)), bs, drop)]
    import torch

    refs = []
    for base_draw in (True, False):
        g = torch.Generator()
        g.set_state(gen_state)
        if base_draw:
            torch.empty((), dtype=torch.int64).random_(generator=g)
        refs.append(chunks(torch.randperm(n, generator=g).tolist(), bs, drop))
    return refs


INTERRUPT_LOG: list[str] = []  # where each Ctrl-C raised inside the loader landed
_gate = False  # a SIGINT raises KeyboardInterrupt only while the loader runs (next())
_interrupts = {"raised": 0, "outside": 0}


def _on_sigint(signum: int, frame: Any) -> None:
    if _gate:
        _interrupts["raised"] += 1
        raise KeyboardInterrupt
    _interrupts["outside"] += 1  # it landed in the harness's own code: not the loader's


def _sigint_timer(delays: list[float], pthread: bool, stop: threading.Event) -> threading.Thread:
    main = threading.main_thread().ident

    def fire() -> None:
        for delay in delays:
            if stop.wait(delay):
                return
            if pthread:
                signal.pthread_kill(main, signal.SIGINT)
            else:
                os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=fire, name="chaos-sigint", daemon=True)
    thread.start()
    return thread


class FailureError(Exception):
    pass


class Run:
    def __init__(self, s: dict[str, Any], verbose: bool):
        self.s, self.verbose = s, verbose
        self.kept: list[tuple[Any, Any, str]] = []  # (batch, copy, where)
        self.seen_pids: set[int] = set()
        self.notes: list[str] = []
        self.pending_crash = False  # a killed worker may surface in a later epoch
        self.interrupted_at: list[int] = []  # batches received when each Ctrl-C was raised
        self.sampler: Any = None  # the user sampler of the loader made last
        self.seed_dir = ""
        if s.get("init"):
            import tempfile

            self.seed_dir = tempfile.mkdtemp(prefix="chaos_seeds_")
        self.fork_pid = 0
        self.worker_base = 0  # the base seed of the workers started last
        self.carried: Any = None  # (generator, sampler) states for the next expect()

    def log(self, text: str) -> None:
        if self.verbose:
            print(text, file=sys.stderr, flush=True)

    def new_loader(self) -> Any:
        from arena_loader import ArenaLoader

        kwargs = loader_kwargs(self.s)
        spec = self.s.get("sampler")
        if spec:
            self.sampler = more.make_sampler(spec, self.s["n"])
            kwargs["batch_sampler" if spec["kind"] == "batch_list" else "sampler"] = self.sampler
        if self.seed_dir:
            kwargs["worker_init_fn"] = more.init_fn(self.seed_dir)
        return ArenaLoader(make_dataset(self.s), **kwargs)

    def expect(self, loader: Any) -> tuple[list, list[int]]:
        """Before ``iter(loader)``: the epochs it may deliver, and torch's base seed for its
        workers (a draw from the loader's generator, or else torch's global RNG)."""
        import torch

        s = self.s
        gen = getattr(loader, "generator", None)
        gen_state = gen.get_state() if gen is not None else None
        sampler_state = more.sampler_state(self.sampler)
        if self.carried is not None:  # a state loaded at the epoch's end: the old loader's
            # generators (the epoch: set_epoch, called on this loader before this)
            (gen_state, (sampler_gen, _)), self.carried = self.carried, None
            sampler_state = (sampler_gen, sampler_state[1])
        bases = [more.torch_base_seed(gen_state if gen is not None else torch.get_rng_state())]
        if s.get("sampler"):
            return [more.sampler_reference(s["sampler"], s["n"], s["batch_size"],
                                           s["drop_last"], sampler_state)], bases
        return references(s, gen_state), bases

    def pull(self, it: Any) -> Any:
        """The next batch of ``it``, decoded (None at its end); a Ctrl-C is retried."""
        global _gate
        for _ in range(200):
            try:
                _gate = True
                batch = next(it)
            except StopIteration:
                return None
            except KeyboardInterrupt:
                continue
            finally:
                _gate = False
            return decode(batch, self.s["kind"], self.s["width"], self.s["collate"])
        raise FailureError("next() kept being interrupted")

    def check_kept(self, where: str) -> None:
        for batch, copy, made in self.kept:
            if not same(batch, copy):
                raise FailureError(f"a batch kept since {made} changed ({where})")

    def epoch(self, loader: Any, e: dict[str, Any], number: int) -> tuple[Any, bool]:
        """One epoch with action ``e``; returns (loader to go on with, whether to go on)."""
        global _gate
        from arena_loader import (
            LoaderClosedError,
            LoaderTimeoutError,
            SlotsExhaustedError,
            WorkerCrashedError,
        )

        s = self.s
        action = e["action"]
        if s.get("sampler") and s["sampler"]["kind"] == "distributed":
            loader.set_epoch(number)
        if self.seed_dir:
            more.read_seeds(self.seed_dir)  # (a resumed run's, not this epoch's)
            flag = Path(self.seed_dir, "fail")
            if action == "initfail":
                flag.touch()
            else:
                flag.unlink(missing_ok=True)
        if action in ("dropload", "interleave") and self.pending_crash:
            e = dict(e, action="full")  # a worker killed earlier surfaces: this loop's part
            action = "full"
        if action in ("dropload", "interleave"):
            return self.epoch_apart(loader, e, number)
        refs, bases = self.expect(loader)
        length = len(refs[0])
        at = max(1, int(e["at"] * length))  # batches delivered when the action happens
        KNOBS.set(bad=action == "bad", slow=action == "slow",
                  delay=e["sample_delay"] if e["ctrlc"] else 0.0)
        self.late_ok = self.pending_crash  # a worker killed earlier may surface this epoch
        try:
            it = iter(loader)
        except WorkerCrashedError:
            if not self.pending_crash:
                raise
            # the worker killed in an earlier epoch surfaced at iter(): the next one is new
            self.pending_crash = False
            self.notes.append(f"epoch {number}: a late crash raised by iter()")
            refs, bases = self.expect(loader)
            it = iter(loader)
        with contextlib.suppress(Exception):
            self.seen_pids.update(it.worker_pids)
        got: list[Any] = []  # index tuples, or ("error", type name, message, exc)
        self.interrupted_at = []
        stop = threading.Event()
        timers = []
        if e["ctrlc"]:
            timers.append(_sigint_timer(e["sigints"], e["pthread"], stop))
        if action == "close":
            def closer() -> None:
                if not stop.wait(e["delay"]):
                    loader.close()
            timers.append(threading.Thread(target=closer, name="chaos-close", daemon=True))
            timers[-1].start()
        state = None
        ended = "end"
        guard = 0
        try:
            while True:
                guard += 1
                if guard > 10 * length + 50:
                    raise FailureError(f"epoch {number}: next() keeps raising: {got[-3:]}")
                try:
                    _gate = True
                    for batch in it:
                        _gate = False
                        position = len(got)
                        got.append(decode(batch, s["kind"], s["width"], s["collate"]))
                        if action in ("keep", "fork") and len(self.kept) < self.keep_cap() and (
                                position % 3 == 0):
                            self.kept.append((batch, deep_copy(batch), f"epoch {number}"))
                        del batch
                        if position + 1 == at or (at == 0 and position == 0):
                            ended = self.act(loader, it, e)
                            if ended == "state":
                                state = loader.state_dict()
                            if ended in ("break", "state", "abandon"):
                                break
                        _gate = True
                    else:
                        _gate = False
                        break
                    _gate = False
                    break
                except KeyboardInterrupt as exc:
                    _gate = False
                    self.interrupted_at.append(len(got))
                    where = traceback.extract_tb(exc.__traceback__)[-3:]
                    INTERRUPT_LOG.append(f"epoch {number} after {len(got)} batches: " + " <- ".join(
                        f"{Path(f.filename).name}:{f.lineno} {f.name} `{f.line}`"
                        for f in reversed(where)))
                    del exc, where
                    continue
                except CorruptError:
                    raise
                except (ValueError, LoaderTimeoutError, WorkerCrashedError, LoaderClosedError,
                        SlotsExhaustedError) as exc:
                    _gate = False
                    got.append(("error", type(exc).__name__, str(exc)[:3000], exc))
                    init_failed = "worker_init_fn of worker" in str(exc)
                    if init_failed or isinstance(exc, (WorkerCrashedError, LoaderClosedError)):
                        self.check_raises_again(it, type(exc))
                        ended = "fatal"
                        break
                    if isinstance(exc, SlotsExhaustedError):
                        raise FailureError(f"epoch {number}: SlotsExhaustedError holding "
                                      f"{len(self.kept)} batches: {exc}") from exc
                    continue
        finally:
            _gate = False
            stop.set()
            for t in timers:
                t.join()
            KNOBS.set()
        pids = [p for p in getattr(it, "worker_pids", []) or [] if p != os.getpid()]
        if ended == "abandon":  # only the cyclic collector can free it now
            cycle = [it]
            cycle.append(cycle)
            del cycle
        del it
        gc.collect()
        if ended == "abandon" and not s["persistent_workers"]:
            alive = more.pids_gone(pids)
            if alive:
                raise FailureError(f"epoch {number}: workers {alive} of an iterator abandoned "
                                   "and collected are still running")
        if not (s["persistent_workers"] and s["num_workers"]):
            self.pending_crash = False  # its workers are gone with the epoch
        self.log(f"  epoch {number} {action}: got {len(got)} (ref {length}), "
                 f"ints {_interrupts}")
        try:
            self.judge(e, number, got, refs, at, ended)
        except FailureError as exc:
            snapshot = "?"
            with contextlib.suppress(Exception):
                snapshot = repr(loader.snapshot())
            raise FailureError(f"{exc}\n  Ctrl-Cs landed: {INTERRUPT_LOG}"
                               f"\n  snapshot: {snapshot}") from None
        self.check_kept(f"after epoch {number}")
        if self.fork_pid:
            pid, self.fork_pid = self.fork_pid, 0
            why = more.reap(pid)
            if why:
                raise FailureError(f"epoch {number}: {why}")
        self.check_worker_seeds(bases, number)
        if action == "stateend":
            if ended == "fatal":  # a crash ended it early: its state resumes the rest of it
                done = [g for g in got if g and g[0] != "error"]
                return self.resume(loader, loader.state_dict(), refs, done, number), True
            return self.resume_at_end(loader, number), True
        if action == "close":
            loader.close()  # (the thread's may have come after the epoch's end)
            try:
                iter(loader)
            except LoaderClosedError:
                return loader, False
            raise FailureError("iter() on a closed loader did not raise LoaderClosedError")
        if ended == "state":
            done = [g for g in got if g and g[0] != "error"]
            return self.resume(loader, state, refs, done, number), True
        return loader, True

    def check_worker_seeds(self, bases: list[int], number: int) -> None:
        """The seeds the workers started this epoch recorded follow torch's rule."""
        if not self.seed_dir:
            return
        s = self.s
        records = more.read_seeds(self.seed_dir)
        self.log(f"  epoch {number}: worker seeds {[(r['seed'], r['pid']) for r in records]}, "
                 f"torch's base {bases}")
        # Persistent workers keep their base seed: restarted on a grown slab (design.md, "Slot
        # budget"; "Known limits"), or resumed from a state taken between epochs
        kept = [self.worker_base] if s["persistent_workers"] and self.worker_base else []
        why = more.check_seeds(records, bases + kept, s["num_workers"],
                               s["worker_mode"] == "process")
        if records:
            self.worker_base = (records[0]["seed"] - records[0]["worker_id"]) % 2 ** 64
        if why:
            raise FailureError(f"epoch {number}: {why}")

    def epoch_apart(self, loader: Any, e: dict[str, Any], number: int) -> tuple[Any, bool]:
        """``dropload``: a new loader dropped (``del``, collected) mid-epoch while its iterator
        goes on to the end, then no worker of it may run. ``interleave``: a second loader
        (options of its own) iterated in turn with this one; both epochs exact."""
        from arena_loader import ArenaLoader

        s, action = self.s, e["action"]
        stop = threading.Event()
        timer = _sigint_timer(e["sigints"], e["pthread"], stop) if e["ctrlc"] else None
        where = f"epoch {number} ({action})"
        try:
            if action == "dropload":
                loader.close()
                loader = self.new_loader()
                self.carried = None  # (a new loader: its own generators' states)
                self.worker_base = 0
                refs, bases = self.expect(loader)
                it = iter(loader)
                pids = [p for p in getattr(it, "worker_pids", []) or [] if p != os.getpid()]
                self.seen_pids.update(pids)
                got: list = []
                at = max(1, int(e["at"] * len(refs[0])))
                while len(got) < at and (batch := self.pull(it)) is not None:
                    got.append(batch)
                del loader
                gc.collect()
                while (batch := self.pull(it)) is not None:
                    got.append(batch)
                del it
                gc.collect()
                if not any(got == r if s["in_order"] else Counter(got) == Counter(r)
                           for r in refs):
                    raise FailureError(f"{where}: got {got}, refs {refs}")
                alive = more.pids_gone(pids)
                if alive:
                    raise FailureError(f"{where}: workers {alive} outlive loader and iterator")
                self.check_worker_seeds(bases, number)
                self.worker_base = 0
                return self.new_loader(), True
            s2 = dict(s, sampler=None, getitems=False, context=None, device=None, init=None,
                      in_order=True, pin_memory=False, slots=None, held_batch_limit=None,
                      timeout=0, worker_mode="process", worker_threads=1, prefetch_factor=None,
                      **e["other"])
            other = ArenaLoader(make_dataset(s2), **loader_kwargs(s2))
            refs, bases = self.expect(loader)
            gen2 = other.generator
            refs2 = references(s2, gen2.get_state() if gen2 is not None else None)
            its = [iter(loader), iter(other)]
            for it in its:
                with contextlib.suppress(Exception):
                    self.seen_pids.update(it.worker_pids)
            gots: list[list] = [[], []]
            live = [0, 1]
            turn = 0
            while live:
                side = live[turn % len(live)]
                batch = self.pull(its[side])
                if batch is None:
                    live.remove(side)
                else:
                    gots[side].append(batch)
                turn += 1
            del its
            other.close()
            if not any(gots[0] == r if s["in_order"] else Counter(gots[0]) == Counter(r)
                       for r in refs):
                raise FailureError(f"{where}: this loader's {gots[0]}, refs {refs}")
            if gots[1] not in refs2:
                raise FailureError(f"{where}: the other loader's {gots[1]}, refs {refs2}")
            self.check_worker_seeds(bases, number)
            return loader, True
        finally:
            stop.set()
            if timer is not None:
                timer.join()
            self.log(f"  epoch {number} {action}: ints {_interrupts}")

    def resume_at_end(self, old: Any, number: int) -> Any:
        """A state taken after the epoch's end, loaded into a new loader: the next epoch is
        the one the old loader's generators, as they are now, give."""
        state = old.state_dict()
        gen = old.generator
        self.carried = (gen.get_state() if gen is not None else None,
                        more.sampler_state(self.sampler))
        old.close()
        loader = self.new_loader()
        loader.load_state_dict(state)
        self.log(f"  epoch {number}: state at the end loaded into a new loader")
        return loader

    def keep_cap(self) -> int:
        limit = self.s["held_batch_limit"]
        return 4 if limit is None else limit - 1

    def check_raises_again(self, it: Any, kind: type) -> None:
        global _gate
        for _ in range(5):
            try:
                _gate = True
                next(it)
            except KeyboardInterrupt:
                continue
            except kind:
                return
            except StopIteration:
                if kind.__name__ == "LoaderClosedError":
                    return  # closed after a normal end
                raise FailureError(f"after {kind.__name__}, next() gave StopIteration") from None
            except Exception as exc:
                raise FailureError(f"after {kind.__name__}, next() raised {exc!r}") from exc
            finally:
                _gate = False
            raise FailureError(f"after {kind.__name__}, next() gave a batch")
        raise FailureError(f"after {kind.__name__}, next() kept being interrupted")

    def act(self, loader: Any, it: Any, e: dict[str, Any]) -> str:
        action = e["action"]
        if action in ("break", "state", "abandon"):
            return action
        if action == "fork":
            self.fork_pid = more.fork_reader([(b, c) for b, c, _ in self.kept], same)
            return "end"
        if action in ("sigkill", "sigterm", "stopcont"):
            # (thread workers report this process's pid: never signal ourselves)
            pids = [p for p in getattr(it, "worker_pids", []) or [] if p != os.getpid()]
            self.seen_pids.update(pids)
            if not pids:
                return "nokill"
            pid = pids[int(e["r"] * len(pids))]
            if action == "stopcont":
                os.kill(pid, signal.SIGSTOP)
                threading.Timer(e["delay"] + 0.2, lambda: _cont(pid)).start()
                return "stopped"
            os.kill(pid, signal.SIGKILL if action == "sigkill" else signal.SIGTERM)
            self.pending_crash = True
            return "killed"
        return "end"

    def judge(self, e: dict[str, Any], number: int, got: list, refs: list, at: int,
              ended: str) -> None:
        s = self.s
        action = e["action"]
        batches = [g for g in got if g and g[0] != "error"]
        errors = [g for g in got if g and g[0] == "error"]
        where = f"epoch {number} ({action}, at {at})"

        def matches(prefix: bool = False) -> bool:
            for ref in refs:
                if s["in_order"]:
                    if batches == (ref[:len(batches)] if prefix else ref):
                        return True
                elif prefix:
                    if Counter(batches) <= Counter(ref):
                        return True
                elif sorted(batches) == sorted(ref):
                    return True
            return False

        def fail(why: str) -> None:
            raise FailureError(f"{where}: {why}; got {batches} errors "
                          f"{[(x[1], x[2][:300]) for x in errors]}; refs {refs}")

        crash_errors = [x for x in errors if x[1] == "WorkerCrashedError"]
        if crash_errors and self.pending_crash and action not in ("sigkill", "sigterm"):
            # The worker killed in an earlier epoch surfaced now (persistent workers)
            if len(errors) != 1 or not matches(prefix=True):
                fail("after a crash surfacing late, batches are not the reference's prefix")
            self.pending_crash = False
            return
        if action in ("sigkill", "sigterm") and ended == "fatal":
            self.pending_crash = False
            if len(errors) != 1 or errors[0][1] != "WorkerCrashedError":
                fail("a killed worker must give one WorkerCrashedError")
            word = "SIGKILL" if action == "sigkill" else "SIGTERM"
            if word not in errors[0][2] and "exited" not in errors[0][2] and not self.late_ok:
                fail(f"crash message does not name {word}")
            if not matches(prefix=True):
                fail("batches before a crash are not the reference's prefix")
            if len(batches) < at and not self.late_ok:
                fail("fewer batches than were delivered before the kill")
            return
        if action == "close":
            if errors and (len(errors) != 1 or errors[0][1] != "LoaderClosedError"):
                fail("close() from another thread must give only LoaderClosedError")
            if not matches(prefix=True):
                fail("batches before close() are not the reference's prefix")
            if not errors and not matches() and s["num_workers"]:
                # (num_workers=0: a closed iterator gives StopIteration, design.md "Errors")
                fail("no LoaderClosedError, yet the epoch is incomplete")
            return
        if action == "initfail" and errors:
            if len(errors) != 1 or errors[0][1] != "ValueError" or ended != "fatal" or (
                    "worker_init_fn of worker" not in errors[0][2]):
                fail("a raising worker_init_fn must give its one ValueError, then the same")
            if not matches(prefix=True):
                fail("batches before the worker_init_fn error are not the reference's prefix")
            return
        if action == "slow":
            if any(x[1] != "LoaderTimeoutError" for x in errors):
                fail("only LoaderTimeoutError may come of a slow sample")
            if not matches():
                fail("a timeout lost or repeated batches")
            return
        if action == "bad":
            bad = s["bad"][0]
            for ref in refs:
                expected = [b for b in ref if bad not in b]
                failing = len(ref) - len(expected)
                if len(errors) == failing and (
                        batches == expected if s["in_order"] else sorted(batches) == sorted(
                            expected)):
                    break
            else:
                fail(f"sample {bad} raising: wrong batches or error count")
            for x in errors:
                if x[1] != "ValueError" or f"sample {bad} is bad" not in x[2]:
                    fail(f"error is not the sample's ValueError naming it: {x[1]}")
                idx = getattr(x[3], "indices", None)
                if s["num_workers"] and (idx is None or bad not in list(idx)):
                    fail(f"error's indices {idx} do not name sample {bad}")
            if s["in_order"] and errors:
                # the error comes at its batch's turn
                for ref in refs:
                    seq = [("E" if bad in b else b) for b in ref]
                    mine = ["E" if g[0] == "error" else g for g in got]
                    if seq == mine:
                        break
                else:
                    fail("the error did not come at its batch's turn")
            return
        if errors:
            if (action == "stopcont" or s["timeout"] < 1) and all(
                    x[1] == "LoaderTimeoutError" for x in errors):
                pass  # (a slow epoch's 0.3 s timeout holds in every epoch: new workers under
                # load may miss it; a timeout loses nothing, which matches() below checks)
            else:
                fail("unexpected errors")
        if ended in ("break", "state", "abandon"):
            if len(batches) != at or not matches(prefix=True):
                fail("batches before the break are not the reference's prefix")
            return
        if not matches():
            fail("the epoch's batches differ from the reference")

    def resume(self, old: Any, state: dict, refs: list, done: list, number: int) -> Any:
        """A new loader built alike resumes after the batches ``done``: it gives the rest."""
        at = len(done)
        old.close()
        loader = self.new_loader()
        loader.load_state_dict(state)
        got = []
        it = iter(loader)
        with contextlib.suppress(Exception):
            self.seen_pids.update(it.worker_pids)
        for batch in it:
            got.append(decode(batch, self.s["kind"], self.s["width"], self.s["collate"]))
            del batch
        del it
        wanted = [ref[at:] for ref in refs]
        # in_order=False: the state counts batches received, not which (design.md, "Resuming":
        # not covered), so only the count and the membership are checked
        ok = (got in wanted) if self.s["in_order"] else any(
            len(got) == len(r) - at and Counter(got) <= Counter(r) for r in refs)
        if not ok:
            raise FailureError(f"epoch {number} resumed after {at}: got {got}, wanted {wanted}")
        self.log(f"  resumed epoch {number}: {len(got)} batches")
        return loader


def _cont(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def leftovers(pid: int) -> dict[str, list]:
    import psutil

    gc.collect()
    children = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            cmdline = " ".join(child.cmdline())  # (the stdlib's helpers are not ours)
            if child.status() != psutil.STATUS_ZOMBIE and not any(
                    h in cmdline for h in ("resource_tracker", "multiprocessing.forkserver")):
                children.append(child.pid)
    with open("/proc/self/maps") as maps:
        mapped = [line.split()[-1] for line in maps if f"{SHM_DIR}/{PREFIX}" in line]
    return {"children": children,
            "threads": [t.name for t in threading.enumerate() if t.name.startswith("arena")],
            "shm": [n for n in os.listdir(SHM_DIR) if n.startswith(f"{PREFIX}{pid}_")],
            "mapped": mapped}


def wait_clean(keys: tuple[str, ...], seconds: float = 6.0) -> dict[str, list]:
    deadline = time.monotonic() + seconds
    while True:
        left = {k: v for k, v in leftovers(os.getpid()).items() if k in keys and v}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def child(seed: int, verbose: bool, limit: float) -> int:
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    faulthandler.dump_traceback_later(max(5.0, limit - 8), exit=False)

    def watchdog() -> None:  # before the parent's kill: where the Ctrl-Cs landed
        time.sleep(max(4.0, limit - 9))
        print(f"Ctrl-Cs landed: {INTERRUPT_LOG}", file=sys.stderr, flush=True)

    threading.Thread(target=watchdog, name="chaos-watchdog", daemon=True).start()
    s = draw_scenario(seed)
    # torch imported up front: arena_loader imports it lazily inside next() for torch output,
    # and a Ctrl-C landing in that first import leaves torch half-imported for good.
    import torch

    if s["pin_memory"]:

        torch.cuda.is_available = lambda: True  # tests/conftest.py's fake_pinning
        torch.Tensor.pin_memory = lambda tensor, device=None: tensor.clone()
    import warnings

    warnings.simplefilter("ignore")
    signal.signal(signal.SIGINT, _on_sigint)
    run = Run(s, verbose)
    run.log(json.dumps({k: v for k, v in s.items() if k != "epochs"}))
    run.log("  actions: " + ", ".join(e["action"] + ("+ctrlc" if e["ctrlc"] else "")
                                      for e in s["epochs"]))
    result: dict[str, Any] = {"seed": seed, "ok": True}
    loader = None
    try:
        loader = run.new_loader()
        for number, e in enumerate(s["epochs"]):
            loader, go_on = run.epoch(loader, e, number)
            if not go_on:
                break
        loader.close()
        run.check_kept("after close()")
        left = wait_clean(("children", "threads", "shm"))
        if left:
            raise FailureError(f"after close(): left {left}")
        run.kept.clear()
        del loader
        left = wait_clean(("mapped",), 2.0)
        if left:
            raise FailureError(f"with no batch held: still mapped {left}")
    except FailureError as exc:
        result.update(ok=False, kind="FAIL", error=str(exc)[:6000])
    except BaseException as exc:  # anything else is a failure to report
        result.update(ok=False, kind=f"EXC {type(exc).__name__}",
                      error="".join(traceback.format_exception(exc))[-6000:])
    if run.seed_dir:
        import shutil

        shutil.rmtree(run.seed_dir, ignore_errors=True)
    result["interrupts"] = dict(_interrupts)
    result["pids"] = sorted(run.seen_pids)
    faulthandler.cancel_dump_traceback_later()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    print("CHAOS-RESULT " + json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


# -- the parent -------------------------------------------------------------------------------


def session_processes(sid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getsid(int(entry)) != sid:
                continue
            with open(f"/proc/{entry}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(entry))
        except (OSError, IndexError):
            continue
    return found


def shm_names() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)}


def run_one(seed: int, limit: float, verbose: bool) -> dict[str, Any]:
    before = shm_names()
    started = time.monotonic()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(seed),
           "--limit", str(limit)] + (["-v"] if verbose else [])
    env = dict(os.environ)
    if draw_scenario(seed).get("device"):  # numba's simulator, chosen before numba imports
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, text=True, env=env)
    outcome: dict[str, Any] = {"seed": seed}
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGUSR1)  # faulthandler: every thread's stack
        time.sleep(2.0)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        outcome.update(ok=False, kind="HANG", error=f"over {limit} s", stderr=err[-20000:])
    outcome["seconds"] = round(time.monotonic() - started, 2)
    lines = [line for line in out.splitlines() if line.startswith("CHAOS-RESULT ")]
    if "kind" not in outcome:
        if lines:
            outcome.update(json.loads(lines[-1][len("CHAOS-RESULT "):]))
            if not outcome["ok"]:
                outcome["stderr"] = err[-8000:]
        else:
            outcome.update(ok=False, kind=f"DIED rc={proc.returncode}", error="no result line",
                           stderr=err[-8000:])
    elif verbose:
        pass
    if verbose and err:
        outcome.setdefault("stderr", err[-8000:])
    # The child's session: nothing may outlive it (workers exit on their parent's death).
    deadline = time.monotonic() + 3.0
    while session_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = session_processes(proc.pid)
    if alive:
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if outcome.get("kind") != "HANG":
            outcome.update(ok=False, kind=outcome.get("kind", "") + " LEAK",
                           leaked_processes=alive)
    pids = {proc.pid, *outcome.get("pids", [])}
    new = shm_names() - before
    ours = sorted(n for n in new if any(n.startswith(f"{PREFIX}{p}_") for p in pids))
    if ours:
        time.sleep(1.0)
        ours = [n for n in ours if os.path.exists(os.path.join(SHM_DIR, n))]
    if ours:
        outcome.update(ok=False, kind=outcome.get("kind", "") + " SHM-LEAK", leaked_shm=ours)
        for name in ours:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(SHM_DIR, name))
    return outcome


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", type=int, action="append", help="run just this scenario")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--limit", type=float, default=60.0, help="seconds before a HANG")
    parser.add_argument("--repeat", type=int, default=1, help="with --only: times each")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()
    if args.child is not None:
        return child(args.child, args.verbose, args.limit)
    rng = random.Random(args.seed)
    started = time.monotonic()
    seeds = [s for s in (args.only or []) for _ in range(args.repeat)]
    failures = []
    count = 0
    interrupts = {"raised": 0, "outside": 0}
    while True:
        if args.only:
            if not seeds:
                break
            seed = seeds.pop(0)
        else:
            if time.monotonic() - started > args.seconds:
                break
            seed = rng.randrange(10 ** 9)
        outcome = run_one(seed, args.limit, args.verbose)
        count += 1
        status = "ok" if outcome["ok"] else outcome["kind"]
        print(f"[{time.monotonic() - started:7.1f}s] scenario {count} seed {seed}: {status} "
              f"({outcome['seconds']} s)", flush=True)
        if not outcome["ok"] or args.verbose:
            for key in ("error", "leaked_processes", "leaked_shm", "stderr"):
                if outcome.get(key):
                    print(f"  {key}: {outcome[key]}", flush=True)
        if not outcome["ok"]:
            failures.append(seed)
        for key, value in outcome.get("interrupts", {}).items():
            interrupts[key] += value
    print(f"done: {count} scenarios in {time.monotonic() - started:.0f} s, "
          f"{len(failures)} failed: {failures}; Ctrl-Cs raised inside the loader "
          f"{interrupts['raised']}, landed in the harness {interrupts['outside']}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
