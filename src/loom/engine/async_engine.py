"""AsyncEngine: EngineCore's step loop on a background thread, one output stream per caller.

A step is almost all torch work, which releases the GIL, so the asyncio HTTP server keeps
accepting and streaming while the model runs. The loop never waits for a batch to fill:
whatever arrived by the top of a step joins that step (continuous batching), and each step's
outputs go out as soon as it ends.

Threading contract: only the loop thread touches EngineCore. Callers hand it work through a
lock-protected inbox (adds and aborts, drained at the top of every step); outputs travel back
to each caller's event loop with `call_soon_threadsafe`. When there is no work the loop sleeps
on a Condition, so an idle server costs no CPU.

Admission counts engine requests (an HTTP request with P prompts and n choices is P x n of
them) and takes them all or none. A request "waits" only if it would find no free sequence
slot: arrivals that the next step will schedule at once do not fill the queue.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import defaultdict
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from loom.engine.client import EngineDeadError, EngineFacts, EngineRequest, RequestRejectedError
from loom.outputs import RequestOutput

if TYPE_CHECKING:  # the engine process's server side imports this module without the engine
    from loom.config import EngineConfig
    from loom.engine.core import EngineCore

logger = logging.getLogger(__name__)


class Aborter(Protocol):
    """Whoever an OutputStream tells to abort the requests its reader left."""

    def abort(self, request_id: str) -> None: ...


class OutputSink(Protocol):
    """Where the loop thread puts a caller's outputs (and the error that ends them)."""

    def put_threadsafe(self, items: list[RequestOutput | Exception]) -> None: ...


class OutputStream:
    """The outputs of one caller's engine requests (an HTTP request's choices), as they come.

    Outputs are cumulative (text and token ids so far), so when the reader falls behind only
    the newest output of each request matters: iteration yields, per wake-up, the newest output
    of every request that progressed. Errors the engine sends (ValueError: the request can
    never run; RequestRejectedError; EngineDeadError) are raised to the reader.
    """

    def __init__(self, engine: Aborter, request_ids: list[str]) -> None:
        import asyncio  # here: the engine process, which never makes a stream, skips it

        self._engine = engine
        self._loop = asyncio.get_running_loop()
        self._ready = asyncio.Event()
        self._items: list[RequestOutput | Exception] = []
        self._unfinished = set(request_ids)
        self._closed = False

    def put_threadsafe(self, items: list[RequestOutput | Exception]) -> None:
        """Called by the loop thread; the items reach the reader on its own event loop."""
        try:
            self._loop.call_soon_threadsafe(self._put, items)
        except RuntimeError:  # the reader's event loop is closed: nobody is left to tell
            pass

    def _put(self, items: list[RequestOutput | Exception]) -> None:
        if not self._closed:
            self._items.extend(items)
            self._ready.set()

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> list[RequestOutput]:
        while not self._items:
            if self._closed or not self._unfinished:
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()
        items, self._items = self._items, []
        newest: dict[str, RequestOutput] = {}
        for item in items:
            if isinstance(item, Exception):
                self.close()
                raise item
            newest[item.request_id] = item
            if item.finished:
                self._unfinished.discard(item.request_id)
        return list(newest.values())

    def close(self) -> None:
        """Abort the requests that have not finished (the caller left or failed); iteration
        stops. Idempotent, and a no-op once every request finished."""
        if self._closed:
            return
        self._closed = True
        for request_id in self._unfinished:
            self._engine.abort(request_id)
        self._items.clear()
        self._ready.set()


class AsyncEngine:
    """Runs `core` on a background thread. `max_num_queued_reqs` and `queue_timeout` are
    admission control: refuse new work that would make more than that many requests wait for
    one of the `max_num_seqs` sequence slots, and give up on a request still unscheduled after
    that many seconds (both raise RequestRejectedError to the caller and count once, in
    `loom:request_rejected_total`)."""

    def __init__(self, core: EngineCore, max_num_queued_reqs: int | None = None,
                 queue_timeout: float | None = None, max_num_seqs: int = 0) -> None:
        self.core = core
        self.max_num_queued_reqs = max_num_queued_reqs
        self.queue_timeout = queue_timeout
        self.max_num_seqs = max_num_seqs
        self._cond = threading.Condition()
        # -- guarded by _cond: the inbox and what admission control reads
        self._adds: list[tuple[OutputSink, EngineRequest, float]] = []
        self._aborts: list[str] = []
        self._resets: list[Future[None]] = []  # prefix-cache resets asked for
        self._num_waiting = 0  # the core's waiting queue, as of the last drain or step
        self._num_running = 0  # and its running batch
        self._draining = False  # shutting down: finish what runs, take nothing new
        self._stopping = False
        self._stop_reason = "the engine was shut down"
        self._dead: EngineDeadError | None = None  # why the loop stopped, once it has
        # -- loop thread only
        self._streams: dict[str, OutputSink] = {}
        self._deadlines: dict[str, float] = {}  # unscheduled request id -> when to give up
        self._thread = threading.Thread(target=self._run, name="loom-engine-loop", daemon=True)

    @classmethod
    def from_config(cls, config: EngineConfig, max_num_queued_reqs: int | None = None,
                    queue_timeout: float | None = None) -> AsyncEngine:
        """The engine `config` describes, with these admission limits (the served engine,
        whether on a thread of the server, in the engine process or in a Ray replica)."""
        from loom.engine.core import EngineCore  # torch and the model

        return cls(EngineCore(config), max_num_queued_reqs=max_num_queued_reqs,
                   queue_timeout=queue_timeout, max_num_seqs=config.scheduler.max_num_seqs)

    # -- caller side (any thread; the HTTP server's event loop) ---------------------------------

    def start(self) -> None:
        self._thread.start()

    def drain(self) -> None:
        """Refuse new requests (503) but go on serving those already taken."""
        with self._cond:
            self._draining = True

    def stop(self, reason: str = "the engine was shut down") -> None:
        """End the loop at the top of its next step; every caller still waiting gets an
        EngineDeadError saying `reason`. Returns at once (see `shutdown`)."""
        with self._cond:
            if not self._stopping:
                self._stopping, self._stop_reason = True, reason
            self._cond.notify()

    def shutdown(self, timeout: float = 30.0) -> None:
        self.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    def submit(self, requests: list[EngineRequest]) -> OutputStream:
        """Queue requests for the next step, all or none. Must be called on the event loop
        that will read the returned stream. Raises RequestRejectedError when taking them
        would make more than `max_num_queued_reqs` requests wait, or while draining;
        EngineDeadError when the loop is down. Requests that even an idle engine could never
        take all at once get a ValueError through the stream."""
        stream = OutputStream(self, [r.request_id for r in requests])
        self.submit_to(requests, stream)
        return stream

    def submit_to(self, requests: list[EngineRequest], stream: OutputSink) -> None:
        """`submit`, with the outputs going to `stream` (from any thread; the engine process
        sends them on to the server process). Raises as `submit` does. The requests arrive
        now, not when the loop takes them in at the top of its next step: the wait for the
        step in progress counts in their queue time and TTFT, as a client sees it."""
        arrival = time.monotonic()
        with self._cond:
            if self._dead is not None:
                raise EngineDeadError(str(self._dead))
            if self._stopping or not self._thread.is_alive():
                raise EngineDeadError("the engine loop is not running")
            if self._draining:
                self._reject(requests, "the server is shutting down; retry elsewhere or later")
            too_many = self._never_admitted(len(requests))
            if too_many is not None:
                stream.put_threadsafe([ValueError(too_many)])
                return
            free_slots = max(0, self.max_num_seqs - self._num_running)
            not_running = self._num_waiting + len(self._adds)
            would_wait = max(0, not_running + len(requests) - free_slots)
            if self.max_num_queued_reqs is not None and would_wait > self.max_num_queued_reqs:
                self._reject(requests, (
                    f"server is at capacity: {max(0, not_running - free_slots)} requests "
                    f"already waiting, {len(requests)} more asked for "
                    f"(max_num_queued_reqs={self.max_num_queued_reqs}); retry later"))
            self._adds.extend((stream, r, arrival) for r in requests)
            self._cond.notify()

    def _never_admitted(self, num_requests: int) -> str | None:
        """Why a request of `num_requests` engine requests could never be taken, even by an
        idle engine, or None. A 503 with Retry-After would have its client retry forever:
        this is the client's to change (a 400, as for a prompt that can never run)."""
        if self.max_num_queued_reqs is None:
            return None
        most = self.max_num_seqs + self.max_num_queued_reqs
        if num_requests <= most:
            return None
        return (f"this request needs {num_requests} sequences (prompts x n), but at most "
                f"{most} can run or wait at once (max_num_seqs={self.max_num_seqs} + "
                f"max_num_queued_reqs={self.max_num_queued_reqs}); lower n or send fewer "
                "prompts per request")

    def _reject(self, requests: list[EngineRequest], why: str) -> None:
        self.core.metrics.rejected.inc(len(requests))
        logger.warning("Rejected request %s (%d engine requests): %s", requests[0].request_id,
                       len(requests), why)
        raise RequestRejectedError(why)

    def abort(self, request_id: str) -> None:
        """Stop a request at the top of the next step (its KV blocks are freed there)."""
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    # -- the rest of the EngineClient surface ---------------------------------------------------

    @property
    def facts(self) -> EngineFacts:
        return EngineFacts.of(self.core)

    @property
    def tokenizer(self) -> Any:
        return self.core.tokenizer

    async def metrics_text(self) -> bytes:
        return self.core.metrics.prometheus_text()

    async def reset_prefix_cache(self) -> None:
        await asyncio.wrap_future(self.request_prefix_cache_reset())

    def request_prefix_cache_reset(self) -> Future[None]:
        """Forget every cached prefix between two steps; done when the future is. Requests
        added after it is done find nothing cached from before."""
        done: Future[None] = Future()
        with self._cond:
            if self._dead is not None:
                raise self._dead
            self._resets.append(done)
            self._cond.notify()
        return done

    # -- the loop thread ------------------------------------------------------------------------

    def _run(self) -> None:
        error = None
        try:
            in_flight = None  # the step running on the model (async scheduling), as a value
            while self._wait_for_work(in_flight is not None):
                self._drain_inbox()
                self._expire_queued()
                outputs: list[RequestOutput] = []
                if self.core.has_unfinished_requests() or in_flight is not None:
                    outputs, in_flight = self.core.step(in_flight)
                else:  # only aborts arrived: no step will run to show their freed blocks
                    self.core.update_gauges()
                with self._cond:  # before delivering: whoever sees a request end sees it gone
                    self._num_waiting = self.core.num_waiting
                    self._num_running = self.core.num_running
                self._deliver(outputs)
        except Exception:  # noqa: BLE001 - any crash must fail the callers, not hang them
            logger.exception("The engine loop died; /health now reports 503")
            # What went wrong is for the log: a client is only told that it did.
            error = EngineDeadError("the engine loop died; the server log says why")
        finally:
            with self._cond:
                reason = self._stop_reason
            self._fail_all(error or EngineDeadError(reason))

    def _wait_for_work(self, step_in_flight: bool) -> bool:
        """Sleep until there is something to do; False when it is time to stop."""
        with self._cond:
            while not (self._stopping or self._adds or self._aborts or self._resets
                       or step_in_flight or self.core.has_unfinished_requests()):
                self._cond.wait()
            return not self._stopping

    def _drain_inbox(self) -> None:
        with self._cond:  # held while adding, so admission never sees a request in neither place
            resets, self._resets = self._resets, []
            if resets:  # before the adds: a request sent after the reset finds nothing cached
                self.core.reset_prefix_cache()
                for done in resets:
                    done.set_result(None)
            adds, self._adds = self._adds, []
            aborts, self._aborts = self._aborts, []
            for stream, request, arrival in adds:
                try:
                    self.core.add_request(request.request_id, request.prompt_token_ids,
                                          request.params, request.priority, arrival)
                except Exception as e:  # noqa: BLE001 - ValueError (can never run) or a bug:
                    stream.put_threadsafe([e])  # either way this request fails alone
                    continue
                self._streams[request.request_id] = stream
                if self.queue_timeout is not None:
                    self._deadlines[request.request_id] = arrival + self.queue_timeout
            self._num_waiting = self.core.num_waiting
        for request_id in aborts:
            self._deadlines.pop(request_id, None)
            output = self.core.abort_request(request_id)
            if output is not None:
                self._deliver([output])

    def _expire_queued(self) -> None:
        """Reject requests that waited past `queue_timeout` without ever being scheduled."""
        now = time.monotonic()
        for request_id, deadline in list(self._deadlines.items()):
            if not self.core.is_unscheduled(request_id):
                del self._deadlines[request_id]
            elif now >= deadline:
                del self._deadlines[request_id]
                with self.core.metrics.abort_counts_as_rejected():  # one request, one count
                    self.core.abort_request(request_id)
                logger.warning("Rejected request %s: not scheduled within queue_timeout=%gs",
                               request_id, self.queue_timeout)
                self._streams.pop(request_id).put_threadsafe([RequestRejectedError(
                    f"request waited {self.queue_timeout:g}s in the queue without being "
                    "scheduled (queue_timeout); the server is overloaded, retry later")])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_stream: dict[OutputSink, list[RequestOutput | Exception]] = defaultdict(list)
        for output in outputs:
            stream = (self._streams.pop(output.request_id, None) if output.finished
                      else self._streams.get(output.request_id))
            if stream is not None:
                by_stream[stream].append(output)
        for stream, items in by_stream.items():
            stream.put_threadsafe(items)

    def _fail_all(self, error: EngineDeadError) -> None:
        with self._cond:
            self._dead = error
            streams = {s for s, _, _ in self._adds} | set(self._streams.values())
            self._adds.clear()
            self._streams.clear()
            resets, self._resets = self._resets, []
        for done in resets:
            done.set_exception(EngineDeadError(str(error)))
        for stream in streams:  # one exception each: they are raised in different tasks
            stream.put_threadsafe([EngineDeadError(str(error))])
