"""Speculative decoding by n-gram prompt lookup: draft tokens from the request's own context.

A request that quotes or edits its context (a RAG answer citing the document, a code edit)
often continues with tokens it has seen: if its last n tokens occurred earlier, the tokens
that followed them then are a cheap guess at what comes next. The scheduler feeds the guesses
(drafts) to the model in the same step as the request's next token; the runner keeps the
longest run the model agrees with, so one step can yield several tokens.

Drafts cost their rows in the step whether accepted or not, and in a batch every request
waits for the step, so a draft is only worth proposing where it is likely to be kept:

- each request keeps p, its estimated chance that a draft token is accepted given the ones
  before it were (a moving average of accepted / tested positions, a rejection ending the
  test), and drafts k tokens only while p^k, the chance that the k-th is reached and kept, is
  at least DRAFT_ROW_COST, a draft row's share of a step (so p = 0.9 drafts 4, p = 0.5 two);
- a new request starts from the acceptance the traffic as a whole has been getting, so on
  traffic that does not copy its context a request never starts with a full set of drafts;
- where p is too low for even one draft, the request pauses drafting, for longer each time,
  and then probes with a single draft; a kept probe raises p again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from loom.config import SpeculativeConfig
from loom.request import Request

# A draft row's cost as a share of a decode step (on a 2-core AVX2 CPU the model's matmuls at
# 1 + 4 rows took 2.0x their 1-row time, and each row past 8 about a tenth of the 8-row time;
# docs/benchmark-log.md, "Drafts sized by acceptance"): the k-th draft is proposed while the
# chance that it is reached and kept, p^k, is at least this.
DRAFT_ROW_COST = 0.15
_ACCEPTANCE_DECAY = 0.5  # weight of the newest verification in a request's moving average
_TRAFFIC_DECAY = 0.05  # the same for the traffic-wide acceptance, over many requests
_FIRST_PAUSE, _MAX_PAUSE = 4, 256  # steps without drafts after a miss at low p, doubling


def drafts_worth_proposing(acceptance: float, max_drafts: int) -> int:
    """The largest k <= max_drafts with acceptance^k >= DRAFT_ROW_COST (0 if none)."""
    if acceptance >= 1.0:
        return max_drafts
    if acceptance <= DRAFT_ROW_COST:
        return 0
    return min(max_drafts, int(math.log(DRAFT_ROW_COST) / math.log(acceptance)))


@dataclass
class _RequestIndex:
    """Where each n-gram of a request's context last ended, for every n in the lookup range;
    extended as tokens arrive, so a lookup is a dict probe, not a scan."""

    acceptance: float
    last_end: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    indexed_until: int = 0  # n-grams ending at positions < this are in last_end
    pause: int = 0
    resume_at: int = 0  # the proposer's step count from which the request drafts again


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.sizes = range(config.prompt_lookup_max, config.prompt_lookup_min - 1, -1)
        self._index: dict[str, _RequestIndex] = {}
        self._step = 0
        self.traffic_acceptance = 1.0  # optimistic until drafts have been verified

    def new_step(self) -> None:
        self._step += 1

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        """Up to `max_drafts` tokens that followed the longest earlier occurrence of the
        request's last n tokens (n from prompt_lookup_max down to prompt_lookup_min), as many
        as the request's acceptance makes worth it; one, a probe, after a pause."""
        index = self._index.get(request.request_id)
        if index is None:
            index = self._index[request.request_id] = _RequestIndex(self.traffic_acceptance)
        if max_drafts <= 0 or self._step < index.resume_at:
            return []
        max_drafts = max(1, drafts_worth_proposing(
            index.acceptance, min(max_drafts, self.config.num_speculative_tokens)))
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
        """Fold one verification into the request's and the traffic's acceptance; pause the
        request while its acceptance is too low for a single draft."""
        index = self._index.get(request_id)
        if index is None or num_drafts == 0:
            return
        # positions tested: the accepted ones and the first rejected one, if any
        rate = num_accepted / (num_accepted + (num_accepted < num_drafts))
        index.acceptance += _ACCEPTANCE_DECAY * (rate - index.acceptance)
        self.traffic_acceptance += _TRAFFIC_DECAY * (rate - self.traffic_acceptance)
        if drafts_worth_proposing(index.acceptance, 1) == 0:
            index.pause = min(_MAX_PAUSE, max(_FIRST_PAUSE, 2 * index.pause))
            index.resume_at = self._step + index.pause
        elif num_accepted == num_drafts:
            index.pause = 0

    def forget(self, request_id: str) -> None:
        self._index.pop(request_id, None)
