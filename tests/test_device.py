"""The device options in the main test process, which never imports numba's CUDA simulator:
option errors, the no-CUDA paths, import hygiene, the simulator run of the device leg, the
device arrays built without a driver, and ``pin_memory`` without a device (torch's
``Tensor.pin_memory`` faked: CPU torch has no page-locked memory)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from arena_loader import ArenaLoader

from .datasets import ImageDataset

ROOT = Path(__file__).resolve().parent.parent
DATA = ImageDataset(6, shape=(3,))


@pytest.mark.parametrize("device, error, shown", [
    ("gpu", ValueError, "'gpu'"),
    ("cuda:", ValueError, "'cuda:'"),
    ("cuda:-1", ValueError, "'cuda:-1'"),
    ("cuda:one", ValueError, "'cuda:one'"),
    ("CUDA", ValueError, "'CUDA'"),
    ("cuda:\u00b2", ValueError, "'cuda:\u00b2'"),  # (a digit to str.isdigit, not to int())
    (0, TypeError, "int 0"),
])
def test_bad_device_is_an_error_naming_device(device, error, shown):
    """Anything but None, 'cpu', 'cuda' or 'cuda:N' is rejected before CUDA is looked at."""
    with pytest.raises(error, match=r"device must be None, 'cpu', 'cuda' or 'cuda:N' with N a "
                                    rf"GPU index >= 0, got {shown}; pass device='cuda'"):
        ArenaLoader(DATA, device=device)


def test_device_cpu_gives_host_batches():
    """device='cpu' (as torch users write it) means host batches, as device=None does."""
    with ArenaLoader(DATA, batch_size=3, device="cpu") as loader:
        assert loader.device is None
        batches = [batch.copy() for batch in loader]
    np.testing.assert_array_equal(batches[1][2], DATA[5])


@pytest.fixture
def no_cuda(monkeypatch):
    """CUDA looks absent, to numba and to torch, whatever this machine has."""
    from arena_loader import _device

    monkeypatch.setattr(_device, "cuda_unavailable_reason", lambda: "no CUDA GPU was found")
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_pin_memory_without_cuda_warns_like_torch_and_gives_host_batches(no_cuda):
    """No accelerator: pin_memory=True warns (torch's words) as each new iterator is made, as
    torch does (not when persistent workers' iterator is reused), and batches stay on the
    host."""
    no_accelerator = (r"'pin_memory' argument is set as true but no accelerator is found.*"
                      r"torch finds no CUDA GPU")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing at construction
        loader = ArenaLoader(DATA, batch_size=2, pin_memory=True)
    with loader:
        for _ in range(2):
            with pytest.warns(UserWarning, match=no_accelerator):
                batches = [batch.copy() for batch in loader]
        assert not loader.snapshot().pinned
    assert len(batches) == 3
    np.testing.assert_array_equal(batches[2][1], DATA[5])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ArenaLoader(DATA, batch_size=2, pin_memory=True, num_workers=1,
                         persistent_workers=True) as loader:
            assert [len([b.copy() for b in loader]) for _ in range(3)] == [3, 3, 3]
    assert sum("no accelerator" in str(w.message) for w in caught) == 1


def test_device_without_cuda_is_an_error_naming_device(no_cuda):
    """device='cuda' with no GPU fails at construction, saying why and what to pass."""
    with pytest.raises(RuntimeError, match=r"device='cuda:0' needs a CUDA GPU, but no CUDA GPU "
                                           r"was found; pass device=None for host batches"):
        ArenaLoader(DATA, device="cuda:0")


def test_importing_and_using_the_library_without_gpu_options_never_loads_numba_cuda():
    """numba.cuda is imported only for pin_memory or device, so no GPU is ever needed."""
    code = ("import sys, numpy as np\n"
            "import arena_loader\n"
            "from arena_loader import ArenaLoader\n"
            "with ArenaLoader(np.arange(8.0), batch_size=4) as loader:\n"
            "    assert [float(b.sum()) for b in loader] == [6.0, 22.0]\n"
            "assert 'numba.cuda' not in sys.modules, 'numba.cuda was imported'\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.timeout(300)
def test_device_leg_passes_under_the_simulator():
    """tests/test_device_sim.py, run in an interpreter that starts numba's CUDA simulator."""
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
         "tests/test_device_sim.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in summary and "skipped" not in summary, summary


def _device_memory(address: int, nbytes: int):
    """A numba ``MemoryPointer`` to ``address`` with no context (none is needed to build
    arrays over it), its pointer of the type numba's driver uses (ctypes' in numba's own
    ``numba.cuda``, cuda-python's ``CUdeviceptr`` in numba-cuda's)."""
    import ctypes

    from numba.cuda.cudadrv import driver

    kinds = [ctypes.c_uint64]
    binding = getattr(driver, "binding", None)
    if binding is None:
        try:
            from cuda.bindings import driver as binding
        except ImportError:
            pass
    if binding is not None:
        kinds.append(binding.CUdeviceptr)
    for kind in kinds:
        memory = driver.MemoryPointer(None, kind(address), nbytes)
        try:
            if memory.device_pointer_value == address:
                return memory
        except (TypeError, ValueError):  # int() of a ctypes pointer, under numba-cuda
            pass
    raise AssertionError(f"no pointer type of {kinds} gives numba's driver the address")


def test_device_arrays_lie_over_their_bytes_and_keep_the_lease_alive(monkeypatch):
    """Each field's device array is built from numba's classes without a driver call (so it
    runs here, without a GPU; numba's public call, the fallback, is made to fail): it points
    at its bytes of the buffer, with the field's shape and dtype, and it alone keeps the
    buffer's lease alive (its slices carry the same owner: numba's views take their base's)."""
    import gc
    import weakref

    from arena_loader._device import cuda

    if cuda.SIMULATED:
        pytest.skip("the simulator makes host arrays")

    def public_call(*args, **kwargs):
        raise AssertionError("device_array fell back to from_cuda_array_interface")

    monkeypatch.setattr(cuda.cuda, "from_cuda_array_interface", public_call)
    monkeypatch.setattr(cuda, "_direct", True)  # (a failure here must not last past the test)

    class Lease:
        pass

    buffer = _device_memory(0x10000, 4096)
    lease = Lease()
    array = cuda.device_array(buffer, 64, 24, np.dtype("<f4"), (2, 3), lease)
    interface = array.__cuda_array_interface__
    assert interface["data"][0] == 0x10000 + 64
    assert (interface["shape"], interface["typestr"], interface["strides"]) == ((2, 3), "<f4",
                                                                                 None)
    assert array.strides == (12, 4) and array.gpu_data.owner is lease
    alive = weakref.ref(lease)
    del lease
    gc.collect()
    assert alive() is not None
    del array
    gc.collect()
    assert alive() is None


def test_device_arrays_from_a_numba_whose_classes_differ_use_its_public_call(monkeypatch):
    """If numba's classes refuse device_array's arguments (another numba-cuda), the field's
    array comes from ``from_cuda_array_interface`` with the same bytes and owner, from then
    on."""
    from arena_loader._device import cuda

    if cuda.SIMULATED:
        pytest.skip("the simulator makes host arrays")
    from numba.cuda.cudadrv import devicearray

    made = []

    def refuse(*args, **kwargs):
        made.append("direct")
        raise TypeError("unexpected keyword argument 'gpu_data'")

    def public_call(interface, owner, sync):
        made.append((interface["data"], interface["shape"], interface["typestr"], owner, sync))
        return "public"

    monkeypatch.setattr(cuda, "_direct", True)  # restored after the test: it goes False here
    monkeypatch.setattr(devicearray, "DeviceNDArray", refuse)
    monkeypatch.setattr(cuda.cuda, "from_cuda_array_interface", public_call)
    buffer = _device_memory(0x20000, 4096)
    lease = object()
    dtype = np.dtype("<i2")
    assert cuda.device_array(buffer, 8, 12, dtype, (6,), lease) == "public"
    assert cuda.device_array(buffer, 20, 4, dtype, (2,), lease) == "public"
    assert made == ["direct", ((0x20008, False), (6,), "<i2", lease, False),
                    ((0x20014, False), (2,), "<i2", lease, False)]


class TensorPairs:
    """A torch dataset of (image, label) samples."""

    def __init__(self, n: int = 12):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        import torch

        return torch.full((4, 3), float(index)), torch.tensor(index)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_pin_memory_gives_tensor_copies_and_frees_the_slot_at_once(fake_pinning, num_workers):
    """pin_memory=True without a device: each tensor handed out is its pin_memory() copy,
    as torch's pin thread makes one, so no batch the consumer holds keeps a slot (a slot is
    rewritten once dropped: a page-locked one under an asynchronous copy would reach the GPU
    with the next batch's rows)."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither torch's no-accelerator warning nor ours
        loader = ArenaLoader(TensorPairs(), batch_size=4, num_workers=num_workers,
                             pin_memory=True)
        with loader:
            held = list(loader)
            assert loader.snapshot().held_batches == 0
            assert not loader.snapshot().pinned  # the slab is not page-locked
    assert len(fake_pinning) == 2 * len(held) == 6
    for i, (images, labels) in enumerate(held):
        torch.testing.assert_close(images[:, 0, 0], torch.arange(4 * i, 4 * i + 4.0))
        assert labels.tolist() == list(range(4 * i, 4 * i + 4))
    assert all(type(batch) is list for batch in held)


def test_pin_memory_says_nothing_of_numpy_string_arrays(fake_pinning):
    """A numpy string array (torch has no tensor for it: it stays numpy in torch output) is
    not a numeric batch left pageable: no warning, the tensors pinned."""
    import torch

    samples = [(torch.full((2,), float(i)), np.array(f"s{i}")) for i in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ArenaLoader(samples, batch_size=2, pin_memory=True) as loader:
            batches = list(loader)
    assert [names.tolist() for _, names in batches] == [["s0", "s1"], ["s2", "s3"]]
    assert fake_pinning == [(2, 2), (2, 2)]


def test_pin_memory_with_numpy_batches_warns_that_they_stay_pageable(fake_pinning):
    """Numpy batches are not page-locked (torch pins tensors only): a warning says so once,
    at construction for output='numpy', else at the first numpy batch."""
    unpinned = r"pin_memory=True page-locks torch tensors only.*output='torch'"
    with pytest.warns(UserWarning, match=unpinned):
        loader = ArenaLoader(DATA, batch_size=2, pin_memory=True, output="numpy")
    with loader, warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len([batch.copy() for batch in loader]) == 3
    with ArenaLoader(DATA, batch_size=2, pin_memory=True) as loader:
        with pytest.warns(UserWarning, match=unpinned) as caught:
            batches = [batch.copy() for epoch in range(2) for batch in loader]
    assert sum("page-locks torch tensors only" in str(w.message) for w in caught) == 1
    np.testing.assert_array_equal(batches[4][1], DATA[3])
    assert fake_pinning == []


def test_pinned_batches_have_the_structure_torch_pinning_gives(fake_pinning):
    """``_output.pin_tensors`` walks a batch as torch's ``pin_memory`` does (the function
    torch's pin thread runs, here the oracle): the same types and values (tuples stay
    tuples), every tensor pinned, objects with a pin_memory() method pinned by it, numpy and
    strings kept."""
    import collections

    import torch
    from torch.utils.data._utils.pin_memory import pin_memory as torch_pin_memory

    from arena_loader._output import pin_tensors

    Pair = collections.namedtuple("Pair", "left right")

    class Custom:
        def __init__(self, tensor):
            self.tensor = tensor

        def pin_memory(self):
            return Custom(self.tensor.pin_memory())

    def batch():
        return {"pair": Pair(torch.ones(2), torch.zeros(1)), "tuple": (torch.ones(1), "name"),
                "list": [torch.ones(3), np.ones(2)], "custom": Custom(torch.ones(1)),
                "ordered": collections.OrderedDict(a=torch.ones(1)), "text": "abc", "n": 3}

    ours, theirs = pin_tensors(batch()), torch_pin_memory(batch())
    assert len(fake_pinning) == 2 * 6

    def shape_of(value):
        if isinstance(value, dict):
            return type(value), {key: shape_of(item) for key, item in value.items()}
        if isinstance(value, (tuple, list)):
            return type(value), [shape_of(item) for item in value]
        if isinstance(value, Custom):
            return Custom, shape_of(value.tensor)
        if isinstance(value, (torch.Tensor, np.ndarray)):
            return type(value), value.tolist()
        return value

    ours, theirs = shape_of(ours), shape_of(theirs)
    assert ours == theirs, (ours, theirs)


def test_ctrl_c_while_a_batch_is_pinned_loses_and_repeats_nothing(fake_pinning, monkeypatch):
    """Without workers next() pins (as torch's single-process iterator does): a
    KeyboardInterrupt inside a tensor's pin_memory() copy (before a batch's first tensor is
    pinned, and after it; batches in slots, past the first read-ahead's segments) reaches the
    caller; the batch is handed out by the next next(), every batch once, in order, and no
    slot stays taken. (With workers the pin thread pins, where no Ctrl-C lands: the Ctrl-C
    matrix covers that next().)"""
    import torch

    copies = []

    def interrupted(tensor, device=None):
        copies.append(None)
        if len(copies) in (21, 26):  # batch 10's first tensor, batch 12's second
            raise KeyboardInterrupt
        return tensor.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", interrupted)
    with ArenaLoader(TensorPairs(40), batch_size=2, pin_memory=True) as loader:
        iterator, labels, interrupts = iter(loader), [], 0
        while True:
            try:
                images, batch_labels = next(iterator)
            except KeyboardInterrupt:
                interrupts += 1
                continue
            except StopIteration:
                break
            labels += batch_labels.tolist()
            assert images[:, 0, 0].tolist() == [float(i) for i in batch_labels]
        del iterator
        snapshot = loader.snapshot()
        assert snapshot.held_batches == 0 and set(snapshot.slot_states) <= {"free"}
        assert sum(snapshot.slot_leases) > 10  # (the interrupted batches were in slots)
    assert interrupts == 2 and labels == list(range(40))


def test_a_pinning_loader_used_in_a_forked_child_is_a_loader_forked_error(fake_pinning):
    """pin_memory=True without a device pins through torch's CUDA, which a forked child
    cannot use: iter() there is a LoaderForkedError naming pin_memory and the fix."""
    from arena_loader.errors import LoaderForkedError

    from .test_fork import run_in_child

    loader = ArenaLoader(TensorPairs(), batch_size=4, pin_memory=True)
    assert len(list(loader)) == 3

    def in_child():
        try:
            iter(loader)
        except LoaderForkedError as exc:
            return str(exc)
        return "no error"

    message = run_in_child("os.fork", in_child)
    assert "pin_memory=True" in message and "CUDA does not survive fork" in message, message
    loader.close()


class SimpleCustomBatch:
    """torch's documented custom batch type: its own pin_memory() pins its tensors."""

    def __init__(self, data):
        import torch

        transposed = list(zip(*data))
        self.inp = torch.stack(transposed[0], 0)
        self.tgt = torch.stack(transposed[1], 0)

    def pin_memory(self):
        self.inp = self.inp.pin_memory()
        self.tgt = self.tgt.pin_memory()
        return self


def collate_custom(batch):
    return SimpleCustomBatch(batch)


def test_pin_memory_calls_a_custom_batch_types_own_pin_memory(fake_pinning):
    """torch's documented custom batch (a collate_fn returning an object with pin_memory()):
    with pin_memory=True its method pins its tensors, as torch's pin thread calls it; the
    values are torch's DataLoader's, the held batches keep no slot, and nothing warns of
    numpy left unpinned."""
    import torch

    dataset = TensorPairs(16)
    theirs = [(batch.inp, batch.tgt) for batch in torch.utils.data.DataLoader(
        dataset, batch_size=4, collate_fn=collate_custom)]
    fake_pinning.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no numpy left unpinned: nothing to warn about
        with ArenaLoader(dataset, batch_size=4, collate_fn=collate_custom, num_workers=2,
                         pin_memory=True) as loader:
            held = list(loader)
            assert loader.snapshot().held_batches == 0
    assert all(type(batch) is SimpleCustomBatch for batch in held)
    assert fake_pinning == [(4, 4, 3), (4,)] * 4
    for batch, (inp, tgt) in zip(held, theirs, strict=True):
        torch.testing.assert_close(batch.inp, inp)
        torch.testing.assert_close(batch.tgt, tgt)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_unpinned_numpy_warning_made_an_error_loses_no_batch(fake_pinning, num_workers):
    """With warnings made errors (``-W error``), the numpy-not-pinned warning is raised by
    the next() after the first numpy batch, before it takes a batch, and points at the
    caller's line: every batch still comes, once, in order."""
    got, raised = [], []
    with ArenaLoader(DATA, batch_size=2, pin_memory=True, num_workers=num_workers) as loader:
        iterator = iter(loader)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            while True:
                try:
                    got.append(next(iterator)[:, 0].tolist())
                except UserWarning as warning:
                    raised.append(str(warning))
                except StopIteration:
                    break
    assert got == [[float(DATA[k][0]), float(DATA[k + 1][0])] for k in (0, 2, 4)]
    assert len(raised) == 1 and "page-locks torch tensors only" in raised[0]
    with pytest.warns(UserWarning, match="page-locks torch tensors only") as caught:
        with ArenaLoader(DATA, batch_size=2, pin_memory=True, num_workers=num_workers) as loader:
            assert len([batch.copy() for batch in loader]) == 3
    ours = [w for w in caught if "page-locks torch tensors only" in str(w.message)]
    assert [Path(w.filename).name for w in ours] == ["test_device.py"]
