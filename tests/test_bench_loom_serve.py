"""`loom bench run` against a real `loom serve` (bundled model, 6 tiny requests), on the
completions endpoint, on chat (for servers that offer only chat) and on the Responses API."""

from __future__ import annotations

import asyncio

import pytest
from bench_helpers import write_trace_file

from loom.bench.replay import Load, Target, replay
from loom.bench.server import LOOM_SERVE, LocalServer
from loom.bench.trace import load_trace

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
