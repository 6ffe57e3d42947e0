"""Per-request sampling parameters, validated once (torch-free: the scheduler, the simulator
and the HTTP layer read them; the batched sampler is model/sampler.py)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from loom.structured.limits import (
    MAX_NESTING_DEPTH,
    MAX_SPEC_CHARS,
    nested_deeper_than,
    value_deeper_than,
)

SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes: a 64-bit value
_MAX_INT32 = 2**31 - 1  # counts (tokens, top-k) beyond this are no request, only a bug
# Stop strings, and stop token ids, per request at most: every token a request generates is
# checked against each of them on the step loop all requests share, so 300,000 (a 3 MiB body)
# made every other request's tokens several times slower. OpenAI allows 4 stop strings.
MAX_STOPS = 1024


class SamplingParamsError(ValueError):
    """A sampling parameter out of range. `field` names it (a SamplingParams field), so callers
    such as the HTTP layer can say which of their own fields was wrong without parsing text."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field} {reason}")
        self.field, self.reason = field, reason


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# Choices per request at most: past 2000 alternatives alive at once the grammar engine
# (llguidance's max_items_in_row) fails the request a token in, and every step spent on so many
# (0.1 s for 20,000 on a 2-core EPYC) holds up the whole batch.
MAX_CHOICES = 2000


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain a request's output, with vLLM's names: a JSON schema (`json`, a dict or its
    text), a `regex`, one of a `choice` of strings, a Lark / GBNF `grammar`, or any JSON object
    (`json_object`). Exactly one is set. Plain data, so it travels wherever SamplingParams do
    (to an engine in another process); the grammar is compiled where the engine runs."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [kind for kind in STRUCTURED_KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise SamplingParamsError(
                "structured_outputs", f"must set exactly one of {', '.join(STRUCTURED_KINDS)}; "
                f"got {', '.join(given) or 'none'}")
        if self.choice is not None and (
                not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise SamplingParamsError("structured_outputs",
                                      "choice must be a non-empty list of non-empty strings")
        if self.choice is not None and len(self.choice) > MAX_CHOICES:
            raise SamplingParamsError("structured_outputs",
                                      f"choice may hold at most {MAX_CHOICES} strings, got "
                                      f"{len(self.choice)}")
        self._check_size()

    def _check_size(self) -> None:
        """The spec's size and nesting, before anything parses it (limits.py says why)."""
        value = getattr(self, self.kind)
        if isinstance(value, (dict, list)):
            if value_deeper_than(value):
                raise SamplingParamsError("structured_outputs", f"{self.kind}: nests deeper "
                                          f"than {MAX_NESTING_DEPTH} levels")
            value = json.dumps(value)
        if not isinstance(value, str):
            return
        if len(value) > MAX_SPEC_CHARS:
            raise SamplingParamsError("structured_outputs", f"{self.kind}: is {len(value)} "
                                      f"characters long; at most {MAX_SPEC_CHARS} are taken")
        if self.kind == "json" and nested_deeper_than(value):
            raise SamplingParamsError("structured_outputs", f"{self.kind}: nests deeper than "
                                      f"{MAX_NESTING_DEPTH} levels")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, spec as text): what compiled grammars are cached by, so the same schema
        sent as a dict or as its JSON text compiles once."""
        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                return self.kind, value  # left for the compiler to refuse, naming the problem
        if not isinstance(value, str):
            value = json.dumps(value, sort_keys=True)
        return self.kind, value


GREEDY_BELOW_TEMPERATURE = 1e-5  # vLLM's _SAMPLING_EPS


@dataclass
class SamplingParams:
    """How to pick tokens for one request; validated on construction so bad values fail early.
    This is the one place the ranges are spelled: the HTTP server checks only types."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # OpenAI's and vLLM's logit adjustments (loom/model/sampler.py `adjust_logits`): the
    # penalties count the tokens generated so far (repetition_penalty the prompt's too)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name, ok, reason in self._checks():
            if not ok:
                raise SamplingParamsError(name, reason)

    def _checks(self) -> list[tuple[str, bool, str]]:
        """(field, holds, what it must be) for every range; ints are checked as ints first
        (bool is not one), so a JSON `true` or a float never reaches the model."""

        def whole(value: object, low: int, high: int) -> bool:
            return _is_int(value) and low <= value <= high

        def finite(value: object) -> bool:
            return _is_number(value) and math.isfinite(value)

        seed_ok = self.seed is None or (_is_int(self.seed)
                                        and SEED_RANGE[0] <= self.seed < SEED_RANGE[1])
        return [
            ("max_tokens", whole(self.max_tokens, 1, _MAX_INT32),
             f"must be an integer >= 1, got {self.max_tokens!r}"),
            ("temperature", finite(self.temperature) and self.temperature >= 0,
             f"must be a finite number >= 0, got {self.temperature!r}"),
            ("top_p", finite(self.top_p) and 0 < self.top_p <= 1,
             f"must be in (0, 1], got {self.top_p!r}"),
            ("top_k", self.top_k == -1 or whole(self.top_k, 1, _MAX_INT32),
             f"must be -1 (off) or an integer >= 1, got {self.top_k!r}"),
            ("seed", seed_ok, f"must be a 64-bit integer, got {self.seed!r}"),
            ("min_tokens", whole(self.min_tokens, 0, _MAX_INT32),
             f"must be an integer >= 0, got {self.min_tokens!r}"),
            ("min_tokens", not _is_int(self.max_tokens) or not _is_int(self.min_tokens)
             or self.min_tokens <= self.max_tokens,
             f"({self.min_tokens!r}) must not exceed max_tokens ({self.max_tokens!r})"),
            ("logprobs", self.logprobs is None or whole(self.logprobs, 0, 20),
             f"must be in [0, 20], got {self.logprobs!r}"),
            ("prompt_logprobs", self.prompt_logprobs is None or whole(self.prompt_logprobs, 0, 20),
             f"must be in [0, 20], got {self.prompt_logprobs!r}"),
            ("stop", len(self.stop) <= MAX_STOPS,
             f"must hold at most {MAX_STOPS} strings, got {len(self.stop)}"),
            ("stop", all(isinstance(s, str) and s and valid_unicode(s) for s in self.stop),
             "must be non-empty strings of valid Unicode"),
            ("stop_token_ids", len(self.stop_token_ids) <= MAX_STOPS,
             f"must hold at most {MAX_STOPS} token ids, got {len(self.stop_token_ids)}"),
            ("stop_token_ids", all(whole(t, 0, _MAX_INT32) for t in self.stop_token_ids),
             "must be token ids (integers >= 0)"),
            ("presence_penalty", finite(self.presence_penalty)
             and -2 <= self.presence_penalty <= 2,
             f"must be in [-2, 2], got {self.presence_penalty!r}"),
            ("frequency_penalty", finite(self.frequency_penalty)
             and -2 <= self.frequency_penalty <= 2,
             f"must be in [-2, 2], got {self.frequency_penalty!r}"),
            ("repetition_penalty", finite(self.repetition_penalty)
             and self.repetition_penalty > 0,
             f"must be a finite number > 0, got {self.repetition_penalty!r}"),
            ("logit_bias", all(whole(t, 0, _MAX_INT32) and finite(b) and -100 <= b <= 100
                               for t, b in self.logit_bias.items()),
             "must map token ids (integers >= 0) to biases in [-100, 100]"),
        ]

    def check_vocab(self, vocab_size: int) -> None:
        """The checks that need the model: token ids and top_k within its vocabulary."""
        if self.top_k > vocab_size:
            raise SamplingParamsError(
                "top_k", f"must be -1 (off) or at most the vocabulary size {vocab_size}, "
                f"got {self.top_k}")
        if any(t >= vocab_size for t in self.stop_token_ids):
            raise SamplingParamsError(
                "stop_token_ids", f"must be in [0, {vocab_size}) for this model")
        if any(t >= vocab_size for t in self.logit_bias):
            raise SamplingParamsError(
                "logit_bias", f"token ids must be in [0, {vocab_size}) for this model")

    @property
    def penalized(self) -> bool:
        """Penalties that depend on the tokens generated so far."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def adjusts_logits(self) -> bool:
        return self.penalized or bool(self.logit_bias)

    @property
    def greedy(self) -> bool:
        """Temperatures below GREEDY_BELOW_TEMPERATURE are greedy: dividing logits by one
        overflows float32 (1e-40 is 0 there), which left nothing to sample."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def valid_unicode(text: str) -> bool:
    """False for a string holding a lone surrogate (JSON allows "\\ud800"): no tokenizer and
    no UTF-8 response can carry it."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True
