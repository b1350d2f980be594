"""PyTorch Geometric 2.8 graph batches: torch's DataLoader (and PyG's own loaders, torch
DataLoader subclasses) against ArenaLoader with the collate_fn a user passes (README.md).

Each case trains a small GCN (PyG's ``GCNConv``, pure torch ops here) for 2 epochs, or only
reads the batches where there is nothing to train, and compares every batch (class, stores,
``batch``/``ptr`` vectors, ``to_data_list()``), each loss, the final weights and one draw of
torch's global RNG afterwards; then leftovers.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import warnings
from functools import partial

import torch
from torch.utils.data import DataLoader, Dataset
from torch_geometric import EdgeIndex
from torch_geometric.data import Batch, Data, HeteroData, InMemoryDataset
from torch_geometric.loader import (
    DataListLoader,
    DenseDataLoader,
    DynamicBatchSampler,
    ImbalancedSampler,
    RandomNodeLoader,
)
from torch_geometric.loader import DataLoader as PyGLoader
from torch_geometric.loader.data_list_loader import collate_fn as list_collate
from torch_geometric.loader.dataloader import Collater
from torch_geometric.loader.dense_data_loader import collate_fn as dense_collate
from torch_geometric.nn import GCNConv, global_mean_pool

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CONFIGS, SEED, Tally, describe, error, seed_all, shm_names, stop_torch, wants

from arena_loader import ArenaLoader

N, B, D = 21, 4, 5      # graphs, batch size, node features


# --- the user's data ---------------------------------------------------------------------------
def graph(i: int, g: torch.Generator) -> Data:
    n = 3 + i % 4
    return Data(x=torch.randn(n, D, generator=g),
                edge_index=torch.randint(0, n, (2, 2 * n), generator=g),
                edge_attr=torch.rand(2 * n, 2, generator=g), y=torch.tensor([i % 3]),
                name=f"g{i}")


class Graphs(Dataset):
    """A user's torch Dataset of PyG ``Data`` objects (built once, no files)."""

    def __init__(self, n: int = N, make=graph):
        g = torch.Generator().manual_seed(0)
        self.items = [make(i, g) for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class Jittered(Graphs):
    """Each access adds noise from torch's global RNG (a random transform): in a worker, the
    worker's seed decides it, so the batches match only if the workers' seeds do."""

    def __getitem__(self, i):
        d = self.items[i].clone()
        d.x = d.x + 0.01 * torch.randn(d.x.shape)
        return d


class Stored(InMemoryDataset):
    """PyG's own dataset class: ``process()`` saves the graphs, ``__getitem__`` separates one
    out of the collated storage."""

    def __init__(self, root: str):
        super().__init__(root)
        self.load(self.processed_paths[0])

    @property
    def processed_file_names(self):
        return ["graphs.pt"]

    def process(self):
        self.save(Graphs().items, self.processed_paths[0])


class PairData(Data):
    """PyG docs' pair of graphs in one Data (``__inc__`` per edge index)."""

    def __inc__(self, key, value, *args, **kwargs):
        if key == "edge_index_s":
            return self.x_s.size(0)
        if key == "edge_index_t":
            return self.x_t.size(0)
        return super().__inc__(key, value, *args, **kwargs)


def pair(i: int, g: torch.Generator) -> PairData:
    a, b = graph(i, g), graph(i + 1, g)
    return PairData(x_s=a.x, edge_index_s=a.edge_index, x_t=b.x, edge_index_t=b.edge_index,
                    y=a.y)


def hetero(i: int, g: torch.Generator) -> HeteroData:
    d = HeteroData()
    d["paper"].x = torch.randn(2 + i % 3, D, generator=g)
    d["author"].x = torch.randn(1 + i % 2, 3, generator=g)
    d["author", "writes", "paper"].edge_index = torch.stack([
        torch.randint(0, 1 + i % 2, (4,), generator=g),
        torch.randint(0, 2 + i % 3, (4,), generator=g)])
    d.y = torch.tensor([i % 3])
    return d


def with_edge_index(i: int, g: torch.Generator) -> Data:
    d = graph(i, g)
    d.edge_index = EdgeIndex(d.edge_index, sparse_size=(d.num_nodes, d.num_nodes))
    return d


def dense(i: int, g: torch.Generator) -> Data:
    adj = (torch.rand(6, 6, generator=g) > 0.6).float()
    return Data(x=torch.randn(6, D, generator=g), adj=adj,
                mask=torch.arange(6) < 3 + i % 4, y=torch.tensor([i % 3]))


class Mixed(Graphs):
    """A (graph, target, extras) sample: Collater recurses into the tuple and dict."""

    def __getitem__(self, i):
        return self.items[i], torch.tensor([float(i)]), {"w": i / 10, "tag": f"t{i}"}


def sized(i: int, g: torch.Generator) -> Data:
    """Small graphs first, then 200,000-node ones (12.8 MB of features each): batches outgrow
    the slot the first batch sized."""
    n = 50 if i < 8 else 200_000
    return Data(x=torch.randn(n, 16, generator=g), y=torch.tensor([i % 3]),
                edge_index=torch.randint(0, n, (2, n), generator=g))


def digest(batch) -> tuple:
    """A large Batch summed up: class, per-key shape, dtype and a checksum, graph count."""
    return (type(batch).__name__, batch.num_graphs, sorted(
        (k, tuple(v.shape), str(v.dtype), float(v.double().sum()), float((v.double() * torch.arange(
            v.numel()).view(v.shape).double().remainder(97)).sum()))
        for k, v in batch.to_dict().items()))


def big_graph() -> Data:
    g = torch.Generator().manual_seed(1)
    n = 40
    return Data(x=torch.randn(n, D, generator=g),
                edge_index=torch.randint(0, n, (2, 160), generator=g),
                y=torch.randint(0, 3, (n,), generator=g),
                train_mask=torch.rand(n, generator=g) < 0.7)


# --- model and run -----------------------------------------------------------------------------
class GCN(torch.nn.Module):
    def __init__(self, pool: bool = True):
        super().__init__()
        self.pool = pool
        self.conv1, self.conv2 = GCNConv(D, 16), GCNConv(16, 16)
        self.lin = torch.nn.Linear(16, 3)

    def forward(self, x, edge_index, batch=None):
        h = torch.relu(self.conv1(x, edge_index))
        h = torch.relu(self.conv2(h, edge_index))
        return self.lin(global_mean_pool(h, batch) if self.pool else h)


def graph_step(model, b):
    return torch.nn.functional.cross_entropy(model(b.x, b.edge_index, b.batch), b.y)


def node_step(model, b):
    out = model(b.x, b.edge_index)
    return torch.nn.functional.cross_entropy(out[b.train_mask], b.y[b.train_mask])


def run(make, epochs=2, step=graph_step, pool=True, stop=None, keep=False, describe=describe):
    """Train (``step=None``: only read) and describe every batch. ``keep``: the batches are
    kept and described after the epochs, not as they come."""
    seed_all()
    torch.manual_seed(SEED)
    model = GCN(pool)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {"batches": [], "losses": []}
    kept, loader = [], None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            loader = make()
            for _ in range(epochs):
                for k, batch in enumerate(loader):
                    (kept.append(batch) if keep else out["batches"].append(describe(batch)))
                    if step is not None:
                        loss = step(model, batch[0] if isinstance(batch, list) else batch)
                        opt.zero_grad()
                        loss.backward()
                        opt.step()
                        out["losses"].append(round(loss.item(), 6))
                    if stop is not None and k == stop:
                        break
        except Exception as exc:  # an error is a result to compare
            out["error"] = type(exc).__name__
            out["mro"] = [c.__name__ for c in type(exc).__mro__]
            out["message"] = error(exc)
        finally:
            loader = stop_torch(loader)
    out["batches"] += [describe(b) for b in kept]
    out["weights"] = [p.detach().round(decimals=5).tolist() for p in model.parameters()]
    out["rng"] = torch.rand(1).item()
    out["warnings"] = sorted({f"{w.category.__name__}: {str(w.message)[:60]}" for w in caught
                              if "pin_memory" not in str(w.message)})
    return out


ORDERS = {"seq": {}, "shuffle": {"shuffle": True}, "gen": {"shuffle": True, "generator": "seed 7"}}


def build(cls, *args, **kwargs):
    """``cls(*args, **kwargs)`` with ``generator="seed 7"`` made a fresh seeded generator (each
    run starts from the same one)."""
    if kwargs.get("generator") == "seed 7":
        kwargs["generator"] = torch.Generator().manual_seed(7)
    if isinstance(kwargs.get("batch_sampler"), tuple):            # (class, args, kwargs): anew
        sampler_cls, sampler_args, sampler_kwargs = kwargs["batch_sampler"]
        kwargs["batch_sampler"] = sampler_cls(*sampler_args, **sampler_kwargs)
    return cls(*args, **kwargs)


def compare(tally, name, want_make, got_make, **kw):
    if not wants(name):
        return
    want = run(want_make, **kw)
    before = shm_names()
    got = run(got_make, **kw)
    note = f"{len(want['batches'])} batches" + (f", {want['error']}" if "error" in want else "")
    if "error" in want and want["error"] in got.get("mro", ()):
        # ours may raise a subclass of torch's type (docs/migrating.md, "Errors and warnings")
        note += f" (arena {got['error']}: {got['message'][:150]})"
        for key in ("message", "mro", "error"):
            want.pop(key), got.pop(key)
    tally.check(name, want, got, before, note)


def pair_of(torch_cls, dataset, *args, collater=(), **kwargs):
    """The two loaders a switching user compares: ``torch_cls`` (torch's DataLoader or a PyG
    subclass) and ``ArenaLoader`` with ``Collater(dataset, *collater)`` as collate_fn."""
    return (partial(build, torch_cls, dataset, *args, **kwargs),
            partial(build, ArenaLoader, dataset, *args, collate_fn=Collater(dataset, *collater),
                    **kwargs))


def same_args(dataset, *args, **kwargs):
    """torch's DataLoader and ArenaLoader with the same arguments."""
    return (partial(build, DataLoader, dataset, *args, **kwargs),
            partial(build, ArenaLoader, dataset, *args, **kwargs))


def subgraph(data, idx):
    return data.subgraph(torch.tensor(idx))


def main() -> None:
    tally = Tally()
    graphs, jit = Graphs(), Jittered()
    for cname, cfg in CONFIGS.items():
        for oname, order in ORDERS.items():
            tag = f"{cname}-{oname}"
            both = dict(**order, **cfg)
            compare(tally, f"collater-{tag}",
                    *same_args(graphs, B, collate_fn=Collater(graphs), **both))
            compare(tally, f"pygloader-{tag}", *pair_of(PyGLoader, graphs, B, **both))
            compare(tally, f"fromlist-{tag}",
                    *same_args(graphs, B, collate_fn=Batch.from_data_list, drop_last=True,
                               **both))
            compare(tally, f"jitter-{tag}", *pair_of(PyGLoader, jit, B, **both))

    tmp = tempfile.TemporaryDirectory()
    stored = Stored(tmp.name)
    datasets = {"pairs": Graphs(make=pair), "hetero": Graphs(make=hetero),
                "edgeindex": Graphs(make=with_edge_index), "mixed": Mixed(),
                "inmemory": stored, "inmemory-subset": stored[torch.arange(3, N)],
                "dense": Graphs(make=dense), "large": Graphs(16, make=sized)}
    big = big_graph()
    ys = torch.tensor([d.y.item() if i % 4 else 0 for i, d in enumerate(graphs.items)])
    for cname, cfg in CONFIGS.items():
        tag = f"{cname}-gen"
        both = dict(**ORDERS["gen"], **cfg)
        follow = (["x", "edge_attr"], ["name"])
        compare(tally, f"follow-{tag}",
                *pair_of(PyGLoader, graphs, B, follow_batch=follow[0], exclude_keys=follow[1],
                         **both)[:1],
                partial(build, ArenaLoader, graphs, B, collate_fn=Collater(graphs, *follow),
                        **both))
        compare(tally, f"pairs-{tag}",
                partial(build, PyGLoader, datasets["pairs"], B, follow_batch=["x_s", "x_t"],
                        **both),
                partial(build, ArenaLoader, datasets["pairs"], B,
                        collate_fn=Collater(datasets["pairs"], ["x_s", "x_t"]), **both),
                step=None)
        compare(tally, f"hetero-{tag}", *pair_of(PyGLoader, datasets["hetero"], B, **both),
                step=None)
        for name in ("edgeindex", "mixed", "inmemory", "inmemory-subset"):
            compare(tally, f"{name}-{tag}", *pair_of(PyGLoader, datasets[name], B, **both))
        compare(tally, f"datalist-{tag}",
                partial(build, DataListLoader, graphs, B, **both),
                partial(build, ArenaLoader, graphs, B, collate_fn=list_collate, **both),
                step=None)
        compare(tally, f"dense-{tag}",
                partial(build, DenseDataLoader, datasets["dense"], B, **both),
                partial(build, ArenaLoader, datasets["dense"], B, collate_fn=dense_collate,
                        **both), step=None)
        parts = 4
        compare(tally, f"randomnode-{cname}",
                partial(build, RandomNodeLoader, big, parts, shuffle=True, **cfg),
                partial(build, ArenaLoader, range(big.num_nodes),
                        math.ceil(big.num_nodes / parts), shuffle=True,
                        collate_fn=partial(subgraph, big), **cfg),
                step=node_step, pool=False, epochs=3)
        for steps in (None, 4):
            sampler = (DynamicBatchSampler, (graphs, 20), dict(shuffle=True, num_steps=steps))
            compare(tally, f"dynamic{steps}-{cname}",
                    *same_args(graphs, batch_sampler=sampler, collate_fn=Collater(graphs),
                               **cfg))
        compare(tally, f"imbalanced-{cname}",
                *pair_of(PyGLoader, graphs, B, sampler=ImbalancedSampler(ys), **cfg))
        compare(tally, f"batchnone-{cname}", *same_args(graphs, batch_size=None, **both),
                step=None)
        compare(tally, f"default-collate-{cname}", *same_args(graphs, B, **cfg), step=None)
        compare(tally, f"keep-{tag}", *pair_of(PyGLoader, graphs, B, **both), keep=True)
        compare(tally, f"break-{tag}", *pair_of(PyGLoader, graphs, B, **both), stop=1,
                epochs=3)
        compare(tally, f"large-{tag}", *pair_of(PyGLoader, datasets["large"], B, **both),
                step=None, describe=digest)
    # ArenaLoader's worker threads (no torch counterpart): against torch's loader without workers
    for oname in ("seq", "gen"):
        for name in ("mixed", "hetero", "large"):
            ds = datasets[name]
            compare(tally, f"thread-{name}-{oname}",
                    partial(build, PyGLoader, ds, B, **ORDERS[oname]),
                    partial(build, ArenaLoader, ds, B, collate_fn=Collater(ds), num_workers=2,
                            worker_mode="thread", **ORDERS[oname]),
                    step=graph_step if name == "mixed" else None,
                    describe=digest if name == "large" else describe)
    # spawn-started workers (they import this script as __mp_main__, PairData with it)
    spawn = dict(num_workers=2, multiprocessing_context="spawn", **ORDERS["gen"])
    for name in ("pairs", "hetero", "mixed"):
        ds = datasets[name]
        compare(tally, f"spawn-{name}-gen", *pair_of(PyGLoader, ds, B, **spawn),
                step=graph_step if name == "mixed" else None)
    tmp.cleanup()
    tally.done()


if __name__ == "__main__":
    main()
