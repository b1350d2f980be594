"""Scenario 15: numpy array subclasses (MaskedArray, recarray, matrix, memmap) and tensor subclasses
(PyG EdgeIndex, Parameter) through default collation, batch_size=None and a collate_fn; prints the type
torch hands out beside ours (found: ours dropped the subclass, and a MaskedArray its mask; fixed in
e161bd1 and 0ce9492)."""
import torch
import numpy as np, tempfile, os, warnings
from torch.utils.data import DataLoader
from arena_loader import ArenaLoader
warnings.simplefilter("ignore")
mm = np.memmap(os.path.join(tempfile.mkdtemp(), "m"), np.float32, "w+", shape=(6, 3)); mm[:] = np.arange(18).reshape(6, 3)
def mk(kind, i):
    v = np.arange(3, dtype=np.float32) + i
    if kind == "masked": return np.ma.masked_array(v, mask=[i % 2 == 0, False, True])
    if kind == "rec": return np.rec.fromrecords([(i, float(i))], names="a,b")
    if kind == "matrix": return np.matrix(v)
    if kind == "memmap": return mm[i]
class DS:
    def __init__(self, kind): self.kind = kind
    def __len__(self): return 6
    def __getitem__(self, i): return mk(self.kind, i)
def ident(b): return b
def stack_keep(b):
    if isinstance(b[0], np.ma.MaskedArray): return np.ma.stack(b)
    return b[0].__class__ is np.recarray and np.rec.array(np.concatenate(b)) or np.stack(b)
def show(x):
    if isinstance(x, list): return "list[" + show(x[0]) + "]"
    s = type(x).__name__
    if isinstance(x, np.ma.MaskedArray): s += f"(mask={np.ma.getmaskarray(x).ravel()[:3].tolist()})"
    return s
for kind in ("masked", "rec", "matrix", "memmap"):
    for mode, kw in (("default collate", dict(batch_size=2)), ("batch_size=None", dict(batch_size=None)),
                     ("collate_fn stack", dict(batch_size=2, collate_fn=stack_keep)), ("collate_fn ident", dict(batch_size=2, collate_fn=ident))):
        row = []
        for cls in (DataLoader, ArenaLoader):
            for nw in (0, 2):
                try:
                    b = next(iter(cls(DS(kind), num_workers=nw, **kw)))
                    row.append(show(b))
                except Exception as e:
                    row.append(f"{type(e).__name__}")
        print(f"{kind:7s} {mode:17s} torch nw0/nw2: {row[0]:30s} {row[1]:30s} | arena: {row[2]:30s} {row[3]}")

print("--- tensor subclasses")
from torch_geometric import EdgeIndex
warnings.simplefilter("ignore")
class Tagged(torch.Tensor):
    pass
class DS:
    def __len__(self): return 4
    def __getitem__(self, i): return i
def ei(b):
    return EdgeIndex(torch.tensor([[0, 1, 1], [1, 0, 2]]) + b[0], sparse_size=(9, 9), sort_order="row")
def param(b): return torch.nn.Parameter(torch.ones(2) * b[0])
def tagged(b):
    return torch.ones(2).as_subclass(Tagged)
def ei_sample_ds():
    class D(DS):
        def __getitem__(self, i): return {"ei": ei([i])}
    return D()
def show_t(b):
    if isinstance(b, dict): return {k: show_t(v) for k, v in b.items()}
    s = type(b).__name__
    if isinstance(b, EdgeIndex): s += f"(sparse_size={b.sparse_size()}, sort_order={b.sort_order})"
    if isinstance(b, torch.nn.Parameter): s += f"(requires_grad={b.requires_grad})"
    return s
for name, ds, kw in (("collate EdgeIndex", DS(), dict(batch_size=2, collate_fn=ei)),
                     ("collate Parameter", DS(), dict(batch_size=2, collate_fn=param)),
                     ("collate user Tensor subclass", DS(), dict(batch_size=2, collate_fn=tagged)),
                     ("batch_size=None EdgeIndex sample", ei_sample_ds(), dict(batch_size=None))):
    for nw in (0, 2):
        row = []
        for cls in (DataLoader, ArenaLoader):
            try:
                row.append(show_t(next(iter(cls(ds, num_workers=nw, **kw)))))
            except Exception as e:
                row.append(f"{type(e).__name__}: {str(e)[:150]}")
        print(f"{name} nw={nw}: torch={row[0]} | arena={row[1]}")
