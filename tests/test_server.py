"""`loom serve` end to end: a real server process on loopback, real clients (the official
`openai` package and raw httpx), the bundled SmolLM2-135M-Instruct."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from server_helpers import serve

from loom import LLM, SamplingParams
from loom.bench.scrape import sample_value as metric

pytestmark = pytest.mark.integration

PROMPT = "The three primary colors are"
CHAT = [{"role": "user", "content": "Name a fruit that is yellow."}]


@pytest.fixture(scope="module")
def server() -> str:
    with serve("--kv-cache-memory", "512MiB") as url:
        yield url


@pytest.fixture(scope="module")
def async_server() -> str:
    with serve("--kv-cache-memory", "256MiB", "--async-scheduling") as url:
        yield url


@pytest.fixture(scope="module")
def limited_server() -> str:
    """Two sequences at a time, two waiting at most, 4 s in the queue at most."""
    with serve("--kv-cache-memory", "128MiB", "--max-num-seqs", "2",
               "--max-num-queued-reqs", "2", "--queue-timeout", "4",
               "--stream-interval", "4") as url:
        yield url


@pytest.fixture(scope="module")
def reference() -> LLM:
    """The offline engine, for the answers the server must reproduce."""
    return LLM(kv_cache_memory="64MiB")


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def scrape(url: str) -> str:
    return httpx.get(f"{url}/metrics").text


def wait_idle(url: str, timeout: float = 30.0) -> str:
    """/metrics once nothing runs and no KV block is held by a live request."""
    deadline = time.monotonic() + timeout
    while True:
        text = scrape(url)
        if (metric(text, "loom:num_requests_running") == 0
                and metric(text, "loom:kv_cache_usage_perc") == 0):
            return text
        assert time.monotonic() < deadline, "server did not go idle"
        time.sleep(0.1)


# -- the official client, compared with the offline engine ----------------------------------------


def test_completions_match_offline(client: openai.OpenAI, reference: LLM) -> None:
    expected = reference.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0))[0]
    model = client.models.list().data[0].id

    answer = client.completions.create(model=model, prompt=PROMPT, max_tokens=16,
                                       temperature=0)
    assert answer.choices[0].text == expected.outputs[0].text
    assert answer.choices[0].finish_reason == expected.outputs[0].finish_reason
    assert answer.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert answer.usage.completion_tokens == len(expected.outputs[0].token_ids)

    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=16,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.outputs[0].text
    assert chunks[-1].usage.completion_tokens == len(expected.outputs[0].token_ids)

    by_ids = client.completions.create(model=model, prompt=expected.prompt_token_ids,
                                       max_tokens=16, temperature=0)
    assert by_ids.choices[0].text == expected.outputs[0].text


def test_chat_matches_offline(client: openai.OpenAI, reference: LLM) -> None:
    expected = reference.chat(CHAT, SamplingParams(max_tokens=24, temperature=0))[0]
    model = client.models.list().data[0].id

    answer = client.chat.completions.create(model=model, messages=CHAT, max_tokens=24,
                                            temperature=0)
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == expected.outputs[0].text
    assert answer.usage.prompt_tokens == len(expected.prompt_token_ids)

    chunks = list(client.chat.completions.create(
        model=model, messages=CHAT, max_completion_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.outputs[0].text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == expected.outputs[0].finish_reason
    assert chunks[-1].usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_sampling_options(client: openai.OpenAI, reference: LLM) -> None:
    greedy = reference.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0))[0]
    words = greedy.outputs[0].text.split()
    stop = words[len(words) // 2]
    stopped = client.completions.create(model="any", prompt=PROMPT, max_tokens=16,
                                        temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert greedy.outputs[0].text.startswith(stopped.choices[0].text)
    assert stop not in stopped.choices[0].text

    extra = {"ignore_eos": True, "min_tokens": 2, "top_k": 20, "priority": 3}
    seeded = [client.completions.create(model="any", prompt=PROMPT, max_tokens=6, n=2,
                                        temperature=1.0, top_p=0.9, seed=7, extra_body=extra)
              for _ in range(2)]
    assert [c.index for c in seeded[0].choices] == [0, 1]
    assert [c.text for c in seeded[0].choices] == [c.text for c in seeded[1].choices]
    assert seeded[0].usage.completion_tokens == 12

    batch = client.completions.create(model="any", prompt=[[504, 3458], [19556, 314]],
                                      max_tokens=3, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]


def test_logprobs_and_echo_score_the_prompt(client: openai.OpenAI, reference: LLM) -> None:
    """What lm-eval's local-completions sends: echo + logprobs with max_tokens 1 (or 0)."""
    prompt = "Paris is the capital of"  # under one KV block: no prefix-cache hit between calls
    expected = reference.generate(prompt, SamplingParams(max_tokens=1, temperature=0,
                                                         prompt_logprobs=1))[0]
    num_prompt = len(expected.prompt_token_ids)

    scored = client.completions.create(model="any", prompt=prompt, max_tokens=1, echo=True,
                                       logprobs=1, temperature=0)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text.startswith(prompt)
    assert len(lp.tokens) == len(lp.token_logprobs) == num_prompt + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [e.logprob for e in expected.prompt_logprobs[1:]]
    assert lp.token_logprobs[1:num_prompt] == pytest.approx(want, abs=1e-3)
    assert all(lp.tokens[i] in lp.top_logprobs[i] for i in range(1, num_prompt + 1))
    assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())  # greedy: the top one

    prompt_only = client.completions.create(model="any", prompt=prompt, max_tokens=0,
                                            echo=True, logprobs=1)
    assert prompt_only.choices[0].text == prompt
    assert prompt_only.choices[0].logprobs.token_logprobs[1:] == pytest.approx(
        lp.token_logprobs[1:num_prompt], abs=1e-5)
    assert prompt_only.usage.completion_tokens == 0

    chat = client.chat.completions.create(model="any", messages=CHAT, max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= t.top_logprobs[0].logprob + 1e-6
               for t in content)


def test_logprobs_rebuild_characters_split_across_tokens(client: openai.OpenAI) -> None:
    """Emoji and CJK characters take several byte-level tokens, each of which reads as U+FFFD
    on its own: chat's `bytes` are each token's own bytes, which join into the answer, and
    completions' text_offset counts characters of the returned text (once past its end)."""
    text = "🌟日本"
    chat = client.chat.completions.create(
        model="any", messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
        top_logprobs=1, extra_body={"guided_regex": text})
    content = chat.choices[0].logprobs.content
    assert chat.choices[0].message.content == text
    assert any(t.token == "\ufffd" for t in content)  # split characters, as tokens show them
    assert b"".join(bytes(t.bytes) for t in content) == text.encode()

    prompt = "héllo 🌟 日本語"
    for stream in (False, True):
        answer = client.completions.create(model="any", prompt=prompt, max_tokens=6,
                                           echo=True, logprobs=0, temperature=0,
                                           stream=stream, extra_body={"guided_regex": "🌟+"})
        parts = list(answer) if stream else [answer]
        whole = "".join(p.choices[0].text for p in parts)
        offsets = [o for p in parts if p.choices[0].logprobs
                   for o in p.choices[0].logprobs.text_offset]
        assert whole.startswith(prompt) and "🌟" in whole[len(prompt):]
        assert offsets == sorted(offsets) and offsets[-1] < len(whole)
        assert offsets[:2] == [0, 1] and len(prompt) in offsets  # the answer's first token


def test_logit_bias_is_honoured_as_openai_sends_it(client: openai.OpenAI, server: str) -> None:
    comma = httpx.post(f"{server}/tokenize", json={"prompt": ","}).json()["tokens"][-1]
    chat = client.chat.completions.create(model="any", messages=CHAT, max_tokens=4,
                                          temperature=0, logit_bias={str(comma): 100})
    assert chat.choices[0].message.content == ",,,,"


def test_echo_logprobs_survive_prefix_cache_hits(client: openai.OpenAI) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 4  # several full KV blocks
    first, second = (client.completions.create(model="any", prompt=prompt, max_tokens=1,
                                               echo=True, logprobs=1, temperature=0)
                     for _ in range(2))
    assert second.choices[0].logprobs.token_logprobs[1:] == pytest.approx(
        first.choices[0].logprobs.token_logprobs[1:], abs=1e-4)


def test_models_health_version_metrics(server: str) -> None:
    models = httpx.get(f"{server}/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["max_model_len"] > 0
    assert httpx.get(f"{server}/health").status_code == 200
    assert httpx.get(f"{server}/version").json()["version"]
    text = scrape(server)
    for name in ("loom:num_requests_running", "loom:kv_cache_usage_perc",
                 "loom:request_rejected_total"):
        metric(text, name)


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/version", "/metrics"])
def test_head_answers_like_get_without_a_body(server: str, path: str) -> None:
    get, head = httpx.get(f"{server}{path}"), httpx.head(f"{server}{path}")
    assert head.status_code == get.status_code == 200
    assert head.headers.get("content-type") == get.headers.get("content-type")
    assert head.content == b""


def test_tool_call_parser_is_a_server_flag(reference: LLM) -> None:
    from loom.cli.main import parse_args
    from loom.cli.serve import server_config
    from loom.engine.async_engine import AsyncEngine
    from loom.entrypoints.openai.server import build_app
    from loom.entrypoints.openai.tool_parsers import TOOL_PARSERS

    config = server_config(parse_args(["serve", "--tool-call-parser", "mistral"]))
    assert config.tool_call_parser == "mistral"
    with pytest.raises(SystemExit):
        parse_args(["serve", "--tool-call-parser", "nonsense"])
    app = build_app(AsyncEngine(reference.engine), config)  # built, never started
    assert app.title == "loom"
    chat = next(r for r in app.routes if getattr(r, "path", "") == "/v1/chat/completions")
    serving = chat.endpoint.__code__.co_freevars  # the route closes over its ChatServing
    assert "chat" in serving
    cell = chat.endpoint.__closure__[serving.index("chat")].cell_contents
    assert isinstance(cell.tool_parser, TOOL_PARSERS["mistral"])


# -- continuous batching through HTTP -------------------------------------------------------------


@pytest.mark.parametrize("which", ["server", "async_server"])
def test_concurrent_streams_are_batched(which: str, request: pytest.FixtureRequest) -> None:
    """32 streams at once: each gets exactly max_tokens tokens, and /metrics saw them run
    together (more than one request in a step), then nothing running; with and without async
    scheduling."""
    server = request.getfixturevalue(which)
    max_tokens, num_requests = 12, 32
    client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)

    async def one(i: int) -> tuple[int, str]:
        stream = await client.completions.create(
            model="any", prompt=f"Request number {i} says", max_tokens=max_tokens,
            temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        usage, finish = None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        return usage, finish

    async def scrape_while(done: asyncio.Event) -> float:
        most = 0.0
        async with httpx.AsyncClient() as http:
            while not done.is_set():
                text = (await http.get(f"{server}/metrics")).text
                most = max(most, metric(text, "loom:num_requests_running"))
                await asyncio.sleep(0.05)
        return most

    async def run() -> tuple[list[tuple[int, str]], float]:
        done = asyncio.Event()
        scraper = asyncio.create_task(scrape_while(done))
        results = await asyncio.gather(*(one(i) for i in range(num_requests)))
        done.set()
        return results, await scraper

    results, most_running = asyncio.run(run())
    assert results == [(max_tokens, "length")] * num_requests
    assert most_running > 1
    idle = wait_idle(server)
    assert metric(idle, "loom:num_requests_running") == 0
    assert metric(idle, "loom:model_forward_seconds_count") >= max_tokens
    assert metric(idle, "loom:model_idle_seconds_count") >= max_tokens - 2


def test_disconnect_mid_stream_aborts(server: str, client: openai.OpenAI) -> None:
    aborted = metric(scrape(server), "loom:request_success_total", finished_reason="abort")
    body = {"prompt": "Tell me a long story", "max_tokens": 4000, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert [next(lines) for _ in range(6)]  # a few tokens in: the request is running
    with pytest.raises(httpx.TimeoutException):  # a non-streamed request the client gives up on
        httpx.post(f"{server}/v1/completions", json={**body, "stream": False}, timeout=1.0)
    text = wait_idle(server)
    assert metric(text, "loom:request_success_total", finished_reason="abort") == aborted + 2
    answer = client.completions.create(model="any", prompt=PROMPT, max_tokens=2)
    assert answer.choices[0].text


# -- bad input: a 400 naming the field; the server goes on ----------------------------------------


TOO_LONG = list(range(100, 100 + 8200))  # beyond the model's 8192-token context

BAD_REQUESTS = [
    ("completions", b'{"prompt": "hi", "max_tokens": ', None),
    ("completions", {"max_tokens": 4}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": 42}, "prompt"),
    ("completions", {"prompt": TOO_LONG, "max_tokens": 1}, "prompt"),
    ("completions", {"prompt": [10**9]}, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 10**6}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ("completions", {"prompt": "hi", "temperature": -0.5}, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("completions", {"prompt": "hi", "stop": 3}, "stop"),
    ("completions", {"prompt": "hi", "n": 0}, "n"),
    ("completions", {"prompt": [[1, 2]] * 65, "n": 128}, "prompt"),  # 8320 sequences
    ("completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
    ("completions", {"prompt": "hi", "stream": "sometimes"}, "stream"),
    ("completions", {"prompt": "hi", "min_tokens": 9, "max_tokens": 2}, "min_tokens"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"max_tokens": 4}, "messages"),
    ("chat/completions", {"messages": [{"content": "no role"}]}, "messages"),
    ("chat/completions", {"messages": "hello"}, "messages"),
    ("chat/completions", {"messages": CHAT, "max_completion_tokens": 0},
     "max_completion_tokens"),
    ("chat/completions", {"messages": CHAT, "temperature": "warm"}, "temperature"),
    ("chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    # once 500s: values that failed inside the model step, or in the tokenizer
    ("completions", {"prompt": "hi", "seed": 2**64}, "seed"),
    ("completions", {"prompt": "hi", "top_k": 2**63}, "top_k"),
    ("completions", {"prompt": "hi", "top_k": 10**6}, "top_k"),  # beyond the vocabulary
    ("completions", {"prompt": [1, -1]}, "prompt"),
    ("completions", {"prompt": [2**32]}, "prompt"),
    ("completions", {"prompt": "\ud800x"}, "prompt"),
    ("completions", {"prompt": ["ok", "\udfff"]}, "prompt"),
    ("chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a\udc00"}]}]}, "messages"),
    # lone surrogates anywhere: fields that reach the template, ignored ones, object keys
    ("chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "description": "\ud800"}}]}, "tools"),
    ("chat/completions", {"messages": [{"role": "assistant", "tool_calls": [{
        "id": "c", "type": "function", "function": {"name": "f\ud800", "arguments": "{}"}}]},
        *CHAT]}, "messages"),
    ("completions", {"prompt": "hi", "user": "\udbff"}, "user"),
    ("completions", {"prompt": "hi", "stop": ["x", "\ud800"]}, "stop"),
    ("completions", {"prompt": "hi", "metadata": {"\ud800": 1}}, "metadata"),
    ("chat/completions", {"messages": CHAT, "stream_options": {"include_usage": True}},
     "stream_options"),  # without stream, as OpenAI and vLLM refuse it
    # once ignored whatever they held
    ("completions", {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {"10000000": 1}}, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {"5": 200}}, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": 5}, "logit_bias"),
    ("chat/completions", {"messages": CHAT, "presence_penalty": "x"}, "presence_penalty"),
    ("chat/completions", {"messages": CHAT, "frequency_penalty": -3}, "frequency_penalty"),
    ("chat/completions", {"messages": CHAT, "tools": [
        {"type": "function", "function": {"name": "f"}},
        {"type": "function", "function": {"name": "f"}}]}, "tools"),  # calls name them
    ("chat/completions", {"messages": CHAT, "tools": [
        {"type": "function", "function": {"name": ""}}]}, "tools"),
    # once accepted
    ("completions", {"prompt": "hi", "temperature": float("inf")}, "temperature"),
    ("completions", {"prompt": [True, False]}, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ("completions", {"prompt": "hi", "stop_token_ids": [2**40]}, "stop_token_ids"),
    ("completions", {"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
    ("completions", {"prompt": "hi", "stop": ""}, "stop"),
    ("completions", {"prompt": "hi", "stop": ["end", ""]}, "stop"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("chat/completions", {"messages": CHAT, "max_tokens": 0}, "max_tokens"),
    ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
]


@pytest.mark.parametrize(("endpoint", "body", "param"), BAD_REQUESTS)
def test_bad_input_is_400(server: str, endpoint: str, body: dict | bytes,
                          param: str | None) -> None:
    url = f"{server}/v1/{endpoint}"
    if not isinstance(body, bytes):  # as a client writes it: Infinity, lone surrogates as \u
        body = json.dumps({**body, "unknown_field": {"ignored": True}}).encode()
    response = httpx.post(url, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] is None
    assert error["param"] == param
    assert (param or "JSON") in error["message"]


def test_server_survives_bad_input(client: openai.OpenAI) -> None:
    assert client.completions.create(model="any", prompt=PROMPT, max_tokens=2).choices[0].text


# -- admission control, on a server that holds 2 running + 2 waiting ------------------------------


def test_burst_over_queue_limit_gets_503(limited_server: str) -> None:
    """20 at once into 2 slots and 2 queue places: some are served, the rest refused at the
    door (503 with Retry-After, never run by the engine), each counted once."""
    before = scrape(limited_server)

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=limited_server, timeout=120) as http:
            body = {"prompt": "Count to ten:", "max_tokens": 4, "ignore_eos": True}
            return await asyncio.gather(*(http.post("/v1/completions", json=body)
                                          for _ in range(20)))

    responses = asyncio.run(burst())
    rejected = [r for r in responses if r.status_code == 503]
    accepted = [r for r in responses if r.status_code == 200]
    assert rejected and accepted and len(rejected) + len(accepted) == 20
    for r in rejected:
        assert r.headers["retry-after"].isdigit()
        assert r.json()["error"]["type"] == "service_unavailable_error"
    assert all(r.json()["usage"]["completion_tokens"] == 4 for r in accepted)
    after = wait_idle(limited_server)
    assert (metric(after, "loom:request_rejected_total")
            - metric(before, "loom:request_rejected_total")) == len(rejected)
    ran = (metric(after, "loom:request_success_total", finished_reason="length")
           - metric(before, "loom:request_success_total", finished_reason="length"))
    assert ran == len(accepted)  # the refused ones never reached the engine


def test_queue_timeout_gets_503(limited_server: str) -> None:
    """Both sequence slots busy with long requests: a third waits 4 s, then is turned away,
    and counts once: as rejected, not also as aborted."""
    before = scrape(limited_server)
    rejected = metric(before, "loom:request_rejected_total")
    aborted = metric(before, "loom:request_success_total", finished_reason="abort")
    body = {"prompt": "Write an essay", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=limited_server, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as a, \
                http.stream("POST", "/v1/completions", json=body) as b:
            lines = a.iter_lines(), b.iter_lines()  # held: dropping one closes its stream
            assert [next(it) for it in lines]  # both running
            started = time.monotonic()
            late = http.post("/v1/completions", json={**body, "stream": True})
            waited = time.monotonic() - started
    assert late.status_code == 503 and "retry-after" in late.headers
    assert "queue" in late.json()["error"]["message"]
    assert waited >= 3.5
    text = wait_idle(limited_server)
    assert metric(text, "loom:request_rejected_total") == rejected + 1
    # the two streams we dropped are the only aborts
    assert metric(text, "loom:request_success_total", finished_reason="abort") == aborted + 2


def test_stream_interval_groups_tokens(limited_server: str) -> None:
    body = {"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "temperature": 0}
    whole = httpx.post(f"{limited_server}/v1/completions", json=body).json()
    with httpx.stream("POST", f"{limited_server}/v1/completions",
                      json={**body, "stream": True}) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) <= 3  # 8 tokens, 4 per chunk (one more if a chunk held back text)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]


def test_default_max_tokens_fits_a_small_kv_cache(limited_server: str) -> None:
    """No max_tokens: the budget is the context left, capped to what the KV cache holds
    (128 MiB here, less than the 8192-token context), so the engine does not refuse it."""
    body = {"messages": [{"role": "user", "content": "Reply with one word: yes or no?"}],
            "temperature": 0}
    response = httpx.post(f"{limited_server}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "stop"


# -- generated input: whatever the schema allows, never a 5xx -------------------------------------


def _bounded(body: object) -> None:
    """Keep generated requests cheap to serve (a few tokens, a few choices) while leaving the
    values that must be refused (negative, huge, wrong type) as they are."""
    if not isinstance(body, dict):
        return
    budgets = ("max_tokens", "max_completion_tokens", "max_output_tokens")
    if all(body.get(name) is None for name in budgets):  # (each endpoint ignores the others)
        body["max_tokens"] = body["max_output_tokens"] = 4  # none: the context's room
    for name, cap in (*((budget, 4) for budget in budgets), ("n", 2)):
        value = body.get(name)
        if type(value) is int and cap < value <= 10_000:
            body[name] = cap


@pytest.mark.parametrize("mode", ["positive", "negative"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_schema_generated_requests_never_get_5xx(server: str, path: str, mode: str) -> None:
    """Bodies schemathesis draws from the server's own /openapi.json, valid ones and ones
    that break it, bounded in number: each is answered below 500, and the server still
    serves after."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.generation import GenerationMode

    operation = schemathesis.openapi.from_url(f"{server}/openapi.json")[path]["POST"]
    statuses: list[int] = []

    @settings(max_examples=30, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(operation.as_strategy(GenerationMode(mode)))
    def one(case: schemathesis.Case) -> None:
        _bounded(case.body)
        response = case.call(base_url=server, timeout=120)  # sent as schemathesis encodes it
        statuses.append(response.status_code)
        assert response.status_code < 500, (case.body, response.text)

    one()
    assert len(statuses) > 1
    answer = httpx.post(f"{server}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"]
