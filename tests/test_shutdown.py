"""Connections that misbehave and a server asked to stop: idle and half-sent connections are
closed, connections over the cap are refused at once, and SIGTERM under load drains and
exits, every stream ending with [DONE] (after a finish or an error event). Real server
processes on loopback, raw sockets for the clients that misbehave."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest
from server_helpers import serve_process

pytestmark = pytest.mark.integration

LONG = {"prompt": "Tell me a very long story", "max_tokens": 600, "ignore_eos": True,
        "stream": True}
SLOW_CLIENT_S = 300  # how long a test waits on a socket before calling it hung


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def open_socket(url: str, sends: bytes = b"") -> socket.socket:
    sock = socket.create_connection(address(url))
    sock.settimeout(SLOW_CLIENT_S)
    if sends:
        sock.sendall(sends)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as
    closed: the server may close with our unread bytes still in its buffer)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


HEAD_ONLY = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"  # no blank line: half a head
HALF_BODY = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
             b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"pro")


@pytest.fixture(scope="module")
def strict_server():
    """Two seconds to send a request, six connections at most."""
    with serve_process("--kv-cache-memory", "256MiB", "--read-timeout", "2",
                       "--max-connections", "6") as server:
        yield server


def test_idle_and_half_sent_connections_are_closed(strict_server) -> None:
    silent = open_socket(strict_server.url)
    half_head = open_socket(strict_server.url, HEAD_ONLY)
    half_body = open_socket(strict_server.url, HALF_BODY)
    assert read_until_closed(silent) == b""
    assert read_until_closed(half_head) == b""
    answer = read_until_closed(half_body)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"--read-timeout" in answer
    for sock in (silent, half_head, half_body):
        sock.close()
    assert httpx.get(f"{strict_server.url}/health").status_code == 200


def test_connections_over_the_cap_are_refused_at_once(strict_server) -> None:
    """Six long streams hold all six connections: a seventh gets 503 and is closed before it
    sends a byte; once the streams go, requests are served again."""
    body = json.dumps(LONG).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
               + body)
    held = [open_socket(strict_server.url, request) for _ in range(6)]
    for sock in held:
        assert sock.recv(15) == b"HTTP/1.1 200 OK"  # streaming: its connection is held
    extra = open_socket(strict_server.url)
    refused = read_until_closed(extra)
    for sock in (*held, extra):
        sock.close()
    assert refused.startswith(b"HTTP/1.1 503"), refused
    assert httpx.get(f"{strict_server.url}/health").status_code == 200


def _stream_events(url: str, started: threading.Barrier, events: list[str],
                   body: dict = LONG) -> None:
    """Read one stream to its end; `events` gets every SSE data line."""
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body,
                          timeout=SLOW_CLIENT_S) as response:
            lines = (line for line in response.iter_lines() if line.startswith("data: "))
            events.append(next(lines)[6:])
            started.wait()
            events.extend(line[6:] for line in lines)
    except httpx.HTTPError as e:  # the test then fails on this stream's events
        events.append(f"client error: {e!r}")


def _start_streams(url: str, count: int, body: dict = LONG
                   ) -> tuple[list[list[str]], list[threading.Thread], threading.Barrier]:
    """`count` streams reading on threads: their events, the threads, and a barrier the
    caller waits at (with one party of its own) until every stream has its first chunk."""
    started = threading.Barrier(count + 1)
    events: list[list[str]] = [[] for _ in range(count)]
    readers = [threading.Thread(target=_stream_events, args=(url, started, e, body))
               for e in events]
    for reader in readers:
        reader.start()
    return events, readers, started


def test_sigterm_drains_streams_and_exits() -> None:
    """16 streams in flight and three stalled sockets (silent, half a head, half a body);
    SIGTERM with --shutdown-timeout 3: the server exits on its own, every stream ends with
    [DONE] after either its finish or an error event, and the stalled sockets are closed."""
    with serve_process("--kv-cache-memory", "512MiB", "--shutdown-timeout", "3",
                       "--read-timeout", "600") as server:
        events, readers, started = _start_streams(server.url, 16)
        stalled = [open_socket(server.url, sends) for sends in (b"", HEAD_ONLY, HALF_BODY)]
        started.wait(timeout=SLOW_CLIENT_S)  # every stream has its first chunk

        os.kill(server.pid, signal.SIGTERM)
        server.proc.wait(timeout=SLOW_CLIENT_S)  # it exits: a hang fails here
        for reader in readers:
            reader.join(timeout=SLOW_CLIENT_S)
        for sock in stalled:
            read_until_closed(sock)
            sock.close()
        log = server.log_path.read_text()

    aborted = 0
    for stream in events:
        assert stream[-1] == "[DONE]", (stream[-3:], log[-3000:])
        last = json.loads(stream[-2])
        if "error" in last:
            assert "shutting down" in last["error"]["message"]
            aborted += 1
        else:
            assert last["choices"][0]["finish_reason"] == "length"
    assert aborted > 0, "no stream was still running at the shutdown timeout"
    assert "shutdown_timeout reached" in log


def test_sigterm_to_every_process_still_drains() -> None:
    """systemd's default (KillMode=control-group), `pkill` or `kill -- -PGID` send SIGTERM to
    the engine process too: it must leave the stopping to the server, so that the streams in
    flight still finish, whole, before the server exits."""
    body = {**LONG, "max_tokens": 80}
    with serve_process("--kv-cache-memory", "256MiB", "--shutdown-timeout", "120") as server:
        events, readers, started = _start_streams(server.url, 4, body)
        started.wait(timeout=SLOW_CLIENT_S)

        os.killpg(server.pid, signal.SIGTERM)  # its own session: the server and its engine
        server.proc.wait(timeout=SLOW_CLIENT_S)
        for reader in readers:
            reader.join(timeout=SLOW_CLIENT_S)
        log = server.log_path.read_text()

    assert "engine process died" not in log, log[-3000:]
    for stream in events:
        assert stream[-1] == "[DONE]", (stream[-3:], log[-3000:])
        chunks = [json.loads(event) for event in stream[:-1]]
        assert all("error" not in chunk for chunk in chunks), (chunks[-1], log[-3000:])
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_second_ctrl_c_aborts_the_drain_and_ends_every_stream() -> None:
    """Ctrl-C starts the drain; a second one (uvicorn's force quit) used to leave asyncio to
    cancel the open streams: cut with neither an error event nor [DONE], tracebacks in the
    log, exit status 0 (one Ctrl-C: a KeyboardInterrupt traceback at exit). Now it aborts the
    requests still running, every stream ends properly, and the status is a shell's for
    Ctrl-C."""
    with serve_process("--kv-cache-memory", "256MiB", "--shutdown-timeout", "300") as server:
        events, readers, started = _start_streams(server.url, 2)
        started.wait(timeout=SLOW_CLIENT_S)

        os.kill(server.pid, signal.SIGINT)
        deadline = time.monotonic() + SLOW_CLIENT_S
        while "Draining" not in server.log_path.read_text():  # the first one was handled
            assert time.monotonic() < deadline, "the server never started draining"
            time.sleep(0.05)
        os.kill(server.pid, signal.SIGINT)
        status = server.proc.wait(timeout=SLOW_CLIENT_S)  # long before the shutdown timeout
        for reader in readers:
            reader.join(timeout=SLOW_CLIENT_S)
        log = server.log_path.read_text()

    assert status == 128 + signal.SIGINT, log[-3000:]
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-3000:]
    for stream in events:
        assert stream[-1] == "[DONE]", (stream[-3:], log[-3000:])
        assert "this request was aborted" in json.loads(stream[-2])["error"]["message"]


def test_ctrl_c_on_an_idle_server_exits_130_without_a_traceback() -> None:
    """A Ctrl-C ended `loom serve` with a KeyboardInterrupt traceback (uvicorn re-raises the
    signal it drained for, and asyncio turned it into one)."""
    with serve_process("--kv-cache-memory", "64MiB") as server:
        os.kill(server.pid, signal.SIGINT)
        status = server.proc.wait(timeout=SLOW_CLIENT_S)
        log = server.log_path.read_text()
    assert status == 128 + signal.SIGINT, log[-3000:]
    assert "KeyboardInterrupt" not in log and "Traceback" not in log, log[-3000:]
