"""Structured outputs over HTTP with the openai SDK: response_format and vLLM's spellings, on
chat and completions, streamed and not, greedy and sampled; a spec that cannot compile is a
400 naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from server_helpers import serve
from test_structured import SCHEMAS

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def client() -> openai.OpenAI:
    with serve("--kv-cache-memory", "256MiB") as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def chat(client: openai.OpenAI, stream: bool, content: str = "Describe a book as JSON.",
         **options: object) -> tuple[str, str]:
    """(the answer's text, its finish reason), reassembled from the stream when streamed."""
    messages = [{"role": "user", "content": content}]
    answer = client.chat.completions.create(model="any", messages=messages, max_tokens=160,
                                            stream=stream, **options)
    if not stream:
        return answer.choices[0].message.content, answer.choices[0].finish_reason
    text, finish = "", None
    for chunk in answer:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_response_format_json_schema_validates(client: openai.OpenAI, stream: bool,
                                               temperature: float) -> None:
    schema = SCHEMAS["nested"]
    text, finish = chat(client, stream, temperature=temperature, seed=7, response_format={
        "type": "json_schema", "json_schema": {"name": "book", "schema": schema}})
    assert finish == "stop"
    jsonschema.validate(json.loads(text), schema)


def test_vllm_spellings_on_chat_and_completions(client: openai.OpenAI) -> None:
    text, _ = chat(client, False, 'Answer in JSON: {"capital of France": ?}', temperature=0,
                   response_format={"type": "json_object"})
    assert isinstance(json.loads(text), dict)
    text, _ = chat(client, True, temperature=0,
                   extra_body={"structured_outputs": {"json": SCHEMAS["person"]}})
    jsonschema.validate(json.loads(text), SCHEMAS["person"])
    choice = client.completions.create(model="any", prompt="Is water wet? Answer:",
                                       max_tokens=8, extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")
    regex = client.completions.create(model="any", prompt="A year:", max_tokens=8, stream=True,
                                      extra_body={"guided_regex": "(19|20)[0-9]{2}"})
    year = "".join(c.choices[0].text for c in regex if c.choices)
    assert len(year) == 4 and 1900 <= int(year) < 2100


@pytest.mark.parametrize(("body", "param"), [
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_json": {"type": "nonsense"}}, "guided_json"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"guided_choice": [f"option {i}" for i in range(2001)]}, "guided_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
])
def test_a_spec_that_cannot_compile_is_a_400_naming_the_field(client: openai.OpenAI,
                                                              body: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="any", max_tokens=4, extra_body=body,
                                       messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["param"] == param


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "response_format"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a", "b"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "response_format"),
])
def test_two_fields_asking_for_structure_are_a_400_not_one_dropped(
        client: openai.OpenAI, body: dict, param: str) -> None:
    for create, prompt in ((client.completions.create, {"prompt": "x"}),
                           (client.chat.completions.create,
                            {"messages": [{"role": "user", "content": "hi"}]})):
        with pytest.raises(openai.BadRequestError) as caught:
            create(model="any", max_tokens=4, extra_body=body, **prompt)
        assert caught.value.body["param"] == param
        assert "one kind of structured output" in caught.value.body["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(("body", "param"), [
    ({"guided_choice": ["\U00040000"]}, "guided_choice"),
    ({"guided_regex": "\U00040000"}, "guided_regex"),  # the engine's error names it too
])
def test_text_the_vocabulary_cannot_write_is_a_400_not_a_500(client: openai.OpenAI, body: dict,
                                                             param: str, stream: bool) -> None:
    """A choice is checked against the tokenizer before it is queued; a regex needing such
    text fails at its first step, before the response's status is sent."""
    for create in (client.completions.create, client.chat.completions.create):
        prompt = ({"prompt": "x"} if create == client.completions.create
                  else {"messages": [{"role": "user", "content": "hi"}]})
        with pytest.raises(openai.BadRequestError) as caught:
            answer = create(model="any", max_tokens=4, stream=stream, extra_body=body, **prompt)
            if stream:
                list(answer)
        assert caught.value.body["param"] == param
        assert "cannot write" in caught.value.body["message"]
    assert chat(client, False, response_format={"type": "json_object"})[1] in ("stop", "length")
