"""The notebook's dataset moved to a module file (the fix for spawn / forkserver workers,
which cannot import a class defined in the notebook's ``__main__``)."""

import time

import torch
from torch.utils.data import Dataset


class Squares(Dataset):
    """Sample i: {"x": float32[3] of i, "y": i}; ``sleep_s`` in every __getitem__."""

    def __init__(self, n=20, sleep_s=0.0):
        self.n, self.sleep_s = n, sleep_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return {"x": torch.full((3,), float(i)), "y": i}
