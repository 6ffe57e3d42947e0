"""Long streamed answers through `loom serve`, for one or more source trees side by side: C
concurrent completions of max_tokens tokens each (ignore_eos, greedy), with or without top-N
logprobs. What grows with an answer's length shows as the late inter-token latency (the median
gap over the last quarter of each stream) pulling away from the early one (the first quarter).
Run from the repository root, e.g.:

    python benchmarks/server/long_outputs.py --src base=/tmp/wt-base/src --src head=src \\
        --concurrency 8 --max-tokens 400 --logprobs 5 --rounds 2

Each run is a fresh server (`python -m loom.cli serve`, the engine process by
default) with that tree first on PYTHONPATH; the trees alternate (A B, B A, ...) and the table
gives medians over rounds. One untimed start per tree first builds its C++ kernels.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*
from benchmarks.harness import host_line, round_order  # noqa: E402
from benchmarks.server.source_trees import SERVE, add_src_argument, source_trees  # noqa: E402
from loom.bench.server import LocalServer  # noqa: E402


def stream_times(client: openai.OpenAI, index: int, args: argparse.Namespace) -> list[float]:
    """Arrival times of one stream's chunks."""
    stream = client.completions.create(
        model="loom", prompt=f"Story number {index}: once upon a time", max_tokens=args.max_tokens,
        temperature=0, logprobs=args.logprobs or None, stream=True,
        extra_body={"ignore_eos": True})
    return [time.perf_counter() for _ in stream]


def measure(url: str, args: argparse.Namespace) -> dict[str, float]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=900)
    start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        streams = list(pool.map(lambda i: stream_times(client, i, args),
                                range(args.concurrency)))
    wall = time.perf_counter() - start
    early: list[float] = []
    late: list[float] = []
    for times in streams:
        gaps = [b - a for a, b in zip(times, times[1:])]
        quarter = max(1, len(gaps) // 4)
        early += gaps[:quarter]
        late += gaps[-quarter:]
    return {"tok_s": sum(len(t) for t in streams) / wall,
            "early_itl_ms": statistics.median(early) * 1e3,
            "late_itl_ms": statistics.median(late) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_src_argument(parser)
    parser.add_argument("--server-flags", default="--kv-cache-memory 512MiB")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--logprobs", type=int, default=5, help="top-N logprobs; 0: none")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    runs = source_trees(args, args.server_flags)
    print(host_line())
    results: dict[str, list[dict[str, float]]] = {label: [] for label in runs}
    with tempfile.TemporaryDirectory() as logs:
        for r in range(-1, args.rounds):  # round -1: one untimed start each
            for label, (src, flags) in round_order(list(runs.items()), max(r, 0)):
                env = {"PYTHONPATH": src}
                log = Path(logs) / f"{label.replace('/', '-')}-{r}.log"
                with LocalServer(SERVE, flags, log, env=env) as server:
                    if r < 0:
                        continue  # the warm-up start builds the kernels
                    result = measure(server.url, args)
                results[label].append(result)
                print(f"round {r + 1} {label}: " + ", ".join(
                    f"{k} {v:.1f}" for k, v in result.items()), flush=True)
    print(f"\nC = {args.concurrency}, {args.max_tokens} tokens each, logprobs "
          f"{args.logprobs or 'off'}; medians of {args.rounds} rounds\n")
    print("| tree | output tok/s | early ITL ms | late ITL ms |\n|---|--:|--:|--:|")
    for label, measured in results.items():
        tok_s, early, late = (statistics.median(m[k] for m in measured)
                              for k in ("tok_s", "early_itl_ms", "late_itl_ms"))
        print(f"| {label} | {tok_s:.1f} | {early:.1f} | {late:.1f} |")


if __name__ == "__main__":
    main()
