"""Paged attention: K/V live in fixed-size blocks addressed through per-request block tables.

Requests with a single query token (decodes) go, on CPU, to the native kernel in
`csrc/paged_attention.cpp` (all of them in one call per layer, reading K/V straight from the
blocks). The model calls it through `rope_write_attend`, one call per layer that also applies
RoPE and writes the step's K/V: about a dozen torch ops fewer per layer, which at one user is
a large share of what is not matmul. The torch fallback batches them into SDPA calls over
their gathered, padded contexts — one call per group of similar context lengths, so a short
chat never pads out to a long document's length. Prefill chunks run one SDPA call each, causal
within the chunk and over the cached context before it.

The cache may hold a narrower type than the model computes in (an fp16 cache under fp32
activations). Every query then sees K/V as the cache holds them, this step's own included, so
a prompt gives the same result whether it is prefilled in one chunk or several, from a cached
prefix or not — unless long chunks attend in bf16 (`AttentionMetadata.prefill_bf16`, auto on
CPUs with AMX), where one long chunk and several short ones round apart.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from loom.model.kernels import paged_attention_ops


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention does beyond causal softmax(q.k * head_dim ** -0.5) v: the
    model builds one per layer from its ModelArch, attention reads it."""

    scale: float  # score multiplier: head_dim ** -0.5, or query_pre_attn_scalar ** -0.5 (Gemma)
    sliding_window: int | None = None  # attends to its last W positions, its own included
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) (Gemma 2)

    def first_position(self, position: int) -> int:
        """The first position a query at `position` attends to: position - W + 1 in a
        window of W (never below 0), else 0."""
        if self.sliding_window is None:
            return 0
        return max(0, position - self.sliding_window + 1)


@dataclass
class PrefillSpan:
    query_start: int  # offset of this request's first query token in the flat batch
    query_len: int
    context_len: int  # tokens of KV after this chunk is written (cached prefix + chunk)
    block_ids: torch.Tensor  # blocks covering context_len


@dataclass
class DecodeGroup:
    """Consecutive single-token queries whose contexts are gathered and padded together."""

    query_start: int
    num_queries: int
    block_tables: torch.Tensor  # [num_queries, max_blocks], padded with block 0
    mask: torch.Tensor  # [num_queries, 1, 1, max_blocks * block_size], True = attend
    # mask cut to each query's last W positions, by W: made once a step, for all its layers
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def window_mask(self, window: int | None) -> torch.Tensor:
        """The mask of a layer with this window (None: the whole context): a query at
        position p (its context p + 1 long) sees p - W + 1 .. p."""
        if window is None:
            return self.mask
        if window not in self._window_masks:
            lens = self.mask.sum(dim=-1, keepdim=True)
            keys = torch.arange(self.mask.shape[-1], device=self.mask.device)
            self._window_masks[window] = self.mask & (keys >= lens - window)
        return self._window_masks[window]


@dataclass
class PagedDecodes:
    """All single-token queries (the first rows of the batch), for the native kernel."""

    num_queries: int
    block_tables: torch.Tensor  # [num_queries, max_blocks], padded with block 0
    context_lens: torch.Tensor  # [num_queries]


@dataclass
class AttentionMetadata:
    """Where each token's K/V goes and what each query attends to, for one step. Decodes come
    either as `paged_decodes` (native kernel) or as `decodes` groups (torch path)."""

    # Each token's K/V slot: (block ids, offsets in the block), both [num_tokens].
    slots: tuple[torch.Tensor, torch.Tensor]
    decodes: list[DecodeGroup]
    prefills: list[PrefillSpan]
    paged_decodes: PagedDecodes | None = None
    # Prefill chunks of at least BF16_PREFILL_MIN_POSITIONS attend in bf16 (backends.py says
    # when: float32 models whose batched matmuls run in bf16 on a CPU with AMX).
    prefill_bf16: bool = False
    # Where sliding-window layers keep a KV group of their own (the runner's kv_groups): the
    # same step through that group's blocks (its slots and block tables; blocks that slid out
    # of the window are the group's null block, never read). for_layer picks.
    sliding: AttentionMetadata | None = None

    def for_layer(self, layer: LayerAttention | None) -> AttentionMetadata:
        """The metadata of the KV group the layer's caches belong to."""
        if self.sliding is not None and layer is not None and layer.sliding_window is not None:
            return self.sliding
        return self


# Query x context positions from which a prefill chunk's SDPA runs in bf16 when the metadata
# asks for it: torch's bf16 kernel (AMX tiles where the CPU has them) overtakes its fp32 one
# between causal chunks of 256 and 384 tokens and gains with length
# (benchmarks/kernels/prefill_attention.py).
BF16_PREFILL_MIN_POSITIONS = 1 << 17


_HUGE_PAGE = 2 << 20


def new_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V caches, both indexed [block, position in block, kv head, dim].

    Both are stored kv head before position and handed out as permuted views, so every torch
    op still sees the common indexing. K is stored [block, kv head, dim, position]: the native
    kernel then scores a whole block with vector FMAs across its positions (no horizontal
    sums). V is stored [block, kv head, position, dim]: one kv head's block is one contiguous
    run, which the kernel's p.V pass streams faster than rows strided by the other heads
    (docs/benchmark-log.md, "V stored head-major")."""
    k = zeros((num_blocks, num_kv_heads, head_dim, block_size), dtype, device)
    v = zeros((num_blocks, num_kv_heads, block_size, head_dim), dtype, device)
    return k.permute(0, 3, 1, 2), v.permute(0, 2, 1, 3)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose CPU pages are zeroed by the OS on first touch rather than written
    now: a cache of gigabytes then costs nothing at start-up, and memory is taken as blocks are
    used. (Masked attention reads unused slots, so they must hold zeros, not whatever the
    allocator last kept there.) The mapping asks for transparent huge pages: touched 4 KB at a
    time, a prefill's first pass through fresh blocks spent more in page faults than in
    RoPE and the KV writes (benchmarks/kernels/prefill_attention.py)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    mapping = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux; a no-op where THP is off
        mapping.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(mapping, dtype=np.uint8)  # keeps the mapping alive
    start = -raw.ctypes.data % _HUGE_PAGE  # whole huge pages from the first block on
    return torch.from_numpy(raw[start:start + nbytes]).view(dtype).view(shape)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Store this step's keys/values ([tokens, kv_heads, head_dim]) into their slots."""
    # through the view, into the [block, head, dim, pos] storage
    k_cache.index_put_(slots, k.to(k_cache.dtype))
    v_cache.index_put_(slots, v.to(v_cache.dtype))


def _as_cached(x: torch.Tensor, cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K or V as the cache holds it, in the compute dtype: x rounded through the cache's type
    when that is narrower; x itself when they are the same."""
    return x.to(cache.dtype).to(dtype)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata,
                    layer: LayerAttention | None = None) -> torch.Tensor:
    """q: [tokens, heads, head_dim]; k, v: this step's [tokens, kv_heads, head_dim], already
    written to the caches ([blocks, block_size, kv_heads, head_dim]). Returns [tokens, heads *
    head_dim]. layer: the layer's variant (None: plain causal attention)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    layer = layer or LayerAttention(head_dim ** -0.5)
    out = torch.empty_like(q)
    group = num_heads // num_kv_heads
    meta = meta.for_layer(layer)
    if meta.paged_decodes is not None and meta.paged_decodes.num_queries:
        n = meta.paged_decodes.num_queries
        out[:n] = paged_attention_ops().paged_decode_attention(
            q[:n], k_cache, v_cache, meta.paged_decodes.block_tables,
            meta.paged_decodes.context_lens, *_kernel_variant(layer, head_dim))
    for dec in meta.decodes:
        rows = slice(dec.query_start, dec.query_start + dec.num_queries)
        n = dec.num_queries
        # [n, blocks, block_size, kv_heads, D] -> contiguous [n, kv_heads, ctx, D]
        k_ctx = k_cache[dec.block_tables].permute(0, 3, 1, 2, 4).reshape(
            n, num_kv_heads, -1, head_dim).to(q.dtype)
        v_ctx = v_cache[dec.block_tables].permute(0, 3, 1, 2, 4).reshape(
            n, num_kv_heads, -1, head_dim).to(q.dtype)
        # a query's group of heads is its "sequence": [n, kv_heads, group, D]
        q_dec = q[rows].view(n, num_kv_heads, group, head_dim)
        out[rows] = _attend(q_dec, k_ctx, v_ctx, dec.window_mask(layer.sliding_window),
                            layer).reshape(n, num_heads, head_dim)
    _attend_prefills(q, k, v, k_cache, v_cache, meta, out, layer=layer)
    return out.view(num_tokens, num_heads * head_dim)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            layer: LayerAttention, causal: bool = False, gqa: bool = False) -> torch.Tensor:
    """softmax(q.k * scale, masked) v over [batch, heads, queries | keys, head_dim]; mask
    (True = attend) broadcasts to [batch, heads, queries, keys]; gqa: k and v have fewer heads
    than q, each shared by consecutive query heads. SDPA where there is no softcap; else the
    scores are capped (c * tanh(s / c)) in an explicit masked softmax, as transformers' eager
    attention does (SDPA has no softcap)."""
    if layer.softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              scale=layer.scale, enable_gqa=gqa)
    if gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * layer.scale
    scores = torch.tanh(scores / layer.softcap) * layer.softcap
    if causal:
        queries, keys = scores.shape[-2:]
        mask = torch.ones(queries, keys, dtype=torch.bool, device=q.device).tril(keys - queries)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1, dtype=torch.float32).to(q.dtype), v)


def rope_write_attend(qkv: torch.Tensor, num_heads: int, rope_cos: torch.Tensor,
                      rope_sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, meta: AttentionMetadata,
                      layer: LayerAttention | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The native path (meta.paged_decodes set) from the fused QKV projection ([tokens,
    (heads + 2 kv_heads) * head_dim]) to the attention output ([tokens, heads * head_dim]):
    RoPE (rope_cos/rope_sin: the model's tables, indexed by position), the KV writes and the
    decode rows' attention are one native call, which ropes q and k inside qkv, in place, so
    that prefill rows then run SDPA on them as on the torch path. layer: the layer's variant
    (window, softcap; None: plain causal attention), and its KV group's metadata; sinks: fp32
    [heads] logits that join each decode row's softmax denominator (gpt-oss)."""
    meta = meta.for_layer(layer)
    decodes = meta.paged_decodes
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    out = paged_attention_ops().rope_write_decode(
        qkv, num_heads, rope_cos, rope_sin, positions, k_cache, v_cache, *meta.slots,
        decodes.block_tables, decodes.context_lens, *_kernel_variant(layer, head_dim), sinks)
    if meta.prefills:
        q, k, v = qkv.view(-1, num_heads + 2 * num_kv_heads, head_dim).split(
            [num_heads, num_kv_heads, num_kv_heads], dim=1)
        _attend_prefills(q, k, v, k_cache, v_cache, meta, out.view(-1, num_heads, head_dim),
                         layer)
    return out


def _kernel_variant(layer: LayerAttention | None, head_dim: int) -> tuple[float, int, float]:
    """(scale, window, softcap) as the native kernel takes them: 0 for none."""
    if layer is None:
        return head_dim ** -0.5, 0, 0.0
    return layer.scale, layer.sliding_window or 0, layer.softcap or 0.0


def _attend_prefills(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor,
                     layer: LayerAttention | None = None) -> None:
    """One attention call per prefill chunk, into its rows of out ([tokens, heads, head_dim]),
    in q's dtype or, for long chunks when meta.prefill_bf16, in bf16 (K/V rounded through the
    cache's type first, as everywhere). layer: the layer's variant (None: plain). A sliding
    window gathers only the blocks from the one the chunk's first query reaches back to (those
    before may be the null block) and masks each query to its own window."""
    layer = layer or LayerAttention(q.shape[-1] ** -0.5)
    window = layer.sliding_window
    block_size = k_cache.shape[1]
    for span in meta.prefills:
        rows = slice(span.query_start, span.query_start + span.query_len)
        dtype = (torch.bfloat16 if meta.prefill_bf16 and span.query_len * span.context_len
                 >= BF16_PREFILL_MIN_POSITIONS else q.dtype)
        q_span = q[rows].transpose(0, 1).unsqueeze(0).to(dtype)  # [1, heads, q, head_dim]
        start = span.context_len - span.query_len  # the chunk's first position
        if start == 0:  # nothing cached before: use this step's K/V
            k_ctx, v_ctx = _as_cached(k[rows], k_cache, dtype), _as_cached(v[rows], v_cache,
                                                                         dtype)
            first = 0
        else:
            skipped = layer.first_position(start) // block_size
            first = skipped * block_size
            k_ctx = k_cache[span.block_ids[skipped:]].flatten(0, 1)[:span.context_len - first]
            v_ctx = v_cache[span.block_ids[skipped:]].flatten(0, 1)[:span.context_len - first]
            k_ctx, v_ctx = k_ctx.to(dtype), v_ctx.to(dtype)
        causal = start == 0 and window is None
        mask = None if causal else _chunk_mask(span.query_len, span.context_len, first,
                                               window, q.device)
        out[rows] = _attend(q_span, k_ctx.transpose(0, 1).unsqueeze(0),
                            v_ctx.transpose(0, 1).unsqueeze(0), mask, layer, causal=causal,
                            gqa=True)[0].transpose(0, 1)


def _chunk_mask(query_len: int, context_len: int, first_key: int, window: int | None,
                device: torch.device) -> torch.Tensor:
    """[query_len, context_len - first_key]: query i, at position p = context_len - query_len
    + i, sees the keys at positions first_key.. up to p, and with a window W only those after
    p - W (its last W positions, its own included, as transformers' sliding mask)."""
    positions = torch.arange(context_len - query_len, context_len, device=device).unsqueeze(1)
    keys = torch.arange(first_key, context_len, device=device).unsqueeze(0)
    mask = keys <= positions
    if window is not None:
        mask &= keys > positions - window
    return mask
