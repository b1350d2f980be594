"""``arena-loader bench`` / ``python -m arena_loader.bench``: every loader on every workload,
same data, batch size, worker count and prefetch depth; table, JSON and PNG chart.

    arena-loader bench --quick                   # the main job: under 2 minutes on 2 cores
    arena-loader bench --out bench-out           # the full suite (several minutes)
    arena-loader bench --quick --workloads image,tiny --loaders ArenaLoader,"queue pickling"

Each case builds its loader (persistent workers), runs one warm-up epoch timed from
construction (start-up included) and ``--repeats`` steady-state epochs; figures are medians
with min/max over those epochs. Ratios compare loaders measured in the same run only.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from . import report
from .harness import CaseResult, environment, measure
from .loaders import (
    ARENA,
    LOADERS,
    QUEUE,
    SPDL,
    TORCH,
    TORCH_NUMPY,
    LoaderKind,
    Setup,
    torch_missing,
)
from .workloads import Sizes, Workload, standard_workloads

SCALING_LOADERS = (ARENA, TORCH, QUEUE, SPDL)
FULL = {"repeats": 5, "scale": 1.0, "scaling": "1,2,3,4"}
QUICK = {"repeats": 3, "scale": 0.25, "scaling": "1,2"}


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
                   help="the main job: 1/4 of the samples, 3 steady epochs, scaling over 1,2 "
                   "workers (under 2 minutes on 2 cores)")
    p.add_argument("--out", type=Path, default=Path("bench-out"),
                   help="folder for bench.json, bench.png and bench.md (default bench-out)")
    p.add_argument("--workers", type=int, default=2,
                   help="num_workers for the comparison (default 2)")
    p.add_argument("--scaling", type=_ints, default=None,
                   help="worker counts for the scaling run on the image workload, e.g. 1,2,3,4 "
                   f"(default {FULL['scaling']}, quick {QUICK['scaling']}); '' to skip")
    p.add_argument("--repeats", type=int, default=None,
                   help="steady-state epochs after the warm-up epoch (default 5, quick 3)")
    p.add_argument("--prefetch-factor", type=int, default=2,
                   help="batches in flight per worker, for every loader (default 2)")
    p.add_argument("--scale", type=float, default=None,
                   help="fraction of the full sample counts (default 1, quick 0.25)")
    p.add_argument("--image-shape", default="3,224,224",
                   help="uint8 image shape of the image, dict and memmap workloads")
    p.add_argument("--large-batch-mb", type=float, default=32.0,
                   help="batch size in MB of the large float32 workload (default 32)")
    p.add_argument("--workloads", default=None,
                   help="comma-separated subset of: image, large, tiny, dict, memmap")
    p.add_argument("--loaders", default=None,
                   help="comma-separated subset of: " + ", ".join(k.name for k in LOADERS))
    p.add_argument("--tmp-dir", default=None, help="where the memmap workload writes its file")
    return p


def _subset(text: str | None, names: list[str], flag: str) -> list[str]:
    if text is None:
        return names
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in chosen if name not in names]
    if unknown:
        raise SystemExit(f"{flag} must name some of {names}, got unknown {unknown}")
    return chosen


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_case(kind: LoaderKind, workload: Workload, dataset: Any, workers: int,
             args: argparse.Namespace) -> CaseResult:
    workers = workers if kind.uses_workers else 1
    result = CaseResult(workload.name, kind.name, workers)
    missing = kind.missing()
    if workload.collate_fn is not None and not kind.takes_collate_fn:
        missing = "takes no collate_fn (this workload's batches are made by one)"
    elif workload.collate_fn is not None and kind.name == TORCH_NUMPY:
        missing = "same as torch default collate here (the workload's collate_fn is used)"
    if missing:
        result.available, result.reason = False, missing
        return result
    setup = Setup(workload.batch_size, workers, args.prefetch_factor, workload.collate_fn)
    result.metrics = measure(lambda: kind.build(dataset, setup), args.repeats)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    with warnings.catch_warnings():  # the caller's filters are restored on return
        # The scaling run oversubscribes the cores on purpose; torch warns about it per epoch.
        warnings.filterwarnings("ignore", message="This DataLoader will create",
                                category=UserWarning)
        # torch.as_tensor on the read-only memmap rows (torch's default collate) warns once
        # per worker; the batches it builds are copies, so the warning does not apply.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable",
                                category=UserWarning)
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    preset = QUICK if args.quick else FULL
    args.repeats = preset["repeats"] if args.repeats is None else args.repeats
    args.scale = preset["scale"] if args.scale is None else args.scale
    scaling = _ints(preset["scaling"]) if args.scaling is None else args.scaling
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {args.repeats}")
    if args.workers < 1:
        raise SystemExit(f"--workers must be at least 1, got {args.workers}")
    sizes = Sizes(scale=args.scale, image_shape=tuple(int(s) for s in args.image_shape.split(",")),
                  large_batch_mb=args.large_batch_mb)
    workloads = standard_workloads(sizes)
    names = _subset(args.workloads, [w.name for w in workloads], "--workloads")
    workloads = [w for w in workloads if w.name in names]
    loader_names = _subset(args.loaders, [k.name for k in LOADERS], "--loaders")
    kinds = [k for k in LOADERS if k.name in loader_names]
    scaling_kinds = [k for k in kinds if k.name in SCALING_LOADERS]
    scaling = [w for w in scaling if w != args.workers] if any(
        w.name == "image" for w in workloads) else []
    total = len(workloads) * len(kinds) + len(scaling) * len(scaling_kinds)

    if any(kind.missing is torch_missing and not torch_missing() for kind in kinds):
        # Import torch before the first case, so every case (and every forked worker)
        # starts from the same process image and no case pays torch's import.
        import torch

        torch.set_num_threads(1)
    env = environment()
    progress(f"arena-loader bench: {total} cases, {args.workers} workers, prefetch_factor "
             f"{args.prefetch_factor}, 1 warm-up + {args.repeats} epochs each; "
             f"{env['cpu_model']}, {env['cores']} cores, load {env['load_average_at_start']}")
    results: list[dict] = []
    scaling_results: list[dict] = []
    done = 0
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="arena_bench_", dir=args.tmp_dir) as tmp:
        for workload in workloads:
            dataset = workload.dataset(tmp)
            runs = [(kind, args.workers, results) for kind in kinds]
            if workload.name == "image":
                runs += [(kind, w, scaling_results) for w in scaling for kind in scaling_kinds]
            try:
                for kind, workers, into in runs:
                    done += 1
                    case_start = time.perf_counter()
                    result = run_case(kind, workload, dataset, workers, args)
                    into.append(result.as_dict())
                    progress(f"[{done:>2}/{total}] {workload.name:<6} {kind.name:<22} "
                             f"w={result.workers}  " + _summary(result)
                             + f"  ({time.perf_counter() - case_start:.1f} s)")
            finally:
                remove = getattr(dataset, "remove", None)
                if remove is not None:
                    remove()
    # The scaling table also shows the comparison's own worker count.
    scaling_results += [r for r in results if r["workload"] == "image"
                        and r["loader"] in SCALING_LOADERS and scaling]
    scaling_results.sort(key=lambda r: (r["loader"], r["workers"]))

    out = _report(args, env, workloads, kinds, results, scaling_results,
                  time.perf_counter() - started)
    _write(args.out, out)
    return 0


def _summary(result: CaseResult) -> str:
    if not result.available:
        return result.reason
    m = result.metrics
    return (f"{m['steady_gbps']['median']:.2f} GB/s, "
            f"{m['steady_batches_per_s']['median']:,.0f} batches/s")


def _report(args: argparse.Namespace, env: dict, workloads: list[Workload],
            kinds: list[LoaderKind], results: list[dict], scaling: list[dict],
            elapsed_s: float) -> dict[str, Any]:
    return {
        "environment": env,
        "settings": {"quick": args.quick, "workers": args.workers,
                     "prefetch_factor": args.prefetch_factor, "repeats": args.repeats,
                     "scale": args.scale, "image_shape": args.image_shape,
                     "large_batch_mb": args.large_batch_mb, "shuffle": False,
                     "persistent_workers": True, "elapsed_s": round(elapsed_s, 1)},
        "workloads": {w.name: f"{w.samples} samples, {w.description}" for w in workloads},
        "loaders": [k.name for k in kinds],
        "results": results,
        "scaling": scaling,
        "ratios": report.ratios(results),
        "targets": report.targets(results),
    }


def _write(folder: Path, out: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    text, markdown = [], []
    env = out["environment"]
    head = (f"{env['cpu_model']}, {env['cores']} cores, {env['memory_gib']} GiB, /dev/shm "
            f"{env['dev_shm_gib']} GiB, Python {env['python']}, load at start "
            f"{env['load_average_at_start']}; {out['settings']['workers']} workers, "
            f"prefetch_factor {out['settings']['prefetch_factor']}, "
            f"{out['settings']['repeats']} steady epochs")
    text.append(head)
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items())
    text.append(versions)
    for workload, description in out["workloads"].items():
        rows = report.table_rows(out["results"], workload, out["ratios"].get(workload, {}))
        text += ["", f"{workload}: {description}", report.text_table(rows)]
        markdown += ["", f"**{workload}**: {description}", "", report.markdown_table(rows)]
    if out["scaling"]:
        rows = [r for r in out["scaling"]]
        text += ["", "image: scaling over num_workers",
                 report.text_table(report.table_rows(rows, "image", {}))]
        markdown += ["", "**image, scaling over num_workers**", "",
                     report.markdown_table(report.table_rows(rows, "image", {}))]
    text += ["", "Targets (ArenaLoader / baseline, same run; reported, not asserted; CPU/GB "
             "ratio: baseline's CPU seconds per GB over ArenaLoader's):",
             *report.target_lines(out["targets"])]
    markdown += ["", "| target | ArenaLoader / baseline | verdict | CPU/GB, baseline / Arena |",
                 "|---|---:|---|---:|",
                 *(f"| {t['target']} | {report.times(t['ratio'])} | {report.verdict(t)} | "
                   f"{report.times(t['cpu_ratio'])} |" for t in out["targets"])]
    print("\n".join(text))
    report.write_json(folder / "bench.json", out)
    (folder / "bench.md").write_text(head + "\n\n" + versions + "\n" + "\n".join(markdown)
                                     + "\n")
    report.write_chart(folder / "bench.png", out)
    print(f"\nwrote {folder / 'bench.json'}, {folder / 'bench.md'}, {folder / 'bench.png'} "
          f"({out['settings']['elapsed_s']} s)")
