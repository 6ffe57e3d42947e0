"""The published-measurements dataset: every row typed, sourced and countable."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from loom.plan.published import ENGINES, FIGURES, published_rows

pytestmark = pytest.mark.unit


def test_every_row_has_a_source_with_a_commit_or_url_and_a_figure():
    rows = published_rows()
    for r in rows:
        assert r.source.url.startswith("https://")
        assert r.source.commit is None or len(r.source.commit) == 40
        assert r.engine in ENGINES and r.source.engine_version
        assert any(getattr(r, f) for f in FIGURES)
        assert r.isl >= 1 and r.osl >= 1 and r.tp >= 1
    assert len({r.key for r in rows}) == len(rows), "duplicate rows"


def test_counts():
    rows = published_rows()
    assert len(rows) >= 60
    assert len({r.gpu for r in rows}) >= 4
    assert len({r.model for r in rows}) >= 3
    assert len({r.engine for r in rows}) >= 2


def test_vllm_rows_are_recorded_as_their_sources_state_them():
    """Spot checks: vLLM CI build 9515 (H200, 32 in / 128 out, batch 8) and the RTX 4090
    Mistral-7B sweep (256 / 128, max concurrency 16)."""
    rows = published_rows()
    ci = next(r for r in rows if r.source.key == "vllm-perf-benchmark-9515"
              and r.model == "llama-3.1-8b")
    assert (ci.gpu, ci.isl, ci.osl, ci.concurrency, ci.latency_ms) == ("h200", 32, 128, 8,
                                                                        833.421)
    sweep = next(r for r in rows if r.gpu == "rtx-4090" and r.concurrency == 16)
    assert (sweep.output_tok_s, sweep.ttft_ms, sweep.engine) == (644, 155, "vllm")
    assert sweep.source.max_num_batched_tokens == 2048  # vLLM V1's default under 70 GiB


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
