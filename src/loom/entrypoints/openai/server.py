"""OpenAI-compatible HTTP server (placeholder until the server issue lands)."""

from __future__ import annotations

import argparse


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)


def run_server(args: argparse.Namespace) -> int:
    raise NotImplementedError("loom serve is not built yet")
