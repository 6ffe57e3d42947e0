"""Running `loom serve` as a real subprocess for integration tests, and reading its /metrics."""

from __future__ import annotations

import shlex
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from loom.bench.server import LOOM_SERVE, LocalServer


@contextmanager
def serve_process(*flags: str, env: dict[str, str] | None = None,
                  startup_timeout: float = 180.0) -> Iterator[LocalServer]:
    """Start `loom serve` with `flags` (and `env` added to the environment) on a free
    loopback port; yield it (url, pid, log_path) once /health answers 200; stop it
    afterwards. Its log is shown if it fails to come up."""
    with tempfile.TemporaryDirectory() as tmp, LocalServer(
            LOOM_SERVE, shlex.join(flags), Path(tmp) / "serve.log", startup_timeout,
            env=env) as server:
        yield server


@contextmanager
def serve(*flags: str, env: dict[str, str] | None = None,
          startup_timeout: float = 180.0) -> Iterator[str]:
    """`serve_process`, yielding only the base URL."""
    with serve_process(*flags, env=env, startup_timeout=startup_timeout) as server:
        yield server.url
