"""`loom serve`: the OpenAI-compatible HTTP server over the async engine.

Routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, /version. Server
options live in `ServerConfig` and become flags the same way engine options do, so each is
spelled once. Everything that can be refused without the model (bad flags, a port in use) is
refused before the model loads.

The app serves any engine client with AsyncEngine's surface (`EngineClient`): the engine in
this process, or, with `--data-parallel-size N` above 1, N replicas on Ray Serve
(`loom.cluster`, imported only then).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import logging
import os
from collections.abc import AsyncIterable, AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, Protocol

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from prometheus_client import CONTENT_TYPE_LATEST

import loom
from loom.cluster.config import ClusterConfig
from loom.config import EngineConfig, add_cli_args, flag_help, from_cli_args
from loom.engine.async_engine import AsyncEngine, EngineRequest
from loom.entrypoints.openai import http_server
from loom.entrypoints.openai.errors import install_error_handlers
from loom.entrypoints.openai.guards import ApiKeyGuard, BodyGuard, HostGuard, is_loopback
from loom.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from loom.entrypoints.openai.serving_chat import ChatServing
from loom.entrypoints.openai.serving_completion import CompletionServing
from loom.entrypoints.openai.serving_tokenize import add_tokenize_routes

logger = logging.getLogger(__name__)

API_KEY_ENV = "LOOM_API_KEY"
_SHUTDOWN_GRACE_S = 5.0  # after shutdown_timeout: time for the last error events to go out


@dataclass(frozen=True)
class ServerConfig:
    CLI_GROUP = "Server"

    host: str = field(default="127.0.0.1", metadata=flag_help(
        "address to listen on; 0.0.0.0 serves every network the machine is on (set "
        "--api-key then)"))
    port: int = field(default=8000, metadata=flag_help("port to listen on"))
    served_model_name: str | None = field(default=None, metadata=flag_help(
        "model name in /v1/models and responses; none = the model's own name"))
    stream_interval: int = field(default=1, metadata=flag_help(
        "tokens gathered per streamed chunk (fewer, larger chunks under load)"))
    tool_call_parser: Literal["hermes", "llama3_json", "mistral"] | None = field(
        default=None, metadata=flag_help(
            "how tool calls are read from a chat answer with tool_choice auto; none = picked "
            "from the model's chat template"))
    api_key: str | None = field(default=None, metadata=flag_help(
        f"require 'Authorization: Bearer KEY' on every /v1 route (401 otherwise); default: "
        f"${API_KEY_ENV} if set, else no key. /health and /metrics stay open"))
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
    shutdown_timeout: float = field(default=30.0, metadata=flag_help(
        "on SIGTERM, seconds requests in flight may run on before they are aborted"))

    def __post_init__(self) -> None:
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
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.api_key == "":
            raise ValueError("api_key must not be empty")

    @property
    def origins(self) -> list[str]:
        return [o.strip() for o in (self.allowed_origins or "").split(",") if o.strip()]


class EngineClient(Protocol):
    """What the server uses of an engine: `core` with `.tokenizer`, `.model_name`,
    `.max_model_len`, `.num_kv_blocks`, `.block_size` and `.metrics.prometheus_text()` (bytes,
    or an awaitable of them); streams of outputs that can be closed; abort; the lifecycle."""

    core: Any

    def submit(self, requests: list[EngineRequest]) -> AsyncIterable[Any]: ...
    def abort(self, request_id: str) -> None: ...
    def start(self) -> None: ...
    def drain(self) -> None: ...
    def stop(self, reason: str = ...) -> None: ...
    def shutdown(self, timeout: float = ...) -> None: ...
    @property
    def is_alive(self) -> bool: ...


def build_app(engine: EngineClient, config: ServerConfig) -> FastAPI:
    """The app over an engine client; it starts and stops with the app's lifespan."""
    model_name = config.served_model_name or engine.core.model_name
    completions = CompletionServing(engine, model_name, config.stream_interval)
    chat = ChatServing(engine, model_name, config.stream_interval,
                       tool_call_parser=config.tool_call_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="loom", version=loom.__version__, lifespan=lifespan)
    install_error_handlers(app)
    _add_guards(app, config)

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest,
                                     raw_request: Request) -> Response:
        return await chat.create(request, raw_request)

    get = partial(app.api_route, methods=["GET", "HEAD"])  # HEAD: the same answer, no body

    @get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, root=engine.core.model_name,
                                         max_model_len=engine.core.max_model_len)])

    @get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_alive else 503)

    @get("/metrics")
    async def metrics() -> Response:
        text = engine.core.metrics.prometheus_text()
        if inspect.isawaitable(text):  # replicas elsewhere: their series are fetched
            text = await text
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @get("/version")
    async def version() -> dict[str, str]:
        return {"version": loom.__version__}

    add_tokenize_routes(app, engine)

    return app


def _add_guards(app: FastAPI, config: ServerConfig) -> None:
    """Innermost first: the body limit, the key, the Host check, then CORS outermost (so a
    browser's preflight is answered before the key is asked for)."""
    app.add_middleware(BodyGuard, max_bytes=config.max_request_body_bytes,
                       read_timeout=config.read_timeout)
    if config.api_key is not None:
        app.add_middleware(ApiKeyGuard, api_key=config.api_key)
    if is_loopback(config.host):
        app.add_middleware(HostGuard)
    if config.origins:
        app.add_middleware(CORSMiddleware, allow_origins=config.origins,
                           allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])


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
    sock = http_server.bind(config.host, config.port)  # before the model: fail in a second
    if cluster_config.data_parallel_size == 1:
        return _serve(config, sock, _local_engine(config, engine_config))
    from loom.cluster.launch import deploy
    from loom.cluster.replica import ReplicaLimits

    cluster = deploy(cluster_config, engine_config,
                     ReplicaLimits(config.max_num_queued_reqs, config.queue_timeout))
    try:
        return _serve(config, sock, cluster.engine)
    finally:
        cluster.shutdown()


def _local_engine(config: ServerConfig, engine_config: EngineConfig) -> AsyncEngine:
    from loom.engine.core import EngineCore

    return AsyncEngine(EngineCore(engine_config),
                       max_num_queued_reqs=config.max_num_queued_reqs,
                       queue_timeout=config.queue_timeout,
                       max_num_seqs=engine_config.scheduler.max_num_seqs)


def _serve(config: ServerConfig, sock: Any, engine: EngineClient) -> int:
    app = build_app(engine, config)
    logging.getLogger("uvicorn.access").addFilter(http_server.QuietPathsFilter())
    # log_config=None: uvicorn's lines go through loom's logging set-up, in one format.
    uvicorn_config = uvicorn.Config(
        app, log_config=None, http=http_server.protocol_class(
            http_server.connection_cap(config.max_connections)),
        timeout_keep_alive=config.read_timeout,
        timeout_graceful_shutdown=config.shutdown_timeout + _SHUTDOWN_GRACE_S)
    server = http_server.DrainingServer(
        uvicorn_config, config.shutdown_timeout, drain=engine.drain,
        stop=lambda: engine.stop("the server is shutting down: this request was aborted"))
    logger.info("Serving %s on http://%s:%d%s", engine.core.model_name, config.host,
                config.port, "" if config.api_key is None else " (API key required)")
    server.run(sockets=[sock])
    return 0
