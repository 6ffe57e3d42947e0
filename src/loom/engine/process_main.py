"""The engine process's side of `loom.engine.process`: its main function, and the messages both
sides speak. Plain pickled tuples cross one duplex pipe:

    server -> engine   (SUBMIT, sid, [EngineRequest]) | (ABORT, request_id) | (DRAIN,)
                       | (STOP, reason) | (METRICS, token) | (RESET_PREFIX_CACHE, token)
    engine -> server   (READY, EngineFacts) | (FAILED, user_error, message)    once, first
                       (OUTPUTS, sid, [OutputDelta | Exception]) | (METRICS, token, bytes)
                       | (RESET_PREFIX_CACHE, token, None)

The engine is the in-process server's `AsyncEngine(EngineCore)`: admission control, queue
timeouts and aborts stay its own. Its loop thread sends each step's outputs down the pipe as
the step ends, with no event loop in between, each as what it added to its request's previous
output (loom.engine.output_delta).

This module imports neither torch nor the engine until the child runs it: the server imports
it to start the child, before anything heavy.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection

from loom.config import EngineConfig
from loom.engine.async_engine import AsyncEngine, EngineDeadError, RequestRejectedError
from loom.engine.output_delta import DeltaEncoder
from loom.outputs import RequestOutput
from loom.torch_import import defer_unused_modules

logger = logging.getLogger(__name__)

SUBMIT, ABORT, DRAIN, STOP, METRICS = "submit", "abort", "drain", "stop", "metrics"
RESET_PREFIX_CACHE = "reset_prefix_cache"  # answered, as METRICS is, with its token
READY, FAILED, OUTPUTS = "ready", "failed", "outputs"
_LIVENESS_POLL_S = 1.0  # how soon a quiet engine process notices its loop died, and exits
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class EngineProcessConfig:
    """What the engine process is started with: the engine, its admission control, and the
    server's logging set-up (a spawned process starts with none; a forked one keeps the
    server's)."""

    engine: EngineConfig
    max_num_queued_reqs: int | None = None
    queue_timeout: float | None = None
    log_level: int = logging.INFO
    log_format: str = logging.BASIC_FORMAT


def run_engine_process(conn: Connection, config: EngineProcessConfig, server_pid: int,
                       server_end: Connection | None = None) -> None:
    """The child's main: load the engine, say it is ready (or why not), then serve the pipe
    until told to stop or the server goes away. `server_end`, the server's end of the pipe
    when the child was forked with it, is closed here, so that the server's exit ends the pipe.
    SIGINT and SIGTERM are ignored: a Ctrl-C reaches the whole process group, and systemd's
    default KillMode (control-group), `pkill` or a kill of the group send SIGTERM to every
    process, while the server must be the one to drain and stop. The server's exit still ends
    this process (SIGKILL, or EOF on the pipe)."""
    _exit_with(server_pid)
    if server_end is not None:
        server_end.close()
    for stop_signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop_signal, signal.SIG_IGN)
    logging.basicConfig(level=config.log_level, format=config.log_format)
    defer_unused_modules()  # a spawned child starts without the server's import hook
    try:  # torch and the model: here, in the child
        engine = AsyncEngine.from_config(config.engine, config.max_num_queued_reqs,
                                         config.queue_timeout)
    except (ValueError, OSError) as e:  # what the user can fix: a bad path, a bad config
        conn.send((FAILED, True, str(e)))
        sys.exit(1)
    except BaseException as e:
        logger.exception("The engine failed to start")
        conn.send((FAILED, False, f"the engine failed to start: {type(e).__name__}: {e}"))
        sys.exit(1)
    engine.start()
    conn.send((READY, engine.facts))
    sys.exit(0 if _serve_pipe(conn, engine) else 1)


def _serve_pipe(conn: Connection, engine: AsyncEngine) -> bool:
    """Serve until the engine loop ends; True if the server ended it (or went away), False if
    the loop died on its own (it has failed its requests; the server sees the pipe end)."""
    sender = _Sender(conn)
    stopped = False
    try:
        while engine.is_alive and not stopped:
            if conn.poll(_LIVENESS_POLL_S):
                stopped = _handle(conn.recv(), engine, sender)
    except (EOFError, OSError):
        engine.stop("the server process exited")
        stopped = True
    engine.shutdown()
    return stopped


def _handle(message: tuple[object, ...], engine: AsyncEngine, sender: _Sender) -> bool:
    """Act on one message from the server; True if it said to stop."""
    kind = message[0]
    if kind == SUBMIT:
        _, sid, requests = message
        sink = _PipeSink(sender, sid)
        try:
            engine.submit_to(requests, sink)
        except (RequestRejectedError, EngineDeadError) as e:
            sink.put_threadsafe([e])
    elif kind == ABORT:
        engine.abort(message[1])
    elif kind == DRAIN:
        engine.drain()
    elif kind == STOP:
        engine.stop(message[1])
    elif kind == METRICS:
        sender.send((METRICS, message[1], engine.core.metrics.prometheus_text()))
    elif kind == RESET_PREFIX_CACHE:
        try:
            engine.request_prefix_cache_reset().result()  # between two steps of the loop thread
        except EngineDeadError:
            pass  # the loop is gone: the pipe closes next, and the caller is told then
        sender.send((RESET_PREFIX_CACHE, message[1], None))
    return kind == STOP


class _Sender:
    """The child's end of the pipe, shared by the loop thread (outputs) and the main thread
    (metrics)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, message: tuple[object, ...]) -> None:
        with self._lock:
            try:
                self._conn.send(message)
            except OSError:  # the server is gone: the main thread sees EOF and stops
                pass


class _PipeSink:
    """A submission's OutputSink in the engine process: its outputs go to the server."""

    def __init__(self, sender: _Sender, sid: int) -> None:
        self._sender = sender
        self._sid = sid
        self._encoder = DeltaEncoder()

    def put_threadsafe(self, items: list[RequestOutput | Exception]) -> None:
        self._sender.send((OUTPUTS, self._sid, [
            _portable(item) if isinstance(item, Exception) else self._encoder.encode(item)
            for item in items]))


def _portable(item: Exception) -> Exception:
    """An exception the server can unpickle and map to a status as in-process (any exception
    pickles; not every one unpickles)."""
    for kind in (RequestRejectedError, EngineDeadError, ValueError):
        if isinstance(item, kind):
            return kind(str(item))
    return RuntimeError(str(item))


def _exit_with(server_pid: int) -> None:
    """Be killed when the server process dies, so no orphan keeps the model's memory (Linux;
    elsewhere EOF on the pipe ends this process once its model is loaded)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != server_pid:  # it died before prctl took effect
        os._exit(1)
