"""`loom serve`'s OpenAI-compatible HTTP server over an engine client (its options and start-up
order are `loom.entrypoints.openai.launch`'s).

Routes: /v1/completions, /v1/chat/completions, /v1/responses (and GET/DELETE of a kept one),
/v1/models (and /v1/models/{id}), /tokenize, /detokenize, /health, /metrics, /version, and
with --enable-admin-routes /reset_prefix_cache.

The app serves any `EngineClient` (loom.engine.client), and sees nothing else of it: by default the
engine in a child process (`loom.engine.process`: it loads the model while this process
imports the HTTP stack, and its step loop has a GIL of its own), with `--engine-in-process`
the engine on a thread of this process, or, with `--data-parallel-size N` above 1, N replicas
on Ray Serve (`loom.cluster`, imported only then).
"""

from __future__ import annotations

import logging
import signal
import socket
import warnings
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from loom.cluster.config import ClusterConfig
from loom.config import EngineConfig
from loom.engine.client import EngineClient
from loom.entrypoints.openai import http_server
from loom.entrypoints.openai.errors import APIError, install_error_handlers
from loom.entrypoints.openai.fairness import ClientLimiter
from loom.entrypoints.openai.guards import (
    ApiKeyGuard,
    BodyGuard,
    HostGuard,
    RequestContext,
    install_request_id_logging,
    is_loopback,
)
from loom.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from loom.entrypoints.openai.protocol_responses import (
    DeletedResponse,
    ResponseObject,
    ResponsesRequest,
)
from loom.entrypoints.openai.response_store import ResponseStore
from loom.entrypoints.openai.server_config import ServerConfig
from loom.entrypoints.openai.serving_chat import ChatServing
from loom.entrypoints.openai.serving_completion import CompletionServing
from loom.entrypoints.openai.serving_responses import ResponsesServing
from loom.entrypoints.openai.serving_tokenize import add_tokenize_routes
from loom.structured.checker import GrammarChecker
from loom.structured.manager import compile_workers
from loom.version import __version__

# FastAPI imports pydantic.v1 (for its compatibility check) the first time it builds a route:
# import it now, with the rest of the HTTP stack, while the engine process loads the model,
# not after (build_app runs once the engine is ready).
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import pydantic.v1  # noqa: F401

logger = logging.getLogger(__name__)

_SHUTDOWN_GRACE_S = 5.0  # after shutdown_timeout: time for the last error events to go out


def build_app(engine: EngineClient, config: ServerConfig) -> FastAPI:
    """The app over an engine client; it starts and stops with the app's lifespan."""
    facts = engine.facts
    model_name = config.served_model_name or facts.model_name
    http_metrics = HTTPMetrics(facts.model_name)
    checker = GrammarChecker(compile_workers(), config.grammar_compile_timeout)
    shared = {"checker": checker, "max_tokens_default": config.max_tokens_default or None,
              "limiter": ClientLimiter(config.max_concurrent_per_client,
                                       http_metrics.throttled.inc)}
    completions = CompletionServing(engine, model_name, config.stream_interval, **shared)
    chat = ChatServing(engine, model_name, config.stream_interval,
                       tool_call_parser=config.tool_call_parser,
                       special_tokens_in_content=config.special_tokens_in_content,
                       reasoning=config.reasoning_parser, **shared)
    responses = ResponsesServing(chat, ResponseStore(config.max_stored_responses))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        checker.start()
        yield
        checker.close()
        engine.shutdown()

    app = FastAPI(title="loom", version=__version__, lifespan=lifespan,
                  responses={400: {"model": ErrorResponse,
                                   "description": "Bad request: the error's param names the "
                                                  "field"}})
    app.openapi = partial(_openapi, app)  # type: ignore[method-assign]
    install_error_handlers(app)
    _add_guards(app, config, http_metrics)

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest,
                                     raw_request: Request) -> Response:
        return await chat.create(request, raw_request)

    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        return await responses.create(request, raw_request)

    get = partial(app.api_route, methods=["GET", "HEAD"])  # HEAD: the same answer, no body

    if config.enable_admin_routes:
        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache() -> Response:
            """vLLM's: forget every cached prefix, so that benchmark repeats start cold
            (`loom bench run --repeats N --reset-prefix-cache`)."""
            try:
                await engine.reset_prefix_cache()
            except NotImplementedError as e:  # replicas on Ray: each holds its own cache
                raise APIError(501, str(e)) from e
            return Response(status_code=200)

    @get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> ResponseObject:
        return responses.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> DeletedResponse:
        return responses.delete(response_id)

    def card() -> ModelCard:
        return ModelCard(id=model_name, root=facts.model_name,
                         max_model_len=facts.max_model_len)

    @get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[card()])

    @get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> ModelCard:
        """The OpenAI SDK's `models.retrieve`: the served model by its name."""
        if model_id != model_name:
            raise APIError(404, f"the model {model_id!r} does not exist; this server serves "
                           f"{model_name!r}", "model", type_="not_found_error")
        return card()

    @get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_alive else 503)

    @get("/metrics")
    async def metrics() -> Response:
        return Response(await engine.metrics_text() + http_metrics.prometheus_text(),
                        media_type=CONTENT_TYPE_LATEST)

    @get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    add_tokenize_routes(app, engine, config.special_tokens_in_content)

    return app


class HTTPMetrics:
    """What only the HTTP server sees, served after the engine's series on /metrics."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.abandoned = Counter(
            "loom:http_requests_abandoned", "HTTP requests whose client left before the server "
            "read their body; they never reached the engine", ["model_name"],
            registry=self.registry).labels(model_name=model_name)
        self.throttled = Counter(
            "loom:http_requests_throttled", "HTTP requests answered 429 because their client "
            "held --max-concurrent-per-client engine requests already; they never reached "
            "the engine", ["model_name"], registry=self.registry).labels(model_name=model_name)

    def prometheus_text(self) -> bytes:
        return generate_latest(self.registry)


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, saying what the server sends for a body it refuses: 400 with an
    OpenAI error body (errors.py), not FastAPI's 422 with its validation details."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        components = schema.get("components", {}).get("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            components.pop(unused, None)
        app.openapi_schema = schema
    return app.openapi_schema


def _add_guards(app: FastAPI, config: ServerConfig, http_metrics: HTTPMetrics) -> None:
    """Innermost first: the body limit, the key, the Host check, CORS (so a browser's
    preflight is answered before the key is asked for), then the request's id outermost
    (on every answer, refusals included)."""
    app.add_middleware(BodyGuard, max_bytes=config.max_request_body_bytes,
                       read_timeout=config.read_timeout, on_abandoned=http_metrics.abandoned.inc)
    if config.api_keys:
        app.add_middleware(ApiKeyGuard, keys=config.api_keys,
                           metrics_key=config.metrics_api_key,
                           public_metrics=config.public_metrics)
    if is_loopback(config.host):
        app.add_middleware(HostGuard)
    if config.origins:
        app.add_middleware(CORSMiddleware, allow_origins=config.origins,
                           allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
                           expose_headers=["X-Request-Id"])
    app.add_middleware(RequestContext)


def serve_cluster(config: ServerConfig, sock: socket.socket, cluster_config: ClusterConfig,
                  engine_config: EngineConfig) -> int:
    """Serve `--data-parallel-size N` replicas on Ray Serve."""
    from loom.admission import AdmissionConfig
    from loom.cluster.launch import deploy

    cluster = deploy(cluster_config, engine_config,
                     AdmissionConfig(config.max_num_queued_reqs, config.queue_timeout_s))
    try:
        return serve(config, sock, cluster.engine, exit_with_engine=False)
    finally:
        cluster.shutdown()


def serve(config: ServerConfig, sock: socket.socket, engine: EngineClient,
          exit_with_engine: bool = True) -> int:
    """Serve the app over `engine` on `sock` until SIGTERM (then drain and return 143, which
    `launch.run_server` turns into the signal itself once everything is stopped) or Ctrl-C
    (then drain and return 130, a second one aborting what still runs), or, with
    `exit_with_engine`, until the engine dies (then return 1). Replicas on Ray do not: Ray
    Serve replaces a dead one."""
    install_request_id_logging()
    warn_if_exposed(config)
    app = build_app(engine, config)
    logging.getLogger("uvicorn.access").addFilter(http_server.QuietPathsFilter())
    # log_config=None: uvicorn's lines go through loom's logging set-up, in one format.
    uvicorn_config = uvicorn.Config(
        app, log_config=None, http=http_server.protocol_class(
            http_server.connection_cap(config.max_connections)),
        timeout_keep_alive=config.read_timeout,
        timeout_graceful_shutdown=config.shutdown_timeout + _SHUTDOWN_GRACE_S,
        ssl_keyfile=config.ssl_keyfile, ssl_certfile=config.ssl_certfile)
    server = http_server.DrainingServer(
        uvicorn_config, config.shutdown_timeout, drain=engine.drain,
        stop=lambda: engine.stop("the server is shutting down: this request was aborted"),
        engine_alive=(lambda: engine.is_alive) if exit_with_engine else None)
    logger.info("Serving %s on %s://%s:%d%s", engine.facts.model_name,
                "http" if config.ssl_certfile is None else "https", config.host,
                sock.getsockname()[1],  # the port bound: the one asked for, or --port 0's pick
                "" if config.api_key is None else " (API key required)")
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass  # uvicorn re-raises, at exit, the Ctrl-C it has drained for: handled, no crash
    if server.engine_died:
        return 1
    if server.terminated:
        return 128 + signal.SIGTERM
    return 128 + signal.SIGINT if server.interrupted else 0  # a shell's status for Ctrl-C


def warn_if_exposed(config: ServerConfig) -> None:
    """A non-loopback address without a key serves the model to anyone who can reach it."""
    if not is_loopback(config.host) and config.api_key is None:
        logger.warning("Listening on %s without an API key: anyone who can reach this port "
                       "can use the model and read /metrics. Set LOOM_API_KEY (or --api-key), "
                       "and serve over TLS (--ssl-certfile) where the network is not yours",
                       config.host)
