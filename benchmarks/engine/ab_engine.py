"""A/B two engine settings on the engine issue's 64-request mixed workload, offline, side by
side in one run (A B A B ...), and print output tok/s for each and the ratio B / A. Run from
the repository root, e.g.:

    python benchmarks/engine/ab_engine.py --a attention_backend=torch --b attention_backend=native
    python benchmarks/engine/ab_engine.py --a dtype=float32 --b dtype=bfloat16 --rounds 3

Settings are `LLM(...)` keyword arguments (numbers and true/false are converted); both runs
also get --common. Both engines live in one process and step in turn, one step each, every
step timed (workload.interleaved_rounds), which one first alternating by round: the machine's
drift hits both alike, so the ratio resolves a few percent where runs one after the other
spread more than that. Each engine's tok/s is over its own step time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*
from benchmarks.engine.workload import (  # noqa: E402
    bundled_tokenizer,
    interleaved_rounds,
    mixed_workload,
)
from benchmarks.harness import host_line, medians, ratios  # noqa: E402
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--a", required=True, help="settings of A, e.g. dtype=float32")
    parser.add_argument("--b", required=True, help="settings of B")
    parser.add_argument("--common", default="kv_cache_memory=1536MiB,max_num_seqs=32")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(host_line())
    items = mixed_workload(bundled_tokenizer())
    common = parse_settings(args.common)
    settings = {"A": args.a, "B": args.b}
    engines = {label: LLM(**{**common, **parse_settings(text)}).engine
               for label, text in settings.items()}
    output_tokens = sum(item.max_tokens for item in items)

    def report(round_number: int, seconds: dict[str, float]) -> None:
        for label, spent in seconds.items():
            print(f"round {round_number} {label} ({settings[label]}): "
                  f"{output_tokens / spent:.1f} tok/s, {spent:.1f} s in its steps", flush=True)

    runs = interleaved_rounds(engines, items, args.rounds, report=report)
    a, b = medians(runs).values()
    per_round = ratios(runs["B"], runs["A"])
    print(f"\n| setting | output tok/s (median of {args.rounds}) |\n|---|---|")
    print(f"| A: {args.a} | {a:.1f} |\n| B: {args.b} | {b:.1f} |")
    print(f"\nB / A = {b / a:.3f}x, rounds {per_round}  (common: {args.common})")


if __name__ == "__main__":
    main()
