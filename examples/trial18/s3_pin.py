"""pin_memory=True under fake pinning (tests/conftest.py's): ArenaLoader's draws from the
sampler after iter() and after each next() against torch's DataLoader (which pins in a
thread with the same read-ahead rule; run without pinning, as its pin thread needs a GPU),
batches, len, and the resume, for a selection of s1's and s2's samplers."""

from __future__ import annotations

from common import PIN_CONFIGS, Tally, compare, fake_pinning, stub_modules
from s1_libraries import mmengine_cases, speechbrain_cases, torchdata_cases, transformers_cases
from s2_custom import cases as custom_cases

if __name__ == "__main__":
    copied = fake_pinning()
    tally = Tally()
    chosen = transformers_cases()[:1] + torchdata_cases() + mmengine_cases()
    stub_modules()
    chosen += speechbrain_cases()[1:2] + custom_cases()
    for case in chosen:
        compare(case, tally, configs=PIN_CONFIGS, resume_configs=("nw0-pin", "nw2-pin"))
    print(f"tensors pinned: {len(copied)}")
    tally.done()
