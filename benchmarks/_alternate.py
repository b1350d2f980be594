"""Run a benchmark script's cases each in a fresh interpreter, alternated round by round (the
first case of round r is case r), so drift on a shared machine spreads over all of them."""

from __future__ import annotations

import argparse
import subprocess
import sys


def case_parser(doc: str) -> argparse.ArgumentParser:
    """``--rounds``, ``--epochs`` and the hidden ``--case`` every such script takes."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    return parser


def rotation(names: list[str], round_: int) -> list[str]:
    """The cases in round ``round_``'s order: case ``round_`` first."""
    shift = round_ % len(names)
    return names[shift:] + names[:shift]


def alternate(script: str, names: list[str], rounds: int, epochs: int) -> dict[str, list[str]]:
    """Each case's last line of output, round by round: ``script --case NAME --epochs N``."""
    outputs: dict[str, list[str]] = {name: [] for name in names}
    for round_ in range(rounds):
        for name in rotation(names, round_):
            out = subprocess.run([sys.executable, script, "--case", name, "--epochs",
                                  str(epochs)], check=True, capture_output=True, text=True)
            outputs[name].append(out.stdout.splitlines()[-1])
    return outputs
