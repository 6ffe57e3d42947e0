"""What a request must pass before any handler sees it, as plain ASGI middleware (each a few
lines, none buffering a streamed response):

- `RequestContext`, outermost: every request gets an id (the client's `X-Request-Id` when it
  sends a sane one, else a new one), sent back as `X-Request-Id` and put in front of every
  log line the server writes while serving it; an exception no handler answered is logged
  once, with that id, and answered 500 (Starlette logged it, then re-raised it for uvicorn
  to log again).
- `HostGuard`: on a loopback bind, the Host header must name loopback. A web page the user
  visits can point its own DNS name at 127.0.0.1 (DNS rebinding) and then read the server as
  if it were same-origin; the Host header it sends still names the attacker's domain. The
  header is parsed as an authority (host, then an optional port of digits), so
  `127.0.0.1:80@evil.example` is no loopback name.
- `ApiKeyGuard`: `Authorization: Bearer <key>` (the scheme in any case, as HTTP has it) on
  every route but /health (401 otherwise); /metrics takes its own key, or none, if the
  server says so.
- `BodyGuard`: the request body is read whole up front, at most `max_bytes` (413) and within
  `read_timeout` seconds (408), so a client that announces a body and sends it slowly, or
  never, cannot hold a handler (or a shutdown) forever. A client that leaves before its body
  is read (uvicorn then reports the disconnect, not the body) is counted by `on_abandoned`:
  its request never reaches the engine, so the engine's counters cannot see it. A body
  nested deeper than BODY_NESTING_LIMIT is a 400 before any parser recurses into it.
"""

from __future__ import annotations

import asyncio
import contextvars
import hmac
import ipaddress
import logging
import re
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from loom.entrypoints.openai.errors import INTERNAL_ERROR, error_response
from loom.entrypoints.openai.fairness import CLIENT_SCOPE_KEY
from loom.structured.limits import MAX_NESTING_DEPTH, nested_deeper_than

logger = logging.getLogger(__name__)

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


# RFC 3986's authority as a Host header carries it: an IP literal in brackets or a name
# (letters, digits, dots, hyphens), then an optional port of digits; nothing else.
_AUTHORITY = re.compile(r"\[(?P<literal>[0-9A-Fa-f:.]+)\]|(?P<name>[0-9A-Za-z._-]+)")
_PORT = re.compile(r"(?::[0-9]{0,5})?")


def host_name(header: str) -> str | None:
    """The host of a Host header, without its port (`[::1]:8000` -> `::1`); None where the
    header is no authority at all (`127.0.0.1:80@evil.example`)."""
    found = _AUTHORITY.match(header)
    if found is None or not _PORT.fullmatch(header, found.end()):
        return None
    return found["literal"] or found["name"]


class HostGuard:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        host = _header(scope, b"host") if scope["type"] == "http" else None
        if host is not None and not is_loopback(host_name(host) or ""):
            response = error_response(
                400, f"Host {host!r} is not this server: bound to loopback, it answers only "
                "to localhost / 127.0.0.1 / [::1] (start it with --host to serve others)")
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


OPEN_PATHS = frozenset({"/health"})
METRICS_PATH = "/metrics"


class ApiKeyGuard:
    """`keys`: the server's API keys (several tell clients apart: the one a request presents
    names its client for fairness). /metrics takes `metrics_key` too, or no key at all with
    `public_metrics`."""

    def __init__(self, app: ASGIApp, keys: list[str], metrics_key: str | None = None,
                 public_metrics: bool = False) -> None:
        self.app = app
        self._keys = [k.encode() for k in keys]
        self._metrics_key = None if metrics_key is None else metrics_key.encode()
        self._public_metrics = public_metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in OPEN_PATHS or (
                path == METRICS_PATH and self._public_metrics):
            await self.app(scope, receive, send)
            return
        token = bearer_token(_header(scope, b"authorization"))
        matched = [hmac.compare_digest(token, key) for key in self._keys]  # constant time
        metrics = (path == METRICS_PATH and self._metrics_key is not None
                   and hmac.compare_digest(token, self._metrics_key))
        if not any(matched) and not metrics:
            response = error_response(
                401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                type_="authentication_error", headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        if len(self._keys) > 1 and any(matched):
            scope[CLIENT_SCOPE_KEY] = f"key-{matched.index(True)}"
        await self.app(scope, receive, send)


def bearer_token(header: str | None) -> bytes:
    """The credentials of `Authorization: Bearer <token>`, the scheme in any case (b"" for
    anything else)."""
    scheme, _, token = (header or "").strip().partition(" ")
    return token.strip().encode("latin-1") if scheme.lower() == "bearer" else b""


# -- request ids and the one log line of a failure --------------------------------------------

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("loom_request_id",
                                                                       default=None)
REQUEST_ID_HEADER = "X-Request-Id"
_CLIENT_REQUEST_ID = re.compile(r"[0-9A-Za-z._:/+=-]{1,128}")  # nothing that could forge a log


class RequestContext:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = _header(scope, REQUEST_ID_HEADER.lower().encode())
        request_id = (given if given is not None and _CLIENT_REQUEST_ID.fullmatch(given)
                      else uuid.uuid4().hex)
        token = REQUEST_ID.set(request_id)
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", []),
                                      (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:  # noqa: BLE001 - answered here, logged once
            logger.exception("%s %s failed", scope.get("method"), scope.get("path"))
            if not started:
                response = error_response(500, INTERNAL_ERROR, type_="internal_server_error")
                await response(scope, receive, send_with_id)
        finally:
            REQUEST_ID.reset(token)


def install_request_id_logging() -> None:
    """Every log record made while a request is served starts with its id (once per
    process; the engine's own process has its own lines, named by engine request ids)."""
    factory = logging.getLogRecordFactory()
    if getattr(factory, "loom_request_ids", False):
        return

    def record(*args: Any, **kwargs: Any) -> logging.LogRecord:
        made = factory(*args, **kwargs)
        request_id = REQUEST_ID.get()
        if request_id is not None:
            made.msg = f"[{request_id}] {made.msg}"
        return made

    record.loom_request_ids = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(record)


class _BodyTooLarge(Exception):
    pass


# A body's JSON nesting at most: room for a schema at its own limit (MAX_NESTING_DEPTH, which
# names the field) inside the request's own few levels.
BODY_NESTING_LIMIT = 2 * MAX_NESTING_DEPTH


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
        if nested_deeper_than(body, BODY_NESTING_LIMIT):
            response = error_response(400, f"request body nests deeper than "
                                      f"{BODY_NESTING_LIMIT} levels")
            await response(scope, receive, send)
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
