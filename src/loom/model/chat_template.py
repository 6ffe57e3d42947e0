"""Chat templates rendered exactly as transformers renders them (`render_jinja_template`).

A model's template is Jinja written against transformers' environment, so that environment is
what loom rebuilds: a sandbox with `trim_blocks` and `lstrip_blocks`, loop controls
(`{% break %}`), the `{% generation %}` tag (training-only: it renders its body), a `tojson`
that keeps non-ASCII and `<` as they are and takes `indent` / `separators` / `sort_keys`,
`raise_exception`, `strftime_now`, and a `namespace` and `dict` that refuse what the
sandbox would let a template reach through them. The messages go in as transformers passes
them: keys whose value is None dropped (templates test for a key, and print "None" for one
that is present), and a turn's reasoning under every name templates read it by
(`reasoning_content`, and `thinking` for gpt-oss). Anything the request adds
(`chat_template_kwargs`, e.g. `enable_thinking`) is a variable of the template, and so are
the special tokens (`bos_token`, `eos_token`, ...).

jinja2 is imported on first use: the engine process never renders a template.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jinja2

# Variables the renderer sets itself: a request's chat_template_kwargs may not name them.
RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The template refused the conversation (its raise_exception) or could not render it."""


def render_chat_template(source: str, messages: list[dict[str, Any]],
                         tools: list[dict[str, Any]] | None = None,
                         add_generation_prompt: bool = False,
                         variables: Mapping[str, Any] | None = None) -> str:
    """`source` rendered over `messages` (transformers' shape: a tool call's arguments as a
    dict), `tools` (OpenAI's shape) and `variables` (special tokens, chat_template_kwargs).
    Raises ChatTemplateError with the template's own message."""
    import jinja2

    reserved = RESERVED_VARIABLES & set(variables or {})
    if reserved:
        raise ChatTemplateError(f"{sorted(reserved)[0]!r} is set by the server, not by "
                                "chat_template_kwargs")
    try:
        return _compiled(source).render(
            messages=[_template_message(m) for m in messages], tools=tools, documents=None,
            add_generation_prompt=add_generation_prompt, **(variables or {}))
    except jinja2.TemplateError as e:
        raise ChatTemplateError(str(e)) from e


def _template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as transformers hands it to a template (see the module docstring)."""
    kept = {key: value for key, value in message.items() if value is not None}
    reasoning = next((kept[k] for k in _REASONING_FIELDS if k in kept), None)
    if reasoning is not None:
        kept = {"thinking": reasoning, **kept, "reasoning_content": reasoning}
    return kept


@functools.lru_cache(maxsize=16)
def _compiled(source: str) -> jinja2.Template:
    """Compiled once per template text (compiling is most of a short chat's render)."""
    import jinja2

    try:
        return _environment().from_string(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e}") from e


@functools.cache
def _environment() -> jinja2.Environment:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.sandbox
    import jinja2.utils

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks what the assistant wrote, for
        training masks; rendering keeps its body as it is."""

        tags = {"generation"}

        def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body
                                          ).set_lineno(lineno)

        @staticmethod
        def _body(caller: Any) -> str:
            return caller()

    class TemplateNamespace(jinja2.utils.Namespace):
        """`namespace(...)` whose attributes may not start with `_` (no way to CPython's)."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            for name in dict(*args, **kwargs):
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, *args, **kwargs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a chat template may not set the attribute {name!r} on a namespace")

    class TemplateDict:
        """`dict(...)` and `dict.fromkeys(...)`, and nothing else of the type."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env
