"""trial14's harness: trial13's common.py (loaded from there, not copied), with ``plain``
extended to tensor subclasses' state (MONAI's MetaTensor meta, affine, applied_operations),
pandas objects and sets, and ``first_diff`` descending into lists (the epochs and batches)."""

import importlib.util
import os

import torch

_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "trial13", "common.py")
_spec = importlib.util.spec_from_file_location("trial13_common", _path)
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)
_base_plain, _base_first_diff = base.plain, base.first_diff


def plain(x):
    """A canonical, copied form of a batch (trial13's, plus the cases above)."""
    if isinstance(x, torch.Tensor):
        state = () if type(x) is torch.Tensor else tuple(
            sorted((k, plain(v)) for k, v in vars(x).items()))
        values = x.detach().as_subclass(torch.Tensor).clone()
        if values.dtype == torch.bfloat16:
            values = values.view(torch.int16)
        return (type(x).__name__, str(x.dtype), tuple(x.shape), values.numpy().tolist(),
                x.requires_grad, state)
    if type(x).__module__.startswith("pandas"):
        return (type(x).__name__, repr(x), str(getattr(x, "dtypes", getattr(x, "dtype", ""))))
    if isinstance(x, (set, frozenset)):
        return (type(x).__name__, tuple(sorted(map(repr, x))))
    if isinstance(x, dict):  # MONAI's applied_operations hold id(transform): differs per loader
        return (type(x).__name__, tuple((k, plain(v)) for k, v in x.items()
                                        if not (k == "id" and isinstance(v, int) and v > 1 << 32)))
    return _base_plain(x)


def first_diff(a, b, path="batch"):
    """trial13's, given the epochs' and batches' lists as tuples (it descends into tuples)."""
    if isinstance(a, list) and isinstance(b, list):
        a, b = (tuple(tuple(e) if isinstance(e, list) else e for e in x) for x in (a, b))
    return _base_first_diff(a, b, path)


base.plain, base.first_diff = plain, first_diff  # trial13's compare() and collect() use these
collect, compare, report_end, seeded, shm, variants = (
    base.collect, base.compare, base.report_end, base.seeded, base.shm, base.variants)
children = base.children
