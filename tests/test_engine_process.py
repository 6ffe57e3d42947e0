"""`loom serve` with the engine in a process of its own (the default): completions streamed and
not, a server process that never loads torch, a child killed mid-stream (error event, no
hang, the server exits with code 1), a child or a server that fails or dies, and the
in-process engine still a flag away. Real server processes on loopback and the official
openai client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import serve_process

HANG_S = 120  # how long a test waits on something that must happen before calling it hung
PROMPT = "The capital of France is"


def engine_child(server_pid: int) -> int:
    """The pid of the server's engine process. Not every child is one: when the engine is
    spawned, not forked, multiprocessing's resource tracker is another, and the grammar
    checker's workers (`-m loom.structured.checker`) are children in every mode."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue  # it exited while we looked
        if ppid == server_pid and b"resource_tracker" not in cmdline \
                and b"loom.structured.checker" not in cmdline:
            return int(stat.parent.name)
    raise AssertionError(f"server {server_pid} has no engine process")


def maps_torch(pid: int) -> bool:
    """Whether the process has torch's library mapped: it does from `import torch` on."""
    return "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text()


def wait_gone(pid: int) -> None:
    deadline = time.monotonic() + HANG_S
    while Path(f"/proc/{pid}").exists() and _state(pid) != "Z":
        assert time.monotonic() < deadline, f"process {pid} is still running"
        time.sleep(0.1)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@pytest.fixture(scope="module")
def server():
    with serve_process("--kv-cache-memory", "256MiB") as server:
        yield server


@pytest.mark.integration
def test_completions_streamed_and_not(server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    whole = client.completions.create(model="any", prompt=PROMPT, max_tokens=12,
                                      temperature=0)
    chunks = client.completions.create(model="any", prompt=PROMPT, max_tokens=12,
                                       temperature=0, stream=True)
    streamed = "".join(c.choices[0].text for c in chunks)
    assert whole.choices[0].text and streamed == whole.choices[0].text
    assert whole.usage.completion_tokens == 12
    chat = client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, temperature=0)
    assert "Paris" in chat.choices[0].message.content


@pytest.mark.integration
def test_the_server_process_never_loads_torch(server) -> None:
    assert not maps_torch(server.pid)
    assert maps_torch(engine_child(server.pid))  # the check sees torch where it is loaded
    metrics = httpx.get(f"{server.url}/metrics").text  # the engine's, through the pipe
    assert "loom:generation_tokens_total" in metrics


@pytest.mark.integration
def test_killing_the_engine_mid_stream_fails_streams_and_exits_the_server() -> None:
    with serve_process("--kv-cache-memory", "128MiB") as server:
        body = {"model": "any", "prompt": "Tell me a long story", "max_tokens": 2000,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                          timeout=HANG_S) as response:
            lines = (line[6:] for line in response.iter_lines() if line.startswith("data: "))
            assert "choices" in json.loads(next(lines))
            os.kill(engine_child(server.pid), signal.SIGKILL)
            events = list(lines)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "service_unavailable_error"
        assert "engine process died" in error["message"]
        # Not a server answering 503 for ever: it exits, for its supervisor to restart it.
        assert server.proc.wait(timeout=HANG_S) == 1
        assert "The engine is dead" in server.log_path.read_text()


@pytest.mark.integration
def test_the_engine_exits_with_the_server() -> None:
    with serve_process("--kv-cache-memory", "128MiB") as server:
        child = engine_child(server.pid)
        os.kill(server.pid, signal.SIGKILL)
        wait_gone(child)


def _serve_and_fail(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loom.cli", "serve", "--port",
                           "0", *flags], capture_output=True, text=True, timeout=HANG_S)


@pytest.mark.integration
def test_a_bad_model_path_exits_with_the_reason(tmp_path: Path) -> None:
    missing = _serve_and_fail("--model", str(tmp_path / "none.gguf"))
    assert missing.returncode != 0 and "does not exist" in missing.stderr
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + b"\0" * 64)
    failed = _serve_and_fail("--model", str(corrupt))
    assert failed.returncode != 0 and "corrupt.gguf" in failed.stderr


@pytest.mark.integration
def test_an_engine_that_refuses_its_config_exits_with_the_reason() -> None:
    """The model loads (the server's tokenizer too); the engine then refuses the config."""
    failed = _serve_and_fail("--no-enable-chunked-prefill", "--max-num-batched-tokens", "64",
                             "--max-num-seqs", "8", "--kv-cache-memory", "64MiB")
    assert failed.returncode != 0
    assert "max_num_batched_tokens (64) must be >= max_model_len" in failed.stderr
    assert "loaded" in failed.stderr  # it was the engine process that refused


@pytest.mark.integration
def test_the_engine_in_process_is_a_flag_away() -> None:
    with serve_process("--kv-cache-memory", "128MiB", "--engine-in-process") as server:
        with pytest.raises(AssertionError):
            engine_child(server.pid)
        assert maps_torch(server.pid)
        answer = httpx.post(f"{server.url}/v1/completions", timeout=HANG_S,
                            json={"model": "any", "prompt": PROMPT, "max_tokens": 4})
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"]


class ExitingProcess:
    """A process at the moment it exits: join comes back at once (its sentinel pipe has
    closed), yet it is listed alive for a few more looks (not reaped yet)."""

    def __init__(self, alive_looks: int) -> None:
        self.alive_looks = alive_looks
        self.joins: list[float | None] = []

    def join(self, timeout: float | None = None) -> None:
        self.joins.append(timeout)

    def is_alive(self) -> bool:
        self.alive_looks -= 1
        return self.alive_looks >= 0


@pytest.mark.unit
def test_shutdown_waits_out_an_exit_that_join_saw_early() -> None:
    from loom.engine.process import _join

    exiting = ExitingProcess(alive_looks=3)
    _join(exiting, timeout=30.0)
    assert not exiting.is_alive() and len(exiting.joins) == 4  # not given up after one join
    stuck = ExitingProcess(alive_looks=10**9)
    started = time.monotonic()
    _join(stuck, timeout=0.05)
    assert stuck.is_alive() and time.monotonic() - started < 5  # the timeout still holds
