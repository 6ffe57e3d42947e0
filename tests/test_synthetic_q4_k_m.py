"""benchmarks/synthetic_gguf.py --q4-k-m: random Q4_K_M blocks written directly, in the types
llama-quantize's Q4_K_M gives each tensor, that loom loads and runs."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import pytest
from gguf.quants import dequantize

from loom import LLM, SamplingParams
from loom.model.arch import default_model_path
from loom.model.gguf_file import read_gguf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout: benchmarks.*
from benchmarks import synthetic_gguf  # noqa: E402 - the writer of model-shaped files


@pytest.mark.unit
def test_the_layers_given_more_bits_are_llama_quantizes() -> None:
    """llama-quantize's Q4_K_M of the 34-layer Gemma-3-4B shape gave attn_v and ffn_down Q6_K
    in exactly these layers (read from its output file's tensor types)."""
    q6_layers = {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 29, 30, 31, 32, 33}
    assert {i for i in range(34) if synthetic_gguf.use_more_bits(i, 34)} == q6_layers
    gemma = synthetic_gguf.Shape("gemma3", 2560, 10240, 34, 8, 4, 256, window=1024)
    types = {name: synthetic_gguf.q4_k_m_type(name, gemma).name for name in (
        "token_embd.weight", "blk.3.attn_v.weight", "blk.4.ffn_down.weight",
        "blk.6.ffn_down.weight", "blk.6.attn_q.weight", "blk.33.ffn_up.weight")}
    assert types == {"token_embd.weight": "Q6_K", "blk.3.attn_v.weight": "Q6_K",
                     "blk.4.ffn_down.weight": "Q4_K", "blk.6.ffn_down.weight": "Q6_K",
                     "blk.6.attn_q.weight": "Q4_K", "blk.33.ffn_up.weight": "Q4_K"}


# What llama-quantize's Q4_K_M gave the F16 files synthetic_gguf writes for 8-layer mixtures
# (hidden 256, experts 256 wide): every tensor's type in its output equalled q4_k_m_type's.
MIXTURE_TYPES = {
    "qwen3moe": {"token_embd.weight": "Q4_K", "output.weight": "Q6_K",
                 "blk.0.ffn_down_exps.weight": "Q6_K", "blk.1.ffn_down_exps.weight": "Q4_K",
                 "blk.3.ffn_down_exps.weight": "Q6_K", "blk.7.ffn_down_exps.weight": "Q6_K",
                 "blk.0.ffn_gate_exps.weight": "Q4_K", "blk.0.ffn_up_exps.weight": "Q4_K",
                 "blk.0.attn_v.weight": "Q6_K", "blk.1.attn_v.weight": "Q4_K",
                 "blk.0.attn_k.weight": "Q4_K", "blk.0.attn_output.weight": "Q4_K"},
    "mixtral": {"token_embd.weight": "Q4_K", "output.weight": "Q6_K",
                "blk.0.ffn_down_exps.weight": "Q6_K", "blk.1.ffn_down_exps.weight": "Q4_K",
                "blk.1.ffn_gate_exps.weight": "Q4_K", "blk.1.attn_v.weight": "Q8_0",
                "blk.1.attn_k.weight": "Q8_0", "blk.1.attn_q.weight": "Q4_K",
                "blk.1.attn_output.weight": "Q5_K"},
}


def _mixture(arch: str, layers: int = 8) -> synthetic_gguf.Shape:
    experts = 8 if arch == "mixtral" else 4  # Mixtral's rules are for exactly 8
    return synthetic_gguf.Shape(arch, hidden=256, ffn=256 if arch == "mixtral" else 512,
                                layers=layers, heads=2, kv_heads=1, head_dim=128,
                                experts=experts, experts_used=2, expert_ffn=256)


@pytest.mark.unit
@pytest.mark.parametrize("arch", sorted(MIXTURE_TYPES))
def test_a_mixtures_types_are_llama_quantizes(arch: str) -> None:
    shape = _mixture(arch)
    assert {name: synthetic_gguf.q4_k_m_type(name, shape).name
            for name in MIXTURE_TYPES[arch]} == MIXTURE_TYPES[arch]


@pytest.mark.unit
def test_it_refuses_widths_the_blocks_do_not_tile(tmp_path: Path) -> None:
    narrow = synthetic_gguf.Shape("llama", 384, 512, 1, 4, 2, 96)
    narrow_experts = synthetic_gguf.Shape("qwen3moe", 256, 512, 1, 2, 1, 128, 4, 2, 96)
    for shape in (narrow, narrow_experts):
        with pytest.raises(ValueError, match="multiples of 256"):
            synthetic_gguf.write(shape, str(default_model_path()), str(tmp_path / "x.gguf"),
                                 q4_k_m=True)


@pytest.mark.integration
def test_a_random_q4_k_m_file_has_sane_weights_and_loom_runs_it(tmp_path: Path) -> None:
    shape = synthetic_gguf.Shape("qwen3", hidden=256, ffn=512, layers=2, heads=2, kv_heads=1,
                                 head_dim=128)
    out = tmp_path / "q4km.gguf"
    synthetic_gguf.write(shape, str(default_model_path()), str(out), q4_k_m=True)
    model = read_gguf(out)
    assert model.metadata["general.file_type"] == synthetic_gguf.GGUF_FILE_TYPE_Q4_K_M
    kinds = {t.name: t.kind for t in model.tensors}
    assert kinds["blk.0.ffn_down.weight"] == "Q4_K" and kinds["blk.1.ffn_down.weight"] == "Q6_K"
    assert kinds["token_embd.weight"] == "Q6_K" and kinds["blk.1.attn_norm.weight"] == "F32"
    for tensor in gguf.GGUFReader(str(out)).tensors[:8]:
        if tensor.tensor_type.name in ("Q4_K", "Q6_K"):
            weights = dequantize(tensor.data, tensor.tensor_type)
            assert abs(weights.mean()) < 0.005 and 0.01 < weights.std() < 0.03, tensor.name
    llm = LLM(model=str(out), kv_cache_memory="32MiB", max_num_seqs=1)
    result = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(result.outputs[0].token_ids) == 4


@pytest.mark.integration
@pytest.mark.parametrize("arch", ["qwen3moe", "mixtral"])
def test_a_random_q4_k_m_mixture_loads_on_the_moe_kernel(tmp_path: Path, arch: str) -> None:
    """Stacked expert tensors in llama-quantize's types, sane weights in each type, and loom
    runs every layer's experts on its native MoE kernel."""
    shape = _mixture(arch, layers=2)
    out = tmp_path / "moe.gguf"
    synthetic_gguf.write(shape, str(default_model_path()), str(out), q4_k_m=True)
    model = read_gguf(out)
    tensors = {t.name: t for t in model.tensors}
    assert model.metadata["general.architecture"] == synthetic_gguf.gguf_arch(arch)
    assert tensors["blk.1.ffn_down_exps.weight"].shape == (shape.experts, 256, 256)
    assert tensors["blk.1.ffn_gate_inp.weight"].kind == "F32"
    for name, tensor in tensors.items():
        if tensor.kind not in ("F32", "F16"):
            assert tensor.kind == synthetic_gguf.q4_k_m_type(name, shape).name, name
    seen = set()
    for tensor in gguf.GGUFReader(str(out)).tensors:
        if tensor.tensor_type.name not in seen and tensor.tensor_type.name != "F32":
            seen.add(tensor.tensor_type.name)
            weights = dequantize(tensor.data, tensor.tensor_type)
            assert abs(weights.mean()) < 0.005 and 0.01 < weights.std() < 0.03, tensor.name
    assert seen == ({"Q4_K", "Q5_K", "Q6_K", "Q8_0"} if arch == "mixtral" else {"Q4_K", "Q6_K"})
    llm = LLM(model=str(out), kv_cache_memory="32MiB", max_num_seqs=1)
    assert all(layer.moe.native for layer in llm.engine.runner.model.layers)
    result = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(result.outputs[0].token_ids) == 4
