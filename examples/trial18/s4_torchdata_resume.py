"""Every case of s1 and s2 resumed mid-epoch by ArenaLoader and by torchdata's
StatefulDataLoader (same cut, same reseeding; 0 and 2 workers): is each equal to the
uninterrupted run (torch's DataLoader), and are the two resumed runs equal? The cases s1/s2
skip (samplers no state can resume) are run here too."""

from __future__ import annotations

import warnings

from common import CONFIGS, Tally, first_difference, resume, run, stub_modules, wants
from s1_libraries import GROUPS, torchsampler_cases
from s2_custom import cases as custom_cases
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

warnings.filterwarnings("ignore", message=".*set_vital.*")

if __name__ == "__main__":
    tally = Tally()
    cases = []
    for group in GROUPS:
        if group is torchsampler_cases:
            stub_modules()
        cases += group()
    for case in cases + custom_cases():
        for config in ("nw0", "nw2"):
            name = f"{case.name}/{config}"
            if not wants(name):
                continue
            cut = (1, 2) if case.epochs > 1 else (0, 7)
            whole = run(DataLoader, case, CONFIGS[config], record=False).order
            ours = resume(case, CONFIGS[config], *cut)
            try:
                theirs = resume(case, CONFIGS[config], *cut, loader_cls=StatefulDataLoader)
            except Exception as exc:
                theirs = f"{type(exc).__name__}: {exc}"
            verdict = ("same" if ours == theirs else "DIFFERENT") + "/" + \
                ("arena=whole" if ours == whole else "arena!=whole") + "/" + \
                ("torchdata=whole" if theirs == whole else "torchdata!=whole")
            detail = "" if ours == whole else "arena " + first_difference(whole, ours)
            if theirs != whole:
                detail += " torchdata " + (first_difference(whole, theirs)
                                           if isinstance(theirs, list) else theirs)
            tally.add(verdict, name, detail)
    tally.done()
