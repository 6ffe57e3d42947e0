"""Reading a server's Prometheus `/metrics` into server-neutral figures.

Queue time, preemptions, KV usage and prefix-cache hits exist only inside the server, so the
client reads them from `/metrics`. Each figure has a canonical name here and the names it goes
by in loom (`loom:`), vLLM (`vllm:`), SGLang (`sglang:`) and llama.cpp (`llamacpp:`); a
server that exports none of them simply yields no server figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from loom.workload.figures import PERCENTILES, Latency
from loom.workload.monitoring import Sample, ServerFigures

# canonical -> sample names, first match wins; (how label sets combine: sum or max)
GAUGES: dict[str, tuple[tuple[str, ...], str]] = {
    "running": (("loom:num_requests_running", "vllm:num_requests_running",
                 "sglang:num_running_reqs", "llamacpp:requests_processing"), "sum"),
    "waiting": (("loom:num_requests_waiting", "vllm:num_requests_waiting",
                 "sglang:num_queue_reqs", "llamacpp:requests_deferred"), "sum"),
    "kv_usage": (("loom:kv_cache_usage_perc", "vllm:kv_cache_usage_perc",
                  "vllm:gpu_cache_usage_perc", "sglang:token_usage",
                  "llamacpp:kv_cache_usage_ratio"), "max"),
}
COUNTERS: dict[str, tuple[str, ...]] = {
    "preemptions": ("loom:num_preemptions_total", "vllm:num_preemptions_total"),
    "prefix_cache_queries": ("loom:prefix_cache_queries_total", "vllm:prefix_cache_queries_total",
                             "vllm:gpu_prefix_cache_queries_total"),
    "prefix_cache_hits": ("loom:prefix_cache_hits_total", "vllm:prefix_cache_hits_total",
                          "vllm:gpu_prefix_cache_hits_total"),
    "rejected": ("loom:request_rejected_total",),
    "prompt_tokens": ("loom:prompt_tokens_total", "vllm:prompt_tokens_total",
                      "sglang:prompt_tokens_total", "llamacpp:prompt_tokens_total"),
    "generation_tokens": ("loom:generation_tokens_total", "vllm:generation_tokens_total",
                          "sglang:generation_tokens_total", "llamacpp:tokens_predicted_total"),
}
HISTOGRAMS: dict[str, tuple[str, ...]] = {
    "queue_time": ("loom:request_queue_time_seconds", "vllm:request_queue_time_seconds"),
    "ttft": ("loom:time_to_first_token_seconds", "vllm:time_to_first_token_seconds",
             "sglang:time_to_first_token_seconds"),
}


@dataclass
class Histogram:
    buckets: dict[float, float] = field(default_factory=dict)  # upper bound -> cumulative count
    sum: float = 0.0
    count: float = 0.0

    def minus(self, earlier: Histogram | None) -> Histogram:
        if earlier is None:
            return self
        return Histogram({le: c - earlier.buckets.get(le, 0.0) for le, c in self.buckets.items()},
                         self.sum - earlier.sum, self.count - earlier.count)

    def quantile(self, q: float) -> float | None:
        """Linear interpolation inside the bucket, as Prometheus' histogram_quantile does."""
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        lower_bound, lower_count = 0.0, 0.0
        for le in sorted(self.buckets):
            count = self.buckets[le]
            if count >= rank:
                if math.isinf(le):
                    return lower_bound  # beyond the last finite bucket: its bound is all we know
                width = count - lower_count
                fraction = (rank - lower_count) / width if width > 0 else 1.0
                return lower_bound + (le - lower_bound) * fraction
            lower_bound, lower_count = le, count
        return lower_bound

    def summary(self) -> dict[str, float | None]:
        """count, mean and percentiles in ms, as result files hold a server's latencies."""
        return self.latency().summary()

    def latency(self) -> Latency:
        """The histogram's estimate of the latency it counts."""
        ms = {p: self.quantile(p / 100) for p in PERCENTILES}
        return Latency(1000 * self.sum / self.count if self.count else None,
                       {p: None if v is None else 1000 * v for p, v in ms.items()},
                       count=int(self.count))


@dataclass
class Snapshot:
    """One scrape: canonical gauges, counters and histograms that the server exported."""

    gauges: dict[str, float] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)
    source: str = ""  # the metric prefix that matched, e.g. "loom" or "vllm"


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text -> sample name -> (labels, value) of each of its samples, NaNs left out
    (NaN gauges exist; results are strict JSON)."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not math.isnan(s.value):
                out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def sample_value(text: str, name: str, **labels: str) -> float:
    """The value of one sample (the first whose labels include those given)."""
    for found, value in samples(text).get(name, []):
        if all(found.get(k) == v for k, v in labels.items()):
            return value
    raise KeyError(f"{name} {labels} not in the metrics")


def parse_metrics(text: str) -> Snapshot:
    samples_by_name = samples(text)
    snap = Snapshot()

    def first(names: tuple[str, ...]) -> str | None:
        name = next((n for n in names if n in samples_by_name
                     or n + "_bucket" in samples_by_name), None)
        if name and not snap.source:
            snap.source = name.split(":", 1)[0]
        return name

    for canon, (names, how) in GAUGES.items():
        if name := first(names):
            values = [v for _, v in samples_by_name[name]]
            snap.gauges[canon] = max(values) if how == "max" else sum(values)
    for canon, names in COUNTERS.items():
        if name := first(names):
            snap.counters[canon] = sum(v for _, v in samples_by_name[name])
    for canon, names in HISTOGRAMS.items():
        if name := first(names):
            hist = Histogram()
            for labels, value in samples_by_name.get(name + "_bucket", []):
                le = float(labels["le"])
                hist.buckets[le] = hist.buckets.get(le, 0.0) + value
            hist.sum = sum(v for _, v in samples_by_name.get(name + "_sum", []))
            hist.count = sum(v for _, v in samples_by_name.get(name + "_count", []))
            snap.histograms[canon] = hist
    return snap


def server_figures(before: Snapshot | None, after: Snapshot | None,
                   timeline: list[Sample]) -> ServerFigures:
    """What the server's /metrics said about a run: deltas of counters and histograms
    between the scrapes before and after it, peaks and means of gauges over the timeline."""
    if after is None:
        return ServerFigures()
    summaries = {key: after.histograms[canon].minus(
        before.histograms.get(canon) if before else None).latency()
        for canon, key in (("queue_time", "queue_time"), ("ttft", "server_ttft"))
        if canon in after.histograms}

    def delta(name: str) -> float | None:
        if name not in after.counters:
            return None
        return after.counters[name] - (before.counters.get(name, 0.0) if before else 0.0)

    preemptions, rejected = delta("preemptions"), delta("rejected")
    queries, hits = delta("prefix_cache_queries"), delta("prefix_cache_hits")
    return ServerFigures.of(
        timeline, metrics_source=after.source, **summaries,
        preemptions=None if preemptions is None else int(preemptions),
        server_rejected=None if rejected is None else int(rejected),
        prefix_cache_hit_rate=hits / queries if queries and hits is not None else None)
