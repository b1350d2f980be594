"""s4: a ``collate_fn`` that raises or returns what cannot cross to the main process, and a
``worker_init_fn`` that raises or has the wrong signature (20 samples, batches of 4).

    python s4_collate_init.py [substring]
"""

from __future__ import annotations

import threading

from common import BAD, Case, Plain, compare, report
from torch.utils.data import default_collate


def collate_raises(samples):
    if any(int(s["y"]) == BAD for s in samples):
        raise ValueError("collate_fn cannot pad sample 9")
    return default_collate(samples)


def collate_lock(samples):
    batch = default_collate(samples)
    if any(int(s["y"]) == BAD for s in samples):
        batch["lock"] = threading.Lock()
    return batch


def collate_generator(samples):
    return (s for s in samples)


def collate_lambda(samples):
    batch = default_collate(samples)
    batch["f"] = lambda: 1
    return batch


def collate_two_args(samples, pad_value):
    return default_collate(samples)


def collate_none(samples):
    return None


def init_raises(worker_id):
    if worker_id == 1:
        raise RuntimeError("cannot open the LMDB env in worker 1")


def init_no_args():
    pass


def init_exit(worker_id):
    raise SystemExit(2)


WORKERS = ((2, False), (2, True))
INIT = "a worker_init_fn error ends the iterator (torch's goes on into UnboundLocalError)"
DROPPED = "an object that does not pickle: torch's worker drops the batch and hangs"
CASES = [
    Case("collate-raises", Plain, options={"collate_fn": collate_raises},
         names=(r"sample 9",)),
    Case("collate-unpicklable-leaf", Plain, options={"collate_fn": collate_lock},
         names=(r"lock",), known=DROPPED, hard_s=12),
    Case("collate-generator", Plain, options={"collate_fn": collate_generator},
         names=(r"generator",), known=DROPPED, hard_s=12),
    Case("collate-lambda", Plain, options={"collate_fn": collate_lambda}, known=DROPPED, hard_s=12),
    Case("collate-two-args", Plain, options={"collate_fn": collate_two_args},
         names=(r"pad_value",)),
    Case("collate-none", Plain, options={"collate_fn": collate_none}),
    Case("collate-not-callable", Plain, options={"collate_fn": "default"}),
    Case("worker-init-raises", Plain, options={"worker_init_fn": init_raises}, configs=WORKERS,
         names=(r"LMDB", r"worker_init_fn|worker 1|process 1"), known=INIT),
    Case("worker-init-no-args", Plain, options={"worker_init_fn": init_no_args},
         configs=WORKERS, names=(r"worker_init_fn|init_no_args",), known=INIT),
    Case("worker-init-not-callable", Plain, options={"worker_init_fn": 5}, configs=WORKERS,
         names=(r"worker_init_fn|not callable",), known=INIT),
    Case("worker-init-exits", Plain, options={"worker_init_fn": init_exit}, configs=WORKERS,
         names=(r"exit code 2",), known="a crash ends the iterator"),
]

if __name__ == "__main__":
    for case in CASES:
        compare(case)
    report()
