"""The servers `loom simulate` stands in for: one per calibrated profile, or one per (GPU,
tensor-parallel size) that fits from the catalogue (roofline), each as a fleet of every size
and behind every router asked for; with the `loom serve` / `vllm serve` commands that would
run it for real."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from loom.admission import AdmissionConfig
from loom.config import EngineConfig
from loom.plan.catalogue import PlanError
from loom.plan.fitted import check_engine, shipped_profiles
from loom.plan.models import resolve_model
from loom.plan.planner import PlanFlags, capacity, flags, gpus_of, settings
from loom.sim.profile import Profile, roofline_profile
from loom.sim.result import SimConfig


@dataclass(frozen=True)
class SimSetup:
    """What to simulate: a profile (`profile`, a file from `loom simulate calibrate`), or
    the GPUs of `gpus` (roofline, with the engine's model); the engine and admission flags
    it runs with; fleets of each size in `replicas` behind each router in `routers`."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    profile: str | None = None
    gpus: PlanFlags = field(default_factory=PlanFlags)
    label: str | None = None
    replicas: tuple[int, ...] = (1,)
    routers: tuple[str, ...] = ("prefix",)
    serving_engine: str = "vllm"  # whose fitted step model a --gpus what-if uses

    def __post_init__(self) -> None:
        """Engine flags the step model cannot represent are refused, not ignored: the
        results would be labelled with a configuration that was never simulated."""
        if self.engine.scheduler.async_scheduling:
            raise ValueError("loom simulate does not model --async-scheduling (its steps run "
                             "back to back); drop the flag")
        if self.engine.scheduler.speculative_config is not None:
            raise ValueError("loom simulate does not model --speculative-config (draft "
                             "tokens and their acceptance need the model); drop the flag")
        bad = [n for n in self.replicas if n < 1]
        if bad:
            raise ValueError(f"--replicas must be >= 1, got {bad[0]}")
        if self.profile and self.gpus.gpus:
            raise ValueError("give --profile or --gpus, not both")
        check_engine(self.serving_engine)
        if not self.profile and not self.gpus.gpus:
            raise ValueError("give --profile PROFILE.json (loom simulate calibrate) or --gpus "
                             "with --model (roofline)")


def sim_configs(setup: SimSetup) -> tuple[list[SimConfig], list[str]]:
    """(the simulated servers, why each (GPU, TP) left out does not fit)."""
    engine = setup.engine
    common = {"scheduler": engine.scheduler, "cache": engine.cache, "limits": setup.admission,
              "max_model_len": engine.model.max_model_len}
    if setup.profile:
        profile = Profile.load(setup.profile)
        config = SimConfig(setup.label or Path(setup.profile).stem, profile, **common)
        serve = profile.engine_flags()
        if engine.model.model:  # the model asked for here, over the one calibrated
            serve = [*_without(serve, "--model"), "--model", engine.model.model]
        config.serve_commands["loom"] = " ".join(["loom", "serve", *serve, *config.flags()])
        return fleets([config], setup.replicas, setup.routers), []
    model = resolve_model(engine.model.model)
    plan = settings(model, dataclasses.replace(
        setup.gpus, block_size=engine.cache.block_size,
        max_model_len=engine.model.max_model_len,
        max_num_batched_tokens=engine.scheduler.max_num_batched_tokens,
        max_num_seqs=engine.scheduler.max_num_seqs, concurrency=(1,)))
    common["max_model_len"] = plan.max_model_len
    configs, skipped = [], []
    fitted = shipped_profiles()
    for gpu in gpus_of(setup.gpus):
        gpu_plan, source = plan, "--efficiency" if setup.gpus.efficiency else ""
        if not setup.gpus.efficiency:
            eff, source = fitted.efficiency(setup.serving_engine, gpu.key)
            gpu_plan = dataclasses.replace(plan, efficiency=eff)
        for tp in plan.tensor_parallel_sizes:
            try:
                profile = roofline_profile(model, gpu, tp, gpu_plan)
            except PlanError as e:
                skipped.append(f"{gpu.key} x{tp}: {e}")
                continue
            profile.meta.update(serving_engine=setup.serving_engine, efficiency_source=source)
            serve = flags(capacity(model, gpu, tp, gpu_plan), model, gpu_plan)
            loom = serve["loom_serve"]
            if loom and serve["download"]:  # loom reads from disk; vllm fetches the name
                loom = f"{serve['download']} && {loom}"
            configs.append(SimConfig(f"{gpu.key}-tp{tp}", profile, **common,
                                     serve_commands={"loom": loom,
                                                     "vllm": serve["vllm_serve"]}))
    if not configs:
        raise ValueError("no configuration fits: " + "; ".join(skipped))
    return fleets(configs, setup.replicas, setup.routers), skipped


def _without(flags: list[str], name: str) -> list[str]:
    """`flags` (name, value pairs) without `name` and its value."""
    pairs = list(zip(flags[::2], flags[1::2]))
    return [x for pair in pairs if pair[0] != name for x in pair]


def fleets(configs: list[SimConfig], replicas: tuple[int, ...],
           routers: tuple[str, ...]) -> list[SimConfig]:
    """Each configuration as a fleet of every size asked for, behind every router asked for
    (one engine needs no router)."""
    out = []  # SimConfig refuses a fleet of fewer than one replica
    for config in configs:
        for n in replicas:
            for router in routers if n > 1 else routers[:1]:
                name = config.name if n == 1 else f"{config.name}-x{n}-{router}"
                out.append(dataclasses.replace(
                    config, name=name, replicas=n, router=router,
                    serve_commands=_fleet_commands(config.serve_commands, n, router)))
    return out


def _fleet_commands(commands: dict[str, str | None], replicas: int,
                    router: str) -> dict[str, str | None]:
    """The serve commands of one replica, run as a fleet."""
    if replicas == 1:
        return dict(commands)
    out: dict[str, str | None] = {}
    for name, command in commands.items():
        if command and name == "loom":
            out[name] = f"{command} --data-parallel-size {replicas} --router {router}"
        elif command:
            out[name] = f"{command} --data-parallel-size {replicas}"
    return out
