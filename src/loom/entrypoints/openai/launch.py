"""`loom serve`'s start-up order, from its dataclasses (`run_server`).

Server options live in `ServerConfig` (server_config.py) and become flags (cli/serve.py) the
same way engine options do, so each is spelled once. Everything that can be refused without
the model (bad flags, a port in use) is refused before the model loads.

Start-up is two processes working at once: the engine process is started first (it imports
torch and loads the model), then this process imports the HTTP stack (`server`) and builds its
tokenizer, and serves once the engine says it is ready. So this module imports nothing heavy:
what it needs to start the engine and no more.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys

from loom.cluster.config import ClusterConfig
from loom.config import EngineConfig
from loom.entrypoints.openai.server_config import ServerConfig


def run_server(config: ServerConfig, cluster_config: ClusterConfig,
               engine_config: EngineConfig) -> int:
    """Serve until stopped; the exit status (a SIGTERM ends the process by that signal, once
    everything is stopped: status 143 in a shell, in every mode)."""
    sock = bind(config.host, config.port)  # before the model: fail in a second
    status = _serve(config, sock, cluster_config, engine_config)
    if status == 128 + signal.SIGTERM:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # whatever a library installed (Ray's)
        os.kill(os.getpid(), signal.SIGTERM)
    return status


def _serve(config: ServerConfig, sock: socket.socket, cluster_config: ClusterConfig,
           engine_config: EngineConfig) -> int:
    if cluster_config.data_parallel_size > 1:
        from loom.entrypoints.openai.server import serve_cluster

        return serve_cluster(config, sock, cluster_config, engine_config)
    if config.engine_in_process:
        from loom.engine.async_engine import AsyncEngine
        from loom.entrypoints.openai.server import serve

        return serve(config, sock, AsyncEngine.from_config(
            engine_config, config.max_num_queued_reqs, config.queue_timeout_s))
    return _serve_engine_process(config, sock, engine_config)


def _serve_engine_process(config: ServerConfig, sock: socket.socket,
                          engine_config: EngineConfig) -> int:
    from loom.engine.process import EngineProcess, EngineProcessConfig, EngineStartError
    from loom.log import LOG_FORMAT

    engine = EngineProcess(EngineProcessConfig(
        engine_config, config.max_num_queued_reqs, config.queue_timeout_s,
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
