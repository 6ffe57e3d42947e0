"""Write a `loom bench` trace of requests that quote or edit their context: the traffic n-gram
speculative decoding is for (a RAG answer citing its document, a code edit returning the
function). Documents are this repository's own text, so the trace needs nothing downloaded.
Each request asks for greedy sampling (`temperature` 0, `--temperature` to change it), as code
edit tools and agents do for a copy task; without it the server's default (1.0 on an OpenAI
server) makes a small model's "quote" a paraphrase, and there is little left to speculate on.

    python benchmarks/server/quote_trace.py -o benchmarks/traces/quote-16.jsonl
    NGRAM='{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4,
            "prompt_lookup_min":2}'   # on one line, without spaces
    loom bench compare --trace benchmarks/traces/quote-16.jsonl --overlap 1,8 \
        --output-dir benchmarks/results/spec-quote --config plain= \
        --config ngram="--speculative-config '$NGRAM'"

(The inner single quotes matter: a --config's flags are split as a shell would split them, so
the JSON's double quotes would otherwise be taken as quoting and dropped.)
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = ["README.md", "docs/architecture.md", "src/loom/core/scheduler.py",
           "src/loom/core/kv_cache.py", "src/loom/core/block_pool.py", "src/loom/engine/core.py",
           "src/loom/model/runner.py", "src/loom/bench/trace.py"]
TASKS = {
    "quote": "\n\nQuote the first paragraph of the text above exactly, word for word:\n",
    "edit": "\n\nRewrite the text above with every occurrence of 'request' replaced by "
            "'query'. Output the whole rewritten text:\n",
}


def documents(max_chars: int) -> list[str]:
    """Chunks of the repository's files, each cut at a line boundary."""
    chunks = []
    for name in SOURCES:
        text = (REPO / name).read_text()
        start = 0
        while start < len(text) and len(chunks) < 64:
            end = text.rfind("\n", start, start + max_chars)
            end = end if end > start else min(len(text), start + max_chars)
            if end - start > max_chars // 2:
                chunks.append(text[start:end])
            start = end + 1
    return chunks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", required=True)
    parser.add_argument("-n", "--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-chars", type=int, default=1600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature every request asks for (default: 0, greedy)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    docs = documents(args.max_chars)
    lines = [{"header": {"format": "loom-trace", "version": 1, "kind": "quote",
                         "seed": args.seed, "num_requests": args.num_requests,
                         "sources": SOURCES, "classes": sorted(TASKS)}}]
    for i in range(args.num_requests):
        task = rng.choice(sorted(TASKS))
        lines.append({"id": f"{task}-{i:05d}", "class": task,
                      "prompt": rng.choice(docs) + TASKS[task], "max_tokens": args.max_tokens,
                      "temperature": args.temperature})
    Path(args.output).write_text("".join(json.dumps(line) + "\n" for line in lines))
    print(f"wrote {args.num_requests} requests to {args.output}")


if __name__ == "__main__":
    main()
