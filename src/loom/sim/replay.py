"""Replay a `loom bench` trace against the simulated engine, as `loom bench run` replays it
against a server: the same arrival schedule (rate, burstiness, closed-loop users), the same
client behaviour (cancellations after `cancel_after_s`) and the server's admission control
(`--max-num-queued-reqs`, `--queue-timeout`), all on the virtual clock.

Like the real engine loop, requests that arrive or give up during a step reach the scheduler
at the next step boundary. Every request sent ends completed, cancelled, rejected or failed.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from loom.bench.arrivals import schedule
from loom.bench.client import CANCELLED, ERROR, OK, REJECTED, RequestResult
from loom.bench.replay import Load
from loom.bench.trace import Trace, TraceRequest
from loom.request import Request
from loom.sampling import SamplingParams
from loom.sim.engine import SimEngine, SimStep


@dataclass(frozen=True)
class ServerLimits:
    """The HTTP server's admission control (`loom serve` flags of the same names)."""

    max_num_queued_reqs: int | None = None
    queue_timeout_s: float | None = None


@dataclass
class _Live:
    """A request between send and end, as the client and the server see it."""

    result: RequestResult
    added_at: float                 # the step boundary at which the engine got it
    cancel_at: float | None
    scheduled: bool = False
    last_token_at: float | None = None


@dataclass
class SimRun:
    """What a simulated replay produced: the client's results and the server's figures."""

    sent: list[RequestResult]
    duration: float
    timeline: list[dict[str, Any]]
    queue_times: list[float] = field(default_factory=list)
    server_ttfts: list[float] = field(default_factory=list)
    preemptions: int = 0
    rejected: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_steps: int = 0
    busy_s: float = 0.0


def prompt_token_ids(trace: Trace, tokenizer: Any | None, seed: int) -> list[list[int]]:
    """Token ids per trace request, as many as its prompt has tokens.

    The scheduler needs only counts and equality (shared prefixes share KV blocks), not the
    true ids. With `prompt_len` known (counted by the model's tokenizer when the trace was
    made), ids come from the prompt's words, one id per distinct word, cut or extended to
    `prompt_len`: a shared text prefix gives shared leading ids, as tokenizing would, at a
    fraction of the cost. Text without `prompt_len` is tokenized; length-only records get
    distinct random ids, so they share nothing."""
    vocab: dict[str, int] = {}
    rng = random.Random(seed)
    untold = [r.prompt for r in trace.requests if r.prompt is not None and not r.prompt_len]
    encoded = iter(e.ids for e in tokenizer.encode_batch(untold)) if untold and tokenizer \
        else iter(())
    out = []
    for r in trace.requests:
        if r.prompt is None:
            out.append([rng.randrange(1, 2**31) for _ in range(r.prompt_len or 1)])
        elif not r.prompt_len:
            out.append(next(encoded, None) or [vocab.setdefault(w, len(vocab))
                                               for w in r.prompt.split()] or [0])
        else:
            ids = [vocab.setdefault(w, len(vocab)) for w in r.prompt.split()][:r.prompt_len]
            out.append(ids + [rng.randrange(2**31, 2**32)
                              for _ in range(r.prompt_len - len(ids))])
    return out


class Simulation:
    def __init__(self, engine: SimEngine, trace: Trace, token_ids: list[list[int]], load: Load,
                 limits: ServerLimits = ServerLimits(), scrape_interval_s: float = 1.0) -> None:
        self.engine, self.scheduler = engine, engine.scheduler
        self.load, self.limits = load, limits
        self.token_ids = {id(r): ids for r, ids in zip(trace.requests, token_ids)}
        cycle = load.duration_s is not None or (load.num_requests or 0) > len(trace.requests)
        self._arrivals: Iterator[tuple[float, TraceRequest]] | None = schedule(
            trace.requests, load.rate, load.burstiness, load.seed, cycle)
        self._num_pulled = 0
        self._next_arrival = self._pull_arrival()
        self._client_time = 0.0  # the client sends in order: never before its last send
        self._pending: deque[tuple[float, TraceRequest]] = deque()  # waiting for a user slot
        self._events: list[tuple[float, int, str, str]] = []  # (time, seq, kind, request id)
        self._seq = 0
        self.live: dict[str, _Live] = {}
        self.interval = scrape_interval_s
        self._next_sample = 0.0
        self.run = SimRun(sent=[], duration=0.0, timeline=[])

    # -- the clock -------------------------------------------------------------------------------

    def simulate(self) -> SimRun:
        while True:
            self._advance_to(self.engine.now)
            if self.scheduler.has_unfinished_requests():
                step = self.engine.step()
                if step is not None:
                    self._sample_until(step.end)
                    self._apply(step)
                    continue
            t = self._next_event_time()
            if math.isinf(t):
                break
            self.engine.now = max(self.engine.now, t)
        for request_id in list(self.live):  # only if the scheduler could never run them
            self._end(request_id, self.engine.now, ERROR, error="never scheduled")
        self._sample_until(self.run.duration)
        run = self.run
        run.preemptions, run.num_steps = self.scheduler.num_preemptions, self.engine.num_steps
        run.busy_s = self.engine.busy_s
        return run

    def _next_event_time(self) -> float:
        """The next arrival counts only once the one before it was sent: like the real client,
        which reads the schedule only when a user slot is free."""
        arrival = self._next_arrival[0] if self._next_arrival and not self._pending else math.inf
        event = self._events[0][0] if self._events else math.inf
        return min(arrival, event)

    def _advance_to(self, now: float) -> None:
        """Deliver, in time order, every arrival, cancellation and queue timeout due by `now`
        (a step boundary)."""
        self._sample_until(now)
        while (t := self._next_event_time()) <= now:
            arrival = self._next_arrival
            if arrival is not None and arrival[0] == t and not self._pending:
                self._next_arrival = self._pull_arrival()
                self._pending.append(arrival)
                self._send_pending(t, now)
                continue
            _, _, kind, request_id = heapq.heappop(self._events)
            live = self.live.get(request_id)
            if live is None:
                continue
            if kind == "cancel":
                self.scheduler.abort_request(request_id)
                self._end(request_id, t, CANCELLED)
            elif not live.scheduled:  # queue timeout: still not scheduled at the boundary
                self.scheduler.abort_request(request_id)
                self.run.rejected += 1
                self._end(request_id, now, REJECTED, http_status=503,
                          error="HTTP 503: not scheduled within queue_timeout")

    def _pull_arrival(self) -> tuple[float, TraceRequest] | None:
        load = self.load
        if self._arrivals is None or (load.num_requests is not None
                                      and self._num_pulled >= load.num_requests):
            return None
        arrival = next(self._arrivals, None)
        if arrival is None or (load.duration_s is not None and arrival[0] >= load.duration_s):
            return None
        self._num_pulled += 1
        return arrival

    def _stop_sending(self) -> None:
        self._arrivals, self._next_arrival = None, None
        self._pending.clear()

    def _push(self, t: float, kind: str, request_id: str) -> None:
        heapq.heappush(self._events, (t, self._seq, kind, request_id))
        self._seq += 1

    # -- the client and the server's front door ---------------------------------------------------

    def _send_pending(self, t: float, boundary: float) -> None:
        """Send what waits for a user slot; `t` is when the slot (or the arrival) came."""
        users = self.load.max_concurrency
        while self._pending and (users is None or len(self.live) < users):
            self._client_time = max(self._client_time, t)
            if self.load.duration_s is not None and self._client_time >= self.load.duration_s:
                self._stop_sending()  # as the client does once its --duration is up
                return
            offset, trace_request = self._pending.popleft()
            self._send(trace_request, offset, max(offset, self._client_time), boundary)

    def _send(self, tr: TraceRequest, offset: float, start: float, boundary: float) -> None:
        request_id = str(len(self.run.sent))
        result = RequestResult(id=tr.id, cls=tr.cls, prompt_len=tr.prompt_len,
                               max_tokens=tr.max_tokens, scheduled_s=offset, start_s=start)
        self.run.sent.append(result)
        self.live[request_id] = _Live(result, boundary, None)
        limit = self.limits.max_num_queued_reqs
        if limit is not None and self.scheduler.num_waiting >= limit:
            self.run.rejected += 1
            self._end(request_id, start, REJECTED, http_status=503,
                      error=f"HTTP 503: max_num_queued_reqs={limit} requests already waiting")
            return
        ids = self.token_ids[id(tr)]
        params = SamplingParams(max_tokens=tr.max_tokens, temperature=0.0, ignore_eos=True)
        try:
            self.scheduler.add_request(Request(request_id, ids, params, priority=tr.priority or 0))
        except ValueError as e:
            self._end(request_id, start, ERROR, http_status=400, error=f"HTTP 400: {e}")
            return
        if result.prompt_len is None:
            result.prompt_len = len(ids)
        if tr.cancel_after_s is not None:
            self.live[request_id].cancel_at = start + tr.cancel_after_s
            self._push(start + tr.cancel_after_s, "cancel", request_id)
        if self.limits.queue_timeout_s is not None:
            self._push(start + self.limits.queue_timeout_s, "timeout", request_id)

    def _end(self, request_id: str, t: float, status: str, http_status: int | None = 200,
             error: str | None = None) -> None:
        live = self.live.pop(request_id)
        r = live.result
        r.status, r.http_status, r.error = status, http_status, error
        r.e2e_s = t - r.start_s
        self.run.duration = max(self.run.duration, t)
        self._send_pending(t, self.engine.now)

    # -- what a step did --------------------------------------------------------------------------

    def _apply(self, step: SimStep) -> None:
        for item in step.output.scheduled:
            live = self.live.get(item.request_id)
            if live is not None and not live.scheduled and not item.padding:
                live.scheduled = True
                self.run.queue_times.append(step.start - live.added_at)
                request = self.scheduler.requests.get(item.request_id)
                self.run.prefix_queries += len(item.prompt_token_ids)
                self.run.prefix_hits += request.num_cached_tokens if request else 0
        t = step.end
        for update in step.updates:
            request_id = update.request.request_id
            live = self.live.get(request_id)
            if live is None or (live.cancel_at is not None and live.cancel_at <= t):
                continue  # the client walked away before this token
            r = live.result
            if live.last_token_at is None:
                r.ttft_s = t - r.start_s
                self.run.server_ttfts.append(t - live.added_at)
            else:
                r.itls_s.append(t - live.last_token_at)
            live.last_token_at = t
            r.output_tokens += 1
            if update.finished:
                self._end(request_id, t, OK)

    def _sample_until(self, t: float) -> None:
        """Timeline entries, as `loom bench` scrapes /metrics, for every interval up to t."""
        while self._next_sample <= t:
            self.run.timeline.append({
                "t": round(self._next_sample, 3), "client_in_flight": len(self.live),
                "running": self.scheduler.num_running, "waiting": self.scheduler.num_waiting,
                "kv_usage": self.engine.kv_cache.pool.usage,
                "preemptions": self.scheduler.num_preemptions})
            self._next_sample += self.interval
