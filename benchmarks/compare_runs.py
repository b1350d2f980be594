"""Do two bench runs agree? Every ratio of one run against the same ratio of the other.

    .venv/bin/arena-loader bench --quick --out /tmp/run1
    .venv/bin/arena-loader bench --quick --out /tmp/run2
    .venv/bin/python benchmarks/compare_runs.py /tmp/run1/bench.json /tmp/run2/bench.json

For each workload and loader that both runs measured: ArenaLoader / loader for batches/s
(speed) and peak memory (median of the within-round ratios), and how far apart the two runs
are (the larger over the smaller). Exits 1 if any ratio differs by more than ``--within``
(default 1.25: the issue's "within 25%"). It also says how many measurements of each run were
kept although other processes took more than the run's --others-limit cores (a busy moment
moves a ratio; such a run says little). Latest result: docs/benchmarks.md, "Stability".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def pairs(first: dict, second: dict) -> list[tuple[str, str, str, float, float]]:
    """(workload, loader, metric, first run's ratio, second run's) for every shared one."""
    out = []
    for workload, loaders in first["ratios"].items():
        for loader, metrics in loaders.items():
            theirs = second["ratios"].get(workload, {}).get(loader, {})
            for metric in ("steady_batches_per_s", "peak_memory_mb"):
                a, b = metrics.get(metric), theirs.get(metric)
                if a and b:
                    out.append((workload, loader, metric, a["median"], b["median"]))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    parser.add_argument("--within", type=float, default=1.25,
                        help="largest allowed ratio between the runs' figures (default 1.25)")
    args = parser.parse_args()
    first, second = (json.loads(path.read_text()) for path in (args.first, args.second))
    rows = pairs(first, second)
    worst = 1.0
    print(f"{'workload':<8} {'ArenaLoader / loader':<30} {'metric':<10} {'run 1':>8} "
          f"{'run 2':>8} {'apart':>6}")
    for workload, loader, metric, a, b in rows:
        apart = max(a, b) / min(a, b)
        worst = max(worst, apart)
        flag = "  <-- over" if apart > args.within else ""
        word = "speed" if metric == "steady_batches_per_s" else "memory"
        print(f"{workload:<8} {loader:<30} {word:<10} {a:>7.3g}x {b:>7.3g}x {apart:>6.2f}{flag}")
    over = sum(1 for *_, a, b in rows if max(a, b) / min(a, b) > args.within)
    print(f"\n{len(rows)} ratios, {over} apart by more than {args.within:g}x; the widest "
          f"{worst:.2f}x")
    for k, run in enumerate((first, second), 1):
        settings = run["settings"]
        if "disturbed" in settings:
            print(f"run {k}: {settings['elapsed_s']} s, {settings['retries_used']} measurements "
                  f"taken again, {len(settings['disturbed'])} kept with other processes "
                  f"taking > {settings['others_limit_cores']:g} cores")
    return 1 if over else 0


if __name__ == "__main__":
    raise SystemExit(main())
