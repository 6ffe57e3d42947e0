"""The native paged decode-attention kernel, and the fused RoPE + KV write + decode attention
op built on it, against the torch path (RoPE, index_put, gather + SDPA), on random caches with
scattered block tables, ragged context lengths and grouped-query heads; prefill chunks in bf16
from BF16_PREFILL_MIN_POSITIONS; the KV cache's lazily zeroed, huge-page memory. A layer's
variants (sliding window, softcap, attention sinks) against a plain dense reference, at the
window's edges, in tiles, in spans, and through the runner's sliding KV group."""

from __future__ import annotations

import random
from collections.abc import Callable
from types import ModuleType, SimpleNamespace

import pytest
import torch

from loom.core.batch import ScheduledRequest, SlidingKVGroup
from loom.model.attention import (
    BF16_PREFILL_MIN_POSITIONS,
    AttentionMetadata,
    LayerAttention,
    PrefillSpan,
    new_kv_cache,
    paged_attention,
    rope_write_attend,
    write_kv,
    zeros,
)
from loom.model.backends import PER_TOKEN_PREFILL_MAX_POSITIONS_BF16
from loom.model.decoder import _rope
from loom.model.kernels import paged_attention_ops
from loom.model.runner import ModelRunner
from loom.sampling import SamplingParams

pytestmark = pytest.mark.unit


def decode_metadata(tables: list[list[int]], lens: list[int], block_size: int,
                    native: bool) -> AttentionMetadata:
    runner = ModelRunner.__new__(ModelRunner)  # only the metadata builders are needed
    runner.block_size, runner.device, runner.sliding_kv = block_size, torch.device("cpu"), None
    slots = (torch.zeros(0, dtype=torch.long),) * 2  # decodes only: nothing is written
    if native:
        return AttentionMetadata(slots, [], [], runner._paged_decodes(tables, lens))
    return AttentionMetadata(slots, runner._decode_groups(tables, lens), [])


# (activations, KV cache, tolerance): fp32 over its own cache or an fp16 one, bf16 over bf16
DTYPES = [(torch.float32, torch.float32, 1e-5), (torch.float32, torch.float16, 1e-5),
          (torch.bfloat16, torch.bfloat16, 2e-2)]


@pytest.mark.parametrize("dtype,cache_dtype,tolerance", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim",
                         [(9, 3, 64), (4, 4, 128), (8, 1, 64), (8, 4, 256)])  # Gemma 3 4B
def test_native_decode_attention_matches_torch(dtype, cache_dtype, tolerance, num_heads,
                                               num_kv_heads, head_dim) -> None:
    ops = paged_attention_ops()
    assert ops is not None, "the kernel must build on the test machine"
    assert_kernel_matches_torch(decode_both_ways, ops, dtype, cache_dtype, tolerance,
                                (num_heads, num_kv_heads, head_dim))


@pytest.mark.parametrize("dtype,cache_dtype,tolerance", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (6, 3, 64), (4, 4, 128),
                                                              (4, 1, 256)])
def test_rows_over_one_block_table_attend_in_tiles_each_over_its_own_context(
        dtype, cache_dtype, tolerance, num_heads, num_kv_heads, head_dim) -> None:
    """A chunk's tokens as consecutive rows, each over the request's blocks up to its own
    position, are attended a tile of tokens at a time (each block read once for the tile).
    Beside them: a request with the next context length over other blocks, which must not join
    the chunk's tile, and one whose first blocks are the chunk's, which may: every row must
    still see exactly its own context."""
    assert_kernel_matches_torch(tiles_both_ways, paged_attention_ops(), dtype, cache_dtype,
                                tolerance, (num_heads, num_kv_heads, head_dim))


def test_decode_rows_do_not_depend_on_how_threads_split_the_batch() -> None:
    """With tiles enough for every thread, a thread takes a whole tile and all its kv heads;
    with few (one request alone), (tile, kv head) pairs. Each row must come out bit for bit the
    same either way: 64 requests in one call against each request in a call of its own."""
    rng = random.Random(1)
    torch.manual_seed(1)
    num_heads, num_kv_heads, head_dim, block_size = 9, 3, 64, 16
    k_cache, v_cache = new_kv_cache(900, block_size, num_kv_heads, head_dim, torch.float16,
                                    torch.device("cpu"))
    k_cache.copy_(torch.randn(k_cache.shape))
    v_cache.copy_(torch.randn(v_cache.shape))
    lens = sorted(rng.randint(1, 200) for _ in range(64))
    free = rng.sample(range(900), 900)
    tables = []
    for length in lens:
        tables.append(free[:-(-length // block_size)])
        free = free[len(tables[-1]):]
    q = torch.randn(len(lens), num_heads, head_dim)
    ops = paged_attention_ops()

    def attend(rows: list[int]) -> torch.Tensor:
        decodes = decode_metadata([tables[i] for i in rows], [lens[i] for i in rows],
                                  block_size, True).paged_decodes
        return ops.paged_decode_attention(q[rows], k_cache, v_cache, decodes.block_tables,
                                          decodes.context_lens, head_dim ** -0.5)

    together = attend(list(range(len(lens))))
    alone = torch.cat([attend([i]) for i in range(len(lens))])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("dtype,cache_dtype,tolerance", DTYPES)
def test_few_long_contexts_attend_in_spans_merged_by_their_log_sum_exp(
        dtype, cache_dtype, tolerance) -> None:
    """Too few requests for every thread: each long context is cut into spans of blocks,
    attended apart and merged by their log-sum-exp. On two threads (or more) that must match
    the torch path; on one nothing is cut, so the two results differing shows the spans ran."""
    rng = random.Random(2)
    torch.manual_seed(2)
    num_heads, num_kv_heads, head_dim, block_size = 9, 3, 64, 16
    k_cache, v_cache = new_kv_cache(400, block_size, num_kv_heads, head_dim, cache_dtype,
                                    torch.device("cpu"))
    k_cache.copy_(torch.randn(k_cache.shape))
    v_cache.copy_(torch.randn(v_cache.shape))
    lens = [700, 1500, 2900]  # the last ends 4 positions into its block
    free = rng.sample(range(400), 400)
    tables = []
    for length in lens:
        tables.append(free[:-(-length // block_size)])
        free = free[len(tables[-1]):]
    q = torch.randn(len(lens), num_heads, head_dim).to(dtype)
    unused = torch.zeros(len(lens), num_kv_heads, head_dim, dtype=dtype)
    expected = paged_attention(q, unused, unused, k_cache, v_cache,
                               decode_metadata(tables, lens, block_size, False))
    decodes = decode_metadata(tables, lens, block_size, True).paged_decodes
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            results.append(paged_attention_ops().paged_decode_attention(
                q, k_cache, v_cache, decodes.block_tables, decodes.context_lens,
                head_dim ** -0.5))
    finally:
        torch.set_num_threads(threads)
    whole, spans = (r.view_as(expected) for r in results)
    torch.testing.assert_close(spans.float(), expected.float(), atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(whole.float(), expected.float(), atol=tolerance, rtol=tolerance)
    assert not torch.equal(whole, spans)


def assert_kernel_matches_torch(both_ways: Callable[..., tuple[torch.Tensor, torch.Tensor]],
                                ops: ModuleType, dtype: torch.dtype, cache_dtype: torch.dtype,
                                tolerance: float, shape: tuple[int, int, int]) -> None:
    """`both_ways` (decode_both_ways, tiles_both_ways) on `ops`' kernel: its rows match the
    torch path's; shape is (query heads, kv heads, head dim)."""
    expected, actual = both_ways(ops, dtype, cache_dtype, *shape)
    torch.testing.assert_close(actual.float(), expected.float(), atol=tolerance, rtol=tolerance)


def tiles_both_ways(ops: ModuleType, dtype: torch.dtype, cache_dtype: torch.dtype,
                    num_heads: int, num_kv_heads: int,
                    head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(torch path, ops' kernel) attention of the rows the tile test above describes."""
    torch.manual_seed(0)
    k_cache, v_cache = new_kv_cache(64, 16, num_kv_heads, head_dim, cache_dtype,
                                    torch.device("cpu"))
    k_cache.copy_(torch.randn(k_cache.shape))
    v_cache.copy_(torch.randn(v_cache.shape))
    chunk, other, extends_chunk = [5, 17, 3], [8, 9, 10], [5, 17, 3, 40]
    rows = ([(chunk, length) for length in range(30, 44)] + [(other, 44)]
            + [(extends_chunk, length) for length in (45, 46, 50)] + [(chunk, 3)])
    tables = [blocks[:-(-length // 16)] for blocks, length in rows]
    lens = [length for _, length in rows]
    q = torch.randn(len(rows), num_heads, head_dim).to(dtype)
    unused = torch.zeros(len(rows), num_kv_heads, head_dim, dtype=dtype)
    expected = paged_attention(q, unused, unused, k_cache, v_cache,
                               decode_metadata(tables, lens, 16, False))
    decodes = decode_metadata(tables, lens, 16, True).paged_decodes
    actual = ops.paged_decode_attention(q, k_cache, v_cache, decodes.block_tables,
                                        decodes.context_lens, head_dim ** -0.5)
    return expected, actual.view_as(expected)


def decode_both_ways(ops: ModuleType, dtype: torch.dtype, cache_dtype: torch.dtype,
                     num_heads: int, num_kv_heads: int,
                     head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(torch path, ops' kernel) decode attention of 12 requests of 1-600 positions over
    scattered blocks."""
    assert ops.supported(num_heads, num_kv_heads, head_dim, 16, dtype, cache_dtype)
    rng = random.Random(0)
    torch.manual_seed(0)
    block_size, num_blocks = 16, 400
    k_cache, v_cache = new_kv_cache(num_blocks + 1, block_size, num_kv_heads, head_dim,
                                    cache_dtype, torch.device("cpu"))
    k_cache.copy_(torch.randn(k_cache.shape))
    v_cache.copy_(torch.randn(v_cache.shape))
    lens = sorted(rng.randint(1, 600) for _ in range(12))
    free = rng.sample(range(num_blocks), num_blocks)
    tables = []
    for length in lens:
        count = -(-length // block_size)
        tables.append(free[:count])
        free = free[count:]
    q = torch.randn(len(lens), num_heads, head_dim).to(dtype)
    k_new = torch.zeros(len(lens), num_kv_heads, head_dim, dtype=dtype)  # unused by decodes
    expected = paged_attention(q, k_new, k_new, k_cache, v_cache,
                               decode_metadata(tables, lens, block_size, False))
    decodes = decode_metadata(tables, lens, block_size, True).paged_decodes
    actual = ops.paged_decode_attention(q, k_cache, v_cache, decodes.block_tables,
                                        decodes.context_lens, head_dim ** -0.5)
    return expected, actual.view_as(expected)


def test_shapes_outside_the_kernel_are_reported_unsupported() -> None:
    ops = paged_attention_ops()
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    assert not ops.supported(4, 4, 32, 16, f32, f32)  # head_dim
    assert not ops.supported(6, 2, 256, 16, f32, f32)  # head_dim 256 is built for G 1, 2, 4, 8
    assert not ops.supported(9, 3, 64, 8, f32, f32)  # block size
    assert not ops.supported(9, 3, 64, 16, f16, f16)  # fp16 activations
    assert not ops.supported(9, 3, 64, 16, bf16, f16)  # bf16 activations over an fp16 cache
    assert not ops.supported(9, 3, 64, 16, f32, bf16)
    assert not ops.supported(36, 3, 64, 16, f32, f32)  # 12 heads per kv head


def test_each_environment_and_checkout_builds_in_its_own_folder(tmp_path, monkeypatch):
    """Two virtualenvs, or two checkouts run from one (an A/B from a git worktree), must not
    share a build folder: each would rebuild the other's kernel on every start."""
    from loom.model import kernels

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    here = kernels._build_directory("k")
    assert here == kernels._build_directory("k") and here.is_dir()
    assert here.parent.parent == tmp_path
    monkeypatch.setattr(kernels, "_CSRC", tmp_path / "other-checkout" / "csrc")
    other_checkout = kernels._build_directory("k")
    monkeypatch.setattr(kernels.sys, "prefix", str(tmp_path / "other-venv"))
    other_venv = kernels._build_directory("k")
    assert len({here, other_checkout, other_venv}) == 3


def _scheduled(request_id: str, tokens: int, start: int, blocks: list[int],
               drafts: int = 0) -> ScheduledRequest:
    return ScheduledRequest(request_id, [1] * tokens, start, blocks, SamplingParams(), True, [],
                            num_draft_tokens=drafts)


def _step_metadata(items: list[ScheduledRequest], block_size: int, scratch_block: int,
                   native: bool, sliding: SlidingKVGroup | None = None
                   ) -> tuple[list[tuple[str, int] | None], torch.Tensor, AttentionMetadata]:
    """(each row's (request id, position), None for padding rows; positions; metadata) from
    the runner's own input preparation, which orders the rows its own way per path."""
    runner = ModelRunner.__new__(ModelRunner)
    runner.block_size, runner.device, runner.scratch_block = block_size, torch.device("cpu"), \
        scratch_block
    runner.sliding_kv = sliding
    # the smaller per-token bound, so that MIXED_STEP's long chunks stay SDPA spans
    runner.backends = SimpleNamespace(
        native_decode=native, bf16_prefill_attention=False,
        per_token_prefill_max_positions=PER_TOKEN_PREFILL_MAX_POSITIONS_BF16)
    items, _, positions, meta = runner._prepare(items)
    keys = [None if item.padding else (item.request_id, item.start_position + i)
            for item in items for i in range(len(item.token_ids))]
    return keys, positions, meta


def _rope_tables(head_dim: int, max_positions: int, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Laid out as DecoderModel's: cos over both halves, sin negated on the first half."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_positions).float(), inv_freq)
    return (torch.cat([freqs.cos(), freqs.cos()], -1).to(dtype),
            torch.cat([-freqs.sin(), freqs.sin()], -1).to(dtype))


def _torch_path(qkv: torch.Tensor, positions: torch.Tensor, tables: tuple[torch.Tensor, ...],
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                num_heads: int) -> torch.Tensor:
    """DecoderModel's torch path from qkv to the attention output."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    q, k, v = qkv.view(-1, num_heads + 2 * num_kv_heads, head_dim).split(
        [num_heads, num_kv_heads, num_kv_heads], dim=1)
    cos, sin = (t[positions].unsqueeze(1) for t in tables)
    qk = _rope(torch.cat([q, k], dim=1), cos, sin)
    q, k = qk[:, :num_heads], qk[:, num_heads:]
    write_kv(k_cache, v_cache, k, v, meta.slots)
    return paged_attention(q, k, v, k_cache, v_cache, meta)


# Decodes at positions on both sides of block boundaries (0, 15, 16, 31, 32, ...), one with two
# draft tokens crossing a boundary, short prefills (per-token queries on the native path) with
# nothing cached and after a cached prefix that starts mid-block, longer ones (SDPA on both
# paths) likewise (and, but for prefill-only steps, a padding row).
MIXED_STEP = [("d0", 1, 0, 0), ("d1", 1, 15, 0), ("d2", 1, 16, 0), ("d3", 1, 31, 0),
              ("d4", 1, 32, 0), ("d5", 1, 300, 0), ("draft", 3, 46, 2), ("p0", 20, 0, 0),
              ("p1", 25, 40, 0), ("p2", 260, 0, 0), ("p3", 100, 600, 0)]


def _step_items(chosen: list[tuple[str, int, int, int]], free: list[int], block_size: int
                ) -> tuple[list[ScheduledRequest], list[int]]:
    """(request id, tokens, start, drafts) rows as scheduled requests, each given the blocks its
    context needs from `free` in order; also the blocks left over."""
    items = []
    for request_id, tokens, start, drafts in chosen:
        count = -(-(start + tokens) // block_size)
        items.append(_scheduled(request_id, tokens, start, free[:count], drafts))
        free = free[count:]
    return items, free


@pytest.mark.parametrize("native", [False, True])
def test_short_prefill_chunks_attend_per_token_on_the_native_path(native: bool) -> None:
    """Below the per-token bound of query x context positions a chunk's tokens become
    decode rows (each over its blocks up to its own position), after the decodes; longer
    chunks keep their SDPA span, as every chunk does on the torch path."""
    items, _ = _step_items(MIXED_STEP, list(range(100)), 16)
    keys, _, meta = _step_metadata(items, 16, 100, native)
    spans = {keys[span.query_start][0]: span for span in meta.prefills}
    short = [("p0", 20, 0), ("p1", 25, 40)]  # 400 and 1,625 positions; p2, p3 above the bound
    assert all(t * (s + t) < PER_TOKEN_PREFILL_MAX_POSITIONS_BF16 for _, t, s in short)
    if not native:
        assert set(spans) == {"p0", "p1", "p2", "p3"}
        return
    assert set(spans) == {"p2", "p3"}
    assert (spans["p3"].query_len, spans["p3"].context_len) == (100, 700)
    rows = meta.paged_decodes.num_queries
    assert rows == 6 + 3 + 20 + 25  # decodes, the draft's three queries, the short chunks
    assert {k[0] for k in keys[:rows]} == {"d0", "d1", "d2", "d3", "d4", "d5", "draft", "p0",
                                           "p1"}
    lens = meta.paged_decodes.context_lens.tolist()
    for request_id, tokens, start in short:
        at = [row for row in range(rows) if keys[row][0] == request_id]
        assert [lens[row] for row in at] == list(range(start + 1, start + tokens + 1))
        table = meta.paged_decodes.block_tables[at[-1]].tolist()
        assert table[:-(-(start + tokens) // 16)] == items[
            [i.request_id for i in items].index(request_id)].block_ids


@pytest.mark.parametrize("dtype,cache_dtype,tolerance",
                         [(torch.float32, torch.float32, 1e-5),
                          (torch.float32, torch.float16, 2e-3),  # a key's rounding may differ
                          (torch.bfloat16, torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim",
                         [(9, 3, 64), (4, 4, 128), (8, 1, 64), (8, 4, 256)])
@pytest.mark.parametrize("step", ["decodes", "prefills", "mixed"])
def test_fused_rope_write_decode_matches_the_torch_path(dtype, cache_dtype, tolerance, num_heads,
                                                        num_kv_heads, head_dim, step) -> None:
    """rope_write_attend (one native call per layer) against RoPE + write_kv + the torch
    attention: the output rows, the caches it wrote and the roped q/k it leaves in qkv."""
    block_size, num_blocks = 16, 120
    chosen = {"decodes": MIXED_STEP[:7], "prefills": MIXED_STEP[7:], "mixed": MIXED_STEP}[step]
    items, free = _step_items(chosen, random.Random(1).sample(range(num_blocks), num_blocks),
                              block_size)
    if step != "prefills":  # (which then has no decodes at all: an empty block table)
        items.append(ScheduledRequest("pad", [1], 7, free[:1], SamplingParams(), True, [],
                                      padding=True))  # a finished request's blocks, as static.py
    torch.manual_seed(0)
    caches = new_kv_cache(num_blocks + 1, block_size, num_kv_heads, head_dim, cache_dtype,
                          torch.device("cpu"))
    for cache in caches:
        cache.copy_(torch.randn(cache.shape))  # the cached prefixes (and stale slots)
    tables = _rope_tables(head_dim, 1024, dtype)
    num_tokens = sum(len(item.token_ids) for item in items)
    token_qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    results = []
    for native in (False, True):
        k_cache, v_cache = (c.clone() for c in caches)
        k_cache = k_cache.as_strided(caches[0].shape, caches[0].stride())  # keep the layout
        keys, positions, meta = _step_metadata(items, block_size, num_blocks, native)
        order = sorted(range(num_tokens), key=lambda row: str(keys[row]))  # same rows, both
        qkv = torch.empty_like(token_qkv)
        qkv[order] = token_qkv
        x = qkv.clone()
        if native:
            out = rope_write_attend(x, num_heads, *tables, positions, k_cache, v_cache, meta)
        else:
            out = _torch_path(x, positions, tables, k_cache, v_cache, meta, num_heads)
        real = [row for row in order if keys[row] is not None]  # a padding row's is discarded
        results.append((out.float()[real], k_cache.float(), v_cache.float()))
        if native:
            cos, sin = (t[positions].unsqueeze(1) for t in tables)
            qk = x.view(num_tokens, -1, head_dim)[:, :num_heads + num_kv_heads]
            roped = _rope(qkv.view(num_tokens, -1, head_dim)[:, :num_heads + num_kv_heads],
                          cos, sin)
            torch.testing.assert_close(qk.float(), roped.float(), atol=tolerance,
                                       rtol=tolerance)
    (expected, k_expected, v_expected), (actual, k_actual, v_actual) = results
    torch.testing.assert_close(actual, expected, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(k_actual, k_expected, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(v_actual, v_expected, atol=0, rtol=0)


def test_kernel_reads_v_through_its_strides_whichever_layout_holds_it() -> None:
    """new_kv_cache stores V kv head before position (one head's block one contiguous run),
    and the kernel reads it through its strides: the same values stored position before kv
    head, as the cache was before, attend to the same output, bit for bit."""
    ops = paged_attention_ops()
    if ops is None:
        pytest.skip("no compiled kernel")
    blocks, bs, kv_heads, dim = 12, 16, 3, 64
    k_cache, v_cache = new_kv_cache(blocks, bs, kv_heads, dim, torch.float16,
                                    torch.device("cpu"))
    assert v_cache.stride() == (kv_heads * bs * dim, dim, bs * dim, 1)
    generator = torch.Generator().manual_seed(7)
    k_cache.copy_(torch.randn(k_cache.shape, generator=generator))
    v_cache.copy_(torch.randn(v_cache.shape, generator=generator))
    position_major = v_cache.contiguous()
    assert position_major.stride() == (bs * kv_heads * dim, kv_heads * dim, dim, 1)
    tables, lens = [[3, 0, 7], [5, 11], [9, 1, 2, 4, 6, 8]], [40, 17, 90]
    decodes = decode_metadata(tables, lens, bs, True).paged_decodes
    q = torch.randn(len(lens), 9, dim, generator=generator)
    outputs = [ops.paged_decode_attention(q, k_cache, v, decodes.block_tables,
                                          decodes.context_lens, dim ** -0.5)
               for v in (v_cache, position_major)]
    assert torch.equal(outputs[0], outputs[1])


def test_fused_op_refuses_out_of_range_positions_and_slots() -> None:
    ops = paged_attention_ops()
    k_cache, v_cache = new_kv_cache(4, 16, 3, 64, torch.float32, torch.device("cpu"))
    cos = sin = torch.zeros(32, 64)
    qkv = torch.zeros(1, 15 * 64)
    one, tables, lens = torch.ones(1, dtype=torch.long), torch.zeros(0, 1, dtype=torch.long), \
        torch.zeros(0, dtype=torch.long)
    for positions, blocks, offsets in [(one * 32, one, one), (one, one * 4, one),
                                       (one, one, one * 16)]:
        with pytest.raises(RuntimeError, match="out of range"):
            ops.rope_write_decode(qkv, 9, cos, sin, positions, k_cache, v_cache, blocks,
                                  offsets, tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="qkv"):
        ops.rope_write_decode(torch.zeros(1, 14 * 64), 9, cos, sin, one, k_cache, v_cache, one,
                              one, tables, lens, 0.125)


def _prefill_chunk(n: int, cached: int, bf16: bool) -> torch.Tensor:
    """paged_attention's output for one prefill chunk of n tokens after `cached` positions
    already in an fp16 cache (9 query heads over 3 kv heads, head_dim 64)."""
    generator = torch.Generator().manual_seed(n + cached)
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    context = cached + n
    num_blocks = -(-context // bs)
    k_cache, v_cache = new_kv_cache(num_blocks, bs, kv_heads, dim, torch.float16,
                                    torch.device("cpu"))
    k, v = (torch.randn(context, kv_heads, dim, generator=generator) for _ in range(2))
    positions = torch.arange(context)
    write_kv(k_cache, v_cache, k, v, (positions // bs, positions % bs))
    q = torch.randn(n, heads, dim, generator=generator)
    span = PrefillSpan(query_start=0, query_len=n, context_len=context,
                       block_ids=torch.arange(num_blocks))
    meta = AttentionMetadata((positions[cached:] // bs, positions[cached:] % bs), [], [span],
                             prefill_bf16=bf16)
    return paged_attention(q, k[cached:], v[cached:], k_cache, v_cache, meta)


@pytest.mark.parametrize(("n", "cached"), [(363, 0), (256, 512), (362, 0), (64, 0), (1, 600)])
def test_long_prefill_chunks_attend_in_bf16_when_asked(n: int, cached: int) -> None:
    """From BF16_PREFILL_MIN_POSITIONS query x context positions (a whole prompt, or a chunk
    after a cached prefix) the chunk attends in bf16: close to fp32, not equal to it. Below,
    the flag changes nothing."""
    fp32 = _prefill_chunk(n, cached, bf16=False)
    asked = _prefill_chunk(n, cached, bf16=True)
    assert asked.dtype == torch.float32
    if n * (n + cached) >= BF16_PREFILL_MIN_POSITIONS:
        assert not torch.equal(asked, fp32)
        torch.testing.assert_close(asked, fp32, atol=3e-2, rtol=3e-2)
    else:
        assert torch.equal(asked, fp32)


def test_cpu_zeros_are_zero_writable_and_on_huge_pages_where_the_kernel_has_them() -> None:
    t = zeros((3, 1000, 700), torch.float16, torch.device("cpu"))
    assert t.shape == (3, 1000, 700) and t.dtype == torch.float16
    assert not t.any()
    t[2, 999, 699] = 1.5
    assert t.sum().item() == 1.5
    assert t.data_ptr() % (2 << 20) == 0  # whole huge pages from its first byte
    try:
        thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        pytest.skip("no transparent huge pages on this OS")
    if "[never]" in thp:
        pytest.skip("transparent huge pages are off on this host")
    address, eligible = t.data_ptr(), None
    for line in open("/proc/self/smaps"):
        first = line.split()[0]
        if "-" in first and all(c in "0123456789abcdef-" for c in first):
            low, high = (int(x, 16) for x in first.split("-"))
            inside = low <= address < high
        elif inside and line.startswith("THPeligible:"):
            eligible = line.split()[1] == "1"
    assert eligible, "the KV cache's mapping is not eligible for transparent huge pages"


# -- a layer's variants: sliding window, softcap, attention sinks ------------------------------

def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: list[int],
                        layer: LayerAttention, sinks: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """Plain dense attention in float64: q [queries, heads, dim] at `positions` over the keys
    and values of positions 0.. ([context, kv heads, dim]), each query over its own causal
    window, scores soft-capped, sinks in the denominator. Returns [queries, heads, dim]."""
    heads, kv_heads = q.shape[1], k.shape[1]
    out = []
    for query, position in zip(q.double(), positions):
        first = layer.first_position(position)
        keys = k[first:position + 1].double().repeat_interleave(heads // kv_heads, 1)
        values = v[first:position + 1].double().repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("hd,lhd->hl", query, keys) * layer.scale
        if layer.softcap is not None:
            scores = layer.softcap * torch.tanh(scores / layer.softcap)
        if sinks is not None:
            scores = torch.cat([scores, sinks.double().unsqueeze(1)], dim=1)
        probs = scores.softmax(dim=1)[:, :keys.shape[0]]
        out.append(torch.einsum("hl,lhd->hd", probs, values))
    return torch.stack(out)


POISON = float("nan")  # blocks wholly before a window hold it: read, it would show


def _windowed_cache(num_blocks: int, num_kv_heads: int, head_dim: int, cache_dtype: torch.dtype,
                    seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Random K/V caches with one more block, the last, full of NaN: the id the tables give
    the blocks a window has left (as the sliding group's null block). Returns it too."""
    torch.manual_seed(seed)
    k_cache, v_cache = new_kv_cache(num_blocks + 1, 16, num_kv_heads, head_dim, cache_dtype,
                                    torch.device("cpu"))
    for cache in (k_cache, v_cache):
        cache.copy_(torch.randn(cache.shape))
        cache[num_blocks] = POISON
    return k_cache, v_cache, num_blocks


def _rows_with_windows(lens: list[int], window: int | None, num_blocks: int, null: int,
                       seed: int) -> list[list[int]]:
    """A scattered block table per row, its blocks before the row's window the null block."""
    free = random.Random(seed).sample(range(num_blocks), num_blocks)
    tables = []
    for length in lens:
        count = -(-length // 16)
        skipped = 0 if window is None else max(0, length - window) // 16
        tables.append([null] * skipped + free[skipped:count])
        free = free[count:]
    return tables


def _reference_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    tables: list[list[int]], lens: list[int], layer: LayerAttention,
                    sinks: torch.Tensor | None) -> torch.Tensor:
    """reference_attention of each decode row (query at position len - 1) over its table."""
    rows = []
    for i, (table, length) in enumerate(zip(tables, lens)):
        k = k_cache[table].flatten(0, 1)[:length]
        v = v_cache[table].flatten(0, 1)[:length]
        rows.append(reference_attention(q[i:i + 1], k, v, [length - 1], layer, sinks))
    return torch.cat(rows)


def variant_both_ways(ops: ModuleType, dtype: torch.dtype, cache_dtype: torch.dtype,
                      num_heads: int, num_kv_heads: int, head_dim: int, window: int | None,
                      softcap: float | None, with_sinks: bool, lens: list[int],
                      threads: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(dense reference, ops' kernel) of decode rows of context `lens` in a layer with the
    variant, on `threads` threads (two or more let few long contexts run in spans)."""
    num_blocks = sum(-(-length // 16) for length in lens)
    k_cache, v_cache, null = _windowed_cache(num_blocks, num_kv_heads, head_dim, cache_dtype,
                                             len(lens))
    tables = _rows_with_windows(lens, window, num_blocks, null, len(lens))
    layer = LayerAttention(head_dim ** -0.5 * 1.5, window, softcap)
    q = (2 * torch.randn(len(lens), num_heads, head_dim)).to(dtype)  # softcap bites
    sinks = torch.randn(num_heads) * 2 if with_sinks else None
    expected = _reference_rows(q, k_cache, v_cache, tables, lens, layer, sinks)
    decodes = decode_metadata(tables, lens, 16, True).paged_decodes
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        actual = ops.paged_decode_attention(q, k_cache, v_cache, decodes.block_tables,
                                            decodes.context_lens, layer.scale,
                                            window=window or 0, softcap=softcap or 0.0,
                                            sinks=sinks)
    finally:
        torch.set_num_threads(before)
    return expected, actual


# Contexts on both sides of each window's edge (W - 1, W, W + 1) and of block edges, beside
# longer ones that span several windows: windows shorter than a block, one block, not a
# multiple of the block size, several blocks.
WINDOW_CASES = [(window, sorted({window - 1, window, window + 1, 15, 16, 17, 33, 130, 301}
                                - {0}))
                for window in (5, 16, 20, 47, 100)]
VARIANT_TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype,cache_dtype,tolerance", DTYPES)
@pytest.mark.parametrize("window,lens", WINDOW_CASES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 4, 128),
                                                              (8, 4, 256)])
def test_windowed_decode_rows_attend_exactly_their_window(dtype, cache_dtype, tolerance, window,
                                                          lens, num_heads, num_kv_heads,
                                                          head_dim) -> None:
    """A row at position p sees p - W + 1 .. p, and the blocks wholly before are never read
    (they hold NaN here: a read would show in the output)."""
    expected, actual = variant_both_ways(paged_attention_ops(), dtype, cache_dtype, num_heads,
                                         num_kv_heads, head_dim, window, None, False, lens)
    assert torch.isfinite(actual.float()).all()
    torch.testing.assert_close(actual.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype,cache_dtype,tolerance", DTYPES)
@pytest.mark.parametrize("window,softcap,with_sinks", [(None, 5.0, False), (None, None, True),
                                                       (20, 5.0, True)])
def test_softcap_and_sinks_match_the_reference(dtype, cache_dtype, tolerance, window, softcap,
                                               with_sinks) -> None:
    expected, actual = variant_both_ways(paged_attention_ops(), dtype, cache_dtype, 9, 3, 64,
                                         window, softcap, with_sinks, [1, 7, 16, 40, 300])
    torch.testing.assert_close(actual.double(), expected, atol=tolerance, rtol=tolerance)
    plain = variant_both_ways(paged_attention_ops(), dtype, cache_dtype, 9, 3, 64, window, None,
                              False, [1, 7, 16, 40, 300])[1]
    assert not torch.allclose(actual.float(), plain.float(), atol=10 * tolerance)  # it did bite


@pytest.mark.parametrize("dtype,cache_dtype,tolerance", DTYPES)
# (window, softcap, sinks, whether spans run): a window of 129 leaves 9 blocks a row, too
# few to cut, as the spans count only the blocks a window reaches
@pytest.mark.parametrize("window,softcap,with_sinks,cut", [
    (None, None, True, True), (700, None, False, True), (1000, 5.0, True, True),
    (129, None, False, False)])
def test_few_long_windowed_contexts_attend_in_spans_that_respect_the_window(
        dtype, cache_dtype, tolerance, window, softcap, with_sinks, cut) -> None:
    """Few long contexts are cut into spans over only the blocks their window reaches, the
    first span starting mid-block at the window's first position; the sink joins the spans'
    merge once. On two threads against the reference, and against one thread (no spans) to
    show whether the spans ran."""
    lens = [700, 1500, 2900]
    results = [variant_both_ways(paged_attention_ops(), dtype, cache_dtype, 9, 3, 64, window,
                                 softcap, with_sinks, lens, threads) for threads in (1, 2)]
    (expected, whole), (_, spans) = results
    for actual in (whole, spans):
        assert torch.isfinite(actual.float()).all()
        torch.testing.assert_close(actual.double(), expected, atol=tolerance, rtol=tolerance)
    assert torch.equal(whole, spans) != cut


@pytest.mark.parametrize("dtype,cache_dtype,tolerance", DTYPES)
@pytest.mark.parametrize("window", [5, 16, 20, 47])
def test_a_chunks_rows_attend_in_tiles_each_over_its_own_window(dtype, cache_dtype, tolerance,
                                                                window) -> None:
    """A short prefill chunk's tokens as consecutive decode rows over one table (a tile reads
    each block once for its rows): each row still sees exactly its own window, rows whose
    windows start in different blocks sharing a tile."""
    ops = paged_attention_ops()
    k_cache, v_cache, null = _windowed_cache(12, 3, 64, cache_dtype, window)
    lens = list(range(60, 80))
    first_block = max(0, lens[0] - window) // 16  # the chunk's first row's window
    table = [null] * first_block + list(range(first_block, 5))
    tables = [table[:-(-length // 16)] for length in lens]
    layer = LayerAttention(64 ** -0.5, window)
    q = torch.randn(len(lens), 9, 64).to(dtype)
    expected = _reference_rows(q, k_cache, v_cache, tables, lens, layer, None)
    decodes = decode_metadata(tables, lens, 16, True).paged_decodes
    actual = ops.paged_decode_attention(q, k_cache, v_cache, decodes.block_tables,
                                        decodes.context_lens, layer.scale, window=window)
    torch.testing.assert_close(actual.double(), expected, atol=tolerance, rtol=tolerance)


def test_variant_arguments_are_checked() -> None:
    ops = paged_attention_ops()
    k_cache, v_cache = new_kv_cache(2, 16, 3, 64, torch.float32, torch.device("cpu"))
    q, tables, lens = torch.zeros(1, 9, 64), torch.zeros(1, 1, dtype=torch.long), \
        torch.ones(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="window and softcap"):
        ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, window=-1)
    with pytest.raises(RuntimeError, match="sinks"):
        ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125,
                                   sinks=torch.zeros(3))


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("window", [5, 20, 47])
def test_a_step_through_the_sliding_group_matches_the_reference(native: bool,
                                                                window: int) -> None:
    """One step of decodes, short chunks (per-token rows on the native path) and long chunks
    (SDPA) through the runner's sliding KV group: tables whose slid-out blocks are the null
    block (NaN here), trimmed by the runner to start at each item's window, on both paths,
    against reference_attention over each request's whole context."""
    bs, num_blocks, heads, kv_heads, dim = 16, 200, 9, 3, 64
    group = SlidingKVGroup(window, num_blocks)
    k_cache, v_cache, null = _windowed_cache(num_blocks, kv_heads, dim, torch.float32, window)
    assert null == group.null_block
    layer = LayerAttention(dim ** -0.5, window)
    chosen = [("d0", 1, 0), ("d1", 1, window - 1), ("d2", 1, window), ("d3", 1, window + 1),
              ("d4", 1, 300), ("p0", 20, 0), ("p1", 25, 40), ("p2", 260, 0), ("p3", 100, 600)]
    free, items, contexts = list(range(num_blocks)), [], {}
    for request_id, tokens, start in chosen:
        count = -(-(start + tokens) // bs)
        blocks, free = free[:count], free[count:]
        kept = max(0, start - window + 1) // bs  # the group frees the blocks before
        items.append(ScheduledRequest(request_id, [1] * tokens, start, [1000 + b for b in blocks],
                                      SamplingParams(), True, [],
                                      sliding_block_ids=[null] * kept + blocks[kept:]))
        contexts[request_id] = blocks
    keys, positions, meta = _step_metadata(items, bs, 1000 + num_blocks, native, group)
    meta = meta.for_layer(layer)
    rows = len(keys)
    q = torch.randn(rows, heads, dim)
    k_new, v_new = torch.randn(rows, kv_heads, dim), torch.randn(rows, kv_heads, dim)
    write_kv(k_cache, v_cache, k_new, v_new, meta.slots)
    assert torch.isfinite(k_cache[:num_blocks]).all()  # nothing was written to the null block
    out = paged_attention(q, k_new, v_new, k_cache, v_cache, meta, layer=layer)
    for request_id, _, _ in chosen:
        at = [row for row in range(rows) if keys[row][0] == request_id]
        context = contexts[request_id]
        end = keys[at[-1]][1] + 1
        k = k_cache[context].flatten(0, 1)[:end]
        v = v_cache[context].flatten(0, 1)[:end]
        expected = reference_attention(q[at], k, v, [keys[row][1] for row in at], layer)
        torch.testing.assert_close(out[at].view(len(at), heads, dim).double(), expected,
                                   atol=2e-5, rtol=2e-5)
