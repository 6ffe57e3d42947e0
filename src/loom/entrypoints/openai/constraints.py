"""A request's structured-output constraint: which of its fields asked for one (vLLM's
`structured_outputs`, a `guided_*` field, OpenAI's `response_format`), at most one of them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from loom.entrypoints.openai.errors import APIError
from loom.entrypoints.openai.protocol import SamplingRequest
from loom.sampling import StructuredOutputsParams


@dataclass(frozen=True)
class Constraint:
    """A request's structured-output constraint and the field that carried it (what its
    errors name)."""

    params: StructuredOutputsParams
    param: str


def fields_kind(fields: Mapping[str, object]) -> str:
    """The one structured-output kind `fields` set (for error messages), or ""."""
    return next((k for k, v in fields.items() if v not in (None, False)), "")


def structured_spec(request: SamplingRequest, format_param: str
                     ) -> tuple[str, dict[str, object]] | None:
    """(the request field that asked, StructuredOutputsParams' fields), or None;
    `format_param` is what the API calls `response_format` (the Responses API: `text`). Two
    of those fields at once is a 400 naming the second: neither would be silently dropped."""
    so, fmt = request.structured_outputs, request.response_format
    guided = {"json": request.guided_json, "regex": request.guided_regex,
              "choice": request.guided_choice, "grammar": request.guided_grammar}
    given = [kind for kind, value in guided.items() if value is not None]
    asked = ["structured_outputs"] if so is not None else []
    asked += [f"guided_{kind}" for kind in given[:1]]
    if fmt is not None and fmt.type != "text":
        asked.append(format_param)
    if len(asked) > 1:
        raise APIError(400, f"{asked[1]}: one kind of structured output per request, and "
                       f"{asked[0]} is set too", asked[1])
    if so is not None:
        return "structured_outputs", {"json": so.json_, "regex": so.regex,
                                      "choice": so.choice, "grammar": so.grammar,
                                      "json_object": bool(so.json_object)}
    if given:
        return f"guided_{given[0]}", guided
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return format_param, {"json_object": True}
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise APIError(400, f"{format_param}: type json_schema needs json_schema.schema",
                       format_param)
    return format_param, {"json": fmt.json_schema.json_schema}
