"""`loom serve --model <a Qwen3 or Gemma 3 GGUF>` end to end with the official openai client:
chat, streaming, forced tool calls, structured outputs, reasoning content, and the prompt the
server renders equal to transformers' rendering of the same template.

Each model is tiny with random weights (benchmarks/synthetic_gguf.py) but carries its family's
real vocabulary and a real chat template from llama.cpp's tree: Qwen3 the Qwen2 vocabulary
with the four tokens Qwen3 adds to it (`<think>` among them) and Qwen3's template; Gemma 3
the 262k-token Gemma vocabulary of the tree's Gemma 4 vocab file (the tree has no Gemma 3
vocabulary or template) and Gemma 2's template, the `<start_of_turn>` format Gemma 3 keeps.
Gemma 3's layers are five sliding (a window shorter than a test's prompt and answer) to a
global one, as llama.cpp lays them out. Random weights write no tool call, JSON or `<think>`
of their own: tool_choice, a JSON schema and a regex make them, as a client would."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from llama_cpp_tree import llama_cpp_tree
from openai import OpenAI
from server_helpers import serve_process
from transformers.utils.chat_template_utils import render_jinja_template

from benchmarks import synthetic_gguf
from loom.model.gguf_file import read_gguf

WINDOW = 16  # Gemma 3's sliding window, in tokens
MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 12}}}}}
CITY_SCHEMA = {"type": "object", "required": ["city", "rank"], "additionalProperties": False,
               "properties": {"city": {"type": "string", "maxLength": 12},
                              "rank": {"type": "integer", "minimum": 1, "maximum": 9}}}


# What Qwen3's tokenizer adds to Qwen2.5's (tokenizer.json's added_tokens, not special: the
# vocab file holds [PAD<id>] user-defined placeholders there)
QWEN3_ADDED_TOKENS = {151665: "<tool_response>", 151666: "</tool_response>", 151667: "<think>",
                      151668: "</think>"}


@dataclass(frozen=True)
class Family:
    name: str
    shape: synthetic_gguf.Shape
    vocab: str  # llama.cpp's models/ggml-vocab-<vocab>.gguf
    template: str  # llama.cpp's models/templates/<template>.jinja
    flags: tuple[str, ...] = ()
    added_tokens: dict[int, str] = field(default_factory=dict)  # replacing the file's


FAMILIES = {
    "qwen3": Family("qwen3", synthetic_gguf.Shape("qwen3", hidden=64, ffn=128, layers=2,
                                                  heads=2, kv_heads=1, head_dim=64),
                    "qwen2", "Qwen-Qwen3-0.6B", ("--reasoning-parser", "qwen3"),
                    QWEN3_ADDED_TOKENS),
    "gemma3": Family("gemma3", synthetic_gguf.Shape("gemma3", hidden=64, ffn=128, layers=6,
                                                    heads=2, kv_heads=1, head_dim=64,
                                                    window=WINDOW),
                     "gemma-4", "google-gemma-2-2b-it"),
}


@dataclass(frozen=True)
class Served:
    family: Family
    url: str
    client: OpenAI
    template: str
    special_tokens: dict[str, str]  # bos_token and eos_token, as the template sees them


def _special_tokens(path: Path) -> dict[str, str]:
    meta = read_gguf(path).metadata
    tokens = meta["tokenizer.ggml.tokens"]
    return {name: tokens[meta[f"tokenizer.ggml.{name}_id"]] for name in ("bos_token", "eos_token")}


def vocabulary(family: Family) -> dict[str, Any]:
    """The header of the family's vocab file, with the family's added tokens in it."""
    vocab = read_gguf(llama_cpp_tree() / "models" / f"ggml-vocab-{family.vocab}.gguf").metadata
    tokens = list(vocab["tokenizer.ggml.tokens"])
    for token_id, text in family.added_tokens.items():
        assert tokens[token_id] == f"[PAD{token_id}]"
        tokens[token_id] = text
    return {**vocab, "tokenizer.ggml.tokens": tokens}


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Served]:
    family = FAMILIES[request.param]
    models = llama_cpp_tree() / "models"
    template = (models / "templates" / f"{family.template}.jinja").read_text()
    path = tmp_path_factory.mktemp(family.name) / f"{family.name}.gguf"
    synthetic_gguf.write(family.shape, vocabulary(family), str(path), chat_template=template)
    with serve_process("--model", str(path), "--max-model-len", "512", "--num-kv-blocks",
                       "128", "--generation-config", "none", *family.flags) as server:
        yield Served(family, server.url, OpenAI(base_url=server.url + "/v1", api_key="x"),
                     template, _special_tokens(path))


def transformers_prompt(served: Served, messages: list[dict[str, Any]], **variables: Any) -> str:
    rendered, _ = render_jinja_template(conversations=[messages], chat_template=served.template,
                                        add_generation_prompt=True,
                                        **served.special_tokens, **variables)
    return rendered[0]


def tokenize(served: Served, **body: Any) -> list[int]:
    answer = httpx.post(served.url + "/tokenize", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["tokens"]


def chat(served: Served, **extra: Any) -> Any:
    return served.client.chat.completions.create(model=served.family.name, messages=MESSAGES,
                                                 temperature=0, **extra)


@pytest.mark.integration
def test_the_prompt_is_transformers_rendering(served: Served) -> None:
    """The chat the server tokenizes is the template as transformers renders it: the same
    tokens as that text, the count the answer's usage reports."""
    ids = tokenize(served, messages=MESSAGES)
    text = transformers_prompt(served, MESSAGES)
    assert ids == tokenize(served, prompt=text, add_special_tokens=False)
    assert ids.count(tokenize(served, prompt=served.special_tokens["bos_token"],
                              add_special_tokens=False)[0]) <= 1  # no second BOS
    answer = chat(served, max_tokens=2)
    assert answer.usage.prompt_tokens == len(ids)


@pytest.mark.integration
def test_streamed_deltas_are_the_answer(served: Served) -> None:
    """At temperature 0 the streamed deltas add up to the whole answer; Gemma 3's prompt and
    answer outrun its sliding window, so its local layers drop positions on the way."""
    answer = chat(served, max_tokens=24)
    text = answer.choices[0].message.content
    assert answer.usage.completion_tokens == 24 and text
    assert answer.usage.prompt_tokens + answer.usage.completion_tokens > 2 * WINDOW
    chunks = list(chat(served, max_tokens=24, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.integration
@pytest.mark.parametrize("tool_choice", [
    {"type": "function", "function": {"name": "get_weather"}}, "required"],
    ids=["named", "required"])
def test_a_forced_tool_call_parses(served: Served, tool_choice: Any) -> None:
    answer = chat(served, max_tokens=64, tools=[WEATHER], tool_choice=tool_choice)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])


@pytest.mark.integration
def test_structured_output_is_valid_against_its_schema(served: Served) -> None:
    answer = chat(served, max_tokens=64, response_format={
        "type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA,
                                               "strict": True}})
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), CITY_SCHEMA)


# A client making a thinking model reason (its weights are random): the answer must open with a
# <think> block, then say a few words
THINKING = r"<think>[a-z]{1,8}( [a-z]{1,8}){0,2}</think>\n\n[A-Z][a-z]{1,8}\."


@pytest.mark.integration
def test_qwen3_reasoning_is_split_from_the_content(served: Served) -> None:
    """--reasoning-parser qwen3: what the answer writes inside <think>...</think> is
    message.reasoning_content, the rest content; streamed, as reasoning_content deltas."""
    if served.family.name != "qwen3":
        pytest.skip("the reasoning parser is Qwen3's")
    assert tokenize(served, prompt="<think>", add_special_tokens=False) == [151667]
    extra = {"structured_outputs": {"regex": THINKING}}
    answer = chat(served, max_tokens=48, extra_body=extra)
    message = answer.choices[0].message
    whole = re.fullmatch(r"<think>(.*)</think>\n\n(.*)", f"<think>{message.reasoning_content}"
                         f"</think>\n\n{message.content}", re.S)
    assert whole and re.fullmatch(THINKING, whole.group(0)), message
    assert "<think>" not in message.content and message.reasoning_content
    reasoning, content = "", ""
    for chunk in chat(served, max_tokens=48, extra_body=extra, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, message.content)


@pytest.mark.integration
def test_enable_thinking_reaches_the_template(served: Served) -> None:
    """chat_template_kwargs are the template's variables: Qwen3's writes an empty
    <think></think> for enable_thinking false, as transformers renders it; the answer is then
    all content. Gemma's template has no such variable: the same prompt."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    ids = tokenize(served, messages=MESSAGES, **off)
    text = transformers_prompt(served, MESSAGES, enable_thinking=False)
    assert ids == tokenize(served, prompt=text, add_special_tokens=False)
    thinks = served.family.name == "qwen3"
    assert (ids != tokenize(served, messages=MESSAGES)) == thinks
    assert text.endswith("<think>\n\n</think>\n\n") == thinks
    answer = chat(served, max_tokens=4, extra_body=off)
    assert answer.usage.prompt_tokens == len(ids)
    assert getattr(answer.choices[0].message, "reasoning_content", None) is None


@pytest.mark.integration
@pytest.mark.parametrize("arch", ["bert", "mamba"])
def test_an_unsupported_architecture_is_one_clear_line(arch: str, tmp_path: Path) -> None:
    """`loom serve` refuses a GGUF of an architecture it does not run with one line that names
    the file, its architecture and what loom runs, and exits non-zero, before any port."""
    import gguf

    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.block_count", 1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    run = subprocess.run([sys.executable, "-m", "loom.cli", "serve", "--model", str(path),
                          "--port", "0"], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    lines = [line for line in run.stderr.splitlines() if "unsupported architecture" in line]
    assert len(lines) == 1, run.stderr
    assert f"'{arch}'" in lines[0] and path.name in lines[0]
    assert all(name in lines[0] for name in ("'qwen3'", "'gemma3'", "'llama'"))
    assert "Traceback" not in run.stderr


@pytest.mark.unit
def test_the_tool_prompt_opens_the_first_user_turn_without_a_system_turn() -> None:
    from loom.model.tokenizer import hermes_tool_messages

    with_system = hermes_tool_messages(MESSAGES, [WEATHER])
    assert [m["role"] for m in with_system] == ["system", "user"]
    (user,) = hermes_tool_messages(MESSAGES, [WEATHER], system_turn=False)
    assert user["role"] == "user" and user["content"].startswith(with_system[0]["content"])
    assert user["content"].endswith("\n\n" + MESSAGES[0]["content"])


@pytest.mark.unit
def test_a_grammar_writes_an_added_token_as_its_text() -> None:
    """Qwen3's <think> is an added token that is not special: a regex that writes `<think>`
    takes it (or the text's pieces), and no control token; the grammar engine's own reader
    of a tokenizer.json made every added token special, then forced and refused it."""
    import time

    from loom.model.model_files import tokenizer_from_gguf
    from loom.sampling import StructuredOutputsParams
    from loom.structured.manager import StructuredOutputManager

    tokenizer = tokenizer_from_gguf(vocabulary(FAMILIES["qwen3"]))
    manager = StructuredOutputManager(tokenizer, 151936)
    states = {ids: manager.start(str(i), StructuredOutputsParams(regex="<think>a"))
              for i, ids in enumerate([(151667, 64), (27, 26865, 29, 64), (151645,)])}
    deadline = time.monotonic() + 60
    while not all(state.ready for state in states.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    for ids, state in states.items():
        assert state.error is None, state.error
        assert state.num_allowed(list(ids)) == (0 if ids == (151645,) else len(ids)), ids
