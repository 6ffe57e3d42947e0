"""What a request must pass before any handler sees it, as plain ASGI middleware (each a few
lines, none buffering a streamed response):

- `HostGuard`: on a loopback bind, the Host header must name loopback. A web page the user
  visits can point its own DNS name at 127.0.0.1 (DNS rebinding) and then read the server as
  if it were same-origin; the Host header it sends still names the attacker's domain.
- `ApiKeyGuard`: `Authorization: Bearer <key>` on every /v1 route (401 otherwise), as vLLM's
  `--api-key` does; /health, /metrics, /version and the OpenAPI schema stay open.
- `BodyGuard`: the request body is read whole up front, at most `max_bytes` (413) and within
  `read_timeout` seconds (408), so a client that announces a body and sends it slowly, or
  never, cannot hold a handler (or a shutdown) forever. A client that leaves before its body
  is read (uvicorn then reports the disconnect, not the body) is counted by `on_abandoned`:
  its request never reaches the engine, so the engine's counters cannot see it.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from loom.entrypoints.openai.errors import error_response

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

def is_loopback(host: str) -> bool:
    """localhost, 127.0.0.0/8 or ::1 (an address, not a name that starts like one)."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def host_name(header: str) -> str:
    """The host of a Host header, without its port: `[::1]:8000` -> `::1`."""
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


class HostGuard:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        host = _header(scope, b"host") if scope["type"] == "http" else None
        if host is not None and not is_loopback(host_name(host)):
            response = error_response(
                400, f"Host {host!r} is not this server: bound to loopback, it answers only "
                "to localhost / 127.0.0.1 / [::1] (start it with --host to serve others)")
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class ApiKeyGuard:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = (_header(scope, b"authorization") or "").encode("latin-1")
            if not hmac.compare_digest(given, self._expected):  # in constant time
                response = error_response(
                    401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    type_="authentication_error", headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


class BodyGuard:
    def __init__(self, app: ASGIApp, max_bytes: int, read_timeout: float,
                 on_abandoned: Callable[[], None]) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout = read_timeout
        self.on_abandoned = on_abandoned

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        try:
            if length is not None and length.isdigit() and int(length) > self.max_bytes:
                raise _BodyTooLarge
            body = await asyncio.wait_for(self._read(receive), self.read_timeout)
        except _BodyTooLarge:
            await self._refuse(413, f"request body is larger than the server's limit of "
                               f"{self.max_bytes} bytes (--max-request-body-bytes)",
                               scope, receive, send)
            return
        except (TimeoutError, asyncio.TimeoutError):
            await self._refuse(408, f"request body not received within {self.read_timeout:g}"
                               " s (--read-timeout)", scope, receive, send)
            return
        if body is None:  # the client left: nobody to answer
            self.on_abandoned()
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive: Receive) -> bytes | None:
        """The whole body; None if the client disconnected before sending it."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    @staticmethod
    async def _refuse(status: int, message: str, scope: Scope, receive: Receive,
                      send: Send) -> None:
        # The rest of the body is never read, so the connection cannot be reused.
        response = error_response(status, message, headers={"Connection": "close"})
        await response(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands the app the body already read, then passes through (so the
    app still learns when the client disconnects)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replay
