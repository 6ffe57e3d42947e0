"""Speculative decoding (n-gram prompt lookup) on and off, side by side, offline.

    python benchmarks/engine/spec_decode.py --rounds 3
    python benchmarks/engine/spec_decode.py --rounds 3 --traffic 1,8

Without --traffic: one request at a time, decode tokens/s on prompts that quote their context
and on ones that do not. Each round runs every prompt on both engines, alternating; the prefix
cache is warmed first so the figure is decode speed (the prompt's prefill is the same either
way). Greedy, so both engines produce the same tokens (checked).

With --traffic C,...: what drafting costs where nothing is copied. The mixed workload
(benchmarks/engine/workload.py: synthetic chat, long and RAG prompts, none of which its answer
quotes) at temperature 1, an OpenAI server's default, as a closed loop of C sequences
(max_num_seqs C; the first 16 requests at C = 1, all 64 above). The two engines step in turn,
one step each, every step timed (workload.interleaved_rounds), so the machine's drift hits both
alike; which one steps first alternates by round. Output tok/s over each engine's own step
time, and the draft tokens the ngram engine ran per output token.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*
from benchmarks.engine.workload import (  # noqa: E402
    bundled_tokenizer,
    interleaved_rounds,
    mixed_workload,
)
from benchmarks.harness import CHECKOUT, host_line, medians, ratios  # noqa: E402
from loom import LLM, SamplingParams  # noqa: E402

NGRAM = ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
         '"prompt_lookup_min": 2}')


def prompts() -> dict[str, str]:
    source = (CHECKOUT / "src/loom/core/scheduler.py").read_text()[:3000]
    readme = (CHECKOUT / "README.md").read_text()[:2500]
    return {
        "quote code": f"Here is a file:\n{source}\nRepeat the first function of the file "
                      "exactly:\n",
        "quote prose": f"{readme}\n\nQuote the first paragraph of the text above, word for "
                       "word:\n",
        "free story": "Write a short story about a lighthouse keeper who finds a message in a "
                      "bottle.\n",
        "free answer": "Explain in a few sentences why the sky is blue.\n",
    }


def traffic(rounds: int, concurrencies: list[int], speculative_config: str) -> None:
    items = mixed_workload(bundled_tokenizer())
    print(f"{host_line()}; {rounds} rounds, medians; {speculative_config}\n")
    print("| sequences | requests | plain tok/s | ngram tok/s | ngram / plain | rounds | "
          "draft tokens per output token | accepted |\n|--:|--:|--:|--:|--:|---|--:|--:|")
    for c in concurrencies:
        work = items[:16] if c == 1 else items
        options = dict(kv_cache_memory="1GiB", max_num_seqs=c)
        engines = {"plain": LLM(**options),
                   "ngram": LLM(**options, speculative_config=speculative_config)}
        output_tokens = sum(item.max_tokens for item in work)
        rates = interleaved_rounds({label: llm.engine for label, llm in engines.items()}, work,
                                   rounds, 1.0)
        metrics = engines["ngram"].get_metrics()
        drafted = metrics["loom:spec_decode_num_draft_tokens_total"]
        accepted = metrics["loom:spec_decode_num_accepted_tokens_total"]
        plain, ngram = (medians(rates)[k] for k in ("plain", "ngram"))
        per_round = ratios(rates["ngram"], rates["plain"])
        print(f"| {c} | {len(work)} | {plain:.1f} | {ngram:.1f} | {ngram / plain:.3f}x | "
              f"{per_round} | {drafted / (rounds * output_tokens):.3f} | "
              f"{100 * accepted / max(drafted, 1):.0f}% |", flush=True)
        del engines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--traffic", default=None, metavar="C,...",
                        help="the mixed workload at temperature 1 at these concurrencies "
                             "instead of the one-request prompts")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--speculative-config", default=NGRAM)
    args = parser.parse_args()
    if args.traffic:
        traffic(args.rounds, [int(c) for c in args.traffic.split(",")], args.speculative_config)
        return
    options = dict(kv_cache_memory="512MiB", max_model_len=4096)
    engines = {"plain": LLM(**options),
               "ngram": LLM(**options, speculative_config=args.speculative_config)}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    rates: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for name, prompt in prompts().items():
            tokens = {}
            for label, llm in engines.items():
                llm.generate(prompt, SamplingParams(max_tokens=1))  # prefill into the cache
                start = time.perf_counter()
                out = llm.generate(prompt, params)[0].outputs[0]
                rates.setdefault((label, name), []).append(
                    len(out.token_ids) / (time.perf_counter() - start))
                tokens[label] = out.token_ids
            assert tokens["plain"] == tokens["ngram"], f"outputs differ on {name!r}"
    metrics = engines["ngram"].get_metrics()
    print(f"{host_line()}; {args.rounds} rounds, medians; {args.speculative_config}\n")
    print("| prompt | plain tok/s | ngram tok/s | ngram / plain |\n|---|--:|--:|--:|")
    for name in prompts():
        plain = statistics.median(rates[("plain", name)])
        ngram = statistics.median(rates[("ngram", name)])
        print(f"| {name} | {plain:.1f} | {ngram:.1f} | {ngram / plain:.2f}x |")
    drafted = metrics["loom:spec_decode_num_draft_tokens_total"]
    accepted = metrics["loom:spec_decode_num_accepted_tokens_total"]
    print(f"\ndraft tokens {drafted:.0f}, accepted {accepted:.0f} "
          f"({100 * accepted / max(drafted, 1):.0f}%)")


if __name__ == "__main__":
    main()
