"""A/B two engine settings on the engine issue's 64-request mixed workload, offline, side by
side in one run (A B A B ...), and print output tok/s for each and the ratio B / A. Run from
the repository root, e.g.:

    python benchmarks/ab_engine.py --a attention_backend=torch --b attention_backend=native
    python benchmarks/ab_engine.py --a dtype=float32 --b dtype=bfloat16 --rounds 3

Settings are `LLM(...)` keyword arguments (numbers and true/false are converted); both runs
also get --common.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

sys.path.insert(0, "benchmarks")
from workload import bundled_tokenizer, mixed_workload, run_offline  # noqa: E402

from loom import LLM  # noqa: E402


def parse_settings(text: str) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    for pair in filter(None, text.split(",")):
        key, _, value = pair.partition("=")
        if value.lower() in ("true", "false"):
            settings[key] = value.lower() == "true"
        else:
            try:
                settings[key] = int(value)
            except ValueError:
                settings[key] = value
    return settings


def run_once(settings: dict[str, Any], items: list) -> tuple[float, float]:
    """(output tok/s, wall seconds) for the whole workload."""
    wall = run_offline(LLM(**settings).engine, items)
    return sum(item.max_tokens for item in items) / wall, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--a", required=True, help="settings of A, e.g. dtype=float32")
    parser.add_argument("--b", required=True, help="settings of B")
    parser.add_argument("--common", default="kv_cache_memory=1536MiB,max_num_seqs=32")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    items = mixed_workload(bundled_tokenizer())
    common = parse_settings(args.common)
    runs: dict[str, list[float]] = {"A": [], "B": []}
    for r in range(args.rounds):
        for label, text in (("A", args.a), ("B", args.b)):
            tok_s, wall = run_once({**common, **parse_settings(text)}, items)
            runs[label].append(tok_s)
            print(f"round {r + 1} {label} ({text}): {tok_s:.1f} tok/s, wall {wall:.1f} s",
                  flush=True)
    a, b = statistics.median(runs["A"]), statistics.median(runs["B"])
    print(f"\n| setting | output tok/s (median of {args.rounds}) |\n|---|---|")
    print(f"| A: {args.a} | {a:.1f} |\n| B: {args.b} | {b:.1f} |")
    print(f"\nB / A = {b / a:.2f}x  (common: {args.common})")


if __name__ == "__main__":
    main()
