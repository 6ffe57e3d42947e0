"""`loom serve` against an attacker and an unlucky user: API keys, Host and CORS checks, body
limits, admission that counts what it admits, errors before the model loads, a quiet access
log. A real server process on loopback, real clients."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from server_helpers import serve_process

from loom.bench.scrape import sample_value as metric

pytestmark = pytest.mark.integration

KEY = "test-key-0123"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY = {"prompt": "Count to ten:", "max_tokens": 2, "ignore_eos": True}


@pytest.fixture(scope="module")
def guarded():
    """8 sequence slots and room for 4 waiting; a key from the environment; one allowed
    origin; bodies up to 300 kB."""
    with serve_process("--kv-cache-memory", "128MiB", "--max-num-seqs", "8",
                       "--max-num-queued-reqs", "4", "--allowed-origins", "http://good.example",
                       "--max-request-body-bytes", "300000",
                       env={"LOOM_API_KEY": KEY}) as server:
        yield server


def scrape(url: str) -> str:
    return httpx.get(f"{url}/metrics").text


# -- security ------------------------------------------------------------------------------------


def test_api_key_is_required_on_v1_only(guarded) -> None:
    url = guarded.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        refused = httpx.post(f"{url}/v1/completions", json=BODY, headers=headers)
        assert refused.status_code == 401, refused.text
        assert refused.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{url}/v1/models").status_code == 401
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(f"{url}{path}").status_code == 200

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    answer = client.completions.create(model="any", prompt=BODY["prompt"], max_tokens=2)
    assert answer.choices[0].text
    stranger = openai.OpenAI(base_url=f"{url}/v1", api_key="guess", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()


@pytest.mark.parametrize(("host", "status"), [
    ("attacker.example", 400), ("attacker.example:8000", 400), ("127.0.0.1.evil.example", 400),
    ("localhost", 200), ("127.0.0.1:8000", 200), ("[::1]:8000", 200)])
def test_host_header_must_name_loopback(guarded, host: str, status: int) -> None:
    """DNS rebinding: a page on attacker.example resolved to 127.0.0.1 still sends its own
    name as Host; on a loopback bind only loopback names are answered."""
    response = httpx.get(f"{guarded.url}/health", headers={"Host": host})
    assert response.status_code == status


def test_cors_answers_allowed_origins_only(guarded) -> None:
    def preflight(origin: str) -> httpx.Response:
        return httpx.options(f"{guarded.url}/v1/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})

    allowed = preflight("http://good.example")
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "http://good.example"
    assert "access-control-allow-origin" not in preflight("http://evil.example").headers
    answer = httpx.post(f"{guarded.url}/v1/completions", json=BODY,
                        headers={**AUTH, "Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in answer.headers


# -- limits ----------------------------------------------------------------------------------------


def test_body_over_the_limit_is_413(guarded) -> None:
    big = {"prompt": "x" * 400_000}
    announced = httpx.post(f"{guarded.url}/v1/completions", json=big, headers=AUTH)
    assert announced.status_code == 413, announced.text
    assert "max-request-body-bytes" in announced.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit holds while reading
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"x" * 10_000
        yield b'"}'

    chunked = httpx.post(f"{guarded.url}/v1/completions", content=chunks(),
                         headers={**AUTH, "content-type": "application/json"})
    assert chunked.status_code == 413
    assert httpx.post(f"{guarded.url}/v1/completions", json=BODY,
                      headers=AUTH).status_code == 200


def test_a_client_that_leaves_before_its_body_is_read_is_counted(guarded) -> None:
    """Its request never reaches the engine, so only the server can count it: /metrics still
    accounts for every request a client started (a timed-out client on a busy server)."""
    def abandoned() -> float:
        return metric(scrape(guarded.url), "loom:http_requests_abandoned_total")

    before = abandoned()
    host, port = guarded.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                     b'{"prompt": ')
    deadline = time.monotonic() + 30
    while abandoned() == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert abandoned() == before + 1
    assert httpx.post(f"{guarded.url}/v1/completions", json=BODY, headers=AUTH).status_code == 200


# -- admission -------------------------------------------------------------------------------------


def test_burst_fills_free_slots_before_the_queue(guarded) -> None:
    """60 at once into an idle server with 8 slots and 4 queue places: at least 12 are
    served (arrivals that find a free slot are not "waiting"); every answer is 200 or 503,
    and each 503 counts once in /metrics."""
    rejected_before = metric(scrape(guarded.url), "loom:request_rejected_total")

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=guarded.url, headers=AUTH, timeout=300) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=BODY)
                                          for _ in range(60)))

    statuses = [r.status_code for r in asyncio.run(burst())]
    assert set(statuses) <= {200, 503}
    assert statuses.count(200) >= 12
    rejected = metric(scrape(guarded.url), "loom:request_rejected_total") - rejected_before
    assert rejected == statuses.count(503)


def test_many_prompts_times_n_are_refused_whole(guarded) -> None:
    """40 prompts x n=3 are 120 engine requests: more than 8 slots + 4 queue places could
    ever take, so the request is refused at once with a 400 (a retry would never succeed),
    and none of it runs; it is no overload, so no rejection is counted."""
    before = scrape(guarded.url)
    refused = httpx.post(f"{guarded.url}/v1/completions", headers=AUTH, json={
        "prompt": [f"Prompt number {i}" for i in range(40)], "n": 3, "max_tokens": 2})
    assert refused.status_code == 400 and "retry-after" not in refused.headers
    assert "max_num_queued_reqs=4" in refused.json()["error"]["message"]
    after = scrape(guarded.url)
    assert (metric(after, "loom:request_rejected_total")
            == metric(before, "loom:request_rejected_total"))
    assert (metric(after, "loom:prompt_tokens_total")
            == metric(before, "loom:prompt_tokens_total"))


# -- the log and the start-up ----------------------------------------------------------------------


def test_access_log_skips_health_and_metrics(guarded) -> None:
    for path in ("/health", "/metrics", "/health?probe=1"):
        httpx.get(f"{guarded.url}{path}")
    httpx.get(f"{guarded.url}/version")
    log = guarded.log_path.read_text()
    assert '"GET /version HTTP/1.1" 200' in log
    assert "GET /health" not in log and "GET /metrics" not in log


def _serve_and_fail(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loom.cli", "serve", *flags],
                          capture_output=True, text=True, timeout=300)


def test_port_in_use_fails_before_the_model_loads() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        failed = _serve_and_fail("--port", str(port))
    assert failed.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in failed.stderr
    assert "in use" in failed.stderr
    assert "loaded" not in failed.stderr  # the model loader never ran


def test_bad_server_flag_fails_before_the_model_loads() -> None:
    failed = _serve_and_fail("--read-timeout", "0")
    assert failed.returncode != 0 and "read_timeout must be > 0" in failed.stderr
    assert "loaded" not in failed.stderr
