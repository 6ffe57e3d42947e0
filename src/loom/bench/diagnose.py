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

from collections.abc import Mapping
from typing import Any

from loom.bench.rules import (
    P95_BLOWUP,
    P95_LOSS,
    RUN_RULES,
    SATURATED_GAIN,
    THROUGHPUT_GAIN,
    Finding,
    limit_of,
)
from loom.bench.scorecard import shown_label
from loom.workload.results import Group, Result, RunResult, as_run, groups
from loom.workload.slo import Slo, parse_slo

# -- rules across runs -----------------------------------------------------------------------

def throughput_up_p95_worse(grouped: list[Group], slo: Slo | None) -> list[Finding]:
    findings = []
    limit = limit_of(slo, "ttft")
    # across configurations at the same offered load
    for i, (name_a, runs_a, _) in enumerate(grouped):
        for name_b, runs_b, _ in grouped[i + 1:]:
            for a in runs_a:
                for b in (r for r in runs_b if r.point == a.point):
                    for base, other, base_name, other_name in ((a, b, name_a, name_b),
                                                               (b, a, name_b, name_a)):
                        finding = _config_tradeoff(base, other, base_name, other_name)
                        if finding:
                            findings.append(finding)
    # along one sweep: past the knee throughput barely moves while p95 explodes
    for name, runs, _ in grouped:
        for low_run, high_run in zip(runs, runs[1:]):
            low, high = low_run.figures, high_run.figures
            if not (low.request_throughput and low.ttft.p95 and high.ttft.p95):
                continue
            gain = high.request_throughput / low.request_throughput - 1
            blowup = high.ttft.p95 / low.ttft.p95
            if 0 < gain < SATURATED_GAIN and blowup >= P95_BLOWUP \
                    and high.ttft.p95 / 1000 > limit:
                running = low_run.metrics.num_requests_running.peak
                cap = f" (running peaked at {running:g} there)" if running is not None else ""
                findings.append(Finding(
                    "throughput_up_p95_worse", "Throughput up, but p95 worse", name,
                    f"from {shown_label(low_run)} to {shown_label(high_run)} completed req/s rose "
                    f"only {gain:.0%} ({low.request_throughput:.2f} -> "
                    f"{high.request_throughput:.2f}) while p95 TTFT grew {blowup:.1f}x "
                    f"({low.ttft.p95 / 1000:.2f} -> {high.ttft.p95 / 1000:.2f} s, "
                    f"limit {limit:g} s): the server admits more concurrent work than the "
                    f"interactive target allows. Cap admission near the lower load's level{cap}, "
                    "or add a queue timeout / separate pool, and retest at the same load.",
                    "--max-num-queued-reqs (cap the queue; or --queue-timeout)",
                    {"low": low_run.point, "high": high_run.point, "throughput_gain": gain,
                     "p95_ttft_ratio": blowup}))
    return findings


def _config_tradeoff(run_a: RunResult, run_b: RunResult, name_a: str,
                     name_b: str) -> Finding | None:
    """b beats a on throughput but loses on p95 latency at the same offered load."""
    a, b = run_a.figures, run_b.figures
    if not a.request_throughput or b.request_throughput < (1 + THROUGHPUT_GAIN) * \
            a.request_throughput:
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
        f"at {shown_label(run_a)}, {name_b} completes {b.request_throughput:.2f} req/s against "
        f"{name_a}'s {a.request_throughput:.2f} (+"
        f"{b.request_throughput / a.request_throughput - 1:.0%}) but {latency}: it accepts "
        "more concurrent work than an interactive target allows. Limit admission (or a queue "
        "timeout / separate pool) and retest at the same offered load.",
        "--max-num-seqs (lower, on the faster configuration)",
        {"point": run_a.point, "throughput": [a.request_throughput, b.request_throughput],
         **{key: [a[key], b[key]] for key, _ in worse}})


def diagnose(obj: Result | Mapping[str, Any], slo: Slo | None = None) -> list[Finding]:
    """All findings for a run, sweep or compare result (an SLO sharpens the latency rules;
    by default the run's own SLO is used)."""
    grouped = groups(obj)
    if slo is None:
        slo = parse_slo(next((r.slo for _, runs, _ in grouped for r in runs if r.slo), None))
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


def what_bounds(obj: Result | Mapping[str, Any]) -> list[str]:
    """One line per run of a run, sweep or compare result: where its completed requests spent
    their time on average, and what would shorten the largest part."""
    return [bound(run) for _, runs, _ in groups(obj) for run in runs]


def bound(run: RunResult | Mapping[str, Any]) -> str:
    run = as_run(run)
    e2e_ms, ttft_ms = run.figures.e2el.mean, run.figures.ttft.mean
    if not e2e_ms or ttft_ms is None:
        return f"{shown_label(run)}: no request completed, so no time to apportion"
    queue_ms = run.metrics.queue_time.mean if run.metrics.queue_time else None
    parts = {"queue": queue_ms or 0.0, "prefill": max(ttft_ms - (queue_ms or 0.0), 0.0),
             "decode": max(e2e_ms - ttft_ms, 0.0)}
    largest = max(parts, key=lambda k: parts[k])
    total = sum(parts.values()) or 1.0
    shares = ", ".join(f"{k} {v / total:.0%}" for k, v in parts.items())
    unknown = "" if queue_ms is not None else " (no server queue metric: prefill includes it)"
    return (f"{shown_label(run)}: {largest}-bound; of a mean E2E of {e2e_ms / 1000:.2f} s: "
            f"{shares}{unknown}. {_BOUND_ADVICE[largest]}.")
