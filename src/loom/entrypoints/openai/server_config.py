"""`loom serve`'s options (ServerConfig), in a module of their own: the start-up order
(launch.py) and the HTTP server (server.py) both read them, and neither imports the other
for them."""

from __future__ import annotations

import os
from dataclasses import dataclass

from loom.admission import AdmissionConfig
from loom.config import option, require_at_least
from loom.entrypoints.openai.reasoning import ReasoningParserName
from loom.entrypoints.openai.tool_parsers import ToolParserName

API_KEY_ENV = "LOOM_API_KEY"


@dataclass(frozen=True)
class HttpLimits(AdmissionConfig):
    """What the HTTP front door allows a request before it reaches the engine's queue (its
    connections, body, client share, grammar time, answer budget): the limits `loom serve`
    adds to the engine's admission, declared together so that --help lists them with it."""

    CLI_GROUP = "Admission"

    max_concurrent_per_client: int | None = option(None,
        "answer 429 (with Retry-After) to a request that would give one client (its API key "
        "among several, else its address) more than this many engine requests (prompts x n) "
        "running or queued; none = no limit")
    max_tokens_default: int = option(2048,
        "the answer's budget for chat and /v1/responses requests that give none (max_tokens, "
        "max_completion_tokens, max_output_tokens), at most what the context has left; "
        "0 = whatever the context has left (vLLM's)")
    grammar_compile_timeout: float = option(10.0,
        "seconds a structured-output constraint (schema, regex, grammar, tools) may take to "
        "compile before it is refused with a 400")
    max_request_body_bytes: int = option(4 * 2**20,
        "largest request body accepted (413 beyond)")
    max_connections: int = option(512,
        "open connections at most (one more is answered 503 and closed); lowered to fit the "
        "file-descriptor limit")

    def __post_init__(self) -> None:
        super().__post_init__()
        require_at_least(1, {"max_request_body_bytes": self.max_request_body_bytes,
                             "max_connections": self.max_connections,
                             "max_concurrent_per_client": self.max_concurrent_per_client})
        require_at_least(0, {"max_tokens_default": self.max_tokens_default})
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"grammar_compile_timeout must be > 0, got "
                             f"{self.grammar_compile_timeout}")


@dataclass(frozen=True)
class ServerConfig(HttpLimits):
    CLI_GROUP = "Server"

    host: str = option("127.0.0.1",
        "address to listen on; 0.0.0.0 serves every network the machine is on (set "
        "--api-key then)")
    port: int = option(8000,
        "TCP port to listen on, 0-65535 (0: any free one, which the log names)")
    served_model_name: str | None = option(None,
        "model name in /v1/models and responses; none = the model's own name")
    stream_interval: int = option(1,
        "tokens gathered per streamed chunk (fewer, larger chunks under load)")
    tool_call_parser: ToolParserName | None = option(None,
        "how tool calls are read from a chat answer with tool_choice auto; none = picked "
        "from the model's chat template")
    reasoning_parser: ReasoningParserName = option("none",
        "split a thinking model's <think> part out of chat answers into reasoning_content "
        "(deepseek_r1: the answer starts inside it, as R1's template opens it; qwen3: "
        "where the answer or the prompt opens it)")
    api_key: str | None = option(None,
        f"require 'Authorization: Bearer KEY' on every route but /health (401 otherwise); "
        "several keys, comma-separated, tell clients apart for --max-concurrent-per-client; "
        f"default: ${API_KEY_ENV} if set, else no key")
    metrics_api_key: str | None = option(None,
        "a key /metrics takes besides the API keys (for a scraper that should not be able to "
        "run the model); none = only the API keys")
    public_metrics: bool = option(False,
        "serve /metrics without any key, even with --api-key")
    enable_admin_routes: bool = option(False,
        "serve POST /reset_prefix_cache (vLLM's; `loom bench run --reset-prefix-cache` "
        "uses it), which changes the server's state for every client")
    ssl_keyfile: str | None = option(None,
        "serve HTTPS with this private key (PEM), given with --ssl-certfile; none = HTTP")
    ssl_certfile: str | None = option(None,
        "the certificate (chain, PEM) for --ssl-keyfile; none = HTTP")
    special_tokens_in_content: bool = option(False,
        "read special-token text in chat messages (e.g. '<|im_start|>') as the control "
        "tokens themselves, as the template's own are; by default it is plain text, so user "
        "text cannot open a forged turn")
    allowed_origins: str | None = option(None,
        "comma-separated origins whose web pages may call the API (CORS), or '*'; "
        "none = no cross-origin access")
    read_timeout: float = option(10.0,
        "seconds a client has to send its request (head and body; 408 after the head), and "
        "that an idle connection stays open")
    max_stored_responses: int = option(1024,
        "finished /v1/responses answers kept in memory for a later previous_response_id and "
        "GET /v1/responses/{id}, oldest dropped first; 0 = keep none")
    shutdown_timeout: float = option(30.0,
        "on SIGTERM, seconds requests in flight may run on before they are aborted")
    engine_in_process: bool = option(False,
        "run the engine loop on a thread of the server's process, not in a process of its "
        "own (slower to start and to serve; one process to debug)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.port <= 65535:  # else bind() raises OverflowError, not an OSError
            raise ValueError(f"port must be in 0-65535, got {self.port}")
        require_at_least(1, {"stream_interval": self.stream_interval})
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("ssl_keyfile and ssl_certfile are given together (or neither)")
        for name in ("ssl_keyfile", "ssl_certfile"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{name}: no such file {path!r}")
        if not self.read_timeout > 0:
            raise ValueError(f"read_timeout must be > 0, got {self.read_timeout}")
        if self.max_stored_responses < 0:
            raise ValueError(f"max_stored_responses must be >= 0, got "
                             f"{self.max_stored_responses}")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.api_key is not None and not all(self.api_key.split(",")):
            raise ValueError("api_key must not be empty (nor hold an empty key)")
        if self.metrics_api_key == "":
            raise ValueError("metrics_api_key must not be empty")

    @property
    def api_keys(self) -> list[str]:
        return [] if self.api_key is None else self.api_key.split(",")

    @property
    def origins(self) -> list[str]:
        return [o.strip() for o in (self.allowed_origins or "").split(",") if o.strip()]
