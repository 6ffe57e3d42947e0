"""Memory per GPU: weights under a tensor-parallel split, runtime overhead, and what is left
for the KV cache. The KV figures themselves come from `loom.model.memory.KVCacheSpec`, the
function that sizes loom's own cache at start-up: there is one KV formula in loom.

Assumptions, stated once here and printed by `loom plan`:

* Tensor parallelism splits attention heads, the MLP and the vocabulary (embedding and lm_head
  are vocab-parallel, as in vLLM); norms are replicated; KV heads are split, or replicated
  one per GPU where the split exceeds them.
* Quantized weight dtypes (fp8, int8, int4) apply to the linear layers; embedding, lm_head and
  norms stay 16-bit, as in vLLM's fp8 / AWQ / GPTQ checkpoints. int4 counts a 16-bit scale per
  group of 128 weights. `gguf` is the file's own tensors, divided by the split.
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

WEIGHT_DTYPES: dict[str, float | None] = {"float32": 4, "bf16": 2, "fp16": 2, "fp8": 1,
                                          "int8": 1, "int4": 0.5 + 2 / 128, "gguf": None}
KV_DTYPES = {"float32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
ACTIVATION_BYTES = 2
LOGIT_BYTES = 4


def check_split(arch: ModelArch, tp: int) -> None:
    """The splits vLLM accepts: heads and MLP divide evenly; KV heads divide, or are a
    divisor of the split (then each GPU holds a replica of one)."""
    if tp < 1:
        raise PlanError(f"tensor_parallel_size must be >= 1, got {tp}")
    if arch.num_heads % tp:
        raise PlanError(f"tensor_parallel_size {tp} does not divide the model's "
                        f"{arch.num_heads} attention heads")
    if arch.intermediate_size % tp:
        raise PlanError(f"tensor_parallel_size {tp} does not divide the MLP width "
                        f"{arch.intermediate_size}")
    kv = arch.num_kv_heads
    if kv % tp and tp % kv:
        raise PlanError(f"tensor_parallel_size {tp} neither divides the {kv} KV heads nor is "
                        "a multiple of them")


def kv_heads_per_gpu(arch: ModelArch, tp: int) -> int:
    return max(1, arch.num_kv_heads // tp)


@dataclass(frozen=True)
class ParamsPerGpu:
    """Parameters one GPU holds, by kind (they are stored and computed differently)."""

    linear: int      # attention and MLP projections (with biases)
    embedding: int
    lm_head: int     # 0 when tied to the embedding (same tensor)
    norms: int

    @property
    def total(self) -> int:
        return self.linear + self.embedding + self.lm_head + self.norms


def params_per_gpu(arch: ModelArch, tp: int) -> ParamsPerGpu:
    check_split(arch, tp)
    h, hd = arch.hidden_size, arch.head_dim
    q = arch.num_heads * hd // tp
    kv = kv_heads_per_gpu(arch, tp) * hd
    attention = h * q + 2 * h * kv + q * h + (q + 2 * kv if arch.attention_bias else 0)
    mlp = 3 * h * arch.intermediate_size // tp
    vocab = arch.vocab_size * h // tp
    return ParamsPerGpu(linear=arch.num_layers * (attention + mlp), embedding=vocab,
                        lm_head=0 if arch.tie_word_embeddings else vocab,
                        norms=(2 * arch.num_layers + 1) * h)


def weight_bytes_per_gpu(model: PlanModel, tp: int, weight_dtype: str) -> int:
    if weight_dtype not in WEIGHT_DTYPES:
        raise PlanError(f"unknown weight dtype {weight_dtype!r}; use one of "
                        f"{', '.join(WEIGHT_DTYPES)}")
    params = params_per_gpu(model.arch, tp)
    if weight_dtype == "gguf":
        if model.gguf_weight_bytes is None:
            raise PlanError(f"weight dtype 'gguf' needs a GGUF model; {model.name} is not one")
        return -(-model.gguf_weight_bytes // tp)
    linear_bytes = WEIGHT_DTYPES[weight_dtype]
    other_bytes = max(linear_bytes, ACTIVATION_BYTES)
    rest = params.embedding + params.lm_head + params.norms
    return int(params.linear * linear_bytes + rest * other_bytes)


def activation_bytes(arch: ModelArch, tp: int, max_num_batched_tokens: int,
                     max_num_seqs: int) -> int:
    """Peak live activations of one step, plus the logits of the sampled rows."""
    hd = arch.head_dim
    qkv = (arch.num_heads // tp + 2 * kv_heads_per_gpu(arch, tp)) * hd
    per_token = 2 * arch.hidden_size + qkv + 2 * arch.intermediate_size // tp
    return (max_num_batched_tokens * per_token * ACTIVATION_BYTES
            + max_num_seqs * arch.vocab_size * LOGIT_BYTES)
