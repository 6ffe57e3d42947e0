"""An independent OpenAI-compatible test server with known timing, for checking `loom bench`.

It shares no code with loom: it streams /v1/completions as SSE with the first token after
exactly `--ttft` seconds and one token every `--itl` seconds after that (each token is sent at
its absolute due time, so delays never accumulate), exports /metrics in loom's names, and
with `--max-running N` answers 503 + Retry-After to requests beyond N in flight. Unknown flags
are accepted and ignored, so `loom bench compare --server-cmd` can start it like a real server.

    python tests/fake_openai_server.py --port 8123 --ttft 0.2 --itl 0.04
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from loom.bench.server import LocalServer

MODEL = "fake-model"


def create_app(ttft: float, itl: float, max_running: int | None) -> FastAPI:
    app = FastAPI()
    state = {"running": 0, "rejected": 0, "finished": 0, "tokens": 0, "queue_sum": 0.0}

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/version")
    async def version() -> dict:
        return {"version": "fake-1.0", "ttft": ttft, "itl": itl, "max_num_seqs": max_running}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        label = f'{{model_name="{MODEL}"}}'
        n = state["finished"]
        lines = [
            f"loom:num_requests_running{label} {state['running']}",
            f"loom:num_requests_waiting{label} 0",
            f"loom:kv_cache_usage_perc{label} {state['running'] / (max_running or 64)}",
            f"loom:num_preemptions_total{label} 0",
            f"loom:request_rejected_total{label} {state['rejected']}",
            f"loom:generation_tokens_total{label} {state['tokens']}",
            f'loom:request_queue_time_seconds_bucket{{le="0.01",model_name="{MODEL}"}} {n}',
            f'loom:request_queue_time_seconds_bucket{{le="+Inf",model_name="{MODEL}"}} {n}',
            f"loom:request_queue_time_seconds_sum{label} 0.0",
            f"loom:request_queue_time_seconds_count{label} {n}",
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    @app.post("/v1/completions")
    async def completions(request: Request):
        start = time.perf_counter()  # token times count from the request's arrival
        body = await request.json()
        if max_running is not None and state["running"] >= max_running:
            state["rejected"] += 1
            return JSONResponse({"error": {"message": "server busy", "code": 503}},
                                status_code=503, headers={"Retry-After": "1"})
        n = int(body.get("max_tokens", 16))
        usage = {"prompt_tokens": len(str(body.get("prompt", "")).split()),
                 "completion_tokens": n}
        state["running"] += 1

        async def events():
            try:
                for i in range(n):
                    delay = start + ttft + i * itl - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    # Raw U+2028 / NEL inside JSON strings, as pydantic-based servers send
                    # them: a client must not split the event there.
                    chunk = {"id": "cmpl-fake", "object": "text_completion", "model": MODEL,
                             "choices": [{"index": 0, "text": f" t{i}\u2028\x85",
                                          "finish_reason": "length" if i == n - 1 else None}]}
                    state["tokens"] += 1
                    yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
                if (body.get("stream_options") or {}).get("include_usage"):
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state["running"] -= 1
                state["finished"] += 1

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@contextlib.contextmanager
def running_fake_server(*flags: str) -> Iterator[str]:
    """Start the fake server in its own process (so its timing does not share the test's
    event loop or GIL); yields its base URL."""
    template = f"{shlex.quote(sys.executable)} {shlex.quote(str(Path(__file__)))} --port {{port}}"
    with tempfile.TemporaryDirectory() as tmp, LocalServer(
            template, shlex.join(flags), Path(tmp) / "fake.log", health_timeout_s=30) as server:
        yield server.url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ttft", type=float, default=0.05, help="seconds to the first token")
    parser.add_argument("--itl", type=float, default=0.02, help="seconds between tokens")
    parser.add_argument("--max-running", type=int, default=None, help="503 beyond this")
    args, _ = parser.parse_known_args()
    uvicorn.run(create_app(args.ttft, args.itl, args.max_running), host="127.0.0.1",
                port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
