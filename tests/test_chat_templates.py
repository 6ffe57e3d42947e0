"""Real models' chat templates (llama.cpp's models/templates/) render in loom exactly as
transformers renders them (`render_jinja_template`, what `apply_chat_template` calls), over
conversations with a system turn, several turns, tool calls and their results, and a
reasoning turn, with and without the generation prompt and `enable_thinking`. A template
that refuses a conversation (Gemma 2 has no system role, Mistral's want alternating turns)
must refuse it in loom too, with the same message."""

from __future__ import annotations

from typing import Any

import pytest
from llama_cpp_tree import llama_cpp_tree
from transformers.utils.chat_template_utils import render_jinja_template

from loom.model.chat_template import ChatTemplateError, render_chat_template

pytestmark = pytest.mark.unit

TEMPLATES = [
    "Qwen-Qwen3-0.6B", "Qwen3.5-4B", "Qwen-Qwen2.5-7B-Instruct", "google-gemma-2-2b-it",
    "google-gemma-4-31B-it", "meta-llama-Llama-3.1-8B-Instruct",
    "meta-llama-Llama-3.2-3B-Instruct", "meta-llama-Llama-3.3-70B-Instruct",
    "microsoft-Phi-3.5-mini-instruct", "HuggingFaceTB-SmolLM3-3B",
    "mistralai-Mistral-Nemo-Instruct-2407", "unsloth-mistral-Devstral-Small-2507",
    "Mistral-Small-3.2-24B-Instruct-2506", "deepseek-ai-DeepSeek-R1-Distill-Llama-8B",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "openai-gpt-oss-120b",
]

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string", "description": "City name"},
                                  "unit": {"type": "string",
                                           "enum": ["celsius", "fahrenheit"]}}}}}
CALL = {"id": "call12345", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}

CONVERSATIONS: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = {
    "one user turn": ([{"role": "user", "content": "What is the capital of France?"}], None),
    "system and several turns": ([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? Answer with <b>bold</b> & \"quotes\", café."}],
        None),
    "tool call and result": ([
        {"role": "user", "content": "What is the weather in Paris?"},
        # the server sends an OpenAI null content as "" (as vLLM does; Qwen3's template
        # fails on a turn without content, in transformers too)
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call12345", "name": "get_weather",
         "content": '{"celsius": 21}'}], [WEATHER_TOOL]),
    "tools offered": ([{"role": "user", "content": "Weather in Oslo?"}], [WEATHER_TOOL]),
    "reasoning turn": ([
        {"role": "user", "content": "Is 7 prime?"},
        {"role": "assistant", "content": "Yes.", "reasoning_content": "7 has no divisors."},
        {"role": "user", "content": "And 9?"}], None),
}
SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>"}


def template(name: str) -> str:
    return (llama_cpp_tree() / "models" / "templates" / f"{name}.jinja").read_text()


def transformers_render(source: str, messages: list[dict[str, Any]],
                        tools: list[dict[str, Any]] | None, add_generation_prompt: bool,
                        variables: dict[str, Any]) -> str:
    """What apply_chat_template renders: messages without their None-valued keys."""
    normalized = [{k: v for k, v in m.items() if v is not None} for m in messages]
    rendered, _ = render_jinja_template(conversations=[normalized], tools=tools,
                                        chat_template=source,
                                        add_generation_prompt=add_generation_prompt,
                                        **variables)
    return rendered[0]


@pytest.mark.parametrize("thinking", [None, False], ids=["default", "no-thinking"])
@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["prompt", "no-prompt"])
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("name", TEMPLATES)
def test_templates_render_as_transformers_renders_them(
        name: str, conversation: str, add_generation_prompt: bool, thinking: bool | None
        ) -> None:
    source = template(name)
    messages, tools = CONVERSATIONS[conversation]
    variables = {**SPECIAL_TOKENS,
                 **({} if thinking is None else {"enable_thinking": thinking})}
    try:
        expected = transformers_render(source, messages, tools, add_generation_prompt,
                                       variables)
    except Exception as refused:  # noqa: BLE001 - the template's own refusal (only Gemma 2's)
        with pytest.raises(ChatTemplateError) as caught:
            render_chat_template(source, messages, tools, add_generation_prompt, variables)
        assert str(refused) in str(caught.value)
        return
    assert render_chat_template(source, messages, tools, add_generation_prompt,
                                variables) == expected


def test_the_conversations_exercise_what_they_name() -> None:
    """The cases are not vacuous: Qwen3 renders the tool call and its result, the reasoning
    of an earlier turn is dropped, and enable_thinking=False writes an empty think block."""
    qwen3 = template("Qwen-Qwen3-0.6B")
    messages, tools = CONVERSATIONS["tool call and result"]
    text = render_chat_template(qwen3, messages, tools, True, SPECIAL_TOKENS)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\n{\"celsius\": 21}\n</tool_response>" in text
    messages, _ = CONVERSATIONS["one user turn"]
    off = render_chat_template(qwen3, messages, None, True,
                               {**SPECIAL_TOKENS, "enable_thinking": False})
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    gemma2 = template("google-gemma-2-2b-it")
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        render_chat_template(gemma2, CONVERSATIONS["system and several turns"][0])


def test_variables_the_server_sets_cannot_come_from_the_request() -> None:
    with pytest.raises(ChatTemplateError, match="'messages' is set by the server"):
        render_chat_template("{{ messages }}", [], variables={"messages": "x"})


def test_sandbox_and_namespace_guards_hold() -> None:
    with pytest.raises(ChatTemplateError):
        render_chat_template("{% set ns = namespace(_x=1) %}{{ ns._x }}", [])
    with pytest.raises(ChatTemplateError):
        render_chat_template("{{ ''.__class__.__mro__ }}", [])
    assert render_chat_template(
        "{% generation %}{{ messages[0].content }}{% endgeneration %}"
        "{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}"
        "{{ {'a': '<é>'} | tojson(indent=1) }}",
        [{"role": "user", "content": "hi", "tool_calls": None}]) == 'hi01{\n "a": "<é>"\n}'
