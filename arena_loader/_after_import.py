"""Run a function the moment a module is imported, by whatever imports it.

A worker of a program that uses torch sets torch up as torch's own workers have it: its RNG
seeded, one intra-op thread, ``torch.utils.data.get_worker_info()`` answering. A forked
worker has torch already. A spawned one (spawn, forkserver) used to import it at start: ~3 s
of CPU per worker on the 2-core machine (docs/benchmarks.md, "Spawned workers"), also for
datasets that never touch torch. Now it sets torch up as torch's import completes (while the
dataset unpickles, in ``worker_init_fn`` or in ``__getitem__``): nothing can use torch before
that, so nothing differs but the time.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from importlib.abc import MetaPathFinder
from types import ModuleType
from typing import Any


def when_imported(name: str, then: Callable[[ModuleType], None]) -> None:
    """``then(module)`` once the top-level module ``name`` is imported: now if it is, else
    as its import completes (before the importer gets the module)."""
    module = sys.modules.get(name)
    if module is not None:
        then(module)
    else:
        sys.meta_path.insert(0, _AfterImport(name, then))


class _AfterImport(MetaPathFinder):
    """First on ``sys.meta_path`` until ``name`` is looked for; then it lets the finders after
    it find the module and wraps that one loader's ``exec_module``."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]):
        self._name, self._then = name, then

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self._name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # once: an import after this one is a plain import
        spec = importlib.util.find_spec(fullname)  # (the finders after this one)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec  # (not found, or a loader of another kind: imported as it is)
        run, then = loader.exec_module, self._then

        def exec_module(module: ModuleType) -> None:
            try:
                run(module)
            finally:
                del loader.exec_module  # the loader's own method again
            then(module)

        loader.exec_module = exec_module
        return spec
