"""Scenario 4: NLP: a tokenizers WordLevel tokenizer trained in place (no download; tiktoken's
encodings need the network) wrapped by transformers' PreTrainedTokenizerFast; BatchEncoding
samples (a UserDict subclass) through default collation and through DataCollatorWithPadding,
DataCollatorForLanguageModeling (torch's RNG in workers), DataCollatorForSeq2Seq-style labels;
the tokenizer as collate_fn (BatchEncoding with its encodings as the batch). Found: default
collation rebuilt a BatchEncoding sample from its items (fixed); open: with num_workers=0 a
collate_fn's objects are pickled copies, so a BatchEncoding batch lacks _n_sequences."""

import os
import sys
import warnings

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import (
    DataCollatorForLanguageModeling,
    DataCollatorWithPadding,
    PreTrainedTokenizerFast,
    default_data_collator,
)

sys.path.insert(0, os.path.dirname(__file__))
from common import compare, report_end, seeded, shm, variants

warnings.simplefilter("ignore")
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog"]
TEXTS = [" ".join(WORDS[: 2 + i % 7]) + f" n{i}" for i in range(15)]

_tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
_tok.pre_tokenizer = pre_tokenizers.Whitespace()
_tok.train_from_iterator(TEXTS, trainers.WordLevelTrainer(
    special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
TOKENIZER = PreTrainedTokenizerFast(tokenizer_object=_tok, pad_token="[PAD]", unk_token="[UNK]",
                                    mask_token="[MASK]", cls_token="[CLS]", sep_token="[SEP]")


class Texts:
    def __init__(self, fixed_length=False, np_tensors=False):
        self.fixed_length, self.np_tensors = fixed_length, np_tensors

    def __len__(self):
        return len(TEXTS)

    def __getitem__(self, i):
        kwargs = dict(padding="max_length", max_length=12, truncation=True) if self.fixed_length \
            else {}
        if self.np_tensors:
            out = TOKENIZER(TEXTS[i], return_tensors="np", **kwargs)
            return {k: v[0] for k, v in out.items()} | {"labels": i % 2}
        out = TOKENIZER(TEXTS[i], **kwargs)
        out["labels"] = i % 2
        return out


def fresh_texts():
    torch.manual_seed(9)  # num_workers=0: DataCollatorForLanguageModeling draws from torch's RNG
    return Texts()


def tokenize_collate(batch):
    return TOKENIZER([TEXTS[i] for i in batch], padding=True, return_tensors="pt")


class Indices:
    def __len__(self):
        return len(TEXTS)

    def __getitem__(self, i):
        return i


if __name__ == "__main__":
    before = shm()
    base = dict(batch_size=4, shuffle=True)
    pad = DataCollatorWithPadding(TOKENIZER)
    pad_np = DataCollatorWithPadding(TOKENIZER, return_tensors="np")
    mlm = DataCollatorForLanguageModeling(TOKENIZER, mlm_probability=0.3)
    for tag, kw in variants(base):
        compare(f"4 DataCollatorWithPadding {tag}", Texts(), seeded(dict(kw, collate_fn=pad)))
        compare(f"4 DataCollatorWithPadding np {tag}", Texts(), seeded(dict(kw, collate_fn=pad_np)))
        compare(f"4 DataCollatorForLanguageModeling {tag}", fresh_texts,
                seeded(dict(kw, collate_fn=mlm)))
        compare(f"4 default_data_collator fixed length {tag}", Texts(True),
                seeded(dict(kw, collate_fn=default_data_collator)))
        compare(f"4 BatchEncoding default collate fixed output=torch {tag}", Texts(True),
                seeded(kw), extra={"output": "torch"})
        compare(f"4 np dict default collate fixed {tag}", Texts(True, True), seeded(kw),
                extra={"output": "torch"})
        compare(f"4 BatchEncoding default collate ragged (error) {tag}", Texts(), seeded(kw))
        compare(f"4 tokenizer as collate_fn {tag}", Indices(),
                seeded(dict(kw, collate_fn=tokenize_collate)))
        compare(f"4 BatchEncoding batch_size=None {tag}", Texts(),
                seeded(dict(kw, batch_size=None)))
    report_end(before)
