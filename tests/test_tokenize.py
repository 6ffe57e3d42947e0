"""/tokenize and /detokenize (vLLM's shapes) on a real HTTP server on loopback: the app
`build_app` makes (admin routes on), over the bundled model. Token counts agree
with `usage.prompt_tokens` of the same prompt or chat."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
import uvicorn

from loom.config import EngineConfig
from loom.engine.async_engine import AsyncEngine
from loom.engine.core import EngineCore
from loom.entrypoints.openai.server import ServerConfig, build_app

pytestmark = pytest.mark.integration

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def url() -> str:
    core = EngineCore(EngineConfig.from_kwargs(kv_cache_memory="128MiB", max_model_len=2048))
    engine = AsyncEngine(core, max_num_seqs=core.config.scheduler.max_num_seqs)
    app = build_app(engine, ServerConfig(enable_admin_routes=True))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join()


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def test_a_prompt_round_trips_and_counts_as_completions_do(url: str) -> None:
    prompt = "The capital of France is Paris. Ünïcödé and emoji 🙂 too."
    tokens = post(url, "/tokenize", {"prompt": prompt, "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"])
    assert tokens["max_model_len"] == 2048
    back = post(url, "/detokenize", {"tokens": tokens["tokens"]}).json()
    assert back == {"prompt": prompt}
    done = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == tokens["count"]


def test_messages_count_as_chat_completions_do(url: str) -> None:
    tokens = post(url, "/tokenize", {"messages": CHAT}).json()
    done = post(url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == tokens["count"]
    text = post(url, "/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\n") and CHAT[0]["content"] in text


def test_bad_requests_name_the_field(url: str) -> None:
    both = post(url, "/tokenize", {"prompt": "x", "messages": CHAT})
    assert both.status_code == 400 and both.json()["error"]["param"] == "prompt"
    outside = post(url, "/detokenize", {"tokens": [10**9]})
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "tokens"
    no_turns = post(url, "/tokenize", {"messages": []})  # as chat refuses them
    assert no_turns.status_code == 400 and no_turns.json()["error"]["param"] == "messages"


def test_reset_prefix_cache_makes_the_next_request_start_cold(url: str) -> None:
    """vLLM's POST /reset_prefix_cache, which `loom bench run --reset-prefix-cache` sends
    between repeats: the prompt cached a moment before is computed again."""
    prompt = "A prefix long enough to fill several KV blocks, said twice. " * 6
    post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    warm = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 1}).json()
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert post(url, "/reset_prefix_cache", {}).status_code == 200
    cold = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 1}).json()
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 1}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # cached anew


def test_cached_tokens_and_continuous_usage(url: str) -> None:
    """A repeated prompt is served from the prefix cache, and says so; with
    continuous_usage_stats every chunk carries the usage so far."""
    prompt = "Once upon a time, in a land far away, there lived a " * 8
    first = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 2}).json()
    again = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 2}).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached <= again["usage"]["prompt_tokens"]
    with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
            "prompt": "Hello", "max_tokens": 4, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
    usages = [httpx.Response(200, content=e).json()["usage"] for e in events]
    assert all(u is not None for u in usages)
    counts = [u["completion_tokens"] for u in usages]  # a reader behind gets fewer chunks
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-2:] == [4, 4]


def test_echo_of_a_token_id_prompt_agrees_with_its_text_offsets(url: str) -> None:
    """Special tokens and characters split across tokens included: each token's offset is
    where its text starts in the echoed text."""
    text = "<|im_start|>user\nCafé 🙂 日本<|im_end|>"
    ids = post(url, "/tokenize", {"prompt": text}).json()["tokens"]
    echoed = post(url, "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True,
                                           "logprobs": 1}).json()["choices"][0]
    assert echoed["text"] == text
    offsets = echoed["logprobs"]["text_offset"]
    assert len(offsets) == len(ids) and offsets[0] == 0 and offsets == sorted(offsets)
    for i, offset in enumerate(offsets):
        before = post(url, "/detokenize", {"tokens": ids[:i]}).json()["prompt"]
        if not before.endswith("\ufffd"):  # a token inside a character starts nowhere
            assert offset == len(before)
