"""A decoder's shape from a Hugging Face config.json, in either layout transformers writes
(its RoPE parameters, sliding-window layers and experts named as each family names them)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from loom.model.arch import (
    GEMMA_FAMILIES,
    HF_MODEL_TYPES,
    LAYER_TYPES,
    NOPE_INTERVAL,
    ModelArch,
    ModelLoadError,
    family_traits,
    layer_types_of,
)

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
        activation = config.get("hidden_activation" if family in GEMMA_FAMILIES else "hidden_act",
                                "gelu_pytorch_tanh" if family in GEMMA_FAMILIES else "silu")
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
            tie_word_embeddings=config.get("tie_word_embeddings", family in GEMMA_FAMILIES),
            # Qwen2-MoE calls its q/k/v biases qkv_bias
            attention_bias=config.get("qkv_bias" if family == "qwen2moe" else "attention_bias",
                                      family in ("qwen2", "qwen2moe")),
            rope_scaling=rope.scaling,
            layer_types=layer_types,
            sliding_window=window,
            qk_norm=("head" if family in ("qwen3", "qwen3moe", "gemma3") else
                     "projection" if family == "olmoe" else None),
            attention_scale=(config.get("query_pre_attn_scalar", head_dim) ** -0.5
                             if family in GEMMA_FAMILIES else None),
            attn_softcap=config.get("attn_logit_softcapping") if family == "gemma2" else None,
            final_softcap=(config.get("final_logit_softcapping") if family in GEMMA_FAMILIES
                           else None),
            rotary_dim=rotary_dim if rotary_dim < head_dim else None,
            rope_local_theta=rope.local_theta,
            nope_layers=_hf_nope_layers(config, family, num_layers),
            **_hf_experts(config, family, num_layers),
            **{**family_traits(family, hidden), "activation": _HF_ACTIVATIONS[activation]},
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
    elif family in GEMMA_FAMILIES:
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
    return layer_types_of(sliding, window)


def _hf_nope_layers(config: Mapping[str, Any], family: str, num_layers: int) -> tuple[int, ...]:
    """SmolLM3's layers without RoPE: `no_rope_layers` (1 = RoPE, per layer), else every
    `no_rope_layer_interval`-th layer (transformers' SmolLM3Config)."""
    if family != "smollm3":
        return ()
    flags = config.get("no_rope_layers")
    if flags is None:
        interval = config.get("no_rope_layer_interval", NOPE_INTERVAL)
        return tuple(i for i in range(num_layers) if (i + 1) % interval == 0)
    if not isinstance(flags, list) or len(flags) != num_layers:
        raise ModelLoadError(f"config.json: no_rope_layers must list {num_layers} layers")
    return tuple(i for i, uses_rope in enumerate(flags) if not uses_rope)
