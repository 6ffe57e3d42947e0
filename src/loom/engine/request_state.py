"""A live request's engine-side state that the scheduler does not need: its detokenizer, the
logprobs gathered so far, its timings (and the metrics they feed), and the RequestOutput
callers get of it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from loom.engine.detokenizer import IncrementalDetokenizer
from loom.engine.metrics import EngineMetrics
from loom.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from loom.request import Request


@dataclass
class RequestState:
    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    logprobs: list[TokenLogprob] | None
    prompt_logprobs: list[TokenLogprob | None] | None
    metrics: RequestMetrics
    error: str | None = None
    last_token_time: float = 0.0

    @classmethod
    def new(cls, request: Request, prompt: str | None, tokenizer: Any,
            arrival_time: float) -> RequestState:
        params = request.sampling_params
        return cls(
            request=request, prompt=prompt,
            detokenizer=IncrementalDetokenizer(tokenizer, request.prompt_token_ids, params.stop,
                                               params.min_tokens),
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            metrics=RequestMetrics(arrival_time))

    def add_prompt_logprobs(self, start: int, entries: list[TokenLogprob]) -> None:
        """A step's scores of prompt tokens from position `start` on (recomputation after a
        preemption repeats some: those are kept once)."""
        if self.prompt_logprobs is not None:
            known = len(self.prompt_logprobs)
            self.prompt_logprobs.extend(entries[known - start:])

    def note_tokens(self, metrics: EngineMetrics, now: float, count: int) -> None:
        """Count a step's tokens for the request and their latency; tokens a step yields
        together (accepted drafts) share the time since the previous step."""
        metrics.generation_tokens.inc(count)
        m = self.metrics
        if m.first_token_time is None:
            m.first_token_time = now
            metrics.ttft.observe(now - m.arrival_time)
            metrics.prefill_time.observe(now - (m.first_scheduled_time or now))
            count -= 1
        for _ in range(count):
            metrics.itl.observe((now - self.last_token_time) / max(count, 1))
        self.last_token_time = now

    def note_finished(self, metrics: EngineMetrics) -> None:
        """The request's end: its finish time, preemptions, status and latencies counted."""
        request, m = self.request, self.metrics
        m.finished_time = time.monotonic()
        m.num_preemptions = request.num_preemptions
        metrics.finished(request.status.value)
        metrics.e2e.observe(m.finished_time - m.arrival_time)
        if m.first_token_time is not None:
            metrics.decode_time.observe(m.finished_time - m.first_token_time)

    def output(self, finished: bool) -> RequestOutput:
        request = self.request
        completion = CompletionOutput(
            index=0,
            text=self.detokenizer.visible_text(finished),
            token_ids=list(request.output_token_ids),
            finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_reason,
            logprobs=self.logprobs,
        )
        return RequestOutput(
            request_id=request.request_id, prompt=self.prompt,
            prompt_token_ids=request.prompt_token_ids, outputs=[completion], finished=finished,
            prompt_logprobs=self.prompt_logprobs, num_cached_tokens=request.num_cached_tokens,
            error=self.error, metrics=self.metrics)
