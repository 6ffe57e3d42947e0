"""Source trees side by side for the benchmarks that start `loom serve` (startup.py,
long_outputs.py): `--src LABEL=DIR[=FLAGS]`, repeatable, each a tree put first on PYTHONPATH
with `loom serve` flags of its own."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SERVE = f"{sys.executable} -m loom.cli serve --port {{port}}"


def add_src_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--src", action="append", default=None, metavar="LABEL=DIR[=FLAGS]",
                        help="a source tree to put first on PYTHONPATH, and flags for its "
                             "`loom serve` (repeatable); default: this checkout's src")


def source_trees(args: argparse.Namespace, server_flags: str) -> dict[str, tuple[str, str]]:
    """label -> (PYTHONPATH, `loom serve` flags: `server_flags` and the tree's own)."""
    runs = {}
    for spec in args.src or ["loom=src"]:
        label, src, *flags = spec.split("=", 2)
        runs[label] = (str(Path(src).resolve()), " ".join([server_flags, *flags]))
    return runs
