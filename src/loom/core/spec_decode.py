"""Speculative decoding by n-gram prompt lookup: draft tokens from the request's own context.

A request that quotes or edits its context (a RAG answer citing the document, a code edit)
often continues with tokens it has seen: if its last n tokens occurred earlier, the tokens
that followed them then are a cheap guess at what comes next. The scheduler feeds the guesses
(drafts) to the model in the same step as the request's next token; the runner keeps the
longest run the model agrees with, so one step can yield several tokens.

Drafts cost their tokens in the step's budget and KV slots whether accepted or not, so each
request backs off by itself: while its drafts keep being rejected it stops drafting for a
while, longer each time, and traffic that does not copy its context pays almost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loom.config import SpeculativeConfig
from loom.request import Request

# Back-off: below this share of draft tokens accepted (a moving average over the request's
# recent drafts) a request pauses drafting, first for _FIRST_PAUSE steps, doubling up to
# _MAX_PAUSE while acceptance stays low.
_MIN_ACCEPTANCE = 0.3
_ACCEPTANCE_DECAY = 0.5  # weight of the newest verification in the moving average
_FIRST_PAUSE, _MAX_PAUSE = 4, 256


@dataclass
class _RequestIndex:
    """Where each n-gram of a request's context last ended, for every n in the lookup range;
    extended as tokens arrive, so a lookup is a dict probe, not a scan."""

    last_end: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    indexed_until: int = 0  # n-grams ending at positions < this are in last_end
    acceptance: float = 1.0
    pause: int = 0
    resume_at: int = 0  # the proposer's step count from which the request drafts again


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.sizes = range(config.prompt_lookup_max, config.prompt_lookup_min - 1, -1)
        self._index: dict[str, _RequestIndex] = {}
        self._step = 0

    def new_step(self) -> None:
        self._step += 1

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        """Up to `max_drafts` tokens that followed the longest earlier occurrence of the
        request's last n tokens (n from prompt_lookup_max down to prompt_lookup_min)."""
        index = self._index.setdefault(request.request_id, _RequestIndex())
        max_drafts = min(max_drafts, self.config.num_speculative_tokens)
        if max_drafts <= 0 or self._step < index.resume_at:
            return []
        length = request.num_tokens
        self._extend(index, request, length)
        for n in self.sizes:
            if n >= length:
                continue
            end = index.last_end.get(n, {}).get(tuple(request.token_ids_slice(length - n,
                                                                               length)))
            if end is not None:
                return request.token_ids_slice(end, min(end + max_drafts, length))
        return []

    def _extend(self, index: _RequestIndex, request: Request, length: int) -> None:
        """Index the n-grams ending before `length` (the suffix itself is what is looked up)."""
        start = index.indexed_until
        if start >= length:
            return
        low = max(0, start - self.config.prompt_lookup_max)
        tokens = request.token_ids_slice(low, length - 1)  # ends at positions < length
        for end in range(max(start, 1), length):
            for n in self.sizes:
                if n <= end:
                    gram = tuple(tokens[end - n - low:end - low])
                    index.last_end.setdefault(n, {})[gram] = end
        index.indexed_until = length

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """Fold one verification into the request's acceptance; pause it while that is low."""
        index = self._index.get(request_id)
        if index is None or num_drafts == 0:
            return
        rate = num_accepted / num_drafts
        index.acceptance = (1 - _ACCEPTANCE_DECAY) * index.acceptance + _ACCEPTANCE_DECAY * rate
        if index.acceptance < _MIN_ACCEPTANCE:
            index.pause = min(_MAX_PAUSE, max(_FIRST_PAUSE, 2 * index.pause))
            index.resume_at = self._step + index.pause
            index.acceptance = _MIN_ACCEPTANCE  # on probation when it resumes
        elif rate == 1.0:
            index.pause = 0

    def forget(self, request_id: str) -> None:
        self._index.pop(request_id, None)
