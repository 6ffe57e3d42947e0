"""Speculative decoding (n-gram prompt lookup) on and off, side by side, offline, one request at
a time: decode tokens/s on prompts that quote their context and on ones that do not.

    python benchmarks/spec_decode.py --rounds 3

Each round runs every prompt on both engines, alternating; the prefix cache is warmed first so
the figure is decode speed (the prompt's prefill is the same either way). Greedy, so both
engines produce the same tokens (checked).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from loom import LLM, SamplingParams, host

REPO = Path(__file__).resolve().parent.parent
NGRAM = ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
         '"prompt_lookup_min": 2}')


def prompts() -> dict[str, str]:
    source = (REPO / "src/loom/core/scheduler.py").read_text()[:3000]
    readme = (REPO / "README.md").read_text()[:2500]
    return {
        "quote code": f"Here is a file:\n{source}\nRepeat the first function of the file "
                      "exactly:\n",
        "quote prose": f"{readme}\n\nQuote the first paragraph of the text above, word for "
                       "word:\n",
        "free story": "Write a short story about a lighthouse keeper who finds a message in a "
                      "bottle.\n",
        "free answer": "Explain in a few sentences why the sky is blue.\n",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--speculative-config", default=NGRAM)
    args = parser.parse_args()
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
    print(f"{host.describe()}; {args.rounds} rounds, medians; {args.speculative_config}\n")
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
