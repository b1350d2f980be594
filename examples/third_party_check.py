"""Hugging Face `datasets` and PyTorch Lightning with ArenaLoader, beside torch's DataLoader.

Needs packages the test environment does not install (run by hand; see docs/migrating.md):

    pip install torch==2.13.0 datasets==5.0.1 lightning==2.6.6 -e .
    python examples/third_party_check.py
"""

import warnings

import lightning
import numpy as np
import torch
from datasets import Dataset
from torch.utils.data import DataLoader

from arena_loader import ArenaLoader

warnings.filterwarnings("ignore")


def pad_collate(batch):
    """Token lists of varying length (numpy rows of a HF dataset) padded per batch."""
    longest = max(len(row["ids"]) for row in batch)
    ids = np.zeros((len(batch), longest), np.int64)
    for r, row in enumerate(batch):
        ids[r, : len(row["ids"])] = row["ids"]
    return {"ids": ids, "label": np.array([row["label"] for row in batch]),
            "text": [str(row["text"]) for row in batch]}


class Model(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.lin(x).squeeze(-1), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class XY(torch.utils.data.Dataset):
    def __len__(self):
        return 256

    def __getitem__(self, i):
        x = torch.full((4,), i / 256.0)
        return x, x.sum()


if __name__ == "__main__":
    rows = {"ids": [list(range(i % 17 + 3)) for i in range(200)],
            "label": [i % 2 for i in range(200)], "text": [f"review {i}" for i in range(200)]}
    numpy_rows = Dataset.from_dict(rows).with_format("numpy")
    for name, loader_type in (("torch", DataLoader), ("arena", ArenaLoader)):
        out = list(loader_type(numpy_rows, batch_size=16, num_workers=2, collate_fn=pad_collate))
        print("HF datasets", name, len(out), out[3]["ids"].shape, out[3]["text"][:2],
              int(out[-1]["label"].sum()))
    tensors = Dataset.from_dict({"x": [[float(i)] * 4 for i in range(64)],
                                 "y": list(range(64))}).with_format("torch")
    ours = [b["x"].sum().item() for b in ArenaLoader(tensors, batch_size=8, num_workers=2)]
    theirs = [b["x"].sum().item() for b in DataLoader(tensors, batch_size=8, num_workers=2)]
    first = next(iter(ArenaLoader(tensors, batch_size=8)))["x"]
    print("HF torch format equal:", ours == theirs, type(first))

    losses = {}
    for name, loader_type in (("torch", DataLoader), ("arena", ArenaLoader)):
        torch.manual_seed(0)
        model = Model()
        trainer = lightning.Trainer(max_epochs=3, accelerator="cpu", logger=False,
                                    enable_checkpointing=False, enable_progress_bar=False,
                                    enable_model_summary=False)
        trainer.fit(model, loader_type(XY(), batch_size=32, shuffle=True, num_workers=2,
                                       persistent_workers=True))
        losses[name] = float(trainer.callback_metrics["loss"])
    print("Lightning final loss", losses)
