"""Per-client fairness: `--max-concurrent-per-client N` bounds the engine requests (prompts x n,
running or queued) one client holds at once, so that one client cannot fill the engine's queue
and push every other client to 503. One over the limit is answered 429 with Retry-After, at
once, and never reaches the engine.

A client is the API key it presented when the server has several (`--api-key A,B`), else the
address it connects from (behind a reverse proxy every client shares the proxy's: give each
its own key there).
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

from loom.entrypoints.openai.errors import RETRY_AFTER_S, APIError

CLIENT_SCOPE_KEY = "loom.client"  # set by the API-key guard when keys tell clients apart


def client_of(scope: MutableMapping[str, Any]) -> str:
    """Who sent the request: the key's name the guard left in the scope, else the address."""
    named = scope.get(CLIENT_SCOPE_KEY)
    if named is not None:
        return named
    address = scope.get("client")
    return address[0] if address else ""


class ClientLimiter:
    """`limit` engine requests per client at most (None: no limit); `on_refused` counts each
    refusal (for /metrics)."""

    def __init__(self, limit: int | None, on_refused: Callable[[], None] | None = None) -> None:
        self.limit = limit
        self._on_refused = on_refused
        self._held: dict[str, int] = {}

    def held(self, client: str) -> int:
        return self._held.get(client, 0)

    def acquire(self, client: str, count: int) -> Callable[[], None]:
        """Take `count` of the client's places, or raise APIError (429; 400 if `count` alone
        is over the limit, which no retry could change). Returns the release, which may be
        called more than once."""
        if self.limit is None:
            return _nothing
        if count > self.limit:
            raise APIError(400, f"this request makes {count} engine requests (prompts x n), "
                           f"more than the {self.limit} one client may hold at once "
                           "(--max-concurrent-per-client)", "n")
        held = self._held.get(client, 0)
        if held + count > self.limit:
            if self._on_refused is not None:
                self._on_refused()
            raise APIError(429, f"too many requests in flight from this client: it holds "
                           f"{held} of its {self.limit} (--max-concurrent-per-client); "
                           "retry when one has finished", type_="rate_limit_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        self._held[client] = held + count
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            left = self._held[client] - count
            if left:
                self._held[client] = left
            else:
                del self._held[client]

        return release


def _nothing() -> None:
    pass
