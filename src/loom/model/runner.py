"""SchedulerOutput -> tensors -> forward -> sampled tokens (ModelRunnerOutput).

The runner owns the KV cache tensors and per-request sampling state (seeded generators); it
never decides who runs.
"""

from __future__ import annotations

import torch

from loom.core.batch import (
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprob,
)
from loom.model.attention import AttentionMetadata, PrefillSpan
from loom.model.llama import LlamaModel
from loom.sampling import Sampler


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        arch = model.arch
        self.model = model
        self.block_size = block_size
        self.device = device
        shape = (num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device),
                           torch.zeros(shape, dtype=dtype, device=device))
                          for _ in range(arch.num_layers)]
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}

    def release(self, request_ids: list[str]) -> None:
        """Drop the per-request state of requests that have ended."""
        for request_id in request_ids:
            self.generators.pop(request_id, None)

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> ModelRunnerOutput:
        # Single-token requests first: their attention is one batched call.
        items = sorted(batch.scheduled, key=lambda s: len(s.token_ids) != 1)
        input_ids, positions, meta = self._prepare(items)
        hidden = self.model.forward(input_ids, positions, self.kv_caches, meta)

        offsets, rows, row_of = 0, [], {}
        prompt_rows: dict[str, tuple[int, list[int]]] = {}
        for item in items:
            n = len(item.token_ids)
            if item.sampling_params.prompt_logprobs is not None and \
                    item.start_position + 1 < item.num_prompt_tokens:
                # logits at position p score prompt token p + 1
                last = min(item.start_position + n, item.num_prompt_tokens - 1)
                count = last - item.start_position
                prompt_rows[item.request_id] = (len(rows), count)
                rows.extend(range(offsets, offsets + count))
            if item.sample:
                row_of[item.request_id] = len(rows)
                rows.append(offsets + n - 1)
            offsets += n
        output = ModelRunnerOutput()
        if not rows:
            return output
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)]).float()
        sampled = [s for s in items if s.sample]
        if sampled:
            sample_rows = torch.tensor([row_of[s.request_id] for s in sampled], device=self.device)
            token_ids = self.sampler(logits[sample_rows], [s.sampling_params for s in sampled],
                                     [self._generator(s) for s in sampled]).tolist()
            for s, token_id in zip(sampled, token_ids):
                output.sampled_token_ids[s.request_id] = token_id
                if s.sampling_params.logprobs is not None:
                    output.logprobs[s.request_id] = _logprobs(
                        logits[row_of[s.request_id]:row_of[s.request_id] + 1], [token_id],
                        s.sampling_params.logprobs)[0]
        for item in items:
            if item.request_id in prompt_rows:
                first, count = prompt_rows[item.request_id]
                start = item.start_position + 1
                targets = item.prompt_token_ids[start:start + count]
                output.prompt_logprobs[item.request_id] = (start, _logprobs(
                    logits[first:first + count], targets, item.sampling_params.prompt_logprobs))
        return output

    def _generator(self, item: ScheduledRequest) -> torch.Generator | None:
        seed = item.sampling_params.seed
        if seed is None:
            return None
        if item.request_id not in self.generators:
            self.generators[item.request_id] = torch.Generator(self.device).manual_seed(seed)
        return self.generators[item.request_id]

    def _prepare(self, items: list[ScheduledRequest]
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillSpan] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        for item in items:
            start, n = item.start_position, len(item.token_ids)
            ids.extend(item.token_ids)
            span = range(start, start + n)
            positions.extend(span)
            slots.extend(item.block_ids[p // bs] * bs + p % bs for p in span)
            num_blocks = -(-(start + n) // bs)
            if n == 1:
                decode_tables.append(item.block_ids[:num_blocks])
                decode_lens.append(start + 1)
            else:
                prefills.append(PrefillSpan(
                    query_start=len(ids) - n, query_len=n, context_len=start + n,
                    block_ids=torch.tensor(item.block_ids[:num_blocks], device=self.device)))
        device = self.device
        max_blocks = max((len(t) for t in decode_tables), default=0)
        tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in decode_tables],
                              dtype=torch.long, device=device).view(len(decode_tables), max_blocks)
        lens = torch.tensor(decode_lens, device=device)
        mask = (torch.arange(max_blocks * bs, device=device).unsqueeze(0) < lens.unsqueeze(1))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            num_decodes=len(decode_tables),
            decode_block_tables=tables,
            decode_mask=mask.view(len(decode_tables), 1, 1, max_blocks * bs),
            prefills=prefills,
        )
        return (torch.tensor(ids, dtype=torch.long, device=device),
                torch.tensor(positions, dtype=torch.long, device=device), meta)


def _logprobs(logits: torch.Tensor, token_ids: list[int], top_n: int) -> list[TokenLogprob]:
    """Log-probability of each chosen token and the top-n alternatives, per logits row."""
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=logits.device).unsqueeze(1))
    chosen_list = chosen.squeeze(1).tolist()
    if top_n:
        top_values, top_ids = logprobs.topk(top_n, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), top_values.tolist())]
    else:
        tops = [[] for _ in token_ids]
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(token_ids, chosen_list, tops)]
