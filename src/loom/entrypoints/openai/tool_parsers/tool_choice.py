"""What a chat request's `tools` and `tool_choice` ask of the answer.

`auto` lets the model choose and a parser finds its calls; `required` and a named function
are enforced with a JSON schema (structured outputs), so the arguments always parse:
`required` makes the answer a list of {"name", "parameters"} objects, one of the listed
functions each, as vLLM does; a named function makes it that function's arguments.

The list is bounded: one call, or up to MAX_PARALLEL_CALLS with `parallel_tool_calls: true`.
Unbounded, a small model repeated its call until max_tokens, and the answer, cut mid-call,
carried no call at all. An answer cut short keeps the calls it completed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from loom.entrypoints.openai.tool_parsers.base import ParsedToolCall, strict_json

Mode = Literal["none", "auto", "required", "named"]
_ANY_OBJECT: dict[str, Any] = {"type": "object"}
MAX_PARALLEL_CALLS = 8  # calls of one `required` answer with parallel_tool_calls: true


@dataclass(frozen=True)
class ToolUse:
    mode: Mode
    tools: list[dict[str, Any]]  # as the chat template gets them (OpenAI's shape)
    named: str | None = None
    parallel: bool = False  # `required` may make several calls (up to MAX_PARALLEL_CALLS)

    @classmethod
    def of(cls, tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
           parallel: bool = False) -> ToolUse:
        """Raises ValueError (naming `tools` or `tool_choice`) for a choice that cannot
        be met."""
        if not tools:
            if tool_choice not in (None, "none"):
                raise ValueError("tool_choice: needs tools")
            return cls("none", [])
        names = [t["function"]["name"] for t in tools]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:  # a call names its function: two of one name could not be told apart
            raise ValueError(f"tools: function names must be unique; {twice[0]!r} is given "
                             "more than once")
        if tool_choice is None or tool_choice in ("auto", "none", "required"):
            return cls(tool_choice or "auto", tools if tool_choice != "none" else [],
                       parallel=parallel)
        name = tool_choice["function"]["name"]
        if name not in {t["function"]["name"] for t in tools}:
            raise ValueError(f"tool_choice: function {name!r} is not among the tools")
        return cls("named", tools, name, parallel)

    @property
    def enforced(self) -> bool:
        """The answer is written under the calls' schema: it is calls, never content."""
        return self.mode in ("required", "named")

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema that enforces this choice (None: nothing to enforce)."""
        if self.mode == "named":
            return self._parameters(self.named)
        if self.mode != "required":
            return None
        defs: dict[str, Any] = {}  # every tool's own $defs, moved to the root they refer to
        options = [{"type": "object",
                    "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                   "parameters": _hoisted(
                                       self._parameters(t["function"]["name"]), f"t{i}_", defs)},
                    "required": ["name", "parameters"], "additionalProperties": False}
                   for i, t in enumerate(self.tools)]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": options},
                  "maxItems": MAX_PARALLEL_CALLS if self.parallel else 1}
        return {**schema, "$defs": defs} if defs else schema

    def _parameters(self, name: str | None) -> dict[str, Any]:
        """A function's parameter schema as enforced: where it lists its properties and says
        nothing of others, no others (a small model went on adding keys of its own until
        max_tokens; the function could not have taken them)."""
        function = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        parameters = function.get("parameters") or _ANY_OBJECT
        if "properties" in parameters and "additionalProperties" not in parameters:
            return {**parameters, "additionalProperties": False}
        return parameters

    def enforced_calls(self, text: str) -> list[ParsedToolCall]:
        """The calls of an answer that `schema()` constrained: for `required` those it
        completed, if it was cut short; for a named function, none then."""
        if self.mode == "named":
            try:
                value = strict_json(text)
            except ValueError:
                return []
            return [ParsedToolCall(self.named, json.dumps(value, ensure_ascii=False))]
        return [ParsedToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
                for item in complete_items(text)]


def _hoisted(parameters: dict[str, Any], prefix: str, defs: dict[str, Any]) -> Any:
    """A tool's parameter schema nested in the `required` schema: its `$defs` (pydantic's
    models, enums) go to `defs`, renamed with `prefix` so tools cannot clash, and its local
    `$ref`s follow them there."""
    own = {**parameters.get("$defs", {}), **parameters.get("definitions", {})}
    if not own:
        return parameters
    renamed = {f"#/{kind}/{name}": f"#/$defs/{prefix}{name}"
               for kind in ("$defs", "definitions") for name in own}

    def moved(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: renamed.get(v, v) if k == "$ref" and isinstance(v, str) else moved(v)
                    for k, v in value.items() if k not in ("$defs", "definitions")}
        if isinstance(value, list):
            return [moved(v) for v in value]
        return value

    defs.update({f"{prefix}{name}": moved(schema) for name, schema in own.items()})
    return moved(parameters)


def complete_items(text: str) -> list[Any]:
    """The items of a JSON array that are whole, of an array that may be cut anywhere (the
    grammar wrote it, so it is `[` item (`, ` item)* `]` as far as it goes)."""
    decoder = json.JSONDecoder()
    items: list[Any] = []
    at = text.find("[") + 1
    if at == 0:
        return items
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        try:
            _, end = decoder.raw_decode(text, at)
            items.append(strict_json(text[at:end]))  # finite numbers, as clients parse them
        except (ValueError, RecursionError):
            return items
        at = end
