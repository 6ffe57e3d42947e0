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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from loom.admission import AdmissionConfig
from loom.cluster.routing import RoutingPolicy, prompt_block_hashes
from loom.request import Request
from loom.sampling import SamplingParams
from loom.sim.engine import SimEngine, SimStep
from loom.workload.arrivals import schedule
from loom.workload.load import Load
from loom.workload.monitoring import Sample
from loom.workload.requests import CANCELLED, ERROR, OK, REJECTED, RequestResult
from loom.workload.trace import Trace, TraceRequest

NO_LIMITS = AdmissionConfig()  # a server that admits everything
# What comes first at one instant: a step's end, then client events, then new steps.
_STEP_END, _CLIENT, _STEP_START = 0, 1, 2


@dataclass
class _Live:
    """A request between send and end, as the client and the server see it."""

    result: RequestResult
    cancel_at: float | None
    replica: int = 0
    scheduled: bool = False
    last_token_at: float | None = None


@dataclass
class SimRun:
    """What a simulated replay produced: the client's results and the server's figures."""

    sent: list[RequestResult]
    duration: float
    timeline: list[Sample]
    queue_times: list[float] = field(default_factory=list)
    server_ttfts: list[float] = field(default_factory=list)
    preemptions: int = 0
    rejected: int = 0
    requests_per_replica: list[int] = field(default_factory=list)
    prefix_queries: int = 0
    prefix_hits: int = 0
    router_decisions: dict[str, int] = field(default_factory=dict)
    num_steps: int = 0
    busy_s: float = 0.0  # summed over the fleet's engines


def prompt_token_ids(trace: Trace, tokenizer: Any | None, seed: int,
                     max_model_len: int | None = None) -> list[list[int]]:
    """Token ids per trace request, as the server would see its prompt.

    A record with text is sent as that text, as `loom bench run` sends it, so its ids are the
    text tokenized with `tokenizer` (the served model's) and its `prompt_len` is not read.
    Without a tokenizer, one id per distinct word: a shared text prefix gives shared leading
    ids as tokenizing would (the scheduler needs only counts and equality), but the count is
    words, not tokens. A record with only `prompt_len` gets that many distinct random ids, so
    it shares nothing; none when the prompt is `max_model_len` tokens or longer, since the
    server refuses it (400) before reading it (a billion ids would take minutes to build)."""
    vocab: dict[str, int] = {}
    rng = random.Random(seed)
    texts = [r.prompt for r in trace.requests if r.prompt is not None]
    encoded = iter([e.ids for e in tokenizer.encode_batch(texts)] if texts and tokenizer
                   else [])
    out = []
    for r in trace.requests:
        if r.prompt is not None:
            ids = next(encoded) if tokenizer else [vocab.setdefault(w, len(vocab))
                                                   for w in r.prompt.split()]
            out.append(ids or [0])
        elif max_model_len is not None and r.prompt_len >= max_model_len:
            out.append([])
        else:
            out.append([rng.randrange(1, 2**31) for _ in range(r.prompt_len or 1)])
    return out


def refusal(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> str | None:
    """The 400 `loom serve` answers before the engine sees a request (`serving.max_tokens`):
    a prompt that leaves no room for one output token, or max_tokens beyond the room left.
    None when the server accepts it."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        return (f"prompt has {num_prompt_tokens} tokens, but max_model_len is {max_model_len} "
                "(prompt and at least one output token must fit)")
    if max_tokens > room:
        return (f"max_tokens={max_tokens} is too large: the prompt has {num_prompt_tokens} "
                f"tokens and max_model_len is {max_model_len}, so at most {room} can be "
                "generated")
    return None


class Simulation:
    """One client replaying a trace against one or more simulated engines (a fleet: replicas
    behind a router, as `loom serve --data-parallel-size N` runs them).

    Everything happens in time order: a step is scheduled at its engine's clock and its tokens
    reach the client at its end; client events (arrivals, cancellations, queue timeouts) come
    in between. At one instant a step's end comes first, then client events, then the next
    steps. A request sent to an engine in mid-step waits for that step's end; an idle
    engine's clock jumps to the request's arrival."""

    def __init__(self, engines: SimEngine | list[SimEngine], trace: Trace,
                 token_ids: Sequence[list[int]], load: Load,
                 limits: AdmissionConfig = NO_LIMITS,
                 scrape_interval_s: float = 1.0, router: RoutingPolicy | None = None) -> None:
        self.engines = engines if isinstance(engines, list) else [engines]
        if router is None and len(self.engines) > 1:
            raise ValueError("a fleet of simulated engines needs a router")
        self.router = router
        self._schedulers = [e.scheduler for e in self.engines]
        self.load, self.limits = load, limits
        # read at send: a fleet's trace may build each prompt only then (fleet_sim.py)
        self.token_ids = token_ids
        self._position = {id(r): i for i, r in enumerate(trace.requests)}
        cycle = load.duration_s is not None or (load.num_requests or 0) > len(trace.requests)
        self._arrivals: Iterator[tuple[float, TraceRequest]] | None = schedule(
            trace.requests, load.rate, load.burstiness, load.seed, cycle)
        self._num_pulled = 0
        self._next_arrival = self._pull_arrival()
        self._client_time = 0.0  # the client sends in order: never before its last send
        self._pending: deque[tuple[float, TraceRequest]] = deque()  # waiting for a user slot
        self._events: list[tuple[float, int, str, str]] = []  # (time, seq, kind, request id)
        self._seq = 0
        # The engines' next actions, (time, kind, engine index): a running step's end, or the
        # start of the next step of an engine with work. An engine has one entry at most.
        self._agenda: list[tuple[float, int, int]] = []
        self._in_flight: dict[int, SimStep] = {}  # engine index -> the step it is running
        self._waking: set[int] = set()   # engines whose next step is on the agenda
        self._stalled: set[int] = set()  # engines that could schedule nothing at their clock
        self.live: dict[str, _Live] = {}
        self.interval = scrape_interval_s
        self._next_sample = 0.0
        self.run = SimRun(sent=[], duration=0.0, timeline=[],
                          requests_per_replica=[0] * len(self.engines))

    # -- the clock -------------------------------------------------------------------------------

    def simulate(self) -> SimRun:
        while True:
            t = self._next_event_time()
            if self._agenda and self._agenda[0][:2] < (t, _CLIENT):
                at, kind, index = heapq.heappop(self._agenda)
                self._sample_until(at)
                if kind == _STEP_END:
                    self._apply(index, self._in_flight.pop(index))
                    self._wake(index)
                else:
                    self._start_step(index)
                continue
            if math.isinf(t):
                break
            self._sample_until(t)
            for index in self._stalled:  # something may have changed for it by t
                self.engines[index].now = max(self.engines[index].now, t)
            stalled, self._stalled = self._stalled, set()
            self._handle_event(t)
            for index in stalled:
                self._wake(index)
        now = max(e.now for e in self.engines)
        for request_id in list(self.live):  # only if the scheduler could never run them
            self._end(request_id, now, ERROR, error="never scheduled")
        self._sample_until(self.run.duration)
        run = self.run
        run.preemptions = sum(e.scheduler.num_preemptions for e in self.engines)
        run.num_steps = sum(e.num_steps for e in self.engines)
        run.busy_s = sum(e.busy_s for e in self.engines)
        return run

    def _wake(self, index: int) -> None:
        """Put the engine's next step on the agenda, at its clock, if it has work and nothing
        of it is there already."""
        engine = self.engines[index]
        if (index in self._in_flight or index in self._waking or index in self._stalled
                or not engine.scheduler.has_unfinished_requests()):
            return
        self._waking.add(index)
        heapq.heappush(self._agenda, (engine.now, _STEP_START, index))

    def _start_step(self, index: int) -> None:
        self._waking.discard(index)
        step = self.engines[index].step()
        if step is None:
            self._stalled.add(index)  # until the next client event
        else:
            self._in_flight[index] = step
            heapq.heappush(self._agenda, (step.end, _STEP_END, index))

    def _next_event_time(self) -> float:
        """The next arrival counts only once the one before it was sent: like the real client,
        which reads the schedule only when a user slot is free."""
        arrival = self._next_arrival[0] if self._next_arrival and not self._pending else math.inf
        event = self._events[0][0] if self._events else math.inf
        return min(arrival, event)

    def _handle_event(self, t: float) -> None:
        """The client event due at `t`: an arrival is sent (or waits for a user slot), a
        cancellation aborts, a queue timeout rejects a request still not scheduled (at the
        boundary of the step its engine is running)."""
        arrival = self._next_arrival
        if arrival is not None and arrival[0] == t and not self._pending:
            self._next_arrival = self._pull_arrival()
            self._pending.append(arrival)
            self._send_pending(t)
            return
        _, _, kind, request_id = heapq.heappop(self._events)
        live = self.live.get(request_id)
        if live is None:
            return
        scheduler = self.engines[live.replica].scheduler
        if kind == "cancel":
            scheduler.abort_request(request_id)
            self._end(request_id, t, CANCELLED)
        elif not live.scheduled:
            scheduler.abort_request(request_id)
            self.run.rejected += 1
            self._end(request_id, self.engines[live.replica].now, REJECTED, http_status=503,
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

    def _send_pending(self, t: float) -> None:
        """Send what waits for a user slot; `t` is when the slot (or the arrival) came."""
        users = self.load.max_concurrency
        while self._pending and (users is None or len(self.live) < users):
            self._client_time = max(self._client_time, t)
            if self.load.duration_s is not None and self._client_time >= self.load.duration_s:
                self._stop_sending()  # as the client does once its --duration is up
                return
            offset, trace_request = self._pending.popleft()
            self._send(trace_request, offset, max(offset, self._client_time))

    def _route(self, ids: list[int]) -> int:
        """The replica a request goes to: the router's choice on the prompt's block hashes and
        the replicas' queues (requests waiting + running), as the cluster's router sees them."""
        if self.router is None:
            return 0
        block_size = self.engines[0].kv_cache.block_size
        hashes = prompt_block_hashes(ids, block_size)
        # waiting + running is every request a scheduler holds: one len each, not two
        # properties, since at 1,000 replicas this scan is a fifth of a fleet run's time
        replica = self.router.choose(hashes, [len(s.requests) for s in self._schedulers])
        self.router.record(replica, hashes)
        decision = self.router.last_decision
        self.run.router_decisions[decision] = self.run.router_decisions.get(decision, 0) + 1
        return replica

    def _send(self, tr: TraceRequest, offset: float, start: float) -> None:
        request_id = str(len(self.run.sent))
        ids = self.token_ids[self._position[id(tr)]]
        result = RequestResult(id=tr.id, cls=tr.cls,
                               prompt_len=tr.prompt_len if tr.prompt is None else len(ids),
                               max_tokens=tr.max_tokens, scheduled_s=offset, start_s=start)
        self.run.sent.append(result)
        error = refusal(result.prompt_len, tr.max_tokens,
                        self.engines[0].scheduler.max_model_len)
        if error is not None:  # the HTTP server's answer: no engine sees it
            self.live[request_id] = _Live(result, None)
            self._end(request_id, start, ERROR, http_status=400, error=f"HTTP 400: {error}")
            return
        replica = self._route(ids)
        engine = self.engines[replica]
        if replica not in self._in_flight:  # idle (or between steps): it starts at `start`
            engine.now = max(engine.now, start)
        self.run.requests_per_replica[replica] += 1
        self.live[request_id] = _Live(result, None, replica)
        limit = self.limits.max_num_queued_reqs
        if limit is not None and engine.scheduler.num_waiting >= limit:
            self.run.rejected += 1
            self._end(request_id, start, REJECTED, http_status=503,
                      error=f"HTTP 503: max_num_queued_reqs={limit} requests already waiting")
            return
        params = SamplingParams(max_tokens=tr.max_tokens, temperature=0.0, ignore_eos=True)
        request = Request(request_id, ids, params, priority=tr.priority or 0)
        try:
            engine.scheduler.add_request(request)
        except ValueError as e:
            self._end(request_id, start, ERROR, http_status=400, error=f"HTTP 400: {e}")
            return
        self._wake(replica)
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
        self._send_pending(t)

    # -- what a step did --------------------------------------------------------------------------

    def _apply(self, replica: int, step: SimStep) -> None:
        """The client's view of a step that just ended on this replica."""
        scheduler = self.engines[replica].scheduler
        for item in step.output.scheduled:
            live = self.live.get(item.request_id)
            if live is not None and not live.scheduled and not item.padding:
                live.scheduled = True
                # from the send, as the engine counts it (the step in progress included)
                self.run.queue_times.append(step.start - live.result.start_s)
                request = scheduler.requests.get(item.request_id)
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
                self.run.server_ttfts.append(r.ttft_s)  # no HTTP time here: the client's
            else:
                r.itls_s.append(t - live.last_token_at)
            live.last_token_at = t
            r.output_tokens += 1
            if update.finished:
                self._end(request_id, t, OK)

    def _sample_until(self, t: float) -> None:
        """Timeline entries, as `loom bench` scrapes /metrics, for every interval up to t."""
        while self._next_sample <= t:
            schedulers = [e.scheduler for e in self.engines]
            self.run.timeline.append({
                "t": round(self._next_sample, 3), "client_in_flight": len(self.live),
                "running": sum(s.num_running for s in schedulers),
                "waiting": sum(s.num_waiting for s in schedulers),
                "kv_usage": sum(e.kv_cache.pool.usage for e in self.engines) / len(self.engines),
                "preemptions": sum(s.num_preemptions for s in schedulers)})
            self._next_sample += self.interval
