"""A/B two engine settings on the engine issue's 64-request mixed workload, offline, side by
side in one run (A B A B ...), and print output tok/s for each and the ratio B / A. Run from
the repository root, e.g.:

    python benchmarks/ab_engine.py --a attention_backend=torch --b attention_backend=native
    python benchmarks/ab_engine.py --a dtype=float32 --b dtype=bfloat16 --rounds 3

Settings are `LLM(...)` keyword arguments (numbers and true/false are converted); both runs
also get --common. Both engines live in one process and step in turn, one step each, every
step timed (workload.run_interleaved), which one first alternating by round: the machine's
drift hits both alike, so the ratio resolves a few percent where runs one after the other
spread more than that. Each engine's tok/s is over its own step time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

sys.path.insert(0, "benchmarks")
from workload import bundled_tokenizer, mixed_workload, run_interleaved  # noqa: E402

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
    items = mixed_workload(bundled_tokenizer())
    output_tokens = sum(item.max_tokens for item in items)
    common = parse_settings(args.common)
    settings = {"A": args.a, "B": args.b}
    engines = {label: LLM(**{**common, **parse_settings(text)}).engine
               for label, text in settings.items()}
    runs: dict[str, list[float]] = {"A": [], "B": []}
    for r in range(args.rounds):
        order = ["A", "B"] if r % 2 == 0 else ["B", "A"]
        for engine in engines.values():
            engine.kv_cache.pool.reset_prefix_cache()  # every round prefills alike
        seconds = run_interleaved({label: engines[label] for label in order}, items)
        for label in order:
            runs[label].append(output_tokens / seconds[label])
            print(f"round {r + 1} {label} ({settings[label]}): {runs[label][-1]:.1f} tok/s, "
                  f"{seconds[label]:.1f} s in its steps", flush=True)
    a, b = statistics.median(runs["A"]), statistics.median(runs["B"])
    per_round = ", ".join(f"{rb / ra:.3f}" for ra, rb in zip(runs["A"], runs["B"]))
    print(f"\n| setting | output tok/s (median of {args.rounds}) |\n|---|---|")
    print(f"| A: {args.a} | {a:.1f} |\n| B: {args.b} | {b:.1f} |")
    print(f"\nB / A = {b / a:.3f}x, rounds {per_round}  (common: {args.common})")


if __name__ == "__main__":
    main()
