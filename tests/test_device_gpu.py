"""The device leg on a real CUDA GPU: the paths the simulator cannot run (page-locking in
place, a non-blocking copy stream, ``__cuda_array_interface__`` to torch). Skipped without a
GPU, and in the simulator run."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    pytest.skip("real-GPU tests; this interpreter runs numba's CUDA simulator",
                allow_module_level=True)

from arena_loader import ArenaLoader, _device

from .datasets import (
    CountedBatches,
    ImageDataset,
    NestedDataset,
    assert_batches_equal,
    assert_epoch_equal,
    draws_per_next,
    host_copy,
    host_epoch,
)

_REASON = _device.cuda_unavailable_reason()

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(_REASON is not None, reason=f"needs a CUDA GPU: {_REASON}")]


def _torch_cuda():
    """torch, if it is installed and sees the GPU (else the test is skipped)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    return torch


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("pin_memory", [False, True])
def test_gpu_batches_match_host_batches(num_workers, pin_memory):
    """Nested batches copied to the GPU equal the host loader's, in order, epoch after epoch
    (each epoch its own shuffle); with pin_memory the slab is page-locked in place (no
    staging warning)."""
    dataset = NestedDataset(37)
    options = dict(batch_size=4, shuffle=True, num_workers=num_workers, generator=3)
    with ArenaLoader(dataset, **options) as host:  # each epoch draws a new order
        expected = [[host_copy(batch) for batch in host] for _ in range(2)]
    assert not np.array_equal(expected[0][0]["label"], expected[1][0]["label"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ArenaLoader(dataset, pin_memory=pin_memory, device="cuda", **options) as loader:
            for epoch in range(2):
                assert_epoch_equal(loader, expected[epoch], f"epoch {epoch}")
            assert loader.snapshot().pinned == pin_memory


@pytest.mark.parametrize("slots", [2, 3, 5])
def test_fewer_slots_with_a_gpu_deliver_every_batch_in_order(slots):
    """The device stage on a real GPU with fewer slots than its read-ahead: two epochs arrive
    with the host loader's contents, in order, nothing hangs."""
    dataset = NestedDataset(40)
    options = dict(batch_size=4, num_workers=2, persistent_workers=True)
    expected = host_epoch(dataset, **options)
    with ArenaLoader(dataset, device="cuda", pin_memory=True, slots=slots, **options) as loader:
        for epoch in range(2):
            assert_epoch_equal(loader, expected, f"epoch {epoch}")


def test_unbatched_scalar_fields_reach_the_gpu():
    """batch_size=None: 0-d fields become 0-d device arrays with the right values."""
    dataset = NestedDataset(5)
    expected = host_epoch(dataset, batch_size=None)
    with ArenaLoader(dataset, batch_size=None, device="cuda", pin_memory=True) as loader:
        for batch, reference in zip(loader, expected):
            assert_batches_equal(host_copy(batch), reference)


@pytest.mark.parametrize("output", [None, "torch", "slices"])
def test_held_gpu_batches_are_not_overwritten(output):
    """A device batch the consumer holds (a numba array, a slice of one, or a torch tensor,
    which alone keeps the buffer's lease) keeps its contents while later batches arrive."""
    if output == "torch":
        _torch_cuda()
    dataset = ImageDataset(64, shape=(256,))
    expected = host_epoch(dataset, batch_size=4)
    with ArenaLoader(dataset, batch_size=4, num_workers=2, pin_memory=True, device="cuda",
                     slots=8, output="torch" if output == "torch" else None) as loader:
        held = []
        for i, batch in enumerate(loader):
            if i < 4:
                held.append(batch[1:] if output == "slices" else batch)
        for i, batch in enumerate(held):
            got = batch.cpu().numpy() if output == "torch" else batch.copy_to_host()
            np.testing.assert_array_equal(got, expected[i][1:] if output == "slices"
                                          else expected[i])


def test_torch_output_is_zero_copy_cuda_tensors():
    """output='torch' gives CUDA tensors over the loader's device buffer (no copy)."""
    torch = _torch_cuda()
    dataset = NestedDataset(12)
    expected = host_epoch(dataset, batch_size=4)
    with ArenaLoader(dataset, batch_size=4, pin_memory=True, device="cuda",
                     output="torch") as loader:
        from arena_loader._layout import prepare_samples

        for i, (batch, reference) in enumerate(zip(loader, expected)):
            image, pair = batch["image"], batch["pair"][0]
            assert image.is_cuda and pair.is_cuda
            rows = list(range(4 * i, 4 * i + 4))
            fields = prepare_samples([dataset[r] for r in rows], rows).plan.fields
            # fields[0] is sample['image'], fields[1] sample['pair'][0]: one device buffer
            assert pair.data_ptr() - image.data_ptr() == fields[1].offset - fields[0].offset
            torch.cuda.current_stream().synchronize()
            assert_batches_equal(host_copy(batch), reference)


class ManyDtypes:
    """Fields of several dtypes, an empty one and a numpy scalar, each made from its index."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> dict:
        return {"flag": np.array([index % 2 == 0, True]),
                "half": np.full((2, 3), index, np.float16),
                "wave": np.full(2, index + 1j, np.complex64),
                "empty": np.zeros((0, 3), np.float32),
                "small": np.int8(-index)}


@pytest.mark.parametrize("output", [None, "torch"])
def test_every_field_dtype_and_empty_fields_reach_the_gpu(output):
    """Each field becomes its own device array (or tensor) with the host batch's dtype,
    shape and values, an empty field included."""
    if output == "torch":
        _torch_cuda()
    expected = host_epoch(ManyDtypes(), batch_size=4)
    with ArenaLoader(ManyDtypes(), batch_size=4, pin_memory=True, device="cuda",
                     output=output) as loader:
        batches = list(loader)
    assert len(batches) == len(expected) == 3
    for i, (batch, reference) in enumerate(zip(batches, expected)):
        if output == "torch":
            assert all(value.is_cuda for value in batch.values())
            batch = {key: value.cpu().numpy() for key, value in batch.items()}
        else:
            batch = host_copy(batch)
        assert_batches_equal(batch, reference, f"batch {i}")


def test_bfloat16_tensors_arrive_as_bfloat16_cuda_tensors():
    """A torch dataset's bfloat16 rows (stored as raw bits) reach the GPU as bfloat16."""
    torch = _torch_cuda()

    class Halves:
        def __len__(self):
            return 8

        def __getitem__(self, index):
            return torch.full((3,), index / 4, dtype=torch.bfloat16)

    with ArenaLoader(Halves(), batch_size=4, device="cuda", pin_memory=True) as loader:
        batches = list(loader)
    assert [batch.dtype for batch in batches] == [torch.bfloat16] * 2
    assert batches[1].cpu().float()[:, 0].tolist() == [1.0, 1.25, 1.5, 1.75]


def test_non_blocking_copies_of_pinned_batches_reach_the_gpu_intact():
    """pin_memory=True without a device, as torch users write the loop: ``x =
    x.cuda(non_blocking=True)`` drops the host batch before its copy has run (the GPU is kept
    busy first, so copies run late). Every batch reaches the GPU with its own rows, and every
    tensor handed out is pinned, as with torch's DataLoader. (With the slab page-locked in
    place, its slots were rewritten under 244 of 256 such copies.)"""
    torch = _torch_cuda()

    class Rows:
        def __len__(self):
            return 128

        def __getitem__(self, index):
            return torch.full((1 << 16,), float(index))

    kept, pinned = [], []
    with ArenaLoader(Rows(), batch_size=4, num_workers=2, pin_memory=True) as loader:
        for _epoch in range(2):
            for i, x in enumerate(loader):
                pinned.append(x.is_pinned())
                torch.cuda._sleep(1_000_000)  # ~0.5 ms of GPU time ahead of the copy
                x = x.cuda(non_blocking=True)
                kept.append((i, x))
    torch.cuda.synchronize()
    assert len(kept) == 64 and all(pinned)
    wrong = [i for i, x in kept if not bool((x == torch.arange(
        4 * i, 4 * i + 4, dtype=torch.float32, device=x.device)[:, None]).all())]
    assert wrong == [], f"batches {wrong} reached the GPU with other rows"


@pytest.mark.parametrize("stage", [dict(pin_memory=True), dict(device="cuda"),
                                   dict(pin_memory=True, device="cuda")])
def test_the_stages_draw_from_the_sampler_as_torch_does_on_a_gpu(stage):
    """With a real GPU behind the pin and device threads (real page-locking, real copies),
    after iter() and after each next() the sampler has given exactly as many batches as to
    torch's DataLoader with pin_memory=True: batches a stage took ahead of next() count
    against the read-ahead (test_pin_stage and test_device_sim check the same with fakes)."""
    torch = _torch_cuda()
    sampler = CountedBatches(12, 2)
    dataset = ImageDataset(24, shape=(4,))
    expected = draws_per_next(torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=2, pin_memory=True), sampler, settle_s=0.02)
    assert expected == [min(4 + k, 12) for k in range(13)]  # torch's prefetch_factor 2 * 2
    with ArenaLoader(dataset, batch_sampler=sampler, num_workers=2, **stage) as loader:
        assert draws_per_next(loader, sampler, settle_s=0.02) == expected
