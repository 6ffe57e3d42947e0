"""The server's watch on its engine (`DrainingServer.on_tick`), without a model or a socket:
an engine that dies on its own ends the server, which then exits with code 1."""

from __future__ import annotations

import asyncio

import pytest
import uvicorn

from loom.entrypoints.openai.http_server import DrainingServer

pytestmark = pytest.mark.unit


def _server(engine_alive: list[bool] | None) -> DrainingServer:
    return DrainingServer(
        uvicorn.Config(app=None), shutdown_timeout=1.0, drain=lambda: None, stop=lambda: None,
        engine_alive=None if engine_alive is None else lambda: engine_alive[0])


def test_the_server_stops_once_its_engine_is_dead() -> None:
    alive = [True]
    server = _server(alive)
    assert not asyncio.run(server.on_tick(1)) and not server.engine_died
    alive[0] = False
    assert asyncio.run(server.on_tick(2)) and server.engine_died


def test_without_a_watch_the_server_never_stops_for_its_engine() -> None:
    """Replicas on Ray: Serve replaces a dead one, so the server stays up."""
    server = _server(None)
    assert not asyncio.run(server.on_tick(1)) and not server.engine_died


def test_a_server_already_stopping_is_not_counted_as_an_engine_death() -> None:
    """SIGTERM first: the engine stops because the server asked, and the exit is clean."""
    server = _server([False])
    server.should_exit = True
    assert asyncio.run(server.on_tick(1)) and not server.engine_died
