"""Tool calling: the parsers, the chat template with tools, and the openai SDK against `loom
serve` (required and named choices always give valid arguments, a two-turn conversation with
a tool result, streamed calls that reassemble into the non-streamed ones)."""

from __future__ import annotations

import json
import re

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


# -- each family's real template and its parser (no model) -----------------------------------

# Phi-4-mini-instruct's chat template (its tokenizer_config.json; not in llama.cpp's tree):
# the tools go in the system message, as JSON text.
PHI4_MINI_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message "
    "and message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + message['content']"
    " + '<|tool|>' + message['tools'] + '<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + "
    "message['role'] + '|>' + message['content'] + '<|end|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}")
FAMILIES = {
    "Qwen-Qwen3-0.6B": "hermes", "Qwen-Qwen2.5-7B-Instruct": "hermes",
    "Qwen3.5-4B": "qwen3_coder", "HuggingFaceTB-SmolLM3-3B": "hermes",
    "meta-llama-Llama-3.1-8B-Instruct": "llama3_json",
    "meta-llama-Llama-3.2-3B-Instruct": "llama3_json",
    "meta-llama-Llama-3.3-70B-Instruct": "llama3_json",
    "mistralai-Mistral-Nemo-Instruct-2407": "mistral",
    "unsloth-mistral-Devstral-Small-2507": "mistral",
    "Mistral-Small-3.2-24B-Instruct-2506": "mistral",
    "phi-4-mini": "phi4_mini",
}
_TURN_ENDS = re.compile(r"(<\|im_end\|>\n?|<\|eot_id\|>|</s>|<\|end\|>|<\|endoftext\|>)+$")


def family_tokenizer(name: str) -> Tokenizer:
    from llama_cpp_tree import llama_cpp_tree
    from model_fixtures import smollm_loaded

    source = PHI4_MINI_TEMPLATE if name == "phi-4-mini" else (
        llama_cpp_tree() / "models" / "templates" / f"{name}.jinja").read_text()
    base = smollm_loaded().tokenizer  # its vocabulary; the template is what is tested
    return Tokenizer(base.backend, base.eos_token_ids, base.bos_token_id,
                     chat_template=source)


@pytest.mark.unit
@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_familys_template_writes_calls_its_parser_reads(name: str) -> None:
    """The parser picked from the template reads back the call the template itself writes
    for an earlier assistant turn (what the model was trained to produce), with the
    reasoning of Qwen3/3.5's closed <think> block split off first; the tool result turn
    renders too."""
    from loom.entrypoints.openai.reasoning import REASONING_PARSERS

    tokenizer = family_tokenizer(name)
    parser_name = parser_name_for_template(tokenizer.chat_template)
    assert parser_name == FAMILIES[name]
    call = {"id": "abc123XYZ", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit":
                                                               "celsius"}}}
    prompt = tokenizer.apply_chat_template(QUESTION, True, TOOLS)
    with_call = tokenizer.apply_chat_template(
        [*QUESTION, {"role": "assistant", "content": "", "tool_calls": [call]}], False, TOOLS)
    assert with_call.startswith(prompt), "the call turn does not continue the prompt"
    written = _TURN_ENDS.sub("", with_call[len(prompt):])
    qwen3 = REASONING_PARSERS["qwen3"]
    inside = qwen3.starts_inside(prompt)
    if inside is not None:
        written = qwen3.split(written, inside).content
    found = TOOL_PARSERS[parser_name]().extract(written, TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in found.calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})], written
    assert not found.content
    result = tokenizer.apply_chat_template(
        [*QUESTION, {"role": "assistant", "content": "", "tool_calls": [call]},
         {"role": "tool", "tool_call_id": "abc123XYZ", "name": "get_weather",
          "content": '{"celsius": 21}'}], True, TOOLS)
    # the result after the call (Llama 3.1's template writes a string result through tojson,
    # quoted, as transformers does; Qwen3's drops the earlier turn's empty think block)
    assert result.rindex("celsius") > result.index("get_weather", result.index("Paris?"))


@pytest.mark.unit
def test_qwen3_coder_types_parameters_by_their_schema() -> None:
    parser = TOOL_PARSERS["qwen3_coder"]()
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"},
                                         "o": {"type": "object"}}}}}]
    text = ("Let me look.\n<tool_call>\n<function=f>\n<parameter=n>\n42\n</parameter>\n"
            "<parameter=s>\n42\n</parameter>\n<parameter=o>\n{\"a\": [1]}\n</parameter>\n"
            "</function>\n</tool_call>")
    found = parser.extract(text, tools)
    assert found.content == "Let me look.\n"
    assert json.loads(found.calls[0].arguments) == {"n": 42, "s": "42", "o": {"a": [1]}}
    assert parser.extract("<tool_call>\n<function=f>\nbroken", tools).calls == []


@pytest.mark.unit
@pytest.mark.parametrize("text", [
    '[TOOL_CALLS][{"name": "get_time", "arguments": {"timezone": "UTC"}}]',
    '[TOOL_CALLS]get_time[ARGS]{"timezone": "UTC"}',
    '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"timezone": "UTC"}'])
def test_mistral_reads_all_three_of_its_formats(text: str) -> None:
    found = TOOL_PARSERS["mistral"]().extract(text)
    assert [(c.name, json.loads(c.arguments)) for c in found.calls] == [
        ("get_time", {"timezone": "UTC"})]
    assert len(found.calls[0].id) == 9 and found.calls[0].id.isalnum()
    if "CALL_ID" in text:
        assert found.calls[0].id == "a1b2c3d4e"
    two = TOOL_PARSERS["mistral"]().extract(f"{text}{text}")
    assert len(two.calls) == 2
    assert TOOL_PARSERS["mistral"]().extract('[TOOL_CALLS]f[ARGS]{"a": NaN}').calls == []


@pytest.mark.unit
def test_phi4_mini_reads_functools_and_its_tool_tokens() -> None:
    parser = TOOL_PARSERS["phi4_mini"]()
    for text in ['functools[{"name": "get_time", "arguments": {"timezone": "UTC"}}]',
                 '<|tool_call|>[{"name": "get_time", "arguments": {"timezone": "UTC"}}]'
                 '<|/tool_call|>']:
        found = parser.extract(text)
        assert [c.name for c in found.calls] == ["get_time"] and not found.content
    assert parser.extract("functools are tools").calls == []
    assert parser.content_prefix("Sure, func") == len("Sure, ")
