"""`loom diagnose`'s rules: each reads figures a bench result holds, fires only when they
show its pattern, cites the numbers that triggered it and names the one setting to try next
(diagnose.py lists them and what each looks for).
"""

from __future__ import annotations

import re
import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from loom.bench.scorecard import shown_label
from loom.workload.monitoring import client_limits
from loom.workload.requests import CANCELLED, OK, REJECTED, RequestResult
from loom.workload.results import RunResult
from loom.workload.slo import Slo

# Thresholds: deliberately coarse, so that a healthy run stays quiet.
WAITING_MEAN = 1.0          # requests waiting on average over the run ...
KV_FREE = 0.8               # ... while KV cache usage never passed this fraction
REJECTED_SHARE = 0.01       # 503s per request sent that mean admission turned work away
SEND_LAG_S = 0.25           # p95 lateness of sends that means the client held requests back
LONG_PROMPT_RATIO = 4.0     # long prompts are >= this many times the short ones ...
TTFT_RATIO = 3.0            # ... and their p95 TTFT this many times the short ones'
DEFAULT_TTFT_LIMIT_S = 2.0  # p95 TTFT deemed too slow when no SLO is given
THROUGHPUT_GAIN = 0.05      # "throughput improved": by at least this fraction ...
P95_LOSS = 0.25             # ... while p95 latency got worse by at least this fraction
SATURATED_GAIN = 0.2        # along a sweep: throughput gains less than this ...
P95_BLOWUP = 2.0            # ... while p95 TTFT at least doubles
PREEMPTION_SHARE = 0.01     # preemptions per request sent that count as KV pressure
OUTSIDE_ENGINE_S = 0.1      # client TTFT beyond the server's own TTFT by at least this
IN_FLIGHT_GAP = 2.0         # requests in flight at the client but not in the engine
KV_FULL = 0.95              # KV cache usage peak at which memory, not the scheduler, admits
FAILED_SHARE = 0.05         # failed per request sent worth a finding (the sweep's default)


@dataclass
class Finding:
    rule: str
    title: str
    run: str
    message: str   # what was measured, with the numbers
    setting: str   # the one setting to try
    evidence: dict[str, Any]


# -- settings the server ran with -----------------------------------------------------------

def server_setting(run: RunResult, flags: str, name: str) -> Any:
    """A server setting (e.g. max_num_seqs) from the flags it was started with, its command
    line, or what its /version reports; None when unknown."""
    server = run.origin.server
    text = " ".join([flags, *server.get("cmdline", [])])
    flag = "--" + name.replace("_", "-")
    if re.search(rf"--no-{flag[2:]}\b", text):
        return False
    match = re.search(rf"{flag}(?:=|\s+)(\S+)", text)
    if match:
        return _number(match.group(1))
    if re.search(rf"{flag}\b", text):
        return True
    return _find_key(server.get("version"), name)


def _number(text: str) -> Any:
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def _find_key(obj: Any, name: str) -> Any:
    if isinstance(obj, dict):
        if name in obj:
            return obj[name]
        for value in obj.values():
            if (found := _find_key(value, name)) is not None:
                return found
    return None


def _open_loop(run: RunResult) -> bool:
    return not run.closed_loop


def _p95(values: list[float]) -> float:
    return float(np.percentile(values, 95))


# -- rules on one run ------------------------------------------------------------------------

def waiting_with_memory_free(run: RunResult, flags: str, slo: Slo | None) -> list[Finding]:
    m = run.metrics
    waiting, kv = m.num_requests_waiting.mean, m.kv_cache_usage.peak
    rejected, sent = run.figures.rejected, run.figures.num_prompts
    findings = []
    memory_free = _memory_free(run)
    if memory_free and rejected >= max(1, REJECTED_SHARE * sent):
        findings.append(Finding(
            "waiting_memory_free", "Requests refused while memory is free", shown_label(run),
            f"{rejected} of {sent} requests got 503/429 while KV cache usage "
            f"peaked at {kv:.0%}: the admission limit, not memory, turned them away.",
            "--max-num-queued-reqs (raise it)",
            {"rejected": rejected, "num_prompts": sent, "kv_cache_usage_peak": kv}))
    elif _waits_with_memory_free(run):
        running_peak = m.num_requests_running.peak
        running = [e["running"] for e in run.timeline if e.get("running") is not None]
        max_seqs = server_setting(run, flags, "max_num_seqs")
        numbers = (f"waiting averaged {waiting:.1f} requests (peak "
                   f"{m.num_requests_waiting.peak:g}) while KV cache usage peaked at "
                   f"{kv:.0%} and running peaked at {running_peak:g}")
        capped = isinstance(max_seqs, int) and running_peak >= max_seqs
        plateau = len(running) >= 3 and sorted(running)[len(running) // 2] == running_peak
        if server_setting(run, flags, "scheduler") == "static":
            message = (f"{numbers}: the server batches statically, so a new request waits for "
                       "the whole running batch to finish before it can join.")
            setting = "--scheduler continuous"
        elif capped or plateau:
            cap = f"= max_num_seqs {max_seqs}" if capped else "(a flat ceiling)"
            message = (f"{numbers} {cap}: the sequence limit, not memory, admits the work. "
                       "Raise it while KV usage stays below ~90%.")
            setting = "--max-num-seqs (llama.cpp: --parallel, SGLang: --max-running-requests)"
        else:
            message = (f"{numbers}, below any sequence cap: new prompts wait for prefill room "
                       "in each step's token budget (or for CPU tokenization).")
            setting = "--max-num-batched-tokens"
        findings.append(Finding("waiting_memory_free", "Waiting grows while memory is free",
                                shown_label(run), message, setting,
                                {"waiting_mean": waiting, "kv_cache_usage_peak": kv,
                                 "running_peak": running_peak, "max_num_seqs": max_seqs}))
    lag = run.client.send_lag_p95_ms
    if _open_loop(run) and run.max_concurrency and lag is not None and lag / 1000 > SEND_LAG_S:
        findings.append(Finding(
            "client_concurrency", "Requests wait in the client, not the server", shown_label(run),
            f"p95 send lag {lag / 1000:.2f} s at offered {run.offered_rate:.2f} req/s: "
            f"requests waited for one of the client's {run.max_concurrency} connections "
            "(server waiting averaged "
            f"{'unknown' if waiting is None else f'{waiting:.1f}'}).",
            "--max-concurrency of loom bench (raise it, or drop it for a pure open loop)",
            {"send_lag_p95_ms": lag, "max_concurrency": run.max_concurrency}))
    return findings


def _memory_free(run: RunResult) -> bool:
    kv = run.metrics.kv_cache_usage.peak
    return kv is not None and kv < KV_FREE


def _waits_with_memory_free(run: RunResult) -> bool:
    """Requests queued on average while the KV cache never filled: a scheduling limit."""
    waiting = run.metrics.num_requests_waiting.mean
    return _memory_free(run) and waiting is not None and waiting >= WAITING_MEAN


def ttft_long_prompts(run: RunResult, flags: str, slo: Slo | None) -> list[Finding]:
    done = [r for r in run.requests if r.status == OK and r.prompt_len and r.ttft_s]
    if len(done) < 8:
        return []
    lens = [r.prompt_len for r in done]
    long_cut, short_cut = np.percentile(lens, 75), np.percentile(lens, 50)
    long = [r for r in done if r.prompt_len >= long_cut]
    short = [r for r in done if r.prompt_len <= short_cut]
    if not long or not short:
        return []
    long_len = statistics.median(r.prompt_len for r in long)
    short_len = statistics.median(r.prompt_len for r in short)
    long_p95, short_p95 = _p95([r.ttft_s for r in long]), _p95([r.ttft_s for r in short])
    limit = limit_of(slo, "ttft")
    if long_len < LONG_PROMPT_RATIO * short_len or long_p95 <= limit \
            or long_p95 < TTFT_RATIO * short_p95:
        return []
    chunked = server_setting(run, flags, "enable_chunked_prefill")
    setting = "--enable-chunked-prefill" if chunked is False else "--max-num-batched-tokens"
    long_ttft = sorted(r.ttft_s for r in long)
    message = (f"prompts of >= {long_cut:.0f} tokens (median {long_len:.0f}, n={len(long)}) "
               f"wait p50 {statistics.median(long_ttft):.2f} s / p95 {long_p95:.2f} s / max "
               f"{long_ttft[-1]:.2f} s for their first token, against p95 {short_p95:.2f} s "
               f"for prompts of <= {short_cut:.0f} tokens; the TTFT limit is {limit:g} s. ")
    message += ("Chunked prefill is off, so a long prefill holds whole steps." if chunked is False
                else "Each step's token budget decides how fast a long prefill gets through and "
                     "how much it delays decodes; compare the long-prompt distribution after.")
    return [Finding("ttft_long_prompts", "TTFT rises with long prompts", shown_label(run),
                    message, setting,
                    {"long_prompt_min_tokens": long_cut, "long_p95_ttft_s": long_p95,
                     "short_p95_ttft_s": short_p95, "ttft_limit_s": limit,
                     "enable_chunked_prefill": chunked})]


def preemptions_or_oom(run: RunResult, flags: str, slo: Slo | None) -> list[Finding]:
    preemptions = run.metrics.preemptions or 0
    oom = [e for e in run.errors if re.search(r"out of memory|\bOOM\b", e, re.I)]
    sent = max(run.figures.num_prompts, 1)
    if preemptions < max(1, PREEMPTION_SHARE * sent) and not oom:
        return []
    kv = run.metrics.kv_cache_usage.peak
    kv_text = f", KV cache usage peaked at {kv:.0%}" if kv is not None else ""
    max_seqs = server_setting(run, flags, "max_num_seqs")
    seqs = f" (now {max_seqs})" if isinstance(max_seqs, int) else ""
    message = (f"{preemptions} preemptions for {sent} requests ({preemptions / sent:.1%})"
               f"{kv_text}, {len(oom)} out-of-memory errors, p95 E2E "
               f"{(run.figures.e2el.p95 or 0) / 1000:.2f} s: the active contexts do not fit "
               "the KV cache, and each preemption recomputes work (not a free scheduling "
               "event). Give the cache more memory (vLLM: --gpu-memory-utilization; a GPU with "
               f"more memory, tensor or pipeline parallelism), or admit fewer sequences "
               f"(--max-num-seqs{seqs}), a smaller token budget (--max-num-batched-tokens) or "
               "shorter contexts (--max-model-len).")
    return [Finding("preemptions_kv_pressure", "Preemptions or out-of-memory errors",
                    shown_label(run), message, "--kv-cache-memory",
                    {"preemptions": preemptions, "num_prompts": sent, "kv_cache_usage_peak": kv,
                     "oom_errors": len(oom)})]


def kv_cache_full(run: RunResult, flags: str, slo: Slo | None) -> list[Finding]:
    """Requests waited while the KV cache was full: memory bounds the batch (a what-if of a
    GPU too small for the load shows this, often without a single preemption)."""
    kv, waiting = run.metrics.kv_cache_usage.peak, run.metrics.num_requests_waiting.peak
    if kv is None or kv < KV_FULL or not waiting or waiting < 1:
        return []
    running = run.metrics.num_requests_running.peak
    max_seqs = server_setting(run, flags, "max_num_seqs")
    capped = _at_cap(running, max_seqs)
    message = (f"KV cache usage peaked at {kv:.1%} while up to {waiting:g} requests waited "
               f"(p95 TTFT {(run.figures.ttft.p95 or 0) / 1000:.2f} s) and running peaked "
               f"at {_g(running)}")
    if capped:
        message += (f" = max_num_seqs {max_seqs}: the batch is at its sequence cap and the "
                    "cache is full too, so raising --max-num-seqs alone would only preempt. ")
    else:
        message += ": memory, not the sequence cap, limits how many requests run; new ones "
        message += "wait for KV blocks to free. "
    message += ("Give the KV cache more memory (a GPU with more memory, tensor parallelism, a "
                "smaller KV dtype) or shorten contexts (--max-model-len), or offer less load.")
    return [Finding("kv_cache_full", "Requests wait while the KV cache is full",
                    shown_label(run), message,
                    "--kv-cache-memory (vLLM: --gpu-memory-utilization)",
                    {"kv_cache_usage_peak": kv, "waiting_peak": waiting, "running_peak": running,
                     "max_num_seqs": max_seqs})]


def batch_at_cap(run: RunResult, flags: str, slo: Slo | None) -> list[Finding]:
    """Requests waited while the batch was at max_num_seqs and memory was not full. Left to
    `waiting_with_memory_free` when memory was clearly free and the queue long (it says the
    same), and to `kv_cache_full` when the cache was full."""
    kv, waiting = run.metrics.kv_cache_usage.peak, run.metrics.num_requests_waiting.peak
    running = run.metrics.num_requests_running.peak
    max_seqs = server_setting(run, flags, "max_num_seqs")
    if not _at_cap(running, max_seqs) or not waiting or waiting < 1 \
            or (kv is not None and kv >= KV_FULL) or _waits_with_memory_free(run):
        return []
    kv_text = "unknown" if kv is None else f"{kv:.0%}"
    return [Finding(
        "batch_at_cap", "The batch size cap bounds this run", shown_label(run),
        f"running peaked at {running:g} = max_num_seqs {max_seqs} while up to {waiting:g} "
        f"requests waited (p95 TTFT {(run.figures.ttft.p95 or 0) / 1000:.2f} s) and KV cache "
        f"usage peaked at {kv_text}: the sequence cap, not memory, decides when a waiting "
        "request starts. Raise it while KV usage stays below ~90% (a larger batch also "
        "lengthens each decode step), or add capacity.",
        "--max-num-seqs (llama.cpp: --parallel, SGLang: --max-running-requests)",
        {"running_peak": running, "max_num_seqs": max_seqs, "waiting_peak": waiting,
         "kv_cache_usage_peak": kv})]


def failed_requests(run: RunResult, flags: str, slo: Slo | None) -> list[Finding]:
    """A share of requests failed: what the errors were, and where to look for each kind.
    Refusals while memory was free are `waiting_with_memory_free`'s, so not counted here."""
    sent, failed = run.figures.num_prompts, run.figures.failed
    skip = {OK, CANCELLED, REJECTED} if _memory_free(run) else {OK, CANCELLED}
    if _memory_free(run):
        failed -= run.figures.rejected
    if not sent or failed < max(1, FAILED_SHARE * sent):
        return []
    kinds = Counter(_error_kind(r) for r in run.requests if r.status not in skip)
    if not kinds:  # a result without its requests: the distinct errors it kept
        kinds = Counter({e[:120]: 1 for e in run.errors})
    top = kinds.most_common(3)
    listed = "; ".join(f"{n} x {kind}" for kind, n in top) or "no error text recorded"
    return [Finding(
        "failed_requests", "Requests failed", shown_label(run),
        f"{failed} of {sent} requests failed ({failed / sent:.0%}): {listed}. Latency figures "
        "count only the answered ones, so fix the failures before comparing speed.",
        _ERROR_SETTING[_error_class(top[0][0]) if top else "other"],
        {"failed": failed, "num_prompts": sent, "errors": dict(top)})]


_ERROR_SETTING = {
    "client": "the requests themselves: prompt + max_tokens within the server's "
              "--max-model-len, the model name (--model) and the API (--endpoint)",
    "rejected": "--max-num-queued-reqs / --queue-timeout (the server's admission), or a lower "
                "offered load",
    "timeout": "--request-timeout (longer), or a lower offered load",
    "other": "the server's log: it failed these requests (or the connection broke)",
}


def _error_kind(request: RequestResult) -> str:
    """A request's error, cut where requests differ (ids, lengths), to count alike ones."""
    error = request.error or request.status or "error"
    return re.sub(r"\d{3,}", "N", error)[:120] if not error.startswith("HTTP") else error[:120]


def _error_class(kind: str) -> str:
    if kind.startswith(("HTTP 429", "HTTP 503")):
        return "rejected"
    if kind.startswith("HTTP 4"):
        return "client"
    return "timeout" if kind.startswith("timeout") else "other"


def _at_cap(running: float | None, max_seqs: Any) -> bool:
    return isinstance(max_seqs, int) and not isinstance(max_seqs, bool) \
        and running is not None and running >= max_seqs


def _g(value: float | None) -> str:
    return "unknown" if value is None else f"{value:g}"


def upstream_bottleneck(run: RunResult, flags: str, slo: Slo | None) -> list[Finding]:
    evidence: dict[str, Any] = {}
    reasons = []
    in_flight = run.client.in_flight_mean
    running, waiting = run.metrics.num_requests_running.mean, run.metrics.num_requests_waiting.mean
    if in_flight is not None and running is not None and waiting is not None:
        gap = in_flight - running - waiting
        if gap >= max(IN_FLIGHT_GAP, 0.5 * in_flight):
            reasons.append(f"the client had {in_flight:.1f} requests in flight on average but "
                           f"the engine saw {running:.1f} running + {waiting:.1f} waiting")
            evidence.update(client_in_flight_mean=in_flight, running_mean=running,
                            waiting_mean=waiting)
    server_ttft = run.metrics.server_ttft.percentiles.get(50) if run.metrics.server_ttft else None
    client_ttft = run.figures.ttft.median
    if server_ttft is not None and client_ttft is not None:
        outside = (client_ttft - server_ttft) / 1000
        if outside >= max(OUTSIDE_ENGINE_S, 0.5 * server_ttft / 1000):
            reasons.append(f"p50 TTFT is {client_ttft / 1000:.2f} s at the client but "
                           f"{server_ttft / 1000:.2f} s inside the engine")
            evidence.update(client_p50_ttft_ms=client_ttft, server_p50_ttft_ms=server_ttft)
    if not reasons:
        return []
    kv = run.metrics.kv_cache_usage.peak
    message = "; ".join(reasons) + (f"; KV cache usage peaked at {kv:.0%}" if kv is not None
                                    else "") + (
        ". Work is stuck before the scheduler: check the server's CPU (HTTP, tokenization, "
        "detokenization), network, storage and model loading before blaming batching.")
    setting = ("--num-threads (loom: leave a core for HTTP + tokenization; vLLM: "
               "--api-server-count)")
    return [Finding("upstream_bottleneck", "Low utilisation while requests wait",
                    shown_label(run), message, setting, evidence)]


def client_limited(run: RunResult, flags: str, slo: Slo | None) -> list[Finding]:
    """The load generator fell behind its own schedule: its figures measure the client."""
    client = run.client
    reasons = client.limited_reasons
    if reasons is None:  # a result from before the client recorded its own limits
        reasons = client_limits(client, closed_loop=not _open_loop(run)
                                or bool(run.max_concurrency))
    if not reasons:
        return []
    return [Finding(
        "client_limited", "The client, not the server, limited this run", shown_label(run),
        f"the client, not the server, limited this run: {'; '.join(reasons)}. Its latencies "
        "include its own queueing and its offered load was not the one asked for.",
        "the load generator: run loom bench on its own cores or machine (e.g. taskset -c N), "
        "away from the server and other work, or split the load over several clients",
        {"send_lag_p95_ms": client.send_lag_p95_ms, "loop_lag_p95_ms": client.loop_lag_p95_ms,
         "cpu_share": client.cpu_share})]


def limit_of(slo: Slo | None, metric: str) -> float:
    limit = slo.limit(metric) if slo else None
    return DEFAULT_TTFT_LIMIT_S if limit is None else limit


RUN_RULES = (client_limited, failed_requests, waiting_with_memory_free, kv_cache_full,
             batch_at_cap, ttft_long_prompts, preemptions_or_oom, upstream_bottleneck)
