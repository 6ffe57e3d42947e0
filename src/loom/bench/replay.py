"""Replay a trace against an OpenAI-compatible server and produce one run result.

The client sends each request when the arrival process says (open loop) or when one of its
N users is free (closed loop), streams every response, and meanwhile samples the server's
/metrics, its own in-flight count and, for a local server, the server's memory: the
timeline the plots and `loom diagnose` read.
"""

from __future__ import annotations

import asyncio
import gc
import math
import time
from dataclasses import dataclass
from typing import Any, Literal

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from loom.bench.client import ENDPOINTS, send
from loom.bench.scrape import Snapshot, parse_metrics, server_figures
from loom.bench.sysinfo import hardware, process_memory
from loom.config import base_url_field, option, server_root
from loom.workload.arrivals import schedule
from loom.workload.load import Load
from loom.workload.monitoring import Sample, ServerMemory, client_figures
from loom.workload.requests import RequestResult
from loom.workload.results import Origin, RunResult, utc_now
from loom.workload.slo import Slo
from loom.workload.trace import Trace, TraceRequest

Endpoint = Literal["completions", "chat", "responses"]  # the keys of client.ENDPOINTS


@dataclass(frozen=True)
class Target:
    """The server under test and how to watch it."""

    CLI_GROUP = "Server under test"

    base_url: str = base_url_field()
    model: str | None = option(None,
        "model name to request; default: the first of the server's /v1/models")
    server_pid: int | None = option(None,
        "pid of a local server, to record its peak memory and command line; default: none "
        "recorded")
    scrape_interval_s: float = option(1.0,
        "seconds between /metrics samples for the timeline", flag="--scrape-interval")
    request_timeout_s: float = option(600.0,
        "seconds before a request counts as failed", flag="--request-timeout")
    endpoint: Endpoint = option("completions",
        "the API to replay on: completions (/v1/completions), chat (/v1/chat/completions, for "
        "servers that offer only chat: each prompt is one user message, so the server's chat "
        "template adds its tokens to every prompt) or responses (/v1/responses, OpenAI's "
        "Responses API that agent frameworks call: each prompt is the input, through the chat "
        "template as well)")

    def __post_init__(self) -> None:
        """Refuse timeouts that could never be met."""
        for flag, value in (("--request-timeout", self.request_timeout_s),
                            ("--scrape-interval", self.scrape_interval_s)):
            if not 0 < value < math.inf:
                raise ValueError(f"{flag} must be > 0 s, got {value:g}")

    @property
    def probe_timeout_s(self) -> float:
        """Seconds to wait for /v1/models, /version or /metrics: never longer than a request
        may take, so a server that never answers is reported in that time."""
        return min(10.0, self.request_timeout_s)

    @property
    def root(self) -> str:
        """The URL without a trailing /v1, which OpenAI clients include but /metrics lacks."""
        return server_root(self.base_url)


async def probe_server(client: httpx.AsyncClient, target: Target) -> dict[str, Any]:
    """What the server says about itself: /version (loom, vLLM), /v1/models, the command line
    of a local server process. Missing endpoints are simply absent."""
    info: dict[str, Any] = {"base_url": target.base_url}
    for key, path in (("version", "/version"), ("models", "/v1/models")):
        try:
            response = await client.get(target.root + path, timeout=target.probe_timeout_s)
            if response.status_code == 200:
                info[key] = response.json()
        except (httpx.HTTPError, ValueError):
            continue
    if target.server_pid:
        try:
            with open(f"/proc/{target.server_pid}/cmdline", "rb") as f:
                info["cmdline"] = [a.decode() for a in f.read().split(b"\0") if a]
        except OSError:
            pass
    return info


def check_reachable(target: Target) -> None:
    """Fail at once, naming the URL, when nothing listens there: otherwise each request
    would fail on its own and the run would end in a scorecard of errors. A URL without
    http(s):// is refused first: every probe would fail and read as "lists no models"."""
    if not target.base_url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url needs http:// or https://, got {target.base_url!r} "
                         "(e.g. http://127.0.0.1:8000)")
    try:
        httpx.get(target.root + "/v1/models", timeout=target.probe_timeout_s)
    except httpx.ConnectError as e:
        what = "connection refused" if "refused" in str(e).lower() else f"cannot connect ({e})"
        raise ConnectionError(f"{what} at {target.base_url}: is the server running "
                              "there?") from None
    except httpx.TimeoutException:
        raise ConnectionError(f"no answer from {target.base_url} within "
                              f"{target.probe_timeout_s:g} s") from None
    except httpx.HTTPError:
        pass  # something answers; the run reports what it does


def reset_prefix_cache(target: Target) -> None:
    """POST /reset_prefix_cache (vLLM's, with VLLM_SERVER_DEV_MODE=1): repeats then start
    from a cold cache. A server without it is told to be restarted instead."""
    try:
        response = httpx.post(target.root + "/reset_prefix_cache", timeout=30)
    except httpx.HTTPError as e:
        raise ConnectionError(f"cannot reset the prefix cache at {target.base_url}: {e}") from None
    if response.status_code >= 400:
        raise ValueError(f"{target.base_url}/reset_prefix_cache answered "
                         f"{response.status_code}: this server cannot reset its prefix cache; "
                         "restart it between repeats (loom bench compare does)")


def model_name(target: Target, server: dict[str, Any]) -> str:
    if target.model:
        return target.model
    models = (server.get("models") or {}).get("data") or []
    if not models:
        raise ValueError(f"{target.base_url} lists no models at /v1/models; pass --model")
    return models[0]["id"]


async def scrape(client: httpx.AsyncClient, target: Target) -> Snapshot | None:
    """The server's /metrics now; None when it has none in a dialect scrape.py knows."""
    try:
        response = await client.get(target.root + "/metrics", timeout=target.probe_timeout_s)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        snap = parse_metrics(response.text)
    except ValueError:
        return None
    return snap if snap.source else None


class _Monitor:
    """Samples /metrics, the client's in-flight count and server memory every interval, and
    how late the client's own event loop wakes up (a starved client's every timestamp is
    late)."""

    LOOP_TICK_S = 0.05

    def __init__(self, client: httpx.AsyncClient, target: Target, has_metrics: bool) -> None:
        self.client, self.target = client, target
        self.start = time.perf_counter()  # reset when sending starts
        self.timeline: list[Sample] = []
        self.in_flight = 0
        self.has_metrics = has_metrics
        self.memory_peak: dict[str, int] | None = None
        self.loop_lags_s: list[float] = []
        self.client_stats: dict[str, float] | None = None
        self.over_saturated_at: float | None = None
        self._stop = asyncio.Event()

    async def watch_loop(self) -> None:
        """Oversleep of a short sleep, tick after tick: the event loop's own lateness."""
        while not self._stop.is_set():
            due = time.perf_counter() + self.LOOP_TICK_S
            await asyncio.sleep(self.LOOP_TICK_S)
            self.loop_lags_s.append(max(0.0, time.perf_counter() - due))

    def growing(self, window_s: float) -> bool:
        """Have the requests in flight (sent, not yet answered: the server's queue and batch,
        on any server) kept growing over the last `window_s` seconds, most samples up and
        more than two requests in all? Then arrivals outpace answers."""
        if not self.timeline:
            return False
        now = self.timeline[-1]["t"]
        recent = [e["client_in_flight"] for e in self.timeline if e["t"] >= now - window_s]
        if len(recent) < 3 or now < window_s:
            return False
        steps = [b - a for a, b in zip(recent, recent[1:])]
        return recent[-1] - recent[0] > 2 and sum(d >= 0 for d in steps) >= 0.75 * len(steps)

    async def sample(self) -> None:
        entry: Sample = {"t": round(time.perf_counter() - self.start, 3),
                         "client_in_flight": self.in_flight}
        if self.has_metrics:
            snap = await scrape(self.client, self.target)
            if snap:  # a scrape that fails mid-run (server too busy) leaves a gap
                entry.update(snap.gauges)
                entry["preemptions"] = snap.counters.get("preemptions")
        if self.target.server_pid:
            memory = await asyncio.to_thread(process_memory, self.target.server_pid)
            if memory:
                entry["server_rss_bytes"] = memory["rss_bytes"]
                peak = self.memory_peak or dict.fromkeys(memory, 0)
                self.memory_peak = {k: max(peak[k], v) for k, v in memory.items()}
        self.timeline.append(entry)

    async def loop(self) -> None:
        watcher = asyncio.create_task(self.watch_loop())
        while not self._stop.is_set():
            await self.sample()
            try:
                await asyncio.wait_for(self._stop.wait(), self.target.scrape_interval_s)
            except asyncio.TimeoutError:
                pass
        await watcher

    def stop(self) -> None:
        self._stop.set()


def _progress(enabled: bool) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[counts]}"), TimeElapsedColumn(),
                    console=Console(stderr=True), disable=not enabled)


async def replay(trace: Trace, load: Load, target: Target, slo: Slo | None = None,
                 label: str | None = None, progress: bool = True) -> RunResult:
    """Run `trace` at `load` against `target`; returns the run result."""
    load.check_runnable(trace)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(target.request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        server = await probe_server(client, target)
        model = model_name(target, server)
        before = await scrape(client, target)
        date = utc_now()
        monitor = _Monitor(client, target, has_metrics=before is not None)
        # A full garbage collection over a large heap (a process that imported torch) stalls
        # the event loop for a few hundred ms and inflates every timestamp taken meanwhile;
        # freezing what exists now keeps the collector to the run's own objects.
        gc.collect()
        gc.freeze()
        try:
            sent, duration = await _send_all(client, trace, load, target, model, monitor,
                                             label or "replay", progress)
        finally:
            gc.unfreeze()
        await monitor.sample()  # the state right after the last request
        after = await scrape(client, target)
    return build_result(sent, duration, monitor, before, after, server, model, trace, load,
                        target, slo, label, date)


async def _send_all(client: httpx.AsyncClient, trace: Trace, load: Load, target: Target,
                    model: str, monitor: _Monitor, label: str,
                    progress: bool) -> tuple[list[RequestResult], float]:
    """Send the trace on the load's schedule and wait for every request to end; returns the
    results in send order and the run's duration (first send to last response). A session's
    turn waits for the answer to the turn before it, then its think time."""
    url = target.root + ENDPOINTS[target.endpoint]
    sem = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    cycle = load.duration_s is not None or (load.num_requests or 0) > len(trace.requests)
    total = load.num_requests or (None if load.duration_s else len(trace.requests))
    counts = dict.fromkeys(("ok", "rejected", "error", "timeout", "cancelled"), 0)
    sent: list[RequestResult] = []
    tasks: list[asyncio.Task] = []
    answered: dict[str, asyncio.Event] = {}  # request id -> its answer ended (sessions)
    start = monitor.start = time.perf_counter()
    cpu_start = time.process_time()
    monitor_task = asyncio.create_task(monitor.loop())
    try:
        with _progress(progress) as bar:
            task_id = bar.add_task(label, total=total, counts="")

            async def one(request: TraceRequest, result: RequestResult, done: asyncio.Event,
                          previous: asyncio.Event | None) -> None:
                try:
                    if previous is not None:
                        await previous.wait()
                        due = time.perf_counter() - start + (request.think_s or 0.0)
                        result.scheduled_s = max(result.scheduled_s, due)
                        wait = start + result.scheduled_s - time.perf_counter()
                        await asyncio.sleep(max(0.0, wait))
                    await send(client, url, request, model, result, start,
                               endpoint=target.endpoint)
                finally:
                    done.set()
                    monitor.in_flight -= 1
                    if sem:
                        sem.release()
                counts[result.status] += 1
                bar.update(task_id, advance=1,
                           counts=" ".join(f"{k} {v}" for k, v in counts.items() if v))

            for offset, request in schedule(trace.requests, load.rate, load.burstiness, load.seed,
                                            cycle, load.burst, load.ramp_up):
                if load.num_requests is not None and len(sent) >= load.num_requests:
                    break
                if load.duration_s is not None and offset >= load.duration_s:
                    break
                delay = start + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if load.over_saturation_s and monitor.growing(load.over_saturation_s):
                    monitor.over_saturated_at = time.perf_counter() - start
                    break
                if sem:
                    await sem.acquire()
                    if load.duration_s and time.perf_counter() - start >= load.duration_s:
                        sem.release()
                        break
                result = RequestResult(id=request.id, cls=request.cls,
                                       prompt_len=request.prompt_len,
                                       max_tokens=request.max_tokens, scheduled_s=offset,
                                       tenant=request.tenant)
                sent.append(result)
                monitor.in_flight += 1
                previous = answered.get(request.after) if request.after else None
                done = answered[request.id] = asyncio.Event()
                tasks.append(asyncio.create_task(one(request, result, done, previous)))
            await asyncio.gather(*tasks)
    except BaseException:  # no task may outlive the client it uses, nor its error go unseen
        monitor.stop()
        for task in (*tasks, monitor_task):
            task.cancel()
        await asyncio.gather(*tasks, monitor_task, return_exceptions=True)
        raise
    duration = time.perf_counter() - start
    monitor.client_stats = {"cpu_s": time.process_time() - cpu_start, "wall_s": duration}
    monitor.stop()
    await monitor_task
    return sent, duration


def build_result(sent: list[RequestResult], duration: float, monitor: _Monitor,
                 before: Snapshot | None, after: Snapshot | None, server: dict[str, Any],
                 model: str, trace: Trace, load: Load, target: Target, slo: Slo | None,
                 label: str | None, date: str) -> RunResult:
    peak = monitor.memory_peak
    origin = Origin(date, server=server, backend=f"openai-{target.endpoint}",
                    endpoint=ENDPOINTS[target.endpoint], base_url=target.base_url,
                    hardware=hardware(), model_id=model)
    return RunResult.of(
        sent, duration, load, trace, slo, label, monitor.timeline, origin,
        metrics=server_figures(before, after, monitor.timeline),
        server_memory=None if peak is None else ServerMemory(
            target.server_pid, peak["rss_bytes"], peak["hwm_bytes"], peak["gpu_bytes"]),
        client=client_figures(sent, monitor.timeline, monitor.client_stats,
                              monitor.loop_lags_s, closed_loop=load.max_concurrency is not None),
        over_saturated_at_s=monitor.over_saturated_at)
