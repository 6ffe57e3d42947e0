"""EngineProcess: `loom serve`'s engine loop in a process of its own, and the engine client
the server holds (vLLM V1's split of the API server from EngineCore).

Why: in one process start-up is serial (import torch and load the model; import the HTTP stack
and build the tokenizer: imports hold the GIL, so threads do not overlap them), and while
serving, the event loop, SSE and detokenizing share one GIL with the step loop. With two
processes the child imports torch and loads the model while the server imports FastAPI and
builds its own tokenizer, and the step loop has a GIL of its own.

`EngineProcess(config)` starts the child at once (this module is light, so the server can do
it before importing anything heavy); `wait_ready()` builds the tokenizer meanwhile and returns
once the model is loaded, raising the child's error if it is not. The messages and the child's
side are in `loom.engine.process_main`.

Errors the engine raises for a request (RequestRejectedError, ValueError, EngineDeadError)
travel as items and are raised to the stream's reader, as in-process. If the child dies, the
pipe ends: every request in flight gets EngineDeadError and `is_alive` turns False (/health
503, and the server shuts down). If the server dies, the child gets SIGKILL
(PR_SET_PDEATHSIG on Linux) or else EOF on the pipe.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from loom.engine import process_main as pipe
from loom.engine.async_engine import EngineDeadError, EngineRequest, OutputStream
from loom.engine.client import EngineFacts
from loom.engine.output_delta import DeltaDecoder, OutputDelta
from loom.engine.process_main import EngineProcessConfig, run_engine_process

logger = logging.getLogger(__name__)


def _start_method() -> str:
    """fork while this process has no other thread (the server at start-up, before it imports
    anything heavy): the child starts where the server is, with nothing to import again and no
    interpreter to start. spawn otherwise: a fork would copy locks other threads hold."""
    return "fork" if sys.platform == "linux" and threading.active_count() == 1 else "spawn"


def _join(process: multiprocessing.process.BaseProcess, timeout: float) -> None:
    """Wait up to `timeout` for `process` to exit. Process.join alone can come back early with
    the process still listed alive: its exit closes the pipe join watches a moment before the
    kernel lets it be reaped."""
    deadline = time.monotonic() + timeout
    process.join(timeout)
    while process.is_alive() and time.monotonic() < deadline:
        process.join(min(0.01, max(0.0, deadline - time.monotonic())))


class EngineStartError(RuntimeError):
    """The engine process ended before its engine was ready (it crashed loading the model)."""


@dataclass
class _Submission:
    """One `submit`: its stream and which of its requests have not finished."""

    stream: OutputStream
    unfinished: set[str]
    decoder: DeltaDecoder = field(default_factory=DeltaDecoder)


class EngineProcess:
    """An engine client (the surface the server uses of AsyncEngine) over an engine in a
    child process, which starts loading as this is made. Serve it after `wait_ready`."""

    def __init__(self, config: EngineProcessConfig) -> None:
        method = _start_method()
        context = multiprocessing.get_context(method)
        self._conn, child_conn = context.Pipe()
        inherited = self._conn if method == "fork" else None  # the child must close it
        self._process = context.Process(
            target=run_engine_process, name="loom-engine", daemon=True,
            args=(child_conn, config, os.getpid(), inherited))
        self._process.start()
        child_conn.close()  # the child's end lives in the child only: its exit ends the pipe
        self._facts: EngineFacts | None = None  # once the engine is ready (wait_ready)
        self._tokenizer: Any = None
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards the three below (the reader thread writes them)
        self._submissions: dict[int, _Submission] = {}
        self._replies: dict[int, Future[object]] = {}  # asked of the child, by token
        self._dead: str | None = None  # why the engine process is gone, once it is
        self._ids = itertools.count()
        self._stop_reason: str | None = None
        self._reader = threading.Thread(target=self._read, name="loom-engine-reader",
                                        daemon=True)
        self._model = config.engine.model.model

    def wait_ready(self) -> None:
        """Build the tokenizer here while the child loads the model; return once it has.
        Raises the child's error: ValueError for what the user can fix (a bad model path, a
        config the engine refuses), EngineStartError for a crash."""
        from loom.model.arch import default_model_path
        from loom.model.model_files import read_tokenizer

        try:
            tokenizer = read_tokenizer(self._model or default_model_path())
        except Exception:  # noqa: BLE001 - the child reads the same files: its reason first
            self._await_ready()
            self.shutdown()
            raise
        self._facts, self._tokenizer = self._await_ready(), tokenizer

    def _await_ready(self) -> EngineFacts:
        try:
            message = self._conn.recv()
        except (EOFError, OSError):
            self._process.join()
            raise EngineStartError(
                f"the engine process exited (code {self._process.exitcode}) before its model "
                "was loaded; the log above says why") from None
        if message[0] == pipe.READY:
            return message[1]
        self._process.join()
        _, user_error, why = message
        raise (ValueError if user_error else EngineStartError)(why)

    # -- the EngineClient surface (on the server's event loop), once ready ---------------------

    @property
    def facts(self) -> EngineFacts:
        if self._facts is None:
            raise RuntimeError("the engine process is not ready: call wait_ready first")
        return self._facts

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def start(self) -> None:
        self._reader.start()

    def drain(self) -> None:
        self._send((pipe.DRAIN,))

    def stop(self, reason: str = "the engine was shut down") -> None:
        """Have the engine fail every request still running with `reason`, then exit."""
        if self._stop_reason is None:
            self._stop_reason = reason
        self._send((pipe.STOP, reason))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine process and wait for it (up to `timeout`, then kill it; at once
        if it is still loading the model). Idempotent."""
        if self._facts is None:
            self._process.kill()
        self.stop()
        _join(self._process, timeout)
        if self._process.is_alive():
            logger.warning("The engine process did not stop within %gs: killing it", timeout)
            self._process.kill()
            self._process.join()
        if self._reader.is_alive():
            self._reader.join()
        self._conn.close()

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._process.is_alive()

    def submit(self, requests: list[EngineRequest]) -> OutputStream:
        """Send the requests to the engine process; its refusals come out of the stream."""
        stream = OutputStream(self, [r.request_id for r in requests])
        sid = next(self._ids)
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(self._dead)
            self._submissions[sid] = _Submission(stream, {r.request_id for r in requests})
        if not self._send((pipe.SUBMIT, sid, requests)):
            with self._lock:
                self._submissions.pop(sid, None)
            raise EngineDeadError(self._dead or "the engine process is gone")
        return stream

    def abort(self, request_id: str) -> None:
        self._send((pipe.ABORT, request_id))

    async def metrics_text(self) -> bytes:
        return await self._ask(pipe.METRICS)

    async def reset_prefix_cache(self) -> None:
        await self._ask(pipe.RESET_PREFIX_CACHE)

    async def _ask(self, kind: str) -> object:
        """Send `kind` with a token; the child's reply carries the token back."""
        import asyncio  # not at the top: the server starts the engine process before it

        token = next(self._ids)
        future: Future[object] = Future()
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(self._dead)
            self._replies[token] = future
        self._send((kind, token))
        return await asyncio.wrap_future(future)

    def _send(self, message: tuple[object, ...]) -> bool:
        """False when the engine process is gone (the reader thread then fails its requests)."""
        with self._send_lock:
            try:
                self._conn.send(message)
            except (OSError, ValueError):  # a broken pipe, or a closed connection
                return False
        return True

    # -- the reader thread --------------------------------------------------------------------

    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                if message[0] == pipe.OUTPUTS:
                    self._deliver(message[1], message[2])
                else:
                    self._reply_arrived(message[1], message[2])
        except (EOFError, OSError):
            pass
        self._process.join()  # it closed its end by exiting
        reason = self._stop_reason or (
            f"the engine process died (exit code {self._process.exitcode}); the server log "
            "says why")
        if self._stop_reason is None:
            logger.error("The engine process died (exit code %s); the server shuts down",
                         self._process.exitcode)
        self._fail_all(reason)

    def _deliver(self, sid: int, items: list[OutputDelta | Exception]) -> None:
        with self._lock:
            submission = self._submissions.get(sid)
            if submission is None:
                return
            for item in items:
                if isinstance(item, Exception):
                    submission.unfinished.clear()
                elif item.finished:
                    submission.unfinished.discard(item.request_id)
            if not submission.unfinished:
                del self._submissions[sid]
        decode = submission.decoder.decode
        submission.stream.put_threadsafe([
            item if isinstance(item, Exception) else decode(item) for item in items])

    def _reply_arrived(self, token: int, payload: object) -> None:
        with self._lock:
            future = self._replies.pop(token, None)
        if future is not None:
            future.set_result(payload)

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            self._dead = reason
            submissions, self._submissions = self._submissions, {}
            waiters, self._replies = self._replies, {}
        for submission in submissions.values():
            submission.stream.put_threadsafe([EngineDeadError(reason)])
        for future in waiters.values():
            future.set_exception(EngineDeadError(reason))
