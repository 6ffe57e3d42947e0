"""`loom bench ...` and `loom diagnose` sub-commands (placeholder until the bench issue lands)."""

from __future__ import annotations

import argparse


def add_bench_parsers(sub: argparse._SubParsersAction) -> None:
    """Register `bench` and `diagnose` on the top-level `loom` parser."""
