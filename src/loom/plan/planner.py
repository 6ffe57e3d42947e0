"""`loom plan`'s answer per (GPU, tensor-parallel size, concurrency): does the model fit, how
many sequences of max_model_len the KV cache holds, how long a context each of N sequences can
have, a roofline estimate of decode and prefill speed, and the flags that size the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from loom.config import flag_help, parse_size
from loom.model.memory import KVCacheLayout, KVCacheSpec
from loom.plan.catalogue import GpuSpec, PlanError, load_catalogue, resolve_gpus
from loom.plan.models import PlanModel
from loom.plan.roofline import Efficiency, ModelShape, StepModel, StepWork, roofline_step_model
from loom.plan.sizing import (
    KV_DTYPES,
    activation_bytes,
    routed_expert_bytes_per_gpu,
    weight_bytes_per_gpu,
)

GIB = 2**30
# the weight dtypes loom serves (CUDA's auto dtype is bf16; a CPU's may be float32, which
# would not fit the budget planned), as its flag
LOOM_DTYPES = {"bf16": " --dtype bfloat16", "fp16": " --dtype float16",
               "float32": " --dtype float32", "gguf": ""}
# vLLM quantizes a 16-bit checkpoint to fp8 as it loads; int8 and int4 need a checkpoint
# quantized beforehand, whose config names its method
VLLM_WEIGHT_FLAGS = {"fp16": " --dtype float16", "float32": " --dtype float32",
                     "fp8": " --quantization fp8"}
WEIGHT_NOTES = {
    "int8": "int8 weights: serve an int8 (W8A8) checkpoint of the model in its place; vLLM "
            "reads the quantization from its config. loom serves 16/32-bit or GGUF weights.",
    "int4": "int4 weights: serve an AWQ / GPTQ checkpoint of the model in its place; vLLM "
            "reads the quantization from its config. loom serves 16/32-bit or GGUF weights.",
    "fp8": "fp8 weights: vLLM quantizes them as it loads; loom serves 16/32-bit or GGUF "
           "weights.",
    "nvfp4": "nvfp4 weights: serve an NVFP4 checkpoint (e.g. NVIDIA ModelOpt's) in its place; "
             "vLLM reads the quantization from its config. loom serves 16/32-bit or GGUF "
             "weights.",
    "mxfp4": "mxfp4 weights: serve an MXFP4 checkpoint (as gpt-oss ships) in its place; vLLM "
             "reads the quantization from its config. loom serves 16/32-bit or GGUF weights."}


@dataclass(frozen=True)
class PlanSettings:
    """Everything `loom plan` varies besides model and GPUs; validated once."""

    max_model_len: int
    concurrencies: tuple[int, ...] = (1,)
    tensor_parallel_sizes: tuple[int, ...] = (1,)
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    block_size: int = 16
    safety_margin: float = 0.10
    framework_bytes: int = GIB
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    efficiency: Efficiency = Efficiency()
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise PlanError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise PlanError("concurrency values must be >= 1")
        if not self.tensor_parallel_sizes or min(self.tensor_parallel_sizes) < 1:
            raise PlanError("tensor_parallel_size values must be >= 1")
        if self.kv_dtype not in KV_DTYPES:
            raise PlanError(f"unknown KV dtype {self.kv_dtype!r}; use one of "
                            f"{', '.join(KV_DTYPES)}")
        if not 0 <= self.safety_margin < 1:
            raise PlanError(f"safety margin must be in [0, 1), got {self.safety_margin}")
        if self.block_size < 1 or self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise PlanError("block_size, max_num_batched_tokens and max_num_seqs must be >= 1")


def csv_ints(text: str) -> tuple[int, ...]:
    """'1,2,4' -> (1, 2, 4)."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None


def csv_names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


@dataclass(frozen=True)
class PlanFlags:
    """What `loom plan` is asked, as its flags give it; `settings` resolves it. The GPU
    fields (GPU_FIELDS) are `loom simulate --gpus`'s too, which takes the sizes from its
    engine flags instead."""

    CLI_GROUP = "Plan"

    gpus: tuple[str, ...] | None = field(default=None, metadata=flag_help(
        "GPUs from the catalogue, 'this' (measured) or --gpu-spec; default: every catalogued "
        "GPU", parse=csv_names))
    tensor_parallel_size: tuple[int, ...] = field(default=(1,), metadata=flag_help(
        "GPUs per replica, one value or a list, e.g. 1,2,4", parse=csv_ints))
    weight_dtype: Literal["auto", "float32", "bf16", "fp16", "fp8", "int8", "int4", "nvfp4",
                          "mxfp4", "gguf"] = field(default="auto", metadata=flag_help(
        "weight storage (int4: weight-only, AWQ/GPTQ-style, computing in 16-bit; nvfp4 / "
        "mxfp4: 4.5 / 4.25 bits a weight with their scales, on fp4 tensor cores where the GPU "
        "has them, else weight-only); auto = the GGUF's own for a .gguf, else bf16"))
    expert_parallel: bool = field(default=False, metadata=flag_help(
        "mixture of experts: hold whole experts, num_experts / TP per GPU (vLLM's "
        "--enable-expert-parallel); default: every expert sliced across the TP GPUs"))
    kv_dtype: Literal["float32", "bf16", "fp16", "fp8"] = field(
        default="bf16", metadata=flag_help("KV cache dtype"))
    safety_margin: float = field(default=0.10, metadata=flag_help(
        "share of GPU memory kept free"))
    runtime_overhead: str = field(default="1GiB", metadata=flag_help(
        "fixed framework memory per GPU (CUDA context, workspaces, allocator)"))
    efficiency: str | None = field(default=None, metadata=flag_help(
        "roofline factors, e.g. bandwidth=0.8,compute=0.6,interconnect=0.7,"
        "step_overhead_s=0.002,seq_overhead_s=2e-5,allreduce_hop_s=5e-6; default: those "
        "values"))
    gpu_spec: list[str] | None = field(default=None, metadata=flag_help(
        'extra GPUs: JSON {"gpus": {"name": {"memory_gb": .., "memory_bandwidth_gbs": .., '
        '"bf16_tflops": .., ...}}} (repeatable); default: the catalogue only'))
    price: str | None = field(default=None, metadata=flag_help(
        "$ per GPU-hour as you were quoted, e.g. h100-sxm=2.4,h200=3.1, for GPUs in --gpus "
        "(loom ships no prices); default: no costs"))
    max_model_len: int | None = field(default=None, metadata=flag_help(
        "prompt + output tokens per sequence; default: the model's context"))
    concurrency: tuple[int, ...] = field(default=(1,), metadata=flag_help(
        "concurrent sequences of max_model_len, one value or a list", parse=csv_ints))
    block_size: int = field(default=16, metadata=flag_help("tokens per KV block"))
    max_num_batched_tokens: int = field(default=2048, metadata=flag_help(
        "tokens per step (sizes the activations)"))
    max_num_seqs: int = field(default=128, metadata=flag_help(
        "sequences per step (sizes the logits)"))

    GPU_FIELDS = ("gpus", "tensor_parallel_size", "weight_dtype", "expert_parallel",
                  "kv_dtype", "safety_margin", "runtime_overhead", "efficiency", "gpu_spec",
                  "price")


def settings(model: PlanModel, flags: PlanFlags) -> PlanSettings:
    """The settings `flags` ask for on `model` (auto dtypes and defaults resolved)."""
    weight_dtype = flags.weight_dtype
    if weight_dtype == "auto":
        weight_dtype = "gguf" if model.gguf_weight_bytes is not None else "bf16"
    max_model_len = flags.max_model_len  # 0 is refused by PlanSettings, not the default
    return PlanSettings(
        max_model_len=model.arch.max_position_embeddings if max_model_len is None
        else max_model_len,
        concurrencies=tuple(dict.fromkeys(flags.concurrency)),
        tensor_parallel_sizes=tuple(dict.fromkeys(flags.tensor_parallel_size)),
        weight_dtype=weight_dtype, kv_dtype=flags.kv_dtype, block_size=flags.block_size,
        safety_margin=flags.safety_margin, framework_bytes=parse_size(flags.runtime_overhead),
        max_num_batched_tokens=flags.max_num_batched_tokens, max_num_seqs=flags.max_num_seqs,
        efficiency=Efficiency.parse(flags.efficiency), expert_parallel=flags.expert_parallel)


def gpus_of(flags: PlanFlags) -> list[GpuSpec]:
    """The GPUs `flags` name (each once, however often named), or the whole catalogue."""
    catalogue = load_catalogue(flags.gpu_spec)
    names = dict.fromkeys(n.lower() for n in flags.gpus) if flags.gpus else sorted(catalogue)
    return resolve_gpus(list(names), catalogue)


@dataclass(frozen=True)
class Capacity:
    """Memory of one GPU of a (GPU, TP) configuration, and the step model that goes with it."""

    gpu: GpuSpec
    tp: int
    weights_bytes: int
    activation_bytes: int
    framework_bytes: int
    margin_bytes: int
    kv_spec: KVCacheSpec
    settings: PlanSettings
    step_model: StepModel

    @property
    def kv_budget_bytes(self) -> int:
        """What is left for the KV cache (negative when the rest does not even fit)."""
        return (self.gpu.memory_bytes - self.margin_bytes - self.weights_bytes
                - self.activation_bytes - self.framework_bytes)

    @property
    def layout(self) -> KVCacheLayout | None:
        """The KV blocks of each group the budget holds, as the engine would size them (a
        sliding-window layer keeps its windows only); None where not even one fits."""
        s = self.settings
        try:
            return self.kv_spec.layout(s.block_size, s.max_model_len, s.max_num_seqs,
                                       s.max_num_batched_tokens,
                                       budget_bytes=max(self.kv_budget_bytes, 0))
        except ValueError:
            return None

    @property
    def num_blocks(self) -> int:
        """Blocks of the full-attention layers: the pool requests are admitted against."""
        return self.layout.num_blocks if self.layout is not None else 0


def capacity(model: PlanModel, gpu: GpuSpec, tp: int, s: PlanSettings) -> Capacity:
    """Weights, overhead and the KV blocks left on each GPU of `tp` x `gpu`."""
    arch = model.arch
    weights = weight_bytes_per_gpu(model, tp, s.weight_dtype, s.expert_parallel)
    kv_bytes = KV_DTYPES[s.kv_dtype]
    shape = ModelShape.of(arch, tp, kv_bytes, weights,
                          routed_expert_bytes_per_gpu(model, tp, s.weight_dtype,
                                                      s.expert_parallel), s.expert_parallel)
    return Capacity(gpu, tp, weights,
                    activation_bytes(arch, tp, s.max_num_batched_tokens, s.max_num_seqs),
                    s.framework_bytes, int(gpu.memory_bytes * s.safety_margin),
                    KVCacheSpec.for_model(arch, kv_bytes, tp), s,
                    roofline_step_model(gpu, arch, tp, shape, s.weight_dtype, s.efficiency))


def plan(model: PlanModel, gpus: list[GpuSpec], s: PlanSettings) -> list[dict[str, Any]]:
    """One row per (gpu, tp, concurrency), in that order."""
    if s.max_model_len > model.arch.max_position_embeddings:
        raise PlanError(f"max_model_len {s.max_model_len} exceeds {model.name}'s context "
                        f"length {model.arch.max_position_embeddings}")
    return [row(cap, c, model, s) for gpu in gpus for tp in s.tensor_parallel_sizes
            for cap in [capacity(model, gpu, tp, s)] for c in s.concurrencies]


def row(cap: Capacity, concurrency: int, model: PlanModel, s: PlanSettings) -> dict[str, Any]:
    blocks_per_seq = -(-s.max_model_len // s.block_size)
    layout = cap.layout
    block_bytes = (layout.full_bytes_per_block if layout is not None
                   else cap.kv_spec.bytes_per_block(s.block_size))
    kv_needed = concurrency * blocks_per_seq * block_bytes + (
        layout.sliding_bytes if layout is not None else 0)
    # no sequence outgrows max_model_len, however much cache is left over
    max_context = min(cap.num_blocks // concurrency * s.block_size, s.max_model_len)
    decode_s = cap.step_model.time(StepWork.of([(1, s.max_model_len - 1, True)] * concurrency))
    prefill_tokens = min(s.max_num_batched_tokens, s.max_model_len)
    prefill_s = cap.step_model.time(StepWork.of([(prefill_tokens, 0, True)]))
    fits = cap.kv_budget_bytes > 0 and cap.num_blocks >= concurrency * blocks_per_seq
    notes = [n for n in (cap.gpu.fp4_note(s.weight_dtype),) if n]
    return {
        "model": model.name, "gpu": cap.gpu.key, "gpu_name": cap.gpu.name,
        "tensor_parallel_size": cap.tp, "num_gpus": cap.tp, "concurrency": concurrency,
        "max_model_len": s.max_model_len, "weight_dtype": s.weight_dtype,
        "kv_dtype": s.kv_dtype, "gpu_memory_bytes": cap.gpu.memory_bytes,
        "weights_bytes_per_gpu": cap.weights_bytes,
        "kv_bytes_per_token": cap.kv_spec.bytes_per_token,
        "kv_bytes_per_block": block_bytes,
        "kv_bytes_at_concurrency": concurrency * s.max_model_len * cap.kv_spec.bytes_per_token,
        "kv_bytes_needed": kv_needed,
        "activation_bytes": cap.activation_bytes, "framework_bytes": cap.framework_bytes,
        "safety_margin_bytes": cap.margin_bytes, "kv_budget_bytes": max(cap.kv_budget_bytes, 0),
        "num_kv_blocks": cap.num_blocks, "fits": fits,
        "max_concurrency": cap.num_blocks // blocks_per_seq,
        "max_context_at_concurrency": max_context,
        # a configuration that does not fit has no speed: it would not run at all
        "decode_tok_s_per_seq": 1 / decode_s if fits else None,
        "decode_tok_s": concurrency / decode_s if fits else None,
        "prefill_tok_s": prefill_tokens / prefill_s if fits else None,
        "params_total": model.arch.num_parameters,
        "params_active": model.arch.num_active_parameters,
        "weight_bytes_read_per_decode_step": cap.step_model.shape.weight_bytes_read(concurrency),
        "expert_parallel": s.expert_parallel, "notes": notes,
        "flags": flags(cap, model, s),
    }


def flags(cap: Capacity, model: PlanModel, s: PlanSettings) -> dict[str, Any]:
    """The flags that give the cache this budget: loom's --kv-cache-memory (loom serves on
    one device, so only without a split) and vLLM's --gpu-memory-utilization (the share of
    memory vLLM may use for weights, activations and KV together: all but the margin)."""
    budget_mib = max(cap.kv_budget_bytes, 0) // 2**20
    loom = None
    if cap.tp == 1 and budget_mib > 0 and s.weight_dtype in LOOM_DTYPES and model.loom_runs:
        loom = (f"--max-model-len {s.max_model_len} --kv-cache-memory {budget_mib}MiB "
                f"--max-num-batched-tokens {s.max_num_batched_tokens} "
                f"--max-num-seqs {s.max_num_seqs}" + LOOM_DTYPES[s.weight_dtype])
    vllm = (f"--tensor-parallel-size {cap.tp} --max-model-len {s.max_model_len} "
            f"--gpu-memory-utilization {1 - s.safety_margin:.2f} "
            f"--max-num-batched-tokens {s.max_num_batched_tokens} --max-num-seqs {s.max_num_seqs}"
            + VLLM_WEIGHT_FLAGS.get(s.weight_dtype, "")
            + (" --kv-cache-dtype fp8" if s.kv_dtype == "fp8" else "")
            + (" --enable-expert-parallel" if s.expert_parallel else ""))
    return {"kv_cache_memory_bytes": budget_mib * 2**20 if loom else None,
            "gpu_memory_utilization": round(1 - s.safety_margin, 2),
            "loom": loom, "vllm": vllm,
            "loom_serve": f"loom serve --model {model.loom_model} {loom}" if loom else None,
            "download": model.download if loom else None,
            "vllm_serve": f"vllm serve {model.serve_name} {vllm}",
            "note": WEIGHT_NOTES.get(s.weight_dtype)}
