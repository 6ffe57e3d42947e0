"""Every engine the server can serve meets the one EngineClient contract (engine/client.py),
with the same kinds of members: the server reaches nothing else."""

from __future__ import annotations

import inspect

import pytest

from loom.engine.async_engine import AsyncEngine
from loom.engine.client import EngineClient
from loom.engine.process import EngineProcess

pytestmark = pytest.mark.unit

MEMBERS = {name: member for name, member in vars(EngineClient).items()
           if not name.startswith("_")}


def clients() -> list[type]:
    found = [AsyncEngine, EngineProcess]
    try:
        from loom.cluster.client import ClusterEngine
    except ImportError:  # no Ray on this machine
        return found
    return [*found, ClusterEngine]


def test_the_contract_is_what_the_server_uses() -> None:
    assert set(MEMBERS) == {"facts", "tokenizer", "submit", "abort", "metrics_text",
                            "reset_prefix_cache", "start", "drain", "stop", "shutdown",
                            "is_alive"}


@pytest.mark.parametrize("cls", clients(), ids=lambda c: c.__name__)
def test_each_engine_meets_the_contract(cls: type) -> None:
    for name, member in MEMBERS.items():
        if isinstance(member, property):
            # a property on the class, or an attribute its __init__ sets (the cluster's facts)
            assert isinstance(getattr(cls, name, None), property) or \
                f"self.{name}" in inspect.getsource(cls.__init__), f"{cls.__name__}.{name}"
            continue
        own = getattr(cls, name)
        assert inspect.iscoroutinefunction(own) == inspect.iscoroutinefunction(member), \
            f"{cls.__name__}.{name}: async in the contract means async here"
