"""OpenAI's Responses API (/v1/responses) through the official openai SDK against `loom serve`:
answers agree with the chat endpoint's, a stream's events are numbered and reassemble into the
non-streamed response, function calls and their outputs make a conversation, text.format
constrains the answer, a kept response continues by previous_response_id, and what loom
cannot do is a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from server_helpers import serve

from loom.entrypoints.openai.errors import APIError, error_body
from loom.entrypoints.openai.protocol import ChatMessage
from loom.entrypoints.openai.protocol_answers import DeltaFunctionCall, DeltaToolCall
from loom.entrypoints.openai.protocol_responses import ResponseObject, ResponsesRequest
from loom.entrypoints.openai.response_store import ResponseStore
from loom.entrypoints.openai.serving_responses import ResponseEvents
from loom.outputs import CompletionOutput, RequestMetrics, RequestOutput

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 24}}}
TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER,
          "description": "The weather in a city now"}]
QUESTION = "What is the weather in Paris?"


# -- reading a request (no model) --------------------------------------------------------------


@pytest.mark.unit
def test_input_items_become_the_chat_conversation() -> None:
    request = ResponsesRequest.model_validate({
        "instructions": "Be brief.",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                               {"type": "input_text", "text": "in Oslo?"}]},
                  {"type": "message", "role": "assistant", "content": "Checking."},
                  {"type": "function_call", "call_id": "c1", "name": "get_weather",
                   "arguments": '{"city": "Oslo"}'},
                  {"type": "function_call", "call_id": "c2", "name": "get_weather",
                   "arguments": '{"city": "Bergen"}'},
                  {"type": "function_call_output", "call_id": "c1", "output": "3 C"},
                  {"type": "function_call_output", "call_id": "c2", "output": "5 C"}],
        "tools": TOOLS, "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 9, "text": {"format": {"type": "json_object"}}})
    chat = request.chat_request()
    assert [(m.role, m.text()) for m in chat.messages] == [
        ("system", "Be brief."), ("user", "Weather in Oslo?"), ("assistant", "Checking."),
        ("tool", "3 C"), ("tool", "5 C")]
    calls = chat.messages[2].tool_calls  # both calls joined the assistant turn before them
    assert [(c.id, c.function.arguments) for c in calls] == [("c1", '{"city": "Oslo"}'),
                                                             ("c2", '{"city": "Bergen"}')]
    assert [m.tool_call_id for m in chat.messages[3:]] == ["c1", "c2"]
    assert chat.tools[0].function.name == "get_weather"
    assert chat.tool_choice.function.name == "get_weather"
    assert chat.max_completion_tokens == 9 and chat.response_format.type == "json_object"


@pytest.mark.unit
@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "background": True}, "background"),
    ({"input": []}, "input"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input"),
    ({"input": [{"role": "user"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, "text"),
])
def test_what_loom_cannot_do_is_an_error_naming_the_field(body: dict, param: str) -> None:
    with pytest.raises(APIError) as caught:
        ResponsesRequest.model_validate(body).chat_request()
    assert caught.value.status == 400 and caught.value.param == param


@pytest.mark.unit
def test_earlier_turns_come_between_the_instructions_and_the_input() -> None:
    earlier = [ChatMessage(role="user", content="Hi."),
               ChatMessage(role="assistant", content="Hello.")]
    request = ResponsesRequest.model_validate({"instructions": "Be brief.", "input": "Again?"})
    assert [(m.role, m.text()) for m in request.chat_request(earlier).messages] == [
        ("system", "Be brief."), ("user", "Hi."), ("assistant", "Hello."), ("user", "Again?")]


@pytest.mark.unit
def test_the_store_keeps_the_most_recent_and_names_the_field_of_an_unknown_id() -> None:
    store = ResponseStore(capacity=2)
    turn = [ChatMessage(role="user", content="x")]
    for i in range(3):
        store.put(ResponseObject(id=f"resp_{i}", status="completed", model="m"), turn)
    assert len(store) == 2 and store.get("resp_2").response.id == "resp_2"
    with pytest.raises(APIError) as caught:
        store.get("resp_0", "previous_response_id")  # the oldest went first
    assert caught.value.status == 404 and caught.value.param == "previous_response_id"
    store.delete("resp_1")
    with pytest.raises(APIError):
        store.delete("resp_1")
    none = ResponseStore(capacity=0)
    none.put(ResponseObject(id="resp_x", status="completed", model="m"), turn)
    assert len(none) == 0


def _events(sent: list[str]) -> list[dict]:
    """Each SSE event's data, checked against its `event:` line."""
    out = []
    for event in sent:
        name, data = event.removesuffix("\n\n").split("\n")
        out.append(json.loads(data.removeprefix("data: ")))
        assert name == f"event: {out[-1]['type']}"
    return out


@pytest.mark.unit
def test_an_answer_that_calls_after_text_closes_the_message_first() -> None:
    """Text, then a call (as the chat path hands them over): the message item is done before
    the call item is added, every event is numbered in order, the last is the response with
    both items and the usage; an error afterwards is one more numbered `error` event."""
    events = ResponseEvents(ResponseObject.starting("resp_1", ResponsesRequest(input="x"), "m"))
    completion = CompletionOutput(0, "Checking.", [5, 6, 7], "stop")
    output = RequestOutput("r", None, [1, 2], [completion], True, metrics=RequestMetrics(0.0),
                           num_cached_tokens=1)
    sent = [*events.start(), *events.text("Check"), *events.text("ing."),
            *events.call_piece(DeltaToolCall(index=0, id="call_1", type="function",
                                             function=DeltaFunctionCall(name="f",
                                                                        arguments='{"a":'))),
            *events.call_piece(DeltaToolCall(index=0, function=DeltaFunctionCall(
                arguments=" 1}"))),
            *events.finish(output, 2),
            events.error(error_body("boom", "internal_server_error"))]
    data = _events(sent)
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    assert [d["type"] for d in data] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed", "error"]
    assert data[2]["item"]["content"] == []  # the part is added by its own event
    assert data[6]["text"] == "Checking." and data[12]["arguments"] == '{"a": 1}'
    final = data[-2]["response"]
    assert [(i["type"], i["status"]) for i in final["output"]] == [
        ("message", "completed"), ("function_call", "completed")]
    assert final["output"][1]["call_id"] == "call_1"
    assert final["usage"]["output_tokens"] == 3 and final["usage"]["total_tokens"] == 5
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 1
    assert data[-1]["code"] == "internal_server_error" and data[-1]["message"] == "boom"


@pytest.mark.unit
def test_an_empty_answer_is_still_a_message() -> None:
    events = ResponseEvents(ResponseObject.starting("resp_2", ResponsesRequest(input="x"), "m"))
    output = RequestOutput("r", None, [1], [CompletionOutput(0, "", [0], "length")], True,
                           metrics=RequestMetrics(0.0))
    data = _events([*events.start(), *events.finish(output, 1)])
    final = data[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["output"][0]["content"][0]["text"] == ""
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


# -- the openai SDK against loom serve ---------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> str:
    with serve("--kv-cache-memory", "256MiB") as url:
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.mark.integration
def test_an_answer_is_the_chat_endpoints_answer(client: openai.OpenAI) -> None:
    response = client.responses.create(model="any", input=QUESTION, instructions="Be brief.",
                                       max_output_tokens=24, temperature=0)
    chat = client.chat.completions.create(
        model="any", max_tokens=24, temperature=0,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": QUESTION}])
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == (response.usage.input_tokens
                                           + response.usage.output_tokens)
    finished = chat.choices[0].finish_reason == "length"
    assert response.status == ("incomplete" if finished else "completed")
    assert (response.incomplete_details is not None) == finished
    assert response.instructions == "Be brief." and response.max_output_tokens == 24


@pytest.mark.integration
def test_a_stream_reassembles_into_the_non_streamed_response(client: openai.OpenAI) -> None:
    options = {"model": "any", "input": "What is the capital of France?",
               "max_output_tokens": 200, "temperature": 0}
    whole = client.responses.create(**options)
    assert whole.status == "completed"  # (the helper below wants response.completed)
    with client.responses.stream(**options) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    deltas = types.count("response.output_text.delta")
    assert deltas >= 2
    assert types == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added",
                     *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.completed"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.integration
def test_a_stream_cut_by_max_output_tokens_ends_incomplete(server: str) -> None:
    body = {"input": QUESTION, "max_output_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server}/v1/responses", json=body, timeout=120) as response:
        lines = [line for line in response.iter_lines() if line]
    events = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    names = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    assert names == [e["type"] for e in events]  # each event named on its own line
    assert "[DONE]" not in lines[-1]
    last = events[-1]
    assert last["type"] == "response.incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["response"]["usage"]["output_tokens"] == 3
    assert last["response"]["output"][0]["status"] == "incomplete"


@pytest.mark.integration
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}],
                         ids=["required", "named"])
def test_function_calls_stream_and_answer_as_items(client: openai.OpenAI,
                                                   tool_choice: object) -> None:
    options = {"model": "any", "input": QUESTION, "tools": TOOLS, "tool_choice": tool_choice,
               "parallel_tool_calls": False, "max_output_tokens": 80, "temperature": 0}
    whole = client.responses.create(**options)
    (call,) = whole.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    with client.responses.stream(**options) as stream:
        events = list(stream)
        final = stream.get_final_response()
    pieces = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    assert pieces == final.output[0].arguments == call.arguments
    assert [e.type for e in events][-3:] == ["response.function_call_arguments.done",
                                             "response.output_item.done",
                                             "response.completed"]


@pytest.mark.integration
def test_a_function_output_continues_the_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(model="any", input=QUESTION, tools=TOOLS,
                                    tool_choice="required", max_output_tokens=80,
                                    temperature=0)
    call = first.output[0]
    turn = [{"role": "user", "content": QUESTION},
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id,
             "output": json.dumps({"celsius": 21, "sky": "sunny"})}]
    second = client.responses.create(model="any", input=turn, tools=TOOLS,
                                     max_output_tokens=40, temperature=0)
    assert second.output and second.status in ("completed", "incomplete")
    assert second.usage.input_tokens > first.usage.input_tokens  # the call and its output
    assert second.usage.input_tokens_details.cached_tokens > 0  # after the same prefix


@pytest.mark.integration
def test_previous_response_id_continues_the_kept_conversation(client: openai.OpenAI) -> None:
    """A second turn naming the first answers as the chat endpoint does given the whole
    conversation, without the first turn's instructions (they do not carry over); a call
    kept in a response is answered by its output alone, and a streamed response is kept too."""
    options = {"model": "any", "max_output_tokens": 16, "temperature": 0}
    first = client.responses.create(input="Name a colour.", instructions="Be brief.", **options)
    assert first.store is True
    second = client.responses.create(input="And another?", previous_response_id=first.id,
                                     **options)
    chat = client.chat.completions.create(
        model="any", max_tokens=16, temperature=0,
        messages=[{"role": "user", "content": "Name a colour."},
                  {"role": "assistant", "content": first.output_text},
                  {"role": "user", "content": "And another?"}])
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.previous_response_id == first.id and second.instructions is None

    called = client.responses.create(input=QUESTION, tools=TOOLS, tool_choice="required",
                                     stream=False, **{**options, "max_output_tokens": 80})
    call = called.output[0]
    output = json.dumps({"celsius": 21})
    answered = client.responses.create(
        previous_response_id=called.id, tools=TOOLS, **options,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": output}])
    whole = client.responses.create(tools=TOOLS, **options, input=[
        {"role": "user", "content": QUESTION},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": output}])
    assert answered.output_text == whole.output_text
    assert answered.usage.input_tokens == whole.usage.input_tokens

    with client.responses.stream(input="Name a fruit.", **options) as stream:
        streamed = stream.get_final_response()
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text


@pytest.mark.integration
def test_kept_responses_are_read_and_deleted_and_store_false_keeps_none(
        client: openai.OpenAI, server: str) -> None:
    options = {"model": "any", "input": "Say hi.", "max_output_tokens": 8, "temperature": 0}
    kept = client.responses.create(**options)
    read = client.responses.retrieve(kept.id)
    assert (read.id, read.output_text, read.usage.total_tokens) == (
        kept.id, kept.output_text, kept.usage.total_tokens)
    head = httpx.head(f"{server}/v1/responses/{kept.id}")  # as every GET route
    assert head.status_code == 200 and head.content == b""
    client.responses.delete(kept.id)
    assert httpx.head(f"{server}/v1/responses/{kept.id}").status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    unkept = client.responses.create(store=False, **options)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(previous_response_id=unkept.id, **options)
    assert caught.value.body["param"] == "previous_response_id"


@pytest.mark.integration
def test_text_format_json_schema_constrains_the_answer(client: openai.OpenAI) -> None:
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 20},
                             "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
    response = client.responses.create(
        model="any", input="Describe a person.", max_output_tokens=60, temperature=1.0,
        text={"format": {"type": "json_schema", "name": "person", "schema": schema}})
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"


@pytest.mark.integration
@pytest.mark.parametrize(("options", "param"), [
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 10 ** 6}, "max_output_tokens"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a",
                                        "schema": {"type": "nonsense"}}}}, "text"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}]},
     "input"),
    ({"input": "x", "tool_choice": "required",
      "tools": [{"type": "function", "name": "f", "parameters": {"type": "nonsense"}}]},
     "tools"),
    # what a response keeps stays within OpenAI's limits
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"input": "x", "metadata": {"k": "v" * 513}}, "metadata"),
    ({"input": "x", "user": "u" * 513}, "user"),
])
def test_bad_requests_are_400s_naming_the_field(client: openai.OpenAI, options: dict,
                                                param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="any", **options)
    assert caught.value.body["param"] == param


@pytest.mark.integration
@pytest.mark.parametrize(("options", "param"), [
    ({"metadata": {"k": "\ud800"}}, "metadata"),
    ({"user": "\udfff"}, "user"),
    ({"tools": [{"type": "function", "name": "f\ud800"}]}, "tools"),
])
def test_lone_surrogates_in_echoed_fields_are_400s(server: str, options: dict,
                                                   param: str) -> None:
    """Fields a response echoes back once took a lone surrogate ("\\ud800", as a client's
    JSON writes it) and failed at the echo: a 500, and for a stream a stored response that
    every GET answered with a 500."""
    for stream in (False, True):
        body = json.dumps({"model": "any", "input": "x", "max_output_tokens": 2,
                           "stream": stream, **options})
        answer = httpx.post(f"{server}/v1/responses", content=body,
                            headers={"content-type": "application/json"}, timeout=60)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param


@pytest.mark.integration
def test_an_openai_agents_sdk_agent_calls_a_tool_through_loom(server: str) -> None:
    """The OpenAI Agents SDK, an agent framework written against OpenAI's own server, runs an
    agent on loom over /v1/responses: it calls the tool, gets the result back into the
    conversation and ends with an answer, streamed and not."""
    import asyncio

    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # (it would post traces to OpenAI)
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        cities.append(city)
        return json.dumps({"city": city, "celsius": 21, "sky": "sunny"})

    async def run_both() -> tuple[object, object, int]:
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
        agent = Agent(name="weather", instructions="You answer questions about the weather.",
                      tools=[get_weather],
                      model=OpenAIResponsesModel(model="any", openai_client=client),
                      model_settings=ModelSettings(tool_choice="required", max_tokens=200,
                                                   temperature=0))
        whole = await Runner.run(agent, QUESTION, max_turns=2)
        streamed = Runner.run_streamed(agent, QUESTION, max_turns=2)
        events = [event async for event in streamed.stream_events()]
        return whole.final_output, streamed.final_output, len(events)

    whole, streamed, num_events = asyncio.run(run_both())
    assert len(cities) == 2 and all(cities)  # one call a run, with the required argument
    assert whole and whole == streamed  # greedy: the same answer either way
    assert num_events > 4


@pytest.mark.integration
def test_logprobs_as_chat_gives_them_streamed_and_not(client: openai.OpenAI) -> None:
    """top_logprobs (or include) asks for the answer's per-token logprobs: the chat endpoint's
    for the same conversation, the streamed deltas' adding up to the non-streamed list."""
    options = {"model": "any", "input": "Name a colour.", "max_output_tokens": 12,
               "temperature": 0, "top_logprobs": 2}
    whole = client.responses.create(**options)
    chat = client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=12,
        temperature=0, logprobs=True, top_logprobs=2)
    part = whole.output[0].content[0]
    expected = chat.choices[0].logprobs.content
    assert [(e.token, len(e.top_logprobs)) for e in part.logprobs] == [
        (e.token, 2) for e in expected]
    # (the second request reads the first's prompt from the fp16 prefix cache: not bitwise)
    assert [e.logprob for e in part.logprobs] == pytest.approx([e.logprob for e in expected],
                                                               abs=1e-2)
    longer = {**options, "max_output_tokens": 200}  # to its end: an EOS, which has no text
    with client.responses.stream(**longer) as stream:
        events = list(stream)
    streamed = [lp.token for e in events if e.type == "response.output_text.delta"
                for lp in e.logprobs]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    everything = [lp.token for lp in done.logprobs]
    assert streamed and everything[:len(streamed)] == streamed  # the rest: tokens with no text
    assert everything == [lp.token for lp in
                          client.responses.create(**longer).output[0].content[0].logprobs]
    included = client.responses.create(**{k: v for k, v in options.items()
                                          if k != "top_logprobs"},
                                       include=["message.output_text.logprobs"])
    assert [e.token for e in included.output[0].content[0].logprobs] == [
        e.token for e in part.logprobs]
    plain = client.responses.create(**{k: v for k, v in options.items() if k != "top_logprobs"})
    assert not plain.output[0].content[0].logprobs
