"""``arena-loader bench`` / ``python -m arena_loader.bench``: every loader on every workload,
same data, batch size, worker count and prefetch depth; table, JSON and PNG chart.

    arena-loader bench --quick                   # the main job: about 2 minutes on 2 cores
    arena-loader bench --out bench-out           # the full suite (about 15-20 minutes)
    arena-loader bench --quick --workloads image,tiny --loaders ArenaLoader,"queue pickling"

A round runs every workload, each on a dataset made anew, and every case of a workload once,
the order rotated from round to round. In a round a case builds its loader (persistent
workers), runs one warm-up epoch timed from construction (start-up included), then batches
for at least --min-seconds and --min-batches, and closes it (mid-epoch if need be). Ratios
are ArenaLoader / other taken within each round, reported as the median over rounds with
min-max: a busy machine slows both sides of a round alike.
A busy moment does not: a measurement during which other processes took more than
--others-limit cores (from /proc/stat, less this run's own CPU) is taken again, at most twice
a case and --retries times a run, and the least disturbed one is kept.
"""

from __future__ import annotations

import argparse
import gc
import os
import shlex
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from . import report
from .harness import Budget, CaseResult, environment, measure_apart
from .loaders import (
    ARENA,
    ARENA_HYBRID,
    ARENA_THREADS,
    COPY,
    COPY_SHARED,
    FLOOR,
    GRAIN,
    LOADERS,
    NODES,
    NODES_THREADS,
    QUEUE,
    SPDL,
    STATEFUL,
    TORCH,
    TORCH_NUMPY,
    TORCH_WIDE,
    LoaderKind,
    Setup,
    torch_missing,
)
from .workloads import Sizes, Workload, standard_workloads

SCALING_LOADERS = (ARENA, TORCH, QUEUE, SPDL)
FULL = {"rounds": 3, "scale": 1.0, "scaling": "1,2,3,4", "min_seconds": 1.5, "min_batches": 50}
QUICK = {"rounds": 3, "scale": 0.25, "scaling": "", "min_seconds": 0.8, "min_batches": 20}
# --quick: the 2-minute budget holds 35 cases of 3 rounds of >= 0.8 s (a case's warm-up
# epoch, start-up and close add ~0.3 s on average; ~115 s on 2 cores). ArenaLoader and torch's
# DataLoader run on every workload; the peers on the fixed-shape image and the JPEG-decode
# workloads; the floor where it says most (image, tiny, jpeg); thread workers on remote.
# The full run has every loader on every workload.
QUICK_LOADERS: dict[str, tuple[str, ...]] = {
    "image": (ARENA, TORCH, SPDL, GRAIN, STATEFUL, NODES, COPY, COPY_SHARED, FLOOR),
    "tiny": (ARENA, TORCH, FLOOR),
    "jpeg": (ARENA, TORCH, SPDL, GRAIN, STATEFUL, NODES, FLOOR, ARENA_HYBRID),
    "remote": (ARENA, TORCH, ARENA_THREADS, NODES_THREADS, ARENA_HYBRID, TORCH_WIDE),
}
QUICK_DEFAULT = (ARENA, TORCH)
CASE_RETRIES = 2  # a disturbed measurement is taken again at most this many times
# /proc/stat counts in 10 ms ticks: over a shorter timed window others' cores cannot be told.
JUDGED_SECONDS = 0.25


def _ints(text: str) -> list[int]:
    if not text.strip():
        return []
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"worker counts must be >= 1, got {text!r}")
    return values


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="arena-loader bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="the main job (about 2 minutes on 2 cores): 1/4 of the samples, 3 "
                   f"rounds of >= {QUICK['min_seconds']:g} s and >= {QUICK['min_batches']} "
                   "batches; ArenaLoader and torch on every workload, SPDL, Grain and "
                   "torchdata on image and jpeg, the floor on image, tiny and jpeg, thread "
                   "workers on remote; no scaling run")
    p.add_argument("--out", type=Path, default=Path("bench-out"),
                   help="folder for bench.json, bench.png and bench.md (default bench-out)")
    p.add_argument("--workers", type=int, default=2,
                   help="num_workers for the comparison (default 2)")
    p.add_argument("--worker-threads", type=int, default=8,
                   help="threads per worker process of the 'ArenaLoader worker_threads' rows "
                   "(jpeg, remote): --workers processes x this many threads (default 8)")
    p.add_argument("--wide-workers", type=int, default=16,
                   help="num_workers of the 'torch default collate wide' row (remote): what "
                   "torch needs to wait as concurrently as processes x threads (default 16)")
    p.add_argument("--scaling", type=_ints, default=None,
                   help="worker counts for the scaling run on the image workload, e.g. 1,2,3,4 "
                   f"(default {FULL['scaling']}, quick none); '' to skip")
    p.add_argument("--rounds", type=int, default=None,
                   help=f"rounds over every case (default {FULL['rounds']}, quick "
                   f"{QUICK['rounds']})")
    p.add_argument("--min-seconds", type=float, default=None,
                   help="each measurement runs for at least this long (default "
                   f"{FULL['min_seconds']:g}, quick {QUICK['min_seconds']:g})")
    p.add_argument("--min-batches", type=int, default=None,
                   help="... and at least this many batches (default "
                   f"{FULL['min_batches']}, quick {QUICK['min_batches']})")
    p.add_argument("--prefetch-factor", type=int, default=2,
                   help="batches in flight per worker, for every loader (default 2)")
    p.add_argument("--scale", type=float, default=None,
                   help="fraction of the full sample counts (default 1, quick 0.25)")
    p.add_argument("--image-shape", default="3,224,224",
                   help="uint8 image shape of the image, dict and memmap workloads")
    p.add_argument("--large-batch-mb", type=float, default=32.0,
                   help="batch size in MB of the large float32 workload (default 32)")
    p.add_argument("--jpeg-side", type=int, default=224,
                   help="side of the jpeg workload's decoded, resized images (default 224)")
    p.add_argument("--workloads", default=None,
                   help="comma-separated subset of: image, large, tiny, dict, memmap, text, "
                   "detect, jpeg, remote")
    p.add_argument("--loaders", default=None,
                   help="comma-separated subset of: " + ", ".join(k.name for k in LOADERS))
    p.add_argument("--tmp-dir", default=None, help="where the memmap workload writes its file")
    p.add_argument("--others-limit", type=float, default=None,
                   help="a measurement during which other processes took more cores than this "
                   "is taken again (default 7.5%% of the machine's cores: 0.15 on 2)")
    p.add_argument("--retries", type=int, default=15,
                   help="most measurements taken again in a run, at most "
                   f"{CASE_RETRIES} a case (default 15; 0: never)")
    return p


def _subset(text: str | None, names: list[str], flag: str) -> list[str]:
    if text is None:
        return names
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in chosen if name not in names]
    if unknown:
        raise SystemExit(f"{flag} must name some of {names}, got unknown {unknown}")
    return chosen


def unavailable(kind: LoaderKind, workload: Workload, quick: bool) -> str | None:
    """Why ``kind`` does not run on ``workload`` (None when it does)."""
    missing = kind.missing()
    if missing:
        return missing
    if workload.collate_fn is not None and not kind.takes_collate_fn:
        return "takes no collate_fn (this workload's batches are made by one)"
    if workload.collate_fn is not None and kind.name == TORCH_NUMPY:
        return "same as torch default collate here (the workload's collate_fn is used)"
    if kind.fixed_shape_only and not workload.fixed_shape:
        return "one fixed-shape array per sample only (the floor leaves the rest out)"
    if quick and not _in_quick(kind, workload):
        return "full run only (not in --quick)"
    return None


def _in_quick(kind: LoaderKind, workload: Workload) -> bool:
    return kind.name in QUICK_LOADERS.get(workload.name, QUICK_DEFAULT)


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    with warnings.catch_warnings():  # the caller's filters are restored on return
        # The scaling run and the remote workload's threads oversubscribe the cores on
        # purpose; torch (and ArenaLoader, for thread workers too) warn about it per epoch.
        warnings.filterwarnings("ignore", message="This DataLoader will create",
                                category=UserWarning)
        # torch.as_tensor on the read-only memmap rows (torch's default collate) warns once
        # per worker; the batches it builds are copies, so the warning does not apply.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable",
                                category=UserWarning)
        # torchdata's StatefulDataLoader calls a deprecated torch function per iterator.
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated",
                                category=UserWarning)
        try:
            return _run(args)
        finally:
            gc.unfreeze()  # harness.measure_apart freezes what is alive before each case


def _run(args: argparse.Namespace) -> int:
    preset = QUICK if args.quick else FULL
    for name in ("rounds", "scale", "min_seconds", "min_batches"):
        if getattr(args, name) is None:
            setattr(args, name, preset[name])
    scaling = _ints(preset["scaling"]) if args.scaling is None else args.scaling
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}")
    if args.workers < 1:
        raise SystemExit(f"--workers must be at least 1, got {args.workers}")
    if args.others_limit is None:
        args.others_limit = 0.075 * (os.cpu_count() or 1)
    args.retries_left = max(0, args.retries)
    budget = Budget(args.min_seconds, args.min_batches)
    sizes = Sizes(scale=args.scale, image_shape=tuple(int(s) for s in args.image_shape.split(",")),
                  large_batch_mb=args.large_batch_mb, jpeg_side=args.jpeg_side)
    workloads = standard_workloads(sizes)
    names = _subset(args.workloads, [w.name for w in workloads], "--workloads")
    workloads = [w for w in workloads if w.name in names]
    loader_names = _subset(args.loaders, [k.name for k in LOADERS], "--loaders")
    kinds = [k for k in LOADERS if k.name in loader_names]
    scaling_kinds = [k for k in kinds if k.name in SCALING_LOADERS]
    scaling = [w for w in scaling if w != args.workers] if any(
        w.name == "image" for w in workloads) else []

    if any(kind.missing is torch_missing and not torch_missing() for kind in kinds):
        # Import torch before the first case, so every case (and every forked worker)
        # starts from the same process image and no case pays torch's import.
        import torch

        torch.set_num_threads(1)
    env = environment()
    plans = []
    for workload in workloads:
        cases = [(kind, args.wide_workers if kind.wide else args.workers) for kind in kinds
                 if (not kind.threads or workload.threads)
                 and (not kind.only or workload.name in kind.only)]
        if workload.name == "image":
            cases += [(kind, w) for w in scaling for kind in scaling_kinds]
        plans.append((workload, cases))
    runnable = sum(1 for w, cases in plans for k, _ in cases
                   if unavailable(k, w, args.quick) is None)
    progress(f"arena-loader bench: {runnable} cases x {args.rounds} rounds, {args.workers} "
             f"workers, prefetch_factor {args.prefetch_factor}, each round: warm-up epoch + "
             f">= {budget.min_seconds:g} s and >= {budget.min_batches} batches; "
             f"{env['cpu_model']}, {env['cores']} cores, load {env['load_average_at_start']}")
    results: list[dict] = []
    scaling_results: list[dict] = []
    started = time.perf_counter()
    # Round by round over every workload, each workload's dataset made anew each round: what
    # lasts for a stretch of the run (a slower moment of the machine, where the data landed
    # in memory) falls in one round of a workload, not in all of them, and the median over
    # rounds leaves it out. (Every workload's rounds back to back, one dataset for all of
    # them, let such a stretch move a whole workload's ratio: large/torch 10x in one run,
    # 7.5x in the next; docs/benchmarks.md, "Stability".)
    planned = [(workload, _case_results(workload, cases, args)) for workload, cases in plans]
    with tempfile.TemporaryDirectory(prefix="arena_bench_", dir=args.tmp_dir) as tmp:
        for r in range(args.rounds):
            for workload, (_, runnable) in planned:
                if not runnable:
                    continue
                dataset = workload.dataset(tmp)
                try:
                    _run_round(workload, dataset, runnable, r, args, budget)
                finally:
                    remove = getattr(dataset, "remove", None)
                    if remove is not None:
                        remove()
                    del dataset
    for (workload, cases), (_, (done, _)) in zip(plans, planned):
        for (_, workers), result in zip(cases, done):
            scaled = workload.name == "image" and workers != args.workers
            (scaling_results if scaled else results).append(result.as_dict())
    # The scaling table also shows the comparison's own worker count.
    scaling_results += [r for r in results if r["workload"] == "image"
                        and r["loader"] in SCALING_LOADERS and scaling]
    scaling_results.sort(key=lambda r: (r["loader"], r["workers"]))

    out = _report(args, env, workloads, kinds, results, scaling_results,
                  time.perf_counter() - started)
    _write(args.out, out)
    return 0


def _case_results(workload: Workload, cases: list[tuple[LoaderKind, int]],
                  args: argparse.Namespace
                  ) -> tuple[list[CaseResult], list[tuple[LoaderKind, CaseResult]]]:
    """A result per case of ``workload`` (those that cannot run say why), and the cases
    that run, each with its result."""
    results, runnable = [], []
    for kind, workers in cases:
        result = CaseResult(workload.name, kind.name, workers if kind.uses_workers else 1)
        reason = unavailable(kind, workload, args.quick)
        if reason:
            result.available, result.reason = False, reason
        else:
            runnable.append((kind, result))
        results.append(result)
    return results, runnable


def _run_round(workload: Workload, dataset: Any,
               runnable: list[tuple[LoaderKind, CaseResult]], r: int,
               args: argparse.Namespace, budget: Budget) -> None:
    """Round ``r`` of one workload: every case once, the order rotated by ``r``."""
    shift = r % len(runnable)
    for kind, result in runnable[shift:] + runnable[:shift]:
        threads = workload.threads if kind.threads else None
        setup = Setup(workload.batch_size, result.workers, args.prefetch_factor,
                      workload.collate_fn, threads,
                      args.worker_threads if kind.hybrid else 1)
        case_start = time.perf_counter()
        figures = _measure_quiet(kind, dataset, setup, budget, args)
        result.rounds.append(figures)
        width = (f"{result.workers}x{setup.worker_threads}" if kind.hybrid
                 else threads or result.workers)
        again = f", taken {figures['retries'] + 1} times" if figures["retries"] else ""
        progress(f"round {r + 1}/{args.rounds} {workload.name:<6} {kind.name:<28} "
                 f"w={width:<4} "
                 f"{figures['steady_batches_per_s']:>9,.1f} batches/s "
                 f"{figures['steady_gbps']:6.2f} GB/s "
                 f"(others {figures['others_cores']:.2f} cores, memory sampler "
                 f"{figures['sampler_cores']:.2f}{again}; "
                 f"{time.perf_counter() - case_start:.1f} s)")


def _measure_quiet(kind: LoaderKind, dataset: Any, setup: Setup, budget: Budget,
                   args: argparse.Namespace) -> dict[str, Any]:
    """One measurement of one case, taken again while other processes took more than
    ``args.others_limit`` cores during it (at most CASE_RETRIES times, and while the run's
    ``args.retries_left`` lasts); the least disturbed one, with ``retries`` set."""
    tries = []
    while True:
        # Each measurement in a process of its own (harness.measure_apart), which freezes
        # what is alive here (main() unfreezes it) before it forks.
        figures = measure_apart(lambda: kind.build(dataset, setup), budget)
        strays = figures.pop("strays")
        tries.append(figures)
        if strays:
            progress(f"warning: {kind.name} left processes {strays} alive after close(); "
                     "killed them")
        if (figures["others_cores"] <= args.others_limit or figures["seconds"] < JUDGED_SECONDS
                or len(tries) > CASE_RETRIES or args.retries_left <= 0):
            break
        args.retries_left -= 1
    best = min(tries, key=lambda f: f["others_cores"])
    return {**best, "retries": len(tries) - 1}


def disturbed(results: list[dict], limit: float) -> list[str]:
    """'workload loader round k: N cores' for each measurement kept although other processes
    took more than ``limit`` cores during it (its retries ran out)."""
    return [f"{row['workload']} {row['loader']} w={row['workers']} round {k + 1}: "
            f"{cores:.2f} cores"
            for row in results if row["available"]
            for k, cores in enumerate(row["others_cores"]["rounds"]) if cores > limit]


def _report(args: argparse.Namespace, env: dict, workloads: list[Workload],
            kinds: list[LoaderKind], results: list[dict], scaling: list[dict],
            elapsed_s: float) -> dict[str, Any]:
    return {
        "environment": env,
        "settings": {"command": "arena-loader bench " + shlex.join(args.argv),
                     "quick": args.quick, "workers": args.workers,
                     "prefetch_factor": args.prefetch_factor, "rounds": args.rounds,
                     "min_seconds": args.min_seconds, "min_batches": args.min_batches,
                     "scale": args.scale, "image_shape": args.image_shape,
                     "large_batch_mb": args.large_batch_mb, "jpeg_side": args.jpeg_side,
                     "worker_threads": args.worker_threads,
                     "wide_workers": args.wide_workers, "shuffle": False,
                     "persistent_workers": True,
                     "others_limit_cores": args.others_limit, "retries": args.retries,
                     "retries_used": args.retries - args.retries_left,
                     # (the scaling rows repeat the comparison's image rows: each once)
                     "disturbed": disturbed(list({id(r): r for r in results + scaling}.values()),
                                            args.others_limit),
                     "elapsed_s": round(elapsed_s, 1)},
        "workloads": {w.name: f"{w.samples} samples, {w.description}" for w in workloads},
        "loaders": [k.name for k in kinds],
        "results": results,
        "scaling": scaling,
        "ratios": report.ratios(results),
        "targets": report.targets(results, scaling),
    }


def _write(folder: Path, out: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    text, markdown = [], []
    env, settings = out["environment"], out["settings"]
    head = (f"{env['cpu_model']}, {env['cores']} cores, {env['memory_gib']} GiB, /dev/shm "
            f"{env['dev_shm_gib']} GiB (huge pages: {env.get('dev_shm_huge', 'unknown')}), "
            f"Python {env['python']}, load at start "
            f"{env['load_average_at_start']}; {settings['workers']} workers, "
            f"prefetch_factor {settings['prefetch_factor']}, {settings['rounds']} rounds of a "
            f"warm-up epoch + >= {settings['min_seconds']:g} s and >= "
            f"{settings['min_batches']} batches; {settings['retries_used']} measurements taken "
            f"again (other processes took > {settings['others_limit_cores']:g} cores); "
            f"command: {settings['command']}")
    text.append(head)
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items())
    text.append(versions)
    legend = ("speed Arena / this: ArenaLoader's batches/s over this loader's, median [min-max] "
              "of the within-round ratios; mem Arena / this: the same for peak memory")
    text.append(legend)
    for workload, description in out["workloads"].items():
        rows = report.table_rows(out["results"], workload, out["ratios"].get(workload, {}))
        text += ["", f"{workload}: {description}", report.text_table(rows)]
        markdown += ["", f"**{workload}**: {description}", "", report.markdown_table(rows)]
    if out["scaling"]:
        rows = list(out["scaling"])
        text += ["", "image: scaling over num_workers",
                 report.text_table(report.table_rows(rows, "image", {}))]
        markdown += ["", "**image, scaling over num_workers**", "",
                     report.markdown_table(report.table_rows(rows, "image", {}))]
    text += ["", "Targets (ArenaLoader / other, within-round ratios, median [min-max]; "
             "reported, not asserted):", *report.target_lines(out["targets"])]
    markdown += ["", "**Targets** (ArenaLoader / other, within-round ratios; reported, not "
                 "asserted)", "", "| target | measured, median [min-max] | verdict |",
                 "|---|---:|---|",
                 *(f"| {t['target']} | {report.times(t['ratio'])} | {report.verdict(t)} |"
                   for t in out["targets"])]
    if settings["disturbed"]:
        text += ["", f"warning: {len(settings['disturbed'])} measurements kept although other "
                 "processes took more than the limit (retries ran out); their ratios may "
                 "wander: " + "; ".join(settings["disturbed"])]
    print("\n".join(text))
    report.write_json(folder / "bench.json", out)
    (folder / "bench.md").write_text(head + "\n\n" + versions + "\n\n" + legend + "\n"
                                     + "\n".join(markdown) + "\n")
    report.write_chart(folder / "bench.png", out)
    print(f"\nwrote {folder / 'bench.json'}, {folder / 'bench.md'}, {folder / 'bench.png'} "
          f"({settings['elapsed_s']} s)")
