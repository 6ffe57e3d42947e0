"""One user with a long context: ms an output token after a prompt of N tokens, where decode
attention is most of the token, for one or more source trees side by side.

    python benchmarks/engine/long_context.py --prompt-tokens 1101 2101 4101 6101
    python benchmarks/engine/long_context.py --trees /tmp/before . --rounds 2

Each (round, tree) runs in a process of its own with that tree's loom first on PYTHONPATH
(this checkout's script), the trees taking turns (harness.round_order). In it,
`LLM(enable_prefix_caching=False)` decodes 129 greedy tokens (ignore_eos) after one prompt of
each length (a passage repeated: only the length matters); ms a token is (finished_time -
first_token_time) / 128 from the request's own metrics, so the prefill is left out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*

OUTPUT_TOKENS = 129
PASSAGE = ("The lighthouse keeper climbed the stairs each evening, trimmed the wick, wound the "
           "clockwork that turned the lens, and wrote the weather in the log. ")


def child(lengths: list[int]) -> None:
    from loom import LLM, SamplingParams

    llm = LLM(enable_prefix_caching=False, max_model_len=max(lengths) + OUTPUT_TOKENS + 16)
    passage = llm.tokenizer.encode(PASSAGE, add_special_tokens=False)
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True)
    llm.generate([passage], SamplingParams(max_tokens=4))  # warm-up
    result = {}
    for length in lengths:
        prompt = (passage * (length // len(passage) + 1))[:length]
        metrics = llm.generate([prompt], params)[0].metrics
        result[length] = ((metrics.finished_time - metrics.first_token_time)
                          / (OUTPUT_TOKENS - 1) * 1e3)
    print(json.dumps(result))


def parent(args: argparse.Namespace) -> None:
    from benchmarks.harness import host_line, round_order

    runs: dict[str, list[dict[str, float]]] = {tree: [] for tree in args.trees}
    for r in range(args.rounds):
        for tree in round_order(args.trees, r):
            env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve() / "src"))
            out = subprocess.run([sys.executable, __file__, "--child",
                                  *map(str, args.prompt_tokens)],
                                 env=env, check=True, capture_output=True, text=True)
            runs[tree].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {tree}: {runs[tree][-1]}", flush=True)
    first = args.trees[0]
    print(f"\n{host_line()}; {OUTPUT_TOKENS} greedy tokens, {args.rounds} rounds\n")
    print("| prompt tokens | " + " | ".join(f"{t} ms a token (rounds)" for t in args.trees)
          + "".join(f" | {t} / {first}" for t in args.trees[1:]) + " |")
    print("|--:|" + "---|" * len(args.trees) + "--:|" * (len(args.trees) - 1))
    for length in map(str, args.prompt_tokens):
        cells = [", ".join(f"{run[length]:.2f}" for run in runs[t]) for t in args.trees]
        base = statistics.median(run[length] for run in runs[first])
        ratio = [f"{statistics.median(run[length] for run in runs[t]) / base:.2f}x"
                 for t in args.trees[1:]]
        print(f"| {int(length):,} | " + " | ".join(cells + ratio) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs="+", default=["."],
                        help="checkouts whose src/ to time (default: this one)")
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[1101, 2101, 4101, 6101])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", type=int, nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
    else:
        parent(args)


if __name__ == "__main__":
    main()
