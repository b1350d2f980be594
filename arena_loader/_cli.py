"""The ``arena-loader`` command: ``arena-loader bench [options]`` runs the benchmark suite
(see ``arena_loader.bench.cli``; ``arena-loader bench --help`` lists its options)."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="arena-loader", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("bench", add_help=False,
                        help="compare ArenaLoader with torch, SPDL, Grain, torchdata, the copy "
                        "limit and the floor (arena-loader bench --help)")
    _, rest = parser.parse_known_args(argv)  # one command so far: bench
    try:
        from .bench.cli import main as bench
    except ImportError as error:
        parser.exit(2, f"arena-loader bench needs the bench extra: pip install "
                    f"'arena-loader[bench]' ({error})\n")
    return bench(rest)


if __name__ == "__main__":
    raise SystemExit(main())
