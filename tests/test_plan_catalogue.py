"""The catalogue of GPUs teams rent, the fp4 formats, mixtures of experts, sliding-window KV
and whose tokens a simulated trace counts: figures worked out by hand from datasheets and
published config.json values (torch-free, no weights)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from rich.console import Console

from loom.plan.catalogue import PlanError, builtin_catalogue, load_catalogue, resolve_gpus
from loom.plan.models import resolve_model
from loom.plan.moe import distinct_experts, expert_coverage
from loom.plan.planner import PlanSettings, capacity, plan
from loom.plan.report import print_plan
from loom.plan.sizing import (
    WEIGHT_DTYPES,
    params_per_gpu,
    routed_expert_bytes_per_gpu,
    weight_bytes_per_gpu,
)
from loom.sim.trace_tokens import trace_tokens
from loom.workload.trace import Trace, TraceRequest

pytestmark = pytest.mark.unit

MIB, GIB = 2**20, 2**30
RENTED = ("h100-sxm", "h100-pcie", "h100-nvl", "h200", "gh200", "a100-80gb", "a100-40gb",
          "l40s", "l4", "a10g", "rtx-4090", "rtx-5090", "mi300x", "mi325x", "b200", "b300")


# -- the catalogue ---------------------------------------------------------------------------

def test_every_rented_gpu_is_catalogued_with_a_source_url_per_figure():
    cat = builtin_catalogue()
    assert set(RENTED) <= set(cat)
    for key in RENTED:
        g = cat[key]
        for number in ("memory_gb", "memory_bandwidth_gbs", "bf16_tflops", "fp8_tflops",
                       "fp4_tflops", "interconnect_gbs"):
            assert g.sources.get(number), f"{key}.{number} has no source"
        for number in ("memory_gb", "memory_bandwidth_gbs", "bf16_tflops"):
            assert "https://" in g.sources[number], f"{key}.{number} names no URL"
        assert g.interconnect_gbs and g.interconnect != "none"


def test_memory_is_what_the_driver_exposes_ecc_included():
    cat = builtin_catalogue()
    # GDDR with ECC on gives ~6% up: nvidia-smi's totals, not the vendor's 24 / 48 GB
    assert cat["l4"].memory_bytes == 23_034 * MIB  # 22.49 GiB
    assert cat["l40s"].memory_bytes == 46_068 * MIB  # 44.99 GiB
    assert cat["a10g"].memory_bytes == 23_028 * MIB
    assert cat["h100-sxm"].memory_bytes == 81_559 * MIB  # HBM: ~ the GB read as GiB
    assert cat["b200"].memory_bytes == 183_359 * MIB
    assert round(cat["l4"].memory_bytes / GIB, 1) == 22.5
    assert round(cat["l40s"].memory_bytes / GIB, 1) == 45.0
    # without a published driver figure, the vendor's GB read as GiB (no ECC on a 4090)
    assert cat["rtx-4090"].driver_memory_gib is None
    assert cat["rtx-4090"].memory_bytes == 24 * GIB


def test_dense_rates_and_fp4_only_on_blackwell():
    cat = builtin_catalogue()
    assert cat["b200"].tflops("nvfp4") == cat["b200"].tflops("mxfp4") == 9000
    assert cat["b300"].tflops("nvfp4") == 13125
    assert cat["rtx-5090"].tflops("nvfp4") == 1676
    for key in ("h100-sxm", "h200", "a100-80gb", "l40s", "mi300x"):
        g = cat[key]
        assert g.fp4_tflops is None
        assert g.tflops("nvfp4") == g.bf16_tflops  # weight-only: dequantized to 16-bit
        assert "no fp4 tensor cores" in g.fp4_note("nvfp4")
    assert cat["b200"].fp4_note("nvfp4") is None and cat["h100-sxm"].fp4_note("bf16") is None
    assert cat["a100-40gb"].tflops("fp8") == 312  # no fp8 tensor cores on Ampere
    assert cat["l40s"].tflops("fp8") == 733


def test_a_gpu_spec_file_adds_and_replaces_entries(tmp_path: Path):
    spec = tmp_path / "gpus.json"
    spec.write_text(json.dumps({"gpus": {
        "My-Card": {"memory_gb": 24, "driver_memory_gib": 22.0, "memory_bandwidth_gbs": 500,
                    "bf16_tflops": 100, "fp4_tflops": 400},
        "l4": {"memory_gb": 24, "memory_bandwidth_gbs": 300, "bf16_tflops": 1}}}))
    cat = load_catalogue([str(spec)])
    mine = resolve_gpus(["my-card"], cat)[0]
    assert mine.memory_bytes == 22 * GIB and mine.tflops("mxfp4") == 400
    assert cat["l4"].bf16_tflops == 1  # a user entry replaces the shipped one
    spec.write_text(json.dumps({"gpus": {"x": {"memory_gb": 24, "memory_bandwidth_gbs": 500,
                                               "bf16_tflops": 100, "fp4_tflops": "fast"}}}))
    with pytest.raises(PlanError, match="fp4_tflops must be a number"):
        load_catalogue([str(spec)])


def test_an_unknown_gpu_lists_the_known_ones():
    with pytest.raises(PlanError) as e:
        resolve_gpus(["h300"], builtin_catalogue())
    message = str(e.value)
    assert "unknown GPU 'h300'" in message and "--gpu-spec" in message
    for key in ("l4", "mi300x", "gh200", "rtx-4090"):
        assert key in message


def test_a_model_that_does_not_fit_prints_no_speed():
    rows = plan(resolve_model("llama-3.1-70b"), resolve_gpus(["l4", "b200"], builtin_catalogue()),
                PlanSettings(max_model_len=8192))
    l4, b200 = rows
    assert not l4["fits"]
    assert l4["decode_tok_s"] is None and l4["prefill_tok_s"] is None
    assert b200["fits"] and b200["decode_tok_s"] > 0
    console = Console(width=250, record=True)
    print_plan(rows, resolve_model("llama-3.1-70b"), PlanSettings(max_model_len=8192), console)
    text = console.export_text()
    l4_line = next(line for line in text.splitlines() if line.startswith("│ l4 "))
    assert "NO" in l4_line and l4_line.rstrip("│ ").endswith("-")
    assert "l4 x1\n  does not fit" in text


# -- fp4 weights -----------------------------------------------------------------------------

def test_fp4_bytes_count_their_scales():
    assert WEIGHT_DTYPES["nvfp4"] * 8 == 4.5   # e2m1 + an fp8 scale per 16
    assert WEIGHT_DTYPES["mxfp4"] * 8 == 4.25  # e2m1 + an e8m0 scale per 32
    model = resolve_model("llama-3.1-8b")
    p = params_per_gpu(model.arch, 1)
    rest = 2 * (p.embedding + p.lm_head + p.norms)  # embedding, lm_head, norms stay 16-bit
    assert weight_bytes_per_gpu(model, 1, "nvfp4") == int(p.linear * 0.5625 + rest)
    assert weight_bytes_per_gpu(model, 1, "mxfp4") == int(p.linear * 0.53125 + rest)
    row = plan(model, resolve_gpus(["h100-sxm"], builtin_catalogue()),
               PlanSettings(max_model_len=8192, weight_dtype="nvfp4"))[0]
    assert any("no fp4 tensor cores" in n for n in row["notes"])
    assert "nvfp4" in row["flags"]["note"] and row["flags"]["loom"] is None


# -- mixtures of experts ---------------------------------------------------------------------

def test_mixtral_total_and_active_parameters():
    arch = resolve_model("mixtral-8x7b").arch
    # per layer: attention 41,943,040 + router 8 x 4096 + 8 experts x 3 x 4096 x 14336
    expert = 3 * 4096 * 14336
    attention = 2 * 4096 * 4096 + 2 * 4096 * 1024
    embeddings = 2 * 32000 * 4096
    norms = 65 * 4096
    assert arch.num_parameters == 32 * (attention + 8 * 4096 + 8 * expert) + embeddings + norms
    assert arch.num_active_parameters == \
        32 * (attention + 8 * 4096 + 2 * expert) + embeddings + norms
    assert round(arch.num_parameters / 1e9, 1) == 46.7
    assert round(arch.num_active_parameters / 1e9, 1) == 12.9
    p = params_per_gpu(arch, 1)
    assert p.total == arch.num_parameters and p.routed_experts == 32 * 8 * expert


def test_expert_coverage_grows_with_the_batch_and_caps_at_every_expert():
    assert expert_coverage(0, 8, 2) == 0
    assert distinct_experts(1, 8, 2) == pytest.approx(2)  # one token: its k experts
    assert distinct_experts(2, 8, 2) == pytest.approx(8 * (1 - 0.75**2))
    counts = [distinct_experts(b, 128, 8) for b in (1, 4, 16, 64, 256, 4096)]
    assert counts == sorted(counts) and counts[-1] <= 128
    assert counts[-1] == pytest.approx(128)


def test_moe_decode_reads_more_experts_at_batch_64():
    model = resolve_model("mixtral-8x7b")
    cap = capacity(model, builtin_catalogue()["h200"], 1, PlanSettings(max_model_len=4096))
    shape = cap.step_model.shape
    experts = routed_expert_bytes_per_gpu(model, 1, "bf16")
    assert shape.expert_bytes == experts
    assert shape.weight_bytes + experts == cap.weights_bytes
    one, sixty_four = shape.weight_bytes_read(1), shape.weight_bytes_read(64)
    assert one == pytest.approx(shape.weight_bytes + experts * 2 / 8)
    assert sixty_four == pytest.approx(cap.weights_bytes, rel=1e-6)  # all 8 experts
    assert shape.weight_bytes_read(10**6) <= cap.weights_bytes
    # FLOPs per token are the active parameters', not all of them
    assert shape.linear_params < params_per_gpu(model.arch, 1).linear / 3
    rows = plan(model, [builtin_catalogue()["h200"]],
                PlanSettings(max_model_len=4096, concurrencies=(1, 64)))
    assert rows[1]["weight_bytes_read_per_decode_step"] > 3 * \
        rows[0]["weight_bytes_read_per_decode_step"]


def test_expert_parallel_placement():
    model = resolve_model("qwen3-30b-a3b")
    assert weight_bytes_per_gpu(model, 4, "bf16", expert_parallel=True) == \
        weight_bytes_per_gpu(model, 4, "bf16")  # even split: the same bytes per GPU
    with pytest.raises(PlanError, match="does not divide the 8 experts"):
        params_per_gpu(resolve_model("mixtral-8x7b").arch, 16, expert_parallel=True)
    with pytest.raises(PlanError, match="needs a mixture-of-experts model"):
        params_per_gpu(resolve_model("llama-3.1-8b").arch, 2, expert_parallel=True)
    rows = plan(model, [builtin_catalogue()["h100-sxm"]],
                PlanSettings(max_model_len=8192, tensor_parallel_sizes=(4,),
                             expert_parallel=True))
    assert "--enable-expert-parallel" in rows[0]["flags"]["vllm"]


def test_deepseek_v3_shape_keeps_mla_kv_whole_on_every_gpu():
    model = resolve_model("deepseek-v3-shaped")
    assert math.isclose(model.arch.num_parameters, 671e9, rel_tol=0.01)
    assert math.isclose(model.arch.num_active_parameters, 37e9, rel_tol=0.02)
    row = plan(model, [builtin_catalogue()["h200"]],
               PlanSettings(max_model_len=32768, tensor_parallel_sizes=(8,),
                            weight_dtype="fp8"))[0]
    assert row["kv_bytes_per_token"] == 61 * 576 * 2  # MLA's latent, bf16, not split
    assert row["fits"] and row["flags"]["loom"] is None  # loom does not run MLA


# -- sliding-window KV -----------------------------------------------------------------------

def test_gemma3_sliding_layers_keep_their_window_only():
    model = resolve_model("gemma-3-12b")
    arch = model.arch
    assert arch.sliding_window == 1024 and arch.layer_types.count("sliding_attention") == 40
    # the sliding pool holds a window per schedulable sequence: max_num_seqs of them
    s = PlanSettings(max_model_len=32768, concurrencies=(8,), max_num_seqs=8)
    row = plan(model, [builtin_catalogue()["h100-sxm"]], s)[0]
    per_layer_block = 2 * 8 * 256 * 2 * 16  # K and V, 8 KV heads of 256, bf16, 16 tokens
    assert row["kv_bytes_per_block"] == 8 * per_layer_block  # the 8 full layers only
    full = 8 * 2048 * 8 * per_layer_block  # 8 sequences of 2,048 blocks in the full layers
    sliding = row["kv_bytes_needed"] - full  # 40 layers, windows of 1,024 (+ a chunk)
    assert 0 < sliding <= 8 * (1024 + 2048) // 16 * 40 * per_layer_block
    every_layer_full = 8 * 32768 * 48 * (2 * 8 * 256 * 2)
    assert row["kv_bytes_needed"] < every_layer_full / 3
    assert row["fits"]


# -- whose tokens a trace counts -------------------------------------------------------------

def _trace(*, text: bool, made_with: str = "SmolLM2-135M-Instruct.Q4_1.gguf") -> Trace:
    request = TraceRequest(max_tokens=8, prompt="hello there" if text else None,
                           prompt_len=None if text else 12)
    return Trace([request], header={"tokenizer": made_with})


def test_a_known_model_without_its_tokenizer_warns_with_the_measured_factor():
    counted = trace_tokens(_trace(text=True), "llama-3.1-8b", None)
    assert counted.tokenizer is None  # SmolLM2's, the default
    assert "0.89 tokens per SmolLM2 token" in counted.warning
    assert "--tokenizer" in counted.warning
    assert "not measured" in trace_tokens(_trace(text=True), "mixtral-8x7b", None).warning
    assert trace_tokens(_trace(text=True), "llama-3.1-8b", "tok.json").warning is None
    assert trace_tokens(_trace(text=True), None, None).warning is None


def test_a_model_file_counts_with_its_own_tokenizer(tmp_path: Path):
    gguf = tmp_path / "llama.gguf"
    gguf.write_bytes(b"GGUF")
    counted = trace_tokens(_trace(text=True), str(gguf), None)
    assert counted.tokenizer == str(gguf) and counted.warning is None
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert "no tokenizer.json" in trace_tokens(_trace(text=True), str(folder), None).warning
    (folder / "tokenizer.json").write_text("{}")
    assert trace_tokens(_trace(text=True), str(folder / "config.json"), None).tokenizer == \
        str(folder)
    # lengths-only records keep the counts of the tokenizer that made the trace
    bare = trace_tokens(_trace(text=False), str(gguf), None)
    assert "only prompt_len" in bare.warning and "SmolLM2" in bare.warning


# -- the new families from a config.json on disk ---------------------------------------------

@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gemma-3-12b", "qwen3-8b", "mixtral-8x7b"])
def test_a_config_json_plans_as_its_shipped_shape(name: str, tmp_path: Path):
    """`loom plan --model FOLDER` reads the config.json alone (read_arch): the same shape,
    experts and sliding layers as the catalogued entry."""
    from loom.plan.models import known_models

    (tmp_path / "config.json").write_text(json.dumps(known_models()[name]["config"]))
    on_disk, shipped = resolve_model(str(tmp_path)), resolve_model(name)
    assert on_disk.arch == shipped.arch
    s = PlanSettings(max_model_len=4096, concurrencies=(1, 32))
    gpu = [builtin_catalogue()["h200"]]
    mine, theirs = plan(on_disk, gpu, s), plan(shipped, gpu, s)
    for key in ("weights_bytes_per_gpu", "kv_bytes_needed", "weight_bytes_read_per_decode_step",
                "params_active", "params_total"):
        assert [r[key] for r in mine] == [r[key] for r in theirs]
