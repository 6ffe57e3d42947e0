"""`loom serve`: the OpenAI-compatible server (its flags are `ServerConfig`'s, the cluster's
and the engine's; entrypoints/openai/launch.py starts it)."""

from __future__ import annotations

import argparse

from loom.cli.flags import add_command
from loom.cli.main import help_of
from loom.cluster.config import ClusterConfig
from loom.config import EngineConfig, from_cli_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    from loom.entrypoints.openai.launch import add_serve_args

    add_command(sub, "serve", main, add_serve_args, EngineConfig.add_cli_args,
                help=help_of("serve"),
                description="Serve a model over OpenAI's HTTP API (no arguments: the bundled "
                            "model on http://127.0.0.1:8000).")


def main(args: argparse.Namespace) -> int:
    from loom.entrypoints.openai.launch import run_server, server_config

    return run_server(server_config(args), from_cli_args(ClusterConfig, args),
                      EngineConfig.from_cli_args(args))
