"""The step model fitted to published rows: it reproduces its training rows, never sees the
held-out ones, and `loom simulate --engine` picks whose fit a what-if uses."""

from __future__ import annotations

import pytest

from loom.plan.catalogue import PlanError, builtin_catalogue
from loom.plan.fitted import shipped_profiles
from loom.plan.planner import PlanFlags
from loom.plan.published import published_rows
from loom.plan.roofline import Efficiency
from loom.sim.configs import SimSetup, sim_configs
from loom.sim.published_fit import JUDGED, fit_group, predictions, split

pytestmark = pytest.mark.unit


def test_the_shipped_fit_reproduces_its_training_rows_within_its_training_error():
    fitted, parts = shipped_profiles(), split(published_rows())
    preds = predictions(parts.train, fitted)
    assert len(preds) >= 60
    for engine, per_gpu in fitted.profiles.items():
        for gpu, entry in per_gpu.items():
            mine = [abs(x - 1) * 100 for p in preds if p.row.gpu == gpu
                    and p.row.engine == engine for x in p.ratios().values()]
            if mine:
                assert sum(mine) / len(mine) <= entry["train_mean_abs_pct"] + 0.5, gpu


def test_held_out_rows_are_never_trained_on():
    parts = split(published_rows())
    train = {r.key for r in parts.train}
    assert parts.judged and parts.held_out
    assert not train & {r.key for r in parts.judged + parts.held_out}
    assert all(r.source.key == JUDGED for r in parts.judged)
    assert not any(r.source.key == JUDGED for r in parts.train)
    assert shipped_profiles().meta["train_rows"] == len(parts.train)
    # vLLM held out by source and GPU: its H200 rows never train, its RTX 4090 rows do
    assert {r.gpu for r in parts.held_out if r.engine == "vllm"} == {"h200"}
    assert {r.gpu for r in parts.train if r.engine == "vllm"} == {"rtx-4090"}


def test_a_closed_loop_predicts_ttft_tpot_and_latency_consistently():
    """Lockstep waves: latency = TTFT + (osl - 1) TPOT; more users, later first tokens."""
    from loom.sim.published_fit import predict

    rows = sorted((r for r in published_rows() if r.gpu == "rtx-4090"),
                  key=lambda r: r.concurrency)
    gpu = builtin_catalogue()["rtx-4090"]
    preds = [predict(r, gpu, Efficiency()) for r in rows]
    for p in preds:
        assert p.latency_ms == pytest.approx(p.ttft_ms + (p.row.osl - 1) * p.tpot_ms)
        assert set(p.ratios()) == {"output_tok_s", "ttft_ms"}
    assert [p.ttft_ms for p in preds] == sorted(p.ttft_ms for p in preds)
    assert preds[-1].output_tok_s > preds[0].output_tok_s


def test_fit_terms_stay_physical_and_improve_on_the_start():
    rows = [r for r in split(published_rows()).train if r.gpu == "h100-sxm"
            and r.model == "llama-3.1-8b"]
    gpu = builtin_catalogue()["h100-sxm"]
    eff, err = fit_group([(r, gpu) for r in rows])
    assert 0 < eff.bandwidth <= 1 and 0 < eff.compute <= 1 and eff.step_overhead_s >= 0
    start = [abs(p.ratio - 1) * 100 for p in predictions(rows, _roofline_only())]
    assert err < sum(start) / len(start)


def test_the_joint_fit_shares_overheads_and_keeps_each_gpus_fractions():
    """One scheduler's per-step and per-sequence costs for every GPU; what differs between
    GPUs is their datasheet fractions, each within its physical bounds."""
    from loom.sim.published_fit import BOUNDS, OVERLAPS, SHARED_TERMS

    trt = shipped_profiles().profiles["trtllm"]
    for name in (*SHARED_TERMS, "overlap"):
        assert len({entry["efficiency"][name] for entry in trt.values()}) == 1, name
    assert trt["h100-sxm"]["efficiency"]["overlap"] in OVERLAPS
    assert trt["h100-sxm"]["efficiency"]["bandwidth"] != trt["h200"]["efficiency"]["bandwidth"]
    for entry in trt.values():
        for name, (lo, hi) in BOUNDS.items():
            assert lo <= entry["efficiency"][name] <= hi, name
    # a generation whose GPUs all have their own rows is their row-weighted geometric mean
    h100, h200, gh200 = (trt[g]["efficiency"]["compute"] for g in ("h100-sxm", "h200", "gh200"))
    assert min(h100, h200, gh200) <= trt["hopper"]["efficiency"]["compute"] <= max(
        h100, h200, gh200)
    assert trt["hopper"]["from"] == "geometric mean of gh200, h100-sxm, h200"
    # L40S trains at TP1 only: its link terms are borrowed from the GPUs with TP rows
    lenders = ("a100-80gb", "h100-sxm", "h200")
    assert trt["l40s"]["tp_terms_from"] == "geometric mean of " + ", ".join(lenders)
    hops = [trt[g]["efficiency"]["allreduce_hop_s"] for g in lenders]
    assert min(hops) <= trt["l40s"]["efficiency"]["allreduce_hop_s"] <= max(hops)


def _roofline_only():
    from loom.plan.fitted import FittedProfiles

    return FittedProfiles({})


def _step_model(engine: str, efficiency: str | None = None):
    from loom.config import EngineConfig, ModelConfig

    setup = SimSetup(EngineConfig(model=ModelConfig(model="llama-3.1-8b", max_model_len=4096)),
                     gpus=PlanFlags(gpus=("h100-sxm",), efficiency=efficiency),
                     serving_engine=engine)
    configs, _ = sim_configs(setup)
    return configs[0].profile


def test_engine_picks_the_fitted_profile():
    trt, vllm = _step_model("trtllm"), _step_model("vllm")
    assert trt.meta["efficiency_source"] == "fitted to trtllm on h100-sxm"
    assert vllm.meta["efficiency_source"].startswith("roofline assumptions")
    want = Efficiency(**shipped_profiles().profiles["trtllm"]["h100-sxm"]["efficiency"])
    assert trt.meta["efficiency"] == vars(want)
    assert trt.step_model.step_s == pytest.approx(want.step_overhead_s)
    assert vllm.step_model.step_s == Efficiency().step_overhead_s
    assert _step_model("trtllm", "bandwidth=0.5").meta["efficiency_source"] == "--efficiency"


def test_unknown_engine_is_a_clear_error():
    with pytest.raises(PlanError, match="unknown engine 'tgi'; choose one of vllm, trtllm"):
        SimSetup(gpus=PlanFlags(gpus=("h100-sxm",)), serving_engine="tgi")


def _cli(argv: list[str]):
    import argparse

    from loom.cli.simulate import add_parser

    parser = argparse.ArgumentParser(prog="loom")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_cli_what_if_prints_its_error_band(tmp_path, capsys):
    from loom.workload.trace import Trace, TraceRequest, write_trace

    write_trace(Trace([TraceRequest(max_tokens=32, prompt_len=200) for _ in range(20)]),
                tmp_path / "t.jsonl")
    common = ["simulate", "--model", "llama-3.1-8b", "--gpus", "h100-sxm", "--max-model-len",
              "4096", "--trace", str(tmp_path / "t.jsonl"), "--rate", "4"]
    args = _cli([*common, "--engine", "trtllm"])
    assert args.func(args) == 0
    band = shipped_profiles().band("trtllm")
    out = capsys.readouterr().out
    assert ("h100-sxm-tp1: step model fitted to trtllm on h100-sxm; expected error: "
            f"throughput ±{band.throughput_pct:.0f}%, TTFT not published") in out
    assert f"(held-out, {band.rows} rows: offline max-throughput runs" in out
    args = _cli(common)
    assert args.func(args) == 0
    assert "expected error: unknown" in capsys.readouterr().out


def test_cli_unknown_engine_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        _cli(["simulate", "--engine", "tgi"])
    assert "--engine: unknown engine 'tgi'" in capsys.readouterr().err
