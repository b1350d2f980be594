"""The GPU leg: page-locking the slab and copying batches to a CUDA device on a numba stream.

Imported only by a loader with ``pin_memory=True`` or ``device`` set, so ``import
arena_loader`` needs no GPU and never imports ``numba.cuda``. See docs/design.md, "Device
copies".

- ``cuda``: every ``numba.cuda`` call (devices, streams, events, buffers, device arrays).
- ``pinning``: ``HostPinner`` page-locks each slab in place.
- ``ring``: device buffers leased to the consumer (``DeviceRing``, a ``_leases.LeaseRing``;
  ``DeviceLease``).
- ``upload``: one copy of a leased host slot into a device buffer (``SlotUploader``).
- ``stage``: the ``arena_loader-device`` thread and the consumer's ``next()`` (``DeviceStage``).
- ``iterator``: ``DeviceCopier``, which puts each host iterator behind a ``DeviceStage``.
"""

from .cuda import cuda_unavailable_reason, resolve_gpu
from .iterator import DeviceCopier
from .pinning import HostPinner

__all__ = ["DeviceCopier", "HostPinner", "cuda_unavailable_reason", "resolve_gpu"]
