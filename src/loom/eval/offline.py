"""Scoring chunks with the engine in this process: every chunk a request with prompt
logprobs, `batch_size` of them in flight, and every scored position's whole log-softmax taken
from the runner (the engine's prompt logprobs stop at the top 20; KL divergence needs all)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import torch

from loom.config import EngineConfig
from loom.core.batch import GrammarBitmask
from loom.engine.core import EngineCore
from loom.eval.config import ScoringConfig
from loom.eval.scores import ChunkScores
from loom.eval.text import Chunk
from loom.model.runner import ModelRunner
from loom.model.sampler import LogitRows, SampledTokens, Sampler
from loom.sampling import SamplingParams


def scoring_engine(config: EngineConfig, scoring: ScoringConfig) -> EngineConfig:
    """The engine as scoring runs it: no prefix caching (a cached position gets no logits),
    room for `batch_size` sequences; with `as_decode`, a step budget of one token a
    sequence. Unless a KV size is given, the cache holds those sequences and no more (not a
    share of RAM)."""
    s, c = config.scheduler, config.cache
    seqs = scoring.batch_size
    budget = seqs if scoring.as_decode else max(s.max_num_batched_tokens, seqs)
    blocks = c.num_kv_blocks
    if blocks is None and c.kv_cache_memory is None:
        blocks = seqs * (-(-(scoring.context + 1) // c.block_size) + 1)
    return replace(config, cache=replace(c, enable_prefix_caching=False, num_kv_blocks=blocks),
                   scheduler=replace(s, max_num_seqs=seqs, max_num_batched_tokens=budget))


def float32_reference(config: EngineConfig) -> EngineConfig:
    """`--reference-dtype float32`: float32 activations, the native matmul at every batch
    size, a float32 KV cache: the most exact loom there is."""
    return replace(config,
                   model=replace(config.model, dtype="float32", batched_matmul="native"),
                   cache=replace(config.cache, kv_cache_dtype="float32"))


class _CapturingSampler(Sampler):
    """The runner's sampler, keeping first the log-softmax rows of the positions a chunk
    scores (the rows of the step's logits that score prompt tokens)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.wanted: dict[str, int] = {}  # request id -> first position whose logits are kept
        self.rows: dict[str, dict[int, np.ndarray]] = {}

    def sample(self, logits: torch.Tensor, rows: LogitRows,
               bitmask: GrammarBitmask | None) -> SampledTokens:
        for item in rows.items:
            if item.request_id not in rows.prompt_rows or item.request_id not in self.wanted:
                continue
            first, count = rows.prompt_rows[item.request_id]
            skip = max(0, self.wanted[item.request_id] - item.start_position)
            if skip >= count:
                continue
            # logits at position p predict p + 1; one log-softmax over the kept rows
            kept = logits[first + skip:first + count].log_softmax(-1).cpu().numpy()
            self.rows.setdefault(item.request_id, {}).update(
                (item.start_position + skip + k, row) for k, row in enumerate(kept))
        return super().sample(logits, rows, bitmask)


class OfflineScorer:
    def __init__(self, config: EngineConfig) -> None:
        runner = ModelRunner.from_config(config)
        runner.sampler = self.sampler = _CapturingSampler(runner.device)
        self.engine = EngineCore(config, runner)
        self.tokenizer = self.engine.tokenizer
        self.vocab_size = runner.info.vocab_size  # the width of a logits row

    def score(self, chunks: list[Chunk], batch_size: int) -> Iterator[ChunkScores]:
        """Each chunk's scores, in order; `batch_size` chunks are submitted together."""
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        for start in range(0, len(chunks), batch_size):
            group = chunks[start:start + batch_size]
            ids = [f"eval-{c.index}" for c in group]
            for request_id, chunk in zip(ids, group):
                self.sampler.wanted[request_id] = chunk.first_scored - 1
                self.engine.add_request(request_id, chunk.token_ids, params)
            self._run(set(ids))
            for request_id, chunk in zip(ids, group):
                del self.sampler.wanted[request_id]
                rows = self.sampler.rows.pop(request_id)
                full = np.stack([rows[p] for p in range(chunk.first_scored - 1,
                                                        len(chunk.token_ids) - 1)])
                yield ChunkScores.from_full(np.array(chunk.targets), full)

    def _run(self, wanted: set[str]) -> None:
        while wanted:
            outputs, _ = self.engine.step()
            wanted -= {o.request_id for o in outputs if o.finished}
