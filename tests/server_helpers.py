"""Running `loom serve` as a real subprocess for integration tests, and reading its /metrics."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(*flags: str, startup_timeout: float = 180.0) -> Iterator[str]:
    """Start `loom serve` with `flags` on a free loopback port; yield its base URL once
    /health answers 200; stop it afterwards. Its log is shown if it fails to come up."""
    port = free_port()
    log = tempfile.TemporaryFile(mode="w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "loom.entrypoints.cli", "serve", "--port", str(port), *flags],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"loom serve did not come up:\n{log.read()[-5000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of Prometheus text (labels other than those given ignored)."""
    for line in text.splitlines():
        match = re.match(r"^([^{\s]+)(?:\{(.*)\})? (\S+)$", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(3))
    raise KeyError(f"{name} {labels} not in /metrics")
