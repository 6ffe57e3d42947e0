"""Admission control: how much work a server takes before it answers 503. Spelled once, here:
`loom serve` reads it from its flags (ServerConfig is one), each Ray replica applies it to
its own queue, and `loom simulate` applies it to the simulated server's front door."""

from __future__ import annotations

from dataclasses import dataclass

from loom.config import option, require_at_least


@dataclass(frozen=True)
class AdmissionConfig:
    max_num_queued_reqs: int | None = option(None,
        "answer 503 (with Retry-After) to a request that would make more than this many "
        "engine requests (prompts x n) wait for a sequence slot; none = no limit")
    queue_timeout_s: float | None = option(None,
        "answer 503 for a request not scheduled within this many seconds; none = wait",
        flag="--queue-timeout")

    def __post_init__(self) -> None:
        """Below these ranges every request would be refused, and a run would look like a
        server that fails them all."""
        require_at_least(1, {"max_num_queued_reqs": self.max_num_queued_reqs})
        if self.queue_timeout_s is not None and not self.queue_timeout_s > 0:
            raise ValueError(f"queue_timeout must be > 0, got {self.queue_timeout_s}")
