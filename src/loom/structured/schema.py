"""A client's JSON schema and regex made ready for the grammar engine: bounds on what a schema
leaves unbounded, the keywords pydantic emits that llguidance refuses (approximated by a
stated rule), and `\\d` read the same way in a regex as in a schema's `pattern`.

Bounds. A small model filled whole token budgets with one number (`1.1971000000...`, which
broke the OpenAI Agents SDK's `output_type`) or one string. So, unless the schema's own bounds
are tighter:

- a `number` has at most NUMBER_FRACTION_DIGITS digits after the point (as `multipleOf`
  10^-6; a schema's own `multipleOf` replaces it) and a magnitude of at most NUMBER_BOUND;
- an `integer` stays within +-INTEGER_BOUND (2^53 - 1: what every JSON reader keeps exact);
- a `string` has at most MAX_STRING_LENGTH characters.

A schema's `maximum` / `minimum` / `maxLength` above these are lowered to them. Values with
an `enum` or `const` are bounded already and left alone; so is a schema that allows any value
(`{}`, `true`), whose numbers and strings are the grammar engine's own.

Approximations, each a relaxation (every answer that satisfies the schema is still allowed;
a few that do not are too):

- `uniqueItems` is dropped: items may repeat (pydantic's `set` fields parse such a list all
  the same); where the items are one of an `enum` (pydantic's `set[SomeEnum]`), the array is
  bounded by the enum's size instead (`maxItems`), since a unique list can hold no more;
- `not` is dropped;
- `if` / `then` / `else` becomes `anyOf: [allOf: [if, then], else]` when both branches are
  given; with only one of them the three are dropped;
- a `format` llguidance does not know (`regex`, `binary`, `password`, ...) is dropped: any
  string, within the length bound. Known ones (`date-time`, `date`, `time`, `email`, `uri`,
  `uuid`, `ipv4`, ...) are enforced.

Regexes: llguidance reads `\\d` in a regex as any Unicode digit (emoji digits came out), but in
a schema's `pattern` as ASCII, as JSON Schema (ECMAScript) does; a regex's `\\d` / `\\D` become
`[0-9]` / `[^0-9]`, so both mean ASCII.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

NUMBER_FRACTION_DIGITS = 6
NUMBER_BOUND = 1e15
INTEGER_BOUND = 2**53 - 1
MAX_STRING_LENGTH = 4096

# Keywords whose value is a map of subschemas, one subschema, or a list of them.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("items", "additionalProperties", "contains", "propertyNames", "additionalItems",
               "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


def prepare_schema(schema: Any, known_format: Callable[[str], bool], root: Any = None) -> Any:
    """A copy of `schema` bounded and approximated as the module says; `known_format` says
    whether the grammar engine enforces a `format`; `root` is the whole schema, for local
    `$ref`s (default: `schema`). The schema's nesting was bounded before it got here
    (limits.MAX_NESTING_DEPTH), so this recursion is too."""
    if not isinstance(schema, dict):
        return schema
    root = schema if root is None else root
    node = dict(schema)
    if node.pop("uniqueItems", None) is True:
        values = _enum_of(node.get("items"), root)
        if values is not None:
            node["maxItems"] = _lower(node.get("maxItems"), len(values))
    node.pop("not", None)
    _conditional(node)
    if isinstance(node.get("format"), str) and not known_format(node["format"]):
        del node["format"]
    _bound(node)
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            node[key] = {name: prepare_schema(sub, known_format, root)
                         for name, sub in node[key].items()}
    for key in _SCHEMA_ONE:
        if isinstance(node.get(key), dict):
            node[key] = prepare_schema(node[key], known_format, root)
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            node[key] = [prepare_schema(sub, known_format, root) for sub in node[key]]
    return node


def _enum_of(items: Any, root: Any) -> list[Any] | None:
    """The values an array's `items` schema allows, where it is an enum (directly or through
    one local `$ref` such as "#/$defs/Colour")."""
    if isinstance(items, dict) and isinstance(items.get("$ref"), str):
        target: Any = root
        for part in items["$ref"].removeprefix("#/").split("/"):
            target = target.get(part) if isinstance(target, dict) else None
        items = target
    if isinstance(items, dict) and isinstance(items.get("enum"), list):
        return items["enum"]
    return None


def _conditional(node: dict[str, Any]) -> None:
    """if / then / else -> anyOf [if and then, else] (both branches), else dropped."""
    if not {"if", "then", "else"} & node.keys():
        return
    condition, then, otherwise = node.pop("if", None), node.pop("then", None), node.pop("else",
                                                                                       None)
    if condition is not None and then is not None and otherwise is not None:
        branches = {"anyOf": [{"allOf": [condition, then]}, otherwise]}
        node["allOf"] = [*node.get("allOf", []), branches]


def _bound(node: dict[str, Any]) -> None:
    """The default bounds, on a node that does not fix its value (enum, const)."""
    if "enum" in node or "const" in node:
        return
    types = node.get("type")
    types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
    if "string" in types:
        node["maxLength"] = _lower(node.get("maxLength"), MAX_STRING_LENGTH)
    if "number" in types:
        node.setdefault("multipleOf", 10.0 ** -NUMBER_FRACTION_DIGITS)
        _range(node, NUMBER_BOUND)
    elif "integer" in types:
        _range(node, INTEGER_BOUND)


def _range(node: dict[str, Any], bound: float) -> None:
    """maximum and minimum within +-bound (exclusive bounds, if any, apply as well)."""
    own_max, own_min = node.get("maximum"), node.get("minimum")
    upper = min(own_max, bound) if _number(own_max) else bound
    lower = max(own_min, -bound) if _number(own_min) else -bound
    if lower <= upper:  # else the schema's own range lies past the bound: it stays as given
        node["maximum"], node["minimum"] = upper, lower


def _lower(own: Any, bound: int) -> Any:
    """The schema's own bound where it is a number within `bound`, else `bound`."""
    return own if _number(own) and own <= bound else bound


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def ascii_digits(regex: str) -> str:
    """`regex` with `\\d` as `[0-9]` and `\\D` as `[^0-9]` (inside a class: `0-9` and the
    nested class `[^0-9]`, which llguidance's regex syntax takes)."""
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(regex):
        char = regex[i]
        if char == "\\" and i + 1 < len(regex):
            escaped = regex[i + 1]
            if escaped == "d":
                out.append("0-9" if in_class else "[0-9]")
            elif escaped == "D":
                out.append("[^0-9]")
            else:
                out.append(regex[i:i + 2])
            i += 2
            continue
        if char == "[" and not in_class:
            in_class = True
            out.append(char)
            # a `]` (or `^]`) first in a class is a literal, not its end
            for literal in ("^]", "]", "^"):
                if regex.startswith(literal, i + 1):
                    out.append(literal)
                    i += len(literal)
                    break
        elif char == "]" and in_class:
            in_class = False
            out.append(char)
        else:
            out.append(char)
        i += 1
    return "".join(out)
