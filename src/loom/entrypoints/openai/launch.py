"""`loom serve`: its options, and the order it starts in.

Server options live in `ServerConfig` and become flags the same way engine options do, so each
is spelled once. Everything that can be refused without the model (bad flags, a port in use) is
refused before the model loads.

Start-up is two processes working at once: the engine process is started first (it imports
torch and loads the model), then this process imports the HTTP stack (`server`) and builds its
tokenizer, and serves once the engine says it is ready. So this module imports nothing heavy:
what it needs to start the engine and no more.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import sys
from dataclasses import dataclass, field

from loom.cluster.config import ClusterConfig
from loom.config import EngineConfig, add_cli_args, flag_help, from_cli_args
from loom.entrypoints.openai.reasoning import ReasoningParserName
from loom.entrypoints.openai.tool_parsers import ToolParserName

API_KEY_ENV = "LOOM_API_KEY"


@dataclass(frozen=True)
class ServerConfig:
    CLI_GROUP = "Server"

    host: str = field(default="127.0.0.1", metadata=flag_help(
        "address to listen on; 0.0.0.0 serves every network the machine is on (set "
        "--api-key then)"))
    port: int = field(default=8000, metadata=flag_help(
        "TCP port to listen on, 0-65535 (0: any free one, which the log names)"))
    served_model_name: str | None = field(default=None, metadata=flag_help(
        "model name in /v1/models and responses; none = the model's own name"))
    stream_interval: int = field(default=1, metadata=flag_help(
        "tokens gathered per streamed chunk (fewer, larger chunks under load)"))
    tool_call_parser: ToolParserName | None = field(
        default=None, metadata=flag_help(
            "how tool calls are read from a chat answer with tool_choice auto; none = picked "
            "from the model's chat template"))
    reasoning_parser: ReasoningParserName = field(
        default="none", metadata=flag_help(
            "split a thinking model's <think> part out of chat answers into reasoning_content "
            "(deepseek_r1: the answer starts inside it, as R1's template opens it; qwen3: "
            "where the answer or the prompt opens it)"))
    api_key: str | None = field(default=None, metadata=flag_help(
        f"require 'Authorization: Bearer KEY' on every /v1 route (401 otherwise); default: "
        f"${API_KEY_ENV} if set, else no key. Routes outside /v1 stay open: /health, "
        "/metrics, /version, /tokenize, /detokenize and the OpenAPI schema and docs"))
    allowed_origins: str | None = field(default=None, metadata=flag_help(
        "comma-separated origins whose web pages may call the API (CORS), or '*'; "
        "none = no cross-origin access"))
    max_num_queued_reqs: int | None = field(default=None, metadata=flag_help(
        "answer 503 (with Retry-After) to a request that would make more than this many "
        "engine requests (prompts x n) wait for a sequence slot; none = no limit", "Admission"))
    queue_timeout: float | None = field(default=None, metadata=flag_help(
        "answer 503 for a request not scheduled within this many seconds; none = wait",
        "Admission"))
    max_request_body_bytes: int = field(default=4 * 2**20, metadata=flag_help(
        "largest request body accepted (413 beyond)", "Admission"))
    read_timeout: float = field(default=10.0, metadata=flag_help(
        "seconds a client has to send its request (head and body; 408 after the head), and "
        "that an idle connection stays open"))
    max_connections: int = field(default=512, metadata=flag_help(
        "open connections at most (one more is answered 503 and closed); lowered to fit the "
        "file-descriptor limit", "Admission"))
    max_stored_responses: int = field(default=1024, metadata=flag_help(
        "finished /v1/responses answers kept in memory for a later previous_response_id and "
        "GET /v1/responses/{id}, oldest dropped first; 0 = keep none"))
    shutdown_timeout: float = field(default=30.0, metadata=flag_help(
        "on SIGTERM, seconds requests in flight may run on before they are aborted"))
    engine_in_process: bool = field(default=False, metadata=flag_help(
        "run the engine loop on a thread of the server's process, not in a process of its "
        "own (slower to start and to serve; one process to debug)"))

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:  # else bind() raises OverflowError, not an OSError
            raise ValueError(f"port must be in 0-65535, got {self.port}")
        positive = {"stream_interval": self.stream_interval,
                    "max_num_queued_reqs": self.max_num_queued_reqs,
                    "max_request_body_bytes": self.max_request_body_bytes,
                    "max_connections": self.max_connections}
        for name, value in positive.items():
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        timeouts = {"queue_timeout": self.queue_timeout, "read_timeout": self.read_timeout}
        for name, value in timeouts.items():
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.max_stored_responses < 0:
            raise ValueError(f"max_stored_responses must be >= 0, got "
                             f"{self.max_stored_responses}")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.api_key == "":
            raise ValueError("api_key must not be empty")

    @property
    def origins(self) -> list[str]:
        return [o.strip() for o in (self.allowed_origins or "").split(",") if o.strip()]


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    add_cli_args(parser, ServerConfig)
    add_cli_args(parser, ClusterConfig)


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The flags, with the API key from the environment when no flag gives one (a flag's
    value is visible to every user of the machine in `ps`)."""
    config = from_cli_args(ServerConfig, args)
    if config.api_key is None and os.environ.get(API_KEY_ENV):
        config = dataclasses.replace(config, api_key=os.environ[API_KEY_ENV])
    return config


def run_server(args: argparse.Namespace) -> int:
    config = server_config(args)
    cluster_config = from_cli_args(ClusterConfig, args)
    engine_config = EngineConfig.from_cli_args(args)
    sock = bind(config.host, config.port)  # before the model: fail in a second
    if cluster_config.data_parallel_size > 1:
        from loom.entrypoints.openai.server import serve_cluster

        return serve_cluster(config, sock, cluster_config, engine_config)
    if config.engine_in_process:
        from loom.engine.async_engine import AsyncEngine
        from loom.entrypoints.openai.server import serve

        return serve(config, sock, AsyncEngine.from_config(
            engine_config, config.max_num_queued_reqs, config.queue_timeout))
    return _serve_engine_process(config, sock, engine_config)


def _serve_engine_process(config: ServerConfig, sock: socket.socket,
                          engine_config: EngineConfig) -> int:
    from loom.engine.process import EngineProcess, EngineProcessConfig, EngineStartError
    from loom.entrypoints.cli import LOG_FORMAT

    engine = EngineProcess(EngineProcessConfig(
        engine_config, config.max_num_queued_reqs, config.queue_timeout,
        log_level=logging.getLogger().getEffectiveLevel(), log_format=LOG_FORMAT))
    from loom.entrypoints.openai.server import serve  # the HTTP stack, while the model loads

    try:
        engine.wait_ready()
        return serve(config, sock, engine)
    except EngineStartError as e:
        print(f"loom: error: {e}", file=sys.stderr)
        return 1
    finally:
        engine.shutdown()  # whatever ended the server: no engine process outlives it


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (not yet listening: until the server is ready a client is
    refused, not left hanging). Raises OSError naming the address."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    return sock
