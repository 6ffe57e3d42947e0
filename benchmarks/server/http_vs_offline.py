"""What the HTTP server costs: the mixed workload offline (LLM engine in this process) and
through `loom serve` at concurrency 1, 4, 16 and 64, both as closed loops (streaming over HTTP).

Reports output tokens/s, p50/p95 time to first token and p50/p95 inter-token latency for each,
then each server's tok/s and p50 ITL against offline at the same concurrency (offline at 1 is
the B = 1 decode step). Every request uses ignore_eos, so output lengths are exactly the
workload's. Each concurrency level has its own workload seed, the same for every mode, and
every round starts fresh servers (and empties the offline prefix cache), so no run is served
from prefixes cached by an earlier one. `--variant` compares `loom serve`s with different
flags, `--rounds` alternates them with offline. Usage:

    python benchmarks/server/http_vs_offline.py             # the full comparison (long on CPU)
    python benchmarks/server/http_vs_offline.py --num-requests 8 --concurrency 1,4   # a smoke run
    python benchmarks/server/http_vs_offline.py --concurrency 1 --num-requests 8 --rounds 3 \\
        --variant thread=--engine-in-process --variant process=
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*
from benchmarks.engine.workload import WorkItem, bundled_tokenizer, mixed_workload  # noqa: E402
from benchmarks.harness import host_line  # noqa: E402
from loom import LLM, SamplingParams  # noqa: E402
from loom.bench.client import send  # noqa: E402
from loom.bench.server import LOOM_SERVE, LocalServer  # noqa: E402
from loom.workload.requests import OK, RequestResult  # noqa: E402
from loom.workload.trace import TraceRequest  # noqa: E402


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


def run_offline(llm: LLM, items: list[WorkItem], concurrency: int) -> Result:
    """A closed loop through EngineCore's step loop, as the HTTP clients run it: `concurrency`
    requests in flight, the next added as one finishes, each token timed as it lands (the
    loop LLM.generate runs, instrumented per step)."""
    engine = llm.engine
    pending = [(f"offline-{i}", item) for i, item in enumerate(items)][::-1]
    timings: dict[str, Timings] = {}
    last: dict[str, float] = {}

    def add() -> None:
        request_id, item = pending.pop()
        engine.add_request(request_id, item.prompt_token_ids, SamplingParams(
            max_tokens=item.max_tokens, temperature=0.0, ignore_eos=True))
        timings[request_id] = Timings()
        last[request_id] = time.monotonic()

    start = time.monotonic()
    for _ in range(min(concurrency, len(pending))):
        add()
    in_flight = None  # with async scheduling, the step still running on the model
    while engine.has_unfinished_requests() or in_flight is not None:
        outputs, in_flight = engine.step(in_flight)
        now = time.monotonic()
        for output in outputs:
            t = timings[output.request_id]
            if t.ttft is None:
                t.ttft = now - last[output.request_id]
            else:
                t.itls.append(now - last[output.request_id])
            last[output.request_id] = now
            t.num_tokens = len(output.outputs[0].token_ids)
            if output.finished and pending:
                add()
    return Result("offline", concurrency, time.monotonic() - start, list(timings.values()))


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
            f"{percentile(itl, 50) * 1000:.1f} | {percentile(itl, 95) * 1000:.1f} | "
            f"{result.wall_s:.1f} |")


HEADER = ("| mode | concurrency | output tok/s | p50 TTFT (s) | p95 TTFT (s) | p50 ITL (ms) "
          "| p95 ITL (ms) | wall (s) |\n|---|--:|--:|--:|--:|--:|--:|--:|")


def summary(runs: dict[tuple[str, int], list[Result]]) -> list[str]:
    """Medians over the rounds of each mode and level, against offline at the same level."""
    lines = ["| mode | concurrency | output tok/s | tok/s / offline | p50 ITL (ms) | p95 ITL (ms) "
             "| p50 ITL / offline |", "|---|--:|--:|--:|--:|--:|--:|"]
    medians = {key: (statistics.median(r.tok_s for r in results),
                     statistics.median(percentile(r.itl(), 50) for r in results),
                     statistics.median(percentile(r.itl(), 95) for r in results))
               for key, results in runs.items()}
    for (mode, concurrency), (tok_s, p50, p95) in medians.items():
        base_tok_s, base_p50, _ = medians[("offline", concurrency)]
        lines.append(f"| {mode} | {concurrency} | {tok_s:.1f} | {tok_s / base_tok_s:.2f} | "
                     f"{p50 * 1000:.1f} | {p95 * 1000:.1f} | {p50 / base_p50:.2f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", default="1,4,16,64",
                        help="comma-separated closed-loop client counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--variant", action="append", default=None, metavar="LABEL=FLAGS",
                        help="a `loom serve` to compare, with these extra flags (repeatable), "
                             "e.g. thread=--engine-in-process; default: http= (no extra flags)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="alternating rounds of offline and every variant")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    variants = dict(v.split("=", 1) for v in (args.variant or ["http="]))
    tokenizer = bundled_tokenizer()

    def workload(level: int) -> list[WorkItem]:  # one per level: no run hits another's prefixes
        return mixed_workload(tokenizer, n=args.num_requests, seed=args.seed + 1 + level)

    engine_flags = {"max_num_seqs": args.max_num_seqs, "kv_cache_memory": args.kv_cache_memory}
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in engine_flags.items()]
    llm = LLM(**engine_flags)
    run_offline(llm, mixed_workload(tokenizer, n=4, seed=args.seed), 4)  # warm-up
    runs: dict[tuple[str, int], list[Result]] = defaultdict(list)
    print(HEADER, flush=True)
    for _ in range(args.rounds):
        for i, concurrency in enumerate(levels):
            llm.engine.kv_cache.pool.reset_prefix_cache()
            runs[("offline", concurrency)].append(run_offline(llm, workload(i), concurrency))
            print(row(runs[("offline", concurrency)][-1]), flush=True)
        for label, extra in variants.items():
            with loom_serve(flags + shlex.split(extra)) as url:
                asyncio.run(run_http(url, mixed_workload(tokenizer, n=4, seed=args.seed), 4))
                for i, concurrency in enumerate(levels):
                    result = asyncio.run(run_http(url, workload(i), concurrency))
                    result.mode = label
                    runs[(label, concurrency)].append(result)
                    print(row(result), flush=True)

    print(f"\n{host_line()}; {args.num_requests} mixed requests a level, "
          f"max_num_seqs={args.max_num_seqs}, kv_cache_memory={args.kv_cache_memory}, "
          f"medians of {args.rounds} alternating rounds")
    print("\n".join(summary(runs)))


if __name__ == "__main__":
    main()
