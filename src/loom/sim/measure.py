"""A configuration of `loom bench compare` measured by the simulator (`--config
NAME=simulate:FLAGS`): the comparison's own trace and loads on the simulated server, a sweep
filed under the comparison's name. It is bench's `Measure` protocol, met here, so bench
never imports the simulator."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from loom.sim.configs import SimSetup, sim_configs
from loom.sim.replay import prompt_token_ids
from loom.sim.result import SimConfig
from loom.sim.whatif import simulate_sweep
from loom.workload.results import ConfigInfo, SweepResult
from loom.workload.sweeps import SweepSpec
from loom.workload.trace import Trace


@dataclass
class SimulatedMeasure:
    """`flags`: the configuration as given ("simulate:..."); `setup`: what they ask to
    simulate; `tokenizer` counts the trace's text as the server it stands for would."""

    flags: str
    setup: SimSetup
    tokenizer: str | None = None
    seed: int = 0
    repeatable: bool = False  # the same figures every time: measured once
    config: SimConfig | None = None  # found by check()

    def check(self, name: str, spec: SweepSpec) -> None:
        """What the simulator cannot take from a comparison, then the one configuration it
        simulates (a profile read, a model resolved): before any server starts."""
        if spec.auto is not None or spec.load.burst or spec.load.ramp_up:
            raise ValueError(f"--config {name}=simulate:...: the simulator takes --rates or "
                             "--overlap, without --auto, --burst or --ramp-up")
        configs, _ = sim_configs(self.setup)
        if len(configs) != 1:
            names = ", ".join(c.name for c in configs)
            raise ValueError(f"--config {name}=simulate:...: simulated {len(configs)} "
                             f"configurations ({names}); give one per --config (one GPU, "
                             "one tensor-parallel size)")
        self.config = replace(configs[0], name=name)

    def sweep(self, name: str, trace: Trace, spec: SweepSpec, log: Path) -> SweepResult:
        if self.config is None:
            self.check(name, spec)
        config = self.config
        tokenizer = None
        if any(r.prompt is not None for r in trace.requests):
            from loom.workload.tokens import load_tokenizer

            tokenizer = load_tokenizer(self.tokenizer)
        ids = prompt_token_ids(trace, tokenizer, self.seed, config.model_len)
        result = simulate_sweep(config, trace, ids, spec.loads(), spec.slo, spec.limits)
        return replace(result, label=name, config=ConfigInfo(
            name, self.flags, result.config.server_command if result.config else None))
