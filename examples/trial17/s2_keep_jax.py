"""trial17 s2: JAX arrays kept from batches (CPU backend): ``jnp.asarray``,
``jax.device_put`` and ``jax.dlpack.from_dlpack``, per leaf, as s1 does for its consumers
(with ``jax_enable_x64``, so the int64 labels are not narrowed into copies).

JAX is multithreaded and warns that ``os.fork()`` may deadlock, so the runs with workers use
``multiprocessing_context="forkserver"`` (the forkserver process is shared by every loader
and is not counted as a leftover child).

    .venv/bin/python examples/trial17/s2_keep_jax.py [substring of case names]
"""

from __future__ import annotations

import common
import numpy as np


def jax_consumers():
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)  # int64 labels stay int64 (else int32 copies)

    def pointer(x):
        return x.unsafe_buffer_pointer()

    def read(x):
        return np.asarray(x).tobytes()

    return [
        common.per_leaf("jnp.asarray", jnp.asarray, read, pointer),
        common.per_leaf("jax.device_put", jax.device_put, read, pointer, outputs=("numpy",)),
        # jax.device_put(tensor) raises TypeError (jax takes no torch tensor there): .numpy()
        common.per_leaf("jax.device_put(t.numpy())",
                        lambda t: jax.device_put(common.as_numpy(t)), read, pointer,
                        outputs=("torch",)),
        common.per_leaf("jax.dlpack.from_dlpack", jax.dlpack.from_dlpack, read, pointer),
    ]


if __name__ == "__main__":
    common.keep_all(jax_consumers(), contexts=("forkserver",))
