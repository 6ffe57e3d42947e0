"""What the HTTP server costs: the mixed workload offline (LLM engine in this process) and
through `loom serve` at concurrency 1, 4, 16 and 64 (closed loop, streaming).

Reports output tokens/s, p50/p95 time to first token and p95 inter-token latency for each,
and the HTTP/offline throughput ratio at concurrency 64. Every request uses ignore_eos, so
output lengths are exactly the workload's. Each HTTP concurrency level gets its own workload
seed (the 64 level reuses the offline seed, on a fresh server process), so no run is served
from prefixes cached by an earlier one. Usage:

    python benchmarks/http_vs_offline.py                    # the full comparison (long on CPU)
    python benchmarks/http_vs_offline.py --num-requests 8 --concurrency 1,4   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import shlex
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from workload import WorkItem, bundled_tokenizer, mixed_workload

from loom import LLM, SamplingParams, host
from loom.bench.client import OK, RequestResult, send
from loom.bench.server import LOOM_SERVE, LocalServer
from loom.bench.trace import TraceRequest


@dataclass
class Timings:
    """One request as the client saw it, in seconds from its send: the first token, each
    later chunk, and the tokens it got."""

    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    num_tokens: int = 0


@dataclass
class Result:
    mode: str
    concurrency: int
    wall_s: float
    requests: list[Timings]

    @property
    def tok_s(self) -> float:
        return sum(r.num_tokens for r in self.requests) / self.wall_s

    def ttft(self) -> list[float]:
        return [r.ttft for r in self.requests]

    def itl(self) -> list[float]:
        return [gap for r in self.requests for gap in r.itls]


def percentile(values: list[float], q: float) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


# -- offline --------------------------------------------------------------------------------------


def run_offline(llm: LLM, items: list[WorkItem]) -> Result:
    """All requests at once through EngineCore's step loop, timing each token as it lands
    (the same loop LLM.generate runs, instrumented per step)."""
    engine = llm.engine
    start = time.monotonic()
    timings, last = {}, {}
    for i, item in enumerate(items):
        engine.add_request(f"offline-{i}", item.prompt_token_ids, SamplingParams(
            max_tokens=item.max_tokens, temperature=0.0, ignore_eos=True))
        timings[f"offline-{i}"] = Timings()
    in_flight = None  # with async scheduling, the step still running on the model
    while engine.has_unfinished_requests() or in_flight is not None:
        outputs, in_flight = engine.step(in_flight)
        now = time.monotonic()
        for output in outputs:
            t = timings[output.request_id]
            if t.ttft is None:
                t.ttft = now - start
            else:
                t.itls.append(now - last[output.request_id])
            last[output.request_id] = now
            t.num_tokens = len(output.outputs[0].token_ids)
    return Result("offline", len(items), time.monotonic() - start, list(timings.values()))


# -- over HTTP ------------------------------------------------------------------------------------


@contextmanager
def loom_serve(flags: list[str]) -> Iterator[str]:
    with tempfile.TemporaryDirectory() as tmp, LocalServer(
            LOOM_SERVE, shlex.join(flags), Path(tmp) / "serve.log") as server:
        yield server.url


async def stream_one(http: httpx.AsyncClient, url: str, item: WorkItem) -> Timings:
    """One streamed request through loom.bench's client (SSE split only where SSE splits)."""
    request = TraceRequest(max_tokens=item.max_tokens, prompt_len=len(item.prompt_token_ids))
    result = RequestResult(id=None, cls="mixed", prompt_len=request.prompt_len,
                           max_tokens=item.max_tokens, scheduled_s=0.0)
    await send(http, url + "/v1/completions", request, "any", result, time.perf_counter(),
               extra={"prompt": item.prompt_token_ids, "temperature": 0})
    if result.status != OK or result.output_tokens != item.max_tokens:
        raise RuntimeError(f"asked for {item.max_tokens} tokens, got {result.output_tokens} "
                           f"({result.status}: {result.error})")
    return Timings(result.ttft_s, result.itls_s, result.output_tokens)


async def run_http(url: str, items: list[WorkItem], concurrency: int) -> Result:
    """Closed loop: `concurrency` clients, each sending its next request when one finishes."""
    queue: asyncio.Queue[WorkItem] = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)
    results: list[Timings] = []
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=None, limits=limits) as http:

        async def client() -> None:
            while not queue.empty():
                results.append(await stream_one(http, url, queue.get_nowait()))

        start = time.monotonic()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return Result("http", concurrency, time.monotonic() - start, results)


# -- report ---------------------------------------------------------------------------------------


def row(result: Result) -> str:
    ttft, itl = result.ttft(), result.itl()
    return (f"| {result.mode} | {result.concurrency} | {result.tok_s:.1f} | "
            f"{percentile(ttft, 50):.3f} | {percentile(ttft, 95):.3f} | "
            f"{percentile(itl, 95) * 1000:.1f} | {result.wall_s:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", default="1,4,16,64",
                        help="comma-separated closed-loop client counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--kv-cache-memory", default="2GiB")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    tokenizer = bundled_tokenizer()

    def workload(seed: int) -> list[WorkItem]:
        return mixed_workload(tokenizer, n=args.num_requests, seed=seed)

    engine_flags = {"max_num_seqs": args.max_num_seqs, "kv_cache_memory": args.kv_cache_memory}
    llm = LLM(**engine_flags)
    run_offline(llm, workload(args.seed + 1000)[:4])  # warm-up
    llm.engine.kv_cache.pool.reset_prefix_cache()
    results = [run_offline(llm, workload(args.seed))]
    print(row(results[-1]), flush=True)
    del llm
    gc.collect()

    flags = [f"--{k.replace('_', '-')}={v}" for k, v in engine_flags.items()]
    with loom_serve(flags) as url:
        asyncio.run(run_http(url, workload(args.seed + 1000)[:4], 4))  # warm-up
        for i, concurrency in enumerate(levels):
            seed = args.seed if concurrency == max(levels) else args.seed + 1 + i
            results.append(asyncio.run(run_http(url, workload(seed), concurrency)))
            print(row(results[-1]), flush=True)

    print(f"\nhost: {host.describe()}; {args.num_requests} mixed requests, "
          f"max_num_seqs={args.max_num_seqs}, kv_cache_memory={args.kv_cache_memory}")
    print("| mode | concurrency | output tok/s | p50 TTFT (s) | p95 TTFT (s) | p95 ITL (ms) "
          "| wall (s) |")
    print("|---|---|---|---|---|---|---|")
    for result in results:
        print(row(result))
    top = max(results[1:], key=lambda r: r.concurrency)
    print(f"\nHTTP (concurrency {top.concurrency}) / offline output tok/s: "
          f"{top.tok_s / results[0].tok_s:.2f}x")


if __name__ == "__main__":
    main()
