"""Step time as a roofline: what one scheduler step costs on a GPU, from the bytes it must read
(weights once, every scheduled sequence's KV), the FLOPs it must do, the tensor-parallel
all-reduces and a per-step / per-sequence constant.

The same `StepModel` form is what `loom simulate calibrate` fits to loom's measured steps, so a
profile is either "roofline" (coefficients from the datasheet and stated efficiencies) or
"calibrated" (coefficients fitted on this machine); `loom plan` and `loom simulate` read both.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from loom.model.arch import ModelArch
from loom.model.memory import KVCacheSpec
from loom.plan.catalogue import GpuSpec, PlanError
from loom.plan.moe import expert_coverage
from loom.plan.sizing import ACTIVATION_BYTES, params_per_gpu


@dataclass(frozen=True)
class ModelShape:
    """What a step costs per token, per GPU, for one model and split. A mixture of experts
    reads its routed experts' bytes only as far as the step's tokens cover them
    (loom.plan.moe); its FLOPs per token are the active parameters'."""

    linear_params: int          # matmul weights every fed token goes through (active ones)
    lm_head_params: int         # only sampled rows reach the lm_head
    attention_flops_per_pair: int  # QK^T + PV per (query, key) pair, all layers
    kv_bytes_per_token: int
    weight_bytes: int           # read once per step (all but the routed experts)
    expert_bytes: int = 0       # routed experts held, read by the share the tokens touch
    num_experts: int = 0
    experts_per_tok: int = 0

    @classmethod
    def of(cls, arch: ModelArch, tp: int, kv_dtype_bytes: int, weight_bytes: int,
           expert_bytes: int = 0, expert_parallel: bool = False) -> ModelShape:
        """`weight_bytes`: all weights per GPU, of which `expert_bytes` are routed experts."""
        params = params_per_gpu(arch, tp, expert_parallel)
        q_dim = arch.num_heads // tp * arch.head_dim
        return cls(linear_params=params.active_linear,
                   lm_head_params=arch.vocab_size * arch.hidden_size // tp,
                   attention_flops_per_pair=4 * arch.num_layers * q_dim,
                   kv_bytes_per_token=KVCacheSpec.for_model(arch, kv_dtype_bytes,
                                                            tp).bytes_per_token,
                   weight_bytes=weight_bytes - expert_bytes, expert_bytes=expert_bytes,
                   num_experts=arch.num_experts, experts_per_tok=arch.num_experts_per_tok)

    def weight_bytes_read(self, tokens: int) -> float:
        """Weight bytes a step of `tokens` tokens reads: the dense part, and of the routed
        experts the expected share those tokens touch."""
        return self.weight_bytes + self.expert_bytes * expert_coverage(
            tokens, self.num_experts, self.experts_per_tok)


@dataclass(frozen=True)
class StepWork:
    """One step's work: totals over its scheduled chunks."""

    tokens: int = 0
    seqs: int = 0
    sampled: int = 0
    kv_tokens: int = 0       # context tokens whose K/V the step reads
    attention_pairs: int = 0  # (query, key) pairs attention computes

    @classmethod
    def of(cls, chunks: Iterable[tuple[int, int, bool]]) -> StepWork:
        """From (tokens fed, first position, samples a token) per scheduled request."""
        tokens = seqs = sampled = kv = pairs = 0
        for n, start, sample in chunks:
            tokens += n
            seqs += 1
            sampled += sample
            kv += start + n
            pairs += n * start + n * (n + 1) // 2
        return cls(tokens, seqs, sampled, kv, pairs)


@dataclass(frozen=True)
class StepModel:
    """t = step_s + seq_s * seqs + token_s * tokens + combine(memory time, compute time), with
    memory time = byte_s * (weight_bytes + KV bytes read) and compute time = flop_s * FLOPs.
    combine is sum where the CPU fit says so; "max" overlaps the two by `overlap`, the share
    of the shorter one hidden under the longer: 1 is the ideal roofline, 0 a step whose
    kernels each wait on memory or on math in turn (what TensorRT-LLM's published rows fit
    to: a step runs matmuls, attention and the rest one after another, none at its ridge)."""

    shape: ModelShape
    step_s: float
    seq_s: float
    token_s: float
    byte_s: float
    flop_s: float
    combine: Literal["max", "sum"] = "max"
    overlap: float = 1.0

    def flops(self, work: StepWork) -> float:
        s = self.shape
        return (2.0 * s.linear_params * work.tokens + 2.0 * s.lm_head_params * work.sampled
                + float(s.attention_flops_per_pair) * work.attention_pairs)

    def memory_bytes(self, work: StepWork) -> float:
        return (self.shape.weight_bytes_read(work.tokens)
                + work.kv_tokens * self.shape.kv_bytes_per_token)

    def time(self, work: StepWork) -> float:
        memory = self.byte_s * self.memory_bytes(work)
        compute = self.flop_s * self.flops(work)
        bound = (max(memory, compute) + (1 - self.overlap) * min(memory, compute)
                 if self.combine == "max" else memory + compute)
        return self.step_s + self.seq_s * work.seqs + self.token_s * work.tokens + bound

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["shape"] = asdict(self.shape)
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> StepModel:
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in obj.items() if k in names}
        values["shape"] = ModelShape(**obj["shape"])
        return cls(**values)


@dataclass(frozen=True)
class Efficiency:
    """Shares of datasheet peaks that a serving step reaches, and fixed costs: assumptions,
    not measurements (override with --efficiency key=value,...)."""

    bandwidth: float = 0.8        # of memory bandwidth, in a decode step's weight + KV reads
    compute: float = 0.6          # of dense tensor FLOP/s, in prefill matmuls (MFU)
    interconnect: float = 0.7     # of one direction of the GPU-to-GPU link, in all-reduces
    overlap: float = 1.0          # of the shorter of memory and compute time, hidden (0: sum)
    step_overhead_s: float = 0.002  # scheduling, launch and sampling per step
    seq_overhead_s: float = 2e-5    # per scheduled sequence (bookkeeping, streaming)
    allreduce_hop_s: float = 5e-6  # per ring step of an all-reduce (2 (tp - 1) of them)

    def __post_init__(self) -> None:
        for name in ("bandwidth", "compute", "interconnect"):
            if not 0 < getattr(self, name) <= 1:
                raise PlanError(f"efficiency {name} must be in (0, 1], got {getattr(self, name)}")
        if not 0 <= self.overlap <= 1:
            raise PlanError(f"efficiency overlap must be in [0, 1], got {self.overlap}")
        for name in ("step_overhead_s", "seq_overhead_s", "allreduce_hop_s"):
            if getattr(self, name) < 0:
                raise PlanError(f"efficiency {name} must be >= 0")

    @classmethod
    def parse(cls, text: str | None) -> Efficiency:
        """'bandwidth=0.7,compute=0.5' -> Efficiency (the rest default)."""
        if not text:
            return cls()
        names = {f.name for f in fields(cls)}
        values = {}
        for part in text.split(","):
            key, sep, value = part.partition("=")
            if not sep or key.strip() not in names:
                raise PlanError(f"bad --efficiency term {part!r}; keys: {', '.join(sorted(names))}")
            values[key.strip()] = float(value)
        return cls(**values)


def roofline_step_model(gpu: GpuSpec, arch: ModelArch, tp: int, shape: ModelShape,
                        weight_dtype: str, eff: Efficiency) -> StepModel:
    """The roofline StepModel of `arch` split over `tp` GPUs of kind `gpu`. Under TP each
    layer all-reduces its attention and MLP outputs as a ring: 2 (tp-1)/tp of the data per GPU
    at the link's bandwidth, in 2 (tp-1) steps that each pay a latency (the alpha-beta model of
    a ring all-reduce: fitted on TP2, the latency must grow with the ring at TP4)."""
    token_s, step_s = 0.0, eff.step_overhead_s
    if tp > 1:
        if not gpu.interconnect_gbs:
            raise PlanError(f"{gpu.key} has no interconnect figure; tensor parallelism over it "
                            "cannot be estimated (add interconnect_gbs with --gpu-spec)")
        link = gpu.interconnect_gbs / 2 * 1e9 * eff.interconnect
        allreduces = 2 * arch.num_layers
        token_s = allreduces * 2 * (tp - 1) / tp * arch.hidden_size * ACTIVATION_BYTES / link
        step_s += allreduces * 2 * (tp - 1) * eff.allreduce_hop_s
    return StepModel(shape=shape, step_s=step_s, seq_s=eff.seq_overhead_s, token_s=token_s,
                     byte_s=1 / (gpu.memory_bandwidth_gbs * 1e9 * eff.bandwidth),
                     flop_s=1 / (gpu.tflops(weight_dtype) * 1e12 * eff.compute),
                     overlap=eff.overlap)
