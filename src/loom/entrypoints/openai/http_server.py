"""The socket, the connections and the shutdown of `loom serve`, around uvicorn.

- The port is bound before the model loads (`launch.bind`), so "address already in use" comes
  at once, not after the load; the socket listens only once the server is ready.
- Connections are capped below the process's file-descriptor limit: one over the cap is
  answered 503 and closed at once, so idle sockets can never exhaust descriptors and turn
  accept() into a loop of "Too many open files".
- A connection must send each request head within the read timeout (uvicorn times out
  only keep-alive connections that send nothing, not a first request that never comes nor
  half a head); `guards.BodyGuard` bounds the body the same way.
- SIGTERM (or Ctrl-C) drains: the listening socket closes, new requests on open connections
  get 503, and requests in flight run on for up to `shutdown_timeout` seconds; then the
  engine stops, so every stream still open ends with an error event and [DONE], and the
  process exits.
- If the engine dies on its own, the server shuts down the same way (its requests in flight
  have already failed) and `loom serve` exits with code 1, for a supervisor to restart it.
- /health and /metrics answers are kept out of the access log: a scraper polls them every
  second or so and would drown the lines that matter.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import signal
import socket
from collections.abc import Callable
from types import FrameType

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

FD_RESERVE = 64  # descriptors kept for the model files, logs and the engine
QUIET_PATHS = frozenset({"/health", "/metrics"})
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\n"
         b"connection: close\r\ncontent-length: 33\r\n\r\ntoo many connections; retry later")


def connection_cap(requested: int) -> int:
    """`requested`, lowered to fit the descriptor limit (raised to its hard maximum first,
    as servers do: the soft default of 1024 is a relic)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return requested
    cap = max(1, min(requested, soft - FD_RESERVE))
    if cap < requested:
        logger.warning("max_connections lowered to %d to fit the file-descriptor limit %d",
                       cap, soft)
    return cap


def protocol_class(max_connections: int) -> type[H11Protocol]:
    """uvicorn's HTTP/1.1 protocol with a connection cap and a deadline for each request head:
    `timeout_keep_alive` seconds from the connection opening (or the previous response
    ending) to the head's last byte. (uvicorn's own keep-alive timer stops at the first byte
    of a request, so half a head would hold the connection forever.)"""

    class CappedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(self.connections) >= max_connections:
                self.transport = transport  # connection_lost closes it again, harmlessly
                transport.write(_BUSY)
                transport.close()
                return
            super().connection_made(transport)
            self._arm_head_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the head is in
                self._cancel_head_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_head_timer()  # for the next request on this connection

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            super().connection_lost(exc)

        def _arm_head_timer(self) -> None:
            self._cancel_head_timer()
            if self.conn.their_state is h11.IDLE:
                self._head_timer = self.loop.call_later(self.timeout_keep_alive,
                                                        self._head_timed_out)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return CappedH11Protocol


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose shutdown first lets requests in flight finish for up to
    `shutdown_timeout` seconds, then calls `stop` (which must end every response still open).

    Given `engine_alive`, it also shuts down once that turns False, and `engine_died` says so:
    an engine that died on its own never comes back, and a server left up without it would
    answer 503 for ever instead of exiting for its supervisor to restart it (vLLM's API server
    exits too).

    `interrupted` says whether a Ctrl-C started the shutdown; a second one while draining calls
    `stop` at once (`aborted`); a third is uvicorn's force quit. `terminated` says whether a
    SIGTERM did: uvicorn would raise it again as it returns, which with Ray's handler in
    place (`--data-parallel-size`) exited 15 before the replicas were stopped; it is left to
    the caller, which raises it once everything is stopped (exit status 143 in every mode)."""

    def __init__(self, config: uvicorn.Config, shutdown_timeout: float,
                 drain: Callable[[], None], stop: Callable[[], None],
                 engine_alive: Callable[[], bool] | None = None) -> None:
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout
        self._drain, self._stop = drain, stop
        self._engine_alive = engine_alive
        self.engine_died = self.aborted = self.interrupted = self.terminated = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()  # for handle_exit, which runs in a handler
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """uvicorn's force quit on a second Ctrl-C left asyncio to cancel the responses still
        open at exit: streams cut with neither an error event nor [DONE], CancelledError
        tracebacks in the log, and exit status 0. Here it aborts the requests still running,
        as the shutdown timeout does, so that every response ends properly, and the drain is
        over at once."""
        if sig == signal.SIGINT and self.should_exit and not self.aborted and self._loop:
            self.aborted = True  # not captured: uvicorn re-raises what it captured, at exit
            self._loop.call_soon_threadsafe(self._stop_now, "Ctrl-C again")
            return
        self.interrupted |= sig == signal.SIGINT
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM:
            self.terminated = True
            self._captured_signals = [s for s in self._captured_signals if s != sig]

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's tick (every 0.1 s until shutdown), which also watches the engine."""
        if not self.should_exit and self._engine_alive is not None and not self._engine_alive():
            logger.error("The engine is dead: shutting the server down, to exit with code 1")
            self.engine_died = self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        logger.info("Draining: new requests get 503; requests in flight have %gs to finish",
                    self.shutdown_timeout)
        self._drain()
        deadline = asyncio.get_running_loop().call_later(self.shutdown_timeout, self._stop_now,
                                                         "shutdown_timeout reached")
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    def _stop_now(self, why: str) -> None:
        logger.warning("%s: aborting the requests still running", why)
        self._stop()


class QuietPathsFilter(logging.Filter):
    """Drops uvicorn access-log records of /health and /metrics."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return args[2].partition("?")[0] not in QUIET_PATHS
        return True
