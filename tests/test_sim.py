"""`loom simulate`: the real scheduler on a virtual clock, writing loom bench's result JSON."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from loom.admission import AdmissionConfig as ServerLimits
from loom.bench.diagnose import diagnose
from loom.bench.scorecard import markdown
from loom.cli.simulate import add_parser
from loom.config import CacheConfig, SchedulerConfig
from loom.plan.roofline import ModelShape, StepModel, StepWork
from loom.sim.calibrate import Sample, errors, fit
from loom.sim.profile import Profile
from loom.sim.replay import prompt_token_ids
from loom.sim.result import SimConfig, simulate_run
from loom.workload.load import Load
from loom.workload.results import load_result, save_json
from loom.workload.trace import Trace, TraceRequest, write_trace

pytestmark = pytest.mark.unit

SHAPE = ModelShape(linear_params=100_000_000, lm_head_params=10_000_000,
                   attention_flops_per_pair=4 * 30 * 576, kv_bytes_per_token=23_040,
                   weight_bytes=0)
# 5 ms per step + 0.2 ms per sequence + 1 GFLOP/ms: a small CPU-like engine
STEP = StepModel(SHAPE, step_s=0.005, seq_s=2e-4, token_s=0.0, byte_s=0.0, flop_s=1e-12,
                 combine="sum")


def _profile(num_blocks: int = 4096) -> Profile:
    return Profile("calibrated", STEP, "test-model", max_model_len=2048,
                   num_kv_blocks=num_blocks, block_size=16)


def _trace(n: int = 60, seed: int = 0, cancel_every: int = 0) -> Trace:
    """A mixed trace: short chats and long prompts, some with long outputs."""
    import random

    rng = random.Random(seed)
    requests = []
    for i in range(n):
        long = i % 4 == 0
        requests.append(TraceRequest(
            max_tokens=rng.randint(16, 200) if not long else rng.randint(8, 32),
            prompt_len=rng.randint(600, 1000) if long else rng.randint(20, 60),
            cls="long" if long else "chat", arrival_s=0.1 * i, id=f"r{i}",
            cancel_after_s=0.3 if cancel_every and i % cancel_every == 1 else None))
    return Trace(requests, {"tokenizer": "test"}, sha256="0" * 64)


def _run(trace: Trace, load: Load, num_blocks: int = 4096, scheduler: str = "continuous",
         limits: ServerLimits | None = None, **sched) -> dict:
    config = SimConfig("test", _profile(num_blocks),
                       SchedulerConfig(scheduler=scheduler, **sched), CacheConfig(),
                       limits=limits or ServerLimits())
    return simulate_run(config, trace, prompt_token_ids(trace, None, 0), load)


def _stable(result: dict) -> dict:
    """The result without what depends on the wall clock."""
    return {k: v for k, v in result.items() if k not in ("date", "simulation", "hardware",
                                                          "command")}


def test_deterministic_for_a_seed():
    trace = _trace()
    a = _run(trace, Load(rate=20.0, seed=3))
    b = _run(trace, Load(rate=20.0, seed=3))
    c = _run(trace, Load(rate=20.0, seed=4))
    assert _stable(a) == _stable(b)
    assert _stable(a)["requests"] != _stable(c)["requests"]


def test_a_request_sent_during_a_step_waits_for_it_in_its_queue_time():
    """As the engine counts it: queue time and server TTFT run from the send, so a request
    that arrives while a long prefill step runs has that step's rest in both; with no HTTP
    time simulated, the server's TTFT is the client's."""
    trace = Trace([TraceRequest(max_tokens=4, prompt_len=2000, cls="long", arrival_s=0.0,
                                id="first"),
                   TraceRequest(max_tokens=4, prompt_len=20, cls="chat", arrival_s=0.001,
                                id="second")], {"tokenizer": "test"}, sha256="0" * 64)
    result = _run(trace, Load(rate="trace"), max_num_batched_tokens=2048)
    first, second = sorted(result["requests"], key=lambda r: r["id"])
    step = first["ttft_s"]  # one step prefills the whole first prompt and samples
    assert step > 0.002  # (2,000 tokens at this model's speed: a few ms at least)
    assert second["ttft_s"] > step - 0.001  # it waited for that step, then had its own
    # (the first was scheduled at once: the mean of the two is half the second's wait)
    assert result["queue_time"]["mean_ms"] >= (step - 0.001) * 1000 / 2
    assert result["server_ttft"]["mean_ms"] == pytest.approx(
        (first["ttft_s"] + second["ttft_s"]) / 2 * 1000)


def test_tiny_kv_cache_preempts_and_a_large_one_does_not():
    trace = _trace()
    tiny = _run(trace, Load(max_concurrency=32), num_blocks=80)
    large = _run(trace, Load(max_concurrency=32), num_blocks=8192)
    assert tiny["preemptions"] > 0
    assert large["preemptions"] == 0
    assert tiny["completed"] == large["completed"] == len(trace.requests)
    assert tiny["kv_cache_usage_peak"] > large["kv_cache_usage_peak"]


def test_static_is_slower_than_continuous_on_a_mixed_trace():
    trace = _trace()
    continuous = _run(trace, Load(max_concurrency=16))
    static = _run(trace, Load(max_concurrency=16), scheduler="static", max_num_seqs=16)
    assert static["duration"] > continuous["duration"]
    assert static["output_throughput"] < continuous["output_throughput"]
    assert static["p95_ttft_ms"] > continuous["p95_ttft_ms"]


def test_every_request_ends_completed_cancelled_or_rejected():
    trace = _trace(cancel_every=5)
    result = _run(trace, Load(rate=40.0), limits=ServerLimits(max_num_queued_reqs=4,
                                                              queue_timeout_s=1.0))
    statuses = [r["status"] for r in result["requests"]]
    assert len(statuses) == len(trace.requests)
    assert set(statuses) <= {"ok", "cancelled", "rejected"}
    assert result["completed"] + result["cancelled"] + result["rejected"] == len(statuses)
    assert result["cancelled"] > 0 and result["rejected"] > 0
    cancelled = [r for r in result["requests"] if r["status"] == "cancelled"]
    assert all(r["e2e_s"] == pytest.approx(0.3) for r in cancelled)


def test_closed_loop_never_exceeds_its_users():
    result = _run(_trace(), Load(max_concurrency=5))
    assert max(e["client_in_flight"] for e in result["timeline"]) <= 5
    assert result["completed"] == 60
    assert result["num_requests_running_peak"] <= 5


def test_budget_and_chunked_prefill_are_the_real_scheduler_s():
    trace = _trace()
    small = _run(trace, Load(max_concurrency=16), max_num_batched_tokens=256, max_num_seqs=16)
    large = _run(trace, Load(max_concurrency=16), max_num_batched_tokens=2048, max_num_seqs=16)
    assert small["simulation"]["steps"] > large["simulation"]["steps"]
    with pytest.raises(ValueError, match="chunked prefill disabled"):
        _run(trace, Load(max_concurrency=4), enable_chunked_prefill=False,
             max_num_batched_tokens=512, max_num_seqs=16)


def test_the_json_loads_in_scorecard_and_diagnose(tmp_path):
    result = _run(_trace(), Load(max_concurrency=32), num_blocks=80)
    assert result["simulated"] is True and result["kind"] == "run"
    save_json(result, tmp_path / "sim.json")
    loaded = load_result(tmp_path / "sim.json")
    card = markdown([loaded])
    assert "simulated test" in card
    rules = {f.rule for f in diagnose(loaded)}
    assert "preemptions_kv_pressure" in rules
    assert loaded["queue_time"]["count"] == 60


def test_shared_prefix_hits_the_prefix_cache():
    text = "a shared document " * 100
    trace = Trace([TraceRequest(max_tokens=8, prompt=text + f" question {i}", cls="rag",
                                arrival_s=float(i), id=str(i)) for i in range(10)],
                  {"tokenizer": "bundled"})
    from loom.workload.tokens import load_tokenizer

    config = SimConfig("test", _profile(), SchedulerConfig(), CacheConfig())
    ids = prompt_token_ids(trace, load_tokenizer(None), 0)
    result = simulate_run(config, trace, ids, Load(rate="trace"))
    assert result["prefix_cache_hit_rate"] > 0.5
    assert result["completed"] == 10
    # without a tokenizer, one id per word: the same sharing
    by_words = simulate_run(config, trace, prompt_token_ids(trace, None, 0), Load(rate="trace"))
    assert by_words["prefix_cache_hit_rate"] == pytest.approx(result["prefix_cache_hit_rate"],
                                                              abs=0.1)


def test_a_prompt_s_text_counts_not_its_prompt_len():
    """`loom bench run` sends the text, so the server sees its tokens, whatever prompt_len
    says."""
    trace = Trace([TraceRequest(max_tokens=4, prompt="one two three", prompt_len=900,
                                arrival_s=0.0, id="text")], {"tokenizer": "test"})
    result = _run(trace, Load(rate="trace"))
    assert result["requests"][0]["prompt_len"] == 3
    assert result["total_input_tokens"] == 3


def test_what_the_server_refuses_is_a_400_not_a_capped_run():
    """A prompt that leaves no room in max_model_len (2048 here), or max_tokens beyond the
    room, is answered 400 by loom serve: failed, never completed; a billion-token prompt
    is refused without building its ids."""
    trace = Trace([TraceRequest(max_tokens=4, prompt_len=10**9, id="huge"),
                   TraceRequest(max_tokens=4, prompt_len=2048, id="full"),
                   TraceRequest(max_tokens=1949, prompt_len=100, id="too-many"),
                   TraceRequest(max_tokens=1948, prompt_len=100, id="fits")],
                  {"tokenizer": "test"})
    ids = prompt_token_ids(trace, None, 0, max_model_len=2048)
    assert ids[0] == [] and len(ids[3]) == 100
    config = SimConfig("test", _profile(), SchedulerConfig(), CacheConfig())
    result = simulate_run(config, trace, ids, Load(max_concurrency=1))
    by_id = {r["id"]: r for r in result["requests"]}
    for name in ("huge", "full", "too-many"):
        assert by_id[name]["status"] == "error" and by_id[name]["http_status"] == 400
    assert "at most 1948 can be generated" in by_id["too-many"]["error"]
    assert by_id["fits"]["status"] == "ok" and by_id["fits"]["output_tokens"] == 1948
    assert result["failed"] == 3 and result["completed"] == 1


@pytest.mark.parametrize("lines, message", [
    (['{"header": 5}', '{"prompt_len": 10, "max_tokens": 4}'],
     "t.jsonl:1: the trace header must be a JSON object, got 5"),
    (['{"header": {}}', "", '{"prompt_len": 10, "max_tokens": 4}',
      '{"prompt": "hi there", "prompt_len": "x", "max_tokens": 4}'],
     "t.jsonl:4: prompt_len must be a positive integer, got 'x'"),
    (['{"prompt_len": 10, "max_tokens": 4, "priority": "high"}'],
     "t.jsonl:1: priority must be an integer, got 'high'"),
])
def test_cli_refuses_a_bad_trace_before_simulating(tmp_path, monkeypatch, lines, message):
    import loom.sim.whatif

    def no_run(*args, **kwargs):
        raise AssertionError("simulated before the trace was checked")

    monkeypatch.setattr(loom.sim.whatif, "simulate_run", no_run)
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    _profile().save(tmp_path / "p.json")
    args = _cli(["simulate", "--profile", str(tmp_path / "p.json"), "--trace",
                 str(tmp_path / "t.jsonl"), "--rate", "1"])
    with pytest.raises(ValueError, match=message):
        args.func(args)


def test_profile_round_trip(tmp_path):
    _profile().save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == _profile()
    (tmp_path / "bad.json").write_text(json.dumps({"kind": "other"}))
    with pytest.raises(ValueError, match="not a loom step profile"):
        Profile.load(tmp_path / "bad.json")


def test_fit_recovers_a_known_step_model():
    truth = StepModel(SHAPE, step_s=0.02, seq_s=5e-4, token_s=1e-5, byte_s=1e-10,
                      flop_s=2e-11, combine="sum")
    works = [StepWork.of([(p, 0, True)] * (p > 0) + [(1, c, True)] * d)
             for p in (0, 32, 256, 1024) for d in (0, 1, 8, 32) for c in (100, 1000)
             if p or d]
    samples = [Sample(w, [truth.time(w)]) for w in works]
    model = fit(samples, SHAPE)
    assert errors(model, samples)["max_abs_pct"] < 1.0


# -- the CLI ------------------------------------------------------------------------------------

def _cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="loom")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_cli_profile_run_writes_the_bench_json(tmp_path, capsys):
    write_trace(_trace(), tmp_path / "t.jsonl")
    _profile().save(tmp_path / "p.json")
    args = _cli(["simulate", "--profile", str(tmp_path / "p.json"), "--trace",
                 str(tmp_path / "t.jsonl"), "--max-concurrency", "8", "--num-kv-blocks", "200",
                 "--output", str(tmp_path / "r.json")])
    assert args.func(args) == 0
    result = load_result(tmp_path / "r.json")
    assert result["simulated"] and result["simulation"]["num_kv_blocks"] == 200
    assert "--num-kv-blocks 200" in " ".join(result["server"]["cmdline"])
    assert "simulated figures" in capsys.readouterr().out


def test_cli_what_if_across_gpus(tmp_path, capsys):
    write_trace(_trace(), tmp_path / "t.jsonl")
    args = _cli(["simulate", "--model", "llama-3.1-70b", "--gpus", "a100-80gb,h100-sxm,h200",
                 "--tensor-parallel-size", "1,2,4", "--max-model-len", "8192",
                 "--trace", str(tmp_path / "t.jsonl"), "--rates", "2,8",
                 "--slo", "ttft_p95=1,e2e_p95=20", "--price", "h100-sxm=2.4,h200=3.1",
                 "--output-dir", str(tmp_path / "what-if")])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "does not fit: a100-80gb x1" in out
    assert "cheapest meeting the SLO at @2/s" in out
    assert "vllm serve meta-llama/Llama-3.1-70B-Instruct --tensor-parallel-size 4" in out
    compare = load_result(tmp_path / "what-if")
    names = [c["name"] for c in compare["configs"]]
    assert "h200-tp2" in names and "h100-sxm-tp1" not in names
    assert all(r["simulated"] for s in compare["sweeps"] for r in s["runs"])
    diagnose(compare)
    assert (tmp_path / "what-if" / "scorecard.md").exists()


def test_cli_what_if_gives_a_loom_command_that_runs_from_disk(tmp_path, capsys):
    """loom reads models from disk only: for a known model its command downloads first."""
    write_trace(_trace(), tmp_path / "t.jsonl")
    args = _cli(["simulate", "--model", "llama-3.1-8b", "--gpus", "h100-sxm",
                 "--max-model-len", "8192", "--trace", str(tmp_path / "t.jsonl"), "--rate", "2"])
    assert args.func(args) == 0
    assert ("h100-sxm-tp1 (loom): hf download meta-llama/Llama-3.1-8B-Instruct --local-dir "
            "./Llama-3.1-8B-Instruct && loom serve --model ./Llama-3.1-8B-Instruct "
            ) in capsys.readouterr().out


def test_cli_needs_a_trace_and_a_load(tmp_path):
    with pytest.raises(ValueError, match="needs --trace"):
        args = _cli(["simulate", "--profile", "p.json"])
        args.func(args)
    write_trace(_trace(), tmp_path / "t.jsonl")
    with pytest.raises(ValueError, match="give --rate"):
        args = _cli(["simulate", "--profile", "p.json", "--trace", str(tmp_path / "t.jsonl")])
        args.func(args)
    assert math.isinf(_cli(["simulate", "--rate", "inf"]).rates[0])


def _documents_trace(num_documents: int = 6, per_document: int = 16) -> Trace:
    """RAG traffic over several documents: each prompt is a document's words and a question;
    prompts of one document share their leading blocks."""
    requests = []
    for i in range(num_documents * per_document):
        doc = i % num_documents
        words = [f"doc{doc}word{w}" for w in range(320)] + [f"question{i}"] * 8
        requests.append(TraceRequest(max_tokens=16, prompt=" ".join(words),
                                     prompt_len=len(words), cls=f"doc{doc}",
                                     arrival_s=0.05 * i, id=str(i)))
    return Trace(requests, {"tokenizer": "test"}, sha256="0" * 64)


def _fleet(trace: Trace, replicas: int, router: str, load: Load) -> dict:
    config = SimConfig("fleet", _profile(), SchedulerConfig(), CacheConfig(),
                       replicas=replicas, router=router)
    return simulate_run(config, trace, prompt_token_ids(trace, None, 0), load)


def test_prefix_routing_keeps_documents_together_and_beats_round_robin():
    trace = _documents_trace()
    prefix = _fleet(trace, 4, "prefix", Load(rate=20.0, seed=1))
    round_robin = _fleet(trace, 4, "round-robin", Load(rate=20.0, seed=1))
    for result in (prefix, round_robin):
        assert result["completed"] == len(trace.requests)
        assert sum(result["simulation"]["requests_per_replica"]) == len(trace.requests)
    assert prefix["prefix_cache_hit_rate"] > round_robin["prefix_cache_hit_rate"]
    decisions = prefix["simulation"]["router_decisions"]
    # one miss per document (its first request), then its blocks are known
    assert decisions.get("prefix", 0) >= len(trace.requests) - 6 - decisions.get("imbalanced", 0)
    assert round_robin["simulation"]["requests_per_replica"] == [24, 24, 24, 24]
    assert prefix["mean_ttft_ms"] < round_robin["mean_ttft_ms"]


def test_a_fleet_serves_more_than_one_engine_and_is_deterministic():
    trace = _trace(n=80)
    one = _run(trace, Load(max_concurrency=64))
    two = _fleet(trace, 2, "pow2", Load(max_concurrency=64, seed=2))
    again = _fleet(trace, 2, "pow2", Load(max_concurrency=64, seed=2))
    assert _stable(two) == _stable(again)
    assert two["completed"] == one["completed"] == 80
    assert two["duration"] < one["duration"]
    assert two["simulation"]["replicas"] == 2 and two["simulation"]["num_gpus"] == 2
    assert all(n > 0 for n in two["simulation"]["requests_per_replica"])
    assert "--data-parallel-size 2 --router pow2" in " ".join(two["server"]["cmdline"])


def test_cli_fleet_sizes_and_routers(tmp_path, capsys):
    write_trace(_documents_trace(4, 6), tmp_path / "t.jsonl")
    _profile().save(tmp_path / "p.json")
    args = _cli(["simulate", "--profile", str(tmp_path / "p.json"), "--trace",
                 str(tmp_path / "t.jsonl"), "--rate", "10", "--replicas", "1,3",
                 "--router", "prefix,round-robin", "--output-dir", str(tmp_path / "fleet")])
    assert args.func(args) == 0
    names = [c["name"] for c in load_result(tmp_path / "fleet")["configs"]]
    assert names == ["p", "p-x3-prefix", "p-x3-round-robin"]
    with pytest.raises(SystemExit):
        _cli(["simulate", "--router", "random"])


def test_cli_overlap_is_bench_sweeps_flag(capsys):
    """--overlap is declared once for bench and simulate: the same parse, the same refusal."""
    args = _cli(["simulate", "--trace", "t.jsonl", "--overlap", "1,2,4"])
    assert args.overlap == (1, 2, 4)
    with pytest.raises(SystemExit):
        _cli(["simulate", "--trace", "t.jsonl", "--overlap", "0"])
    assert "argument --overlap: expected concurrencies >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--queue-timeout", "-1"], "queue_timeout must be > 0, got -1"),
    (["--max-num-queued-reqs", "-1"], "max_num_queued_reqs must be >= 1, got -1"),
    (["--duration", "-1"], "--duration must be > 0, got -1"),
    (["--rate", "0"], "--rate must be > 0"),
    (["--async-scheduling"], "does not model --async-scheduling"),
    (["--speculative-config", '{"method": "ngram"}'], "does not model --speculative-config"),
    (["--output", "/proc/loom-test/r.json"], "--output /proc/loom-test/r.json: cannot write"),
    (["--rates", "1,2"], "several loads or configurations: give --output-dir"),
    (["--price", "h200=3.1"], "--price names h200, not among the GPUs planned"),
])
def test_cli_refuses_bad_flags_before_simulating(tmp_path, monkeypatch, flags, message):
    """Each of these ran (sending nothing, failing everything or ignoring the flag) and
    exited 0, or failed only once the simulation was done."""
    import loom.sim.whatif

    def no_run(*args, **kwargs):
        raise AssertionError("simulated before the flags were checked")

    monkeypatch.setattr(loom.sim.whatif, "simulate_run", no_run)
    write_trace(_trace(), tmp_path / "t.jsonl")
    _profile().save(tmp_path / "p.json")
    args = _cli(["simulate", "--profile", str(tmp_path / "p.json"), "--trace",
                 str(tmp_path / "t.jsonl"), "--rate", "1", *flags])
    with pytest.raises(ValueError, match=message):
        args.func(args)


@pytest.mark.parametrize("count", ["0", "-1"])
def test_a_request_count_below_one_is_refused_as_the_flag_is_parsed(count, capsys):
    with pytest.raises(SystemExit):
        _cli(["simulate", "--trace", "t.jsonl", "-n", count])
    assert f"expected an integer >= 1, got '{count}'" in capsys.readouterr().err


def test_calibrate_checks_its_output_before_measuring(monkeypatch):
    import loom.sim.calibrate

    def no_measure(*args, **kwargs):
        raise AssertionError("measured before the output path was checked")

    monkeypatch.setattr(loom.sim.calibrate, "calibrate", no_measure)
    args = _cli(["simulate", "calibrate", "--grid", "quick", "--output", "/proc/p.json"])
    with pytest.raises(ValueError, match="--output /proc/p.json: cannot write there"):
        args.func(args)


def test_the_serve_command_runs_the_engine_a_profile_timed(tmp_path, capsys):
    """A calibrated profile records its thread count (and the options it ran with), and the
    `loom serve` command printed to benchmark it passes them."""
    profile = Profile("calibrated", STEP, "m.gguf", max_model_len=2048, num_kv_blocks=4096,
                      block_size=16, meta={"num_threads": 1, "engine_config": {
                          "model": {"model": "m.gguf", "num_threads": None, "dtype": "auto",
                                    "attention_backend": "torch"}, "cache": {}}})
    profile.save(tmp_path / "p.json")
    write_trace(_trace(), tmp_path / "t.jsonl")
    args = _cli(["simulate", "--profile", str(tmp_path / "p.json"), "--trace",
                 str(tmp_path / "t.jsonl"), "--rate", "4"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert ("loom serve --model m.gguf --attention-backend torch --num-threads 1 "
            "--max-model-len 2048") in out


def test_cli_help_shows_calibrate_as_optional_and_the_shipped_models(capsys):
    with pytest.raises(SystemExit):
        _cli(["simulate", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: loom simulate (--profile PROFILE | --gpus GPUS --model MODEL)")
    assert "loom simulate calibrate --output PROFILE" in out
    assert "llama-3.1-70b" in " ".join(out.split())


def test_served_calibration_recovers_the_servers_overheads(tmp_path):
    """The served path end to end with the server stood in for by a simulation whose steps
    cost 3 ms + 0.1 ms a sequence + 50 us a token fed more (no timing): the profile it writes
    adds those terms, and its simulation reproduces the server's TPOT and TTFT."""
    from loom.sim import served

    true = {"step_s": 0.003, "seq_s": 1e-4, "token_s": 5e-5}
    slower = served.with_overheads(_profile(), true)
    trace = _trace(24)
    ids = prompt_token_ids(trace, None, 0)

    def fake_server(flags, trace, load, log):
        assert "--num-kv-blocks" in flags and load.max_concurrency in (1, 16)
        return simulate_run(served.sim_config(slower, 2048), trace, ids, load)

    points = served.measure_points(_profile(), trace, ids, (1, 16), 2048, tmp_path,
                                   fake_server)
    fitted = served.fit_overheads(_profile(), points, trace, ids, 2048)
    added = fitted.meta["served"]
    for name, value in true.items():
        assert added[f"added_{name}"] == pytest.approx(value, rel=0.1), name
    assert fitted.step_model.step_s > STEP.step_s and fitted.source == "calibrated"
    for p in points:
        tpot, ttft = added["fitted_tpot_ttft_s"][str(p.users)]
        assert tpot == pytest.approx(p.served_tpot_s, rel=0.02)
        assert ttft == pytest.approx(p.served_ttft_s, rel=0.02)
    path = tmp_path / "served.json"
    fitted.save(path)
    assert Profile.load(path).meta["served"]["points"][1]["users"] == 16
    with pytest.raises(ValueError, match="two or more loads"):
        served.fit_overheads(_profile(), points[:1], trace, ids, 2048)


def test_served_token_term_is_fitted_from_ttft_and_lengthens_it(tmp_path):
    """A server whose only extra cost is per token fed (slower prefill, decode as offline):
    the fit puts it in token_s, not in the per-step or per-sequence terms, and the served
    profile's TTFT moves up from the offline one's to the server's."""
    from loom.sim import served

    slower = served.with_overheads(_profile(), {"token_s": 2e-4})
    trace = _trace(24)
    ids = prompt_token_ids(trace, None, 0)
    points = served.measure_points(
        _profile(), trace, ids, (1, 16), 2048, tmp_path,
        lambda flags, trace, load, log: simulate_run(served.sim_config(slower, 2048), trace,
                                                     ids, load))
    fitted = served.fit_overheads(_profile(), points, trace, ids, 2048).meta["served"]
    assert fitted["added_token_s"] == pytest.approx(2e-4, rel=0.1)
    assert fitted["added_step_s"] < 2e-4 and fitted["added_seq_s"] < 2e-5
    one = points[0]
    assert one.simulated_ttft_s < fitted["fitted_tpot_ttft_s"]["1"][1] == pytest.approx(
        one.served_ttft_s, rel=0.02)
