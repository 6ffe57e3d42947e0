"""`loom bench run` against a real `loom serve` (bundled model, 6 tiny requests), on the
completions endpoint, on chat (for servers that offer only chat) and on the Responses API."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
from bench_helpers import write_trace_file

from loom.bench.replay import Target, replay
from loom.bench.server import LOOM_SERVE, LocalServer
from loom.workload.load import Load
from loom.workload.trace import load_trace

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("endpoint", ["completions", "chat", "responses"])
def test_bench_run_against_loom_serve(tmp_path, endpoint: str) -> None:
    prompts = ["Hello, how are you?", "Name a colour.", "What is 2 + 2?"] * 2
    trace_path = write_trace_file(tmp_path / "t.jsonl", prompts, 4, ["rag", "chat"])
    server = LocalServer(LOOM_SERVE, "--kv-cache-memory 128MiB --max-num-seqs 4",
                         tmp_path / "serve.log", health_timeout_s=180)
    with server:
        result = asyncio.run(replay(load_trace(trace_path), Load(max_concurrency=3),
                                    Target(server.url, server_pid=server.pid,
                                           scrape_interval_s=0.5, endpoint=endpoint),
                                    progress=False))
    assert (result["completed"], result["failed"]) == (6, 0), result["errors"]
    assert result["total_output_tokens"] == 24  # ignore_eos: exactly max_tokens each
    assert result["endpoint"] == {"completions": "/v1/completions", "chat": "/v1/chat/completions",
                                  "responses": "/v1/responses"}[endpoint]
    assert result["model_id"] and result["server"]["version"]["version"]
    assert result["metrics_source"] == "loom"
    assert result["queue_time"]["count"] == 6 and result["preemptions"] == 0
    assert result["num_requests_running_peak"] <= 3
    assert result["server_memory"]["peak_rss_bytes"] > 100 * 2**20
    assert set(result["per_class"]) == {"chat", "rag"}


def test_bench_repeats_reset_loom_serves_prefix_cache(tmp_path) -> None:
    """The documented `bench run --repeats N --reset-prefix-cache` against loom serve (the
    engine in its own process): each repeat after the first starts with no cached prefix, so
    the second repeat finds in the cache what the first did, not its every prompt."""
    from loom.cli.main import main

    prompts = ["A shared document, long enough for a few KV blocks. " * 4 + f"Q{i}?"
               for i in range(4)]
    trace_path = write_trace_file(tmp_path / "t.jsonl", prompts, 2, ["rag"])
    server = LocalServer(LOOM_SERVE, "--kv-cache-memory 128MiB --enable-admin-routes",
                         tmp_path / "serve.log",
                         health_timeout_s=180)

    def hits() -> float:
        text = httpx.get(f"{server.url}/metrics").text
        return float(re.search(r"^loom:prefix_cache_hits_total\S* (\S+)$", text, re.M)[1])

    run = ["bench", "run", "--base-url", server.url, "--trace", str(trace_path),
           "--max-concurrency", "1", "--scrape-interval", "0.2"]
    with server:
        assert main([*run, "--repeats", "2", "--reset-prefix-cache"]) == 0
        two_cold = hits()  # the shared document's blocks, found by Q1-Q3, in each repeat
        assert httpx.post(f"{server.url}/reset_prefix_cache").status_code == 200
        assert main(run) == 0
        one_cold = hits() - two_cold
        assert main(run) == 0  # once more, every prompt still cached
        warm = hits() - two_cold - one_cold
    assert 0 < one_cold < warm and two_cold == 2 * one_cold
