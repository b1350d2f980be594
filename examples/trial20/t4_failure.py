"""t4: failures under torchrun, torch's DataLoader against ArenaLoader, num_workers 0 and 2:

- ``raise``: rank 1's dataset raises ValueError at sample 13 (epoch 0): the error rank 1
  reports (does it name the index?), how the run ends (torchrun's exit code), leftovers;
- ``raise-caught``: the same, but rank 1 catches it, destroys the process group and exits 0
  (rank 0 stops at its next collective): leftovers;
- ``sigkill``: rank 1 SIGKILLs itself after 3 steps (an OOM kill): leftovers after torchrun
  tears the job down;
- ``worker-sigkill``: rank 1's worker loading sample 13 is SIGKILLed: the error, leftovers;
- ``sigint``: Ctrl-C (SIGINT to torchrun's process group) once rank 1 has done 3 steps (it
  lands in rank 1's loop body);
- ``sigint-in-next``: the same, with every sample taking a second from then on, so that
  the Ctrl-C lands while rank 1 waits in ``next()`` (in its workers too: same group);
- ``sigterm``: SIGTERM to torchrun alone (a scheduler's preemption), which passes it on to
  the ranks, whose workers are left to notice;
- ``restart``: ``--max-restarts 1``, rank 1 raises at sample 13 on the first try only: the
  elastic agent restarts both ranks, whose second try must train as torch's does.

Leftovers: any process the run started still alive once torchrun exits (polled 10 s), and
/dev/shm names with the loader's prefix made by any of them.

    python t4_failure.py [substring]
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time

from common import (
    ONLY,
    Tally,
    Tensors,
    dump,
    init,
    launch,
    loader_class,
    mark,
    public,
    sampler_class,
    train,
)
from torch.utils.data import get_worker_info

CASES = ("raise", "raise-caught", "sigkill", "worker-sigkill", "sigint", "sigint-in-next",
         "sigterm", "restart")


class Killing(Tensors):
    """Rank 1's worker that loads sample 13 is SIGKILLed (the kernel's OOM killer)."""

    def __getitem__(self, i):
        if int(i) == 13 and os.environ["RANK"] == "1" and get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(i)


def rank_main(case: str, kind: str, nw: int, persist: bool) -> None:
    rank, _ = init()
    slow = os.path.join(os.environ["TRIAL20_OUT"], "slow")
    first_try = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    fails = case.startswith("raise") or (case == "restart" and first_try)
    dataset = (Killing if case == "worker-sigkill" else Tensors)(
        n=40, fail_at=13 if fails else None, slow_flag=slow)
    sampler = sampler_class("torch")(dataset, shuffle=False)
    loader = loader_class(kind)(dataset, batch_size=2, sampler=sampler, num_workers=nw,
                                persistent_workers=persist)

    def on_step(step: int) -> None:
        if step == 3 and rank == 1:
            if case == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if case in ("sigint", "sigterm"):
                mark("t4", rank, "step3")
                time.sleep(30)  # the driver's Ctrl-C lands here, or in the next batches
            if case == "sigint-in-next":
                with open(slow, "w"):
                    pass  # samples take a second each from now: Ctrl-C lands in next()
        if case.startswith(("sigint", "sigterm")) and rank == 0 and step > 3:
            time.sleep(0.2)

    if case == "raise-caught":
        try:
            train(loader, sampler, epochs=3, on_step=on_step)
        except ValueError as exc:
            import torch.distributed as dist
            dump("t4", rank, {"error": f"{type(exc).__name__}: {exc}"})
            dist.destroy_process_group()
            return
    dump("t4", rank, public(train(loader, sampler, epochs=3, on_step=on_step)))


def error_line(text: str) -> str:
    """What rank 1's traceback says about the failing sample."""
    lines = [ln for ln in text.splitlines() if "13" in ln and ("corrupt" in ln or "ndex" in ln
                                                               or "batch" in ln)]
    return " | ".join(dict.fromkeys(ln.strip()[:110] for ln in lines[:3]))


def last_error(text: str) -> str:
    """The exception rank 1 ended with (its traceback's last line)."""
    lines = [ln for ln in text.splitlines() if ln.startswith("[rank1]: ") and ln[9:10] != " "
             and ("Error" in ln or "Interrupt" in ln or "Exception" in ln)]
    return lines[-1][9:].strip() if lines else ""


def main() -> None:
    tally = Tally()
    for case in CASES:
        for nw, persist in ((0, False), (2, False), (2, True)):
            name = f"{case} nw={nw}{' persistent' if persist else ''}"
            if ONLY not in name:
                continue
            if case == "worker-sigkill" and nw == 0:
                continue
            seen, runs, flaky = {}, {}, {}
            for kind in ("torch", "arena"):
                run = launch(os.path.basename(__file__), case, kind, str(nw), str(int(persist)),
                             timeout=90, interrupt_when={"sigint": "t4.rank1.step3",
                                                          "sigint-in-next": "slow.rank1",
                                                          "sigterm": "t4.rank1.step3"}.get(case),
                             interrupt=signal.SIGTERM if case == "sigterm" else signal.SIGINT,
                             group=case != "sigterm",
                             torchrun_args=["--max-restarts", "1"] if case == "restart" else [],
                             env={"TRIAL_TIMEOUT": "40"} if case == "restart" else None)
                if case == "restart":
                    runs[kind] = [run.result("t4", r) for r in range(2)]
                    # torchrun's second rendezvous here fails now and then with either
                    # loader: gloo's connectFullMesh refused, or init_process_group hangs
                    # (until TRIAL_TIMEOUT); no loader has run in that process yet.
                    flaky[kind] = "connectFullMesh" in run.err or "init_process_group" in run.err
                r1 = run.result("t4", 1)
                said = (error_line(run.err) if case == "raise" else (r1 or {}).get("error")
                        or last_error(run.err))
                seen[kind] = (run.rc, said)
                tally.leaks(f"{name} {kind}", run.leftovers)
                tally.add("info", f"{name} {kind}",
                          f"rc={run.rc} {run.seconds:.1f} s; " + " / ".join(said.splitlines()[:2]))
            index_named = bool(re.search(r"\b13\b", seen["arena"][1]))
            if case.startswith("raise"):
                tally.add("SAME" if index_named else "DIFF", f"{name} error names index 13",
                          seen["arena"][1][:200])
            if case == "restart" and any(flaky.values()):
                tally.add("gloo", f"{name}", f"second rendezvous failed: {flaky}")
                continue
            tally.check(f"{name} torchrun exit code", seen["torch"][0], seen["arena"][0])
            if case == "restart":
                for rank in range(2):
                    tally.check(f"{name} rank{rank} second try", runs["torch"][rank],
                                runs["arena"][rank])
    tally.done()


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:
        rank_main(sys.argv[1], sys.argv[2], int(sys.argv[3]), bool(int(sys.argv[4])))
    else:
        sys.exit(main())
