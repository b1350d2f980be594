"""s5: bad options (20 samples, batches of 4 unless the case sets ``batch_size``).

    python s5_options.py [substring]
"""

from __future__ import annotations

import numpy as np
from common import Case, N, Plain, compare, report

ZERO = ((0, False),)
TWO = ((2, False),)
NONE = ((None, False),)  # num_workers from the case's options


def opt(name, options, configs=ZERO, param=None, **kw):
    """A case whose error must name ``param`` (the option's name unless given)."""
    word = param if param is not None else next(iter(options))
    return Case(name, Plain, options=options, configs=configs,
                names=(rf"\b{word}\b",) if word else (), **kw)


CASES = [
    opt("num-workers-negative", {"num_workers": -1}, NONE),
    opt("num-workers-float", {"num_workers": 2.0}, NONE),
    opt("num-workers-str", {"num_workers": "2"}, NONE),
    opt("timeout-negative", {"timeout": -1}),
    opt("timeout-str", {"timeout": "5"}),
    opt("prefetch-without-workers", {"prefetch_factor": 2}),
    opt("prefetch-zero", {"prefetch_factor": 0}, TWO,
        known="prefetch_factor=0 refused (torch yields nothing)"),
    opt("prefetch-negative", {"prefetch_factor": -1}, TWO),
    opt("pin-memory-without-cuda", {"pin_memory": True}, ((0, False), (2, False))),
    opt("context-bad-string", {"multiprocessing_context": "forks"}, TWO),
    opt("context-without-workers", {"multiprocessing_context": "spawn"}),
    opt("context-object-of-wrong-type", {"multiprocessing_context": 3}, TWO),
    opt("generator-int-shuffle", {"generator": 42, "shuffle": True},
        known="an int seed is accepted (ours: numpy's order)"),
    opt("generator-str-shuffle", {"generator": "seed", "shuffle": True}),
    opt("generator-numpy-no-shuffle", {"generator": np.random.default_rng(0)}, TWO,
        known="a numpy Generator is accepted"),
    opt("generator-str-no-shuffle", {"generator": "seed"}, TWO),
    opt("batch-size-zero", {"batch_size": 0}),
    opt("batch-size-negative", {"batch_size": -4}),
    opt("batch-size-float", {"batch_size": 2.5}),
    opt("batch-size-str", {"batch_size": "4"}),
    opt("drop-last-str", {"drop_last": "yes"}),
    opt("drop-last-int", {"drop_last": 1}),
    opt("shuffle-str", {"shuffle": "yes"}),
    opt("persistent-without-workers", {"persistent_workers": True}),
    opt("in-order-str", {"in_order": "no"}, TWO),
    opt("sampler-with-shuffle", {"sampler": list(range(N)), "shuffle": True}, param="shuffle"),
    opt("batch-sampler-with-drop-last", {"batch_sampler": [[0, 1]], "drop_last": True},
        param="batch_sampler"),
    opt("batch-size-none-drop-last", {"batch_size": None, "drop_last": True}, param="drop_last"),
]

if __name__ == "__main__":
    for case in CASES:
        compare(case)
    report()
