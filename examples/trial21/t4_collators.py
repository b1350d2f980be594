"""transformers 5.24's data collators as ``collate_fn``: torch's DataLoader against
ArenaLoader (README.md).

A user's Hugging Face code with ``from arena_loader import ArenaLoader as DataLoader``: the
tokenizer is a ``PreTrainedTokenizerFast`` over a WordLevel model trained here on a few
sentences (no downloads), the samples what ``datasets.map(tokenizer)`` gives without a
format (dicts of Python int lists, variable lengths). Each case loads 2 epochs with torch's
``DataLoader`` and with ``ArenaLoader`` (``output="torch"``, as docs/migrating.md advises for
such collate_fns, and the default ``output``), the same seeds and options, and compares every
batch: its class (``BatchEncoding`` or ``dict``), keys, leaf types, dtypes, shapes and
values, which keys hold the same object, a ``BatchEncoding``'s ``encodings`` and whether
``.to("cpu")`` keeps it one; then torch's RNG after the run, and leftovers.
"""

from __future__ import annotations

import copy
import os
import pickle
import sys
import warnings
from functools import partial

import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from torch.utils.data import DataLoader
from transformers import (
    BatchEncoding,
    DataCollatorForLanguageModeling,
    DataCollatorForMultipleChoice,
    DataCollatorForPermutationLanguageModeling,
    DataCollatorForSeq2Seq,
    DataCollatorForTokenClassification,
    DataCollatorWithPadding,
    PreTrainedTokenizerFast,
    default_data_collator,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CONFIGS, Tally, describe, error, seed_all, shm_names, stop_torch, wants

from arena_loader import ArenaLoader

warnings.filterwarnings("ignore", message=".*held.*")
B = 4
WORDS = ("the quick brown fox jumps over a lazy dog while seven small birds sing in green "
         "trees near an old river and children play games on warm sunny afternoons").split()


def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    trainer = trainers.WordLevelTrainer(special_tokens=specials)
    tok.train_from_iterator([" ".join(WORDS)] * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")


TOK = tokenizer()


def sentence(i: int, n: int) -> str:
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(n))


class Samples(torch.utils.data.Dataset):
    """Sample ``i`` of one of the shapes the collators take (``kind``)."""

    def __init__(self, kind: str, n: int = 22):
        # tokenized here, once: thread workers calling the one fast tokenizer at a time
        # race on its padding settings (transformers#47085), which is not what t4 compares
        self.kind, self.n = kind, n
        self.items = [self.make(i) for i in range(n)]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return copy.deepcopy(self.items[int(i)])

    def make(self, i: int):
        enc = dict(TOK(sentence(i, 3 + i % 6)))
        if self.kind == "cls":
            return {**enc, "label": i % 3}
        if self.kind == "seq2seq":
            return {**enc, "labels": TOK(sentence(i + 1, 2 + i % 4))["input_ids"]}
        if self.kind == "tokens":
            return {**enc, "labels": [(i + k) % 5 for k in range(len(enc["input_ids"]))]}
        if self.kind == "fixed":       # already padded: default_data_collator's input
            ids = TOK(sentence(i, 6), padding="max_length", max_length=8)
            return {**dict(ids), "label": i % 3, "score": i / 10}
        if self.kind == "fixed-np":
            return {"input_ids": np.arange(i, i + 8), "label": np.int64(i % 3)}
        if self.kind == "even":        # DataCollatorForPermutationLanguageModeling's
            return TOK(sentence(i, 2 + 2 * (i % 3)))["input_ids"]
        if self.kind == "offsets":     # whole word masking reads the offsets (which
            # tokenizer.pad does not pad: padded here)
            return dict(TOK(sentence(i, 3 + i % 6), return_offsets_mapping=True,
                            padding="max_length", max_length=10))
        if self.kind == "choices":
            return [dict(TOK(sentence(i + c, 2 + (i + c) % 4))) for c in range(3)]
        if self.kind == "text":
            return {"text": sentence(i, 2 + i % 5), "label": i % 3}
        if self.kind == "flat":
            return {"input_ids": enc["input_ids"], "labels": enc["input_ids"]}
        return enc


def mc_collator(samples):
    """DataCollatorForMultipleChoice's input: a list of choices per sample, and labels."""
    labels = [len(s[0]["input_ids"]) % 3 for s in samples]
    batch = DataCollatorForMultipleChoice(TOK)([{k: [c[k] for c in s] for k in s[0]} | {"label": y}
                                                for s, y in zip(samples, labels)])
    return batch


def tokenize_batch(samples, **kwargs):
    """The collate_fn many scripts write: tokenize the batch's raw text there."""
    enc = TOK([s["text"] for s in samples], padding=True, return_tensors="pt", **kwargs)
    enc["labels"] = torch.tensor([s["label"] for s in samples])
    return enc


def collect(loader, epochs: int = 2, keep: bool = False):
    """Each batch looked at when it comes, or (``keep``) every batch kept and looked at after
    the 2 epochs (an eval loop gathering its batches; held batches stay in the slab)."""
    out = []
    for _ in range(epochs):
        for batch in loader:
            out.append(batch if keep else look(batch))
    return [look(batch) for batch in out] if keep else out


def probe(read):
    try:
        return ("value", read())
    except Exception as exc:  # an error is compared as a result
        return ("error", error(exc))


def look(batch):
    """``describe`` plus what a collator's batch carries beyond values."""
    extra = {"class": ("str", type(batch).__name__)}
    if isinstance(batch, dict) or hasattr(batch, "keys"):
        keys = list(batch.keys())
        extra["same"] = ("list", [[a, b] for j, a in enumerate(keys) for b in keys[j + 1:]
                                  if batch[a] is batch[b]])
        extra["shapes"] = {k: ("tuple", tuple(getattr(batch[k], "shape", ()))) for k in keys}
        # what a training step may do: write into a batch's arrays in place
        extra["writes"] = {k: probe(lambda v=batch[k]: (v.__imul__(1), True)[1]) for k in keys
                           if isinstance(batch[k], (torch.Tensor, np.ndarray))}
    if isinstance(batch, BatchEncoding):
        encodings = batch.encodings
        extra["encodings"] = ("str", type(encodings).__name__)
        # each probed alone: transformers' pickling drops ``_n_sequences`` (torch's workers
        # hand out a BatchEncoding whose ``n_sequences`` raises AttributeError)
        if not THREADS_RUNNING:
            extra["n_sequences"] = probe(lambda: batch.n_sequences)
        extra["attr"] = probe(lambda: batch.input_ids is batch["input_ids"])
        if encodings:
            extra["tokens"] = probe(lambda: [batch.tokens(j) for j in range(len(encodings))])
            extra["word_ids"] = probe(lambda: [batch.word_ids(j)
                                               for j in range(len(encodings))])
            extra["char_to_token"] = probe(lambda: batch.char_to_token(0, 2))
        extra["to"] = probe(lambda: type(batch.to("cpu")).__name__)
    # a batch kept for later (pickled to a cache, deep-copied for logging)
    extra["pickled"] = probe(lambda: describe(dict(pickle.loads(pickle.dumps(batch)))))
    extra["deepcopy"] = probe(lambda: type(copy.deepcopy(batch)).__name__)
    return {"batch": describe(dict(batch) if hasattr(batch, "keys") else batch),
            "extra": extra}


def run(make, dataset, collate_fn, options, gen_seed, keep=False):
    seed_all()
    generator = torch.Generator().manual_seed(gen_seed) if gen_seed is not None else None
    loader = make(dataset, batch_size=B, shuffle=True, collate_fn=collate_fn,
                  generator=generator, **options)
    try:
        batches = collect(loader, keep=keep)
    except Exception as exc:  # an error is compared as a result
        batches = error(exc)
    after = torch.rand(3).tolist()
    stop_torch(loader)
    if isinstance(loader, ArenaLoader):
        loader.close()
    return {"batches": batches, "rng_after": ("list", after)}


def cases():
    yield "padding", "cls", DataCollatorWithPadding(TOK)
    yield "padding-mult8", "cls", DataCollatorWithPadding(TOK, pad_to_multiple_of=8)
    yield "padding-np", "cls", DataCollatorWithPadding(TOK, return_tensors="np")
    yield "mlm", "plain", DataCollatorForLanguageModeling(TOK, mlm=True, mlm_probability=0.3)
    # seeded: its generator is made at the first call in each process (so built anew per run)
    yield "mlm-seed", "plain", lambda: DataCollatorForLanguageModeling(TOK, mlm_probability=0.3,
                                                                       seed=7)
    # numpy's global RNG in the workers (torch reseeds torch's and Python's, not numpy's)
    yield "mlm-np", "plain", DataCollatorForLanguageModeling(TOK, mlm_probability=0.3,
                                                             return_tensors="np")
    yield "mlm-wwm", "offsets", DataCollatorForLanguageModeling(TOK, mlm_probability=0.3,
                                                              whole_word_mask=True)
    yield "plm", "even", DataCollatorForPermutationLanguageModeling(TOK)
    yield "plm-np", "even", DataCollatorForPermutationLanguageModeling(TOK, return_tensors="np")
    yield "clm", "plain", DataCollatorForLanguageModeling(TOK, mlm=False)
    yield "seq2seq", "seq2seq", DataCollatorForSeq2Seq(TOK)
    yield "seq2seq-np", "seq2seq", DataCollatorForSeq2Seq(TOK, return_tensors="np")
    yield "choices", "choices", mc_collator
    yield "tokens", "tokens", DataCollatorForTokenClassification(TOK)
    yield "tokenize", "text", tokenize_batch
    yield "tokenize-offsets", "text", partial(tokenize_batch, return_offsets_mapping=True,
                                              return_special_tokens_mask=True)
    yield "default", "fixed", default_data_collator
    yield "default-np-samples", "fixed-np", default_data_collator
    yield "default-np", "fixed", partial(default_data_collator, return_tensors="np")
    try:
        from transformers import DataCollatorWithFlattening
    except ImportError:
        return
    yield "flatten", "flat", DataCollatorWithFlattening()
    yield "flatten-fa", "flat", DataCollatorWithFlattening(return_flash_attn_kwargs=True,
                                                           return_seq_idx=True)


KEPT = ("padding", "clm", "tokenize", "flatten")   # every batch kept, looked at after
# 2 thread workers against torch's loader without workers: collators that draw nothing (a
# drawing one shares the process's RNG between the threads: docs/design.md, "Thread workers")
# (not "tokenize": its collate_fn calls the tokenizer, as above). transformers' pickling drops
# a BatchEncoding's ``n_sequences``, and thread workers' batches are pickled as process
# workers' are: it is left out of these cases (README.md)
THREADED = ("padding", "seq2seq", "tokens", "choices", "default", "flatten")
THREADS_RUNNING = False
SPAWNED = ("padding", "mlm-seed", "tokenize")   # spawn-started workers (slow: ~10 s a run)


def main() -> None:
    tally = Tally()
    for name, kind, collate_fn in cases():
        dataset = Samples(kind)
        configs = {k: (v, False) for k, v in CONFIGS.items()}
        if name in KEPT:
            configs["nw2-kept"] = (dict(num_workers=2), True)
        if name in SPAWNED:
            configs["nw2-spawn"] = (dict(num_workers=2, multiprocessing_context="spawn"), False)
        if name in THREADED:
            configs["thread"] = (dict(num_workers=0), False)
        for config, (options, keep) in configs.items():
            arena_options = dict(options, num_workers=2, worker_mode="thread") \
                if config == "thread" else options
            global THREADS_RUNNING
            THREADS_RUNNING = config == "thread"
            for gen_seed in (None, 5):
                for output in ("torch", None):
                    label = f"{name}/{config}/gen{gen_seed}/output={output}"
                    if not wants(label):
                        continue
                    before = shm_names()
                    fresh = collate_fn if getattr(collate_fn, "__name__", "") == "<lambda>" \
                        else (lambda f=collate_fn: f)
                    want = run(DataLoader, dataset, fresh(), options, gen_seed, keep)
                    got = run(partial(ArenaLoader, output=output), dataset, fresh(),
                              arena_options, gen_seed, keep)
                    both = isinstance(want["batches"], str) and want["batches"]
                    tally.check(label, want, got, before, f"(both {both})" if both else "")
    tally.done()


if __name__ == "__main__":
    main()
