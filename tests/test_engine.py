"""The engine end to end on the real bundled model: scheduling choices must not change
greedy outputs, and every request-level option must do what it says."""

from __future__ import annotations

import collections

import pytest

from loom import LLM, SamplingParams
from loom.model.arch import ModelLoadError

pytestmark = pytest.mark.integration

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.\n",
    "def fibonacci(n):\n    ",
    "1, 2, 3, 4, 5, 6,",
    "A long time ago, in a small village by the mountains, there lived an old clockmaker "
    "who repaired every clock in the valley. One winter morning",
    "Q: What is 17 times 3?\nA:",
]


NGRAM = ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, '
         '"prompt_lookup_min": 1}')


def run_all(engine) -> list:
    """Every output until nothing is unfinished or in flight, as a server's loop drives it."""
    outputs, in_flight = [], None
    while engine.has_unfinished_requests() or in_flight is not None:
        step_outputs, in_flight = engine.step(in_flight)
        outputs += step_outputs
    return outputs


def greedy(max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(llm: LLM) -> list[list[int]]:
    """Greedy tokens of each prompt run alone."""
    return [llm.generate(p, greedy())[0].outputs[0].token_ids for p in PROMPTS]


@pytest.fixture(scope="module", params=["sync", "async"])
def any_llm(request, llm: LLM) -> LLM:
    """The shared engine, and one that schedules a step ahead of the model: both must give
    the same answers."""
    if request.param == "sync":
        return llm
    return LLM(kv_cache_memory="256MiB", max_model_len=2048, async_scheduling=True,
               dtype="float32")


def test_native_decode_attention_is_the_cpu_default(llm: LLM) -> None:
    assert llm.engine.runner.native_decode


def test_answers_the_capital_of_france(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=32, temperature=0.0))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"


def test_batch_composition_does_not_change_greedy_output(any_llm: LLM, reference) -> None:
    outs = any_llm.generate(PROMPTS, greedy())
    assert [o.outputs[0].token_ids for o in outs] == reference


@pytest.mark.parametrize("options", [
    dict(scheduler="static", max_num_seqs=2),
    dict(max_num_seqs=3, max_num_batched_tokens=16),  # tiny budget: chunked prefill everywhere
    dict(num_kv_blocks=12, max_num_seqs=6, enable_prefix_caching=False),  # forces preemption
    dict(enable_chunked_prefill=False, max_num_batched_tokens=2048),
    dict(async_scheduling=True, max_num_seqs=3, max_num_batched_tokens=16),
    dict(async_scheduling=True, num_kv_blocks=12, max_num_seqs=6, enable_prefix_caching=False),
    dict(async_scheduling=True, scheduler="static", max_num_seqs=2),
    dict(attention_backend="torch"),  # the reference runs the native kernel
    dict(speculative_config=NGRAM),
    dict(speculative_config=NGRAM, num_kv_blocks=12, max_num_seqs=6,
         enable_prefix_caching=False),
    dict(speculative_config=NGRAM, attention_backend="torch"),
], ids=["static", "chunked", "preemption", "no-chunking", "async-chunked", "async-preemption",
        "async-static", "torch-attention", "ngram-speculation", "ngram-preemption",
        "ngram-torch-attention"])
def test_scheduler_settings_do_not_change_greedy_output(options, reference) -> None:
    llm = LLM(max_model_len=2048, kv_cache_memory="128MiB", dtype="float32", **options)
    outs = llm.generate(PROMPTS, greedy())
    assert [o.outputs[0].token_ids for o in outs] == reference
    if "speculative_config" in options:  # the model repeats itself: some drafts must be kept
        assert llm.get_metrics()["loom:spec_decode_num_accepted_tokens_total"] > 0
    preemptions = llm.get_metrics()["loom:num_preemptions_total"]
    if "num_kv_blocks" in options:
        assert preemptions > 0
        assert sum(o.metrics.num_preemptions for o in outs) == preemptions
    assert llm.engine.kv_cache.pool.usage == 0.0


def test_prefix_cache_hits_keep_outputs_identical(any_llm: LLM) -> None:
    shared = "You are a careful assistant. Answer briefly and cite the document. " * 6
    prompts = [shared + q for q in ("What is loom?", "Who wrote it?", "Why batch?")]
    first = any_llm.generate(prompts[0], greedy(8))[0]
    before = any_llm.get_metrics()["loom:prefix_cache_hits_total"]
    outs = any_llm.generate(prompts, greedy(8))
    assert any_llm.get_metrics()["loom:prefix_cache_hits_total"] - before >= 3 * 64
    assert outs[0].outputs[0].token_ids == first.outputs[0].token_ids
    assert all(o.num_cached_tokens > 0 for o in outs)
    uncached = LLM(enable_prefix_caching=False, max_model_len=2048,
                   kv_cache_memory="128MiB", dtype="float32").generate(prompts, greedy(8))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in uncached]


def test_requests_sent_together_share_a_prefix_computed_in_their_first_step(
        any_llm: LLM) -> None:
    shared = "Document 7: the clockmaker's ledger lists every repair of the winter. " * 6
    prompts = [shared + q for q in ("Who paid?", "What broke?", "When?")]
    before = any_llm.get_metrics()["loom:prefix_cache_hits_total"]
    outs = any_llm.generate(prompts, greedy(8))  # one step: nothing was cached before it
    assert any_llm.get_metrics()["loom:prefix_cache_hits_total"] - before >= 2 * 64
    assert [o.num_cached_tokens > 0 for o in outs] == [False, True, True]
    uncached = LLM(enable_prefix_caching=False, max_model_len=2048,
                   kv_cache_memory="128MiB", dtype="float32").generate(prompts, greedy(8))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in uncached]


def test_seeded_sampling_draws_its_own_numbers_whatever_shares_the_batch(any_llm: LLM) -> None:
    """The seeded request's text alone and in a crowd: its draws are its own. (Its logits can
    move in their last bits with the batch, sampler.py says why, which would turn a draw that
    lands at a boundary between two tokens; these prompts have none.) A seed that differs only
    above 32 bits draws other numbers."""
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=7)
    alone = any_llm.generate("Once upon a time", seeded)[0].outputs[0].token_ids
    crowd = any_llm.generate(["Once upon a time", *PROMPTS],
                         [seeded] + [SamplingParams(max_tokens=16, temperature=1.0)] * 6)
    assert crowd[0].outputs[0].token_ids == alone
    for seed in (8, 7 + 2**32):
        other = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=seed)
        assert any_llm.generate("Once upon a time", other)[0].outputs[0].token_ids != alone


def test_stop_strings_are_cut_from_the_text(any_llm: LLM) -> None:
    full = any_llm.generate("1, 2, 3, 4, 5, 6,", greedy(20))[0].outputs[0].text
    assert " 9," in full
    out = any_llm.generate("1, 2, 3, 4, 5, 6,", SamplingParams(max_tokens=20, temperature=0.0,
                                                            stop=[" 9", "never"]))[0].outputs[0]
    assert out.text == full[:full.index(" 9")]
    assert out.finish_reason == "stop" and out.stop_reason == " 9"


def test_stop_token_ids_min_tokens_and_max_tokens(any_llm: LLM) -> None:
    base = any_llm.generate("1, 2, 3, 4, 5, 6,", greedy(10))[0].outputs[0].token_ids
    stop_id = base[3]
    out = any_llm.generate("1, 2, 3, 4, 5, 6,", SamplingParams(
        max_tokens=10, temperature=0.0, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == base[:base.index(stop_id) + 1] and out.stop_reason == stop_id
    chat = [{"role": "user", "content": "Say hi."}]
    short = any_llm.chat(chat, SamplingParams(max_tokens=64, temperature=0.0))[0].outputs[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 64  # ends on EOS
    forced = any_llm.chat(chat, SamplingParams(max_tokens=64, min_tokens=len(short.token_ids) + 5,
                                           temperature=0.0))[0].outputs[0]
    assert len(forced.token_ids) >= len(short.token_ids) + 5
    # EOS is never sampled before min_tokens (vLLM's rule): the answer goes on, not past an end
    eos = set(any_llm.tokenizer.eos_token_ids)
    assert not eos & set(forced.token_ids[:len(short.token_ids) + 4])
    capped = any_llm.generate("Hello", greedy(5))[0].outputs[0]
    assert len(capped.token_ids) == 5 and capped.finish_reason == "length"


def test_logit_bias_and_penalties_steer_the_tokens(any_llm: LLM) -> None:
    """logit_bias forces a token (greedy and sampled); penalties counting the tokens
    generated so far break a loop that plain greedy decoding stays in, and a request without
    them, in the same batch, keeps its own answer."""
    comma = any_llm.tokenizer.encode(",", add_special_tokens=False)[0]
    for temperature in (0.0, 1.0):
        forced = any_llm.generate("Once upon a time", SamplingParams(
            max_tokens=6, temperature=temperature, logit_bias={comma: 100.0}))[0].outputs[0]
        assert forced.token_ids == [comma] * 6
    loop = "1 1 1 1 1 1 1 1 1 1"
    plain, penalized, repeated = any_llm.generate([loop] * 3, [
        greedy(10), SamplingParams(max_tokens=10, temperature=0.0, frequency_penalty=2.0),
        SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.5)])
    assert collections.Counter(plain.outputs[0].token_ids).most_common(1)[0][1] >= 5
    for out in (penalized, repeated):
        assert collections.Counter(out.outputs[0].token_ids).most_common(1)[0][1] <= 3
    assert plain.outputs[0].token_ids == any_llm.generate(loop, greedy(10))[0].outputs[0].token_ids


def test_logprobs_match_the_greedy_choice(any_llm: LLM) -> None:
    out = any_llm.generate("The capital of France is", SamplingParams(
        max_tokens=4, temperature=0.0, logprobs=3, prompt_logprobs=2))[0]
    for entry, token_id in zip(out.outputs[0].logprobs, out.outputs[0].token_ids):
        assert entry.token_id == token_id
        assert entry.top[0][0] == token_id and entry.logprob == pytest.approx(entry.top[0][1])
    assert out.prompt_logprobs[0] is None
    assert [e.token_id for e in out.prompt_logprobs[1:]] == out.prompt_token_ids[1:]
    assert all(e.logprob <= 0 for e in out.prompt_logprobs[1:])


def test_abort_returns_blocks_and_others_keep_running(any_llm: LLM) -> None:
    engine = any_llm.engine
    engine.add_request("keep", "Hello there", greedy(6))
    engine.add_request("drop", "Tell me everything about the ocean", greedy(200))
    _, in_flight = engine.step()
    _, in_flight = engine.step(in_flight)
    aborted = engine.abort_request("drop")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    done = []
    while engine.has_unfinished_requests() or in_flight is not None:
        outputs, in_flight = engine.step(in_flight)
        done += [o for o in outputs if o.finished]
    assert [o.request_id for o in done] == ["keep"] and len(done[0].outputs[0].token_ids) == 6
    assert engine.kv_cache.pool.usage == 0.0
    assert any_llm.get_metrics()["loom:request_success_total{finished_reason=abort}"] >= 1


def test_bad_requests_fail_alone_with_clear_errors(any_llm: LLM) -> None:
    engine = any_llm.engine
    engine.add_request("good", "Hello", greedy(3))
    with pytest.raises(ValueError, match="max_model_len is 2048"):
        engine.add_request("too-long", [5] * 2048, greedy(3))
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("empty", [], greedy(3))
    with pytest.raises(ValueError, match="duplicate request id"):
        engine.add_request("good", "Hello", greedy(3))
    outputs = run_all(engine)
    assert outputs[-1].request_id == "good" and len(outputs[-1].outputs[0].token_ids) == 3


def test_unknown_model_and_options_are_rejected() -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(model="/nonexistent/model.gguf")
    with pytest.raises(TypeError, match="unknown engine option"):
        LLM(max_num_seq=4)
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        LLM(max_num_seqs=0)


def test_get_metrics_reports_the_documented_names(llm: LLM) -> None:
    llm.generate("Hi", greedy(2))
    metrics = llm.get_metrics()
    for name in ("loom:num_preemptions_total", "loom:prompt_tokens_total",
                 "loom:generation_tokens_total", "loom:num_requests_running",
                 "loom:num_requests_waiting", "loom:kv_cache_usage_perc"):
        assert name in metrics
    assert metrics["loom:generation_tokens_total"] >= 2


def test_a_request_whose_step_throws_fails_alone(any_llm: LLM, reference, monkeypatch) -> None:
    engine = any_llm.engine
    real_execute = engine.runner.execute

    def execute(batch):
        if any(item.request_id == "poisoned" for item in batch.scheduled):
            raise RuntimeError("sampling blew up")
        return real_execute(batch)

    monkeypatch.setattr(engine.runner, "execute", execute)
    engine.add_request("healthy", PROMPTS[0], greedy())
    engine.add_request("poisoned", PROMPTS[1], greedy())
    finished = {o.request_id: o for o in run_all(engine) if o.finished}
    assert finished["poisoned"].outputs[0].finish_reason == "error"
    assert "sampling blew up" in finished["poisoned"].error
    assert finished["healthy"].outputs[0].token_ids == reference[0]
    assert engine.kv_cache.pool.usage == 0.0


def test_a_request_that_shared_a_failed_requests_prefix_is_recomputed(
        any_llm: LLM, monkeypatch) -> None:
    engine = any_llm.engine
    real_execute = engine.runner.execute
    shared = "Appendix B of the maintenance manual, copied for every question. " * 6

    def execute(batch):
        if any(item.request_id == "owner" for item in batch.scheduled):
            raise RuntimeError("forward pass blew up")
        return real_execute(batch)

    expected = any_llm.generate(shared + "And the second?", greedy(8))[0].outputs[0].token_ids
    any_llm.engine.kv_cache.pool.reset_prefix_cache()
    monkeypatch.setattr(engine.runner, "execute", execute)
    engine.add_request("owner", shared + "First question?", greedy(8))
    engine.add_request("sharer", shared + "And the second?", greedy(8))
    finished = {o.request_id: o for o in run_all(engine) if o.finished}
    assert finished["owner"].outputs[0].finish_reason == "error"
    # The sharer found the owner's blocks in the failed step, which never wrote them.
    assert finished["sharer"].outputs[0].token_ids == expected
    assert engine.kv_cache.pool.usage == 0.0


def test_sampling_values_beyond_the_vocabulary_are_refused_offline_too(llm: LLM) -> None:
    with pytest.raises(ValueError, match="top_k"):
        llm.generate("Hi", SamplingParams(top_k=10**6))
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate("Hi", SamplingParams(stop_token_ids=[10**6]))
    assert llm.generate("Hi", greedy(2))[0].outputs[0].finish_reason == "length"
