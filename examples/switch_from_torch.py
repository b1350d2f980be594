"""A torch training script as users write it (variable-length text, a pad_sequence collate,
shuffle, persistent workers), run with torch's DataLoader or, changing only the import, with
ArenaLoader: both give the same sample order and the same losses.

    .venv/bin/python examples/switch_from_torch.py torch
    .venv/bin/python examples/switch_from_torch.py arena
"""
import sys
import time

import torch
import torch.nn as nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset

if sys.argv[1:] == ["arena"]:
    from arena_loader import ArenaLoader as DataLoader
else:
    from torch.utils.data import DataLoader


class Reviews(Dataset):
    """Token sequences of varying length with a label, as a text dataset gives."""
    def __init__(self, n=4096):
        g = torch.Generator().manual_seed(0)
        self.lengths = torch.randint(8, 200, (n,), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)
    def __len__(self):
        return len(self.lengths)
    def __getitem__(self, i):
        n, label = int(self.lengths[i]), int(self.labels[i])
        # Label 1 reviews use the upper half of the vocabulary: a model can learn it.
        ids = (torch.arange(n) * 7 + i) % 500 + 500 * label
        return ids, label


def collate(batch):
    ids, labels = zip(*batch)
    lengths = torch.tensor([len(x) for x in ids])
    return pad_sequence(ids, batch_first=True), lengths, torch.tensor(labels)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(1000, 32)
        self.out = nn.Linear(32, 2)
    def forward(self, x, lengths):
        mask = torch.arange(x.shape[1])[None, :] < lengths[:, None]
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
        return self.out(self.emb(x[mask], offsets))


if __name__ == "__main__":
    torch.set_num_threads(1)  # a model this small gains nothing from more; leave cores to workers
    torch.manual_seed(0)
    loader = DataLoader(Reviews(), batch_size=64, shuffle=True, num_workers=2,
                        collate_fn=collate, persistent_workers=True)
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    losses, order = [], []
    start = time.perf_counter()
    for _epoch in range(2):
        for x, lengths, y in loader:
            order.append(int(x[0, 0]))
            loss = nn.functional.cross_entropy(model(x, lengths), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
    print(sys.argv[1], f"batches {len(losses)} first-loss {first:.4f} last-loss {last:.4f} "
          f"order {order[:6]} time {time.perf_counter() - start:.2f}s")
