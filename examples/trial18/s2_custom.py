"""The custom samplers users write by hand, through torch's DataLoader and ArenaLoader (order,
len, draws, iter() calls; resume). See common.py and README.md."""

from __future__ import annotations

import itertools
from collections import defaultdict

import torch
from common import LENGTHS, Case, Tally, compare


class TrainingSampler:
    """detectron2's TrainingSampler: an endless shuffled stream, this rank's share of it; no
    ``__len__``."""

    def __init__(self, size: int, shuffle: bool = True, seed: int = 0, rank: int = 0,
                 world_size: int = 1):
        self._size, self._shuffle, self._seed = size, shuffle, seed
        self._rank, self._world_size = rank, world_size

    def __iter__(self):
        yield from itertools.islice(self._infinite_indices(), self._rank, None,
                                    self._world_size)

    def _infinite_indices(self):
        g = torch.Generator()
        g.manual_seed(self._seed)
        while True:
            if self._shuffle:
                yield from torch.randperm(self._size, generator=g).tolist()
            else:
                yield from torch.arange(self._size).tolist()


class GroupedBatches:
    """detectron2-style grouping (its AspectRatioGroupedDataset as a batch sampler): indices
    of one group are batched together as they come; endless, no ``batch_size`` attribute, no
    ``__len__``."""

    def __init__(self, sampler, groups: list[int], size: int):
        self.sampler, self.groups, self.size = sampler, groups, size

    def __iter__(self):
        buckets = defaultdict(list)
        for index in self.sampler:
            bucket = buckets[self.groups[index]]
            bucket.append(index)
            if len(bucket) == self.size:
                yield bucket[:]
                del bucket[:]


class TokenBudget:
    """fairseq/ESPnet-style dynamic batching: samples sorted by length within shuffled
    buckets, packed while ``max_tokens`` (padded) allows, batches shuffled; the epoch's
    batches change with ``set_epoch``. Batches vary in size. ``with_len``: a ``__len__``;
    ``batch_size``: an attribute saying the most samples a batch has (None: not said)."""

    def __init__(self, lengths, max_tokens: int, seed: int = 0, with_len: bool = True,
                 batch_size: int | str | None = "absent"):
        self.lengths, self.max_tokens, self.seed, self.epoch = lengths, max_tokens, seed, 0
        self.with_len = with_len
        if batch_size != "absent":
            self.batch_size = batch_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.lengths), generator=g).tolist()
        batches, batch, longest = [], [], 0
        for chunk in range(0, len(order), 12):
            for i in sorted(order[chunk: chunk + 12], key=lambda j: self.lengths[j]):
                longest2 = max(longest, self.lengths[i])
                if batch and longest2 * (len(batch) + 1) > self.max_tokens:
                    batches.append(batch)
                    batch, longest2 = [], self.lengths[i]
                batch.append(i)
                longest = longest2
            if batch:
                batches.append(batch)
                batch, longest = [], 0
        return [batches[k] for k in torch.randperm(len(batches), generator=g).tolist()]

    def __iter__(self):
        yield from self._batches()

    def __len__(self) -> int:
        if not self.with_len:
            raise TypeError("TokenBudget has no len()")
        return len(self._batches())


class StatefulShuffle:
    """A sampler written to torchdata's Stateful contract: a new permutation each
    ``iter()`` (its own epoch count), ``state_dict()`` says where it is (epoch and indices
    yielded), and ``iter()`` after ``load_state_dict()`` goes on from there."""

    def __init__(self, n: int, seed: int = 0):
        self.n, self.seed = n, seed
        self.epoch, self.yielded, self._resume_at, self._started = 0, 0, None, False

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        if self._resume_at is not None:
            skip, self._resume_at = self._resume_at, None
        else:
            if self._started:
                self.epoch += 1
            skip = 0
        self._started = True
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.n, generator=g).tolist()
        self.yielded = skip
        for index in order[skip:]:
            self.yielded += 1
            yield index

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "yielded": self.yielded, "started": self._started}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self._started = state["epoch"], state["started"]
        self._resume_at = state["yielded"]


class EpochSeeded:
    """A sampler whose order comes from ``set_epoch`` alone (DistributedSampler's pattern,
    without its padding), with an ``epoch`` that is not an int until set."""

    def __init__(self, n: int, seed: int = 0):
        self.n, self.seed, self.epoch = n, seed, None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + (self.epoch or 0))
        yield from torch.randperm(self.n, generator=g).tolist()


class LyingLen:
    """A shuffled sampler whose ``__len__`` is not what it yields (a filter applied after
    the length was taken; an epoch-size setting)."""

    def __init__(self, n: int, said: int):
        self.n, self.said = n, said

    def __len__(self) -> int:
        return self.said

    def __iter__(self):
        yield from torch.randperm(self.n).tolist()


def cases() -> list[Case]:
    groups = [length % 2 for length in LENGTHS]

    def training(ds):
        s = TrainingSampler(len(ds), seed=3)
        return {"sampler": s, "batch_size": 4}, s

    def grouped(ds):
        s = GroupedBatches(TrainingSampler(len(ds), seed=3), groups, 3)
        return {"batch_sampler": s}, s

    def budget(ds, **kw):
        s = TokenBudget(LENGTHS, max_tokens=40, seed=5, **kw)
        return {"batch_sampler": s}, s

    def stateful(ds):
        s = StatefulShuffle(len(ds), seed=8)
        return {"sampler": s, "batch_size": 4}, s

    def stateful_batches(ds):
        from torch.utils.data import BatchSampler

        s = StatefulShuffle(len(ds), seed=8)
        return {"batch_sampler": BatchSampler(s, 4, False)}, s

    def seeded(ds):
        s = EpochSeeded(len(ds), seed=2)
        return {"sampler": s, "batch_size": 4}, s

    def dist(ds):
        from torch.utils.data.distributed import DistributedSampler

        s = DistributedSampler(ds, num_replicas=3, rank=2, shuffle=True, seed=6)
        return {"sampler": s, "batch_size": 4}, s

    return [
        Case("custom.TrainingSampler", training, steps=10),
        Case("custom.GroupedBatches", grouped, steps=9),
        Case("custom.TokenBudget", budget),
        Case("custom.TokenBudget-nolen", lambda ds: budget(ds, with_len=False)),
        Case("custom.TokenBudget-bs-none", lambda ds: budget(ds, batch_size=None)),
        Case("custom.TokenBudget-bs-max", lambda ds: budget(ds, batch_size=8)),
        Case("custom.TokenBudget-bs-2", lambda ds: budget(ds, batch_size=2)),
        Case("custom.StatefulShuffle", stateful),
        Case("custom.StatefulShuffle-batches", stateful_batches),
        Case("custom.EpochSeeded", seeded),
        Case("torch.DistributedSampler", dist),
        Case("custom.LyingLen-short", lambda ds: ({"sampler": LyingLen(len(ds), 5),
                                                   "batch_size": 4}, None)),
        Case("custom.LyingLen-long", lambda ds: ({"sampler": LyingLen(len(ds), 100),
                                                  "batch_size": 4}, None)),
        # plain iterables: a list, a range, a one-shot generator (empty after epoch 0)
        Case("plain.list-batches", lambda ds: ({"batch_sampler": [[3, 1], [4, 1, 5], [9]]},
                                               None)),
        Case("plain.range-sampler", lambda ds: ({"sampler": range(29, -1, -2),
                                                 "batch_size": 4}, None)),
        Case("plain.generator-sampler", lambda ds: ({"sampler": iter(range(0, 30, 3)),
                                                     "batch_size": 4}, None),
             resumable="a one-shot generator: a new one in a resumed run starts over"),
    ]


if __name__ == "__main__":
    tally = Tally()
    for case in cases():
        compare(case, tally)
    tally.done()
