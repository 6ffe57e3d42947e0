"""Per-request timings + server scrapes -> the figures of one run, under `vllm bench serve`'s
key names (so existing tooling reads them) plus loom's own; and reading result files back.

Counting: every request sent is `completed` (status ok), `cancelled` (the client walked away,
as the trace asked), or `failed`; `rejected` (HTTP 503/429) is the part of `failed` that
admission control refused, `timeouts` the part that outlived --request-timeout. error_rate =
failed / num_prompts. Latency figures are over completed requests, in ms, like vLLM's.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loom.bench.client import CANCELLED, OK, REJECTED, TIMEOUT, RequestResult
from loom.bench.scrape import Snapshot

PERCENTILES = (50, 90, 95, 99)
RESULT_VERSION = 1


@dataclass(frozen=True)
class Slo:
    """Service-level objective, e.g. 'ttft_p95=1.0,e2e_p95=10' (seconds).

    Per request, "good" means ttft <= the ttft limit and e2e <= the e2e limit (and tpot <=
    its limit when given); the percentile in a key is the share of requests the service
    promises to keep within it, which the scorecard checks against the run's percentiles.
    """

    limits: tuple[tuple[str, int, float], ...]  # (metric, percentile, seconds)

    METRICS = ("ttft", "tpot", "e2e")

    @classmethod
    def parse(cls, text: str) -> Slo:
        """'ttft_p95=1.0,e2e_p95=10'; a limit is seconds > 0 and a percentile 1-100, else
        every request would miss it (or the term means nothing)."""
        limits = []
        for part in text.split(","):
            key, sep, value = part.partition("=")
            metric, _, pct = key.strip().partition("_p")
            try:
                percentile, seconds = int(pct) if pct else 95, float(value)
            except ValueError:
                percentile = seconds = -1
            if not sep or metric not in cls.METRICS or not 0 < percentile <= 100 \
                    or not 0 < seconds < float("inf"):
                raise ValueError(f"--slo: bad term {part!r}; use e.g. ttft_p95=1.0,e2e_p95=10 "
                                 "(seconds > 0, percentile 1-100)")
            limits.append((metric, percentile, seconds))
        return cls(tuple(limits))

    def __str__(self) -> str:
        return ",".join(f"{m}_p{p}={v:g}" for m, p, v in self.limits)

    def good(self, r: RequestResult) -> bool:
        if r.status != OK:
            return False
        values = {"ttft": r.ttft_s, "tpot": r.tpot_s, "e2e": r.e2e_s}
        return all(values[m] is None or values[m] <= limit for m, _, limit in self.limits)

    def met(self, result: dict[str, Any]) -> bool | None:
        """Do the run's percentiles meet every limit? None when a figure is missing."""
        key = {"ttft": "ttft", "tpot": "tpot", "e2e": "e2el"}
        checks = [result.get(f"p{p}_{key[m]}_ms") for m, p, _ in self.limits]
        if any(c is None for c in checks):
            return None
        return all(c <= 1000 * limit for c, (_, _, limit) in zip(checks, self.limits))


def _stats(prefix: str, values_s: list[float]) -> dict[str, float | None]:
    """mean/median/std/pNN of seconds, as vLLM's `{stat}_{prefix}_ms` keys."""
    keys = [f"mean_{prefix}_ms", f"median_{prefix}_ms", f"std_{prefix}_ms"]
    keys += [f"p{p}_{prefix}_ms" for p in PERCENTILES]
    if not values_s:
        return dict.fromkeys(keys)
    ms = np.asarray(values_s) * 1000.0
    values = [ms.mean(), np.median(ms), ms.std(), *np.percentile(ms, PERCENTILES)]
    return {k: float(v) for k, v in zip(keys, values)}


def request_figures(results: list[RequestResult], duration_s: float,
                    slo: Slo | None) -> dict[str, Any]:
    """Counts, throughputs, latency percentiles and goodput of a set of requests."""
    done = [r for r in results if r.status == OK]
    cancelled = sum(r.status == CANCELLED for r in results)
    rejected = sum(r.status == REJECTED for r in results)
    timeouts = sum(r.status == TIMEOUT for r in results)
    failed = len(results) - len(done) - cancelled
    total_in = sum(r.prompt_len or 0 for r in done)
    total_out = sum(r.output_tokens for r in done)
    duration_s = max(duration_s, 1e-9)
    figures: dict[str, Any] = {
        "num_prompts": len(results), "completed": len(done), "failed": failed,
        "rejected": rejected, "timeouts": timeouts, "cancelled": cancelled,
        "error_rate": failed / len(results) if results else 0.0,
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(done) / duration_s,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
    }
    figures.update(_stats("ttft", [r.ttft_s for r in done]))
    figures.update(_stats("tpot", [r.tpot_s for r in done if r.tpot_s is not None]))
    figures.update(_stats("itl", [x for r in done for x in r.itls_s]))
    figures.update(_stats("e2el", [r.e2e_s for r in done]))
    good = sum(slo.good(r) for r in results) if slo else None
    figures["request_goodput"] = good / duration_s if slo else None
    figures["goodput"] = None if slo is None else {
        "slo": str(slo), "good": good, "request_goodput": good / duration_s,
        "fraction": good / len(results) if results else 0.0, "slo_met": slo.met(figures)}
    return figures


def per_class(results: list[RequestResult], duration_s: float,
              slo: Slo | None) -> dict[str, dict[str, Any]]:
    """The figures of each request class on its own: does one class pay for another?"""
    keep = ("num_prompts", "completed", "failed", "rejected", "timeouts", "cancelled",
            "error_rate",
            "request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms",
            "p95_ttft_ms", "mean_tpot_ms", "p95_tpot_ms", "p95_itl_ms", "median_e2el_ms",
            "p95_e2el_ms", "request_goodput")
    out = {}
    for cls in sorted({r.cls for r in results}):
        figures = request_figures([r for r in results if r.cls == cls], duration_s, slo)
        out[cls] = {k: figures[k] for k in keep}
    return out


def server_figures(before: Snapshot | None, after: Snapshot | None,
                   timeline: list[dict[str, Any]]) -> dict[str, Any]:
    """What the server's /metrics said about the run: deltas of counters and histograms
    between the scrapes before and after it, peaks and means of gauges over the timeline."""
    out: dict[str, Any] = {"metrics_source": after.source if after else None,
                           "queue_time": None, "server_ttft": None, "preemptions": None,
                           "prefix_cache_hit_rate": None, "server_rejected": None}
    if after is None:
        return out
    for canon, key in (("queue_time", "queue_time"), ("ttft", "server_ttft")):
        if canon in after.histograms:
            out[key] = after.histograms[canon].minus(
                before.histograms.get(canon) if before else None).summary()

    def delta(name: str) -> float | None:
        if name not in after.counters:
            return None
        return after.counters[name] - (before.counters.get(name, 0.0) if before else 0.0)

    if (preemptions := delta("preemptions")) is not None:
        out["preemptions"] = int(preemptions)
    if (rejected := delta("rejected")) is not None:
        out["server_rejected"] = int(rejected)
    queries, hits = delta("prefix_cache_queries"), delta("prefix_cache_hits")
    if queries and hits is not None:
        out["prefix_cache_hit_rate"] = hits / queries
    for gauge, key in (("kv_usage", "kv_cache_usage"), ("running", "num_requests_running"),
                       ("waiting", "num_requests_waiting")):
        values = [e[gauge] for e in timeline if e.get(gauge) is not None]
        out[f"{key}_peak"] = max(values) if values else None
        out[f"{key}_mean"] = float(np.mean(values)) if values else None
    return out


def exact_summary(values_s: list[float]) -> dict[str, Any]:
    """count, mean and percentiles in ms of exact values, in the shape `server_figures` gives a
    server histogram (for sources that know each value, such as a simulation)."""
    out: dict[str, Any] = {"count": len(values_s),
                           "mean_ms": 1000 * float(np.mean(values_s)) if values_s else None}
    for p in PERCENTILES:
        out[f"p{p}_ms"] = 1000 * float(np.percentile(values_s, p)) if values_s else None
    return out


# A client is "limited" (it, not the server, set the pace) when any of these is crossed.
CLIENT_SEND_LAG_S = 0.25   # p95 lateness of open-loop sends
CLIENT_LOOP_LAG_S = 0.1    # p95 oversleep of the client's event loop
CLIENT_CPU_SHARE = 0.9     # of one core: the client's process had no CPU to spare


def client_figures(results: list[RequestResult], timeline: list[dict[str, Any]],
                   stats: dict[str, float] | None = None, loop_lags_s: list[float] | None = None,
                   closed_loop: bool = False) -> dict[str, Any]:
    """How well the load generator kept its schedule: a late send is the client's queueing,
    not the server's, and must not be mistaken for it. In a closed loop a send waits for a
    free user by design, so there only the event loop's lateness and the CPU count."""
    lags = [max(0.0, r.start_s - r.scheduled_s) for r in results]
    in_flight = [e["client_in_flight"] for e in timeline]
    out: dict[str, Any] = {
        "send_lag_p95_ms": float(np.percentile(lags, 95)) * 1000 if lags else None,
        "send_lag_max_ms": max(lags) * 1000 if lags else None,
        "in_flight_peak": max(in_flight) if in_flight else None,
        "in_flight_mean": float(np.mean(in_flight)) if in_flight else None,
        "cpu_s": None, "cpu_share": None, "loop_lag_p95_ms": None, "loop_lag_max_ms": None}
    if stats:
        out["cpu_s"] = stats["cpu_s"]
        out["cpu_share"] = stats["cpu_s"] / max(stats["wall_s"], 1e-9)
    if loop_lags_s:
        out["loop_lag_p95_ms"] = float(np.percentile(loop_lags_s, 95)) * 1000
        out["loop_lag_max_ms"] = max(loop_lags_s) * 1000
    out["limited_reasons"] = client_limits(out, closed_loop)
    out["limited"] = bool(out["limited_reasons"])
    return out


def client_limits(client: dict[str, Any], closed_loop: bool) -> list[str]:
    """Why the client, not the server, may have limited a run (empty: it kept pace)."""
    reasons = []
    lag, loop = client.get("send_lag_p95_ms"), client.get("loop_lag_p95_ms")
    if not closed_loop and lag is not None and lag > 1000 * CLIENT_SEND_LAG_S:
        reasons.append(f"p95 send lag {lag / 1000:.2f} s behind schedule")
    if loop is not None and loop > 1000 * CLIENT_LOOP_LAG_S:
        reasons.append(f"the client's event loop woke p95 {loop:.0f} ms late")
    share = client.get("cpu_share")
    if share is not None and share >= CLIENT_CPU_SHARE:
        reasons.append(f"the client used {share:.0%} of a core")
    return reasons


def offered_rate(results: list[RequestResult], duration_s: float) -> float:
    """Requests/s the client actually offered: sends over the span of sending, but never
    below sends over the run's duration, the span completed req/s is measured over; else a
    short run (n - 1 gaps in the span, n answers in the duration) would complete more
    requests per second than it was offered."""
    span = max((r.scheduled_s for r in results), default=0.0)
    overall = len(results) / max(duration_s, 1e-9)
    if len(results) > 1 and span > 0:
        return max((len(results) - 1) / span, overall)
    return overall


def save_json(obj: dict[str, Any], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=1, allow_nan=False) + "\n")


def check_writable(path: str | Path, flag: str) -> None:
    """Fail now, naming the flag, if `path` cannot be written later (a directory, a read-only
    or pseudo file system): a result computed for minutes must not be lost at the end. Its
    missing parent folders are created, as writing would; the file itself is not."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a directory; give a file name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            with path.open("a"):
                pass
        else:
            with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".loom-check-"):
                pass
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None


def check_folder_writable(path: str | Path, flag: str) -> None:
    """The folder results will be written into, made now: a bad path fails before work."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path}: exists and is not a directory")
    check_writable(path / "compare.json", flag)


def load_json(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def load_result(path: str | Path) -> dict[str, Any]:
    """A run JSON, a sweep JSON, a compare directory or its compare.json, checked to hold
    what the scorecard and diagnose read, so a wrong file is one error naming it."""
    path = Path(path)
    if path.is_dir():
        if not (path / "compare.json").is_file():
            raise ValueError(f"{path}: a folder without compare.json: give a run or sweep "
                             "JSON, or the folder `loom bench compare --out-dir` wrote")
        path = path / "compare.json"
    elif not path.is_file():
        raise ValueError(f"{path}: no such file (a run or sweep JSON, or a compare folder)")
    obj = load_json(path)
    if not isinstance(obj, dict) or obj.get("kind") not in ("run", "sweep", "compare"):
        raise ValueError(f"{path}: not a loom bench result (run, sweep or compare)")
    if obj["kind"] == "compare" and "sweeps" not in obj:
        configs = obj.get("configs")
        if not isinstance(configs, list) or not all(
                isinstance(e, dict) and isinstance(e.get("file"), str) for e in configs):
            raise ValueError(f"{path}: a compare index needs configs, each with a file")
        obj["sweeps"] = [load_json(path.parent / e["file"]) for e in configs]
    sweeps = obj["sweeps"] if obj["kind"] == "compare" else [obj] if obj["kind"] == "sweep" \
        else []
    for sweep in sweeps:
        if not isinstance(sweep, dict) or not isinstance(sweep.get("runs"), list):
            raise ValueError(f"{path}: a sweep without a list of runs")
    runs = [obj] if obj["kind"] == "run" else [r for s in sweeps for r in s["runs"]]
    for i, run in enumerate(runs):
        missing = [k for k in RUN_KEYS if not isinstance(run, dict) or k not in run]
        if missing:
            where = "the run" if obj["kind"] == "run" else f"run {i + 1}"
            raise ValueError(f"{path}: {where} lacks {', '.join(missing)}: not a complete "
                             "loom bench result")
    return obj


# What every run must hold for the scorecard and diagnose to read it.
RUN_KEYS = ("request_rate", "num_prompts", "completed", "error_rate", "request_throughput",
            "offered_rate", "requests")


def groups(obj: dict[str, Any]) -> list[tuple[str, list[dict[str, Any]], str]]:
    """(configuration name, its runs, its server flags) of a result."""
    if obj["kind"] == "run":
        return [(obj.get("label") or "run", [obj], "")]
    sweeps = obj["sweeps"] if obj["kind"] == "compare" else [obj]
    return [(s.get("label") or f"config {i}", s["runs"], (s.get("config") or {}).get("flags", ""))
            for i, s in enumerate(sweeps)]


def run_label(run: dict[str, Any]) -> str:
    """A run's name in tables and findings: its label, else its offered load."""
    if run.get("label"):
        return run["label"]
    rate, users = run["request_rate"], run.get("max_concurrency")
    if rate == "trace":
        return "trace arrivals"
    if rate == "inf":
        return f"x{users}" if users else "all at once"
    return f"@{rate:g}/s"


def requests_of(run: dict[str, Any]) -> list[RequestResult]:
    return [RequestResult.from_json(r) for r in run["requests"]]
