"""Pickling and copying an ``ArenaLoader``, as torch's DataLoader allows (``copy.deepcopy``,
``pickle``, ``torch.multiprocessing.spawn(fn, args=(loader,))``, a spawn-started ``Pool``).

torch pickles its loader's ``__dict__``: the dataset, samplers, generator and options, in
their current state. Ours has the same, beside what belongs to the process that made it: the
slab, the live iterators and their workers, the finalizer that closes them, the pinning or
device stage, and the resume bookkeeping's lock. Those are left out and made anew where the
copy is loaded, as ``ArenaLoader._adopt_after_fork`` does for a forked child: the copy is an
independent loader over copies of the same dataset and samplers, with its own slab and
workers (torch's copy, likewise, has no iterator; torch refuses to pickle a loader whose
persistent workers run, ours leaves them with the original). A state ``load_state_dict()``
left for the next ``iter()`` goes along and is loaded again, as torchdata's copy keeps it.
"""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Any

from ._arena import ArenaSource
from ._pin_stage import BatchPinner
from ._resume import LoaderResume
from ._wiring import LiveIterators, close_all, open_gpu_options

# Made anew where a copy is loaded (_resume from the copied seeds); the rest is copied.
_PROCESS_BOUND = ("_pinner", "_device", "_pin_batch", "_unpinned", "_pinning", "_source",
                  "_iterators", "_pid", "_finalizer", "_resume")
_LOADED = "_loaded_state"  # (in the pickled state only: the state load_state_dict() left)


class Picklable:
    """``__getstate__`` / ``__setstate__`` for ArenaLoader (see the module's docstring), and
    the process-bound parts its constructor, a forked child and a loaded copy make."""

    def _open_gpu_parts(self) -> None:
        """The pinning and device parts for ``pin_memory`` and ``device``: with workers, a
        thread pins each batch while the training step runs, as torch's pin thread does;
        without, next() pins it, as torch's single-process iterator does."""
        options = self.options
        self._pinner, self._device, self._pin_batch, self._unpinned = open_gpu_options(
            options)
        self._pinning = BatchPinner(self._pin_batch) if (
            self._pin_batch is not None and options.num_workers > 0) else None

    def _open_process_parts(self) -> None:
        """The slab, the live-iterator registry and the finalizer that closes them in this
        process. With a device the stage counts the batches you hold (not the slot it
        copies from)."""
        on_device = self._device is not None
        self._source = ArenaSource(
            self.slots, pinner=self._pinner, lease_only=on_device, output=self.output,
            pin_batch=None if self._pinning else self._pin_batch,
            held_batch_limit=None if on_device else self.held_batch_limit)
        self._iterators = LiveIterators()
        self._pid = os.getpid()
        self._finalizer = weakref.finalize(self, close_all, self._source,
                                           self._iterators.live, self._pid)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in _PROCESS_BOUND:
            state.pop(name, None)
        # A loaded state that the next iter() would resume goes along, as torchdata's
        # StatefulDataLoader's (its next_iter_state): the copy resumes it too.
        with self._resume.lock:
            state[_LOADED] = self._resume.loaded()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        loaded = state.pop(_LOADED, None)
        self.__dict__.update(state)
        with warnings.catch_warnings():  # (the constructor gave its warnings once)
            warnings.simplefilter("ignore")
            self._open_gpu_parts()
        self._resume = LoaderResume(self._seeds)
        self._open_process_parts()
        if loaded is not None:
            self.load_state_dict(loaded)
