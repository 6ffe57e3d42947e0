"""Speculative decoding counters, named as vLLM's (`loom:spec_decode_*`), in the engine's own
registry so they appear in /metrics beside the rest."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from loom.core.batch import ModelRunnerOutput, SchedulerOutput


class SpecDecodeMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str,
                 num_speculative_tokens: int) -> None:
        label = {"model_name": model_name}

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"loom:spec_decode_{name}", doc, list(label),
                           registry=registry).labels(**label)

        self.drafts = counter("num_drafts", "Requests that had draft tokens in a step")
        self.draft_tokens = counter("num_draft_tokens", "Draft tokens proposed")
        self.accepted_tokens = counter("num_accepted_tokens", "Draft tokens accepted")
        per_position = Counter("loom:spec_decode_num_accepted_tokens_per_pos",
                               "Accepted draft tokens by their position in the draft",
                               ["model_name", "position"], registry=registry)
        self.accepted_per_position = [per_position.labels(model_name=model_name, position=str(i))
                                      for i in range(num_speculative_tokens)]

    def observe(self, batch: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        for item in batch.scheduled:
            if not item.num_draft_tokens:
                continue
            accepted = len(runner_output.accepted_draft_ids.get(item.request_id, []))
            self.drafts.inc()
            self.draft_tokens.inc(item.num_draft_tokens)
            self.accepted_tokens.inc(accepted)
            for position in range(accepted):
                self.accepted_per_position[position].inc()
