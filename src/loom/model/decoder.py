"""The decoder every family runs through (Llama, Mistral, Qwen2/3, SmolLM2/3, Phi-3, Gemma 2/3,
and the mixtures of experts Mixtral, Qwen2/3-MoE and OLMoE), over a flat batch of tokens.

Tokens of many requests are concatenated into one [num_tokens, hidden] matrix, so every
projection is one matmul for the whole step; only attention looks at request boundaries,
through the paged KV cache. Q/K/V and gate/up projections are fused to cut per-step ops (Phi-3's
checkpoints come fused). What a family changes is data in its ModelArch, read here once into
each layer: q/k norms, Gemma's extra norms, (1 + w) norm weights, embedding scale, GeGLU and
logit softcap, each layer's attention variant (`LayerAttention`: scale, sliding window,
softcap) and its RoPE table (Gemma 3's local base, SmolLM3's layers without RoPE, Phi's
partial rotary). A mixture-of-experts layer runs its `MoeBlock` (model/moe.py: the native
kernel on a GGUF's blocks) where a dense one runs gate_up and down. A plain Llama takes the
same path it always did.
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
from loom.model.linear import Linear, MatmulRows
from loom.model.moe import MoeBlock, Routing, moe_from_hf
from loom.model.weights import BlockQuantWeight, LazyWeights


class DecoderLayer:
    def __init__(self, w: Mapping[str, torch.Tensor], prefix: str, arch: ModelArch,
                 attention: LayerAttention, rope: int | None, qk_rows: torch.Tensor | None,
                 norm: partial[torch.Tensor], prepack: bool,
                 block_quant: dict[str, BlockQuantWeight], matmul: MatmulRows,
                 experts: bool) -> None:
        """rope: the index of the layer's RoPE table in the model's, None for none; qk_rows:
        the order of the fused QKV projection's rows that puts a partial rotary's pairs half a
        head apart (`_rotary_layout`), None to keep the checkpoint's; norm: a norm weight by
        name, as the model applies it; experts: the MLP is a mixture of experts."""
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        linear = partial(_linear, w, prepack=prepack, block_quant=block_quant, matmul=matmul)
        qkv_bias = (torch.cat([w[attn + f"{x}_proj.bias"] for x in "qkv"]) if arch.attention_bias
                    else None)
        self.qkv = linear(_qkv_names(w, prefix), qkv_bias, rows=qk_rows)
        # Llama's attention_bias also puts a bias on o_proj, and mlp_bias on all three MLP
        # projections (Qwen2 has q/k/v biases only): use whichever the checkpoint has.
        self.o = linear([attn + "o_proj.weight"], w.get(attn + "o_proj.bias"))
        # the MLP: a mixture of experts (on the native kernel where the GGUF's experts are
        # blocks it reads), or gate_up and down
        self.moe: MoeBlock | None = None
        self.gate_up: Linear | None = None
        self.down: Linear | None = None
        if experts:
            self.moe = moe_from_hf(w, prefix, Routing.from_arch(arch), block_quant,
                                   block_quant_linear_ops() if block_quant else None,
                                   matmul.int8_max)
        else:
            gate_bias, up_bias = w.get(mlp + "gate_proj.bias"), w.get(mlp + "up_proj.bias")
            self.gate_up = linear(_gate_up_names(w, prefix), torch.cat([gate_bias, up_bias])
                                  if gate_bias is not None else None)
            self.down = linear([mlp + "down_proj.weight"], w.get(mlp + "down_proj.bias"))
        self.input_norm = norm(prefix + "input_layernorm.weight")
        # Gemma's post_attention_layernorm norms the attention output; Llama's is the MLP's input
        self.post_attn_norm: torch.Tensor | None = None
        self.post_mlp_norm: torch.Tensor | None = None
        if arch.sandwich_norms:
            self.post_attn_norm = norm(prefix + "post_attention_layernorm.weight")
            self.pre_mlp_norm = norm(prefix + "pre_feedforward_layernorm.weight")
            self.post_mlp_norm = norm(prefix + "post_feedforward_layernorm.weight")
        else:
            self.pre_mlp_norm = norm(prefix + "post_attention_layernorm.weight")
        self.q_norm, self.k_norm = None, None
        if arch.qk_norm is not None:  # a partial rotary's layout moves the normed dims too
            q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
            if qk_rows is None:
                q_dims = k_dims = slice(None)
            elif arch.qk_norm == "head":
                q_dims = k_dims = qk_rows[:arch.head_dim]
            else:
                q_dims, k_dims = qk_rows[:q], qk_rows[q:q + kv] - q
            self.q_norm = norm(attn + "q_norm.weight")[q_dims]
            self.k_norm = norm(attn + "k_norm.weight")[k_dims]
        self.attention = attention
        self.rope = rope


def _qkv_names(w: Mapping[str, torch.Tensor], prefix: str) -> list[str]:
    fused = prefix + "self_attn.qkv_proj.weight"
    return [fused] if fused in w else [prefix + f"self_attn.{x}_proj.weight" for x in "qkv"]


def _gate_up_names(w: Mapping[str, torch.Tensor], prefix: str) -> list[str]:
    fused = prefix + "mlp.gate_up_proj.weight"
    return [fused] if fused in w else [prefix + f"mlp.{x}_proj.weight" for x in ("gate", "up")]


def _linear(w: Mapping[str, torch.Tensor], names: list[str], bias: torch.Tensor | None,
            prepack: bool, block_quant: dict[str, BlockQuantWeight],
            matmul: MatmulRows, rows: torch.Tensor | None = None) -> Linear:
    """One projection from the named weights, stacked along the output rows (then reordered
    by `rows` where given); with the GGUF's block-quantized form too when every part has one
    (and then, by `matmul`, a bf16 copy for wide calls: model/linear.py), each run of one
    kind in its own (BlockQuantWeight.runs), a reordered stack in one kind. The fp32
    parts are stacked only when the layer will use them."""
    quant, ops = None, None
    if all(n in block_quant for n in names):
        parts = [block_quant[n] for n in names]
        ops = block_quant_linear_ops()
        if rows is None:
            quant = BlockQuantWeight.runs(parts)
        else:
            stacked = BlockQuantWeight.cat(parts)
            quant = [BlockQuantWeight(stacked.blocks[rows], stacked.kind)]
    if rows is not None and bias is not None:
        bias = bias[rows]
    if Linear.uses_panels(quant, ops):
        return Linear(None, bias, prepack, quant, ops, matmul.bf16_above, matmul.int8_max)
    weight = torch.cat([w[n] for n in names]) if len(names) > 1 else w[names[0]]
    if rows is not None:
        weight = weight[rows]
    return Linear(weight, bias, prepack, quant, ops)


class DecoderModel:
    def __init__(self, arch: ModelArch, weights: Mapping[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, prepack: bool = False,
                 block_quant: dict[str, BlockQuantWeight] | None = None,
                 fused_ops: ModuleType | None = None,
                 matmul: MatmulRows | None = None, max_model_len: int | None = None) -> None:
        """prepack: hold the projection weights prepacked for oneDNN; block_quant: the GGUF's
        block-quantized weights, for the native matmul (see model/linear.py), whose path for
        a call of so many rows `matmul` picks (bf16 copies, int8, fp32); fused_ops: the compiled
        add + RMSNorm and SiLU * up (CPU float32), else torch's ops; max_model_len: the context
        served (default the model's), which picks LongRoPE's long or short factors."""
        self.arch = arch
        self.fused_ops = fused_ops
        missing = [n for n in _required_names(arch, weights) if n not in weights]
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
        # Gemma multiplies by sqrt(hidden) rounded to the model's dtype, as transformers does
        self.embed_scale = (None if arch.embedding_scale == 1.0 else
                            torch.tensor(arch.embedding_scale).to(device=device, dtype=dtype))
        head = "model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
        matmul = matmul or MatmulRows()
        self.lm_head = _linear(w, [head], None, prepack, block_quant, matmul)

        def norm(name: str) -> torch.Tensor:  # Gemma's (1 + w), folded into the weight once
            return w[name] + arch.norm_offset if arch.norm_offset else w[name]

        self.final_norm = norm("model.norm.weight")
        context = max_model_len or arch.max_position_embeddings
        keys = dict.fromkeys(_rope_key(arch, i) for i in range(arch.num_layers))
        tables = {key: i for i, key in enumerate(k for k in keys if k is not None)}
        # Laid out for _rope: cos repeated over both halves, sin negated on the first half.
        self.rope_tables = [_rope_table(arch, theta, local, context, device, dtype)
                            for theta, local in tables]
        # what the native kernel applies to a layer without RoPE: cos 1, sin 0 (at position 0)
        self._no_rope = (torch.ones(1, arch.head_dim, device=device, dtype=dtype),
                         torch.zeros(1, arch.head_dim, device=device, dtype=dtype))
        qk_rows = _rotary_layout(arch, device)
        scale = arch.attention_scale or arch.head_dim ** -0.5
        self.layers = [
            DecoderLayer(w, f"model.layers.{i}.", arch,
                         LayerAttention(scale, arch.sliding_window if arch.is_sliding(i) else None,
                                        arch.attn_softcap),
                         tables.get(_rope_key(arch, i)), qk_rows, norm, prepack, block_quant,
                         matmul, arch.has_experts(i))
            for i in range(arch.num_layers)]
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self._act_mul = self._silu_mul if arch.activation == "silu" else self._gelu_tanh_mul

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self._embed_blocks is None:
            return F.embedding(input_ids, self._embed_table)
        return self._embed_blocks.rows(input_ids).to(self.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:
        """[num_tokens] ids -> [num_tokens, hidden] final hidden states (normed)."""
        # On the native path the kernel reads the tables by position itself.
        ropes = None if meta.paged_decodes is not None else [
            (cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
            for cos, sin in self.rope_tables]
        hidden, delta = self.embed(input_ids), None
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            hidden, x = self._add_norm(hidden, delta, layer.input_norm)
            out = layer.o(self._attention(layer, layer.qkv(x), positions, ropes, k_cache,
                                          v_cache, meta))
            if layer.post_attn_norm is not None:
                out = self._norm(out, layer.post_attn_norm)
            hidden, x = self._add_norm(hidden, out, layer.pre_mlp_norm)
            if layer.moe is None:
                delta = layer.down(self._act_mul(layer.gate_up(x)))
            else:
                delta = layer.moe(x)
            if layer.post_mlp_norm is not None:
                delta = self._norm(delta, layer.post_mlp_norm)
        return self._add_norm(hidden, delta, self.final_norm)[1]

    def _attention(self, layer: DecoderLayer, qkv: torch.Tensor, positions: torch.Tensor,
                   ropes: list[tuple[torch.Tensor, torch.Tensor]] | None, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """[tokens, q + k + v heads] projections -> [tokens, heads * head_dim] attention
        output, with this step's K/V written to the caches. ropes: this step's (cos, sin) of
        each table, for the torch path; None for the native one, one call from qkv to the
        decode rows' output (model/attention.py: rope_write_attend)."""
        arch = self.arch
        heads = arch.num_heads + arch.num_kv_heads
        if layer.q_norm is not None:  # in place, before RoPE, on either path
            q = qkv[:, :self.q_size]
            k = qkv[:, self.q_size:self.q_size + self.kv_size]
            if arch.qk_norm == "head":
                q = q.unflatten(-1, (arch.num_heads, arch.head_dim))
                k = k.unflatten(-1, (arch.num_kv_heads, arch.head_dim))
            q.copy_(self._norm(q, layer.q_norm))
            k.copy_(self._norm(k, layer.k_norm))
        if ropes is None:
            if layer.rope is None:
                (cos, sin), positions = self._no_rope, torch.zeros_like(positions)
            else:
                cos, sin = self.rope_tables[layer.rope]
            return rope_write_attend(qkv, arch.num_heads, cos, sin, positions, k_cache, v_cache,
                                     meta, layer=layer.attention)
        qk = qkv[:, :self.q_size + self.kv_size].view(-1, heads, arch.head_dim)
        if layer.rope is not None:
            qk = _rope(qk, *ropes[layer.rope])
        q, k = qk[:, :arch.num_heads], qk[:, arch.num_heads:]  # rotated together: 3 ops
        v = qkv[:, self.q_size + self.kv_size:].reshape(-1, arch.num_kv_heads, arch.head_dim)
        write_kv(k_cache, v_cache, k, v, meta.for_layer(layer.attention).slots)
        return paged_attention(q, k, v, k_cache, v_cache, meta, layer=layer.attention)

    def _add_norm(self, hidden: torch.Tensor, delta: torch.Tensor | None,
                  weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden + delta, RMSNorm of that); the fused kernel adds into hidden in place."""
        eps = self.arch.rms_norm_eps
        if self.fused_ops is not None:
            return hidden, self.fused_ops.add_rms_norm(hidden, delta, weight, eps)
        if delta is not None:
            hidden = hidden + delta
        return hidden, F.rms_norm(hidden, (self.arch.hidden_size,), weight, eps)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm over the last dim (Gemma's extra norms, the q/k norms)."""
        return F.rms_norm(x, (x.shape[-1],), weight, self.arch.rms_norm_eps)

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.fused_ops is not None:
            return self.fused_ops.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def _gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.arch.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (transformers' layout) on [tokens, heads, head_dim]: with x = (x1, x2),
    (x1 c - x2 s, x2 c + x1 s) = x * (c, c) + (x2, x1) * (-s, s)."""
    tokens, heads, dim = x.shape
    swapped = x.view(tokens, heads, 2, dim // 2).flip(2).view(tokens, heads, dim)
    return torch.addcmul(x * cos, swapped, sin)


def _rope_key(arch: ModelArch, layer: int) -> tuple[float, bool] | None:
    """Which RoPE table a layer uses: (theta, local), local being Gemma 3's unscaled base of
    the sliding layers; None for a layer without RoPE."""
    if layer in arch.nope_layers:
        return None
    if arch.rope_local_theta is not None and arch.is_sliding(layer):
        return arch.rope_local_theta, True
    return arch.rope_theta, False


def _rope_table(arch: ModelArch, theta: float, local: bool, context: int,
                device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [positions, head_dim] for _rope and the native kernel. A partial rotary's
    frequencies are padded with zeros to half a head (cos 1, sin 0: those dims pass through,
    `_rotary_layout` puts them there); LongRoPE's attention factor scales the rotated dims."""
    if local:
        inv_freq, factor = _base_inv_freq(theta, arch.head_dim).float(), 1.0
    else:
        inv_freq, factor = rope_inv_freq(arch, context), rope_attention_factor(arch)
    inv_freq = F.pad(inv_freq.to(device), (0, arch.head_dim // 2 - inv_freq.numel()))
    positions = torch.arange(arch.max_position_embeddings, device=device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    rotated = inv_freq != 0
    cos = torch.where(rotated, freqs.cos() * factor, 1.0)
    sin = torch.where(rotated, freqs.sin() * factor, 0.0)
    return torch.cat([cos, cos], dim=-1).to(dtype), torch.cat([-sin, sin], dim=-1).to(dtype)


def _rotary_layout(arch: ModelArch, device: torch.device) -> torch.Tensor | None:
    """For a partial rotary (rotary_dim r < head_dim D), the order of the fused QKV rows that
    moves each q and k head's rotated pairs (i, i + r/2) to (i, i + D/2) and its passed-through
    dims into the rest: q.k is the same sum in another order, and RoPE is then the whole-head
    rotate-half of _rope and the native kernel, with cos 1 and sin 0 on the passed dims."""
    r, d = arch.rotary_dim, arch.head_dim
    if r is None:
        return None
    half, passed = r // 2, d // 2 - r // 2
    head = [*range(half), *range(r, r + passed), *range(half, r), *range(r + passed, d)]
    qk_heads = arch.num_heads + arch.num_kv_heads
    rows = [h * d + i for h in range(qk_heads) for i in head]
    rows += range(qk_heads * d, (qk_heads + arch.num_kv_heads) * d)  # v as it is
    return torch.tensor(rows, device=device)


def _required_names(arch: ModelArch, weights: Mapping[str, torch.Tensor]) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not arch.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        names += _qkv_names(weights, p) + [p + "self_attn.o_proj.weight"]
        if not arch.has_experts(i):  # moe_from_hf names an expert's missing tensors
            names += _gate_up_names(weights, p) + [p + "mlp.down_proj.weight"]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if arch.sandwich_norms:
            names += [p + "pre_feedforward_layernorm.weight",
                      p + "post_feedforward_layernorm.weight"]
        if arch.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    return names


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def rope_inv_freq(arch: ModelArch, context: int | None = None) -> torch.Tensor:
    """RoPE inverse frequencies of the rotary dims, with the model's scaling (linear, Llama-3
    style, LongRoPE: its long factors where the context served, by default the model's,
    exceeds its original one, as llama.cpp picks them by its context size)."""
    inv_freq = _base_inv_freq(arch.rope_theta, arch.rotary_dim or arch.head_dim)
    scaling = arch.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq.float()
    if kind == "freq_factors":  # llama.cpp's rope_freqs tensor: divisors per frequency
        return (inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float64)).float()
    if kind == "longrope":
        long = (context or arch.max_position_embeddings) > \
            scaling["original_max_position_embeddings"]
        factors = scaling["long_factor" if long else "short_factor"]
        return (inv_freq / torch.tensor(factors, dtype=torch.float64)).float()
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


def rope_attention_factor(arch: ModelArch) -> float:
    """What RoPE's cos and sin are multiplied by (LongRoPE's attention factor; else 1)."""
    scaling = arch.rope_scaling or {}
    return float(scaling.get("attention_factor", 1.0)) if \
        scaling.get("rope_type") == "longrope" else 1.0
