"""The cluster's pure parts: its flags, its config's checks, the one-scrape metrics merge."""

from __future__ import annotations

import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from loom.cli.dataclass_flags import from_cli_args
from loom.cli.main import parse_args
from loom.cluster.config import ClusterConfig
from loom.cluster.metrics import merge_replica_texts
from loom.engine.metrics import EngineMetrics

pytestmark = pytest.mark.unit


def test_flags_come_from_the_dataclass() -> None:
    args = parse_args(["serve", "--data-parallel-size", "3", "--ray-address", "auto",
                       "--router", "round-robin", "--router-imbalance-threshold", "2"])
    assert from_cli_args(ClusterConfig, args) == ClusterConfig(
        data_parallel_size=3, ray_address="auto", router="round-robin",
        router_imbalance_threshold=2)
    assert from_cli_args(ClusterConfig, parse_args(["serve"])) == ClusterConfig()


def test_unknown_router_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["serve", "--router", "random"])
    assert "--router" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, message", [
    ({"data_parallel_size": 0}, "data_parallel_size"),
    ({"router": "random"}, "router"),
    ({"router_imbalance_threshold": -1}, "router_imbalance_threshold"),
])
def test_bad_cluster_config(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClusterConfig(**kwargs)


def _heavy_modules_after(code: str) -> list[str]:
    """Which of ray and torch a fresh interpreter has loaded after running `code`."""
    probe = f"{code}\nimport sys\nprint(*(m for m in ('ray', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True)
    return out.stdout.split()


def test_routing_policy_imports_neither_ray_nor_torch() -> None:
    assert _heavy_modules_after("import loom.cluster.routing") == []


def test_serve_with_one_replica_imports_no_ray() -> None:
    code = ("from loom.cli.main import parse_args\n"
            "import loom.entrypoints.openai.server\n"
            "parse_args(['serve', '--data-parallel-size', '1'])")
    assert "ray" not in _heavy_modules_after(code)


def _replica_text(requests: int) -> bytes:
    metrics = EngineMetrics("m")
    metrics.prompt_tokens.inc(requests * 10)
    for _ in range(requests):
        metrics.finished("stop")
    metrics.ttft.observe(0.1)
    return metrics.prometheus_text()


def test_merge_labels_every_replicas_series_in_one_family_each() -> None:
    merged = merge_replica_texts({"a": _replica_text(1), "b": _replica_text(2)}).decode()
    families = list(text_string_to_metric_families(merged))
    names = [f.name for f in families]
    assert len(names) == len(set(names))  # each family once, with both replicas' samples
    prompt = next(f for f in families if f.name == "loom:prompt_tokens")
    assert {s.labels["replica"]: s.value for s in prompt.samples
            if s.name.endswith("_total")} == {"a": 10.0, "b": 20.0}
    for family in families:
        assert all("replica" in s.labels for s in family.samples)
    ttft = next(f for f in families if f.name == "loom:time_to_first_token_seconds")
    assert {s.labels["replica"] for s in ttft.samples if s.name.endswith("_count")} == {"a", "b"}


def test_merge_of_no_replicas_is_empty() -> None:
    assert merge_replica_texts({}) == b""


def test_only_requests_count_as_router_decisions() -> None:
    """The start-up model_facts call goes through the router too; it is no request the router
    placed, so /metrics showed a decision before any client had sent one."""
    from types import SimpleNamespace

    from ray.serve._private.common import DeploymentID, ReplicaID

    from loom.cluster.metrics import ROUTER_DECISIONS
    from loom.cluster.ray_router import ROUTED_METHOD, LoomRequestRouter

    router = LoomRequestRouter.__new__(LoomRequestRouter)  # no Ray Serve controller here
    router.initialize_state(router="prefix", num_replicas=2)
    replica = ReplicaID("r-units", DeploymentID(name="loom", app_name="units"))

    def routed(method: str) -> float:
        pending = SimpleNamespace(metadata=SimpleNamespace(call_method=method,
                                                           internal_request_id=method))
        router.on_request_routed(pending, replica, None)
        return sum(s.value for m in ROUTER_DECISIONS.collect() for s in m.samples
                   if s.name.endswith("_total") and s.labels["replica"] == "r-units")

    assert routed("model_facts") == 0
    assert routed(ROUTED_METHOD) == 1
