"""Soak `loom serve`: many requests over both endpoints, streamed and not, in bursts at several
times capacity, with clients that disconnect or give up, against a KV cache small enough to
preempt; a share of the chat requests carry a JSON schema, a choice, a regex or tools.
Then check that nothing was lost or leaked:

- no 5xx, no stream without [DONE], no error event: every request is answered, or refused
  with 503, or was given up by its own client;
- /metrics counts every request once: stop + length + abort + rejected = requests sent;
- nothing runs or waits at the end and no KV block is held (usage 0);
- the server's RSS after warm-up and at the end (flat: no leak per request).

    flock /tmp/loom-bench.lock .venv/bin/python benchmarks/server/soak.py -n 10000

`tests/test_soak.py` runs a few hundred requests of the same soak.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

# A server small enough to preempt and to refuse: 8 sequences, 8 waiting, 32 KV blocks.
SERVER_FLAGS = ("--num-kv-blocks", "32", "--max-num-seqs", "8", "--max-num-queued-reqs", "8",
                "--queue-timeout", "20")
CAPACITY = 8 + 8  # running + waiting
BURST = 5 * CAPACITY
DISCONNECT_SHARE, TIMEOUT_SHARE = 0.10, 0.05
CLIENT_TIMEOUT_S = 0.5
WORDS = ("river", "lamp", "orbit", "seven", "quiet", "garden", "copper", "window", "story")
# Chat requests that also carry a constraint or tools (compiled in the server's check
# processes and the engine's compile pool, cached after the first), a share of them.
STRUCTURED_SHARE = 0.3
_TOOLS = [{"type": "function", "function": {
    "name": "lookup", "parameters": {"type": "object", "required": ["word"],
                                     "properties": {"word": {"type": "string", "maxLength": 12},
                                                    "count": {"type": "integer"}}}}}]
STRUCTURED = (
    {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {
        "type": "object", "required": ["word", "score"],
        "properties": {"word": {"enum": list(WORDS)}, "score": {"type": "number"},
                       "tags": {"type": "array", "uniqueItems": True, "maxItems": 2,
                                "items": {"type": "string", "maxLength": 8}}}}}}},
    {"guided_choice": ["yes", "no", "maybe"]},
    {"guided_regex": r"\d{2,4}-[a-z]{3}"},
    {"response_format": {"type": "json_object"}},
    {"tools": _TOOLS, "tool_choice": "required"},
    {"tools": _TOOLS, "tool_choice": {"type": "function", "function": {"name": "lookup"}}},
    {"tools": _TOOLS, "tool_choice": "auto"},
)


@dataclass
class SoakReport:
    sent: int = 0
    outcomes: Counter = field(default_factory=Counter)  # ok / rejected / cancelled / error
    details: Counter = field(default_factory=Counter)  # "behaviour -> outcome (why)"
    errors: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    rss_kib: list[int] = field(default_factory=list)  # after warm-up, at the end
    seconds: float = 0.0

    @property
    def counted(self) -> float:
        return counted(self.metrics)


# The series that count each request once as it ends: finished for any reason, rejected, or
# left by its client before the server read it (a timed-out client on a busy server).
COUNTED_SERIES = ("loom:request_success_total", "loom:request_rejected_total",
                  "loom:http_requests_abandoned_total")


def counted(m: dict[str, float]) -> float:
    """Requests /metrics has seen end, each once."""
    return sum(counted_parts(m).values())


def counted_parts(m: dict[str, float]) -> dict[str, float]:
    """What `counted` adds up, by series: where a miscount is, for a failure to say."""
    return {k: v for k, v in m.items() if k.startswith(COUNTED_SERIES)}


def _metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name{labels other than model_name}: value}."""
    values = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        key, _, value = line.rpartition(" ")
        name, _, labels = key.partition("{")
        kept = [p for p in labels.rstrip("}").split(",") if p and not p.startswith("model_name")]
        values[name + (f"{{{','.join(kept)}}}" if kept else "")] = float(value)
    return values


def _request(rng: random.Random) -> tuple[str, dict, str]:
    """(path, body, what the client does: finish / disconnect / timeout)."""
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))
    body: dict = {"max_tokens": rng.randint(4, 48), "ignore_eos": True,
                  "stream": rng.random() < 0.5, "temperature": rng.choice([0.0, 0.8])}
    if rng.random() < 0.5:
        path, body["prompt"] = "/v1/completions", words
    else:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": words}]
        if rng.random() < STRUCTURED_SHARE:
            body.update(rng.choice(STRUCTURED))
    draw = rng.random()
    behaviour = ("disconnect" if draw < DISCONNECT_SHARE
                 else "timeout" if draw < DISCONNECT_SHARE + TIMEOUT_SHARE else "finish")
    if behaviour == "disconnect":
        body["stream"] = True
    if behaviour == "timeout":
        body["stream"] = False
    return path, body, behaviour


async def _one(http: httpx.AsyncClient, path: str, body: dict, behaviour: str) -> str:
    """The outcome of one request; what went wrong, for an error. A client that times out
    gives up waiting for the answer, after sending its request: with a short connect timeout
    as well, a busy machine's client gave up on connecting, now and then, before the server
    had anything to count."""
    timeout = (httpx.Timeout(600.0, read=CLIENT_TIMEOUT_S) if behaviour == "timeout"
               else 600.0)
    try:
        if not body["stream"]:
            response = await http.post(path, json=body, timeout=timeout)
            return _status(response.status_code, response.text)
        async with http.stream("POST", path, json=body, timeout=timeout) as response:
            if response.status_code != 200:
                return _status(response.status_code, (await response.aread()).decode())
            last = ""
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if behaviour == "disconnect":
                    return "cancelled: left the stream"  # leaving the block closes it
                if '"error"' in line[:20]:
                    return f"error: stream error event {line[:200]}"
                last = line
            return "ok" if last == "data: [DONE]" else "error: stream ended without [DONE]"
    except httpx.TimeoutException as e:  # which phase: a request never written never arrived
        return (f"cancelled: {type(e).__name__}" if behaviour == "timeout"
                else "error: client timed out")
    except httpx.HTTPError as e:
        return f"error: {e!r}"


def _status(code: int, text: str) -> str:
    return {200: "ok", 503: "rejected"}.get(code, f"error: {code} {text[:200]}")


def _rss_kib(pid: int) -> int:
    from loom.bench.sysinfo import process_memory

    mem = process_memory(pid)
    return mem["rss_bytes"] // 1024 if mem else 0


async def soak(url: str, num_requests: int, server_pid: int | None = None,
               seed: int = 0) -> SoakReport:
    """Send `num_requests` in bursts of BURST at once; then wait for the server to go idle
    and read its /metrics."""
    rng, report, start = random.Random(seed), SoakReport(), time.monotonic()
    warm_up = max(BURST, num_requests // 10)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=BURST)
    async with httpx.AsyncClient(base_url=url, limits=limits) as http:
        while report.sent < num_requests:
            wave = [_request(rng) for _ in range(min(BURST, num_requests - report.sent))]
            results = await asyncio.gather(*(_one(http, *r) for r in wave))
            report.sent += len(wave)
            for (_, _, behaviour), outcome in zip(wave, results, strict=True):
                report.outcomes[outcome.split(":")[0]] += 1
                report.details[f"{behaviour} -> {outcome[:60]}"] += 1
                if outcome.startswith("error"):
                    report.errors.append(outcome)
            if server_pid is not None and not report.rss_kib and report.sent >= warm_up:
                report.rss_kib.append(_rss_kib(server_pid))
        report.metrics = await _idle_metrics(http, report.sent)
    if server_pid is not None:
        report.rss_kib.append(_rss_kib(server_pid))
    report.seconds = time.monotonic() - start
    return report


async def _idle_metrics(http: httpx.AsyncClient, sent: int, timeout_s: float = 120.0
                        ) -> dict[str, float]:
    """/metrics once nothing runs or waits and every request sent has ended (a handler whose
    client gave up early may still be on its way to the engine)."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = _metrics((await http.get("/metrics")).text)
        idle = (values["loom:num_requests_running"] == 0
                and values["loom:num_requests_waiting"] == 0
                and values["loom:kv_cache_usage_perc"] == 0 and counted(values) >= sent)
        if idle or time.monotonic() > deadline:
            return values
        await asyncio.sleep(0.2)


def markdown(report: SoakReport) -> str:
    m = report.metrics
    rss = (f"{report.rss_kib[0] / 1024:.0f} MiB after warm-up, {report.rss_kib[-1] / 1024:.0f}"
           f" MiB at the end" if len(report.rss_kib) == 2 else "not measured")
    rows = [
        ("requests sent", report.sent),
        ("answered (200, streams ended with [DONE])", report.outcomes["ok"]),
        ("refused with 503", report.outcomes["rejected"]),
        ("given up by their client (disconnect / timeout)", report.outcomes["cancelled"]),
        ("errors (5xx, error events, lost)", report.outcomes["error"]),
        ("counted in /metrics (stop + length + abort + error + rejected + abandoned)",
         int(report.counted)),
        ("preemptions", int(m.get("loom:num_preemptions_total", 0))),
        ("KV cache usage at the end", m.get("loom:kv_cache_usage_perc")),
        ("running / waiting at the end", f"{m.get('loom:num_requests_running'):.0f} / "
                                          f"{m.get('loom:num_requests_waiting'):.0f}"),
        ("server RSS", rss),
        ("wall time", f"{report.seconds:.0f} s"),
    ]
    return "\n".join(["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--num-requests", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from loom import host
    from loom.bench.server import LOOM_SERVE, LocalServer

    with tempfile.TemporaryDirectory() as tmp, LocalServer(
            LOOM_SERVE, " ".join(SERVER_FLAGS), Path(tmp) / "serve.log", 600) as server:
        report = asyncio.run(soak(server.url, args.num_requests, server.pid, args.seed))
    print(f"host: {host.describe()}\ndate: {time.strftime('%Y-%m-%d %H:%M')}\n"
          f"server flags: {' '.join(SERVER_FLAGS)}\n")
    print(markdown(report))
    for error in report.errors[:20]:
        print(error)


if __name__ == "__main__":
    main()
