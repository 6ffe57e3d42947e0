"""`loom plan`: memory arithmetic against figures worked out by hand from published
config.json values, the split rules, bad input, and the CLI's JSON (torch-free)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys

import pytest

from loom.cli.plan import add_parser
from loom.model.arch_hf import arch_from_hf_config
from loom.model.memory import KVCacheSpec
from loom.plan.catalogue import PlanError, builtin_catalogue, parse_prices, resolve_gpus
from loom.plan.models import PlanModel, known_models, resolve_model
from loom.plan.planner import PlanSettings, capacity, plan
from loom.plan.roofline import Efficiency, StepWork
from loom.plan.sizing import activation_bytes, params_per_gpu, weight_bytes_per_gpu

pytestmark = pytest.mark.unit

# SmolLM2-135M's config.json: GQA (9 query heads, 3 KV heads) with tied embeddings.
SMOLLM2_CONFIG = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
                  "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                  "vocab_size": 49152, "max_position_embeddings": 8192,
                  "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "rope_theta": 100000}


def _known(name: str) -> PlanModel:
    return resolve_model(name)


def _smollm2() -> PlanModel:
    return PlanModel("smollm2", arch_from_hf_config(SMOLLM2_CONFIG), "smollm2")


# -- parameters and weights ------------------------------------------------------------------

def test_llama_8b_parameters_and_weights_by_hand():
    # per layer: q 4096x4096 + k, v 2 x 4096x1024 + o 4096x4096 = 41,943,040;
    # MLP 3 x 4096x14336 = 176,160,768; x 32 layers = 6,979,321,856.
    # embedding and (untied) lm_head 128256 x 4096 = 525,336,576 each; norms 65 x 4096.
    p = params_per_gpu(_known("llama-3.1-8b").arch, 1)
    assert p.linear == 6_979_321_856
    assert (p.embedding, p.lm_head, p.norms) == (525_336_576, 525_336_576, 266_240)
    assert p.total == 8_030_261_248 == _known("llama-3.1-8b").arch.num_parameters
    assert weight_bytes_per_gpu(_known("llama-3.1-8b"), 1, "bf16") == 2 * 8_030_261_248
    # TP 2: q, o halve (2 x 4096x2048), k, v keep 4 of 8 KV heads (2 x 4096x512), MLP halves
    # (3 x 4096x7168), vocab-parallel embedding and lm_head halve, norms replicate.
    p2 = params_per_gpu(_known("llama-3.1-8b").arch, 2)
    assert p2.linear == 32 * (2 * 4096 * 2048 + 2 * 4096 * 512 + 3 * 4096 * 7168)
    assert p2.total == 4_015_263_744
    # int4: linear layers at 0.5 byte + a 16-bit scale per 128 weights; the rest 16-bit.
    assert weight_bytes_per_gpu(_known("llama-3.1-8b"), 1, "int4") == \
        3_598_712_832 + 2 * (2 * 525_336_576 + 266_240)


def test_tied_embeddings_count_once():
    # per layer: 2 x 576x576 + 2 x 576x192 + 3 x 576x1536 = 3,538,944; x 30 = 106,168,320;
    # embedding 49152 x 576 = 28,311,552, no separate lm_head; norms 61 x 576 = 35,136.
    p = params_per_gpu(_smollm2().arch, 1)
    assert (p.linear, p.embedding, p.lm_head, p.norms) == (106_168_320, 28_311_552, 0, 35_136)
    assert p.total == 134_515_008 == _smollm2().arch.num_parameters


def test_qwen_attention_bias_counted():
    # q, o 3584x3584; k, v 3584x512; biases 3584 + 2 x 512; MLP 3 x 3584x18944
    p = params_per_gpu(_known("qwen2.5-7b").arch, 1)
    assert p.linear == 28 * (2 * 3584 * 3584 + 2 * 3584 * 512 + 3584 + 1024 + 3 * 3584 * 18944)
    assert p.total == 7_615_616_512


# -- KV cache: the engine's own formula --------------------------------------------------------

@pytest.mark.parametrize("name, tp, expected", [
    ("llama-3.1-8b", 1, 2 * 32 * 8 * 128 * 2),   # 131,072: K and V, 32 layers, 8 KV heads
    ("llama-3.1-8b", 2, 2 * 32 * 4 * 128 * 2),   # TP 2 divides the 8 KV heads: 4 per GPU
    ("llama-3.1-8b", 16, 2 * 32 * 1 * 128 * 2),  # TP 16 does not: one replica per GPU
    ("qwen2.5-7b", 1, 2 * 28 * 4 * 128 * 2),     # 57,344
    ("qwen2.5-7b", 4, 2 * 28 * 1 * 128 * 2),
])
def test_kv_bytes_per_token_by_hand(name, tp, expected):
    rows = plan(_known(name), resolve_gpus(["h200"], builtin_catalogue()),
                PlanSettings(max_model_len=4096, tensor_parallel_sizes=(tp,)))
    assert rows[0]["kv_bytes_per_token"] == expected
    assert expected == KVCacheSpec.for_model(_known(name).arch, 2, tp).bytes_per_token


def test_kv_split_smollm2_tied_gqa():
    assert KVCacheSpec.for_model(_smollm2().arch, 2, 1).bytes_per_token == 2 * 30 * 3 * 64 * 2
    rows = plan(_smollm2(), resolve_gpus(["rtx-5090"], builtin_catalogue()),
                PlanSettings(max_model_len=2048, tensor_parallel_sizes=(1, 3)))
    # TP 3 divides the 3 KV heads: 1 each
    assert [r["kv_bytes_per_token"] for r in rows] == [23_040, 2 * 30 * 1 * 64 * 2]
    # 9 heads / 3 and the tied embedding split: (106,168,320 + 28,311,552) / 3 + norms
    assert rows[1]["weights_bytes_per_gpu"] == 2 * ((106_168_320 + 28_311_552) // 3 + 35_136)


def test_max_concurrency_by_hand_llama_8b_h100():
    s = PlanSettings(max_model_len=8192, concurrencies=(4, 64))
    rows = plan(_known("llama-3.1-8b"), resolve_gpus(["h100-sxm"], builtin_catalogue()), s)
    # 81,559 MiB (nvidia-smi's total) - 10% margin - weights - activations - 1 GiB framework
    activations = 2048 * (2 * 4096 + (32 + 2 * 8) * 128 + 2 * 14336) * 2 + 128 * 128256 * 4
    assert activations == 241_827_840 == activation_bytes(_known("llama-3.1-8b").arch, 1,
                                                          2048, 128)
    memory = 81_559 * 2**20
    budget = memory - memory // 10 - 16_060_522_496 - activations - 2**30
    assert rows[0]["kv_budget_bytes"] == budget == 59_592_636_826
    blocks = budget // (131_072 * 16)  # 28,415 blocks of 16 tokens
    assert rows[0]["num_kv_blocks"] == blocks == 28_415
    assert rows[0]["max_concurrency"] == blocks // (8192 // 16) == 55
    assert [r["fits"] for r in rows] == [True, False]
    assert rows[1]["max_context_at_concurrency"] == blocks // 64 * 16 == 7_088
    assert rows[0]["kv_bytes_at_concurrency"] == 4 * 8192 * 131_072
    assert rows[0]["flags"]["loom"].startswith("--max-model-len 8192 --kv-cache-memory "
                                               f"{budget // 2**20}MiB")
    assert "--gpu-memory-utilization 0.90" in rows[0]["flags"]["vllm"]


def test_70b_needs_a_split_and_tp_helps():
    rows = plan(_known("llama-3.1-70b"), resolve_gpus(["h100-sxm"], builtin_catalogue()),
                PlanSettings(max_model_len=8192, tensor_parallel_sizes=(1, 4)))
    single, four = rows
    assert not single["fits"] and single["max_concurrency"] == 0
    assert four["fits"] and four["max_concurrency"] > 0
    assert four["flags"]["loom"] is None  # loom serves on one device
    assert "--tensor-parallel-size 4" in four["flags"]["vllm_serve"]


# -- roofline -----------------------------------------------------------------------------------

def test_decode_roofline_is_memory_bound_and_scales_with_bandwidth():
    cat = builtin_catalogue()
    s = PlanSettings(max_model_len=4096, concurrencies=(1,))
    h100, h200 = (capacity(_known("llama-3.1-8b"), cat[g], 1, s) for g in ("h100-sxm", "h200"))
    work = StepWork.of([(1, 4095, True)])
    m = h100.step_model
    assert m.byte_s * m.memory_bytes(work) > m.flop_s * m.flops(work)
    overhead = m.step_s + m.seq_s
    ratio = (h100.step_model.time(work) - overhead) / (h200.step_model.time(work) - overhead)
    assert ratio == pytest.approx(4800 / 3350)


def test_overlap_runs_between_the_roofline_and_the_sum():
    cap = capacity(_known("llama-3.1-8b"), builtin_catalogue()["h100-sxm"], 1,
                   PlanSettings(max_model_len=4096))
    work = StepWork.of([(512, 0, True)] + [(1, 2000, True)] * 64)
    m = cap.step_model
    memory, compute = m.byte_s * m.memory_bytes(work), m.flop_s * m.flops(work)
    fixed = m.step_s + m.seq_s * work.seqs
    assert m.overlap == 1 and m.time(work) == pytest.approx(fixed + max(memory, compute))
    summed = dataclasses.replace(m, overlap=0.0)
    assert summed.time(work) == pytest.approx(fixed + memory + compute)
    half = dataclasses.replace(m, overlap=0.5).time(work)
    assert m.time(work) < half < summed.time(work)
    with pytest.raises(PlanError, match="overlap must be in"):
        Efficiency.parse("overlap=1.5")


def test_step_work_counts_attention_pairs():
    work = StepWork.of([(3, 0, True), (1, 10, True)])
    assert (work.tokens, work.seqs, work.sampled, work.kv_tokens) == (4, 2, 2, 14)
    assert work.attention_pairs == (1 + 2 + 3) + 11


def test_efficiency_parse_and_bounds():
    assert Efficiency.parse("bandwidth=0.5").bandwidth == 0.5
    with pytest.raises(PlanError, match="bad --efficiency"):
        Efficiency.parse("speed=2")
    with pytest.raises(PlanError, match="compute"):
        Efficiency.parse("compute=1.5")


# -- bad input ------------------------------------------------------------------------------------

def test_unknown_gpu_names_the_known_ones():
    with pytest.raises(PlanError, match="unknown GPU 'h900'.*h100-sxm"):
        resolve_gpus(["h900"], builtin_catalogue())


def test_tp_that_does_not_divide_the_heads():
    with pytest.raises(PlanError, match="tensor_parallel_size 2 does not divide the model's 9 "
                                        "attention heads"):
        params_per_gpu(_smollm2().arch, 2)
    with pytest.raises(PlanError, match="tensor_parallel_size 7"):
        params_per_gpu(_known("qwen2.5-7b").arch, 7)  # 28 heads, but 4 KV heads / MLP


def test_missing_config_and_unknown_model(tmp_path):
    with pytest.raises(PlanError, match="has no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(PlanError, match="neither a known architecture"):
        resolve_model("llama-9")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(PlanError, match="lacks"):
        resolve_model(str(tmp_path))


def test_config_json_folder_and_gpu_spec_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    assert resolve_model(str(tmp_path)).arch.num_parameters == 134_515_008
    spec = tmp_path / "gpus.json"
    spec.write_text(json.dumps({"gpus": {"L40S": {"memory_gb": 48, "memory_bandwidth_gbs": 864,
                                                  "bf16_tflops": 362}}}))
    from loom.plan.catalogue import load_catalogue

    assert load_catalogue([str(spec)])["l40s"].memory_bytes == 48 * 2**30
    spec.write_text(json.dumps({"gpus": {"x": {"memory_gb": 48}}}))
    with pytest.raises(PlanError, match="needs numeric memory_bandwidth_gbs, bf16_tflops"):
        load_catalogue([str(spec)])


def test_the_loom_command_names_a_folder_on_disk(tmp_path):
    """vLLM fetches a hub name itself; loom reads models from disk only, so for a known model
    its command names the folder that the printed download makes, and for a path the path."""
    settings = PlanSettings(max_model_len=4096)
    h100 = resolve_gpus(["h100-sxm"], builtin_catalogue())
    (known,) = plan(_known("llama-3.1-8b"), h100, settings)
    flags = known["flags"]
    assert flags["download"] == ("hf download meta-llama/Llama-3.1-8B-Instruct "
                                 "--local-dir ./Llama-3.1-8B-Instruct")
    assert flags["loom_serve"].startswith("loom serve --model ./Llama-3.1-8B-Instruct ")
    assert flags["vllm_serve"].startswith("vllm serve meta-llama/Llama-3.1-8B-Instruct ")
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    (on_disk,) = plan(resolve_model(str(tmp_path)), h100, settings)
    assert on_disk["flags"]["download"] is None
    assert on_disk["flags"]["loom_serve"].startswith(f"loom serve --model {tmp_path} ")


def test_prices_only_from_the_flag():
    assert parse_prices("h100-sxm=2.4, H200=3") == {"h100-sxm": 2.4, "h200": 3.0}
    with pytest.raises(PlanError, match="bad --price"):
        parse_prices("h100-sxm")
    assert all("price" not in json.dumps(g.to_json()).lower() for g in builtin_catalogue().values())


def test_catalogue_has_the_seed_list_with_a_source_per_number():
    cat = builtin_catalogue()
    for key in ("h100-sxm", "h200", "b200", "b300", "a100-80gb", "rtx-5090"):
        g = cat[key]
        for number in ("memory_gb", "memory_bandwidth_gbs", "bf16_tflops", "fp8_tflops",
                       "interconnect_gbs"):
            assert g.sources.get(number), f"{key}.{number} has no source"
    assert set(known_models()) == {"llama-3.1-8b", "llama-3.1-70b", "qwen2.5-7b",
                                   "qwen2.5-72b", "mistral-7b", "qwen3-8b", "qwen3-30b-a3b",
                                   "gemma-3-12b", "mixtral-8x7b", "deepseek-v3-shaped"}


# -- the CLI ------------------------------------------------------------------------------------

def _cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="loom")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_cli_json_rows(capsys):
    args = _cli(["plan", "--model", "llama-3.1-8b", "--gpus", "h100-sxm,h200",
                 "--tensor-parallel-size", "1,2", "--max-model-len", "8192",
                 "--concurrency", "4,64", "--json", "--price", "h100-sxm=2.4"])
    assert args.func(args) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 2 * 2 * 2
    keys = {"gpu", "tensor_parallel_size", "concurrency", "fits", "max_concurrency",
            "kv_bytes_per_token", "weights_bytes_per_gpu"}
    assert all(keys <= row.keys() for row in rows)
    assert [(r["gpu"], r["tensor_parallel_size"], r["concurrency"]) for r in rows[:3]] == \
        [("h100-sxm", 1, 4), ("h100-sxm", 1, 64), ("h100-sxm", 2, 4)]
    assert rows[0]["usd_per_hour"] == 2.4 and rows[2]["usd_per_hour"] == 4.8
    assert "usd_per_hour" not in rows[-1]


def test_cli_table_runs_on_the_bundled_gguf(capsys):
    args = _cli(["plan", "--gpus", "rtx-5090", "--max-model-len", "2048"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "rtx-5090" in out and "loom serve --model" in out


def test_plan_does_not_import_torch():
    code = ("import argparse, sys\n"
            "from loom.cli.plan import add_parser\n"
            "p = argparse.ArgumentParser(); add_parser(p.add_subparsers())\n"
            "a = p.parse_args(['plan', '--model', 'llama-3.1-70b', '--gpus', 'h200', "
            "'--tensor-parallel-size', '2', '--max-model-len', '8192', '--json'])\n"
            "a.func(a)\n"
            "assert 'torch' not in sys.modules, 'plan imported torch'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# -- input checks and output details ------------------------------------------------------------

def test_max_model_len_0_is_refused_not_the_default(capsys):
    args = _cli(["plan", "--model", "llama-3.1-8b", "--gpus", "h100-sxm",
                 "--max-model-len", "0"])
    with pytest.raises(PlanError, match="max_model_len must be >= 2, got 0"):
        args.func(args)


def test_a_config_field_of_the_wrong_type_names_field_and_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**SMOLLM2_CONFIG,
                                                      "num_attention_heads": "9"}))
    with pytest.raises(PlanError, match=r"config.json: num_attention_heads must be a positive "
                                        r"integer, got '9'"):
        resolve_model(str(tmp_path))


def test_a_config_json_path_is_named_after_its_folder(tmp_path):
    folder = tmp_path / "SmolLM2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    model = resolve_model(str(folder / "config.json"))
    assert model.name == "SmolLM2" and model.serve_name == str(folder)


def test_gpus_named_twice_plan_once_and_prices_name_a_planned_gpu(capsys):
    args = _cli(["plan", "--model", "llama-3.1-8b", "--gpus", "h100-sxm,H100-SXM",
                 "--concurrency", "4,4", "--max-model-len", "8192", "--json"])
    assert args.func(args) == 0
    assert len(json.loads(capsys.readouterr().out)) == 1
    args = _cli(["plan", "--model", "llama-3.1-8b", "--gpus", "h100-sxm",
                 "--price", "h100-sxm=2.4,h200=3.1"])
    with pytest.raises(PlanError, match="--price names h200, not among the GPUs planned"):
        args.func(args)


def test_no_serve_command_where_nothing_fits_and_context_within_max_model_len(capsys):
    args = _cli(["plan", "--model", "llama-3.1-70b", "--gpus", "h100-sxm,h200",
                 "--weight-dtype", "fp8", "--max-model-len", "65536"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "h100-sxm x1\n  does not fit at max_model_len 65536" in out
    assert "vllm serve meta-llama/Llama-3.1-70B-Instruct --tensor-parallel-size 1" in out
    assert out.count("vllm serve") == 1  # the h200's only
    (row,) = plan(_known("llama-3.1-8b"), resolve_gpus(["h200"], builtin_catalogue()),
                  PlanSettings(max_model_len=8192))
    assert row["max_concurrency"] > 1 and row["max_context_at_concurrency"] == 8192


def test_int4_is_weight_only_and_its_commands_say_what_to_serve():
    """int4 (AWQ/GPTQ) multiplies in 16-bit: prefill at the bf16 rate, not fp8's; fp8
    is quantized by vLLM at load; neither is a weight dtype loom serves."""
    h100 = resolve_gpus(["h100-sxm"], builtin_catalogue())
    rows = {d: plan(_known("llama-3.1-8b"), h100, PlanSettings(max_model_len=8192,
                                                               weight_dtype=d))[0]
            for d in ("bf16", "int4", "fp8")}
    assert rows["int4"]["prefill_tok_s"] == pytest.approx(rows["bf16"]["prefill_tok_s"],
                                                          rel=0.05)
    assert rows["fp8"]["prefill_tok_s"] > 1.5 * rows["int4"]["prefill_tok_s"]
    assert rows["int4"]["decode_tok_s"] > rows["bf16"]["decode_tok_s"]  # fewer bytes read
    assert rows["fp8"]["flags"]["vllm_serve"].endswith("--quantization fp8")
    assert "AWQ / GPTQ checkpoint" in rows["int4"]["flags"]["note"]
    assert rows["int4"]["flags"]["loom_serve"] is None
    assert rows["bf16"]["flags"]["loom_serve"].endswith("--dtype bfloat16")
