"""Structured outputs on the offline engine: every constrained answer of the bundled model parses
and validates, greedy and sampled; unconstrained neighbours are untouched; bad specs fail early
naming the problem; preemption, async scheduling and speculative decoding keep the matcher
right."""

from __future__ import annotations

import json
import math
from concurrent.futures import Future
from dataclasses import dataclass

import jsonschema
import pytest

from loom import LLM, SamplingParams
from loom.sampling import MAX_CHOICES, SamplingParamsError, StructuredOutputsParams
from loom.structured.grammar import StructuredOutputsError, grammar_for

CHAT = "Describe a {} as JSON."

# Held back from the engine's own tuning: nested objects, arrays, enums, bounded numbers,
# required fields. Strings and arrays are bounded so no answer can run out of tokens.
SCHEMAS = {
    "person": {"type": "object", "additionalProperties": False,
               "required": ["name", "age", "email"],
               "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 20},
                              "age": {"type": "integer", "minimum": 0, "maximum": 120},
                              "email": {"type": "string", "maxLength": 30}}},
    "order": {"type": "object", "additionalProperties": False, "required": ["id", "lines"],
              "properties": {
                  "id": {"type": "integer", "minimum": 1000, "maximum": 9999},
                  "lines": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                      "type": "object", "additionalProperties": False,
                      "required": ["sku", "qty"],
                      "properties": {"sku": {"enum": ["A1", "B2", "C3"]},
                                     "qty": {"type": "integer", "minimum": 1,
                                             "maximum": 9}}}}}},
    "reading": {"type": "object", "additionalProperties": False,
                "required": ["sensor", "celsius", "ok"],
                "properties": {"sensor": {"enum": ["north", "south"]},
                               "celsius": {"type": "number", "minimum": -40, "maximum": 60},
                               "ok": {"type": "boolean"},
                               "tags": {"type": "array", "maxItems": 2,
                                        "items": {"type": "string", "maxLength": 8}}}},
    "nested": {"type": "object", "additionalProperties": False, "required": ["book"],
               "properties": {"book": {
                   "type": "object", "additionalProperties": False,
                   "required": ["title", "author", "year"],
                   "properties": {"title": {"type": "string", "maxLength": 24},
                                  "author": {"type": "object", "additionalProperties": False,
                                             "required": ["last"],
                                             "properties": {"first": {"type": "string",
                                                                      "maxLength": 12},
                                                            "last": {"type": "string",
                                                                     "maxLength": 12}}},
                                  "year": {"type": "integer", "minimum": 1450,
                                           "maximum": 2030}}}}},
}


EXACT = dict(kv_cache_memory="256MiB", max_model_len=2048, dtype="float32",
             kv_cache_dtype="float32", linear_backend="onednn")


@pytest.fixture(scope="module")
def exact_llm() -> LLM:
    """What batch-shape tests compare against, on settings where these prompts' greedy choices
    did not move with the batch's shape: fp32 throughout, the KV cache included, and oneDNN's
    matmuls, not the native kernel, whose switch between its int8 (decode) and fp32 (prefill)
    paths moves a recomputed request's logits (on an AVX-512 EPYC that flipped a near-tie of
    these prompts after a preemption)."""
    return LLM(**EXACT)


@dataclass(frozen=True)
class Answers:
    schemas: list[dict]
    prompts: list[list[int]]
    params: list[SamplingParams]
    texts: list[str]


@pytest.fixture(scope="module")
def exact_answers(exact_llm: LLM) -> Answers:
    """Four constrained greedy answers on `exact_llm`, generated once for every mode compared
    with them."""
    schemas = [SCHEMAS[n] for n in ("person", "order", "nested", "reading")]
    prompts = [chat_prompt(exact_llm, n) for n in ("cook", "order", "book", "sensor")]
    params = [constrained(s, temperature=0) for s in schemas]
    texts = [o.outputs[0].text for o in exact_llm.generate(prompts, params)]
    return Answers(schemas, prompts, params, texts)


def chat_prompt(llm: LLM, what: str) -> list[int]:
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": CHAT.format(what)}])
    return llm.tokenizer.encode(text, add_special_tokens=False)


def constrained(schema: dict, **options: object) -> SamplingParams:
    return SamplingParams(max_tokens=160, structured_outputs=StructuredOutputsParams(
        json=schema), **options)


# -- the spec ---------------------------------------------------------------------------------


@pytest.mark.unit
def test_exactly_one_constraint_kind() -> None:
    with pytest.raises(SamplingParamsError, match="exactly one"):
        StructuredOutputsParams(regex="a+", choice=["a"])
    with pytest.raises(SamplingParamsError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(SamplingParamsError, match="choice"):
        StructuredOutputsParams(choice=[])


@pytest.mark.unit
def test_choices_past_what_the_grammar_engine_keeps_alive_are_refused_up_front() -> None:
    """Past 2000 alternatives alive at once llguidance failed the request a token in (and a
    step over 20,000 held up the whole batch for 0.1 s): refused where the spec is made."""
    StructuredOutputsParams(choice=[f"option {i}" for i in range(MAX_CHOICES)])
    with pytest.raises(SamplingParamsError, match=f"at most {MAX_CHOICES}"):
        StructuredOutputsParams(choice=[f"option {i}" for i in range(MAX_CHOICES + 1)])


@pytest.mark.unit
def test_a_schema_as_text_or_dict_is_one_cache_entry() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    as_dict = StructuredOutputsParams(json=schema)
    as_text = StructuredOutputsParams(json=json.dumps(schema, indent=2))
    assert as_dict.key == as_text.key
    assert grammar_for(as_dict) is grammar_for(as_text)


@pytest.mark.unit
@pytest.mark.parametrize(("spec", "problem"), [
    (StructuredOutputsParams(regex="a(b"), "regex"),
    (StructuredOutputsParams(json={"type": "nonsense"}), "json"),
    (StructuredOutputsParams(json="{not json"), "json"),
    (StructuredOutputsParams(grammar="start: undefined_rule"), "grammar"),
])
def test_a_spec_that_cannot_compile_names_its_kind(spec: StructuredOutputsParams,
                                                   problem: str) -> None:
    with pytest.raises(StructuredOutputsError) as caught:
        grammar_for(spec)
    assert caught.value.field == "structured_outputs" and caught.value.kind == problem


# -- the engine ----------------------------------------------------------------------------------


@pytest.mark.integration
def test_every_constrained_answer_validates_greedy_and_sampled(llm: LLM) -> None:
    names = sorted(SCHEMAS) * 2
    params = [constrained(SCHEMAS[name], temperature=0) for name in sorted(SCHEMAS)] + [
        constrained(SCHEMAS[name], temperature=1.0, seed=i) for i, name in
        enumerate(sorted(SCHEMAS))]
    outs = llm.generate([chat_prompt(llm, name) for name in names], params)
    for out, name in zip(outs, names):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), SCHEMAS[name])


@pytest.mark.integration
def test_an_unconstrained_request_is_untouched_by_constrained_neighbours(llm: LLM) -> None:
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompt = chat_prompt(llm, "cat")
    alone = llm.generate([prompt], plain)[0].outputs[0].token_ids
    batch = llm.generate([prompt] * 4, [constrained(SCHEMAS["person"], temperature=0), plain,
                                        constrained(SCHEMAS["order"], temperature=0.8, seed=1),
                                        constrained(SCHEMAS["nested"], temperature=0)])
    assert batch[1].outputs[0].token_ids == alone
    for out, name in zip([batch[0], batch[2], batch[3]], ["person", "order", "nested"]):
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS[name])


@pytest.mark.integration
def test_choice_regex_grammar_and_json_object(llm: LLM) -> None:
    specs = [StructuredOutputsParams(choice=["yes", "no", "maybe"]),
             StructuredOutputsParams(regex=r"[0-9]{3}-[A-Z]{2}"),
             StructuredOutputsParams(grammar='start: "red" | "green" | "blue"'),
             StructuredOutputsParams(json_object=True)]
    outs = llm.generate(["Is the sky blue? Answer:"] * len(specs),
                        [SamplingParams(max_tokens=64, temperature=0, structured_outputs=s)
                         for s in specs])
    texts = [o.outputs[0].text for o in outs]
    assert texts[0] in ("yes", "no", "maybe")
    assert len(texts[1]) == 6 and texts[1][:3].isdigit() and texts[1][4:].isupper()
    assert texts[2] in ("red", "green", "blue")
    assert isinstance(json.loads(texts[3]), dict)
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


@pytest.mark.integration
def test_logprobs_are_the_models_own_not_the_masked_ones(llm: LLM) -> None:
    """The grammar's mask picks the token, but logprobs show the model's distribution: the
    mask goes onto a copy, even where the sampler reads the logits in place (a step's rows
    are consecutive: a view, no copy)."""
    choices = ["yes", "no", "maybe"]
    out = llm.generate(["Is the sky blue? Answer:"], SamplingParams(
        max_tokens=8, temperature=0, logprobs=5,
        structured_outputs=StructuredOutputsParams(choice=choices)))[0].outputs[0]
    assert out.text in choices
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0]
    texts = [llm.tokenizer.decode([token_id]) for token_id, _ in first.top]
    assert all(math.isfinite(logprob) for _, logprob in first.top)
    assert any(not any(c.startswith(t) for c in choices) for t in texts), texts


@pytest.mark.integration
def test_a_bad_spec_fails_its_request_alone_naming_the_problem(llm: LLM) -> None:
    """The compile (and so the check) runs on the engine's compile threads, never on the
    step loop: a spec that fails there fails its own request, with the reason."""
    from loom.structured import GRAMMAR_ERROR_PREFIX

    failed, plain = llm.generate(["x", "The capital of France is"], [
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a(b")),
        SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)])
    assert failed.error.startswith(f"{GRAMMAR_ERROR_PREFIX}regex: ") and "unclosed" in failed.error
    assert plain.error is None and len(plain.outputs[0].token_ids) == 4
    assert not llm.engine.has_unfinished_requests()


# The bundled vocabulary has no token for byte 0xF1, which starts U+40000's UTF-8 (nor for
# 0x04): no token sequence writes these characters.
UNWRITABLE = "\U00040000"


@pytest.mark.integration
@pytest.mark.parametrize("choice", [UNWRITABLE, "\x04", f"ok{UNWRITABLE}"])
def test_a_choice_the_vocabulary_cannot_write_is_refused_before_it_is_queued(
        llm: LLM, choice: str) -> None:
    with pytest.raises(ValueError, match="structured_outputs choice: .*cannot write"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(
            choice=["fine", choice])))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.integration
@pytest.mark.parametrize("spec", [
    StructuredOutputsParams(regex=f"x{UNWRITABLE}+"),
    StructuredOutputsParams(json={"type": "object", "required": ["a"],
                                  "properties": {"a": {"const": UNWRITABLE}}}),
], ids=["regex", "json"])
def test_a_grammar_that_needs_unwritable_text_fails_alone_as_the_clients_error(
        llm: LLM, spec: StructuredOutputsParams) -> None:
    """Only a step reaches such text: the request ends with an error the server answers as
    400, and its neighbour's answer is whole."""
    from loom.structured import GRAMMAR_ERROR_PREFIX

    plain = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    failed, neighbour = llm.generate(["x", "The capital of France is"], [
        SamplingParams(max_tokens=16, structured_outputs=spec), plain])
    assert failed.finished and failed.error.startswith(GRAMMAR_ERROR_PREFIX), failed.error
    assert "cannot write" in failed.error
    assert neighbour.error is None and len(neighbour.outputs[0].token_ids) == 8
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.integration
@pytest.mark.parametrize("options", [
    {"async_scheduling": True},
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                            "prompt_lookup_max": 3, "prompt_lookup_min": 1}},
    {"num_kv_blocks": 14, "block_size": 16,  # four answers cannot all fit: preemption
     "enable_prefix_caching": False},  # (the shared system prompt would save blocks)
], ids=["async", "ngram", "preempted"])
def test_scheduling_modes_keep_constrained_answers_valid(exact_answers: Answers,
                                                        options: dict) -> None:
    """Greedy answers equal the plain engine's: constrained requests wait for their previous
    token (async), verify drafts under the grammar's mask at every position (n-gram), and a
    recomputed request's matcher stays where it was (preemption). Both on `exact_llm`'s
    settings, where the modes' different batch shapes change no greedy choice."""
    other = LLM(max_num_seqs=4, **(EXACT | options))
    outs = other.generate(exact_answers.prompts, exact_answers.params)
    for out, schema in zip(outs, exact_answers.schemas):
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    if "num_kv_blocks" in options:
        assert other.get_metrics()["loom:num_preemptions_total"] > 0
    assert [o.outputs[0].text for o in outs] == exact_answers.texts


@pytest.mark.integration
def test_constrained_requests_take_drafts_the_grammar_allows(llm: LLM) -> None:
    """An answer that copies JSON from its prompt: n-gram drafts are proposed, cut where the
    grammar would refuse a token, verified under its mask, and accepted, with greedy output
    the same as without speculation."""
    record = '{"name": "Ada", "age": 36, "email": "ada@example.com"}'
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": (
        f"Copy this JSON record exactly, then stop: {record}")}])
    prompt = llm.tokenizer.encode(text, add_special_tokens=False)
    params = constrained(SCHEMAS["person"], temperature=0)
    expected = llm.generate([prompt], params)[0].outputs[0].text
    spec = LLM(max_model_len=2048, dtype="float32", kv_cache_memory="256MiB",
               speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    out = spec.generate([prompt], params)[0].outputs[0].text
    assert out == expected
    jsonschema.validate(json.loads(out), SCHEMAS["person"])
    metrics = spec.get_metrics()
    assert metrics["loom:spec_decode_num_draft_tokens_total"] > 0
    assert metrics["loom:spec_decode_num_accepted_tokens_total"] > 0
    sampled = spec.generate([prompt] * 4, [constrained(SCHEMAS["person"], temperature=1.0,
                                                       seed=i) for i in range(4)])
    for answer in sampled:  # rejection sampling under the mask keeps every answer valid
        assert answer.error is None
        jsonschema.validate(json.loads(answer.outputs[0].text), SCHEMAS["person"])


@pytest.mark.unit
def test_a_request_waits_for_its_grammar_while_others_run() -> None:
    """The scheduler admits a constrained request only once its compile is done; the rest of
    the queue is not held up."""
    from stand_in import make_engine

    from loom.config import SchedulerConfig
    from loom.structured.state import GrammarState

    engine = make_engine(SchedulerConfig(), num_blocks=64, block_size=4)
    compiling: Future = Future()
    engine.structured.start = lambda request_id, spec: GrammarState(request_id, compiling)
    engine.add_request("constrained", [4, 5, 6], SamplingParams(
        max_tokens=2, structured_outputs=StructuredOutputsParams(regex="t1")))
    engine.add_request("plain", [1, 2, 3], SamplingParams(max_tokens=2))
    outputs, _ = engine.step()
    assert [o.request_id for o in outputs] == ["plain"]
    assert engine.is_unscheduled("constrained")
    compiling.set_exception(ValueError("no such grammar"))
    outputs, _ = engine.step()
    failed = [o for o in outputs if o.request_id == "constrained"]
    assert failed and failed[0].finished and "no such grammar" in failed[0].error


@pytest.mark.unit
def test_a_grammar_that_fails_to_compile_is_the_clients_400_not_a_500():
    from loom.entrypoints.openai.errors import APIError
    from loom.entrypoints.openai.serving import check_failed
    from loom.outputs import RequestOutput
    from loom.structured import GRAMMAR_ERROR_PREFIX

    def output(error: str) -> RequestOutput:
        return RequestOutput("r", None, [1], [], finished=True, error=error)

    with pytest.raises(APIError) as refused:
        check_failed(output(f"{GRAMMAR_ERROR_PREFIX}no token can start the grammar"))
    assert refused.value.status == 400 and refused.value.param == "structured_outputs"
    with pytest.raises(APIError) as failed:
        check_failed(output("RuntimeError: the step failed"))
    assert failed.value.status == 500
