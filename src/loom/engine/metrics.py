"""Prometheus metrics (names follow vLLM's, prefixed `loom:`) and the periodic stats log line."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

logger = logging.getLogger("loom.stats")

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class EngineMetrics:
    """All engine metrics, in a registry of their own so several engines can live in one
    process (tests, `loom bench compare`)."""

    def __init__(self, model_name: str, log_interval_s: float = 5.0) -> None:
        self.registry = CollectorRegistry()
        r, label = self.registry, {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"loom:{name}", doc, list(label), registry=r).labels(**label)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"loom:{name}", doc, list(label), registry=r).labels(**label)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] = _LATENCY_BUCKETS
                      ) -> Histogram:
            return Histogram(f"loom:{name}", doc, list(label), buckets=buckets,
                             registry=r).labels(**label)

        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)")
        self.preemptions = counter("num_preemptions", "Preemptions (recompute) so far")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the cache")
        self.rejected = counter("request_rejected", "Requests refused by admission control")
        self._success = Counter("loom:request_success", "Finished requests by reason",
                                ["model_name", "finished_reason"], registry=r)
        self._model_name = model_name
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens per engine step",
                                          _TOKEN_BUCKETS)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token")
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish")
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled")
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "First scheduled to first token")
        self.decode_time = histogram("request_decode_time_seconds", "First token to finish")
        self.forward_time = histogram("model_forward_seconds", "One step on the model")
        self.idle_gap = histogram(
            "model_idle_seconds",
            "Model idle between back-to-back steps (Python: schedule, prepare, process)",
            (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25))
        for reason in ("stop", "length", "abort", "error"):
            self._success.labels(model_name=model_name, finished_reason=reason)

        self._abort_is_rejection = False
        self.log_interval_s = log_interval_s
        self._last_log = time.monotonic()
        self._logged = {"prompt": 0.0, "generation": 0.0, "queries": 0.0, "hits": 0.0,
                        "drafted": 0.0, "accepted": 0.0}

    def finished(self, reason: str) -> None:
        if reason == "abort" and self._abort_is_rejection:
            self.rejected.inc()
            return
        self._success.labels(model_name=self._model_name, finished_reason=reason).inc()

    @contextmanager
    def abort_counts_as_rejected(self) -> Iterator[None]:
        """Within this block, a request that ends as an abort counts as rejected instead: a
        queue timeout is aborted in the engine but answered with 503, and each request must
        count once (the loop thread is the only caller, so no lock is needed)."""
        self._abort_is_rejection = True
        try:
            yield
        finally:
            self._abort_is_rejection = False

    def prometheus_text(self) -> bytes:
        return generate_latest(self.registry)

    def snapshot(self) -> dict[str, float]:
        """{metric name: value} for gauges and counters (labelled ones as name{label=...})."""
        values = {}
        for family in self.registry.collect():
            if family.type not in ("gauge", "counter"):
                continue
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                extra = {k: v for k, v in sample.labels.items() if k != "model_name"}
                key = sample.name + ("".join(f"{{{k}={v}}}" for k, v in extra.items()))
                values[key] = sample.value
        return values

    def maybe_log_stats(self, busy: bool) -> None:
        """Every `log_interval_s` while there is work, one line of throughput and state."""
        now = time.monotonic()
        elapsed = now - self._last_log
        if elapsed < self.log_interval_s:
            return
        values = self.snapshot()
        current = {"prompt": values["loom:prompt_tokens_total"],
                   "generation": values["loom:generation_tokens_total"],
                   "queries": values["loom:prefix_cache_queries_total"],
                   "hits": values["loom:prefix_cache_hits_total"],
                   "drafted": values.get("loom:spec_decode_num_draft_tokens_total", 0.0),
                   "accepted": values.get("loom:spec_decode_num_accepted_tokens_total", 0.0)}
        delta = {k: current[k] - self._logged[k] for k in current}
        self._last_log, self._logged = now, current
        if not busy and not delta["prompt"] and not delta["generation"]:
            return
        hit_rate = 100.0 * delta["hits"] / delta["queries"] if delta["queries"] else 0.0
        drafts = ""  # speculative decoding's share of draft tokens kept, where it is on
        if "loom:spec_decode_num_draft_tokens_total" in values:
            rate = 100.0 * delta["accepted"] / delta["drafted"] if delta["drafted"] else 0.0
            drafts = f", Draft acceptance rate: {rate:.1f}%"
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Preemptions: %d, "
            "Prefix cache hit rate: %.1f%%%s",
            delta["prompt"] / elapsed, delta["generation"] / elapsed,
            values["loom:num_requests_running"], values["loom:num_requests_waiting"],
            100.0 * values["loom:kv_cache_usage_perc"], values["loom:num_preemptions_total"],
            hit_rate, drafts)
