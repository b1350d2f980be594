"""Where the device leg's time goes per batch: each step of the device thread and of the
consumer's ``next()`` timed in place, and the numba calls they make timed alone.

    .venv/bin/python benchmarks/device_steps.py [--batch-mib 4] [--batches 1600] [--workers 4]

Needs a CUDA GPU (or ``NUMBA_ENABLE_CUDASIM=1``, which says nothing about speed: the call
costs are then skipped). Small batches (4 MiB: a 79 us copy at 53 GB/s) reach only ~0.45x the
raw pinned copy (docs/benchmarks.md, "GPU: host-to-device copies"), because the thread's and
the consumer's Python per batch, on one GIL, outlasts the copy; this says which steps.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np
from bench_h2d import Samples  # (run as a script: benchmarks/ is on sys.path)

MIB = 2**20


SPENT: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # step: [ns, calls]


def timed(owner: type, name: str, label: str) -> None:
    """Wrap ``owner.name`` so that its wall time adds up under ``label``."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        began = time.perf_counter_ns()
        try:
            return inner(*args, **kwargs)
        finally:
            spent = SPENT[label]
            spent[0] += time.perf_counter_ns() - began
            spent[1] += 1

    setattr(owner, name, wrapper)


def call_costs(repeats: int = 2000) -> None:
    """us per call of each numba / driver call the device path makes, alone."""
    from numba import cuda
    from numba.cuda.cudadrv import driver

    from arena_loader._device import cuda as ours

    stream, _ = ours.new_stream()
    event = ours.new_event()
    buffer = ours.device_bytes(4096)
    host = ours.pinned_bytes(4096)
    interface = {"shape": (4096,), "strides": None, "typestr": "|u1",
                 "data": (buffer.__cuda_array_interface__["data"][0], False), "version": 3}

    def enter_gpu():
        with cuda.gpus[0]:
            pass

    calls = {
        "with cuda.gpus[0]": enter_gpu,
        "cuda.default_stream()": cuda.default_stream,
        "event.record(stream)": lambda: event.record(stream),
        "event.wait(stream)": lambda: event.wait(stream),
        "event.synchronize()": event.synchronize,
        "host_to_device 4 KiB": lambda: driver.host_to_device(buffer, host, 4096, stream=stream),
        "from_cuda_array_interface": lambda: cuda.from_cuda_array_interface(
            interface, owner=buffer, sync=False),
        "device_array (arena_loader)": lambda: ours.device_array(
            buffer.gpu_data, 0, 4096, np.dtype(np.uint8), (4096,), buffer),
        "stream.synchronize()": stream.synchronize,
    }
    if not hasattr(ours, "device_array"):  # (older code, for an A/B)
        del calls["device_array (arena_loader)"]
    with cuda.gpus[0]:
        for label, call in calls.items():
            call()
            began = time.perf_counter_ns()
            for _ in range(repeats):
                call()
            print(f"  {label:28s} {(time.perf_counter_ns() - began) / repeats / 1e3:7.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-mib", type=int, default=4)
    parser.add_argument("--batches", type=int, default=1600)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    from arena_loader import ArenaLoader
    from arena_loader._arena import LeasedSlot
    from arena_loader._device import cuda as ours
    from arena_loader._device.ring import DeviceRing
    from arena_loader._device.stage import DeviceStage
    from arena_loader._device.upload import SlotUploader

    if not ours.SIMULATED:
        print("numba calls alone (us a call):")
        call_costs()
    for owner, name, label in [
            (DeviceStage, "_next_host", "thread: next host batch"),
            (DeviceStage, "_take_buffer", "thread: take a device buffer"),
            (SlotUploader, "copy", "thread: queue the copy + assemble"),
            (SlotUploader, "retire", "thread: wait for the copy before"),
            (DeviceStage, "_publish", "thread: publish"),
            (ours, "copy_to_buffer", "  of which the driver's copy call"),
            (ours.DeviceFields, "field", "  of which each field's device array"),
            (LeasedSlot, "assemble", "  of which assembling (fields included)"),
            (DeviceRing, "lease", "  of which the buffer's lease"),
            (DeviceStage, "next_batch", "consumer: next()")]:
        timed(owner, name, label)

    batch_size = 8
    sample_nbytes = args.batch_mib * MIB // batch_size
    dataset = Samples(args.batches * batch_size, sample_nbytes)
    with ArenaLoader(dataset, batch_size=batch_size, num_workers=args.workers,
                     persistent_workers=True, pin_memory=True, device="cuda",
                     slots=2 * args.workers + 2) as loader:
        for _batch in loader:  # warm-up epoch
            pass
        SPENT.clear()
        began, batches = time.perf_counter(), 0
        for _ in range(args.epochs):
            for _batch in loader:
                batches += 1
        seconds = time.perf_counter() - began
    nbytes = batches * batch_size * sample_nbytes
    print(f"{batches} batches of {args.batch_mib} MiB, {args.workers} workers: "
          f"{batches / seconds:,.0f} batches/s, {nbytes / seconds / 1e9:.2f} GB/s, "
          f"{1e6 * seconds / batches:.0f} us a batch")
    for label, (spent, calls) in SPENT.items():
        print(f"  {label:36s} {spent / 1e3 / batches:7.1f} us a batch ({calls} calls)")


if __name__ == "__main__":
    main()
