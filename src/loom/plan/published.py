"""Published serving measurements as typed rows (published.json): what TensorRT-LLM, vLLM and
others report for a model on a GPU at fixed input / output lengths and a load, each row with
the source it came from (URL, repository path and commit). `loom simulate calibrate
--published` fits the GPU step model to them; nothing in the file is predicted."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources

from loom.plan.catalogue import PlanError

ENGINES = ("vllm", "trtllm", "sglang")
# checkpoints whose architecture is another catalogued model's (same shapes, new weights)
SAME_SHAPE = {"llama-3.3-70b": "llama-3.1-70b", "llama-3-70b": "llama-3.1-70b"}
FIGURES = ("output_tok_s", "total_tok_s", "ttft_ms", "tpot_ms", "latency_ms")


@dataclass(frozen=True)
class Source:
    key: str
    url: str
    repo: str | None
    path: str | None
    commit: str | None
    engine: str
    engine_version: str
    method: str
    # the engine's scheduler limits and the memory it leaves free, as the source states them or
    # as that engine defaults (the defaults here are trtllm-bench's PyTorch backend's)
    max_num_seqs: int = 2048
    max_num_batched_tokens: int = 8192
    memory_margin: float = 0.05


@dataclass(frozen=True)
class PublishedRow:
    """One published figure set: a workload of fixed lengths at a load, and what was measured.

    `rate` 'inf' with no `concurrency` is an offline run (every request queued at once);
    `concurrency` N is a closed loop of N users."""

    source: Source
    model: str
    checkpoint: str | None
    dtype: str
    gpu: str
    tp: int
    isl: int
    osl: int
    num_requests: int
    rate: str
    concurrency: int | None
    output_tok_s: float | None
    total_tok_s: float | None
    ttft_ms: float | None
    tpot_ms: float | None
    latency_ms: float | None = None  # mean end-to-end request latency

    @property
    def engine(self) -> str:
        return self.source.engine

    @property
    def shape_model(self) -> str:
        """The catalogued model whose shapes this row's model has."""
        return SAME_SHAPE.get(self.model, self.model)

    @property
    def key(self) -> str:
        load = f"c{self.concurrency}" if self.concurrency else f"rate-{self.rate}"
        return (f"{self.source.key}:{self.model}:{self.dtype}:{self.gpu}:tp{self.tp}:"
                f"{self.isl}/{self.osl}:{load}")


def _row(obj: dict, sources: dict[str, Source], where: str) -> PublishedRow:
    try:
        source = sources[obj["source"]]
        row = PublishedRow(source=source, **{k: v for k, v in obj.items() if k != "source"})
    except (KeyError, TypeError) as e:
        raise PlanError(f"{where}: malformed published row ({e})") from None
    if row.engine not in ENGINES:
        raise PlanError(f"{where}: unknown engine {row.engine!r}")
    if min(row.tp, row.isl, row.osl, row.num_requests) < 1:
        raise PlanError(f"{where}: tp, isl, osl and num_requests must be >= 1")
    if all(getattr(row, f) is None for f in FIGURES):
        raise PlanError(f"{where}: a row without a published figure")
    return row


@cache
def published_rows() -> tuple[PublishedRow, ...]:
    """Every row of the shipped dataset, checked."""
    obj = json.loads(resources.files("loom.plan").joinpath("published.json").read_text())
    sources = {k: Source(key=k, url=v["url"], repo=v.get("repo"), path=v.get("path"),
                         commit=v.get("commit"), engine=v["engine"],
                         engine_version=v["engine_version"], method=v["method"],
                         **{f: v[f] for f in ("max_num_seqs", "max_num_batched_tokens",
                                              "memory_margin") if f in v})
               for k, v in obj["sources"].items()}
    return tuple(_row(r, sources, f"published.json row {i}") for i, r in enumerate(obj["rows"]))
