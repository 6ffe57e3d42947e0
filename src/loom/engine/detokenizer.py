"""Incremental detokenization with stop strings.

Text is produced token by token without re-decoding the whole output: each new token is
decoded together with a few tokens before it, and the difference is the new text. Text that
could still turn into a stop string is held back, so a streamed answer never shows part of one.
Stop strings end the answer only from its `min_tokens`-th token on, as stop tokens and EOS do
(the scheduler's rule) and as vLLM checks them.
"""

from __future__ import annotations

from loom.model.tokenizer import Tokenizer

_CONTEXT_TOKENS = 6  # earlier tokens decoded alongside a new one, so merges decode right


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 stop: list[str], min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.min_tokens = min_tokens
        self.num_output = 0
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.token_ids = prompt_token_ids[-_CONTEXT_TOKENS:]
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""
        self.stopped_on: str | None = None

    def push(self, token_id: int) -> None:
        """Append a token; afterwards `stopped_on` names the stop string it completed, if any."""
        self.token_ids.append(token_id)
        self.num_output += 1
        prefix = self.tokenizer.decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self.tokenizer.decode(self.token_ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return  # an incomplete UTF-8 sequence: wait for the next token
        new_text = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        checked_from = max(0, len(self.text) - self.hold_back)
        self.text += new_text
        if self.num_output < self.min_tokens:
            return
        hits = [(at, stop) for stop in self.stop
                if (at := self.text.find(stop, checked_from)) != -1]
        if hits:
            at, self.stopped_on = min(hits)
            self.text = self.text[:at]

    def visible_text(self, finished: bool) -> str:
        """Text safe to show now: all of it once finished, else minus a possible stop prefix."""
        if finished or not self.hold_back:
            return self.text
        return self.text[:max(0, len(self.text) - self.hold_back)]
