"""The published-measurements dataset: every row typed, sourced and countable."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from loom.plan.published import ENGINES, published_rows

pytestmark = pytest.mark.unit


def test_every_row_has_a_source_with_a_commit_or_url_and_a_figure():
    rows = published_rows()
    for r in rows:
        assert r.source.url.startswith("https://")
        assert r.source.commit is None or len(r.source.commit) == 40
        assert r.engine in ENGINES and r.source.engine_version
        assert r.output_tok_s or r.total_tok_s or r.ttft_ms or r.tpot_ms
        assert r.isl >= 1 and r.osl >= 1 and r.tp >= 1
    assert len({r.key for r in rows}) == len(rows), "duplicate rows"


def test_counts():
    rows = published_rows()
    assert len(rows) >= 60
    assert len({r.gpu for r in rows}) >= 4
    assert len({r.model for r in rows}) >= 3


def test_a_row_is_recorded_as_its_source_states_it():
    """Spot check against TensorRT-LLM v1.0's perf-overview: Llama 3.1 8B FP8, H100, 128/2048."""
    row = next(r for r in published_rows() if r.source.key == "trtllm-perf-overview-v1.0"
               and r.model == "llama-3.1-8b" and r.gpu == "h100-sxm" and r.osl == 2048
               and r.isl == 128)
    assert row.output_tok_s == 22714 and row.dtype == "fp8" and row.tp == 1


def test_a_malformed_row_is_refused_naming_it(monkeypatch):
    from loom.plan import published
    from loom.plan.catalogue import PlanError

    obj = json.loads(resources.files("loom.plan").joinpath("published.json").read_text())
    obj["rows"][3]["tp"] = 0
    sources = {k: published.Source(key=k, url=v["url"], repo=v["repo"], path=v["path"],
                                   commit=v["commit"], engine=v["engine"],
                                   engine_version=v["engine_version"], method=v["method"])
               for k, v in obj["sources"].items()}
    with pytest.raises(PlanError, match="row 3: tp, isl"):
        published._row(obj["rows"][3], sources, "published.json row 3")
