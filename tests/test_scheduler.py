"""Scheduler + KV cache driven by a stand-in model that checks every KV read (stand_in.py).

The property tests run the real `EngineCore` step loop (plain and overlapped, with and without
speculative decoding) with `SlotRunner` in place of the model runner.
"""

from __future__ import annotations

import json
import logging

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stand_in import (
    VOCAB,
    SlotModel,
    check_limits,
    expected_output,
    make_engine,
)

from loom.config import SchedulerConfig
from loom.core.batch import ModelRunnerOutput, SchedulerOutput
from loom.core.kv_cache import KVCacheManager
from loom.core.scheduler import Scheduler
from loom.core.static import StaticScheduler
from loom.outputs import RequestOutput
from loom.request import Request, RequestStatus
from loom.sampling import SamplingParams

pytestmark = pytest.mark.unit


def make(config: SchedulerConfig, num_blocks: int, block_size: int, max_model_len: int = 4096,
         prefix_caching: bool = True) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, prefix_caching)
    cls = StaticScheduler if config.scheduler == "static" else Scheduler
    return cls(config, kv, max_model_len)

def add(scheduler: Scheduler, request_id: str, prompt: list[int], max_tokens: int,
        priority: int = 0) -> Request:
    request = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                      priority=priority)
    scheduler.add_request(request)
    return request

def run_step(scheduler: Scheduler, model: SlotModel) -> SchedulerOutput:
    batch = scheduler.schedule()
    check_limits(scheduler, batch)
    scheduler.update(batch, model.execute(batch))
    return batch


@st.composite
def workloads(draw: st.DrawFn) -> dict:
    chunked = draw(st.booleans())
    budget = draw(st.integers(4, 48))
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(8, 60)) if chunked else budget
    prefixes = [draw(st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=20))
                for _ in range(2)]
    requests = []
    for i in range(draw(st.integers(1, 10))):
        prefix = draw(st.sampled_from(prefixes))
        tail = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30))
        prompt = (prefix + tail)[:max_model_len - 1]
        requests.append(dict(
            request_id=f"r{i}", prompt=prompt, max_tokens=draw(st.integers(1, 20)),
            priority=draw(st.integers(0, 3)), arrive_at=draw(st.integers(0, 15)),
            abort_at=draw(st.one_of(st.none(), st.integers(0, 40)))))
    async_scheduling = draw(st.booleans())
    speculative = None if async_scheduling else draw(st.one_of(st.none(), st.builds(
        lambda k, low, extra: json.dumps({"method": "ngram", "num_speculative_tokens": k,
                                          "prompt_lookup_min": low,
                                          "prompt_lookup_max": low + extra}),
        st.integers(1, 5), st.integers(1, 3), st.integers(0, 2))))
    longest = max(min(len(r["prompt"]) + r["max_tokens"], max_model_len) for r in requests)
    min_blocks = -(-longest // block_size)
    return dict(
        config=SchedulerConfig(
            max_num_batched_tokens=budget, max_num_seqs=draw(st.integers(1, min(6, budget))),
            enable_chunked_prefill=chunked,
            scheduler=draw(st.sampled_from(["continuous", "static"])),
            scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
            async_scheduling=async_scheduling, speculative_config=speculative),
        block_size=block_size, max_model_len=max_model_len,
        num_blocks=draw(st.integers(min_blocks, min_blocks + 12)),
        prefix_caching=draw(st.booleans()), requests=requests)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_finish_correctly_without_leaks(w: dict) -> None:
    engine = make_engine(w["config"], w["num_blocks"], w["block_size"], w["max_model_len"],
                         w["prefix_caching"])
    scheduler = engine.scheduler
    finished: dict[str, RequestOutput] = {}
    in_flight = None
    for step in range(3000):
        for spec in w["requests"]:
            if spec["arrive_at"] == step:
                engine.add_request(spec["request_id"], spec["prompt"], SamplingParams(
                    max_tokens=spec["max_tokens"], ignore_eos=True), spec["priority"])
            if spec["abort_at"] == step and spec["request_id"] in scheduler.requests:
                finished[spec["request_id"]] = engine.abort_request(spec["request_id"])
        if isinstance(scheduler, StaticScheduler):
            assert {r.request_id for r in scheduler.running} <= scheduler.batch_ids
            assert len(scheduler.batch_ids) <= w["config"].max_num_seqs
            assert len(scheduler.running) + len(scheduler.padding) <= w["config"].max_num_seqs
        outputs, in_flight = engine.step(in_flight)
        finished.update((o.request_id, o) for o in outputs if o.finished)
        if step > 15 and not engine.has_unfinished_requests() and in_flight is None:
            break
    else:
        pytest.fail("requests were starved: the workload never finished")

    pool = scheduler.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks, "KV blocks leaked"
    assert all(c == 0 for c in pool.ref_cnt)
    assert not scheduler.kv_cache.block_tables
    assert finished.keys() == {spec["request_id"] for spec in w["requests"]}
    for spec in w["requests"]:
        output = finished[spec["request_id"]].outputs[0]
        if output.finish_reason == "abort":
            assert spec["abort_at"] is not None
            continue
        allowed = min(spec["max_tokens"], w["max_model_len"] - len(spec["prompt"]))
        assert output.finish_reason == "length"
        copying = w["config"].speculative_config is not None
        assert output.token_ids == expected_output(spec["prompt"], allowed, copying)


def test_decodes_are_scheduled_before_new_prefills_and_long_prompts_are_chunked() -> None:
    scheduler = make(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4), 64, 4)
    model = SlotModel(4)
    add(scheduler, "a", [1, 2, 3], 5)
    run_step(scheduler, model)  # a's prefill; a now decodes
    add(scheduler, "b", list(range(20)), 2)
    batch = run_step(scheduler, model)
    assert [(s.request_id, len(s.token_ids)) for s in batch.scheduled] == [("a", 1), ("b", 7)]
    batch = run_step(scheduler, model)
    assert [(s.request_id, len(s.token_ids)) for s in batch.scheduled] == [("a", 1), ("b", 7)]
    assert not batch.scheduled[1].sample  # 14 of 20 prompt tokens done: nothing to sample yet


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_prefix_computed_in_this_step_serves_requests_admitted_after_it(
        async_scheduling: bool) -> None:
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4,
                             async_scheduling=async_scheduling)
    engine = make_engine(config, 64, 4)
    prefix = list(range(100, 112))  # three full blocks
    engine.add_request("first", prefix + [1, 2], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request("second", prefix + [3], SamplingParams(max_tokens=3, ignore_eos=True))
    batches: list[SchedulerOutput] = []
    execute = engine.runner.execute
    engine.runner.execute = lambda batch: (batches.append(batch), execute(batch))[1]
    finished, in_flight = {}, None
    while engine.has_unfinished_requests() or in_flight is not None:
        outputs, in_flight = engine.step(in_flight)
        finished.update((o.request_id, o) for o in outputs if o.finished)
    first_step = batches[0].scheduled
    assert [(s.request_id, len(s.token_ids)) for s in first_step] == [("first", 14),
                                                                      ("second", 1)]
    assert finished["second"].num_cached_tokens == 12
    assert first_step[1].block_ids[:3] == first_step[0].block_ids[:3]
    assert finished["first"].outputs[0].token_ids == expected_output(prefix + [1, 2], 3)
    assert finished["second"].outputs[0].token_ids == expected_output(prefix + [3], 3)


def test_the_engine_stops_at_any_of_the_models_eos_ids() -> None:
    """A model may name several EOS tokens (Llama-3.x-Instruct: <|end_of_text|> and
    <|eot_id|>); whichever is sampled ends the request, reported as EOS (no stop_reason)."""
    prompt = [1, 2, 3]
    second_eos = expected_output(prompt, 2)[1]
    engine = make_engine(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4), 64, 4)
    engine.tokenizer.eos_token_ids[:] = [VOCAB + 1, second_eos]
    engine.add_request("r", prompt, SamplingParams(max_tokens=10))
    outputs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outputs += engine.step()[0]
    final = outputs[-1].outputs[0]
    assert final.token_ids == expected_output(prompt, 2)
    assert (final.finish_reason, final.stop_reason) == ("stop", None)


def test_a_failed_request_withdraws_the_prefix_it_was_computing() -> None:
    scheduler = make(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4), 64, 4)
    model = SlotModel(4)
    prefix = list(range(100, 112))
    first = add(scheduler, "first", prefix + [1, 2], 3)
    second = add(scheduler, "second", prefix + [3], 3)
    batch = scheduler.schedule()
    assert second.num_cached_tokens == 12
    # The step throws and first fails alone: its blocks were never written, so second, which
    # found them, must recompute rather than read them (the model asserts on a stale slot).
    scheduler.fail_request("first")
    assert first.status == RequestStatus.FINISHED_ERROR
    assert second.status == RequestStatus.PREEMPTED
    assert scheduler.kv_cache.find_cached_prefix(second) == []
    scheduler.update(batch, ModelRunnerOutput())
    while scheduler.has_unfinished_requests():
        run_step(scheduler, model)
    assert second.output_token_ids == expected_output(prefix + [3], 3)
    assert scheduler.kv_cache.pool.num_free_blocks == 64


def test_without_chunked_prefill_a_prompt_runs_whole_or_waits() -> None:
    config = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4,
                             enable_chunked_prefill=False)
    scheduler = make(config, 64, 4, max_model_len=16)
    model = SlotModel(4)
    add(scheduler, "a", [1, 2, 3], 3)
    run_step(scheduler, model)
    add(scheduler, "b", list(range(8)), 1)  # 8 tokens do not fit next to a's decode token
    steps = [[(s.request_id, len(s.token_ids)) for s in run_step(scheduler, model).scheduled]
             for _ in range(3)]
    assert steps == [[("a", 1)], [("a", 1)], [("b", 8)]]
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        add(scheduler, "c", list(range(9)), 1)


def test_priority_policy_admits_lowest_value_first() -> None:
    config = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=1,
                             scheduling_policy="priority")
    scheduler = make(config, 64, 4)
    model = SlotModel(4)
    for priority in [2, 0, 1]:
        add(scheduler, f"p{priority}", [5, 6, 7], 1, priority=priority)
    order = [run_step(scheduler, model).scheduled[0].request_id for _ in range(3)]
    assert order == ["p0", "p1", "p2"]


def test_preemption_recomputes_the_latest_arrival_and_logs_it(caplog) -> None:
    # 6 blocks of 2 tokens: two requests growing to 8 tokens each cannot both fit.
    scheduler = make(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=2), 6, 2,
                     prefix_caching=False)
    model = SlotModel(2)
    first = add(scheduler, "first", [1, 2, 3], 5)
    second = add(scheduler, "second", [4, 5, 6], 5)
    with caplog.at_level(logging.WARNING):
        while scheduler.has_unfinished_requests():
            run_step(scheduler, model)
    assert second.num_preemptions >= 1 and first.num_preemptions == 0
    assert scheduler.num_preemptions == second.num_preemptions
    assert "PreemptionMode.RECOMPUTE" in caplog.text
    assert first.output_token_ids == expected_output([1, 2, 3], 5)
    assert second.output_token_ids == expected_output([4, 5, 6], 5)


def test_admission_keeps_room_for_the_token_a_prompt_samples() -> None:
    """3 blocks of 4. "second"'s 4 tokens end a block, so the token it samples needs a block
    of its own: it waits for one instead of taking the last block and being, the latest
    arrival, its own preemption victim the step after (with async scheduling a re-admitted
    request did that step after step)."""
    scheduler = make(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4), 3, 4,
                     prefix_caching=False)
    model = SlotModel(4)
    first = add(scheduler, "first", [1, 2, 3, 4, 5], 3)
    second = add(scheduler, "second", [6, 7, 8, 9], 3)
    assert [s.request_id for s in run_step(scheduler, model).scheduled] == ["first"]
    while scheduler.has_unfinished_requests():
        run_step(scheduler, model)
    assert scheduler.num_preemptions == 0
    assert first.output_token_ids == expected_output([1, 2, 3, 4, 5], 3)
    assert second.output_token_ids == expected_output([6, 7, 8, 9], 3)


def test_static_batch_admits_nobody_until_the_whole_batch_is_done() -> None:
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=2, scheduler="static")
    scheduler = make(config, 64, 4)
    model = SlotModel(4)
    add(scheduler, "short", [1], 1)
    add(scheduler, "long", [2], 6)
    add(scheduler, "next", [3], 1)
    admitted_at, padded_at = {}, []
    for step in range(10):
        for s in run_step(scheduler, model).scheduled:
            admitted_at.setdefault(s.request_id, step)
            if s.padding:
                padded_at.append((s.request_id, step))
    # "short" finishes at step 0, but "next" waits until "long" (6 tokens) is done too, and
    # meanwhile "short" keeps its slot busy with padding, as in a padded fixed batch.
    assert admitted_at == {"short": 0, "long": 0, "next": 6}
    assert padded_at == [("short", step) for step in range(1, 6)]


def test_requests_that_can_never_fit_are_refused_up_front() -> None:
    scheduler = make(SchedulerConfig(), num_blocks=2, block_size=4, max_model_len=32)
    with pytest.raises(ValueError, match="whole cache holds 2 blocks"):
        add(scheduler, "big", list(range(6)), 10)
    with pytest.raises(ValueError, match="max_model_len is 32"):
        add(scheduler, "long", list(range(32)), 1)
