"""A decoder's shape from a GGUF header: llama.cpp's metadata keys, and the rules its graph
applies where the file says nothing (sliding patterns, Gemma's attention scale, SmolLM3's
layers without RoPE, which mixtures renormalise their experts' weights)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from loom.model.arch import (
    GEMMA_FAMILIES,
    GGUF_ARCHITECTURES,
    NOPE_INTERVAL,
    ROPE_FREQS_TENSOR,
    ROPE_LONG_TENSOR,
    ROPE_SHORT_TENSOR,
    ModelArch,
    ModelLoadError,
    family_traits,
    layer_types_of,
)
from loom.model.gguf_file import GGUFTensor, dequantize

# Layers llama.cpp's graph makes sliding where a GGUF names no pattern (llama-model.cpp's
# set_swa_pattern): Gemma 2 every other layer from the first, Gemma 3 five in every six.
_GGUF_FULL_EVERY = {"gemma2": 2, "gemma3": 6}
# Gemma's 27B models scale q.k by (hidden / heads) ** -0.5, the others by head_dim ** -0.5: the
# converter writes no attention scale and llama.cpp tells them apart by their layer count.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
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
    if scale is None and arch_name in GEMMA_FAMILIES:
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
        nope_layers=(tuple(i for i in range(num_layers) if (i + 1) % NOPE_INTERVAL == 0)
                     if arch_name == "smollm3" else ()),
        **_gguf_experts(meta, tensors, p, arch_name, num_layers, file_name),
        **family_traits(arch_name, hidden),
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
    return layer_types_of(sliding, window)


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
