"""`loom serve`: the OpenAI-compatible server (its flags are `ServerConfig`'s, the cluster's
and the engine's; entrypoints/openai/launch.py starts it from those dataclasses)."""

from __future__ import annotations

import argparse
import dataclasses
import os

from loom.cli.dataclass_flags import add_cli_args, add_engine_args, engine_config, from_cli_args
from loom.cli.flags import add_command
from loom.cli.main import help_of
from loom.cluster.config import ClusterConfig
from loom.entrypoints.openai.server_config import API_KEY_ENV, ServerConfig


def add_parser(sub: argparse._SubParsersAction) -> None:
    add_command(sub, "serve", main, add_serve_args, add_engine_args,
                help=help_of("serve"),
                description="Serve a model over OpenAI's HTTP API (no arguments: the bundled "
                            "model on http://127.0.0.1:8000).")


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


def main(args: argparse.Namespace) -> int:
    from loom.entrypoints.openai.launch import run_server

    return run_server(server_config(args), from_cli_args(ClusterConfig, args),
                      engine_config(args))
