"""The server's check of a client's constraint, in child processes: bounded in time, fair
between clients, and unable to take the server down.

A spec is checked by compiling it (grammar.grammar_for), and that compile is native code with
no time limit of its own: a 1.3 MB grammar took minutes, and a grammar whose rules chain a few
thousand deep overflowed its stack and killed the process. So each check runs in one of a few
long-lived child processes, on a thread with a small stack (CHECK_STACK_BYTES: smaller than the
engine's compile threads get, so what passes here cannot overflow there). A check that takes
longer than `timeout` seconds, or kills its child, is the client's 400, and the child is
replaced.

Results (pass or the reason it failed) are cached by (kind, spec), so a spec sent again — every
turn of an agent sends the same tools — is answered at once without a child; checks of a spec
already in progress wait for that one. Waiting checks are served round-robin by client, so one
client's queue of slow grammars holds up only its own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import select
import subprocess
import sys
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from loom.sampling import StructuredOutputsParams
from loom.structured.grammar import StructuredOutputsError

logger = logging.getLogger(__name__)

CHECK_STACK_BYTES = 4 * 2**20
_CACHE_SIZE = 1024


@dataclass
class _Job:
    key: tuple[str, str]
    done: asyncio.Future[str | None]  # the failure's reason, or None: it compiles


@dataclass
class _Worker:
    """One child process (`python -m loom.structured.checker`, so nothing of the server's
    own main module or state goes with it): a JSON line [kind, spec] in, a JSON line out."""

    process: subprocess.Popen[bytes]

    @classmethod
    def start(cls) -> _Worker:
        return cls(subprocess.Popen([sys.executable, "-m", "loom.structured.checker"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE))

    def check(self, key: tuple[str, str], timeout: float) -> str | None:
        """Blocking: the failure's reason or None. Raises TimeoutError or EOFError (the
        child died), after which this worker must be stopped."""
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            self.process.stdin.write(json.dumps(list(key)).encode() + b"\n")
            self.process.stdin.flush()
        except OSError as e:
            raise EOFError from e
        readable, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not readable:
            raise TimeoutError
        line = self.process.stdout.readline()
        if not line:
            raise EOFError
        return json.loads(line)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(5)


@dataclass
class GrammarChecker:
    """`workers` children at most, started on first use; a check longer than `timeout`
    seconds fails."""

    workers: int
    timeout: float
    _cache: OrderedDict[tuple[str, str], str | None] = field(default_factory=OrderedDict)
    _running: dict[tuple[str, str], asyncio.Future[str | None]] = field(default_factory=dict)
    _queues: dict[str, deque[_Job]] = field(default_factory=dict)  # waiting, by client
    _last_served: dict[str, int] = field(default_factory=dict)  # client -> turn it was served
    _turn: int = 0
    _idle: list[_Worker] = field(default_factory=list)
    _num_started: int = 0

    def start(self) -> None:
        """Start the children now (each imports llguidance), not on the first request."""
        while self._num_started < self.workers:
            self._idle.append(_Worker.start())
            self._num_started += 1

    async def check(self, params: StructuredOutputsParams, client: str = "") -> None:
        """Raise StructuredOutputsError if `params` cannot compile (or allows no answer)."""
        key = params.key
        if key in self._cache:
            self._cache.move_to_end(key)
            reason = self._cache[key]
        elif key in self._running:
            reason = await asyncio.shield(self._running[key])
        else:
            done: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
            self._running[key] = done
            self._queues.setdefault(client, deque()).append(_Job(key, done))
            self._dispatch()
            reason = await asyncio.shield(done)
        if reason is not None:
            raise StructuredOutputsError(key[0], reason)

    def _dispatch(self) -> None:
        """Hand waiting jobs to free workers: each to the waiting client served longest ago
        (or never), so that clients take turns."""
        while self._queues and (self._idle or self._num_started < self.workers):
            client = min(self._queues, key=lambda c: self._last_served.get(c, -1))
            queue = self._queues[client]
            job = queue.popleft()
            if not queue:
                del self._queues[client]
            self._turn += 1
            self._last_served[client] = self._turn
            if len(self._last_served) > _CACHE_SIZE:  # forget clients no longer waiting
                self._last_served = {c: t for c, t in self._last_served.items()
                                     if c in self._queues or c == client}
            if self._idle:
                worker = self._idle.pop()
            else:
                worker = _Worker.start()
                self._num_started += 1
            asyncio.get_running_loop().create_task(self._run(worker, job))

    async def _run(self, worker: _Worker, job: _Job) -> None:
        kind = job.key[0]
        try:
            reason = await asyncio.to_thread(worker.check, job.key, self.timeout)
            self._idle.append(worker)
        except TimeoutError:
            reason = (f"took longer than {self.timeout:g} s to compile "
                      "(--grammar-compile-timeout); simplify it")
            logger.warning("A %s spec of %d characters took longer than %g s to compile",
                           kind, len(job.key[1]), self.timeout)
            await asyncio.to_thread(worker.stop)
            self._num_started -= 1
        except (EOFError, OSError):
            reason = "the grammar engine failed on it (nested too deeply?)"
            logger.warning("The grammar engine's check process died on a %s spec of %d "
                           "characters", kind, len(job.key[1]))
            await asyncio.to_thread(worker.stop)
            self._num_started -= 1
        self._cache[job.key] = reason
        while len(self._cache) > _CACHE_SIZE:
            self._cache.popitem(last=False)
        del self._running[job.key]
        job.done.set_result(reason)
        self._dispatch()

    def close(self) -> None:
        for worker in self._idle:
            worker.stop()
        self._idle.clear()


def _child_main() -> None:
    """A check process: a JSON line [kind, spec] in, the failure's reason (or null) out,
    until its input ends."""
    from loom.structured.grammar import _checked_grammar, client_reason

    threading.stack_size(CHECK_STACK_BYTES)
    for line in sys.stdin.buffer:
        key = tuple(json.loads(line))
        result: list[str | None] = [None]

        def run(key: tuple[str, str] = key, result: list[str | None] = result) -> None:
            try:
                _checked_grammar(*key)
            except StructuredOutputsError as e:
                result[0] = e.detail
            except Exception as e:  # noqa: BLE001 - whatever it is, the spec failed
                result[0] = client_reason(str(e) or type(e).__name__)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        sys.stdout.write(json.dumps(result[0]) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _child_main()
