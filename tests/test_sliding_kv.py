"""The sliding-window layers' KV group (core/kv_cache.py): a request holds only the blocks its
window still reaches, and none is lost.

The stand-in model (stand_in.py) writes every token into its slot in both groups and reads
each query's window back through the sliding table: a block freed too early, a wrong block,
a stale prefix hit or a botched preemption fails an assertion there or changes the tokens.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stand_in import SlotModel, SlotRunner, expected_output
from test_scheduler import workloads

from loom.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from loom.core.batch import ModelRunnerOutput, SchedulerOutput, SlidingKVGroup
from loom.core.kv_cache import KVCacheManager
from loom.engine.core import EngineCore
from loom.model.arch import ModelArch
from loom.model.memory import KVCacheSpec
from loom.outputs import RequestOutput
from loom.request import Request
from loom.sampling import SamplingParams

pytestmark = pytest.mark.unit


class SlidingSlotModel(SlotModel):
    """SlotModel with a sliding-window layer beside its full one: every token is written to
    its slot in the sliding group too, and every query (each fed position) reads its window,
    positions p - W + 1 .. p, back through the sliding table, which must hold exactly those
    blocks from the block its first query's window starts in, the null block before."""

    def __init__(self, block_size: int, group: SlidingKVGroup, copying: bool) -> None:
        super().__init__(block_size, copying)
        self.group = group
        self.sliding_slots: dict[int, tuple[int, int]] = {}

    def execute(self, batch: SchedulerOutput) -> ModelRunnerOutput:
        bs, window = self.block_size, self.group.window
        for item in batch.scheduled:
            if item.padding:
                continue
            assert len(item.sliding_block_ids) == len(item.block_ids)
            for i, token in enumerate(item.token_ids):
                position = item.start_position + i
                self.sliding_slots[self.slot(item.sliding_block_ids, position)] = (position,
                                                                                   token)
        for item in batch.scheduled:
            if item.padding:
                continue
            first_block = max(0, item.start_position - window + 1) // bs
            table = item.sliding_block_ids
            assert all(b == self.group.null_block for b in table[:first_block]), \
                "a block before the window is still held"
            assert self.group.null_block not in table[first_block:], "a window block was freed"
            history = {}  # what this step fed, by position (placeholders included)
            for i, token in enumerate(item.token_ids):
                history[item.start_position + i] = token
            for position in history:
                for p in range(max(0, position - window + 1), position + 1):
                    known = history[p] if p in history else \
                        self.slots[self.slot(item.block_ids, p)][1]
                    assert self.sliding_slots[self.slot(table, p)] == (p, known), \
                        "sliding KV read from a wrong slot"
        return super().execute(batch)


class SlidingSlotRunner(SlotRunner):
    def __init__(self, block_size: int, group: SlidingKVGroup, copying: bool = False) -> None:
        super().__init__(block_size, copying)
        self.model = SlidingSlotModel(block_size, group, copying)
        self.group = group

    def initialize_kv_cache(self, num_blocks: int) -> SlidingKVGroup:
        return self.group


def make_sliding_engine(config: SchedulerConfig, num_blocks: int, block_size: int,
                        group: SlidingKVGroup, max_model_len: int = 4096,
                        prefix_caching: bool = True) -> EngineCore:
    runner = SlidingSlotRunner(block_size, group, copying=config.speculative_config is not None)
    engine = EngineCore(EngineConfig(
        model=ModelConfig(max_model_len=max_model_len),
        cache=CacheConfig(block_size=block_size, num_kv_blocks=num_blocks,
                          enable_prefix_caching=prefix_caching),
        scheduler=config), runner=runner)
    runner.engine = engine
    return engine


def assert_nothing_held_out_of_window(kv: KVCacheManager) -> None:
    """No request holds a sliding block wholly before the window of its next token to
    compute, and the pool's references are exactly the tables' live entries."""
    held: dict[int, int] = {}
    for request_id, table in kv.sliding_tables.items():
        slid = kv.num_slid_out[request_id]
        assert all(b == kv.sliding.null_block for b in table[:slid])
        for b in table[slid:]:
            held[b] = held.get(b, 0) + 1
    for b in range(kv.sliding_pool.num_blocks):
        assert kv.sliding_pool.ref_cnt[b] == held.get(b, 0)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.integers(1, 24), st.data())
def test_random_workloads_with_a_sliding_group_hold_windows_and_lose_nothing(
        w: dict, window: int, data: st.DataObject) -> None:
    """The real engine loop (plain and overlapped, chunked or not, static or continuous,
    prefix caching on and off, drafts) on a model with a sliding layer: every query's window
    is read back right, no block outlives its window, the pool never holds more than
    blocks_needed, both pools end empty and every request's tokens are its own history's."""
    config: SchedulerConfig = w["config"]
    bs = w["block_size"]
    needed = SlidingKVGroup.blocks_needed(window, bs, config.max_num_seqs,
                                          config.max_num_batched_tokens)
    # down to what one request alone needs: the pool may run out, and then preempts
    alone = SlidingKVGroup.blocks_needed(window, bs, 1, config.max_num_batched_tokens)
    group = SlidingKVGroup(window, data.draw(st.integers(alone, needed)))
    engine = make_sliding_engine(config, w["num_blocks"], bs, group, w["max_model_len"],
                                 w["prefix_caching"])
    scheduler, kv = engine.scheduler, engine.kv_cache
    finished: dict[str, RequestOutput] = {}
    in_flight = None
    for step in range(3000):
        for spec in w["requests"]:
            if spec["arrive_at"] == step:
                engine.add_request(spec["request_id"], spec["prompt"], SamplingParams(
                    max_tokens=spec["max_tokens"], ignore_eos=True), spec["priority"])
            if spec["abort_at"] == step and spec["request_id"] in scheduler.requests:
                finished[spec["request_id"]] = engine.abort_request(spec["request_id"])
        outputs, in_flight = engine.step(in_flight)
        finished.update((o.request_id, o) for o in outputs if o.finished)
        assert kv.sliding_pool.num_blocks - kv.sliding_pool.num_free_blocks <= needed
        assert_nothing_held_out_of_window(kv)
        for request in scheduler.running:
            assert kv.num_slid_out[request.request_id] >= kv.first_window_block(
                request.num_computed_tokens)
        if step > 15 and not engine.has_unfinished_requests() and in_flight is None:
            break
    else:
        pytest.fail("requests were starved: the workload never finished")

    for pool in (kv.pool, kv.sliding_pool):
        assert pool.num_free_blocks == pool.num_blocks, "KV blocks leaked"
        assert all(c == 0 for c in pool.ref_cnt)
    assert not kv.sliding_tables and not kv.num_slid_out
    assert finished.keys() == {spec["request_id"] for spec in w["requests"]}
    for spec in w["requests"]:
        output = finished[spec["request_id"]].outputs[0]
        if output.finish_reason == "abort":
            continue
        assert output.finish_reason == "length"  # not "error": the model's checks passed
        allowed = min(spec["max_tokens"], w["max_model_len"] - len(spec["prompt"]))
        copying = config.speculative_config is not None
        assert output.token_ids == expected_output(spec["prompt"], allowed, copying)


def _request(request_id: str, tokens: list[int], max_tokens: int = 4) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_each_step_frees_exactly_the_blocks_that_slid_out() -> None:
    """block_size 4, W = 6 (allocate_slots' picture): after each chunk or decode the request
    holds the blocks from the one its next query's window starts in, and no other."""
    kv = KVCacheManager(64, 4, enable_prefix_caching=False, sliding=SlidingKVGroup(6, 16))
    request = _request("a", list(range(40)))
    null = kv.sliding.null_block
    held_after = []
    for num_new in (9, 6, 1, 1, 1, 1, 4, 17):
        assert kv.allocate_slots(request, num_new)
        table = kv.get_sliding_block_table("a")
        first = max(0, request.num_computed_tokens - 5) // 4  # the step's first query's window
        assert table[:first] == [null] * first and null not in table[first:]
        assert len(table) == len(kv.get_block_table("a")) == -(-(request.num_computed_tokens
                                                                  + num_new) // 4)
        request.num_computed_tokens += num_new
        kv.slide(request, request.num_computed_tokens)
        held_after.append(len(table) - table.count(null))
        assert kv.sliding_pool.num_free_blocks == 16 - held_after[-1]
    # (W - 1) / 4 rounded up + 1 = 3 at most once a step is computed, whatever came before
    assert max(held_after) <= 3 and held_after[-1] == 2  # 39 computed: blocks 8 and 9
    kv.free(request)
    assert kv.sliding_pool.num_free_blocks == 16 and kv.pool.num_free_blocks == 64


def test_a_long_request_holds_a_window_of_sliding_blocks_not_its_context() -> None:
    """A 4,000-token conversation on a window of 64: the full group holds its 250 blocks, the
    sliding group 5 at most after any step (ceil(63 / 16) + 1)."""
    kv = KVCacheManager(300, 16, enable_prefix_caching=True, sliding=SlidingKVGroup(64, 40))
    request = _request("a", list(range(3000)), max_tokens=1000)
    most = 0
    while request.num_computed_tokens < 3000:
        num_new = min(512, 3000 - request.num_computed_tokens)
        assert kv.allocate_slots(request, num_new)
        request.num_computed_tokens += num_new
        kv.cache_blocks(request, request.num_computed_tokens)
        kv.slide(request, request.num_computed_tokens)
        most = max(most, 40 - kv.sliding_pool.num_free_blocks)
    for token in range(1000):
        request.output_token_ids.append(token)
        assert kv.allocate_slots(request, 1)
        request.num_computed_tokens += 1
        kv.slide(request, request.num_computed_tokens)
        most = max(most, 40 - kv.sliding_pool.num_free_blocks)
    assert len(kv.get_block_table("a")) == 250
    assert most <= 5


def test_a_prefix_is_served_only_as_far_as_its_window_is_still_cached() -> None:
    """A hit needs the sliding blocks its first query's window reads; where one was evicted
    the hit stops at the last point whose window is whole."""
    kv = KVCacheManager(64, 4, enable_prefix_caching=True, sliding=SlidingKVGroup(6, 8))
    first = _request("a", list(range(24)))
    assert kv.allocate_slots(first, 24)
    first.num_computed_tokens = 24
    kv.cache_blocks(first, 24)
    sliding = list(kv.get_sliding_block_table("a"))
    kv.free(first)
    again = _request("b", list(range(24)) + [99])
    hit = kv.find_cached_prefix(again)
    assert len(hit) == 6  # 24 tokens: every window is there
    kv.sliding_pool.evict(sliding[4])  # positions 16-19: the window of 24 reads 19 ..
    assert len(kv.find_cached_prefix(again)) == 4  # the window of 16 reads 11 .. 15: blocks 2, 3
    assert kv.allocate_slots(again, 9, kv.find_cached_prefix(again))
    table = kv.get_sliding_block_table("b")
    assert table[:2] == [kv.sliding.null_block] * 2 and table[2:4] == sliding[2:4]
    assert kv.sliding_pool.ref_cnt[sliding[2]] == 1  # revived from the cache


def test_a_preempted_sliding_request_recomputes_the_same_tokens() -> None:
    """Two requests growing past their windows in too few full blocks: the later one is
    preempted (both groups freed) and recomputed, and both give their own history's tokens."""
    config = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=2)
    engine = make_sliding_engine(config, 10, 2, SlidingKVGroup(3, 40), prefix_caching=False)
    engine.add_request("first", [1, 2, 3, 4, 5], SamplingParams(max_tokens=8, ignore_eos=True))
    engine.add_request("second", [6, 7, 8], SamplingParams(max_tokens=8, ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step()[0] if o.finished)
    assert engine.scheduler.num_preemptions >= 1
    assert finished["first"].outputs[0].token_ids == expected_output([1, 2, 3, 4, 5], 8)
    assert finished["second"].outputs[0].token_ids == expected_output([6, 7, 8], 8)
    assert engine.kv_cache.sliding_pool.num_free_blocks == 40


def _arch(layer_types: tuple[str, ...], window: int | None) -> ModelArch:
    return ModelArch(architecture="gemma3", hidden_size=256, intermediate_size=512,
                     num_layers=len(layer_types), num_heads=4, num_kv_heads=1, head_dim=64,
                     vocab_size=1000, rms_norm_eps=1e-6, rope_theta=1e4,
                     max_position_embeddings=32768, tie_word_embeddings=True,
                     attention_bias=False, layer_types=layer_types, sliding_window=window)


GEMMA3_LIKE = ("sliding_attention",) * 5 + ("full_attention",)  # five local layers per global


def test_the_budget_gives_the_sliding_layers_their_windows_and_the_rest_to_full_layers() -> None:
    spec = KVCacheSpec.for_model(_arch(GEMMA3_LIKE * 2, 512), dtype_bytes=2)
    assert (spec.num_layers, spec.num_sliding_layers, spec.sliding_window) == (12, 10, 512)
    budget = 2**30
    layout = spec.layout(16, 8192, max_num_seqs=32, max_num_batched_tokens=2048,
                         budget_bytes=budget)
    assert layout.num_sliding_blocks == SlidingKVGroup.blocks_needed(512, 16, 32, 2048)
    assert layout.full_bytes_per_block == 2 * 2 * 64 * 2 * 16  # two full layers' K and V
    assert layout.full_bytes + layout.sliding_bytes <= budget
    assert budget - layout.full_bytes - layout.sliding_bytes < layout.full_bytes_per_block
    uniform = spec.num_blocks(budget, 16)  # every layer keeping the whole context
    assert layout.num_blocks > 5 * uniform  # the full pool holds 5x+ more context
    assert layout.sliding_group == SlidingKVGroup(512, layout.num_sliding_blocks)


def test_a_budget_too_small_for_every_window_sizes_both_groups_alike() -> None:
    spec = KVCacheSpec.for_model(_arch(GEMMA3_LIKE, 512), dtype_bytes=2)
    budget = 50 * spec.bytes_per_block(16)
    layout = spec.layout(16, 8192, 128, 2048, budget_bytes=budget)
    assert layout.num_blocks == layout.num_sliding_blocks == 50
    given = spec.layout(16, 8192, 128, 2048, num_blocks=10_000)
    assert (given.num_blocks, given.num_sliding_blocks) == (
        10_000, SlidingKVGroup.blocks_needed(512, 16, 128, 2048))


def test_without_full_layers_the_budget_is_the_sliding_pools() -> None:
    """Mistral with sliding_window on every layer: the full group is bookkeeping only (no
    memory), as many blocks as max_num_seqs requests of max_model_len."""
    spec = KVCacheSpec.for_model(_arch(("sliding_attention",) * 4, 4096), dtype_bytes=2)
    budget = 2**30
    layout = spec.layout(16, 32768, 8, 2048, budget_bytes=budget)
    assert layout.full_bytes_per_block == 0 and layout.num_blocks == 8 * 2048
    assert layout.num_sliding_blocks == SlidingKVGroup.blocks_needed(4096, 16, 8, 2048)
    small = spec.layout(16, 32768, 8, 2048, budget_bytes=100 * spec.bytes_per_block(16))
    assert small.num_sliding_blocks == 100


def test_a_window_as_long_as_the_context_keeps_one_group() -> None:
    spec = KVCacheSpec.for_model(_arch(GEMMA3_LIKE, 4096), dtype_bytes=2)
    layout = spec.layout(16, 4096, 8, 2048, budget_bytes=2**28)
    assert layout.sliding_group is None
    assert layout.num_blocks == spec.num_blocks(2**28, 16)
    full = KVCacheSpec.for_model(_arch(("full_attention",) * 6, None), dtype_bytes=2)
    assert full.num_sliding_layers == 0 and not full.keeps_sliding_group(4096)
