"""Bounded fuzzing of the structured-output and tool fields (hypothesis) against the app
in-process over the bundled model: whatever a client puts there is answered, or refused with
a 4xx naming the field, never a 5xx. And a failure no handler answers is logged once."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loom.config import EngineConfig
from loom.engine.async_engine import AsyncEngine
from loom.engine.core import EngineCore
from loom.entrypoints.openai.server import ServerConfig, build_app

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def engine() -> AsyncEngine:
    core = EngineCore(EngineConfig.from_kwargs(kv_cache_memory="64MiB", max_model_len=1024))
    return AsyncEngine(core, max_num_seqs=core.config.scheduler.max_num_seqs)


@pytest.fixture(scope="module")
def client(engine: AsyncEngine) -> Iterator[TestClient]:
    with TestClient(build_app(engine, ServerConfig()), base_url="http://127.0.0.1",
                    raise_server_exceptions=False) as http:
        yield http


names = st.text(st.characters(codec="utf-8"), max_size=8)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**20, 10**20),
                    st.floats(allow_nan=False, allow_infinity=False), names)
TYPES = ["string", "number", "integer", "boolean", "null", "object", "array", "nonsense"]
KEYWORDS = ("type", "properties", "items", "enum", "const", "minimum", "maximum", "minLength",
            "maxLength", "pattern", "format", "anyOf", "oneOf", "allOf", "$ref", "required",
            "additionalProperties", "uniqueItems", "not", "if", "then", "else", "multipleOf",
            "minItems", "maxItems", "$defs", "x-guidance")


def schemas() -> st.SearchStrategy[object]:
    """Schema-shaped values: the keywords pydantic and clients send, with values of every
    kind (mostly sensible, often not)."""
    leaves = st.one_of(
        scalars, st.sampled_from(TYPES), st.lists(st.sampled_from(TYPES), max_size=3),
        st.sampled_from(["#", "#/$defs/a", "#/nowhere", "date-time", "regex", r"\d+", "a(b",
                         "^[a-z]{2,}$"]))

    def node(children: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
        value = st.one_of(leaves, children, st.lists(children, max_size=3),
                          st.dictionaries(names, children, max_size=3))
        return st.dictionaries(st.sampled_from(KEYWORDS), value, max_size=4)

    base = st.one_of(st.booleans(), st.dictionaries(st.sampled_from(KEYWORDS), leaves,
                                                    max_size=4))
    return st.recursive(base, node, max_leaves=12)


texts = st.text(st.characters(codec="utf-8"), max_size=40)
grammars = st.one_of(texts, st.sampled_from([
    'start: start "a"', 'start: "a" | start "a"', "root ::= [0-9]+", "start: /[a-z]+/",
    'start: x\nx: "a" x', "start: %json {}"]))
tool_choices = st.one_of(st.none(), st.sampled_from(["none", "auto", "required", "bogus"]),
                         st.fixed_dictionaries({"type": st.just("function"), "function":
                                                st.fixed_dictionaries({"name": names})}))


def tools() -> st.SearchStrategy[list[dict]]:
    function = st.fixed_dictionaries(
        {"name": st.one_of(st.just("f"), names)},
        optional={"parameters": schemas(), "description": texts})
    return st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": function}),
                    max_size=3)


constraints = st.one_of(
    st.fixed_dictionaries({"guided_json": st.one_of(schemas(), schemas().map(json.dumps))}),
    st.fixed_dictionaries({"structured_outputs": st.fixed_dictionaries(
        {}, optional={"json": schemas(), "regex": texts, "choice": st.lists(texts, max_size=4),
                      "grammar": grammars, "json_object": st.booleans()})}),
    st.fixed_dictionaries({"response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])},
        optional={"json_schema": st.fixed_dictionaries({"name": names},
                                                       optional={"schema": schemas()})})}),
    st.fixed_dictionaries({"guided_regex": texts}),
    st.fixed_dictionaries({"guided_choice": st.lists(texts, max_size=4)}),
    st.fixed_dictionaries({"guided_grammar": grammars}),
    st.fixed_dictionaries({"tools": tools(), "tool_choice": tool_choices},
                          optional={"parallel_tool_calls": st.booleans()}),
)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(fields=constraints, endpoint=st.sampled_from(["chat", "responses", "completions"]),
       stream=st.booleans())
def test_structured_and_tool_fields_never_make_a_5xx(client: TestClient, fields: dict,
                                                     endpoint: str, stream: bool) -> None:
    if endpoint == "responses":
        fields = {k: v for k, v in fields.items() if k in ("tools", "tool_choice")} or {
            "text": {"format": fields.get("response_format", {"type": "text"})}}
        tools_ = fields.get("tools")
        if tools_:  # the Responses API writes tools flat
            fields["tools"] = [{"type": "function", **t["function"]} for t in tools_]
        body = {"input": "Hi", "max_output_tokens": 3, **fields}
        path = "/v1/responses"
    elif endpoint == "chat":
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, **fields}
        path = "/v1/chat/completions"
    else:
        body = {"prompt": "Hi", "max_tokens": 3,
                **{k: v for k, v in fields.items() if k not in ("tools", "tool_choice",
                                                                 "parallel_tool_calls")}}
        path = "/v1/completions"
    answer = client.post(path, json={**body, "stream": stream})
    assert answer.status_code < 500, (path, body, answer.text[:500])
    if answer.status_code >= 400:
        assert answer.json()["error"]["message"]
    elif stream:
        assert '"internal_server_error"' not in answer.text, (path, body, answer.text[-500:])


def test_a_failure_no_handler_answers_is_a_500_logged_once(engine: AsyncEngine, caplog,
                                                           monkeypatch) -> None:
    """Each such failure logged its traceback twice (the handler, then uvicorn)."""
    app = build_app(engine, ServerConfig())

    def broken(requests: object) -> None:
        raise RuntimeError("the step failed")

    monkeypatch.setattr(engine, "submit", broken)
    http = TestClient(app, base_url="http://127.0.0.1",  # no lifespan: the engine runs
                      raise_server_exceptions=False)
    with caplog.at_level(logging.ERROR):
        answer = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                           headers={"X-Request-Id": "broken-1"})
    assert answer.status_code == 500 and "the step failed" not in answer.text
    assert answer.headers["x-request-id"] == "broken-1"
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1, [r.getMessage() for r in caplog.records]
