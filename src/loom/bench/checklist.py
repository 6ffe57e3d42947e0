"""The practical decision checklist, answered from measured data.

Five questions decide whether a configuration is ready, each answered pass / fail / not
measured with the numbers behind it, never from a single throughput figure:

1. latency: does the main scenario meet its p95 TTFT and E2E targets (the SLO)?
2. burst: what did a burst above the normal rate do: refuse work cleanly, let latency spike
   (beyond the TTFT target: a fail), or absorb it, and did service come back to normal
   within the run?
3. memory: preemptions and KV cache pressure at the context lengths the trace uses?
4. reproducibility: are the figures stable across repeats, and did the client keep pace?
5. cost: machine time per accepted answer (answers that failed or were refused bought
   nothing; idle time between arrivals is paid for too) against the alternative.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from loom.bench.overload import burst_outcomes
from loom.bench.scorecard import shown_label
from loom.workload.figures import request_figures
from loom.workload.results import RunResult, as_runs
from loom.workload.slo import Slo

PASS, FAIL, NOT_MEASURED = "pass", "fail", "not measured"
KV_PRESSURE = 0.9        # peak KV cache usage that leaves no headroom
STABLE_THROUGHPUT = 0.10  # half-width of the repeats' 95% interval / median, output tok/s
STABLE_TTFT = 0.25        # the same for p95 TTFT, a tail figure and noisier


@dataclass(frozen=True)
class Answer:
    key: str
    question: str
    status: str
    numbers: str


# (configuration, its runs, its flags): typed runs, or as their files hold them
Group = tuple[str, Sequence[RunResult | Mapping[str, Any]], str]


def answer(groups: Sequence[Group], main: str | None = None, slo: Slo | None = None,
           gpu_cost_per_hour: float | None = None) -> tuple[str, list[Answer]]:
    """(the configuration decided on, the five answers for it)."""
    typed = [(name, as_runs(runs)) for name, runs, _ in groups]
    names = [name for name, _ in typed]
    chosen = main if main is not None else names[0]
    if chosen not in names:
        raise ValueError(f"--main {chosen!r} is not one of the configurations: "
                         f"{', '.join(names)}")
    runs = next(runs for name, runs in typed if name == chosen)
    others = [(name, rs) for name, rs in typed if name != chosen]
    return chosen, [latency(runs, slo), burst(runs, slo), memory(runs),
                    reproducibility(runs), cost(chosen, runs, others, slo, gpu_cost_per_hour)]


def _steady(runs: list[RunResult]) -> list[RunResult]:
    """The runs at the normal rate (no burst), else all."""
    return [r for r in runs if not r.load.burst] or runs


def latency(runs: list[RunResult], slo: Slo | None) -> Answer:
    question = "Main scenario: p95 TTFT and E2E within their targets?"
    targets = {m: limit for m, p, limit in slo.limits if p == 95} if slo else {}
    missing = [m for m in ("ttft", "e2e") if m not in targets]
    if missing:
        return Answer("latency", question, NOT_MEASURED,
                      f"no target for {' and '.join(f'{m}_p95' for m in missing)}: give --slo "
                      "ttft_p95=S,e2e_p95=S")
    parts, ok = [], True
    for run in _steady(runs):
        ttft, e2e = run.figures.ttft.p95, run.figures.e2el.p95
        if ttft is None or e2e is None:
            parts.append(f"{shown_label(run)}: nothing completed")
            ok = False
            continue
        met = ttft <= 1000 * targets["ttft"] and e2e <= 1000 * targets["e2e"]
        ok &= met
        parts.append(f"{shown_label(run)}: p95 TTFT {ttft / 1000:.2f} s "
                     f"({'<=' if ttft <= 1000 * targets['ttft'] else '>'} {targets['ttft']:g}), "
                     f"p95 E2E {e2e / 1000:.2f} s "
                     f"({'<=' if e2e <= 1000 * targets['e2e'] else '>'} {targets['e2e']:g})")
    return Answer("latency", question, PASS if ok else FAIL, "; ".join(parts))


def burst(runs: list[RunResult], slo: Slo | None) -> Answer:
    question = "A burst above the normal rate: bounded queue, clean rejection or latency spike?"
    outcomes = [(run, o) for run in runs if (o := burst_outcomes(run, slo))]
    if not outcomes:
        return Answer("burst", question, NOT_MEASURED, "no run had a burst: give --burst "
                                                       "5x:30s")
    ttft_limit = slo.limit("ttft") if slo else None
    parts, ok = [], True
    for run, o in outcomes:
        during, before = o.during, o.before
        recovered = o.recovery_s is not None
        clean = during.timeouts == 0 and during.errors == 0
        spike_ok = o.response != "latency spike" or (
            ttft_limit is not None and during.p95_ttft_ms is not None
            and during.p95_ttft_ms <= 1000 * ttft_limit)
        ok &= recovered and clean and spike_ok
        spike = f"p95 TTFT {_s(before.p95_ttft_ms)} s before -> {_s(during.p95_ttft_ms)} s during"
        queue = "" if o.queue_peak_during is None else \
            f", server queue peaked at {o.queue_peak_during:g}"
        paid = f", {o.paid['class']} paid most" if o.paid.get("class") else ""
        over = f", counted over {run.repeats} repeats" if run.repeats > 1 else ""
        parts.append(
            f"{shown_label(run)} ({o.burst.factor:g}x for {o.burst.length_s:g} s{over}): "
            f"{o.response}; {during.sent} sent during it, {during.completed} answered, "
            f"{during.rejected} refused, {during.timeouts} timed out; {spike}{queue}; "
            f"goodput {o.goodput_during:.2f} req/s ({o.goodput_basis}); "
            + (f"back to normal {o.recovery_s:.1f} s after it" if recovered
               else "not back to normal by the end of the run") + paid)
    return Answer("burst", question, PASS if ok else FAIL, "; ".join(parts))


def _s(ms: float | None) -> str:
    return "-" if ms is None else f"{ms / 1000:.2f}"


def memory(runs: list[RunResult]) -> Answer:
    question = "Preemptions and KV cache pressure at the intended context length?"
    preemptions = [p for r in runs if (p := r.metrics.preemptions) is not None]
    peaks = [p for r in runs if (p := r.metrics.kv_cache_usage.peak) is not None]
    oom = sum(bool(re.search(r"out of memory|\bOOM\b", e, re.I))
              for r in runs for e in r.errors)
    if not preemptions and not peaks:
        return Answer("memory", question, NOT_MEASURED,
                      "the server exported no preemption or KV usage metrics")
    longest = max((q.prompt_len or 0) + q.max_tokens for r in runs for q in r.requests)
    peak = max(peaks) if peaks else None
    ok = sum(preemptions) == 0 and (peak is None or peak < KV_PRESSURE) and oom == 0
    return Answer("memory", question, PASS if ok else FAIL,
                  f"{sum(preemptions)} preemptions over "
                  f"{sum(r.figures.num_prompts for r in runs)} "
                  f"requests; KV cache usage peaked at "
                  f"{'-' if peak is None else f'{peak:.0%}'} (pressure from "
                  f"{KV_PRESSURE:.0%}); {oom} out-of-memory errors; longest request "
                  f"{longest} tokens (prompt + output)")


def reproducibility(runs: list[RunResult]) -> Answer:
    question = "Reproducible across repeats, with a client that kept pace?"
    limited = [shown_label(r) for r in runs if r.client.limited]
    repeated = [r for r in runs if r.repeats > 1]
    if not repeated:
        return Answer("reproducibility", question, NOT_MEASURED if not limited else FAIL,
                      "one run per point: give --repeats K (K >= 2)"
                      + (f"; the client limited {', '.join(limited)}" if limited else ""))
    parts, ok = [], not limited
    for run in repeated:
        widths = {}
        for key in ("output_throughput", "p95_ttft_ms"):
            interval, value = run.ci.get(key), run.figures.get(key)
            if interval and value:
                widths[key] = (interval[1] - interval[0]) / 2 / value
        ok &= widths.get("output_throughput", 0) <= STABLE_THROUGHPUT \
            and widths.get("p95_ttft_ms", 0) <= STABLE_TTFT
        parts.append(f"{shown_label(run)} over {run.repeats} repeats: output tok/s "
                     f"+/-{widths.get('output_throughput', 0):.0%}, p95 TTFT "
                     f"+/-{widths.get('p95_ttft_ms', 0):.0%} (95% interval half-width)")
    if limited:
        parts.append(f"the client, not the server, limited {', '.join(limited)}")
    return Answer("reproducibility", question, PASS if ok else FAIL,
                  "; ".join(parts) + f" (stable: within +/-{STABLE_THROUGHPUT:.0%} and "
                                     f"+/-{STABLE_TTFT:.0%})")


def accepted(run: RunResult, slo: Slo | None) -> int:
    """Answers that count: within the SLO when one is given, else completed."""
    if slo is None:
        return run.figures.completed
    goodput = request_figures(run.requests, run.duration, slo).goodput
    return goodput.good if goodput else 0


def cost(name: str, runs: list[RunResult], others: list[tuple[str, list[RunResult]]],
         slo: Slo | None, gpu_cost_per_hour: float | None) -> Answer:
    question = "Cost per accepted answer against the alternative (after retries and idle)?"
    if not others:
        return Answer("cost", question, NOT_MEASURED, "no alternative configuration to compare")
    points = {r.point for r in runs}

    def per_answer(rs: list[RunResult]) -> float | None:
        shared = [r for r in rs if r.point in points]
        answers = sum(accepted(r, slo) for r in shared)
        return sum(r.duration for r in shared) / answers if answers else None

    unit, scale = (("$", gpu_cost_per_hour / 3600) if gpu_cost_per_hour is not None
                   else ("machine-s", 1.0))
    mine = per_answer(runs)
    theirs = {other: per_answer(rs) for other, rs in others}
    text = ", ".join(f"{n} {_cost(v, scale)}" for n, v in theirs.items())
    basis = f"answers within {slo}" if slo else "completed answers"
    numbers = (f"{unit} per accepted answer ({basis}; run time, idle included, over answers "
               f"that succeeded): {name} {_cost(mine, scale)}; {text}")
    known = [v for v in theirs.values() if v is not None]
    if mine is None:
        return Answer("cost", question, FAIL, numbers)
    return Answer("cost", question, PASS if not known or mine <= min(known) else FAIL, numbers)


def _cost(value: float | None, scale: float) -> str:
    return "-" if value is None else f"{value * scale:.3g}"
