"""Agent frameworks, unchanged, against `loom serve` on loopback: the openai SDK's
`chat.completions.parse` with a pydantic model (a `set` of an `Enum`, an `Enum`), pydantic-ai's
default structured output (a required output tool), LangChain's `bind_tools` over chat and
over the Responses API. Each returned a 400 (`uniqueItems`), or a call that never ended."""

from __future__ import annotations

import enum

import openai
import pytest
from pydantic import BaseModel, Field
from server_helpers import serve

pytestmark = pytest.mark.integration


class Colour(enum.Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Fruit(BaseModel):
    name: str = Field(max_length=20)
    colours: set[Colour]
    main: Colour


@pytest.fixture(scope="module")
def url() -> str:
    with serve("--kv-cache-memory", "256MiB", "--max-tokens-default", "256") as base:
        yield f"{base}/v1"


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


def test_openai_parse_with_a_set_and_an_enum(url: str) -> None:
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    answer = client.chat.completions.parse(
        model="any", response_format=Fruit, max_tokens=200, temperature=0,
        messages=[{"role": "user", "content": "Describe a banana."}])
    fruit = answer.choices[0].message.parsed
    assert isinstance(fruit, Fruit) and isinstance(fruit.main, Colour)
    assert all(isinstance(c, Colour) for c in fruit.colours)


def test_pydantic_ai_default_structured_output(url: str) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("any", provider=OpenAIProvider(base_url=url, api_key="unused"))
    agent = Agent(model, output_type=Fruit, model_settings={"temperature": 0})
    result = agent.run_sync("Describe a banana.")
    assert isinstance(result.output, Fruit)


@pytest.mark.parametrize("responses_api", [False, True], ids=["chat", "responses"])
def test_langchain_bind_tools_returns_parsed_calls(url: str, responses_api: bool) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="any", base_url=url, api_key="unused", temperature=0,
                     max_tokens=200, max_retries=0, use_responses_api=responses_api)
    message = llm.bind_tools([get_weather], tool_choice="any").invoke(
        "What is the weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str)
