"""SchedulerOutput -> tensors -> forward -> sampled tokens (ModelRunnerOutput).

The runner owns the model, its KV cache tensors and the sampler (which keeps each request's
sampling state: one call a step, `Sampler.sample`); it never decides who runs. The engine
asks it how many KV blocks fit (`determine_num_kv_blocks`), then hands that count back
(`initialize_kv_cache`, which answers with the sliding-window layers' KV group where they keep
one): the engine never probes the machine itself.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from loom import host
from loom.config import CacheConfig, EngineConfig, SchedulerConfig, parse_size
from loom.core.batch import (
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    SlidingKVGroup,
)
from loom.model.arch import ModelInfo
from loom.model.attention import (
    AttentionMetadata,
    DecodeGroup,
    PagedDecodes,
    PrefillSpan,
    new_kv_cache,
)
from loom.model.backends import Backends, resolve_backends
from loom.model.decoder import DecoderModel
from loom.model.loader import load_model
from loom.model.memory import KVCacheLayout, KVCacheSpec, sliding_layers
from loom.model.sampler import LogitRows, Sampler, take_rows

logger = logging.getLogger(__name__)


def _return_freed_heap() -> None:
    """Hand the memory loading freed back to the OS. Converting a GGUF's blocks and laying them
    out in panels frees about a model's size in large arrays, and glibc's malloc keeps most of
    that in its heap (its mmap threshold grows with the blocks freed), so a 1.7B-parameter
    Q4_K_M model stayed 1.2 GiB more resident than it needed
    (BENCHMARKS.md, "Start-up"). malloc_trim(0) returns the free pages; elsewhere than glibc,
    nothing."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


_MAX_PADDING = 1.25  # padded KV a decode group may gather, relative to what it needs

_CPU_KV_SHARE, _CPU_KV_CAP = 0.25, 4 * 2**30
_GPU_KV_SHARE = 0.85


class ModelRunner:
    def __init__(self, model: DecoderModel, backends: Backends, block_size: int,
                 info: ModelInfo | None = None) -> None:
        self.model = model
        self.backends = backends
        self.block_size = block_size
        self.device = backends.device
        self.info = info
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.scratch_block = 0
        # the sliding layers' own KV group, where they keep one (initialize_kv_cache)
        self.sliding_kv: SlidingKVGroup | None = None
        self._layout: KVCacheLayout | None = None  # what determine_num_kv_blocks found
        self.sampler = Sampler(self.device)  # and each request's sampling state

    @property
    def native_decode(self) -> bool:
        """Decodes go through the C++ paged-attention kernel."""
        return self.backends.native_decode

    @classmethod
    def from_config(cls, config: EngineConfig) -> ModelRunner:
        """Load the model, pick its backends for this machine and build it (no KV cache yet)."""
        runner = cls._built(config)
        _return_freed_heap()  # the loader's copies are gone by now
        return runner

    @classmethod
    def _built(cls, config: EngineConfig) -> ModelRunner:
        loaded = load_model(config.model.model)
        block_size = config.cache.block_size
        backends = resolve_backends(
            config.model, config.cache, loaded.arch, has_block_quant=bool(loaded.block_quant))
        model = DecoderModel(loaded.arch, loaded.weights, backends.dtype, backends.device,
                             prepack=backends.prepack,
                             block_quant=loaded.block_quant if backends.linear == "native"
                             else None,
                             fused_ops=backends.fused_ops,
                             matmul=backends.matmul_rows,
                             max_model_len=config.model.max_model_len)
        info = ModelInfo(loaded.name, loaded.tokenizer, loaded.arch.vocab_size,
                         loaded.arch.max_position_embeddings)
        logger.info("model %s on %s: %s%s", info.name, backends.device, backends.describe(),
                    " (dtype auto)" if config.model.dtype == "auto" else "")
        if backends.linear == "native" and loaded.conversions:
            logger.info("GGUF types the native matmul reads converted (docs/gguf-types.md): %s",
                        ", ".join(f"{n} x {what}" for what, n in loaded.conversions.items()))
        return cls(model, backends, block_size, info)

    # -- KV cache memory -----------------------------------------------------------------------

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec.for_model(self.model.arch, self.backends.kv_dtype.itemsize)

    def determine_num_kv_blocks(self, cache: CacheConfig, max_model_len: int,
                                scheduler: SchedulerConfig) -> int:
        """KV blocks of the full-attention layers (the pool the scheduler admits against) for
        this cache config on this device: the count asked for, or what the memory budget
        (given, or a share of what the device has free) holds once the sliding layers' own
        group, if any, has what the scheduler's limits can ever use (KVCacheSpec.layout)."""
        if cache.num_kv_blocks is not None:
            budget, source = None, "num_kv_blocks"
        else:
            budget, source = self._kv_budget(cache)
        layout = self.kv_cache_spec.layout(
            cache.block_size, max_model_len, scheduler.max_num_seqs,
            scheduler.max_num_batched_tokens, budget_bytes=budget,
            num_blocks=cache.num_kv_blocks)
        num_tokens = layout.num_blocks * cache.block_size
        sliding = ""
        if layout.sliding_window is not None:
            sliding = (f"; sliding-window layers (window {layout.sliding_window}): "
                       f"{layout.num_sliding_blocks} blocks "
                       f"({layout.sliding_bytes / 2**30:.2f} GiB), the windows of "
                       f"max_num_seqs={scheduler.max_num_seqs} requests")
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, from %s); "
            "max concurrency at max_model_len=%d: %.2fx%s",
            layout.num_blocks, cache.block_size, num_tokens, layout.full_bytes / 2**30,
            source, max_model_len, num_tokens / max_model_len, sliding)
        self._layout = layout
        return layout.num_blocks

    def _kv_budget(self, cache: CacheConfig) -> tuple[int, str]:
        if cache.kv_cache_memory is not None:
            return parse_size(cache.kv_cache_memory), "kv_cache_memory"
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * _GPU_KV_SHARE), f"{_GPU_KV_SHARE:.0%} of free GPU memory"
        return (min(int(host.available_ram_bytes() * _CPU_KV_SHARE), _CPU_KV_CAP),
                f"{_CPU_KV_SHARE:.0%} of available RAM, at most {_CPU_KV_CAP / 2**30:g} GiB")

    def initialize_kv_cache(self, num_blocks: int,
                            num_sliding_blocks: int | None = None) -> SlidingKVGroup | None:
        """Allocate K and V for `num_blocks` blocks per full-attention layer, plus one scratch
        block that padding tokens (the fixed-batch baseline) write to. Sliding-window layers
        with a group of their own (KVCacheSpec.layout) get num_sliding_blocks (default: what
        determine_num_kv_blocks found, else num_blocks) plus the group's null block, which is
        also its scratch block; returns that group for the KV cache manager, else None."""
        arch, layout = self.model.arch, self._layout
        keeps_group = (layout.sliding_window is not None if layout is not None
                       else self.kv_cache_spec.keeps_sliding_group(arch.max_position_embeddings))
        if num_sliding_blocks is None:
            num_sliding_blocks = layout.num_sliding_blocks if layout is not None else num_blocks
        self.sliding_kv = (SlidingKVGroup(arch.sliding_window, num_sliding_blocks)
                           if keeps_group else None)
        self.scratch_block = num_blocks

        def layer_cache(sliding: bool) -> tuple[torch.Tensor, torch.Tensor]:
            count = self.sliding_kv.num_blocks if sliding else num_blocks
            return new_kv_cache(count + 1, self.block_size, arch.num_kv_heads, arch.head_dim,
                                self.backends.kv_dtype, self.device)

        self.kv_caches = [layer_cache(self.sliding_kv is not None and sliding)
                          for sliding in sliding_layers(arch)]
        return self.sliding_kv

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> ModelRunnerOutput:
        # here, not by the caller: in order with steps still running (async scheduling)
        self.sampler.forget(batch.finished_request_ids)
        items, input_ids, positions, meta = self._prepare(batch.scheduled)
        hidden = self.model.forward(input_ids, positions, self.kv_caches, meta)
        rows = LogitRows.of(items)
        if not rows.rows:
            return ModelRunnerOutput()
        logits = self.model.compute_logits(take_rows(hidden, rows.rows)).float()
        sampled = self.sampler.sample(logits, rows, batch.grammar_bitmask)
        return ModelRunnerOutput(sampled_token_ids=sampled.token_ids,
                                 accepted_draft_ids=sampled.accepted_draft_ids,
                                 logprobs=sampled.logprobs,
                                 prompt_logprobs=sampled.prompt_logprobs)

    def _prepare(self, scheduled: list[ScheduledRequest]) -> tuple[
            list[ScheduledRequest], torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flatten the step into token ids, positions and attention metadata. Returns the
        requests in the order their tokens take in the flat batch: decode-like requests
        first, shortest context first, so their attention batches in groups of similar
        length. A decode with draft tokens is decode-like: each of its tokens is a query of
        its own over the request's blocks, up to its own position (no context gathered); on
        the native path, so is a short prefill chunk (Backends.per_token_prefill_max_positions)."""
        per_token = self._attends_per_token
        items = sorted(scheduled, key=lambda s: (not per_token(s), s.start_position))
        bs = self.block_size
        device = self.device
        ids: list[int] = []
        positions: list[int] = []
        for item in items:
            ids.extend(item.token_ids)
            positions.extend(range(item.start_position, item.start_position + len(item.token_ids)))
        offsets = torch.tensor([p % bs for p in positions], dtype=torch.long, device=device)
        one_per_token = [per_token(item) for item in items]
        meta = self._group_metadata(items, one_per_token, offsets)
        if self.sliding_kv is not None:
            meta.sliding = self._group_metadata(items, one_per_token, offsets, self.sliding_kv)
        return (items, torch.tensor(ids, dtype=torch.long, device=device),
                torch.tensor(positions, dtype=torch.long, device=device), meta)

    def _group_metadata(self, items: list[ScheduledRequest], one_per_token: list[bool],
                        offsets: torch.Tensor, sliding: SlidingKVGroup | None = None
                        ) -> AttentionMetadata:
        """The step's metadata through one KV group's blocks: the full layers' (block_ids) or,
        with `sliding`, the sliding layers' (sliding_block_ids). Those start each item's
        tables at the block the window of its first token reaches back to: the blocks before
        (null ones among them) are left out, and context lengths count from there, which
        changes no score (keys carry their positions from RoPE), so every sliding table is
        as long as a window, not a context."""
        bs, device = self.block_size, self.device
        scratch = sliding.null_block if sliding is not None else self.scratch_block
        slot_blocks: list[int] = []
        prefills: list[PrefillSpan] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        query_start = 0
        for item, per_token in zip(items, one_per_token):
            start, n = item.start_position, len(item.token_ids)
            blocks = item.block_ids if sliding is None else item.sliding_block_ids
            span = range(start, start + n)
            slot_blocks.extend([scratch] * n if item.padding else (blocks[p // bs] for p in span))
            skip = 0 if sliding is None else max(0, start - sliding.window + 1) // bs
            shift = skip * bs
            if per_token:
                for p in span:
                    decode_tables.append(blocks[skip:p // bs + 1])
                    decode_lens.append(p + 1 - shift)
            else:
                prefills.append(PrefillSpan(
                    query_start=query_start, query_len=n, context_len=start + n - shift,
                    block_ids=torch.tensor(blocks[skip:-(-(start + n) // bs)], device=device)))
            query_start += n
        slots = (torch.tensor(slot_blocks, dtype=torch.long, device=device), offsets)
        bf16 = self.backends.bf16_prefill_attention
        if self.native_decode:
            return AttentionMetadata(slots, [], prefills,
                                     self._paged_decodes(decode_tables, decode_lens),
                                     prefill_bf16=bf16)
        window = sliding.window if sliding is not None else None
        return AttentionMetadata(slots, self._decode_groups(decode_tables, decode_lens, window),
                                 prefills, prefill_bf16=bf16)

    def _attends_per_token(self, item: ScheduledRequest) -> bool:
        """Whether each of the item's tokens is a query of its own in the decode rows."""
        n = len(item.token_ids)
        return (n == 1 or item.num_draft_tokens > 0
                or (self.native_decode and n * (item.start_position + n)
                    < self.backends.per_token_prefill_max_positions))

    def _paged_decodes(self, tables: list[list[int]], lens: list[int]) -> PagedDecodes:
        max_blocks = max((len(t) for t in tables), default=0)
        return PagedDecodes(
            num_queries=len(tables),
            block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables],
                                      dtype=torch.long, device=self.device),
            context_lens=torch.tensor(lens, dtype=torch.long, device=self.device))

    def _decode_groups(self, tables: list[list[int]], lens: list[int],
                       window: int | None = None) -> list[DecodeGroup]:
        """Split decodes (sorted by context length) wherever padding to the group's longest
        context would waste more than a quarter of the gathered KV. window: each query sees
        only its last `window` positions."""
        bounds, start, total = [], 0, 0
        for i, length in enumerate(lens):
            if i > start and length * (i - start + 1) > _MAX_PADDING * (total + length):
                bounds.append((start, i))
                start, total = i, 0
            total += length
        if lens:
            bounds.append((start, len(lens)))
        groups = []
        for lo, hi in bounds:
            max_blocks = max(len(t) for t in tables[lo:hi])  # a draft's queries interleave
            block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables[lo:hi]],
                                        dtype=torch.long, device=self.device)
            ctx = torch.arange(max_blocks * self.block_size, device=self.device)
            ends = torch.tensor(lens[lo:hi], device=self.device).unsqueeze(1)
            mask = ctx.unsqueeze(0) < ends
            if window is not None:
                mask &= ctx.unsqueeze(0) >= ends - window
            groups.append(DecodeGroup(lo, hi - lo, block_tables,
                                      mask.view(hi - lo, 1, 1, max_blocks * self.block_size)))
        return groups

