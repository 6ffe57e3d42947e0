"""What crosses a process boundary for a request's output (the engine process's pipe, a Ray
replica's stream): what it added since the last.

The engine hands out cumulative RequestOutputs (its text, token ids and logprobs so far, the
prompt with them), as vLLM's does; in one process that costs a list copy a step. Pickled
whole at every step they cost the square of the output's length: at an answer's n-th token,
all n TokenLogprob objects of its logprobs are pickled, sent and unpickled again, on the
engine loop's time. So each output goes as an OutputDelta against the one before it, and the
receiving side rebuilds the cumulative output before anything reads it:

    engine   RequestOutput --DeltaEncoder.encode--> OutputDelta ==pipe / Ray==>
    server   OutputDelta --DeltaDecoder.decode--> RequestOutput (the same fields)

Every sequence is sent as (start, tail): the receiver keeps its first `start` items and
appends `tail`. The engine's sequences only grow, so `start` is what was sent before; a text
that stopped extending the one sent (nothing does so today) is sent whole. The prompt and its
ids go with a request's first delta only, the small fields (finish reason, metrics, ...) with
every one. One encoder and one decoder per submission: their state ends with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

from loom.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob

T = TypeVar("T")


@dataclass
class OutputDelta:
    """One RequestOutput, as what it adds to its request's previous one."""

    request_id: str
    text: tuple[int, str]
    token_ids: tuple[int, list[int]]
    logprobs: tuple[int, list[TokenLogprob]] | None
    prompt_logprobs: tuple[int, list[TokenLogprob | None]] | None
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    num_cached_tokens: int
    error: str | None
    metrics: RequestMetrics | None
    prompt: tuple[str | None, list[int]] | None = None  # the first delta's (text, token ids)


@dataclass
class _Sent:
    """How much of a request's output the other side has."""

    text: str = ""
    tokens: int = 0
    logprobs: int = 0
    prompt_logprobs: int = 0


def _tail(items: list[T], sent: int) -> tuple[int, list[T]]:
    start = min(sent, len(items))
    return start, items[start:]


def _optional_tail(items: list[T] | None, sent: int) -> tuple[int, list[T]] | None:
    return None if items is None else _tail(items, sent)


def _text_tail(text: str, sent: str) -> tuple[int, str]:
    if text.startswith(sent):
        return len(sent), text[len(sent):]
    return 0, text


class DeltaEncoder:
    """The engine process's side, for one submission's sink."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def encode(self, output: RequestOutput) -> OutputDelta:
        first = output.request_id not in self._sent
        sent = self._sent.setdefault(output.request_id, _Sent())
        completion = output.outputs[0]
        delta = OutputDelta(
            request_id=output.request_id,
            text=_text_tail(completion.text, sent.text),
            token_ids=_tail(completion.token_ids, sent.tokens),
            logprobs=_optional_tail(completion.logprobs, sent.logprobs),
            prompt_logprobs=_optional_tail(output.prompt_logprobs, sent.prompt_logprobs),
            finished=output.finished, finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason, num_cached_tokens=output.num_cached_tokens,
            error=output.error, metrics=output.metrics,
            prompt=(output.prompt, output.prompt_token_ids) if first else None)
        if output.finished:
            del self._sent[output.request_id]
        else:
            sent.text, sent.tokens = completion.text, len(completion.token_ids)
            sent.logprobs = len(completion.logprobs or ())
            sent.prompt_logprobs = len(output.prompt_logprobs or ())
        return delta


@dataclass
class _Received:
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


def _extend(items: list[T] | None, tail: tuple[int, list[T]] | None) -> list[T] | None:
    """`items` with the tail applied, in place (the lists a request's outputs share, as the
    engine's own outputs share their logprobs lists)."""
    if tail is None:
        return None
    start, added = tail
    items = [] if items is None else items
    del items[start:]
    items.extend(added)
    return items


class DeltaDecoder:
    """The server's side, for one submission: cumulative RequestOutputs again."""

    def __init__(self) -> None:
        self._received: dict[str, _Received] = {}

    def decode(self, delta: OutputDelta) -> RequestOutput:
        if delta.prompt is not None:
            self._received[delta.request_id] = _Received(*delta.prompt)
        got = self._received[delta.request_id]
        start, text = delta.text
        got.text = got.text[:start] + text
        _extend(got.token_ids, delta.token_ids)
        got.logprobs = _extend(got.logprobs, delta.logprobs)
        got.prompt_logprobs = _extend(got.prompt_logprobs, delta.prompt_logprobs)
        if delta.finished:
            del self._received[delta.request_id]
        completion = CompletionOutput(
            index=0, text=got.text, token_ids=list(got.token_ids),
            finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
            logprobs=got.logprobs)
        return RequestOutput(
            request_id=delta.request_id, prompt=got.prompt,
            prompt_token_ids=got.prompt_token_ids, outputs=[completion],
            finished=delta.finished, prompt_logprobs=got.prompt_logprobs,
            num_cached_tokens=delta.num_cached_tokens, error=delta.error,
            metrics=delta.metrics)
