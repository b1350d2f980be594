"""Samplers and batch samplers from libraries: torch's DataLoader against ArenaLoader
(order, len, draws, iter() calls; resume). See common.py and README.md."""

from __future__ import annotations

import torch
from common import LABELS, LENGTHS, Case, Tally, compare, stub_modules


def transformers_cases() -> list[Case]:
    from transformers.trainer_pt_utils import DistributedLengthGroupedSampler, LengthGroupedSampler

    def grouped(ds):
        s = LengthGroupedSampler(4, lengths=LENGTHS)
        return {"sampler": s, "batch_size": 4}, s

    def grouped_gen(ds):
        s = LengthGroupedSampler(4, lengths=LENGTHS, generator=torch.Generator().manual_seed(5))
        return {"sampler": s, "batch_size": 4, "drop_last": True}, s

    def dist_grouped(ds):
        s = DistributedLengthGroupedSampler(4, num_replicas=2, rank=1, lengths=LENGTHS, seed=3)
        return {"sampler": s, "batch_size": 4}, s

    return [Case("hf.LengthGrouped", grouped),
            Case("hf.LengthGrouped-gen-droplast", grouped_gen),
            Case("hf.DistributedLengthGrouped", dist_grouped)]


def torchsampler_cases() -> list[Case]:
    from torchsampler import ImbalancedDatasetSampler

    def imbalanced(ds):
        s = ImbalancedDatasetSampler(ds, labels=LABELS)
        return {"sampler": s, "batch_size": 4}, s

    def imbalanced_callback(ds):
        s = ImbalancedDatasetSampler(ds, num_samples=20)  # labels from ds.get_labels()
        return {"sampler": s, "batch_size": 3}, s

    return [Case("torchsampler.Imbalanced", imbalanced),
            Case("torchsampler.Imbalanced-n20", imbalanced_callback)]


def pml_cases() -> list[Case]:
    from pytorch_metric_learning.samplers import MPerClassSampler

    def mper(ds):
        s = MPerClassSampler(LABELS, m=2, batch_size=4, length_before_new_iter=24)
        return {"sampler": s, "batch_size": 4}, s

    return [Case("pml.MPerClass", mper,
                 resumable="draws from numpy's global RNG, which no state holds")]


def catalyst_cases() -> list[Case]:
    from catalyst.data import (
        BalanceClassSampler,
        DistributedSamplerWrapper,
        DynamicBalanceClassSampler,
    )
    from torch.utils.data import Sampler

    # catalyst 22.4 calls Sampler.__init__(labels); torch >= 2.2 takes no argument there
    Sampler.__init__ = lambda self, data_source=None: None

    def balance(ds):
        s = BalanceClassSampler(LABELS, mode="upsampling")
        return {"sampler": s, "batch_size": 4}, s

    def dynamic(ds):
        s = DynamicBalanceClassSampler(LABELS, exp_lambda=0.8, ignore_warning=True)
        return {"sampler": s, "batch_size": 4}, s

    def wrapper(ds):
        s = DistributedSamplerWrapper(BalanceClassSampler(LABELS, mode="downsampling"),
                                      num_replicas=2, rank=0, shuffle=True)
        return {"sampler": s, "batch_size": 2}, s

    numpy_global = "draws from numpy's global RNG, which no state holds"
    return [Case("catalyst.BalanceClass", balance, resumable=numpy_global),
            Case("catalyst.DynamicBalanceClass", dynamic,
                 resumable="counts epochs in __iter__ (no set_epoch, no state_dict)"),
            Case("catalyst.DistributedSamplerWrapper", wrapper, resumable=numpy_global)]


def torchnlp_cases() -> list[Case]:
    from torch.utils.data import RandomSampler, SequentialSampler
    from torchnlp.samplers import BalancedSampler, BucketBatchSampler

    def bucket(ds):
        s = BucketBatchSampler(RandomSampler(ds), batch_size=4, drop_last=False,
                               sort_key=lambda i: LENGTHS[i], bucket_size_multiplier=2)
        return {"batch_sampler": s}, s

    def bucket_seq(ds):
        s = BucketBatchSampler(SequentialSampler(ds), batch_size=4, drop_last=True,
                               sort_key=lambda i: LENGTHS[i], bucket_size_multiplier=3)
        return {"batch_sampler": s}, s

    def balanced(ds):
        s = BalancedSampler(list(range(len(ds))), get_class=lambda i: LABELS[i],
                            num_samples=24)
        return {"sampler": s, "batch_size": 4}, s

    return [Case("torchnlp.BucketBatch", bucket), Case("torchnlp.BucketBatch-seq", bucket_seq),
            Case("torchnlp.Balanced", balanced)]


def speechbrain_cases() -> list[Case]:
    from speechbrain.dataio.sampler import DynamicBatchSampler, ReproducibleRandomSampler

    def reproducible(ds):
        s = ReproducibleRandomSampler(ds, seed=11)
        return {"sampler": s, "batch_size": 4}, s

    def dynamic(ds):
        s = DynamicBatchSampler(ds, max_batch_length=40, num_buckets=3, lengths_list=LENGTHS,
                                shuffle=True, batch_ordering="random", seed=7)
        return {"batch_sampler": s}, s

    def dynamic_sorted(ds):
        s = DynamicBatchSampler(ds, max_batch_length=30, num_buckets=2, lengths_list=LENGTHS,
                                shuffle=False, batch_ordering="descending")
        return {"batch_sampler": s}, s

    return [Case("speechbrain.ReproducibleRandom", reproducible),
            Case("speechbrain.DynamicBatch", dynamic),
            Case("speechbrain.DynamicBatch-sorted", dynamic_sorted)]


def mmengine_cases() -> list[Case]:
    from mmengine.dataset import DefaultSampler, InfiniteSampler

    def default(ds):
        s = DefaultSampler(ds, shuffle=True, seed=9)
        return {"sampler": s, "batch_size": 4}, s

    def infinite(ds):
        s = InfiniteSampler(ds, shuffle=True, seed=9)
        return {"sampler": s, "batch_size": 4}, s

    return [Case("mmengine.Default", default),
            # mmengine's loop: one iter() for the whole run
            Case("mmengine.Infinite", infinite, steps=20, epochs=1),
            # an iter() per "epoch": every iterator delegates to one generator, which the
            # first dropped iterator closes, so the second epoch is empty (torch's too)
            Case("mmengine.Infinite-reiter", infinite, steps=11, epochs=2,
                 resumable="epoch 1 is empty (the shared generator was closed); a new "
                 "sampler in a resumed run is not")]


def torchdata_cases() -> list[Case]:
    from torchdata.stateful_dataloader.sampler import RandomSampler, StatefulDistributedSampler

    def stateful_dist(ds):
        s = StatefulDistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=4)
        return {"sampler": s, "batch_size": 4}, s

    def stateful_random(ds):
        s = RandomSampler(ds, generator=torch.Generator().manual_seed(2))
        return {"sampler": s, "batch_size": 4}, s

    def stateful_random_global(ds):
        s = RandomSampler(ds)
        return {"sampler": s, "batch_size": 4, "drop_last": True}, s

    return [Case("torchdata.StatefulDistributed", stateful_dist),
            Case("torchdata.RandomSampler-gen", stateful_random),
            Case("torchdata.RandomSampler-global", stateful_random_global)]


GROUPS = [transformers_cases, torchsampler_cases, pml_cases, catalyst_cases, torchnlp_cases,
          speechbrain_cases, mmengine_cases, torchdata_cases]

if __name__ == "__main__":
    tally = Tally()
    for group in GROUPS:
        if group is torchsampler_cases:
            stub_modules()
        try:
            cases = group()
        except Exception as exc:
            tally.add("IMPORT", group.__name__, f"{type(exc).__name__}: {exc}")
            continue
        for case in cases:
            compare(case, tally)
    tally.done()
