"""What every iterator handed to user code has as torch's DataLoader iterators have it:
``len(iter(loader))``, and no copy or pickle."""

from __future__ import annotations

from typing import Any


class NotCopied:
    """Refuses ``copy.copy``, ``copy.deepcopy`` and pickling with torch's exception class, as
    torch's iterators do (``NotImplementedError``). A copy would share the epoch's state with
    the original: the two handed out the same batch, or, behind ``__getattr__``, recursed."""

    __slots__ = ()

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} cannot be pickled or copied, as torch's DataLoader "
            "iterators cannot: it runs one epoch on its loader's workers and shared memory; "
            "copy or pickle the loader, keep the position with loader.state_dict(), or call "
            "iter(loader) for a new iterator")


class LoaderLength(NotCopied):
    """The length of an iterator handed to user code: its loader's index sampler's (the batch
    sampler's, or the sampler's without batching), the whole epoch's as torch's ``__len__``
    gives it, not what is left. An iterable-style dataset's ``InfiniteConstantSampler`` has
    none: a ``TypeError``, as in torch. Code counts steps by it (``range(len(it))``), and
    ``tqdm(it)`` shows its total."""

    __slots__ = ()
    _owner: Any  # the loader (None only for the persistent iterator, never handed out)

    def __len__(self) -> int:
        loader = self._owner
        if loader is None:  # (a TypeError, which list() and other length hints pass over)
            raise TypeError(f"{type(self).__name__} of persistent workers has no len(); its "
                            "face that iter(loader) returns has the loader's")
        batch_sampler = loader.batch_sampler
        return len(loader.sampler if batch_sampler is None else batch_sampler)
