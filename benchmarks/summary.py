"""One bench run at a glance: ArenaLoader against the main peers per workload, and the targets.

    .venv/bin/arena-loader bench --out /tmp/full
    .venv/bin/python benchmarks/summary.py /tmp/full/bench.json > summary.md

Prints markdown: the machine and command, then one row per workload with ArenaLoader's
batches/s (median over rounds) and the within-round ratios (median [min-max]) against torch's
DataLoader, the queue-pickling loader, SPDL, the floor and the copy limit for speed, and
against torch for peak memory; then every target the run checked, met or missed. Every figure
is read from ``bench.json`` as the run wrote it (docs/benchmarks.md, "Current figures").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from arena_loader.bench.report import times, verdict

PEERS = ("torch default collate", "queue pickling", "SPDL arena", "floor", "copy limit")
SPEED, MEMORY = "steady_batches_per_s", "peak_memory_mb"


def summary(run: dict) -> str:
    env = run["environment"]
    lines = [f"{env['cpu_model']}, {env['cores']} cores, Python {env['python']}, "
             f"{env['date_utc'][:16].replace('T', ' ')} UTC; "
             f"`{run['settings'].get('command', 'arena-loader bench')}`", ""]
    header = ["workload", "ArenaLoader batches/s", *(f"speed / {p}" for p in PEERS),
              "peak memory / torch"]
    lines += ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    ours = {r["workload"]: r for r in run["results"] if r["loader"] == "ArenaLoader"}
    for workload, peers in run["ratios"].items():
        mine = ours.get(workload)
        if mine is None or not mine["available"]:
            continue
        cells = [workload, f"{mine[SPEED]['median']:,.0f}"]
        cells += [times(peers.get(peer, {}).get(SPEED)) for peer in PEERS]
        cells.append(times(peers.get("torch default collate", {}).get(MEMORY)))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| target | median [min-max] | |", "|---|---|---|"]
    for target in run["targets"]:
        lines.append(f"| {target['target']} | {times(target['ratio'])} | {verdict(target)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a bench.json written by arena-loader bench")
    print(summary(json.loads(parser.parse_args().run.read_text())))


if __name__ == "__main__":
    main()
