"""Start a server under test as a subprocess on a free port, wait until /health answers, stop
it afterwards. bench imports no engine code: `loom serve` is started like any other server.
While it starts (a model load can take a minute), the log says so every few seconds."""

from __future__ import annotations

import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import httpx

logger = logging.getLogger(__name__)

PROGRESS_EVERY_S = 10.0
LOOM_SERVE = f"{shlex.quote(sys.executable)} -m loom.cli serve --port {{port}}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """`with LocalServer(template, flags, log) as server:` -> server.url, server.pid.

    template is a command line with `{port}`, e.g. LOOM_SERVE or
    'llama-server -m model.gguf --port {port}'; flags are appended to it, env is added to
    this process's environment. The server runs in its own session, so stopping it also stops
    any children it started (vLLM's engine core). `startup_s` is how long it took to answer.
    """

    def __init__(self, template: str, flags: str, log_path: Path,
                 health_timeout_s: float = 600.0, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.command = shlex.split(template.format(port=self.port)) + shlex.split(flags)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.health_timeout_s = health_timeout_s
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self._group_stopped = False

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def __enter__(self) -> LocalServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env,
                                         start_new_session=True)
        logger.info("starting %s (log: %s)", shlex.join(self.command), self.log_path)
        start = time.monotonic()
        # One client for every poll: a new one per request (httpx.get) builds an SSL context
        # each time, tens of ms of CPU taken from the server it is timing, 20 times a second.
        with httpx.Client(timeout=2) as client:
            self._wait_healthy(client, start)
        return self

    def _wait_healthy(self, client: httpx.Client, start: float) -> None:
        deadline = start + self.health_timeout_s
        next_note = start + PROGRESS_EVERY_S
        while True:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise ChildProcessError(f"server exited with {self.proc.returncode} before it was "
                                   f"healthy: {shlex.join(self.command)}\n{tail}")
            try:
                if client.get(self.url + "/health").status_code == 200:
                    self.startup_s = time.monotonic() - start
                    logger.info("server on %s healthy after %.0f s", self.url, self.startup_s)
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ChildProcessError(f"server not healthy after {self.health_timeout_s:g} s: "
                                   f"{shlex.join(self.command)} (log: {self.log_path})")
            if time.monotonic() >= next_note:
                logger.info("waiting for %s/health: %.0f s of at most %g s", self.url,
                            time.monotonic() - start, self.health_timeout_s)
                next_note += PROGRESS_EVERY_S
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is None or self._group_stopped:
            return
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait()
        self._signal(signal.SIGKILL)  # children that outlived the leader share its group
        self._group_stopped = True  # once: the group id may be reused after this

    def _signal(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # type: ignore[union-attr]
        except ProcessLookupError:
            pass

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
