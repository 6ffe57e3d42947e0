"""Tool calling: the parsers, the chat template with tools, and the openai SDK against `loom
serve` (required and named choices always give valid arguments, a two-turn conversation with
a tool result, streamed calls that reassemble into the non-streamed ones)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from server_helpers import serve

from loom.entrypoints.openai.tool_parsers import TOOL_PARSERS, parser_name_for_template
from loom.entrypoints.openai.tool_parsers.tool_choice import ToolUse
from loom.model.tokenizer import Tokenizer

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 24},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["timezone"],
        "properties": {"timezone": {"type": "string", "maxLength": 24}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                           "description": "The weather in a city now"}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME,
                                           "description": "The time in a timezone"}}]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


# -- parsers and templates (no model) -----------------------------------------------------------


@pytest.mark.unit
def test_hermes_finds_calls_and_the_content_before_them() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    found = TOOL_PARSERS["hermes"]().extract(text)
    assert found.content == "Let me check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in found.calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert len({c.id for c in found.calls}) == 2


@pytest.mark.unit
@pytest.mark.parametrize("text", [
    "no call here", "<tool_call>{not json}</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',
    # JSON.parse refuses these, so a client could not read the arguments
    '<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": 1e999}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "{\\"a\\": -Infinity}"}</tool_call>',
    '<tool_call>{"name": "f", "arguments": ' + "[" * 5000 + "]" * 5000 + "}</tool_call>"])
def test_hermes_leaves_non_calls_as_content(text: str) -> None:
    found = TOOL_PARSERS["hermes"]().extract(text)
    assert found.calls == [] and found.content == text


@pytest.mark.unit
def test_llama3_json_and_mistral() -> None:
    llama = TOOL_PARSERS["llama3_json"]().extract(
        '{"name": "get_time", "parameters": {"timezone": "UTC"}}; '
        '{"name": "get_weather", "parameters": {"city": "Rome"}}')
    assert [c.name for c in llama.calls] == ["get_time", "get_weather"] and not llama.content
    mistral = TOOL_PARSERS["mistral"]().extract(
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Lyon"}}]')
    assert json.loads(mistral.calls[0].arguments) == {"city": "Lyon"}
    assert len(mistral.calls[0].id) == 9 and mistral.calls[0].id.isalnum()


@pytest.mark.unit
def test_streamed_content_stops_where_a_call_may_begin() -> None:
    hermes = TOOL_PARSERS["hermes"]()
    assert hermes.content_prefix("Sure, <tool") == len("Sure, ")
    assert hermes.content_prefix("Sure, <tool_call>{") == len("Sure, ")
    assert hermes.content_prefix("Plain text") == len("Plain text")
    llama = TOOL_PARSERS["llama3_json"]()
    assert llama.content_prefix(' {"name"') == 0 and llama.content_prefix("Hi") == 2


@pytest.mark.unit
def test_the_parser_follows_the_template() -> None:
    assert parser_name_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_name_for_template("<|python_tag|>{{ x }}") == "llama3_json"
    assert parser_name_for_template(None) == "hermes"


@pytest.mark.unit
def test_required_and_named_choices_are_schemas() -> None:
    required = ToolUse.of(TOOLS, "required", parallel=False)
    schema = required.schema()
    jsonschema.validate([{"name": "get_time", "parameters": {"timezone": "UTC"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {"city": "x"}}], schema)
    with pytest.raises(jsonschema.ValidationError):  # parallel_tool_calls=false: one call
        jsonschema.validate([{"name": "get_time", "parameters": {"timezone": "UTC"}}] * 2,
                            schema)
    named = ToolUse.of(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert named.schema() == WEATHER
    assert named.enforced_calls('{"city": "Oslo"}')[0].arguments == '{"city": "Oslo"}'
    assert named.enforced_calls('{"city": NaN}') == []  # not JSON a client can read
    with pytest.raises(ValueError, match="not among the tools"):
        ToolUse.of(TOOLS, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ValueError, match="needs tools"):
        ToolUse.of([], "required")
    assert ToolUse.of(TOOLS, "none").tools == []


@pytest.mark.unit
def test_a_template_without_tools_gets_the_hermes_tool_prompt() -> None:
    from model_fixtures import smollm_loaded

    tokenizer: Tokenizer = smollm_loaded().tokenizer
    assert not tokenizer.template_has_tools
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    text = tokenizer.apply_chat_template(
        [*QUESTION, {"role": "assistant", "content": "", "tool_calls": [call]},
         {"role": "tool", "tool_call_id": "c1", "content": '{"celsius": 21}'}], tools=TOOLS)
    assert text.startswith("<|im_start|>system\nYou may call one or more functions")
    assert '"name": "get_weather"' in text and "<tool_call>" in text
    assert "<tool_response>\n{\"celsius\": 21}\n</tool_response>" in text


@pytest.mark.unit
def test_a_template_with_tools_renders_them_itself() -> None:
    from model_fixtures import smollm_loaded

    base = smollm_loaded().tokenizer
    own = Tokenizer(base.backend, base.eos_token_ids, chat_template=(
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}"))
    assert own.template_has_tools
    assert own.apply_chat_template(QUESTION, tools=TOOLS) == (
        "[get_weather][get_time]user:What is the weather in Paris?;")


# -- the openai SDK against loom serve ---------------------------------------------------------


@pytest.fixture(scope="module")
def client() -> openai.OpenAI:
    with serve("--kv-cache-memory", "256MiB") as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def ask(client: openai.OpenAI, stream: bool = False, messages: list | None = None,
        **options: object):
    return client.chat.completions.create(
        model="any", messages=messages or QUESTION, tools=TOOLS, max_tokens=80, stream=stream,
        **options)


def valid_calls(calls) -> list[tuple[str, dict]]:
    found = []
    for call in calls:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, PARAMETERS[call.function.name])
        assert call.id and call.type == "function"
        found.append((call.function.name, arguments))
    return found


@pytest.mark.integration
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_and_named_always_give_valid_arguments(client: openai.OpenAI,
                                                        temperature: float) -> None:
    required = ask(client, tool_choice="required", parallel_tool_calls=False,
                   temperature=temperature, seed=3)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(valid_calls(choice.message.tool_calls)) == 1
    named = ask(client, tool_choice={"type": "function", "function": {"name": "get_time"}},
                temperature=temperature, seed=3)
    assert [name for name, _ in valid_calls(named.choices[0].message.tool_calls)] == [
        "get_time"]


@pytest.mark.integration
@pytest.mark.parametrize("tool_choice", ["required",
                                         {"type": "function",
                                          "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_streamed_calls_reassemble_into_the_non_streamed_ones(client: openai.OpenAI,
                                                              tool_choice: object) -> None:
    whole = ask(client, tool_choice=tool_choice, parallel_tool_calls=False, temperature=0)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in ask(client, stream=True, tool_choice=tool_choice, parallel_tool_calls=False,
                     temperature=0):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for piece in choice.delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = piece.id or call["id"]
            call["name"] += (piece.function.name or "") if piece.function else ""
            call["arguments"] += (piece.function.arguments or "") if piece.function else ""
    expected = whole.choices[0].message.tool_calls
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in expected]
    assert all(c["id"] for c in calls.values())
    assert finish == whole.choices[0].finish_reason


@pytest.mark.integration
def test_a_two_turn_conversation_with_a_tool_result(client: openai.OpenAI) -> None:
    first = ask(client, tool_choice="required", parallel_tool_calls=False, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = [*QUESTION,
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id,
                 "content": json.dumps({"celsius": 21, "sky": "sunny"})}]
    answer = ask(client, messages=messages, temperature=0)  # auto: it may call again
    choice = answer.choices[0]
    assert choice.message.content or choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    # the call and its result are in the prompt now, after the same tools and question
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens
    assert answer.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.integration
def test_tool_choice_errors_name_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert caught.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, tool_choice="required", response_format={"type": "json_object"})
    assert caught.value.body["param"] == "tool_choice"
    nonsense = [{"type": "function", "function": {"name": "f",
                                                  "parameters": {"type": "nonsense"}}}]
    with pytest.raises(openai.BadRequestError) as caught:  # its parameters cannot compile
        client.chat.completions.create(model="any", messages=QUESTION, tools=nonsense,
                                       tool_choice="required", max_tokens=8)
    assert caught.value.body["param"] == "tools"
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{x"}}
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, messages=[*QUESTION, {"role": "assistant", "tool_calls": [call]}])
    assert caught.value.body["param"] == "messages"
    assert "tool call arguments are not JSON" in caught.value.body["message"]
    deep = {**call, "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}
    with pytest.raises(openai.BadRequestError) as caught:  # once a RecursionError: a 500
        ask(client, messages=[*QUESTION, {"role": "assistant", "tool_calls": [deep]}])
    assert caught.value.body["param"] == "messages"
