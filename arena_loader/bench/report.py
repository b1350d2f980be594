"""Ratios, targets and the three outputs of a run: terminal table, JSON, PNG chart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .loaders import ARENA, COPY, QUEUE, SPDL, TORCH

# (workload, baseline, metric, minimum ArenaLoader / baseline ratio, the wording)
TARGETS = [
    ("image", TORCH, "steady_gbps", 10.0, "image-like steady state >= 10x torch default collate"),
    ("image", QUEUE, "steady_gbps", 30.0, "image-like steady state >= 30x queue pickling"),
    ("image", SPDL, "steady_gbps", 1.5, "image-like steady state >= 1.5x SPDL arena"),
    ("image", COPY, "steady_gbps", 0.7, "image-like steady state >= 0.7x the copy limit"),
    ("tiny", TORCH, "steady_batches_per_s", 3.0, "tiny rows batches/s >= 3x torch"),
    ("image", TORCH, "first_epoch_speed", 1.0, "first epoch incl. start-up faster than torch"),
    ("image", TORCH, "memory_headroom", 1.0, "peak memory (private RSS + shm) <= torch's"),
    ("text", TORCH, "steady_batches_per_s", 3.0, "text pad-to-longest batches/s >= 3x torch"),
    ("detect", TORCH, "steady_batches_per_s", 3.0, "detection tuple(zip) batches/s >= 3x torch"),
    ("text", TORCH, "memory_headroom", 1 / 1.2, "text peak memory <= 1.2x torch's"),
    ("detect", TORCH, "memory_headroom", 1 / 1.2, "detection peak memory <= 1.2x torch's"),
]


def _find(results: list[dict], workload: str, loader: str) -> dict | None:
    for row in results:
        if (row["workload"], row["loader"]) == (workload, loader) and row["available"]:
            return row
    return None


def ratio(arena: dict, other: dict, metric: str) -> float:
    """ArenaLoader relative to ``other``: above 1 is better for ArenaLoader."""
    if metric == "first_epoch_speed":
        return other["first_epoch_s"] / arena["first_epoch_s"]
    if metric == "memory_headroom":
        return other["peak_memory_mb"] / arena["peak_memory_mb"]
    return arena[metric]["median"] / other[metric]["median"]


def ratios(results: list[dict]) -> dict[str, dict[str, float]]:
    """Per workload: ArenaLoader's steady-state batches/s over each other loader's (the
    results hold one case per workload and loader, all at the same worker count)."""
    out: dict[str, dict[str, float]] = {}
    for row in results:
        arena = _find(results, row["workload"], ARENA)
        if row["loader"] != ARENA and row["available"] and arena is not None:
            out.setdefault(row["workload"], {})[row["loader"]] = ratio(
                arena, row, "steady_batches_per_s")
    return out


def targets(results: list[dict]) -> list[dict[str, Any]]:
    """The issue's targets, each with the ratio measured in this run (None if a loader did
    not run) and whether it was met. Reported, never asserted."""
    rows = []
    for workload, baseline, metric, minimum, text in TARGETS:
        arena, other = _find(results, workload, ARENA), _find(results, workload, baseline)
        value = ratio(arena, other, metric) if arena and other else None
        # CPU seconds per GB, baseline over ArenaLoader: the work each design does per byte,
        # which other programs competing for the cores disturb far less than wall time.
        cpu = (other["cpu_s_per_gb"] / arena["cpu_s_per_gb"]
               if arena and other and metric.startswith("steady") and arena["cpu_s_per_gb"]
               else None)
        rows.append({"target": text, "workload": workload, "baseline": baseline,
                     "minimum": minimum, "ratio": value, "cpu_ratio": cpu,
                     "met": None if value is None else value >= minimum})
    return rows


def fmt(value: float | None, digits: int = 2) -> str:
    if value is None or value != value:
        return "-"
    return f"{value:,.{digits}f}"


COLUMNS = ("loader", "w", "GB/s median [min-max]", "batches/s", "epoch 1 s", "1st batch s",
           "CPU s/GB", "RSS main MB", "RSS workers MB", "shm MB", "peak mem MB", "Arena x")


def table_rows(results: list[dict], workload: str,
               arena_ratios: dict[str, float]) -> list[tuple[str, ...]]:
    rows = []
    for row in results:
        if row["workload"] != workload:
            continue
        if not row["available"]:
            rows.append((row["loader"], str(row["workers"]), row["reason"]) + ("",) * 9)
            continue
        gbps = row["steady_gbps"]
        rows.append((
            row["loader"], str(row["workers"]),
            f"{gbps['median']:.2f} [{gbps['min']:.2f}-{gbps['max']:.2f}]",
            fmt(row["steady_batches_per_s"]["median"], 0), fmt(row["first_epoch_s"]),
            fmt(row["first_batch_s"], 3), fmt(row["cpu_s_per_gb"]),
            fmt(row["peak_rss_main_mb"], 0), fmt(row["peak_rss_workers_mb"], 0),
            fmt(row["peak_shm_mb"], 0), fmt(row["peak_memory_mb"], 0),
            fmt(arena_ratios.get(row["loader"]), 2) if row["loader"] != ARENA else "1",
        ))
    return rows


def text_table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(str(r[i])) for r in [COLUMNS, *rows]) for i in range(len(COLUMNS))]
    line = lambda r: "  ".join(  # noqa: E731
        str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(COLUMNS), "-" * (sum(widths) + 2 * (len(widths) - 1)),
                      *map(line, rows)])


def markdown_table(rows: list[tuple[str, ...]]) -> str:
    head = "| " + " | ".join(COLUMNS) + " |"
    rule = "|" + "|".join(["---"] + ["---:"] * (len(COLUMNS) - 1)) + "|"
    return "\n".join([head, rule, *("| " + " | ".join(r) + " |" for r in rows)])


def times(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}x"


def verdict(row: dict) -> str:
    return "n/a" if row["met"] is None else ("met" if row["met"] else "MISSED")


def target_lines(rows: list[dict]) -> list[str]:
    out = [f"  {'target':<58} {'ratio':>8}  {'verdict':<7} {'CPU/GB ratio':>12}"]
    for row in rows:
        out.append(f"  {row['target']:<58} {times(row['ratio']):>8}  {verdict(row):<7} "
                   f"{times(row['cpu_ratio']):>12}")
    return out


def write_json(path: Path, report: dict[str, Any]) -> None:
    path.write_text(json.dumps(_finite(report), indent=2, allow_nan=False) + "\n")


def _finite(value: Any) -> Any:
    """NaN (a figure that could not be measured, e.g. no batch) becomes JSON null."""
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    if isinstance(value, float) and value != value:
        return None
    return value


def write_chart(path: Path, report: dict[str, Any]) -> None:
    """Steady-state throughput per loader for each workload (log scale), and worker
    scaling on the image workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    plain = FuncFormatter(lambda value, _: f"{value:g}")

    results = report["results"]
    workloads = list(dict.fromkeys(r["workload"] for r in results))
    panels = len(workloads) + (1 if report["scaling"] else 0)
    cols = 3
    rows = -(-panels // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    for ax, workload in zip(axes.flat, workloads):
        cases = [r for r in results if r["workload"] == workload and r["available"]]
        metric = "steady_batches_per_s" if workload == "tiny" else "steady_gbps"
        values = [r[metric]["median"] for r in cases]
        errors = [[v - r[metric]["min"] for v, r in zip(values, cases)],
                  [r[metric]["max"] - v for v, r in zip(values, cases)]]
        colors = ["tab:green" if r["loader"].startswith("ArenaLoader") else
                  "tab:gray" if r["loader"] == COPY else "tab:blue" for r in cases]
        ax.barh([r["loader"] for r in cases], values, xerr=errors, color=colors)
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(plain)
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.invert_yaxis()
        ax.set_title(f"{workload}: {report['workloads'][workload]}", fontsize=8)
        ax.set_xlabel("batches/s (median, min-max)" if metric == "steady_batches_per_s"
                      else "GB/s (median, min-max)", fontsize=8)
        ax.tick_params(labelsize=7)
    used = len(workloads)
    if report["scaling"]:
        ax = axes.flat[used]
        used += 1
        by_loader: dict[str, list[dict]] = {}
        for row in report["scaling"]:
            if row["available"]:
                by_loader.setdefault(row["loader"], []).append(row)
        for loader, rows_ in by_loader.items():
            rows_.sort(key=lambda r: r["workers"])
            ax.plot([r["workers"] for r in rows_],
                    [r["steady_gbps"]["median"] for r in rows_], marker="o", label=loader)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(sorted({r["workers"] for r in report["scaling"]}))
        ax.set_xlabel("num_workers", fontsize=8)
        ax.set_ylabel("GB/s (median)", fontsize=8)
        ax.set_title(f"image: scaling over workers ({report['environment']['cores']} cores)",
                     fontsize=8)
        ax.legend(fontsize=7)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[used:]:
        ax.axis("off")
    env = report["environment"]
    fig.suptitle(f"arena_loader bench, {env['date_utc']}, {env['cpu_model']}, "
                 f"{env['cores']} cores", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
