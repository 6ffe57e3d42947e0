"""The bounds a client's constraint must keep before any parser sees it, and the one nesting
scan they need.

A spec is the client's text, and every parser it meets recurses on its nesting: Python's json
raised RecursionError near 1,000 levels (a 500), and llguidance's compiler overflowed its
native stack on a grammar whose rules chain a few thousand deep (the process died). So size
and depth are checked first, on the text, in one pass that recurses on nothing.
"""

from __future__ import annotations

import re

# A spec's text at most (a schema as JSON text, a regex, a grammar). The largest agent tool
# sets seen (dozens of tools with their parameter schemas) are a few tens of kB; a 1.3 MB
# Lark grammar kept a compile worker busy for minutes.
MAX_SPEC_CHARS = 128 * 1024
# JSON nesting at most, in a schema or a request body: pydantic models nest through $defs
# and $ref, a few levels each; `required` tools wrap their parameters in about six more.
MAX_NESTING_DEPTH = 64

# A JSON string (to its closing quote, or to the end of an unterminated one) or a bracket.
_STRING_OR_BRACKET = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{}]', re.DOTALL)


def nested_deeper_than(text: str | bytes, limit: int = MAX_NESTING_DEPTH) -> bool:
    """Whether the arrays and objects of JSON `text` nest more than `limit` deep (brackets
    inside strings do not count). Malformed JSON is measured as far as it goes: the parser
    that follows names what is wrong with it."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if data.count(b"[") + data.count(b"{") <= limit:  # the usual body: no scan needed
        return False
    depth = 0
    for match in _STRING_OR_BRACKET.finditer(data):
        char = match.group()[:1]
        if char in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return True
        elif char in (b"]", b"}"):
            depth = max(0, depth - 1)
    return False


def value_deeper_than(value: object, limit: int = MAX_NESTING_DEPTH) -> bool:
    """The same for a parsed value (dicts and lists), walked without recursion."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth >= limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children
                         if isinstance(child, (dict, list)))
    return False
