"""Reasoning parsers (`--reasoning-parser`, vLLM's names): a thinking model's answer split
into its reasoning (`message.reasoning_content`, streamed as `delta.reasoning_content`) and
its content (what tool parsers and clients read).

Both parsers read `<think>...</think>`, and both first look at how the rendered prompt ends:
inside an open `<think>` (Qwen3.5's and the R1 distills' templates open it there) the answer
starts inside its reasoning; right after a closed, empty block (what templates write for
`enable_thinking: false`) it has none, and is all content. Otherwise:

- `qwen3`: the answer reasons if it opens with `<think>` (Qwen3's own template leaves that to
  the model).
- `deepseek_r1`: the answer starts inside its reasoning (the first R1 releases skip the tag),
  until `</think>`, all of it if that never comes.

Content after `</think>` starts at its first non-blank character (the templates write a blank
line there). A streamed answer holds back what could still be the start of a tag, so every
character goes out once, to the side the whole answer puts it on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

ReasoningParserName = Literal["none", "qwen3", "deepseek_r1"]
START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasonedText:
    """An answer (or as much of it as is certain) split at its reasoning."""

    reasoning: str | None  # None: the answer does not reason
    content: str


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    opens_in_reasoning: bool  # the answer is taken to start inside <think> (deepseek_r1)

    def starts_inside(self, prompt: str) -> bool | None:
        """Whether an answer to `prompt` (the rendered chat) begins inside its reasoning;
        None where the prompt has closed the reasoning (the answer is all content)."""
        opened, closed = prompt.rfind(START), prompt.rfind(END)
        if opened > closed:
            return True
        if closed != -1 and not prompt[closed + len(END):].strip():
            return None
        return self.opens_in_reasoning

    def split(self, text: str, inside: bool, finished: bool = True) -> ReasonedText:
        """`text` split; `inside`: it begins inside the reasoning (starts_inside). While
        not `finished`, what could still be the start of a tag (and the blanks after
        `</think>`) is on neither side yet: what follows decides."""
        body = text.lstrip()
        if body.startswith(START):
            body, inside = body[len(START):], True
        elif not finished and START.startswith(body):  # nothing yet, or "<thi": wait
            return ReasonedText("" if inside else None, "")
        elif not inside:
            return ReasonedText(None, text)
        at = body.find(END)
        if at == -1:
            held = 0 if finished else _partial_suffix(body, END)
            return ReasonedText(body[:len(body) - held], "")
        return ReasonedText(body[:at], body[at + len(END):].lstrip())

    def token_count(self, decode: Callable[[list[int]], str], token_ids: list[int],
                    inside: bool) -> int:
        """The answer's tokens up to the one that completes `</think>` (all of them if it
        never comes); 0 if it does not reason. The first k tokens hold the tag from some k
        on, so k is found by bisection: a few decodes, not one per token."""
        if self.split(decode(token_ids), inside).reasoning is None:
            return 0
        low, high = 0, len(token_ids)  # the tag is not in token_ids[:low], is in [:high]
        if END not in decode(token_ids):
            return high
        while high - low > 1:
            middle = (low + high) // 2
            if END in decode(token_ids[:middle]):
                high = middle
            else:
                low = middle
        return high


def _partial_suffix(text: str, tag: str) -> int:
    """How many trailing characters of `text` could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ReasoningParser("qwen3", opens_in_reasoning=False),
    "deepseek_r1": ReasoningParser("deepseek_r1", opens_in_reasoning=True),
}


def reasoning_parser(name: str) -> ReasoningParser | None:
    """The parser `--reasoning-parser name` names; None for "none"."""
    return None if name == "none" else REASONING_PARSERS[name]
