"""Memory per GPU: weights under a tensor-parallel split, runtime overhead, and what is left
for the KV cache. The KV figures themselves come from `loom.model.memory.KVCacheSpec`, the
function that sizes loom's own cache at start-up: there is one KV formula in loom.

Assumptions, stated once here and printed by `loom plan`:

* Tensor parallelism splits attention heads, the MLP and the vocabulary (embedding and lm_head
  are vocab-parallel, as in vLLM); norms are replicated; KV heads are split, or replicated
  one per GPU where the split exceeds them.
* Quantized weight dtypes (fp8, int8, int4, nvfp4, mxfp4) apply to the linear layers;
  embedding, lm_head and norms stay 16-bit, as in vLLM's fp8 / AWQ / GPTQ / ModelOpt
  checkpoints. Bytes per weight count the scales: int4 a 16-bit scale per group of 128
  (4.125 bits), NVFP4 an fp8 (e4m3) scale per 16 (4.5 bits; its one fp32 scale per tensor is
  nothing), MXFP4 an e8m0 scale per 32 (4.25 bits). `gguf` is the file's own tensors,
  divided by the split.
* A mixture of experts: the router is replicated; each expert is sliced across the TP GPUs
  (vLLM's default), or with expert parallelism held whole, num_experts / TP of them per GPU
  (vLLM's --enable-expert-parallel, EP = TP). Memory per GPU is the same either way where
  the division is even; what differs is which splits are possible and the all-to-all.
* Runtime overhead = activations of one step at max_num_batched_tokens (residual, normed
  input, fused qkv and gate_up outputs, 16-bit) + fp32 logits for max_num_seqs rows + a fixed
  framework share (CUDA context, cuBLAS / NCCL workspaces, allocator; default 1 GiB).
  Fragmentation inside the KV cache is whole blocks, counted per sequence; allocator
  fragmentation is what the safety margin (default 10% of memory) is for.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.model.arch import ModelArch
from loom.plan.catalogue import PlanError
from loom.plan.models import PlanModel

WEIGHT_DTYPES: dict[str, float | None] = {
    "float32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": 0.5 + 2 / 128,
    "nvfp4": 0.5 + 1 / 16, "mxfp4": 0.5 + 1 / 32, "gguf": None}
KV_DTYPES = {"float32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
ACTIVATION_BYTES = 2
LOGIT_BYTES = 4


def check_split(arch: ModelArch, tp: int, expert_parallel: bool = False) -> None:
    """The splits vLLM accepts: heads and MLP divide evenly; KV heads divide, or are a
    divisor of the split (then each GPU holds a replica of one); experts are sliced evenly
    or, with expert parallelism, placed evenly."""
    if tp < 1:
        raise PlanError(f"tensor_parallel_size must be >= 1, got {tp}")
    if arch.num_heads % tp:
        raise PlanError(f"tensor_parallel_size {tp} does not divide the model's "
                        f"{arch.num_heads} attention heads")
    if _moe_layers(arch) < arch.num_layers and arch.intermediate_size % tp:
        raise PlanError(f"tensor_parallel_size {tp} does not divide the MLP width "
                        f"{arch.intermediate_size}")
    if expert_parallel and not arch.num_experts:
        raise PlanError("expert parallelism needs a mixture-of-experts model; this one is dense")
    if expert_parallel and arch.num_experts % tp:
        raise PlanError(f"expert parallelism over {tp} GPUs does not divide the "
                        f"{arch.num_experts} experts")
    if arch.num_experts and not expert_parallel and arch.moe_intermediate_size % tp:
        raise PlanError(f"tensor_parallel_size {tp} does not divide the expert width "
                        f"{arch.moe_intermediate_size} (try --expert-parallel)")
    kv = arch.num_kv_heads
    if kv % tp and tp % kv:
        raise PlanError(f"tensor_parallel_size {tp} neither divides the {kv} KV heads nor is "
                        "a multiple of them")


def kv_heads_per_gpu(arch: ModelArch, tp: int) -> int:
    return max(1, arch.num_kv_heads // tp)


def _moe_layers(arch: ModelArch) -> int:
    return sum(arch.has_experts(i) for i in range(arch.num_layers))


@dataclass(frozen=True)
class ParamsPerGpu:
    """Parameters one GPU holds, by kind (they are stored and computed differently).
    `routed_experts` is the part of `linear` a step reads only where its tokens route;
    `active_linear` the linear weights one token goes through on this GPU, on average (all
    of `linear` for a dense model)."""

    linear: int      # attention and MLP projections (with biases, routers, every expert held)
    embedding: int
    lm_head: int     # 0 when tied to the embedding (same tensor)
    norms: int
    routed_experts: int = 0
    active_linear: int = 0

    @property
    def total(self) -> int:
        return self.linear + self.embedding + self.lm_head + self.norms


def params_per_gpu(arch: ModelArch, tp: int, expert_parallel: bool = False) -> ParamsPerGpu:
    """Per GPU under a TP split. A routed expert's share is E * expert / TP either way (sliced
    1/TP each, or E/TP whole ones); a token's k experts cost k * expert / TP on average."""
    check_split(arch, tp, expert_parallel)
    h, hd = arch.hidden_size, arch.head_dim
    q = arch.num_heads * hd // tp
    kv = kv_heads_per_gpu(arch, tp) * hd
    attention = h * q + 2 * h * kv + q * h + (q + 2 * kv if arch.attention_bias else 0)
    moe_layers = _moe_layers(arch)
    dense = (arch.num_layers - moe_layers) * 3 * h * arch.intermediate_size // tp
    expert = 3 * h * arch.moe_intermediate_size
    shared_width = arch.shared_expert_intermediate_size
    always = arch.num_experts * h + (3 * h * shared_width // tp + h if shared_width else 0)
    routed = moe_layers * arch.num_experts * expert // tp
    active = moe_layers * (arch.num_experts_per_tok * expert // tp + always)
    vocab = arch.vocab_size * h // tp
    fixed = arch.num_layers * attention + dense
    return ParamsPerGpu(linear=fixed + routed + moe_layers * always, embedding=vocab,
                        lm_head=0 if arch.tie_word_embeddings else vocab,
                        norms=(2 * arch.num_layers + 1) * h, routed_experts=routed,
                        active_linear=fixed + active)


def weight_bytes_per_gpu(model: PlanModel, tp: int, weight_dtype: str,
                         expert_parallel: bool = False) -> int:
    return _weight_bytes(model, tp, weight_dtype, expert_parallel)[0]


def routed_expert_bytes_per_gpu(model: PlanModel, tp: int, weight_dtype: str,
                                expert_parallel: bool = False) -> int:
    """Of weight_bytes_per_gpu, the routed experts' (a step reads them only where its tokens
    route; 0 for a dense model)."""
    return _weight_bytes(model, tp, weight_dtype, expert_parallel)[1]


def _weight_bytes(model: PlanModel, tp: int, weight_dtype: str,
                  expert_parallel: bool) -> tuple[int, int]:
    """(all weight bytes per GPU, the routed experts' part)."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise PlanError(f"unknown weight dtype {weight_dtype!r}; use one of "
                        f"{', '.join(WEIGHT_DTYPES)}")
    params = params_per_gpu(model.arch, tp, expert_parallel)
    if weight_dtype == "gguf":
        if model.gguf_weight_bytes is None:
            raise PlanError(f"weight dtype 'gguf' needs a GGUF model; {model.name} is not one")
        total = -(-model.gguf_weight_bytes // tp)  # experts: their share of the parameters
        return total, total * params.routed_experts // params.total
    linear_bytes = WEIGHT_DTYPES[weight_dtype]
    other_bytes = max(linear_bytes, ACTIVATION_BYTES)
    rest = params.embedding + params.lm_head + params.norms
    return (int(params.linear * linear_bytes + rest * other_bytes),
            int(params.routed_experts * linear_bytes))


def activation_bytes(arch: ModelArch, tp: int, max_num_batched_tokens: int,
                     max_num_seqs: int) -> int:
    """Peak live activations of one step, plus the logits of the sampled rows. A mixture's
    MLP output per token is its k experts' (and the shared one's) gate_up rows."""
    hd = arch.head_dim
    qkv = (arch.num_heads // tp + 2 * kv_heads_per_gpu(arch, tp)) * hd
    mlp = arch.intermediate_size
    if arch.num_experts:
        moe = arch.num_experts_per_tok * arch.moe_intermediate_size \
            + arch.shared_expert_intermediate_size
        mlp = max(moe, mlp if _moe_layers(arch) < arch.num_layers else 0)
    per_token = 2 * arch.hidden_size + qkv + 2 * mlp // tp
    return (max_num_batched_tokens * per_token * ACTIVATION_BYTES
            + max_num_seqs * arch.vocab_size * LOGIT_BYTES)
