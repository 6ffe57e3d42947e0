"""The stand-in model the scheduler tests run on, behind the engine's runner protocol.

`SlotModel` plays the model: each scheduled token is written into its slot (block id *
block_size + offset) together with its position, and a sampled token is a function of the
whole context read back through the block table. A wrong block, a reused slot, a stale
prefix-cache hit or a botched preemption therefore changes the tokens, which are compared with
the tokens the request's own history dictates.
"""

from __future__ import annotations

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from loom.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from loom.core.batch import ModelRunnerOutput, SchedulerOutput, SlidingKVGroup
from loom.core.scheduler import Scheduler
from loom.engine.core import EngineCore
from loom.model.arch import ModelInfo
from loom.model.tokenizer import Tokenizer

VOCAB = 1000


COPY_BACK = 7  # a copying model repeats the token this far back, three steps in four


def next_token(history: list[int], copying: bool = False) -> int:
    """The stand-in model's prediction. A copying one mostly repeats its context, so n-gram
    drafts are often right (and sometimes wrong) and speculative decoding is exercised."""
    h = hash(tuple(history))
    if copying and len(history) >= COPY_BACK and h % 4:
        return history[-COPY_BACK]
    return h % VOCAB


def expected_output(prompt: list[int], max_tokens: int, copying: bool = False) -> list[int]:
    history = list(prompt)
    for _ in range(max_tokens):
        history.append(next_token(history, copying))
    return history[len(prompt):]


class SlotModel:
    def __init__(self, block_size: int, copying: bool = False) -> None:
        self.block_size = block_size
        self.copying = copying
        self.slots: dict[int, tuple[int, int]] = {}

    def slot(self, block_ids: list[int], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + \
            position % self.block_size

    def execute(self, batch: SchedulerOutput) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        for item in batch.scheduled:  # all writes first, as the runner does per layer
            assert item.token_ids, "a scheduled request must feed at least one token"
            if item.padding:
                assert not item.sample and len(item.token_ids) == 1
                continue  # the runner sends padding to a scratch slot
            for i, token in enumerate(item.token_ids):
                position = item.start_position + i
                self.slots[self.slot(item.block_ids, position)] = (position, token)
        for item in batch.scheduled:
            if item.sample:
                end = item.start_position + len(item.token_ids)
                context = [self.slots[self.slot(item.block_ids, p)] for p in range(end)]
                assert [p for p, _ in context] == list(range(end)), "KV read from a wrong slot"
                self._verify([t for _, t in context], item.num_draft_tokens, item.request_id,
                             out)
        return out

    def _verify(self, history: list[int], num_drafts: int, request_id: str,
                out: ModelRunnerOutput) -> None:
        """Keep the drafts (the last num_drafts of history) the model agrees with, then
        predict one more token, as the runner's greedy verification does."""
        first_draft = len(history) - num_drafts
        accepted = []
        for position in range(first_draft, len(history)):
            predicted = next_token(history[:position], self.copying)
            if predicted != history[position]:
                break
            accepted.append(predicted)
        if num_drafts:
            out.accepted_draft_ids[request_id] = accepted
        out.sampled_token_ids[request_id] = next_token(history[:first_draft + len(accepted)],
                                                       self.copying)


def check_limits(scheduler: Scheduler, batch: SchedulerOutput) -> None:
    cfg = scheduler.config
    assert batch.num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(batch.scheduled) <= cfg.max_num_seqs
    assert len(scheduler.running) <= cfg.max_num_seqs


class SlotRunner:
    """The engine's runner protocol over `SlotModel`, checking the step limits on every batch
    the real engine loop hands it."""

    def __init__(self, block_size: int, copying: bool = False) -> None:
        self.model = SlotModel(block_size, copying)
        self.info = ModelInfo("slot-model", toy_tokenizer(), VOCAB, 4096)
        self.engine: EngineCore | None = None

    def determine_num_kv_blocks(self, cache: CacheConfig, max_model_len: int,
                                scheduler: SchedulerConfig) -> int:
        assert cache.num_kv_blocks is not None
        return cache.num_kv_blocks

    def initialize_kv_cache(self, num_blocks: int) -> SlidingKVGroup | None:
        return None

    def execute(self, batch: SchedulerOutput) -> ModelRunnerOutput:
        check_limits(self.engine.scheduler, batch)
        return self.model.execute(batch)


def toy_tokenizer() -> Tokenizer:
    """A word-level tokenizer over ids 0..VOCAB-1 ("t0 t1 ..."), no EOS."""
    vocab = {f"t{i}": i for i in range(VOCAB)}
    return Tokenizer(backend=HFTokenizer(models.WordLevel(vocab, unk_token="t0")),
                     eos_token_ids=[])


def make_engine(config: SchedulerConfig, num_blocks: int, block_size: int,
                max_model_len: int = 4096, prefix_caching: bool = True) -> EngineCore:
    """The real engine loop over the stand-in model (a copying one where drafts are made)."""
    runner = SlotRunner(block_size, copying=config.speculative_config is not None)
    engine = EngineCore(EngineConfig(
        model=ModelConfig(max_model_len=max_model_len),
        cache=CacheConfig(block_size=block_size, num_kv_blocks=num_blocks,
                          enable_prefix_caching=prefix_caching),
        scheduler=config), runner=runner)
    runner.engine = engine
    return engine
