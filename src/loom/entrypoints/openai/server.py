"""`loom serve`: the OpenAI-compatible HTTP server over the async engine.

Routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, /version. Server
options live in `ServerConfig` and become flags the same way engine options do, so each is
spelled once.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

import loom
from loom.config import EngineConfig, add_cli_args, flag_help, from_cli_args
from loom.engine.async_engine import AsyncEngine
from loom.engine.core import EngineCore
from loom.entrypoints.openai.errors import install_error_handlers
from loom.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from loom.entrypoints.openai.serving_chat import ChatServing
from loom.entrypoints.openai.serving_completion import CompletionServing

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata=flag_help("address to listen on"))
    port: int = field(default=8000, metadata=flag_help("port to listen on"))
    served_model_name: str | None = field(default=None, metadata=flag_help(
        "model name in /v1/models and responses; none = the model's own name"))
    stream_interval: int = field(default=1, metadata=flag_help(
        "tokens gathered per streamed chunk (fewer, larger chunks under load)"))
    max_num_queued_reqs: int | None = field(default=None, metadata=flag_help(
        "answer 503 (with Retry-After) when this many requests already wait; none = no limit"))
    queue_timeout: float | None = field(default=None, metadata=flag_help(
        "answer 503 for a request not scheduled within this many seconds; none = wait"))

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.max_num_queued_reqs is not None and self.max_num_queued_reqs < 1:
            raise ValueError(f"max_num_queued_reqs must be >= 1, got {self.max_num_queued_reqs}")
        if self.queue_timeout is not None and self.queue_timeout <= 0:
            raise ValueError(f"queue_timeout must be > 0, got {self.queue_timeout}")


def build_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    """The app over an engine; the engine loop starts and stops with the app's lifespan."""
    model_name = config.served_model_name or engine.core.model_name
    completions = CompletionServing(engine, model_name, config.stream_interval)
    chat = ChatServing(engine, model_name, config.stream_interval)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="loom", version=loom.__version__, lifespan=lifespan)
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest,
                                     raw_request: Request) -> Response:
        return await chat.create(request, raw_request)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, root=engine.core.model_name,
                                         max_model_len=engine.core.max_model_len)])

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.core.metrics.prometheus_text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": loom.__version__}

    return app


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    add_cli_args(parser, ServerConfig)


def run_server(args: argparse.Namespace) -> int:
    config = from_cli_args(ServerConfig, args)
    engine = AsyncEngine(EngineCore(EngineConfig.from_cli_args(args)),
                         max_num_queued_reqs=config.max_num_queued_reqs,
                         queue_timeout=config.queue_timeout)
    app = build_app(engine, config)
    logger.info("Serving %s on http://%s:%d", engine.core.model_name, config.host, config.port)
    # log_config=None: uvicorn's lines go through loom's logging set-up, in one format.
    uvicorn.run(app, host=config.host, port=config.port, log_config=None)
    return 0
