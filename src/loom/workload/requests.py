"""What happened to one request, as its client saw it: the unit every figure is computed
from, whether a real client (`loom bench`) or a simulated one (`loom simulate`) sent it.

Every request ends in exactly one status, so nothing a server refuses or breaks goes
uncounted: ok, cancelled (the client walked away, as the trace asked), rejected (HTTP 503 /
429: admission control), timeout (past --request-timeout) or error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

OK, CANCELLED, REJECTED, ERROR, TIMEOUT = "ok", "cancelled", "rejected", "error", "timeout"


@dataclass
class RequestResult:
    """Client-side timings (seconds) of one request. `scheduled_s`/`start_s` are offsets from
    the run's start: when the arrival process wanted it sent, and when it was."""

    id: str | None
    cls: str
    prompt_len: int | None
    max_tokens: int
    scheduled_s: float
    start_s: float = 0.0
    status: str = ERROR
    ttft_s: float | None = None
    e2e_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    http_status: int | None = None
    retry_after: str | None = None
    error: str | None = None
    tenant: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first, as vllm bench serve defines it."""
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        """A shallow dict (asdict deep-copies every field: the bulk of writing a large
        simulated run); `itls_s` is shared with the result, not copied."""
        out = dict(self.__dict__)
        out["class"] = out.pop("cls")
        out["tpot_s"] = self.tpot_s
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> RequestResult:
        obj = dict(obj)
        obj["cls"] = obj.pop("class")
        obj.pop("tpot_s", None)
        return cls(**obj)
