"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a flat batch of tokens.

Tokens of many requests are concatenated into one [num_tokens, hidden] matrix, so every
projection is one matmul for the whole step; only attention looks at request boundaries,
through the paged KV cache. Q/K/V and gate/up projections are fused to cut per-step ops.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import partial
from types import ModuleType

import torch
import torch.nn.functional as F

from loom.model.arch import ModelArch, ModelLoadError
from loom.model.attention import (
    AttentionMetadata,
    LayerAttention,
    paged_attention,
    rope_write_attend,
    write_kv,
)
from loom.model.kernels import block_quant_linear_ops
from loom.model.linear import Linear
from loom.model.memory import sliding_layers
from loom.model.weights import BlockQuantWeight, LazyWeights


class LlamaLayer:
    def __init__(self, w: Mapping[str, torch.Tensor], prefix: str, bias: bool,
                 prepack: bool, block_quant: dict[str, BlockQuantWeight],
                 bf16_above_rows: int | None) -> None:
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        qkv_bias = torch.cat([w[attn + f"{x}_proj.bias"] for x in "qkv"]) if bias else None
        linear = partial(_linear, w, prepack=prepack, block_quant=block_quant,
                         bf16_above_rows=bf16_above_rows)
        self.qkv = linear([attn + f"{x}_proj.weight" for x in "qkv"], qkv_bias)
        # Llama's attention_bias also puts a bias on o_proj, and mlp_bias on all three MLP
        # projections (Qwen2 has q/k/v biases only): use whichever the checkpoint has.
        self.o = linear([attn + "o_proj.weight"], w.get(attn + "o_proj.bias"))
        gate_bias, up_bias = w.get(mlp + "gate_proj.bias"), w.get(mlp + "up_proj.bias")
        self.gate_up = linear([mlp + "gate_proj.weight", mlp + "up_proj.weight"],
                              torch.cat([gate_bias, up_bias]) if gate_bias is not None else None)
        self.down = linear([mlp + "down_proj.weight"], w.get(mlp + "down_proj.bias"))
        self.input_norm = w[prefix + "input_layernorm.weight"]
        self.post_attn_norm = w[prefix + "post_attention_layernorm.weight"]


def _linear(w: Mapping[str, torch.Tensor], names: list[str], bias: torch.Tensor | None,
            prepack: bool, block_quant: dict[str, BlockQuantWeight],
            bf16_above_rows: int | None) -> Linear:
    """One projection from the named weights, stacked along the output rows; with the GGUF's
    block-quantized form too when every part has one (and then, with bf16_above_rows, a
    bf16 copy for wide calls: model/linear.py). The fp32 parts are stacked only when the layer
    will use them."""
    quant, ops = None, None
    if all(n in block_quant for n in names):
        quant = BlockQuantWeight.cat([block_quant[n] for n in names])
        ops = block_quant_linear_ops()
    if Linear.uses_panels(quant, ops):
        return Linear(None, bias, prepack, quant, ops, bf16_above_rows)
    weight = torch.cat([w[n] for n in names]) if len(names) > 1 else w[names[0]]
    return Linear(weight, bias, prepack, quant, ops)


class LlamaModel:
    def __init__(self, arch: ModelArch, weights: Mapping[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, prepack: bool = False,
                 block_quant: dict[str, BlockQuantWeight] | None = None,
                 fused_ops: ModuleType | None = None,
                 bf16_above_rows: int | None = None) -> None:
        """prepack: hold the projection weights prepacked for oneDNN; block_quant: the GGUF's
        block-quantized weights, for the native matmul (see model/linear.py), which with
        bf16_above_rows hands calls of more rows to bf16 copies of them; fused_ops: the compiled
        add + RMSNorm and SiLU * up (CPU float32), else torch's ops."""
        self.arch = arch
        self.fused_ops = fused_ops
        missing = [n for n in _required_names(arch) if n not in weights]
        if missing:
            raise ModelLoadError(f"weights are missing {len(missing)} tensors, e.g. {missing[:3]}")
        # Converted when a layer asks: weights the native matmul takes are never made in fp32.
        w = LazyWeights({name: lambda name=name: weights[name].to(device=device, dtype=dtype)
                         for name in weights})
        block_quant = block_quant or {}
        # On a CPU the embedding is looked up in the GGUF's blocks, so its fp32 table (the
        # vocabulary x hidden) is never made; a tied lm_head runs on the same blocks.
        # (A copy: a view of the file's blocks would keep the whole file mapped, and every page
        # loading touched resident, for as long as the model runs.)
        embed = block_quant.get("model.embed_tokens.weight") if device.type == "cpu" else None
        self._embed_blocks = (None if embed is None
                              else BlockQuantWeight(embed.blocks.clone(), embed.kind))
        self._embed_table = (w["model.embed_tokens.weight"] if self._embed_blocks is None
                             else None)
        self.dtype = dtype
        head = "model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
        self.lm_head = _linear(w, [head], None, prepack, block_quant, bf16_above_rows)
        self.final_norm = w["model.norm.weight"]
        self.layers = [LlamaLayer(w, f"model.layers.{i}.", arch.attention_bias, prepack,
                                  block_quant, bf16_above_rows)
                       for i in range(arch.num_layers)]
        self.layer_attention = [
            LayerAttention(arch.head_dim ** -0.5, arch.sliding_window if sliding else None)
            for sliding in sliding_layers(arch)]
        inv_freq = rope_inv_freq(arch).to(device)
        positions = torch.arange(arch.max_position_embeddings, device=device, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        # Laid out for _rope: cos repeated over both halves, sin negated on the first half.
        self.rope_cos = torch.cat([freqs.cos(), freqs.cos()], dim=-1).to(dtype)
        self.rope_sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1).to(dtype)
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self._embed_blocks is None:
            return F.embedding(input_ids, self._embed_table)
        return self._embed_blocks.rows(input_ids).to(self.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:
        """[num_tokens] ids -> [num_tokens, hidden] final hidden states (normed)."""
        # On the native path the kernel reads the tables by position itself.
        rope = None if meta.paged_decodes is not None else (
            self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1))
        hidden, delta = self.embed(input_ids), None
        for layer, variant, (k_cache, v_cache) in zip(self.layers, self.layer_attention,
                                                      kv_caches):
            hidden, x = self._add_norm(hidden, delta, layer.input_norm)
            attn = self._attention(layer.qkv(x), positions, rope, k_cache, v_cache, meta,
                                   variant)
            hidden, x = self._add_norm(hidden, layer.o(attn), layer.post_attn_norm)
            delta = layer.down(self._silu_mul(layer.gate_up(x)))
        return self._add_norm(hidden, delta, self.final_norm)[1]

    def _attention(self, qkv: torch.Tensor, positions: torch.Tensor,
                   rope: tuple[torch.Tensor, torch.Tensor] | None, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, meta: AttentionMetadata,
                   layer: LayerAttention) -> torch.Tensor:
        """[tokens, q + k + v heads] projections -> [tokens, heads * head_dim] attention
        output, with this step's K/V written to the caches. rope: this step's (cos, sin), for
        the torch path; None for the native one, one call from qkv to the decode rows' output
        (model/attention.py: rope_write_attend)."""
        arch = self.arch
        if rope is None:
            return rope_write_attend(qkv, arch.num_heads, self.rope_cos, self.rope_sin,
                                     positions, k_cache, v_cache, meta, layer=layer)
        qk = _rope(qkv[:, :self.q_size + self.kv_size].view(
            -1, arch.num_heads + arch.num_kv_heads, arch.head_dim), *rope)
        q, k = qk[:, :arch.num_heads], qk[:, arch.num_heads:]  # rotated together: 3 ops
        v = qkv[:, self.q_size + self.kv_size:].reshape(-1, arch.num_kv_heads, arch.head_dim)
        write_kv(k_cache, v_cache, k, v, meta.for_layer(layer).slots)
        return paged_attention(q, k, v, k_cache, v_cache, meta, layer=layer)

    def _add_norm(self, hidden: torch.Tensor, delta: torch.Tensor | None,
                  weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden + delta, RMSNorm of that); the fused kernel adds into hidden in place."""
        eps = self.arch.rms_norm_eps
        if self.fused_ops is not None:
            return hidden, self.fused_ops.add_rms_norm(hidden, delta, weight, eps)
        if delta is not None:
            hidden = hidden + delta
        return hidden, F.rms_norm(hidden, (self.arch.hidden_size,), weight, eps)

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.fused_ops is not None:
            return self.fused_ops.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (transformers' layout) on [tokens, heads, head_dim]: with x = (x1, x2),
    (x1 c - x2 s, x2 c + x1 s) = x * (c, c) + (x2, x1) * (-s, s)."""
    tokens, heads, dim = x.shape
    swapped = x.view(tokens, heads, 2, dim // 2).flip(2).view(tokens, heads, dim)
    return torch.addcmul(x * cos, swapped, sin)


def _required_names(arch: ModelArch) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not arch.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    return names


def rope_inv_freq(arch: ModelArch) -> torch.Tensor:
    """RoPE inverse frequencies, with linear or Llama-3 style scaling when configured."""
    dim = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = arch.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq.float()
    if kind == "freq_factors":  # llama.cpp's rope_freqs tensor: divisors per frequency
        return (inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float64)).float()
    factor = scaling["factor"]
    if kind == "linear":
        return (inv_freq / factor).float()
    if kind == "llama3":
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled).float()
    raise ModelLoadError(f"unsupported rope_scaling type {kind!r}")
