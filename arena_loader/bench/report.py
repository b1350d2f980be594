"""Ratios, targets and the three outputs of a run: terminal table, JSON, PNG chart.

Every ratio reads one way: ArenaLoader's figure over the other loader's, taken within each
round (both measured minutes apart at most, under the same load) and reported as the median
over rounds with its min-max. Speed: ArenaLoader batches/s / other's (above 1: ArenaLoader
is faster). Memory and time: ArenaLoader / torch's (below 1: ArenaLoader uses less). Limits
are written the same way: ``>= 10x`` for speed, ``<= 1.2x`` for memory.
"""

from __future__ import annotations

import json
import statistics
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .loaders import ARENA, ARENA_HYBRID, COPY, COPY_SHARED, FLOOR, QUEUE, SPDL, TORCH, TORCH_WIDE

# (workload, other loader, metric, ">=" or "<=", limit on ArenaLoader / other)
TARGETS = [
    ("image", TORCH, "steady_batches_per_s", ">=", 10.0),
    ("image", QUEUE, "steady_batches_per_s", ">=", 30.0),
    ("image", SPDL, "steady_batches_per_s", ">=", 1.5),
    ("image", COPY, "steady_batches_per_s", ">=", 0.7),
    ("tiny", TORCH, "steady_batches_per_s", ">=", 3.0),
    ("text", TORCH, "steady_batches_per_s", ">=", 3.0),
    ("detect", TORCH, "steady_batches_per_s", ">=", 3.0),
    ("image", TORCH, "first_epoch_s", "<=", 1.0),
    ("image", TORCH, "peak_memory_mb", "<=", 1.0),
    ("text", TORCH, "peak_memory_mb", "<=", 1.2),
    ("detect", TORCH, "peak_memory_mb", "<=", 1.2),
]
# Threads inside workers (issue 24): (workload, our row, other row, metric, op, limit). With
# the defaults: 2 processes x 8 threads against torch with 2 and with 16 workers, and against
# ArenaLoader's processes alone on JPEG decode.
HYBRID_TARGETS = [
    ("remote", ARENA_HYBRID, TORCH, "steady_batches_per_s", ">=", 6.0),
    ("remote", ARENA_HYBRID, TORCH_WIDE, "steady_batches_per_s", ">=", 1.0),
    ("remote", ARENA_HYBRID, TORCH_WIDE, "peak_added_mb", "<=", 0.3),
    ("remote", ARENA_HYBRID, TORCH_WIDE, "peak_memory_mb", "<=", 0.3),
    ("jpeg", ARENA_HYBRID, ARENA, "steady_batches_per_s", ">=", 1.0),
]
# Engine v3 (issue 21): one worker on images against one thread that only copies, read from
# the scaling run's 1-worker row; and against the same copy into shared memory, which every
# loader handing batches to another process writes into (CopyLimit's docstring).
ONE_WORKER = "ArenaLoader 1 worker"
ONE_WORKER_TARGETS = [
    ("image", ONE_WORKER, COPY, "steady_batches_per_s", ">=", 0.9),
    ("image", ONE_WORKER, COPY_SHARED, "steady_batches_per_s", ">=", 0.9),
]
METRIC_WORDS = {"steady_batches_per_s": "batches/s", "first_epoch_s": "first epoch time",
                "peak_memory_mb": "peak memory",
                "peak_added_mb": "memory added (peak memory - main process before the loader)"}


def target_text(workload: str, other: str, metric: str, op: str, limit: float,
                ours: str = ARENA) -> str:
    return f"{workload} {METRIC_WORDS[metric]}: {ours} / {other} {op} {limit:g}x"


def _find(results: list[dict], workload: str, loader: str) -> dict | None:
    for row in results:
        if (row["workload"], row["loader"]) == (workload, loader) and row["available"]:
            return row
    return None


def ratio(arena: dict, other: dict, metric: str) -> dict[str, Any] | None:
    """ArenaLoader's ``metric`` over ``other``'s, round by round: median, min, max."""
    ours, theirs = arena[metric]["rounds"], other[metric]["rounds"]
    values = [a / b for a, b in zip(ours, theirs) if b and b == b and a == a]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "rounds": values}


def ratios(results: list[dict]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per workload and other loader: ArenaLoader / other for batches/s (speed), CPU s/GB,
    peak memory and first-epoch time, each the median of the within-round ratios."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for row in results:
        arena = _find(results, row["workload"], ARENA)
        if row["loader"] == ARENA or not row["available"] or arena is None:
            continue
        out.setdefault(row["workload"], {})[row["loader"]] = {
            metric: ratio(arena, row, metric)
            for metric in ("steady_batches_per_s", "cpu_s_per_gb", "peak_memory_mb",
                           "first_epoch_s")}
    return out


def targets(results: list[dict], scaling: Sequence[dict] = ()) -> list[dict[str, Any]]:
    """The targets, each with this run's ratio (None if a loader did not run) and whether it
    was met. Reported, never asserted. ``scaling``: the scaling run's rows; its 1-worker
    ArenaLoader row (or the comparison's, in a run with one worker) is ``ONE_WORKER``."""
    rows = []
    one = [dict(row, loader=ONE_WORKER) for row in [*scaling, *results]
           if (row["loader"], row["workers"]) == (ARENA, 1)][:1]
    every = [(w, ARENA, *rest) for w, *rest in TARGETS] + HYBRID_TARGETS + ONE_WORKER_TARGETS
    for workload, ours, other, metric, op, limit in every:
        arena = _find(one if ours == ONE_WORKER else results, workload, ours)
        theirs = _find(results, workload, other)
        value = ratio(arena, theirs, metric) if arena and theirs else None
        met = None
        if value is not None:
            met = value["median"] >= limit if op == ">=" else value["median"] <= limit
        rows.append({"target": target_text(workload, other, metric, op, limit, ours),
                     "workload": workload, "ours": ours, "other": other, "metric": metric, "op": op,
                     "limit": limit, "ratio": value, "met": met})
    return rows


def fmt(value: float | None, digits: int = 2) -> str:
    if value is None or value != value:
        return "-"
    return f"{value:,.{digits}f}"


def times(value: dict | float | None) -> str:
    """``1.23x [1.10-1.31]`` for a ratio with its spread over rounds."""
    if value is None:
        return "-"
    if isinstance(value, dict):
        return f"{value['median']:.3g}x [{value['min']:.3g}-{value['max']:.3g}]"
    return f"{value:.3g}x"


COLUMNS = ("loader", "w", "batches/s median [min-max]", "GB/s", "epoch 1 s", "1st batch s",
           "CPU s/GB", "peak mem MB", "shm MB", "speed Arena / this", "mem Arena / this")


def table_rows(results: list[dict], workload: str,
               arena_ratios: dict[str, dict[str, Any]]) -> list[tuple[str, ...]]:
    rows = []
    for row in results:
        if row["workload"] != workload:
            continue
        if not row["available"]:
            rows.append((row["loader"], str(row["workers"]), row["reason"])
                        + ("",) * (len(COLUMNS) - 3))
            continue
        rate = row["steady_batches_per_s"]
        mine = arena_ratios.get(row["loader"], {})
        rows.append((
            row["loader"], str(row["workers"]),
            f"{fmt(rate['median'], 0)} [{fmt(rate['min'], 0)}-{fmt(rate['max'], 0)}]",
            fmt(row["steady_gbps"]["median"]), fmt(row["first_epoch_s"]["median"]),
            fmt(row["first_batch_s"]["median"], 3), fmt(row["cpu_s_per_gb"]["median"]),
            fmt(row["peak_memory_mb"]["median"], 0), fmt(row["peak_shm_mb"]["median"], 0),
            "1" if row["loader"] == ARENA else times(mine.get("steady_batches_per_s")),
            "1" if row["loader"] == ARENA else times(mine.get("peak_memory_mb")),
        ))
    return rows


def text_table(rows: list[tuple[str, ...]]) -> str:
    measured = [COLUMNS, *(r for r in rows if any(r[3:]))]
    widths = [max(len(str(r[i])) for r in (measured if i > 1 else [COLUMNS, *rows]))
              for i in range(len(COLUMNS))]

    def line(r: tuple[str, ...]) -> str:
        if len(r) > 2 and not any(r[3:]):  # an unavailable loader: its reason, unpadded
            return f"{r[0].ljust(widths[0])}  {r[1].rjust(widths[1])}  {r[2]}"
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(COLUMNS), "-" * (sum(widths) + 2 * (len(widths) - 1)),
                      *map(line, rows)])


def markdown_table(rows: list[tuple[str, ...]]) -> str:
    head = "| " + " | ".join(COLUMNS) + " |"
    rule = "|" + "|".join(["---"] + ["---:"] * (len(COLUMNS) - 1)) + "|"
    return "\n".join([head, rule, *("| " + " | ".join(r) + " |" for r in rows)])


def verdict(row: dict) -> str:
    return "n/a" if row["met"] is None else ("met" if row["met"] else "MISSED")


def target_lines(rows: list[dict]) -> list[str]:
    width = max(len(row["target"]) for row in rows)
    out = [f"  {'target':<{width}}  {'measured [min-max over rounds]':>30}  verdict"]
    for row in rows:
        out.append(f"  {row['target']:<{width}}  {times(row['ratio']):>30}  {verdict(row)}")
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


def torch_ratios(results: list[dict], workload: str) -> list[tuple[str, float, float, float]]:
    """(loader, median, min, max) of each loader's batches/s over torch's, within rounds."""
    torch_row = _find(results, workload, TORCH)
    if torch_row is None:
        return []
    out = []
    for row in results:
        if row["workload"] == workload and row["available"]:
            value = ratio(row, torch_row, "steady_batches_per_s")
            if value is not None:
                out.append((row["loader"], value["median"], value["min"], value["max"]))
    return out


def write_chart(path: Path, report: dict[str, Any]) -> None:
    """One panel per workload: each loader's batches/s as a ratio to torch's DataLoader
    (log scale, median and min-max over rounds), the copy limit and the floor marked by
    vertical lines; and worker scaling on the image workload when it was run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    plain = FuncFormatter(lambda value, _: f"{value:g}")
    results = report["results"]
    workloads = [w for w in dict.fromkeys(r["workload"] for r in results)
                 if torch_ratios(results, w)]
    panels = len(workloads) + (1 if report["scaling"] else 0)
    cols = 3
    rows = max(1, -(-panels // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(5.6 * cols, 3.9 * rows), squeeze=False)
    for ax, workload in zip(axes.flat, workloads):
        lines = (COPY, COPY_SHARED, FLOOR)
        cases = [c for c in torch_ratios(results, workload) if c[0] not in lines]
        marks = {c[0]: c[1] for c in torch_ratios(results, workload) if c[0] in lines}
        names = [c[0] for c in cases]
        values = [c[1] for c in cases]
        errors = [[c[1] - c[2] for c in cases], [c[3] - c[1] for c in cases]]
        colors = ["tab:green" if name.startswith("ArenaLoader") else
                  "tab:orange" if name.startswith("torch") else "tab:blue" for name in names]
        # Points, not bars: a bar on a log axis starts nowhere in particular.
        for y, (value, low, high, color) in enumerate(zip(values, *errors, colors)):
            ax.errorbar([value], [y], xerr=[[low], [high]], fmt="o", color=color, capsize=3)
        ax.set_yticks(range(len(names)), names)
        ax.set_ylim(len(names) - 0.5, -0.5)
        for name, style in ((COPY, "--"), (COPY_SHARED, "-."), (FLOOR, ":")):
            if name in marks:
                ax.axvline(marks[name], color="black", linestyle=style, linewidth=1,
                           label=f"{name} {marks[name]:.3g}x")
        ax.axvline(1.0, color="tab:orange", linewidth=0.8)
        if marks:
            ax.legend(fontsize=6, loc="best")
        ax.set_xscale("log")
        shown = [c[2] for c in cases] + [c[3] for c in cases] + [*marks.values(), 1.0]
        ax.set_xlim(min(shown) / 1.5, max(shown) * 1.5)
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(plain)
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(textwrap.fill(f"{workload}: {report['workloads'][workload]}", 70),
                     fontsize=7)
        ax.set_xlabel("batches/s / torch default collate's (median, min-max over rounds)",
                      fontsize=7)
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
                 f"{env['cores']} cores; {report['settings']['command']}\nbatches/s as a "
                 "ratio to torch's DataLoader (orange line); dashed: copy limit, dash-dot: into "
                 "shared memory, dotted: floor",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
