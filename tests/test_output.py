"""output="torch": zero-copy tensors over the slab, with torch's default_collate structure."""

from __future__ import annotations

import collections
import dataclasses
import gc
import threading
import types
import typing

import numpy as np
import pytest
import torch
import torch.utils.data

from arena_loader import ArenaLoader

from .datasets import ImageDataset, NestedDataset

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_torch_tensors_view_the_slot_and_free_it_when_dropped(num_workers):
    """Each tensor's memory is its slot's; the slot is free again once the tensor is gone."""
    dataset = ImageDataset(8, shape=(3, 4), dtype=np.float32)
    with ArenaLoader(dataset, batch_size=4, num_workers=num_workers, output="torch",
                     slots=5) as loader:
        assert sum(1 for _ in loader) == 2  # the first epoch sizes the slab
        iterator = iter(loader)
        batch = next(iterator)
        snapshot = loader.snapshot()
        offset = batch.data_ptr() - snapshot.slab_address
        assert isinstance(batch, torch.Tensor) and batch.dtype == torch.float32
        assert 0 <= offset < snapshot.slab_nbytes and offset % snapshot.slot_nbytes == 0
        np.testing.assert_array_equal(batch.numpy(), np.stack([dataset[i] for i in range(4)]))
        assert snapshot.leased_slots == 1
        del batch
        gc.collect()
        assert loader.snapshot().leased_slots == 0
        del iterator


def test_nested_samples_match_torch_default_collate():
    """Dicts, tuples and namedtuples of tensors with torch's dtypes (Python int -> int64,
    float -> float64, bool -> bool); tuples become lists and strings stay lists, as in
    torch."""
    dataset = NestedDataset(6)
    ours = list(ArenaLoader(dataset, batch_size=3, num_workers=2, output="torch"))
    theirs = list(torch.utils.data.DataLoader(dataset, batch_size=3))
    assert len(ours) == len(theirs) == 2

    def compare(a, b, where):
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor), where
            assert a.dtype == b.dtype and a.shape == b.shape, where
            assert torch.equal(a, b), where
        elif isinstance(b, dict):
            assert a.keys() == b.keys(), where
            for key in b:
                compare(a[key], b[key], f"{where}[{key!r}]")
        elif isinstance(b, (tuple, list)) and not isinstance(b[0], str):
            assert type(a) is type(b) and len(a) == len(b), where
            for i, (x, y) in enumerate(zip(a, b)):
                compare(x, y, f"{where}[{i}]")
        else:
            assert list(a) == list(b), where

    for i, (a, b) in enumerate(zip(ours, theirs)):
        compare(a, b, f"batch {i}")


class Pair(typing.NamedTuple):
    left: torch.Tensor
    right: int


def unbatched_sample(i):
    """Tuples at the top, inside a dict, inside a list, of strings; and a namedtuple."""
    return (torch.full((2,), float(i)), (i, 2.5), {"a": (i, torch.tensor([i, i]))},
            [(i,), "x"], ("s", "t"), Pair(torch.tensor(i), i))


def structure(value):
    """Types and values, leaf by leaf (tensors by dtype and values)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.tolist())
    if isinstance(value, dict):
        return (type(value), {key: structure(item) for key, item in value.items()})
    if isinstance(value, (tuple, list)):
        return (type(value), [structure(item) for item in value])
    return (type(value), value)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("output", [None, "torch"])
def test_unbatched_samples_get_torchs_default_convert_structure(output, num_workers):
    """batch_size=None without a collate_fn: tuples become lists at every depth (torch's
    default_convert), namedtuples keep their type, a tuple of strings becomes a list too;
    with a collate_fn its structure is kept. (Unbatched tuples stayed tuples, found by a
    user trial with webdataset's ``.batched()``.)"""
    dataset = [unbatched_sample(i) for i in range(4)]
    kwargs = dict(batch_size=None, num_workers=num_workers)
    theirs = [structure(b) for b in torch.utils.data.DataLoader(dataset, **kwargs)]
    with ArenaLoader(dataset, output=output, **kwargs) as loader:
        ours = [structure(b) for b in loader]
    assert ours == theirs
    assert theirs[0][0] is list and theirs[0][1][5][0] is Pair
    keep = dict(collate_fn=lambda sample: (sample[0], sample[1]), **kwargs)
    theirs = [structure(b) for b in torch.utils.data.DataLoader(dataset, **keep)]
    with ArenaLoader(dataset, output=output, **keep) as loader:
        assert [structure(b) for b in loader] == theirs
    assert theirs[0][0] is tuple and theirs[0][1][1][0] is tuple


class Tagged(list):
    """A list subclass (a library's sequence type)."""


@pytest.mark.parametrize("output", [None, "torch"])
def test_list_subclass_samples_keep_their_type_as_with_torch(output):
    """torch's default_collate, and default_convert (batch_size=None), keep a list subclass's
    type (a copy of it, its items set; tuples become lists). Tensors among the samples (or
    output="torch") made it a plain list here."""
    samples = [Tagged([torch.full((2,), float(i)), i]) for i in range(4)]
    for batch_size in (2, None):
        theirs = [structure(b) for b in
                  torch.utils.data.DataLoader(samples, batch_size=batch_size)]
        with ArenaLoader(samples, batch_size=batch_size, output=output) as loader:
            assert [structure(b) for b in loader] == theirs, batch_size
        assert theirs[0][0] is Tagged


@dataclasses.dataclass
class Example:
    image: np.ndarray
    label: int


def test_dataclass_and_ordered_dict_samples_in_torch_output():
    """output="torch": a dataclass sample's fields (collated field by field, where torch raises
    TypeError) come back as tensors, and an OrderedDict sample's batch stays an OrderedDict,
    as torch's default_collate copies the first sample's mapping."""
    samples = [Example(np.full(2, i, np.float32), i) for i in range(4)]
    with ArenaLoader(samples, batch_size=2, output="torch") as loader:
        batch = next(iter(loader))
    assert type(batch) is Example
    assert torch.equal(batch.image, torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
    assert torch.equal(batch.label, torch.tensor([0, 1]))
    ordered = [collections.OrderedDict(b=np.full(2, i), a=i) for i in range(4)]
    theirs = next(iter(torch.utils.data.DataLoader(ordered, batch_size=2)))
    with ArenaLoader(ordered, batch_size=2, output="torch") as loader:
        assert structure(next(iter(loader))) == structure(theirs)
    assert type(theirs) is collections.OrderedDict


@dataclasses.dataclass
class Sample:
    image: typing.Any
    box: typing.Any


@pytest.mark.parametrize("output", [None, "torch"])
def test_an_unbatched_samples_dataclass_is_passed_through_as_torchs_default_convert_does(
        output):
    """torch's ``default_convert`` (batch_size=None) leaves a dataclass as it is: its numpy
    array stays an array, its tuple a tuple. Ours made tensors and lists inside it too
    (``output="torch"`` still makes its array a tensor; the tuple stays)."""
    dataset = [{"sample": Sample(np.full(2, i), (i, torch.tensor([i]))), "t": torch.ones(1)}
               for i in range(2)]
    with ArenaLoader(dataset, batch_size=None, output=output) as loader:
        ours = [b["sample"] for b in loader]
    theirs = [b["sample"] for b in torch.utils.data.DataLoader(dataset, batch_size=None)]
    image = np.ndarray if output is None else torch.Tensor
    assert [(type(s.image), type(s.box), s.image.tolist()) for s in ours] == [
        (image, tuple, [i, i]) for i in range(2)]
    assert [(type(s.image), type(s.box)) for s in theirs] == [(np.ndarray, tuple)] * 2


def test_an_unbatched_samples_dataclass_keeps_its_numpy_scalars_and_matrices_as_torch_does():
    """torch's ``default_convert`` passes a dataclass through whole, so a numpy scalar or an
    ``np.matrix`` in it stays what it was; ours stored them as a 0-d array and a plain
    array, as for a sample's own (which torch makes tensors of)."""
    data = [{"sample": Sample(np.float32(1.5), np.matrix([[1, 2]])), "t": torch.ones(1)}]
    theirs = next(iter(torch.utils.data.DataLoader(data, batch_size=None)))["sample"]
    with ArenaLoader(data, batch_size=None) as loader:
        ours = next(iter(loader))["sample"]
    assert (type(ours.image), ours.image, type(ours.box), ours.box.tolist()) == (
        type(theirs.image), theirs.image, type(theirs.box), theirs.box.tolist()) == (
        np.float32, 1.5, np.matrix, [[1, 2]])


def test_an_unbatched_sample_whose_only_tensors_need_grad_is_converted_as_torchs():
    """batch_size=None: a sample whose tensors all travel pickled (``requires_grad``, a
    subclass) is a tensor sample all the same: torch's ``default_convert`` makes its numpy
    arrays tensors and its tuples lists. Ours handed them out as numpy and tuples."""
    data = [{"w": torch.ones(2, requires_grad=True), "x": np.arange(2), "p": (i, 2)}
            for i in range(2)]
    theirs = list(torch.utils.data.DataLoader(data, batch_size=None))
    with ArenaLoader(data, batch_size=None) as loader:
        ours = [structure(b) for b in loader]
    assert ours == [structure(b) for b in theirs]
    assert type(theirs[0]["x"]) is torch.Tensor and type(theirs[0]["p"]) is list


def test_torch_tensor_samples_are_accepted():
    """A dataset that returns CPU torch tensors is loaded like one returning arrays."""
    class TensorDataset:
        def __len__(self):
            return 6

        def __getitem__(self, i):
            return torch.full((2, 3), float(i)), torch.tensor(i)

    batches = list(ArenaLoader(TensorDataset(), batch_size=3, num_workers=2, output="torch"))
    expected = list(torch.utils.data.DataLoader(TensorDataset(), batch_size=3))
    for (x, y), (ex, ey) in zip(batches, expected):
        assert torch.equal(x, ex) and torch.equal(y, ey) and y.dtype == ey.dtype


def test_output_must_be_numpy_or_torch():
    """Any other output is refused at construction, naming the parameter."""
    with pytest.raises(ValueError, match=r"output must be one of \(None, 'numpy', 'torch'\), "
                                         r"got 'jax'"):
        ArenaLoader(ImageDataset(4), output="jax")


def _mixed_collate(samples):
    """A collate_fn's batch of tensors, numpy arrays and numpy scalars side by side."""
    return {"x": torch.tensor(samples), "mask": np.array(samples) > 1,
            "f32": np.float32(samples[0]), "n": len(samples),
            "pair": (np.int64(len(samples)), torch.tensor(2.5))}


def _leaf_types(batch):
    return {key: (type(value), [type(v) for v in value] if isinstance(value, tuple) else None)
            for key, value in batch.items()}


@pytest.mark.timeout(20)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_collate_fn_batch_is_handed_out_as_the_collate_fn_made_it(num_workers):
    """output=None: a collate_fn's numpy arrays and numpy scalars stay numpy beside its tensors
    (torch hands out what the collate_fn returns); they became tensors and 0-d arrays before
    (found by a user trial with a collate_fn returning tensors and a numpy mask)."""
    kwargs = dict(batch_size=3, collate_fn=_mixed_collate, num_workers=num_workers)
    theirs = list(torch.utils.data.DataLoader(list(range(6)), **kwargs))
    with ArenaLoader(list(range(6)), **kwargs) as loader:
        ours = list(loader)
    assert [_leaf_types(b) for b in ours] == [_leaf_types(b) for b in theirs]
    assert _leaf_types(theirs[0])["mask"][0] is np.ndarray
    assert _leaf_types(theirs[0])["f32"][0] is np.float32
    for mine, torchs in zip(ours, theirs, strict=True):
        assert torch.equal(mine["x"], torchs["x"]) and (mine["mask"] == torchs["mask"]).all()
        assert mine["f32"] == torchs["f32"] and mine["pair"][0] == torchs["pair"][0]


def _aliasing_collate(samples):
    ids = torch.tensor(samples)
    mask = np.array(samples) > 2
    return {"input_ids": ids, "labels": ids, "masks": (mask, mask)}


def _aliases(batch):
    return (batch["input_ids"] is batch["labels"], batch["masks"][0] is batch["masks"][1])


@pytest.mark.timeout(20)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_collate_fns_array_in_two_places_stays_one_array_as_with_torch(num_workers):
    """A collate_fn that puts one tensor (or array) in two places (pytorch-forecasting's
    ``x["decoder_target"]`` is its ``y[0]``; ``{"input_ids": ids, "labels": ids}``) gives
    torch's loader one object there, pickling keeping identity from workers: a write into
    one is seen in the other. Each place took a field, a copy of its own (trial21)."""
    kwargs = dict(batch_size=3, collate_fn=_aliasing_collate, num_workers=num_workers)
    theirs = list(torch.utils.data.DataLoader(list(range(6)), **kwargs))
    with ArenaLoader(list(range(6)), **kwargs) as loader:
        ours = list(loader)
    assert [_aliases(b) for b in ours] == [_aliases(b) for b in theirs] == [(True, True)] * 2
    for batch in ours + theirs:
        batch["labels"][0] = -100
        batch["masks"][1][0] = True
        assert batch["input_ids"][0] == -100 and batch["masks"][0][0]
    assert [b["input_ids"].tolist() for b in ours] == [b["input_ids"].tolist() for b in theirs]


class _OneTensorTwice:
    def __len__(self):
        return 2

    def __getitem__(self, i):
        ids = torch.arange(3) + i
        return {"input_ids": ids, "labels": ids}


@pytest.mark.timeout(20)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_tensor_in_two_places_of_an_unbatched_sample_is_written_through_as_with_torch(
        num_workers):
    """``batch_size=None``: torch's ``default_convert`` hands the sample's one tensor out in
    both places, so a write into ``labels`` changes ``input_ids``; it changed only the copy."""
    kwargs = dict(batch_size=None, num_workers=num_workers)
    theirs = list(torch.utils.data.DataLoader(_OneTensorTwice(), **kwargs))
    with ArenaLoader(_OneTensorTwice(), **kwargs) as loader:
        ours = list(loader)
    for batch in ours + theirs:
        batch["labels"][0] = -100
    assert [b["input_ids"].tolist() for b in ours] == [b["input_ids"].tolist() for b in theirs]
    assert theirs[1]["input_ids"].tolist() == [-100, 2, 3]


class _TwiceEach:
    def __len__(self):
        return 2

    def __getitem__(self, i):
        ids, mask = torch.arange(3) + i, np.arange(3) > i
        return {"input_ids": ids, "labels": ids, "mask": mask, "also": mask}


@pytest.mark.timeout(20)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_one_tensor_in_two_places_is_one_tensor_also_where_numpy_views_become_tensors(
        num_workers):
    """``batch_size=None``: torch's ``default_convert`` hands a tensor out as it is (one
    object in both places) and makes a tensor of a numpy array per place (two tensors over
    its memory). ``output="torch"``: a collate_fn's tensor in two places is one tensor, as
    without it. Every place got a tensor of its own (the fields became tensors per place)."""
    def pattern(b):
        return b["input_ids"] is b["labels"], b["mask"] is b["also"], type(b["mask"])

    kwargs = dict(batch_size=None, num_workers=num_workers)
    theirs = list(torch.utils.data.DataLoader(_TwiceEach(), **kwargs))
    with ArenaLoader(_TwiceEach(), **kwargs) as loader:
        ours = list(loader)
    assert [pattern(b) for b in ours] == [pattern(b) for b in theirs] == [
        (True, False, torch.Tensor)] * 2
    for batch in ours:  # (torch's workers send the two tensors' memory as two copies)
        batch["also"][0] = True
        assert batch["mask"][0]
    with ArenaLoader(list(range(6)), batch_size=3, collate_fn=_aliasing_collate,
                     output="torch") as loader:
        assert [_aliases(b) for b in loader] == [(True, True)] * 2


def test_a_numpy_scalar_in_two_places_of_an_unbatched_sample_is_two_tensors_as_with_torch():
    """``batch_size=None``: torch's ``default_convert`` makes a tensor of a numpy scalar per
    place, each with its own memory; a numpy scalar met twice was one field (a number met
    twice is one field, immutable), so a write into one tensor changed the other."""
    scale = np.float32(1.5)
    data = [{"a": scale, "b": scale, "t": torch.zeros(1)}]
    theirs = next(iter(torch.utils.data.DataLoader(data, batch_size=None)))
    with ArenaLoader(data, batch_size=None) as loader:
        ours = next(iter(loader))
        for batch in (ours, theirs):
            batch["a"] += 1
            assert (type(batch["b"]), batch["b"].item()) == (torch.Tensor, 1.5)
        del ours


class Encoding(collections.UserDict):
    """A mapping with state besides its items, as transformers' BatchEncoding keeps the
    tokenizer's encodings (``word_ids()`` reads them)."""

    def __init__(self, data=None, words=None):
        super().__init__(data)
        self.words = words


def _encoding_collate(samples):
    return Encoding({"ids": torch.tensor(samples), "mask": np.ones(len(samples))},
                    words=[f"w{s}" for s in samples])


@pytest.mark.timeout(20)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("output", [None, "torch"])
def test_collate_fn_mapping_keeps_its_attributes(output, num_workers):
    """A collate_fn's mapping comes back with its own attributes, as torch hands out the object
    (found by a user trial: a tokenizer as collate_fn gave a BatchEncoding whose word_ids()
    failed, its encodings lost)."""
    kwargs = dict(batch_size=2, collate_fn=_encoding_collate, num_workers=num_workers)
    theirs = list(torch.utils.data.DataLoader(list(range(4)), **kwargs))
    with ArenaLoader(list(range(4)), output=output, **kwargs) as loader:
        ours = list(loader)
    assert [(type(b), b.words, list(b)) for b in ours] == [
        (type(b), b.words, list(b)) for b in theirs]
    assert ours[1].words == ["w2", "w3"] and torch.equal(ours[1]["ids"], theirs[1]["ids"])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_default_collation_keeps_the_first_samples_mapping_attributes(num_workers):
    """Samples that are mappings with state of their own (a tokenizer's BatchEncoding) collate
    into a copy of the first sample's mapping, as torch's default_collate makes one (found by
    a user trial: the batch was rebuilt from its items, its encodings None)."""
    samples = [Encoding({"ids": [i, i + 1], "label": i}, words=[f"w{i}"]) for i in range(4)]
    kwargs = dict(batch_size=2, num_workers=num_workers)
    theirs = list(torch.utils.data.DataLoader(samples, **kwargs))
    with ArenaLoader(samples, output="torch", **kwargs) as loader:
        ours = list(loader)

    def seen(batch):
        return (type(batch), batch.words, [x.tolist() for x in batch["ids"]],
                batch["label"].tolist())

    assert [seen(b) for b in ours] == [seen(b) for b in theirs]
    assert seen(ours[1]) == (Encoding, ["w2"], [[2, 3], [3, 4]], [2, 3])


def test_in_process_batches_hold_the_collate_fns_objects_themselves():
    """With num_workers=0 a collate_fn's non-array values are the very objects it returned,
    as torch's are there, not pickled copies (found by a user trial: a BatchEncoding batch
    lost its _n_sequences to pickling; a lock in a batch raised TypeError)."""
    lock, made = threading.Lock(), []

    def collate(samples):
        made.append(types.SimpleNamespace(rows=samples))
        return {"x": torch.tensor(samples), "lock": lock, "tag": made[-1]}

    with ArenaLoader(list(range(4)), batch_size=2, collate_fn=collate) as loader:
        batches = list(loader)
    assert [(b["lock"] is lock, b["tag"] is tag) for b, tag in zip(batches, made)] == [
        (True, True)] * 2
    assert [b["x"].tolist() for b in batches] == [[0, 1], [2, 3]]


class _LibraryTensor(torch.Tensor):
    """A tensor subclass with metadata, as a library defines one (PyG's ``EdgeIndex`` with
    its ``sparse_size``, torchvision's ``tv_tensors``); its module starts with "torch"."""

    meta: str = ""

    def __reduce_ex__(self, protocol):
        return _rebuild_library_tensor, (self.as_subclass(torch.Tensor), self.meta)


_LibraryTensor.__module__ = "torch_ext.tensors"


def _rebuild_library_tensor(data, meta):
    out = data.as_subclass(_LibraryTensor)
    out.meta = meta
    return out


class _IndexSamples:
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        return index


def _library_tensor_collate(batch: list) -> dict:
    out = torch.tensor(batch).as_subclass(_LibraryTensor)
    out.meta = f"rows {batch}"
    return {"t": out, "p": torch.nn.Parameter(torch.ones(2) * batch[0])}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_collate_fn_tensor_subclasses_are_handed_out_as_they_are(num_workers):
    """A collate_fn's tensor subclasses keep their type and metadata, as with torch's
    DataLoader (PyG's EdgeIndex came back a plain Tensor without its sparse_size, a
    Parameter a Tensor without requires_grad)."""
    with ArenaLoader(_IndexSamples(), batch_size=2, num_workers=num_workers,
                     collate_fn=_library_tensor_collate) as loader:
        batches = list(loader)
    assert [type(b["t"]) for b in batches] == [_LibraryTensor] * 2
    assert [b["t"].meta for b in batches] == ["rows [0, 1]", "rows [2, 3]"]
    assert [b["t"].tolist() for b in batches] == [[0, 1], [2, 3]]
    assert all(type(b["p"]) is torch.nn.Parameter and b["p"].requires_grad for b in batches)


def _grad_collate(batch: list) -> dict:
    weights = torch.full((2,), float(batch[0]), requires_grad=True)
    return {"w": weights, "scaled": weights * 2, "x": torch.tensor(batch)}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_tensors_that_require_grad_keep_it_as_with_torch(num_workers):
    """A collate_fn's tensors that require grad: handed out requiring it, as by torch's
    DataLoader (the slab's copy dropped the flag); without workers the very tensors, graph
    included (torch returns the collate_fn's output); with workers a leaf requiring grad
    (torch's own workers hang on the non-leaf ``scaled``). A dataset's samples that require
    grad, stacked by default collation, keep the stack's graph as torch's do."""
    with ArenaLoader(_IndexSamples(), batch_size=2, num_workers=num_workers,
                     collate_fn=_grad_collate) as loader:
        batches = list(loader)
    assert [b["w"].tolist() for b in batches] == [[0.0, 0.0], [2.0, 2.0]]
    assert all(b["w"].requires_grad and b["w"].is_leaf for b in batches)
    assert all(b["scaled"].requires_grad for b in batches)
    assert [b["scaled"].grad_fn is not None for b in batches] == [num_workers == 0] * 2
    assert not any(b["x"].requires_grad for b in batches)
    theirs = next(iter(torch.utils.data.DataLoader(_GradSamples(), batch_size=2)))
    with ArenaLoader(_GradSamples(), batch_size=2) as loader:
        ours = next(iter(loader))
    assert ours.requires_grad and type(ours.grad_fn) is type(theirs.grad_fn)
    assert torch.equal(ours.detach(), theirs.detach())


class _GradSamples(_IndexSamples):
    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((2,), float(index), requires_grad=True)


class _MetaTensor(torch.Tensor):
    """A tensor subclass from outside torch's modules whose ``__torch_function__`` merges
    its metadata through ``torch.stack``, as MONAI's ``MetaTensor`` does."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        if func is torch.stack and isinstance(out, _MetaTensor):
            out.meta = tuple(m for t in args[0] for m in t.meta)
        return out


class _MetaSamples(_IndexSamples):
    def __getitem__(self, index: int) -> dict:
        image = torch.full((2,), float(index)).as_subclass(_MetaTensor)
        image.meta = (f"s{index}",)
        return {"image": image, "label": index}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_default_collation_stacks_tensor_subclasses_with_torch(num_workers):
    """Samples holding a tensor subclass defined outside torch are stacked by torch.stack,
    as torch's default_collate does: the batch keeps the subclass and the metadata its
    __torch_function__ merges, and its other fields are tensors (found by a user trial:
    MONAI's MetaTensor raised SampleTypeError)."""
    kwargs = dict(batch_size=2, num_workers=num_workers)
    theirs = list(torch.utils.data.DataLoader(_MetaSamples(), **kwargs))
    with ArenaLoader(_MetaSamples(), **kwargs) as loader:
        ours = list(loader)

    def seen(batch):
        return (type(batch["image"]), batch["image"].meta, batch["image"].tolist(),
                type(batch["label"]), batch["label"].tolist())

    assert [seen(b) for b in ours] == [seen(b) for b in theirs]
    assert seen(ours[1]) == (_MetaTensor, ("s2", "s3"), [[2.0, 2.0], [3.0, 3.0]],
                             torch.Tensor, [2, 3])


class _Box:
    """A class default collation cannot batch until a collate function is registered for it
    in torch's ``default_collate_fn_map``."""

    def __init__(self, value: int | list) -> None:
        self.value = value


def _collate_boxes(batch: list, *, collate_fn_map: dict) -> _Box:
    return _Box([box.value for box in batch])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_default_collation_uses_collate_functions_registered_with_torch(num_workers,
                                                                         monkeypatch):
    """A type registered in torch's default_collate_fn_map is collated by its function, as
    torch's default_collate does (found by a user trial: MONAI's list_data_collate registers
    MetaTensor's, after which torch's batches carried per-sample metadata and ours did not)."""
    from torch.utils.data._utils.collate import default_collate_fn_map

    monkeypatch.setitem(default_collate_fn_map, _Box, _collate_boxes)
    samples = [{"box": _Box(i), "x": (i, float(i))} for i in range(4)]
    kwargs = dict(batch_size=2, num_workers=num_workers)
    theirs = list(torch.utils.data.DataLoader(samples, **kwargs))
    with ArenaLoader(samples, **kwargs) as loader:
        ours = list(loader)

    def seen(batch):
        return (type(batch["box"]), batch["box"].value, [x.tolist() for x in batch["x"]])

    assert [seen(b) for b in ours] == [seen(b) for b in theirs]
    assert seen(ours[1]) == (_Box, [2, 3], [[2, 3], [2.0, 3.0]])


def test_output_torch_imports_torch_with_the_loader_not_inside_next():
    """output="torch" imports torch when the loader is made. Imported lazily by the first
    next(), a Ctrl-C landing in that import (it takes a second or more) left torch
    half-imported: every later next() raised RuntimeError ("Only a single TORCH_LIBRARY ...",
    "cannot initialize type ...") and the epoch was lost (found by benchmarks/chaos.py)."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "import numpy as np\n"
        "from arena_loader import ArenaLoader\n"
        "loader = ArenaLoader([np.zeros(2)] * 4, batch_size=2, output='torch')\n"
        "assert 'torch' in sys.modules, 'torch is not imported by the loader'\n"
        "assert [type(b).__name__ for b in loader] == ['Tensor', 'Tensor']\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
