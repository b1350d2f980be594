"""trial17 repro (polars', not ours): a polars gather in a forked worker hangs once the parent
has used polars' thread pool, under torch's DataLoader and ArenaLoader alike.

``df[indices]`` (what a bulk ``__getitems__`` does) runs on polars' thread pool; a worker
forked after the parent used that pool (here a ``sort``) waits forever for pool threads that
do not exist in the child. polars' own advice is the ``spawn``/``forkserver`` start methods,
which work with both loaders (s5_polars.py runs its ``__getitems__`` cases so).
``df.row(i)`` uses no pool and works under fork.

    timeout 60 .venv/bin/python examples/trial17/repro_polars_fork.py torch fork        # hangs
    timeout 60 .venv/bin/python examples/trial17/repro_polars_fork.py arena fork        # hangs
    timeout 60 .venv/bin/python examples/trial17/repro_polars_fork.py arena forkserver  # works
"""

import sys

import numpy as np
import polars as pl
from torch.utils.data import DataLoader

from arena_loader import ArenaLoader


class Rows:
    def __init__(self):
        self.df = pl.DataFrame({"id": np.arange(4000), "x": np.random.rand(4000)}).sort("x")

    def __len__(self):
        return len(self.df)

    def __getitems__(self, indices):
        return self.df[list(indices)].to_dicts()


if __name__ == "__main__":
    which, context = sys.argv[1], sys.argv[2]
    loader_type = ArenaLoader if which == "arena" else DataLoader
    loader = loader_type(Rows(), batch_size=64, num_workers=2, multiprocessing_context=context)
    print(which, context, sum(1 for _ in loader), "batches", flush=True)
