"""trial17 s3: tensordict samples as a dataset (TensorDict per sample, nested; (td, label)
pairs; ragged samples with ``tensordict.pad_sequence``; tensorclass samples; a whole
TensorDict indexed per sample), torch's DataLoader beside ArenaLoader with the same options
(common.LOADER_CONFIGS x output None / "torch"), every batch compared by bytes, dtype, shape
and structure, TensorDict batch_size included (common.compare).

    .venv/bin/python examples/trial17/s3_tensordict.py [substring of case names]
"""

from __future__ import annotations

import common
import tensordict
import torch
from tensordict import TensorDict, tensorclass


def td_sample(i: int) -> TensorDict:
    return TensorDict(
        {"obs": torch.arange(12, dtype=torch.float32).reshape(4, 3) + i,
         "action": torch.tensor(i % 5),
         "next": TensorDict({"reward": torch.tensor([i * 0.5]),
                             "done": torch.tensor([i % 3 == 0])}, batch_size=[])},
        batch_size=[])


class TDs:
    """A TensorDict per sample (nested TensorDict inside); ``pair``: (td, label) tuples."""

    def __init__(self, n=18, pair=False):
        self.n, self.pair = n, pair

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        td = td_sample(i)
        return (td, i * 10) if self.pair else td


class MissingKey(TDs):
    """Every fifth sample lacks "action": tensordict stacks such samples lazily."""

    def __getitem__(self, i):
        td = td_sample(i)
        if i % 5 == 2:
            del td["action"]
        return td


@tensorclass
class Step:
    obs: torch.Tensor
    reward: torch.Tensor


class Steps:
    def __len__(self):
        return 18

    def __getitem__(self, i):
        return Step(obs=torch.full((2, 3), float(i)), reward=torch.tensor(i * 1.5),
                    batch_size=[])


class WholeTD:
    """One TensorDict of N rows used as the dataset itself (td[i] per sample)."""

    def __init__(self):
        self.td = TensorDict({"x": torch.arange(18 * 6, dtype=torch.float64).reshape(18, 6),
                              "y": torch.arange(18)}, batch_size=[18])

    def __len__(self):
        return len(self.td)

    def __getitem__(self, i):
        return self.td[i]


def pad_collate(samples):
    return tensordict.pad_sequence(samples, pad_dim=0, return_mask=True)


def ragged_td(i):
    length = 2 + i % 4
    return TensorDict({"obs": torch.arange(length * 3, dtype=torch.float32).reshape(length, 3)
                       + i, "id": torch.full((length,), i)}, batch_size=[length])


class RaggedTDs:
    def __len__(self):
        return 18

    def __getitem__(self, i):
        return ragged_td(i)


if __name__ == "__main__":
    tally = common.Tally()
    compare = common.compare
    compare(tally, "td default collation", TDs)
    compare(tally, "td collate_fn=torch.stack", TDs, collate_fn=torch.stack)
    compare(tally, "td collate_fn=tensordict.collate", TDs, collate_fn=tensordict.collate)
    compare(tally, "td (td, label) default", lambda: TDs(pair=True))
    compare(tally, "td (td, label) tensordict.collate", lambda: TDs(pair=True),
            collate_fn=tensordict.collate)
    compare(tally, "td ragged pad_sequence", RaggedTDs, collate_fn=pad_collate)
    compare(tally, "td ragged default (lazy stack)", RaggedTDs)
    compare(tally, "td ragged torch.stack", RaggedTDs, collate_fn=torch.stack,
            configs=common.ERROR_CONFIGS)
    compare(tally, "td missing key default (lazy stack)", MissingKey)
    compare(tally, "tensorclass default", Steps)
    compare(tally, "tensorclass torch.stack", Steps, collate_fn=torch.stack)
    compare(tally, "tensorclass tensordict.collate", Steps, collate_fn=tensordict.collate)
    compare(tally, "td whole-dataset td[i]", WholeTD)
    tally.done()
