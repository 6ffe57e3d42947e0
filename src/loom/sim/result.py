"""A simulated run as the run result `loom bench run` makes (same builder, same keys), marked
simulated, so scorecard, plots, compare and diagnose read it unchanged."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from loom import host
from loom.admission import AdmissionConfig
from loom.cluster.routing import ROUTERS, RoutingPolicy, make_policy
from loom.config import CacheConfig, SchedulerConfig
from loom.sim.engine import SimEngine
from loom.sim.profile import Profile
from loom.sim.replay import SimRun, Simulation
from loom.workload.figures import Latency
from loom.workload.load import Load
from loom.workload.monitoring import ServerFigures, client_figures
from loom.workload.results import Origin, RunResult, utc_now
from loom.workload.slo import Slo
from loom.workload.trace import Trace

ENDPOINT = "/v1/completions"  # what the simulated client sends to, as `loom bench run` does


@dataclass(frozen=True)
class SimConfig:
    """One simulated server: a profile and the engine / server flags it runs with."""

    name: str
    profile: Profile
    scheduler: SchedulerConfig = SchedulerConfig()
    cache: CacheConfig = CacheConfig()
    max_model_len: int | None = None
    limits: AdmissionConfig = AdmissionConfig()
    replicas: int = 1     # engines behind a router (loom serve --data-parallel-size)
    router: str = "prefix"
    serve_commands: dict[str, str | None] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.router not in ROUTERS:
            raise ValueError(f"unknown router {self.router!r}; choose one of "
                             f"{', '.join(ROUTERS)}")

    @property
    def model_len(self) -> int:
        return self.max_model_len or self.profile.max_model_len

    @property
    def num_kv_blocks(self) -> int:
        """The cache the flags ask for, else the profile's (in this block size)."""
        from loom.config import parse_size

        if self.cache.num_kv_blocks is not None:
            return self.cache.num_kv_blocks
        per_block = self.profile.step_model.shape.kv_bytes_per_token * self.cache.block_size
        if self.cache.kv_cache_memory is not None:
            return max(1, parse_size(self.cache.kv_cache_memory) // per_block)
        return self.profile.num_kv_blocks * self.profile.block_size // self.cache.block_size

    @property
    def num_gpus(self) -> int:
        return self.profile.num_gpus * self.replicas

    def engines(self) -> list[SimEngine]:
        """One engine per replica, each with its own KV cache and scheduler."""
        sc = self.scheduler
        if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < self.model_len:
            raise ValueError(f"with chunked prefill disabled, max_num_batched_tokens "
                             f"({sc.max_num_batched_tokens}) must be >= max_model_len "
                             f"({self.model_len})")
        return [SimEngine(sc, self.num_kv_blocks, self.cache.block_size,
                          self.cache.enable_prefix_caching, self.model_len,
                          self.profile.step_model) for _ in range(self.replicas)]

    def routing_policy(self, seed: int) -> RoutingPolicy | None:
        return make_policy(self.router, self.replicas, seed=seed) if self.replicas > 1 else None

    def flags(self) -> list[str]:
        """The engine and server flags of this configuration, as `loom serve` takes them."""
        sc, cc = self.scheduler, self.cache
        out = ["--max-model-len", str(self.model_len), "--num-kv-blocks", str(self.num_kv_blocks),
               "--block-size", str(cc.block_size),
               "--max-num-batched-tokens", str(sc.max_num_batched_tokens),
               "--max-num-seqs", str(sc.max_num_seqs), "--scheduler", sc.scheduler,
               "--scheduling-policy", sc.scheduling_policy,
               "--enable-chunked-prefill" if sc.enable_chunked_prefill
               else "--no-enable-chunked-prefill",
               "--enable-prefix-caching" if cc.enable_prefix_caching
               else "--no-enable-prefix-caching"]
        if self.limits.max_num_queued_reqs is not None:
            out += ["--max-num-queued-reqs", str(self.limits.max_num_queued_reqs)]
        if self.limits.queue_timeout_s is not None:
            out += ["--queue-timeout", f"{self.limits.queue_timeout_s:g}"]
        if self.replicas > 1:
            out += ["--data-parallel-size", str(self.replicas), "--router", self.router]
        return out


def simulate_run(config: SimConfig, trace: Trace, token_ids: list[list[int]], load: Load,
                 slo: Slo | None = None, label: str | None = None,
                 scrape_interval_s: float = 1.0) -> RunResult:
    """Replay `trace` at `load` on the simulated `config`; returns the run result."""
    date = utc_now()
    wall, cpu = time.perf_counter(), time.process_time()
    run = Simulation(config.engines(), trace, token_ids, load, config.limits,
                     scrape_interval_s, config.routing_policy(load.seed)).simulate()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return build(run, config, trace, load, slo, label or f"simulated {config.name}", date,
                 wall, cpu)


def build(run: SimRun, config: SimConfig, trace: Trace, load: Load, slo: Slo | None,
          label: str, date: str, wall_s: float, cpu_s: float) -> RunResult:
    """The run result of a simulation: the server's figures are its exact counts."""
    profile = config.profile
    queries = run.prefix_queries
    metrics = ServerFigures.of(
        run.timeline, metrics_source="loom", queue_time=Latency.of(run.queue_times),
        server_ttft=Latency.of(run.server_ttfts), preemptions=run.preemptions,
        prefix_cache_hit_rate=run.prefix_hits / queries if queries else None,
        server_rejected=run.rejected)
    server = {"simulated": True, "cmdline": ["loom", "serve", *config.flags()],
              "profile": {"source": profile.source, "model": profile.model, **profile.meta}}
    origin = Origin(date, server=server, backend="loom-simulate", endpoint=ENDPOINT,
                    base_url=f"simulated:{config.name}",
                    hardware={**host.hardware(), "gpus": []}, model_id=profile.model)
    return RunResult.of(
        run.sent, run.duration, load, trace, slo, label, run.timeline, origin,
        metrics=metrics, client=client_figures(run.sent, run.timeline,
                                               closed_loop=load.max_concurrency is not None),
        simulated=True, simulation={
            "config": config.name, "profile_source": profile.source,
            "num_gpus": config.num_gpus, "replicas": config.replicas,
            "router": config.router if config.replicas > 1 else None,
            "requests_per_replica": run.requests_per_replica,
            "router_decisions": run.router_decisions,
            "num_kv_blocks": config.num_kv_blocks, "block_size": config.cache.block_size,
            "max_model_len": config.model_len, "steps": run.num_steps,
            "busy_fraction": (run.busy_s / (run.duration * config.replicas)
                              if run.duration else 0.0),
            "wall_s": wall_s, "cpu_s": cpu_s,
            "simulated_s_per_wall_s": run.duration / wall_s if wall_s > 0 else None,
            "serve_commands": config.serve_commands,
            "not_modelled": "EOS (requests end at their trace length), async scheduling "
                            "(steps run back to back), HTTP/tokenization time outside the step"})
