"""--reasoning-parser: a thinking model's <think> part split out of its answer, whole and
streamed (every character once, on the side the whole answer puts it), over the real engine
loop and HTTP server with Qwen's vocabulary, Qwen3's and DeepSeek-R1's real chat templates,
and a scripted model; chat_template_kwargs reach the template; tool calls after the
reasoning still parse; the Responses API gets a reasoning item."""

from __future__ import annotations

import dataclasses
import json
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llama_cpp_tree import llama_cpp_tree
from scripted_model import ScriptedRunner, scripted_client

from loom.entrypoints.openai.reasoning import REASONING_PARSERS
from loom.model.gguf_file import read_gguf
from loom.model.model_files import tokenizer_from_gguf
from loom.model.tokenizer import Tokenizer

QWEN3, R1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]


# -- the parsers (pure) --------------------------------------------------------------------------

@pytest.mark.unit
@pytest.mark.parametrize("parser,inside,text,reasoning,content", [
    (QWEN3, False, "<think>\nhmm\n</think>\n\nParis.", "\nhmm\n", "Paris."),
    (QWEN3, False, "Paris.", None, "Paris."),  # no tag: all content
    (QWEN3, False, "<think>cut off by max_tokens", "cut off by max_tokens", ""),
    (QWEN3, True, "hmm</think>Paris.", "hmm", "Paris."),  # the prompt opened it
    # R1: starts_inside says True where the prompt does not decide
    (R1, True, "hmm\n</think>\n\nParis.", "hmm\n", "Paris."),  # R1 skips the tag
    (R1, True, "<think>hmm</think>Paris.", "hmm", "Paris."),
    (R1, True, "all thought, never done", "all thought, never done", ""),
])
def test_answers_split_at_their_reasoning(parser, inside, text, reasoning, content) -> None:
    split = parser.split(text, inside)
    assert (split.reasoning, split.content) == (reasoning, content)


@pytest.mark.unit
def test_where_the_prompt_leaves_the_answer() -> None:
    assert QWEN3.starts_inside("<|im_start|>assistant\n<think>\n") is True
    assert QWEN3.starts_inside("<|im_start|>assistant\n<think>\n\n</think>\n\n") is None
    assert QWEN3.starts_inside("<|im_start|>assistant\n") is False
    assert R1.starts_inside("<｜Assistant｜>") is True
    assert R1.starts_inside("<｜Assistant｜><think>\n</think>") is None  # thinking off
    # a closed block of an earlier turn, followed by more of the prompt, decides nothing
    assert QWEN3.starts_inside("<think>a</think>b<|im_start|>assistant\n") is False


PIECES = st.lists(st.sampled_from(["<", "<think>", "</think>", "</", "think", ">", "\n",
                                   " ", "a", "Paris", "<tool_call>", "<b>"]), max_size=14)


@pytest.mark.unit
@settings(max_examples=400, deadline=None)
@given(PIECES, st.data(), st.sampled_from([QWEN3, R1]), st.booleans())
def test_streamed_pieces_add_up_to_the_whole_split(pieces, data, parser, inside) -> None:
    """However the answer arrives, the reasoning and content sent so far are prefixes of
    the final ones and add up to them: nothing is sent twice, moved, or lost."""
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    whole = parser.split(text, inside)
    sent_reasoning, sent_content = "", ""
    for cut in [*cuts, len(text)]:
        part = parser.split(text[:cut], inside, finished=cut == len(text))
        reasoning = part.reasoning or ""
        assert reasoning.startswith(sent_reasoning) and part.content.startswith(sent_content)
        sent_reasoning, sent_content = reasoning, part.content
    assert (sent_reasoning, sent_content) == (whole.reasoning or "", whole.content)


@pytest.mark.unit
def test_reasoning_tokens_are_counted_up_to_the_closing_tag() -> None:
    pieces = ["<think>", "a", "b", "</th", "ink>", "Paris", "."]
    decode = lambda ids: "".join(pieces[i] for i in ids)  # noqa: E731
    assert QWEN3.token_count(decode, list(range(7)), False) == 5
    assert QWEN3.token_count(decode, [5, 6], False) == 0
    assert R1.token_count(decode, [1, 2], True) == 2  # never closed: all of it


# -- over the server ---------------------------------------------------------------------------

@cache
def qwen_tokenizer(template: str) -> Tokenizer:
    """Qwen2's vocabulary (Qwen3's is the same byte-level BPE) with a real chat template."""
    tree = llama_cpp_tree()
    base = tokenizer_from_gguf(read_gguf(tree / "models" / "ggml-vocab-qwen2.gguf").metadata)
    source = (tree / "models" / "templates" / f"{template}.jinja").read_text()
    return dataclasses.replace(base, chat_template=source)


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
THOUGHT = "The user asks for France's capital. That is Paris."
ANSWER = f"<think>\n{THOUGHT}\n</think>\n\nThe capital of France is Paris."


def chat(client, stream: bool = False, **body: object):
    return client.post("/v1/chat/completions", json={
        "model": "any", "messages": QUESTION, "max_tokens": 200, "stream": stream, **body})


def streamed(response) -> tuple[str, str, list[dict]]:
    reasoning, content, chunks = "", "", []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[6:])
            chunks.append(chunk)
            for choice in chunk["choices"]:
                reasoning += choice["delta"].get("reasoning_content") or ""
                content += choice["delta"].get("content") or ""
    return reasoning, content, chunks


@pytest.mark.integration
def test_qwen3_reasoning_is_split_whole_and_streamed() -> None:
    runner = ScriptedRunner(qwen_tokenizer("Qwen-Qwen3-0.6B"), ANSWER)
    with scripted_client(runner, reasoning_parser="qwen3") as client:
        whole = chat(client).json()
        message = whole["choices"][0]["message"]
        assert message["reasoning_content"] == f"\n{THOUGHT}\n"
        assert message["content"] == "The capital of France is Paris."
        num_answer = len(runner.tokenizer.encode(ANSWER, add_special_tokens=False))
        assert whole["usage"]["completion_tokens"] == num_answer + 1  # and <|endoftext|>
        with client.stream("POST", "/v1/chat/completions", json={
                "model": "any", "messages": QUESTION, "max_tokens": 200, "stream": True,
                "stream_options": {"include_usage": True}}) as response:
            reasoning, content, chunks = streamed(response)
        assert (reasoning, content) == (message["reasoning_content"], message["content"])
        # (how the pieces are cut depends on how far the engine runs ahead of the server;
        # that any cut adds up is the property test's)
        kinds = [key for c in chunks for ch in c["choices"]
                 for key in ("reasoning_content", "content") if ch["delta"].get(key)]
        assert kinds == sorted(kinds, reverse=True)  # the reasoning, then the content
        assert chunks[-1]["usage"]["completion_tokens"] == num_answer + 1


@pytest.mark.integration
def test_without_the_parser_the_answer_is_untouched() -> None:
    runner = ScriptedRunner(qwen_tokenizer("Qwen-Qwen3-0.6B"), ANSWER)
    with scripted_client(runner) as client:
        message = chat(client).json()["choices"][0]["message"]
    assert message["content"] == ANSWER and message["reasoning_content"] is None


@pytest.mark.integration
def test_chat_template_kwargs_reach_the_template() -> None:
    """enable_thinking: false makes Qwen3's template close an empty block in the prompt; the
    answer then has no reasoning to split, even with the parser on."""
    runner = ScriptedRunner(qwen_tokenizer("Qwen-Qwen3-0.6B"), "Paris.")
    with scripted_client(runner, reasoning_parser="qwen3") as client:
        off = chat(client, chat_template_kwargs={"enable_thinking": False}).json()
        on = chat(client).json()
        refused = chat(client, chat_template_kwargs={"messages": []})
        counted = [client.post("/tokenize", json={"messages": QUESTION, **extra}).json()
                   for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {})]
    assert runner.prompts[0].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert runner.prompts[1].endswith("<|im_start|>assistant\n")
    assert off["usage"]["prompt_tokens"] > on["usage"]["prompt_tokens"]
    assert [c["count"] for c in counted] == [off["usage"]["prompt_tokens"],
                                             on["usage"]["prompt_tokens"]]
    assert off["choices"][0]["message"] == {"role": "assistant", "content": "Paris.",
                                            "reasoning_content": None, "tool_calls": []}
    assert refused.status_code == 400 and refused.json()["error"]["param"] == \
        "chat_template_kwargs"


@pytest.mark.integration
@pytest.mark.parametrize("stream", [False, True])
def test_deepseek_r1_answers_start_inside_their_reasoning(stream: bool) -> None:
    """R1's template opens <think> in the prompt (with enable_thinking; llama.cpp's copy of
    it closes the block otherwise), so the answer starts inside it."""
    runner = ScriptedRunner(qwen_tokenizer("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"),
                            f"{THOUGHT}\n</think>\n\nParis.")
    with scripted_client(runner, reasoning_parser="deepseek_r1") as client:
        kwargs = {"chat_template_kwargs": {"enable_thinking": True}}
        if stream:
            with client.stream("POST", "/v1/chat/completions", json={
                    "model": "any", "messages": QUESTION, "max_tokens": 200, "stream": True,
                    **kwargs}) as response:
                reasoning, content, _ = streamed(response)
        else:
            message = chat(client, **kwargs).json()["choices"][0]["message"]
            reasoning, content = message["reasoning_content"], message["content"]
    assert runner.prompts[0].endswith("<think>\n")
    assert (reasoning, content) == (f"{THOUGHT}\n", "Paris.")


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}


@pytest.mark.integration
@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_after_the_reasoning_still_parse(stream: bool) -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    runner = ScriptedRunner(qwen_tokenizer("Qwen-Qwen3-0.6B"),
                            f"<think>\nI need the weather tool.\n</think>\n\n{call}")
    with scripted_client(runner, reasoning_parser="qwen3") as client:
        body = {"tools": [WEATHER]}
        if stream:
            with client.stream("POST", "/v1/chat/completions", json={
                    "model": "any", "messages": QUESTION, "max_tokens": 200, "stream": True,
                    **body}) as response:
                reasoning, content, chunks = streamed(response)
            calls = [c for chunk in chunks for ch in chunk["choices"]
                     for c in ch["delta"].get("tool_calls") or []]
            finish = chunks[-1]["choices"][0]["finish_reason"]
        else:
            choice = chat(client, **body).json()["choices"][0]
            reasoning, content = choice["message"]["reasoning_content"], \
                choice["message"]["content"]
            calls, finish = choice["message"]["tool_calls"], choice["finish_reason"]
    assert reasoning == "\nI need the weather tool.\n" and not content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
        == [("get_weather", {"city": "Paris"})]
    assert finish == "tool_calls"
    assert "<tools>" in runner.prompts[0]  # Qwen3's own template rendered the tools


@pytest.mark.integration
def test_the_responses_api_answers_with_a_reasoning_item() -> None:
    runner = ScriptedRunner(qwen_tokenizer("Qwen-Qwen3-0.6B"), ANSWER)
    with scripted_client(runner, reasoning_parser="qwen3") as client:
        whole = client.post("/v1/responses", json={"model": "any", "input": "Capital?"}).json()
        with client.stream("POST", "/v1/responses", json={
                "model": "any", "input": "Capital?", "stream": True}) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: ")]
    reasoning, message = whole["output"]
    assert reasoning["type"] == "reasoning"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": f"\n{THOUGHT}\n"}]
    assert message["content"][0]["text"] == "The capital of France is Paris."
    thought_tokens = len(runner.tokenizer.encode(f"<think>\n{THOUGHT}\n</think>",
                                                 add_special_tokens=False))
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == thought_tokens
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index(
        "response.output_text.delta")
    assert "".join(e["delta"] for e in events
                   if e["type"] == "response.reasoning_text.delta") == f"\n{THOUGHT}\n"
    assert events[-1]["response"]["output"][0]["content"] == reasoning["content"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
