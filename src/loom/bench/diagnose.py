"""`loom diagnose`: diagnosing a disappointing result from its measurements.

Look for the constraint before changing another flag. Each rule reads figures a bench result
holds, fires only when they show its pattern, cites the numbers that triggered it and names
the one setting to try next:

1. waiting grows (or 503s) while memory is free -> admission / max_num_seqs / token budget
   requests wait in the client instead     -> the load generator's --max-concurrency
2. TTFT rises with long prompts            -> chunked prefill / max_num_batched_tokens
3. throughput up but p95 worse             -> cap admission (needs several rates or configs)
4. preemptions or out-of-memory            -> KV cache capacity (or fewer sequences)
5. low utilisation while requests wait     -> something upstream of the scheduler
6. the client fell behind its schedule      -> the load generator itself (its own cores)
7. requests wait while the KV cache is full -> KV cache capacity (memory admits the work)
8. requests wait while running = max_num_seqs (memory not full) -> the batch-size cap
9. requests failed                         -> what the errors say (trace, timeout, server)

When none fires, `what_bounds` still says where each run's time went (queue, prefill or
decode), which names the knob that would move it.
"""

from __future__ import annotations

import re
import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from loom.bench.client import CANCELLED, OK, REJECTED
from loom.bench.results import Slo, client_limits, groups, requests_of
from loom.bench.scorecard import shown_label

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

def server_setting(run: dict[str, Any], flags: str, name: str) -> Any:
    """A server setting (e.g. max_num_seqs) from the flags it was started with, its command
    line, or what its /version reports; None when unknown."""
    server = run.get("server") or {}
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


def _open_loop(run: dict[str, Any]) -> bool:
    return run["request_rate"] != "inf"


def _p95(values: list[float]) -> float:
    return float(np.percentile(values, 95))


# -- rules on one run ------------------------------------------------------------------------

def waiting_with_memory_free(run: dict[str, Any], flags: str, slo: Slo | None) -> list[Finding]:
    waiting, kv = run.get("num_requests_waiting_mean"), run.get("kv_cache_usage_peak")
    rejected = run.get("rejected", 0)
    findings = []
    memory_free = _memory_free(run)
    if memory_free and rejected >= max(1, REJECTED_SHARE * run["num_prompts"]):
        findings.append(Finding(
            "waiting_memory_free", "Requests refused while memory is free", shown_label(run),
            f"{rejected} of {run['num_prompts']} requests got 503/429 while KV cache usage "
            f"peaked at {kv:.0%}: the admission limit, not memory, turned them away.",
            "--max-num-queued-reqs (raise it)",
            {"rejected": rejected, "num_prompts": run["num_prompts"], "kv_cache_usage_peak": kv}))
    elif _waits_with_memory_free(run):
        running_peak = run.get("num_requests_running_peak")
        running = [e["running"] for e in run.get("timeline", []) if e.get("running") is not None]
        max_seqs = server_setting(run, flags, "max_num_seqs")
        numbers = (f"waiting averaged {waiting:.1f} requests (peak "
                   f"{run.get('num_requests_waiting_peak'):g}) while KV cache usage peaked at "
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
    lag = (run.get("client") or {}).get("send_lag_p95_ms")
    if _open_loop(run) and run.get("max_concurrency") and lag is not None \
            and lag / 1000 > SEND_LAG_S:
        findings.append(Finding(
            "client_concurrency", "Requests wait in the client, not the server", shown_label(run),
            f"p95 send lag {lag / 1000:.2f} s at offered {run['offered_rate']:.2f} req/s: "
            f"requests waited for one of the client's {run['max_concurrency']} connections "
            "(server waiting averaged "
            f"{'unknown' if waiting is None else f'{waiting:.1f}'}).",
            "--max-concurrency of loom bench (raise it, or drop it for a pure open loop)",
            {"send_lag_p95_ms": lag, "max_concurrency": run["max_concurrency"]}))
    return findings


def _memory_free(run: dict[str, Any]) -> bool:
    kv = run.get("kv_cache_usage_peak")
    return kv is not None and kv < KV_FREE


def _waits_with_memory_free(run: dict[str, Any]) -> bool:
    """Requests queued on average while the KV cache never filled: a scheduling limit."""
    waiting = run.get("num_requests_waiting_mean")
    return _memory_free(run) and waiting is not None and waiting >= WAITING_MEAN


def ttft_long_prompts(run: dict[str, Any], flags: str, slo: Slo | None) -> list[Finding]:
    done = [r for r in requests_of(run) if r.status == OK and r.prompt_len and r.ttft_s]
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
    limit = _limit(slo, "ttft")
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


def preemptions_or_oom(run: dict[str, Any], flags: str, slo: Slo | None) -> list[Finding]:
    preemptions = run.get("preemptions") or 0
    oom = [e for e in run.get("errors", []) if re.search(r"out of memory|\bOOM\b", e, re.I)]
    sent = max(run["num_prompts"], 1)
    if preemptions < max(1, PREEMPTION_SHARE * sent) and not oom:
        return []
    kv = run.get("kv_cache_usage_peak")
    kv_text = f", KV cache usage peaked at {kv:.0%}" if kv is not None else ""
    max_seqs = server_setting(run, flags, "max_num_seqs")
    seqs = f" (now {max_seqs})" if isinstance(max_seqs, int) else ""
    message = (f"{preemptions} preemptions for {sent} requests ({preemptions / sent:.1%})"
               f"{kv_text}, {len(oom)} out-of-memory errors, p95 E2E "
               f"{(run.get('p95_e2el_ms') or 0) / 1000:.2f} s: the active contexts do not fit "
               "the KV cache, and each preemption recomputes work (not a free scheduling "
               "event). Give the cache more memory (vLLM: --gpu-memory-utilization; a GPU with "
               f"more memory, tensor or pipeline parallelism), or admit fewer sequences "
               f"(--max-num-seqs{seqs}), a smaller token budget (--max-num-batched-tokens) or "
               "shorter contexts (--max-model-len).")
    return [Finding("preemptions_kv_pressure", "Preemptions or out-of-memory errors",
                    shown_label(run), message, "--kv-cache-memory",
                    {"preemptions": preemptions, "num_prompts": sent, "kv_cache_usage_peak": kv,
                     "oom_errors": len(oom)})]


def kv_cache_full(run: dict[str, Any], flags: str, slo: Slo | None) -> list[Finding]:
    """Requests waited while the KV cache was full: memory bounds the batch (a what-if of a
    GPU too small for the load shows this, often without a single preemption)."""
    kv, waiting = run.get("kv_cache_usage_peak"), run.get("num_requests_waiting_peak")
    if kv is None or kv < KV_FULL or not waiting or waiting < 1:
        return []
    running = run.get("num_requests_running_peak")
    max_seqs = server_setting(run, flags, "max_num_seqs")
    capped = _at_cap(running, max_seqs)
    message = (f"KV cache usage peaked at {kv:.1%} while up to {waiting:g} requests waited "
               f"(p95 TTFT {(run.get('p95_ttft_ms') or 0) / 1000:.2f} s) and running peaked "
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


def batch_at_cap(run: dict[str, Any], flags: str, slo: Slo | None) -> list[Finding]:
    """Requests waited while the batch was at max_num_seqs and memory was not full. Left to
    `waiting_with_memory_free` when memory was clearly free and the queue long (it says the
    same), and to `kv_cache_full` when the cache was full."""
    kv, waiting = run.get("kv_cache_usage_peak"), run.get("num_requests_waiting_peak")
    running = run.get("num_requests_running_peak")
    max_seqs = server_setting(run, flags, "max_num_seqs")
    if not _at_cap(running, max_seqs) or not waiting or waiting < 1 \
            or (kv is not None and kv >= KV_FULL) or _waits_with_memory_free(run):
        return []
    kv_text = "unknown" if kv is None else f"{kv:.0%}"
    return [Finding(
        "batch_at_cap", "The batch size cap bounds this run", shown_label(run),
        f"running peaked at {running:g} = max_num_seqs {max_seqs} while up to {waiting:g} "
        f"requests waited (p95 TTFT {(run.get('p95_ttft_ms') or 0) / 1000:.2f} s) and KV cache "
        f"usage peaked at {kv_text}: the sequence cap, not memory, decides when a waiting "
        "request starts. Raise it while KV usage stays below ~90% (a larger batch also "
        "lengthens each decode step), or add capacity.",
        "--max-num-seqs (llama.cpp: --parallel, SGLang: --max-running-requests)",
        {"running_peak": running, "max_num_seqs": max_seqs, "waiting_peak": waiting,
         "kv_cache_usage_peak": kv})]


def failed_requests(run: dict[str, Any], flags: str, slo: Slo | None) -> list[Finding]:
    """A share of requests failed: what the errors were, and where to look for each kind.
    Refusals while memory was free are `waiting_with_memory_free`'s, so not counted here."""
    sent, failed = run["num_prompts"], run.get("failed") or 0
    skip = {OK, CANCELLED, REJECTED} if _memory_free(run) else {OK, CANCELLED}
    if _memory_free(run):
        failed -= run.get("rejected") or 0
    if not sent or failed < max(1, FAILED_SHARE * sent):
        return []
    kinds = Counter(_error_kind(r) for r in run.get("requests", [])
                    if r.get("status") not in skip)
    if not kinds:  # a result without its requests: the distinct errors it kept
        kinds = Counter({e[:120]: 1 for e in run.get("errors", [])})
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


def _error_kind(request: dict[str, Any]) -> str:
    """A request's error, cut where requests differ (ids, lengths), to count alike ones."""
    error = request.get("error") or request.get("status") or "error"
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


def upstream_bottleneck(run: dict[str, Any], flags: str, slo: Slo | None) -> list[Finding]:
    evidence: dict[str, Any] = {}
    reasons = []
    client = run.get("client") or {}
    in_flight = client.get("in_flight_mean")
    running, waiting = run.get("num_requests_running_mean"), run.get("num_requests_waiting_mean")
    if in_flight is not None and running is not None and waiting is not None:
        gap = in_flight - running - waiting
        if gap >= max(IN_FLIGHT_GAP, 0.5 * in_flight):
            reasons.append(f"the client had {in_flight:.1f} requests in flight on average but "
                           f"the engine saw {running:.1f} running + {waiting:.1f} waiting")
            evidence.update(client_in_flight_mean=in_flight, running_mean=running,
                            waiting_mean=waiting)
    server_ttft = (run.get("server_ttft") or {}).get("p50_ms")
    if server_ttft is not None and run.get("median_ttft_ms") is not None:
        outside = (run["median_ttft_ms"] - server_ttft) / 1000
        if outside >= max(OUTSIDE_ENGINE_S, 0.5 * server_ttft / 1000):
            reasons.append(f"p50 TTFT is {run['median_ttft_ms'] / 1000:.2f} s at the client but "
                           f"{server_ttft / 1000:.2f} s inside the engine")
            evidence.update(client_p50_ttft_ms=run["median_ttft_ms"],
                            server_p50_ttft_ms=server_ttft)
    if not reasons:
        return []
    kv = run.get("kv_cache_usage_peak")
    message = "; ".join(reasons) + (f"; KV cache usage peaked at {kv:.0%}" if kv is not None
                                    else "") + (
        ". Work is stuck before the scheduler: check the server's CPU (HTTP, tokenization, "
        "detokenization), network, storage and model loading before blaming batching.")
    setting = ("--num-threads (loom: leave a core for HTTP + tokenization; vLLM: "
               "--api-server-count)")
    return [Finding("upstream_bottleneck", "Low utilisation while requests wait",
                    shown_label(run), message, setting, evidence)]


def client_limited(run: dict[str, Any], flags: str, slo: Slo | None) -> list[Finding]:
    """The load generator fell behind its own schedule: its figures measure the client."""
    client = run.get("client") or {}
    reasons = client.get("limited_reasons")
    if reasons is None:  # a result from before the client recorded its own limits
        reasons = client_limits(client, closed_loop=not _open_loop(run)
                                or bool(run.get("max_concurrency")))
    if not reasons:
        return []
    return [Finding(
        "client_limited", "The client, not the server, limited this run", shown_label(run),
        f"the client, not the server, limited this run: {'; '.join(reasons)}. Its latencies "
        "include its own queueing and its offered load was not the one asked for.",
        "the load generator: run loom bench on its own cores or machine (e.g. taskset -c N), "
        "away from the server and other work, or split the load over several clients",
        {k: client.get(k) for k in ("send_lag_p95_ms", "loop_lag_p95_ms", "cpu_share")})]


# -- rules across runs -----------------------------------------------------------------------

def throughput_up_p95_worse(grouped: list[tuple[str, list[dict[str, Any]], str]],
                            slo: Slo | None) -> list[Finding]:
    findings = []
    limit = _limit(slo, "ttft")
    # across configurations at the same offered load
    for i, (name_a, runs_a, _) in enumerate(grouped):
        for name_b, runs_b, _ in grouped[i + 1:]:
            for a in runs_a:
                for b in (r for r in runs_b if _point(r) == _point(a)):
                    for base, other, base_name, other_name in ((a, b, name_a, name_b),
                                                               (b, a, name_b, name_a)):
                        finding = _config_tradeoff(base, other, base_name, other_name)
                        if finding:
                            findings.append(finding)
    # along one sweep: past the knee throughput barely moves while p95 explodes
    for name, runs, _ in grouped:
        for low, high in zip(runs, runs[1:]):
            if not (low["request_throughput"] and low["p95_ttft_ms"] and high["p95_ttft_ms"]):
                continue
            gain = high["request_throughput"] / low["request_throughput"] - 1
            blowup = high["p95_ttft_ms"] / low["p95_ttft_ms"]
            if 0 < gain < SATURATED_GAIN and blowup >= P95_BLOWUP \
                    and high["p95_ttft_ms"] / 1000 > limit:
                running = low.get("num_requests_running_peak")
                cap = f" (running peaked at {running:g} there)" if running is not None else ""
                findings.append(Finding(
                    "throughput_up_p95_worse", "Throughput up, but p95 worse", name,
                    f"from {shown_label(low)} to {shown_label(high)} completed req/s rose only "
                    f"{gain:.0%} ({low['request_throughput']:.2f} -> "
                    f"{high['request_throughput']:.2f}) while p95 TTFT grew {blowup:.1f}x "
                    f"({low['p95_ttft_ms'] / 1000:.2f} -> {high['p95_ttft_ms'] / 1000:.2f} s, "
                    f"limit {limit:g} s): the server admits more concurrent work than the "
                    f"interactive target allows. Cap admission near the lower load's level{cap}, "
                    "or add a queue timeout / separate pool, and retest at the same load.",
                    "--max-num-queued-reqs (cap the queue; or --queue-timeout)",
                    {"low": _point(low), "high": _point(high), "throughput_gain": gain,
                     "p95_ttft_ratio": blowup}))
    return findings


def _config_tradeoff(a: dict[str, Any], b: dict[str, Any], name_a: str,
                     name_b: str) -> Finding | None:
    """b beats a on throughput but loses on p95 latency at the same offered load."""
    if not a["request_throughput"] or b["request_throughput"] < (1 + THROUGHPUT_GAIN) * \
            a["request_throughput"]:
        return None
    worse = [(key, label) for key, label in (("p95_ttft_ms", "p95 TTFT"),
                                             ("p95_e2el_ms", "p95 E2E"))
             if a[key] and b[key] and b[key] >= (1 + P95_LOSS) * a[key]]
    if not worse:
        return None
    latency = ", ".join(f"{label} {a[key] / 1000:.2f} -> {b[key] / 1000:.2f} s"
                        for key, label in worse)
    return Finding(
        "throughput_up_p95_worse", "Throughput up, but p95 worse", f"{name_a} vs {name_b}",
        f"at {shown_label(a)}, {name_b} completes {b['request_throughput']:.2f} req/s against "
        f"{name_a}'s {a['request_throughput']:.2f} (+"
        f"{b['request_throughput'] / a['request_throughput'] - 1:.0%}) but {latency}: it accepts "
        "more concurrent work than an interactive target allows. Limit admission (or a queue "
        "timeout / separate pool) and retest at the same offered load.",
        "--max-num-seqs (lower, on the faster configuration)",
        {"point": _point(a), "throughput": [a["request_throughput"], b["request_throughput"]],
         **{key: [a[key], b[key]] for key, _ in worse}})


def _point(run: dict[str, Any]) -> tuple[Any, Any]:
    return run["request_rate"], run.get("max_concurrency")


def _limit(slo: Slo | None, metric: str) -> float:
    if slo:
        for m, _, limit in slo.limits:
            if m == metric:
                return limit
    return DEFAULT_TTFT_LIMIT_S


RUN_RULES = (client_limited, failed_requests, waiting_with_memory_free, kv_cache_full,
             batch_at_cap, ttft_long_prompts, preemptions_or_oom, upstream_bottleneck)


def diagnose(obj: dict[str, Any], slo: Slo | None = None) -> list[Finding]:
    """All findings for a run, sweep or compare result (an SLO sharpens the latency rules;
    by default the run's own SLO is used)."""
    grouped = groups(obj)
    if slo is None:
        text = next((r["slo"] for _, runs, _ in grouped for r in runs if r.get("slo")), None)
        slo = Slo.parse(text) if text else None
    findings = [f for _, runs, flags in grouped for run in runs
                for rule in RUN_RULES for f in rule(run, flags, slo)]
    return findings + throughput_up_p95_worse(grouped, slo)


# -- what bounds a run when no rule fires ----------------------------------------------------

_BOUND_ADVICE = {
    "queue": "requests wait for a slot: the server is at capacity at this load (compare a lower "
             "rate, or add capacity)",
    "prefill": "TTFT is prompt compute, not queueing: shorter prompts, a shared prefix (prefix "
               "caching) or a larger --max-num-batched-tokens shorten it",
    "decode": "time per output token is the model's step time, which grows with the batch "
              "(--max-num-seqs trades it against throughput) and with the model's size",
}


def what_bounds(obj: dict[str, Any]) -> list[str]:
    """One line per run of a run, sweep or compare result: where its completed requests spent
    their time on average, and what would shorten the largest part."""
    return [bound(run) for _, runs, _ in groups(obj) for run in runs]


def bound(run: dict[str, Any]) -> str:
    e2e_ms, ttft_ms = run.get("mean_e2el_ms"), run.get("mean_ttft_ms")
    if not e2e_ms or ttft_ms is None:
        return f"{shown_label(run)}: no request completed, so no time to apportion"
    queue_ms = (run.get("queue_time") or {}).get("mean_ms")
    parts = {"queue": queue_ms or 0.0, "prefill": max(ttft_ms - (queue_ms or 0.0), 0.0),
             "decode": max(e2e_ms - ttft_ms, 0.0)}
    largest = max(parts, key=lambda k: parts[k])
    total = sum(parts.values()) or 1.0
    shares = ", ".join(f"{k} {v / total:.0%}" for k, v in parts.items())
    unknown = "" if queue_ms is not None else " (no server queue metric: prefill includes it)"
    return (f"{shown_label(run)}: {largest}-bound; of a mean E2E of {e2e_ms / 1000:.2f} s: "
            f"{shares}{unknown}. {_BOUND_ADVICE[largest]}.")
