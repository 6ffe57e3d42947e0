"""Result files: a run (one offered load), a sweep (one configuration at rising loads) and a
comparison (several configurations on one trace), typed, and read and written as the JSON
`loom bench` has always written (files from older versions read too: what they lack keeps
its default). `loom bench` measures them against a server, `loom simulate` against the
simulated engine; the scorecard, plots, report and `loom diagnose` read either.
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from loom.config import option
from loom.workload.figures import CLASS_KEYS, Figures, offered_rate, per_class, request_figures
from loom.workload.jsonview import JsonView, plain
from loom.workload.load import Load
from loom.workload.monitoring import ClientFigures, Sample, ServerFigures, ServerMemory
from loom.workload.requests import RequestResult
from loom.workload.slo import Slo
from loom.workload.trace import Trace, TraceInfo

RESULT_VERSION = 1
# What every run must hold for the scorecard and diagnose to read it.
RUN_KEYS = ("request_rate", "num_prompts", "completed", "error_rate", "request_throughput",
            "offered_rate", "requests")


def utc_now() -> str:
    """A result's date: when its measurement started, UTC, to the second."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class Origin(JsonView):
    """Where and how a run was measured: when, by what command, against which server and
    model (`server`: what the server said of itself), on which machine (`hardware`)."""

    date: str | None = None
    command: str | None = None
    server: dict[str, Any] = field(default_factory=dict)
    backend: str | None = None
    endpoint: str | None = None
    base_url: str | None = None
    hardware: dict[str, Any] = field(default_factory=dict)
    model_id: str | None = None
    tokenizer_id: str | None = None


@dataclass(frozen=True)
class RunResult(JsonView):
    """One run: a trace replayed at one offered load, and everything measured meanwhile.
    `metrics` is what the server's /metrics said of the run, `client` how the load
    generator kept its schedule."""

    label: str | None
    load: Load
    duration: float
    offered_rate: float
    figures: Figures
    requests: list[RequestResult]
    origin: Origin = field(default_factory=Origin)
    trace: TraceInfo = field(default_factory=TraceInfo)
    slo: str | None = None
    metrics: ServerFigures = field(default_factory=ServerFigures)
    server_memory: ServerMemory | None = None
    client: ClientFigures = field(default_factory=ClientFigures)
    over_saturated_at_s: float | None = None
    per_class: dict[str, Figures] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    timeline: list[Sample] = field(default_factory=list)
    limits_crossed: list[str] | None = None  # a sweep's verdict on this run
    simulated: bool = False
    simulation: dict[str, Any] | None = None  # what loom simulate ran (sim/result.py)
    repeats: int = 1  # K repeats of this point stand behind the figures (bench/repeats.py)
    repeat_figures: list[dict[str, Any]] = field(default_factory=list)
    ci: dict[str, list[float]] = field(default_factory=dict)  # figure -> 95% interval
    result_version: int = RESULT_VERSION

    @classmethod
    def of(cls, sent: list[RequestResult], duration: float, load: Load, trace: Trace,
           slo: Slo | None, label: str | None, timeline: list[Sample], origin: Origin,
           **measured: Any) -> RunResult:
        """The result of sending `sent` at `load`: its figures computed here; `origin` and
        what the caller measured besides (metrics, client, ...) given by field name. The
        command line is the CLI's to record (`with_command`)."""
        origin = replace(origin, tokenizer_id=trace.header.get("tokenizer"))
        return cls(label, load, duration, offered_rate(sent, duration),
                   request_figures(sent, duration, slo), sent, origin, trace.describe(),
                   str(slo) if slo else None, per_class=per_class(sent, duration, slo),
                   errors=sorted({r.error for r in sent if r.error})[:20], timeline=timeline,
                   **measured)

    def with_command(self, command: str | None) -> RunResult:
        """This run as measured by `command` (the command line that asked for it)."""
        return replace(self, origin=replace(self.origin, command=command))

    @property
    def request_rate(self) -> float | str:
        """req/s, "inf" (all at once, or the closed loop of max_concurrency users) or
        "trace", as the file says it."""
        return self.load.rate_name

    @property
    def max_concurrency(self) -> int | None:
        return self.load.max_concurrency

    @property
    def closed_loop(self) -> bool:
        """All at once, paced by the client's users."""
        return self.request_rate == "inf"

    @property
    def point(self) -> tuple[float | str, int | None]:
        """The offered load as a key: runs of two configurations at one point compare."""
        return self.request_rate, self.max_concurrency

    @property
    def rate_order(self) -> float:
        """The rate for sorting: a rate "inf" or "trace" after every number."""
        return self.request_rate if isinstance(self.request_rate, (int, float)) else math.inf

    def to_json(self) -> dict[str, Any]:
        origin = self.origin.to_json()
        out: dict[str, Any] = {"kind": "run", "result_version": self.result_version,
                               "label": self.label}
        out.update({k: origin[k] for k in ("date", "command", "backend", "endpoint",
                                           "base_url", "model_id", "tokenizer_id", "server")})
        out.update(trace=self.trace.to_json(), hardware=origin["hardware"])
        out.update(self.load.to_json())
        out.update(slo=self.slo, duration=self.duration, offered_rate=self.offered_rate)
        out.update(self.figures.to_json())
        out.update(self.metrics.to_json())
        out.update(server_memory=plain(self.server_memory), client=self.client.to_json(),
                   over_saturated_at_s=self.over_saturated_at_s)
        out["per_class"] = {c: f.to_json(CLASS_KEYS) for c, f in self.per_class.items()}
        out.update(errors=self.errors, timeline=self.timeline,
                   requests=[r.to_json() for r in self.requests])
        if self.limits_crossed is not None:
            out["limits_crossed"] = self.limits_crossed
        if self.simulated:
            out.update(simulated=True, simulation=self.simulation)
        if self.repeats > 1:
            out.update(repeats=self.repeats, repeat_figures=self.repeat_figures, ci=self.ci)
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> RunResult:
        """A run as a file (or a JSON-shaped mapping) holds it."""
        rest = {k: obj[k] for k in ("slo", "over_saturated_at_s", "errors", "timeline",
                                    "limits_crossed", "simulated", "simulation", "repeats",
                                    "repeat_figures", "ci", "result_version")
                if obj.get(k) is not None}
        return cls(obj.get("label"), Load.from_json(obj), obj["duration"], obj["offered_rate"],
                   Figures.from_json(obj),
                   [RequestResult.from_json(r) for r in obj.get("requests", [])],
                   Origin.from_json(obj), TraceInfo.from_json(obj.get("trace") or {}),
                   metrics=ServerFigures.from_json(obj),
                   server_memory=ServerMemory.from_json(obj["server_memory"])
                   if obj.get("server_memory") else None,
                   client=ClientFigures.from_json(obj.get("client") or {}),
                   per_class={c: Figures.from_json(f)
                              for c, f in (obj.get("per_class") or {}).items()}, **rest)


@dataclass(frozen=True)
class Limits(JsonView):
    """What "unacceptable" means for a sweep."""

    CLI_GROUP = "Sweep limits"

    max_p95_queue_s: float = option(2.0,
        "p95 queue time in seconds (server metric; else p95 TTFT)", flag="--max-p95-queue")
    max_error_rate: float = option(0.05, "failed / sent")

    def __post_init__(self) -> None:
        if not 0 <= self.max_p95_queue_s < math.inf:
            raise ValueError(f"--max-p95-queue must be >= 0 s, got {self.max_p95_queue_s:g}")
        if not 0 <= self.max_error_rate <= 1:
            raise ValueError(f"--max-error-rate must be from 0 to 1, got "
                             f"{self.max_error_rate:g}")

    def crossed(self, run: RunResult) -> list[str]:
        """Why `run` is beyond the limits (empty: within them). Queue time is the server's
        (from /metrics); a server without it is judged by p95 TTFT, which includes it."""
        reasons = []
        queue = run.metrics.queue_time
        queue_ms, what = (queue.p95 if queue else None), "p95 queue time"
        if queue_ms is None:
            queue_ms, what = run.figures.ttft.p95, "p95 TTFT (no server queue metric)"
        if queue_ms is not None and queue_ms > 1000 * self.max_p95_queue_s:
            reasons.append(f"{what} {queue_ms / 1000:.2f} s > {self.max_p95_queue_s:g} s")
        if run.figures.error_rate > self.max_error_rate:
            reasons.append(f"error rate {run.figures.error_rate:.1%} > "
                           f"{self.max_error_rate:.1%}")
        if run.figures.completed == 0:
            reasons.append("no request completed")
        if run.over_saturated_at_s is not None:
            reasons.append(f"over-saturated: the queue kept growing; sending stopped at "
                           f"{run.over_saturated_at_s:.0f} s")
        return reasons


@dataclass(frozen=True)
class ConfigInfo(JsonView):
    """The configuration a sweep measured: its name, flags and the server command run."""

    name: str | None = None
    flags: str = ""
    server_command: str | None = None


@dataclass(frozen=True)
class SweepResult(JsonView):
    """One configuration at several offered loads; the knee is the highest offered rate
    found within the limits."""

    label: str
    runs: list[RunResult]
    knee_rate: float | None = None
    points: Literal["rate", "concurrency"] = "rate"
    limits: Limits | None = None
    trace: TraceInfo = field(default_factory=TraceInfo)
    config: ConfigInfo | None = None
    simulated: bool = False
    repeats: int = 1
    knee_rates: list[float | None] = field(default_factory=list)  # one per repeat

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": "sweep", "label": self.label,
                               "limits": plain(self.limits), "points": self.points,
                               "knee_rate": self.knee_rate, "trace": self.trace.to_json(),
                               "runs": [r.to_json() for r in self.runs]}
        if self.config is not None:
            out["config"] = self.config.to_json()
        if self.simulated:
            out["simulated"] = True
        if self.repeats > 1:
            out.update(repeats=self.repeats, knee_rates=self.knee_rates)
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> SweepResult:
        return cls(label=obj.get("label") or "",
                   runs=[r if isinstance(r, RunResult) else RunResult.from_json(r)
                         for r in obj["runs"]],
                   knee_rate=obj.get("knee_rate"), points=obj.get("points", "rate"),
                   limits=Limits.from_json(obj["limits"]) if obj.get("limits") else None,
                   trace=TraceInfo.from_json(obj.get("trace") or {}),
                   config=ConfigInfo.from_json(obj["config"]) if obj.get("config") else None,
                   simulated=bool(obj.get("simulated")), repeats=obj.get("repeats", 1),
                   knee_rates=obj.get("knee_rates", []))

    def with_command(self, command: str | None) -> SweepResult:
        """Every run of this sweep as measured by `command`."""
        return replace(self, runs=[r.with_command(command) for r in self.runs])

    @property
    def flags(self) -> str:
        return self.config.flags if self.config else ""


@dataclass(frozen=True)
class CompareEntry(JsonView):
    """One configuration of a comparison, as compare.json indexes it."""

    name: str
    file: str
    flags: str = ""
    knee_rate: float | None = None
    simulated: bool = False

    def to_json(self) -> dict[str, Any]:
        out = {"name": self.name, "flags": self.flags, "file": self.file,
               "knee_rate": self.knee_rate}
        return {**out, "simulated": True} if self.simulated else out


@dataclass(frozen=True)
class CompareResult(JsonView):
    """Several configurations swept on one trace: compare.json indexes their sweep files
    (`index()`); read back, the sweeps come with it."""

    configs: list[CompareEntry]
    sweeps: list[SweepResult]
    trace: TraceInfo = field(default_factory=TraceInfo)
    command: str | None = None

    def index(self) -> dict[str, Any]:
        return {"kind": "compare", "command": self.command, "trace": self.trace.to_json(),
                "configs": [c.to_json() for c in self.configs]}

    def to_json(self) -> dict[str, Any]:
        return {**self.index(), "sweeps": [s.to_json() for s in self.sweeps]}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> CompareResult:
        return cls([CompareEntry.from_json(c) for c in obj.get("configs", [])],
                   [as_sweep(s) for s in obj.get("sweeps", [])],
                   TraceInfo.from_json(obj.get("trace") or {}), obj.get("command"))


Result = RunResult | SweepResult | CompareResult
Group = tuple[str, list[RunResult], str]  # (configuration, its runs, its server flags)


def as_run(obj: RunResult | Mapping[str, Any]) -> RunResult:
    """A run, typed: itself, or read from its JSON."""
    return obj if isinstance(obj, RunResult) else RunResult.from_json(obj)


def as_runs(runs: Sequence[RunResult | Mapping[str, Any]]) -> list[RunResult]:
    return [as_run(r) for r in runs]


def as_sweep(obj: SweepResult | Mapping[str, Any]) -> SweepResult:
    return obj if isinstance(obj, SweepResult) else SweepResult.from_json(obj)


def as_result(obj: Result | Mapping[str, Any]) -> Result:
    """A run, sweep or comparison, typed: itself, or read from its JSON by its kind."""
    if isinstance(obj, (RunResult, SweepResult, CompareResult)):
        return obj
    kinds = {"run": RunResult, "sweep": SweepResult, "compare": CompareResult}
    return kinds[obj.get("kind", "run")].from_json(obj)


def groups(obj: Result | Mapping[str, Any]) -> list[Group]:
    """(configuration name, its runs, its server flags) of a result."""
    obj = as_result(obj)
    if isinstance(obj, RunResult):
        return [(obj.label or "run", [obj], "")]
    sweeps = obj.sweeps if isinstance(obj, CompareResult) else [obj]
    return [(s.label or f"config {i}", s.runs, s.flags) for i, s in enumerate(sweeps)]


def run_label(run: RunResult) -> str:
    """A run's name in tables and findings: its label, else its offered load."""
    if run.label:
        return run.label
    rate, users = run.request_rate, run.max_concurrency
    if rate == "trace":
        return "trace arrivals"
    if rate == "inf":
        return f"x{users}" if users else "all at once"
    return f"@{rate:g}/s"


def save_json(obj: Mapping[str, Any], path: str | Path) -> None:
    """A result (or any JSON-shaped mapping) as strict JSON, its folder made as needed."""
    data = plain(obj)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")


def load_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())


def load_result(path: str | Path) -> Result:
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
    return as_result(obj)
