"""t5: checkpoint and resume per rank under torchrun. Each rank trains 3 epochs uninterrupted
(``full``); a second run stops after K steps, saving model, optimizer and the loader's
``state_dict()`` per rank (``inside``: in the loop after step K, the usual checkpoint hook;
``after``: once the loop has broken out); a new torchrun run loads them and trains on
(``set_epoch`` at each epoch's start, as the user's loop does). The resumed batches, losses
and final weights must equal the rest of the uninterrupted run, per rank. ArenaLoader against
torchdata's StatefulDataLoader (the API it copies), same cases; samplers: torch's and our
DistributedSampler, and torchdata's StatefulDistributedSampler (whose own state_dict the
loaders save).

    python t5_resume.py [substring]
"""

from __future__ import annotations

import itertools
import os
import sys

import torch
from common import (
    ONLY,
    Tally,
    Tensors,
    dump,
    init,
    launch,
    loader_class,
    public,
    sampler_class,
    train,
)

EPOCHS = 3
STEPS = 6  # per rank per epoch: 21 samples, 2 ranks, batch 2 -> 11 -> 6 batches


def cases():
    for kind, sampler, (nw, persist), cut, when in itertools.product(
            ("stateful", "arena"), ("torch", "ours", "stateful"), ((0, False), (2, False),
                                                                  (2, True)),
            (3, 6, 8), ("inside", "after")):
        yield (f"{kind} sampler={sampler} nw={nw}{' persistent' if persist else ''} "
               f"cut={cut} {when}"), dict(kind=kind, sampler=sampler, nw=nw, persist=persist,
                                          cut=cut, when=when)


def build(cfg):
    dataset = Tensors()
    sampler = sampler_class(cfg["sampler"])(dataset, shuffle=True, seed=5)
    loader = loader_class(cfg["kind"])(dataset, batch_size=2, sampler=sampler,
                                       num_workers=cfg["nw"],
                                       persistent_workers=cfg["persist"])
    return sampler, loader


def rank_main(phase: str) -> None:
    from common import model
    from torch.nn.parallel import DistributedDataParallel
    rank, _ = init()
    out = os.environ["TRIAL20_OUT"]
    results = {}
    done_full = set()
    only = sys.argv[2] if len(sys.argv) > 2 else ""
    for name, cfg in cases():
        if only not in name:
            continue
        key = (cfg["kind"], cfg["sampler"], cfg["nw"], cfg["persist"])
        ckpt = os.path.join(out, f"{name.replace(' ', '_')}.rank{rank}.pt")
        if phase == "save":
            if key not in done_full:
                done_full.add(key)
                sampler, loader = build(cfg)
                results["full " + repr(key)] = public(train(loader, sampler, epochs=EPOCHS))
            sampler, loader = build(cfg)
            net = DistributedDataParallel(model())
            opt = torch.optim.SGD(net.parameters(), lr=0.5)
            saved = {}

            def on_step(step, loader=loader, net=net, opt=opt, saved=saved, cfg=cfg):
                if step == cfg["cut"] and cfg["when"] == "inside":
                    saved["loader"] = loader.state_dict()
            got = train(loader, sampler, epochs=EPOCHS, net=net, opt=opt,
                        stop_after=cfg["cut"], on_step=on_step)
            if cfg["when"] == "after":
                saved["loader"] = loader.state_dict()
            torch.save({"model": net.module.state_dict(), "opt": opt.state_dict(),
                        "loader": saved["loader"], "epoch": (cfg["cut"] - 1) // STEPS}, ckpt)
            results[name] = public(got)
        else:
            state = torch.load(ckpt, weights_only=False)
            sampler, loader = build(cfg)
            module = model()
            module.load_state_dict(state["model"])
            net = DistributedDataParallel(module)
            opt = torch.optim.SGD(net.parameters(), lr=0.5)
            opt.load_state_dict(state["opt"])
            try:
                loader.load_state_dict(state["loader"])
                results[name] = public(train(loader, sampler, epochs=EPOCHS, net=net, opt=opt,
                                             start_epoch=state["epoch"]))
            except Exception as exc:
                results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    dump(f"t5-{phase}", rank, results)


def joined(before, after):
    """The batches (or losses) of the run cut and resumed, per epoch: the resumed run starts
    with the rest of the epoch the cut was in (empty when the cut was its last step: the
    loader's state then still says that epoch, as StatefulDataLoader's does)."""
    return [*before[:-1], before[-1] + after[0], *after[1:]]


def main() -> None:
    tally = Tally()
    save = launch(os.path.basename(__file__), "save", ONLY, timeout=280)
    if save.rc != 0:
        tally.add("ERROR", "save run", f"rc={save.rc} {save.err[-1500:]}")
    resume = launch(os.path.basename(__file__), "resume", ONLY, outdir=save.outdir, timeout=280)
    if resume.rc != 0:
        tally.add("ERROR", "resume run", f"rc={resume.rc} {resume.err[-1500:]}")
    tally.leaks("save run", save.leftovers)
    tally.leaks("resume run", resume.leftovers)
    saved = [save.result("t5-save", r) or {} for r in range(2)]
    resumed = [resume.result("t5-resume", r) or {} for r in range(2)]
    for name, cfg in cases():
        if ONLY not in name:
            continue
        key = repr((cfg["kind"], cfg["sampler"], cfg["nw"], cfg["persist"]))
        for rank in range(2):
            full, cut = saved[rank].get("full " + key), saved[rank].get(name)
            rest = resumed[rank].get(name)
            if not (full and cut and rest) or "error" in rest:
                tally.add("ERROR", f"{name} rank{rank}", str((rest or {}).get("error"))[:300])
                continue
            want = {k: full[k] for k in ("batches", "losses", "weights")}
            got = {"batches": joined(cut["batches"], rest["batches"]),
                   "losses": joined(cut["losses"], rest["losses"]),
                   "weights": rest["weights"]}
            tally.check(f"{name} rank{rank} resumed == uninterrupted", want, got)
    # ArenaLoader's uninterrupted runs against StatefulDataLoader's
    for rank in range(2):
        for sampler, nw in itertools.product(("torch", "ours", "stateful"), ((0, False), (2, False),
                                                                  (2, True))):
            a = saved[rank].get("full " + repr(("arena", sampler, *nw)))
            s = saved[rank].get("full " + repr(("stateful", sampler, *nw)))
            if a and s:
                tally.check(f"full sampler={sampler} nw={nw} rank{rank} arena == stateful", s, a)
    tally.done()


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:
        rank_main(sys.argv[1])
    else:
        sys.exit(main())
