"""The dense families beyond Llama's (Qwen3, SmolLM3, Phi-3, Gemma 2, Gemma 3) against
transformers' own implementations, on tiny random-weight models (model_fixtures.FAMILY_SPECS),
each loaded by loom from its Hugging Face folder and from the GGUF files llama.cpp's own
converter (convert_hf_to_gguf.py, from the unpacked llama.cpp tree) writes of that folder:
float32 and Q8_0.

Teacher-forced log-probabilities go through the paged KV cache as the engine runs it: one-shot
prefill, decodes at and around the sliding window's edge (Gemma's window is 8 positions, the
contexts several windows long), chunked prefills whose chunks start inside a window and end
across one, and a step mixing all of them. Greedy text goes through loom's engine (the native
decode kernel where it takes the model). Plus the shapes both formats give, RoPE frequencies
against transformers' initialisers, parameter counts and the errors for what loom does not run.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from llama_cpp_tree import llama_cpp_tree
from model_fixtures import (
    FAMILY_SPECS,
    PROMPT_LEN,
    SCHEDULES,
    TinySpec,
    build_tiny_model,
    convert_with_llama_cpp,
    prompt,
    reference_logprobs,
    run_schedule,
    save_hf_folder,
    teacher_forced,
)

from loom import LLM, SamplingParams
from loom.model.arch import ModelArch, ModelLoadError
from loom.model.arch_gguf import arch_from_gguf
from loom.model.arch_hf import arch_from_hf_config
from loom.model.attention import DecodeGroup, _chunk_mask
from loom.model.backends import _native_decode
from loom.model.decoder import rope_attention_factor, rope_inv_freq
from loom.model.kernels import paged_attention_ops
from loom.model.loader import load_model
from loom.model.weights import LoadedModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAMILIES = list(FAMILY_SPECS)
LOGPROB_ATOL = 2e-3  # float32 throughout: observed differences are ~1e-5
# Mean KL(float32 || Q8_0) of the next-token distribution over a 40-token prompt, per family:
# measured 1.6e-4 (Gemma 2) to 4.6e-3 (SmolLM3, Phi-3) on these random-weight models (their
# logits span tens of nats, so rounding weights to 8 bits moves them more than in a trained
# model); the bound leaves 2x margin. The argmax agreed at 90-98% of positions.
Q8_MEAN_KL = 1e-2
Q8_ARGMAX_AGREE = 0.85


@dataclasses.dataclass(frozen=True)
class Family:
    model: object  # transformers' model
    hf: Path
    gguf: Path  # the converter's --outtype f32
    q8: Path  # --outtype q8_0


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, Family]:
    """Every family built, saved and converted once for the module (one converter process)."""
    root = tmp_path_factory.mktemp("families")
    built, jobs = {}, []
    for name, spec in FAMILY_SPECS.items():
        model = build_tiny_model(spec)
        hf = save_hf_folder(model, root / name, spec.tokenizer)
        built[name] = Family(model, hf, root / f"{name}.gguf", root / f"{name}-q8_0.gguf")
        jobs += [(hf, built[name].gguf, "f32"), (hf, built[name].q8, "q8_0")]
    convert_with_llama_cpp(llama_cpp_tree(), jobs)
    return built


_loaded: dict[tuple[str, str], LoadedModel] = {}


def load(families: dict[str, Family], name: str, fmt: str) -> LoadedModel:
    """loom's model of family `name` from its "hf" folder, "gguf" or "q8" file (cached)."""
    if (name, fmt) not in _loaded:
        family = families[name]
        path = {"hf": family.hf, "gguf": family.gguf, "q8": family.q8}[fmt]
        _loaded[name, fmt] = load_model(str(path))
    return _loaded[name, fmt]


@pytest.mark.integration
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("name", FAMILIES)
def test_logprobs_match_transformers(families, name, fmt, schedule):
    for r, (got, expected) in teacher_forced(families[name].model, load(families, name, fmt),
                                             SCHEDULES[schedule]).items():
        assert got.shape == expected.shape
        diff = float((got - expected).abs().max())
        assert diff <= LOGPROB_ATOL, f"request {r}: max |log p - transformers'| = {diff:.2e}"


@pytest.mark.integration
@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_tokens_match_transformers_generate(families, name):
    """16 greedy tokens through loom's engine (scheduler, runner, sampler; decodes on the
    native kernel wherever it builds, Gemma's windows and softcaps included) equal
    transformers'."""
    family = families[name]
    ids = prompt(family.model, PROMPT_LEN, seed=7)
    family.model.generation_config.eos_token_id = None  # 16 tokens, as ignore_eos below
    with torch.no_grad():
        expected = family.model.generate(torch.tensor([ids]), max_new_tokens=16,
                                         do_sample=False)[0, len(ids):].tolist()
    llm = LLM(model=str(family.hf), dtype="float32", kv_cache_dtype="float32",
              kv_cache_memory="16MiB", max_model_len=256)
    assert llm.engine.runner.backends.native_decode == (paged_attention_ops() is not None)
    out = llm.generate([ids], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == expected


@pytest.mark.integration
@pytest.mark.parametrize("name", FAMILIES)
def test_q8_0_gguf_stays_close_to_float32(families, name):
    """The converter's Q8_0 file: loom's next-token distribution against transformers'
    float32 one, mean KL below Q8_MEAN_KL (and the argmax mostly kept)."""
    model = families[name].model
    ids = prompt(model, PROMPT_LEN, seed=3)
    got = run_schedule(load(families, name, "q8"), SCHEDULES["chunks"], {"a": ids})["a"]
    expected = reference_logprobs(model, ids)
    kl = (expected.exp() * (expected - got)).sum(-1)
    assert float(kl.mean()) < Q8_MEAN_KL, f"mean KL {float(kl.mean()):.2e}"
    agree = (got.argmax(-1) == expected.argmax(-1)).float().mean()
    assert agree >= Q8_ARGMAX_AGREE
    # and it is quantized: not the float32 file's numbers
    assert float(kl.mean()) > 1e-7


@pytest.mark.integration
@pytest.mark.parametrize("name", FAMILIES)
def test_gguf_and_hf_folder_give_the_same_model(families, name):
    """The converter's file read back to transformers' names and values: Q/K rows
    un-permuted (SmolLM3), Gemma's 1 + w norms back to w, Phi-3's fused projections as they
    are, LongRoPE's factors from their tensors; the same shape from both."""
    from_hf, from_gguf = load(families, name, "hf"), load(families, name, "gguf")
    assert from_gguf.arch.rms_norm_eps == pytest.approx(from_hf.arch.rms_norm_eps, rel=1e-6)
    same = {"rms_norm_eps": 0.0}
    assert dataclasses.replace(from_hf.arch, **same) == dataclasses.replace(from_gguf.arch, **same)
    torch.testing.assert_close(rope_inv_freq(from_gguf.arch), rope_inv_freq(from_hf.arch),
                               rtol=1e-6, atol=0)
    assert rope_attention_factor(from_gguf.arch) == pytest.approx(
        rope_attention_factor(from_hf.arch), rel=1e-6)
    assert set(from_hf.weights) == set(from_gguf.weights)
    for tensor_name, tensor in from_hf.weights.items():
        # (1 + w) - 1 rounds w in float32; everything else is the file's bits
        atol = 1e-6 if "norm" in tensor_name and from_hf.arch.norm_offset else 0.0
        torch.testing.assert_close(from_gguf.weights[tensor_name], tensor, atol=atol, rtol=0,
                                   msg=tensor_name)


@pytest.mark.integration
@pytest.mark.parametrize("name", FAMILIES)
def test_num_parameters_counts_the_checkpoint(families, name):
    model = families[name].model
    assert load(families, name, "hf").arch.num_parameters == sum(
        p.numel() for p in model.parameters())


@pytest.mark.integration
def test_gemma_query_pre_attn_scalar_other_than_head_dim(tmp_path):
    """Gemma 3's 27B scales q.k by its query_pre_attn_scalar (hidden / heads), not head_dim:
    loom reads it from config.json."""
    base = FAMILY_SPECS["gemma3"]
    spec = TinySpec("gemma3-scalar", base.model_type,
                    dict(base.config, query_pre_attn_scalar=48), seed=16)
    model = build_tiny_model(spec)
    loaded = load_model(str(save_hf_folder(model, tmp_path / "hf")))
    assert loaded.arch.attention_scale == 48 ** -0.5
    ids = prompt(model, 20, seed=5)
    got = run_schedule(loaded, [[("a", 0, 20)]], {"a": ids})["a"]
    torch.testing.assert_close(got, reference_logprobs(model, ids), atol=LOGPROB_ATOL, rtol=0)


# -- pure: RoPE, masks, backends, errors ------------------------------------------------------

def _phi3_config(**overrides):
    from transformers import Phi3Config

    params = dict(FAMILY_SPECS["phi3"].config, vocab_size=300, **overrides)
    return Phi3Config(**params)


@pytest.mark.unit
@pytest.mark.parametrize("context", [32, 256], ids=["short", "long"])
def test_longrope_matches_transformers(context):
    """LongRoPE over a partial rotary: loom's frequencies for a context of the original
    length (short factors) or longer (long factors) and its attention factor equal
    transformers' `longrope` initialiser at those sequence lengths."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _phi3_config()
    expected, attention_factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu",
                                                                 seq_len=context)
    arch = arch_from_hf_config(config.to_dict())
    assert arch.rotary_dim == 48
    torch.testing.assert_close(rope_inv_freq(arch, context), expected.float(), rtol=1e-6,
                               atol=0)
    assert rope_attention_factor(arch) == pytest.approx(attention_factor, rel=1e-12)
    assert attention_factor > 1.0


@pytest.mark.unit
def test_gemma3_local_and_global_rope_match_transformers():
    """Gemma 3's global layers: base 1e6 with linear scaling; its sliding layers: base 1e4,
    unscaled; each as transformers' Gemma3RotaryEmbedding computes it."""
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    config = Gemma3TextConfig(vocab_size=300, **FAMILY_SPECS["gemma3"].config)
    rotary = Gemma3RotaryEmbedding(config)
    arch = arch_from_hf_config(config.to_dict())
    assert arch.rope_local_theta == 1e4 and arch.rope_theta == 1e6
    torch.testing.assert_close(rope_inv_freq(arch), rotary.full_attention_inv_freq.float(),
                               rtol=1e-6, atol=0)
    local = dataclasses.replace(arch, rope_theta=1e4, rope_scaling=None)
    torch.testing.assert_close(rope_inv_freq(local), rotary.sliding_attention_inv_freq.float(),
                               rtol=1e-6, atol=0)


@pytest.mark.unit
@pytest.mark.parametrize("window", [1, 3, 8])
def test_window_masks_see_the_last_w_positions(window):
    """A query at position p sees p - W + 1 .. p (transformers' sliding_window_overlay:
    kv > q - W), in a chunk after cached context and in a decode group alike."""
    from transformers.masking_utils import sliding_window_overlay

    inside = sliding_window_overlay(window)
    context, query_len = 13, 5
    mask = _chunk_mask(query_len, context, 0, window, torch.device("cpu"))
    for i in range(query_len):
        p = context - query_len + i
        assert mask[i].tolist() == [k <= p and bool(inside(0, 0, p, k)) for k in range(context)]
    # the first key a chunk reads from: the same mask, its leading columns cut
    first = max(0, context - query_len - window + 1)
    torch.testing.assert_close(_chunk_mask(query_len, context, first, window,
                                           torch.device("cpu")), mask[:, first:])
    lens = torch.tensor([1, window, window + 1, 13])
    full = (torch.arange(16).unsqueeze(0) < lens.unsqueeze(1)).view(4, 1, 1, 16)
    group = DecodeGroup(0, 4, torch.zeros(4, 4, dtype=torch.long), full)
    got = group.window_mask(window).view(4, 16)
    for row, n in enumerate(lens.tolist()):
        p = n - 1
        assert got[row].tolist() == [k <= p and bool(inside(0, 0, p, k)) for k in range(16)]
    assert group.window_mask(None) is full


@pytest.mark.unit
def test_native_decode_takes_windows_softcaps_and_scales():
    """The native kernel attends with a LayerAttention (window, softcap, scale), so Gemma's
    sliding, softcapped layers decode on it like any other family's."""
    config = {**FAMILY_SPECS["gemma2"].config, "model_type": "gemma2", "vocab_size": 300}
    gemma = arch_from_hf_config(config)
    assert gemma.layer_types is not None and gemma.attn_softcap is not None
    expected = paged_attention_ops() is not None
    assert _native_decode("auto", gemma, 16, torch.device("cpu"), torch.float32,
                          torch.float32) == expected


@pytest.mark.unit
def test_hf_config_fields_per_family():
    """What each family's config.json turns into: SmolLM3's no-RoPE layers, Qwen3's q/k
    norms, Gemma 2's sliding pattern, softcaps and scale, Phi-3's window on every layer."""
    def arch(name: str, **extra) -> ModelArch:
        spec = FAMILY_SPECS[name]
        return arch_from_hf_config({**spec.config, "model_type": spec.model_type,
                                    "vocab_size": 300, **extra})

    assert arch("smollm3").nope_layers == (3,)
    assert arch("smollm3", no_rope_layers=[1, 0, 1, 1]).nope_layers == (1,)
    assert arch("qwen3").qk_norm and not arch("qwen3").attention_bias
    gemma2 = arch("gemma2")
    assert gemma2.layer_types == ("sliding_attention", "full_attention")
    assert (gemma2.attn_softcap, gemma2.final_softcap, gemma2.attention_scale) == (
        3.0, 5.0, 64 ** -0.5)
    assert (gemma2.norm_offset, gemma2.embedding_scale, gemma2.activation) == (
        1.0, 8.0, "gelu_tanh")
    phi3 = arch("phi3", sliding_window=16)
    assert phi3.layer_types == ("sliding_attention",) * 2 and phi3.sliding_window == 16
    with pytest.raises(ModelLoadError, match="activation"):
        arch("qwen3", hidden_act="relu")


@pytest.mark.unit
def test_unsupported_architectures_name_what_loom_runs():
    with pytest.raises(ModelLoadError, match=r"unsupported model_type 'gpt2'; loom runs "
                                             r"model_type \[.*'gemma3_text'"):
        arch_from_hf_config({"model_type": "gpt2"})
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'falcon' in x.gguf; "
                                             r"loom runs GGUF architectures \[.*'phi3'"):
        arch_from_gguf({"general.architecture": "falcon"}, {}, "x.gguf")
