"""The mixtures of experts (Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE) end to end against
transformers' own implementations, on tiny random-weight models (model_fixtures.MOE_SPECS: 8
experts, 2 a token), each loaded by loom from its Hugging Face folder and from the GGUF files
llama.cpp's own converter writes of it (float32 and Q8_0; Mixtral as GGUF architecture "llama").

Teacher-forced log-probabilities go through the paged KV cache as the engine runs it (one-shot
prefill, decodes, chunked prefills, a mixed step); greedy text through loom's engine; the Q8_0
file's experts on the native MoE kernel as the engine runs them; Qwen2/3-MoE with dense layers
mixed in (Hugging Face folders: the converter cannot write them); routers whose rows tie exactly
(loom takes the lower expert ids; transformers takes whatever torch.topk returns among equal
scores); parameter counts, active and total; what the start-up log says; the fields each format
gives and the files loom refuses.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from llama_cpp_tree import llama_cpp_tree
from model_fixtures import (
    MIXED_MOE_SPECS,
    MOE_SPECS,
    PROMPT_LEN,
    SCHEDULES,
    build_tiny_model,
    convert_with_llama_cpp,
    prompt,
    reference_logprobs,
    run_schedule,
    save_hf_folder,
    teacher_forced,
)

from loom import LLM, SamplingParams
from loom.model.arch import ModelLoadError, default_model_path
from loom.model.arch_gguf import arch_from_gguf
from loom.model.arch_hf import arch_from_hf_config
from loom.model.decoder import DecoderModel
from loom.model.gguf_file import GGUFTensor
from loom.model.kernels import block_quant_linear_ops
from loom.model.linear import INT8_MAX_ROWS
from loom.model.loader import load_model
from loom.model.model_files import read_arch
from loom.model.moe import ExpertBlocks, Routing, moe_from_hf
from loom.model.weights import LoadedModel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout: benchmarks.*
from benchmarks import synthetic_gguf  # noqa: E402 - the writer of model-shaped files

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ops = block_quant_linear_ops()
needs_kernel = pytest.mark.skipif(ops is None or not ops.supported(),
                                  reason="no C++ compiler or no AVX2/FMA/F16C")
MOES = list(MOE_SPECS)
LOGPROB_ATOL = 2e-3  # float32 throughout: observed differences are ~1e-5
# Mean KL(transformers' float32 || loom on the converter's Q8_0 file) of the next-token
# distribution over four 40-token prompts: measured 3.9e-3 (Qwen3-MoE) to 1.6e-2 (Mixtral) on
# these random-weight models, one prompt alone 4e-4 to 5.5e-2: Q8_0's rounding moves some
# tokens to another expert, which moves their logits by up to a nat. The bound leaves 2x
# margin; the argmax agreed at 86-93% of positions.
Q8_MEAN_KL = 3e-2
Q8_ARGMAX_AGREE = 0.8
Q8_SEEDS = (3, 4, 5, 6)


@dataclasses.dataclass(frozen=True)
class Mixture:
    model: object  # transformers' model
    hf: Path
    gguf: Path  # the converter's --outtype f32
    q8: Path  # --outtype q8_0
    tied: object  # the model with tied router rows (tie_routers)
    tied_hf: Path
    tied_q8: Path


def tie_routers(model: object) -> object:
    """A copy of `model` whose every router has experts 0-3 on one row and 4-7 on another:
    each token's logits tie four ways at the top, so its 2 experts are a choice among equals
    (softmax weights equal, renormalised to 1/2 each where the family does)."""
    tied = copy.deepcopy(model)
    with torch.no_grad():
        for name, param in tied.named_parameters():
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                param[1:4] = param[0]
                param[5:8] = param[4]
    return tied


@pytest.fixture(scope="module")
def mixtures(tmp_path_factory) -> dict[str, Mixture]:
    """Every family built, tied, saved and converted once for the module (one converter
    process)."""
    root = tmp_path_factory.mktemp("mixtures")
    built, jobs = {}, []
    for name, spec in MOE_SPECS.items():
        model = build_tiny_model(spec)
        tied = tie_routers(model)
        hf = save_hf_folder(model, root / name, spec.tokenizer)
        tied_hf = save_hf_folder(tied, root / f"{name}-tied", spec.tokenizer)
        built[name] = Mixture(model, hf, root / f"{name}.gguf", root / f"{name}-q8_0.gguf",
                              tied, tied_hf, root / f"{name}-tied-q8_0.gguf")
        jobs += [(hf, built[name].gguf, "f32"), (hf, built[name].q8, "q8_0"),
                 (tied_hf, built[name].tied_q8, "q8_0")]
    convert_with_llama_cpp(llama_cpp_tree(), jobs)
    return built


_loaded: dict[tuple[str, str], LoadedModel] = {}


def load(mixtures: dict[str, Mixture], name: str, fmt: str) -> LoadedModel:
    """loom's model of family `name` from one of its files ("hf", "gguf", "q8", "tied_hf",
    "tied_q8"; cached)."""
    if (name, fmt) not in _loaded:
        _loaded[name, fmt] = load_model(str(getattr(mixtures[name], fmt)))
    return _loaded[name, fmt]


def max_diff(got: torch.Tensor, expected: torch.Tensor) -> float:
    assert got.shape == expected.shape
    return float((got - expected).abs().max())


def mean_kl(expected: torch.Tensor, got: torch.Tensor) -> float:
    """Mean over positions of KL(expected || got), both log-probabilities."""
    return float((expected.exp() * (expected - got)).sum(-1).mean())


# -- against transformers ---------------------------------------------------------------------

@pytest.mark.integration
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("name", MOES)
def test_logprobs_match_transformers(mixtures, name, fmt, schedule):
    """Every layer's experts on the torch path (fp32: the folder's, or the f32 file's)."""
    loaded = load(mixtures, name, fmt)
    for r, (got, expected) in teacher_forced(mixtures[name].model, loaded,
                                             SCHEDULES[schedule]).items():
        diff = max_diff(got, expected)
        assert diff <= LOGPROB_ATOL, f"request {r}: max |log p - transformers'| = {diff:.2e}"


@pytest.mark.integration
@pytest.mark.parametrize("name", list(MIXED_MOE_SPECS))
def test_dense_layers_mixed_in_match_transformers(name, tmp_path):
    """Qwen3-MoE's mlp_only_layers and Qwen2-MoE's decoder_sparse_step: those layers run the
    dense MLP, the others their experts."""
    spec = MIXED_MOE_SPECS[name]
    model = build_tiny_model(spec)
    loaded = load_model(str(save_hf_folder(model, tmp_path / name, spec.tokenizer)))
    dense = {"qwen3_moe-dense": (0,), "qwen2_moe-step": (0, 2)}[name]
    assert loaded.arch.dense_layers == dense
    decoder = DecoderModel(loaded.arch, loaded.weights, torch.float32, torch.device("cpu"))
    assert [layer.moe is None for layer in decoder.layers] == [
        i in dense for i in range(loaded.arch.num_layers)]
    for schedule in ("prefill", "mixed"):
        for r, (got, expected) in teacher_forced(model, loaded, SCHEDULES[schedule]).items():
            assert max_diff(got, expected) <= LOGPROB_ATOL, (schedule, r)
    assert loaded.arch.num_parameters == sum(p.numel() for p in model.parameters())


@pytest.mark.integration
@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("name", MOES)
def test_greedy_tokens_match_transformers_generate(mixtures, name, fmt):
    """16 greedy tokens through loom's engine (scheduler, runner, sampler; decodes on the
    native attention kernel where there is one: head_dim 64) equal transformers'."""
    mixture = mixtures[name]
    ids = prompt(mixture.model, PROMPT_LEN, seed=7)
    mixture.model.generation_config.eos_token_id = None  # 16 tokens, as ignore_eos below
    with torch.no_grad():
        expected = mixture.model.generate(torch.tensor([ids]), max_new_tokens=16,
                                          do_sample=False)[0, len(ids):].tolist()
    llm = LLM(model=str(getattr(mixture, fmt)), dtype="float32", kv_cache_dtype="float32",
              kv_cache_memory="16MiB", max_model_len=256)
    assert all(layer.moe is not None for layer in llm.engine.runner.model.layers)
    out = llm.generate([ids], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == expected


@pytest.mark.integration
@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("name", MOES)
def test_q8_0_gguf_stays_close_to_float32(mixtures, name, path):
    """The converter's Q8_0 file, its experts on the native MoE kernel (every other matmul on
    the native one too, as the engine runs a GGUF) or dequantized on the torch path: mean KL
    from transformers' float32 distribution below Q8_MEAN_KL, the argmax mostly kept; the
    kernel's within a tenth of that KL of the torch path's."""
    native = path == "native"
    if native and (ops is None or not ops.supported()):
        pytest.skip("no C++ compiler or no AVX2/FMA/F16C")
    model, loaded = mixtures[name].model, load(mixtures, name, "q8")
    if native:
        decoder = DecoderModel(loaded.arch, loaded.weights, torch.float32, torch.device("cpu"),
                               block_quant=loaded.block_quant)
        assert all(layer.moe.native for layer in decoder.layers)
    prompts = [prompt(model, PROMPT_LEN, seed=seed) for seed in Q8_SEEDS]

    def run(on_kernel: bool) -> torch.Tensor:
        return torch.cat([run_schedule(loaded, SCHEDULES["chunks"], {"a": ids},
                                       native_linear=on_kernel)["a"] for ids in prompts])

    got = run(native)
    expected = torch.cat([reference_logprobs(model, ids) for ids in prompts])
    kl = mean_kl(expected, got)
    assert 1e-7 < kl < Q8_MEAN_KL, f"mean KL {kl:.2e}"  # quantized, not the float32 numbers
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= Q8_ARGMAX_AGREE
    if native:
        assert mean_kl(run(False), got) < kl / 10


def decided(logprobs: torch.Tensor, margin: float) -> torch.Tensor:
    """The positions whose top two log-probabilities are more than `margin` apart: where two
    computations that round apart must still agree on the argmax."""
    top = logprobs.topk(2, dim=-1).values
    return top[:, 0] - top[:, 1] > margin


@needs_kernel
@pytest.mark.integration
def test_the_engine_runs_a_q8_0_mixture_on_the_moe_kernel(mixtures):
    """`auto` backends on a Q8_0 mixture put every layer's experts on the native MoE kernel
    (not the torch loop over experts), and the engine's greedy decodes are what a
    teacher-forced prefill of its own output on the kernel predicts (away from near ties)."""
    path = mixtures["qwen3_moe"].q8
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB", max_model_len=256)
    assert all(layer.moe.native for layer in llm.engine.runner.model.layers)
    ids = prompt(mixtures["qwen3_moe"].model, 24, seed=9)
    out = llm.generate([ids], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    generated = out[0].outputs[0].token_ids
    fed = ids + generated
    logprobs = run_schedule(load(mixtures, "qwen3_moe", "q8"), [[("a", 0, len(fed))]],
                            {"a": fed}, native_linear=True)["a"][len(ids) - 1:-1]
    sure = decided(logprobs, 0.05)
    assert sure.sum() >= 8
    assert logprobs.argmax(-1)[sure].tolist() == torch.tensor(generated)[sure].tolist()


@needs_kernel
@pytest.mark.integration
def test_batch_invariant_mixture_decodes_alone_as_together(mixtures):
    """--batch-invariant on a Q8_0 mixture with a shared expert: 6 prompts' greedy tokens and
    logprobs, bit for bit, decoded one a call and all together among 18 others (prefill steps
    of hundreds of tokens and decode steps of 24 rows, the shared expert's: more rows than
    the default int8 bounds); one layer's experts give each token the same bits alone as
    among 160, which the default bounds send to the fp32 path, to round apart."""
    llm = LLM(model=str(mixtures["qwen2_moe"].q8), batch_invariant=True,
              kv_cache_memory="16MiB", max_model_len=256, max_num_seqs=24)
    prompts = [prompt(mixtures["qwen2_moe"].model, 16 + i, seed=40 + i) for i in range(24)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)

    def decoded(outs: list) -> list[tuple[list[int], list[float]]]:
        return [(list(o.outputs[0].token_ids), [e.logprob for e in o.outputs[0].logprobs])
                for o in outs]

    alone = decoded([llm.generate([ids], params)[0] for ids in prompts[:6]])
    assert decoded(llm.generate(prompts, params)[:6]) == alone
    moe = llm.engine.runner.model.layers[0].moe
    assert moe.native
    x = torch.randn(160, 128, generator=torch.Generator().manual_seed(0))
    assert torch.equal(moe(x), torch.cat([moe(row) for row in x.split(1)]))
    moe.int8_max_rows = dict(INT8_MAX_ROWS)
    assert not torch.equal(moe(x), torch.cat([moe(row) for row in x.split(1)]))


@pytest.mark.integration
@pytest.mark.parametrize("name", MOES)
def test_gguf_and_hf_folder_give_the_same_model(mixtures, name):
    """The converter's file read back to transformers' names and values: the same shape
    (Mixtral's GGUF architecture is "llama"), the same dense tensors, each layer's router and
    experts (stacked in the file, per expert in the folder) and Qwen2-MoE's shared expert."""
    from_hf, from_gguf = load(mixtures, name, "hf"), load(mixtures, name, "gguf")
    arch = from_hf.arch
    assert from_gguf.arch.architecture == ("llama" if name == "mixtral" else arch.architecture)
    same = {"rms_norm_eps": 0.0, "architecture": ""}
    assert dataclasses.replace(arch, **same) == dataclasses.replace(from_gguf.arch, **same)
    dense = {n for n in from_hf.weights if ".experts." not in n and "gate.weight" not in n}
    for tensor_name in dense:
        torch.testing.assert_close(from_gguf.weights[tensor_name], from_hf.weights[tensor_name],
                                   atol=0, rtol=0, msg=tensor_name)
    routing = Routing.from_arch(arch)
    for i in range(arch.num_layers):
        a = moe_from_hf(from_hf.weights, f"model.layers.{i}.", routing)
        b = moe_from_hf(from_gguf.weights, f"model.layers.{i}.", routing)
        assert torch.equal(a.router, b.router)
        for part in ("gate", "up", "down"):
            assert torch.equal(getattr(a.experts, part), getattr(b.experts, part)), part
        assert (a.shared is not None) == (name == "qwen2_moe") == (b.shared is not None)
        if a.shared is not None:
            assert torch.equal(a.shared.gate, b.shared.gate)
            for part in ("gate", "up", "down"):
                assert torch.equal(getattr(a.shared.mlp, part), getattr(b.shared.mlp, part))


@pytest.mark.integration
@pytest.mark.parametrize("name", MOES)
def test_the_q8_0_files_experts_are_its_blocks(mixtures, name):
    """On the native path the loader hands the decoder the Q8_0 experts as the file's blocks
    (E * N rows each, per expert the rows of its slice): the fp32 weights of the experts are
    never made."""
    loaded = load(mixtures, name, "q8")
    prefix = "model.layers.0.mlp.experts."
    gate = loaded.block_quant[prefix + "gate_proj"]
    arch = loaded.arch
    assert gate.kind == "Q8_0" and gate.shape == (arch.num_experts * arch.moe_intermediate_size,
                                                  arch.hidden_size)
    block = moe_from_hf(loaded.weights, "model.layers.0.", Routing.from_arch(arch),
                        loaded.block_quant)
    assert isinstance(block.experts.down, ExpertBlocks)
    torch.testing.assert_close(block.experts.down.expert(3).dequantize(),
                               loaded.weights[prefix + "down_proj"][3], atol=0, rtol=0)


@pytest.mark.integration
@pytest.mark.parametrize("name", MOES)
def test_parameter_counts(mixtures, name):
    """num_parameters counts the checkpoint; num_active_parameters drops, on each layer, the
    experts a token does not take (8 - 2 of 8)."""
    model, arch = mixtures[name].model, load(mixtures, name, "hf").arch
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert arch.num_parameters == total
    assert arch.num_active_parameters == total - experts * 6 // 8


# -- routing ties -----------------------------------------------------------------------------

def _stable_topk(descending: bool):
    """torch.topk as transformers calls it, equal values in expert order (descending: the
    lower ids first) or reversed (the higher ids first)."""
    def topk(x: torch.Tensor, k: int, dim: int = -1):
        order = torch.sort(x if descending else x.flip(dim), dim=dim, descending=True,
                           stable=True).indices
        if not descending:
            order = x.shape[dim] - 1 - order
        indices = order.narrow(dim, 0, k)
        return torch.return_types.topk((x.gather(dim, indices), indices))
    return topk


def reference_with_ties(model: object, ids: list[int], lower_first: bool) -> torch.Tensor:
    with mock.patch.object(torch, "topk", _stable_topk(lower_first)):
        return reference_logprobs(model, ids)


@pytest.mark.integration
@pytest.mark.parametrize("name", MOES)
def test_tied_router_rows_take_the_lower_expert_ids(mixtures, name):
    """Routers whose experts 0-3 and 4-7 share a row (tie_routers): every token's top two
    are a choice among four equal logits. loom takes the lower ids (0 and 1, or 4 and 5), on
    the torch path (the folder) and on the native MoE kernel (the Q8_0 file): transformers
    with that rule is matched as closely as untied models are; with the higher ids it is
    not, so the rule decides the output. transformers itself takes what torch.topk returns
    among equal probabilities, which torch leaves unspecified: with torch 2.13 on a CPU
    neither rule (of [x] * 4 + [y] * 4, y > x, it took 5 and 6), and its log-probabilities on
    these models were up to 4.3-6.3 nats from loom's (mean KL from loom's kernel 0.12-0.33)."""
    mixture = mixtures[name]
    ids = prompt(mixture.model, PROMPT_LEN, seed=11)
    lower = reference_with_ties(mixture.tied, ids, lower_first=True)
    higher = reference_with_ties(mixture.tied, ids, lower_first=False)
    assert max_diff(higher, lower) > 100 * LOGPROB_ATOL
    got = run_schedule(load(mixtures, name, "tied_hf"), SCHEDULES["chunks"], {"a": ids})["a"]
    assert max_diff(got, lower) <= LOGPROB_ATOL
    if ops is None or not ops.supported():
        return
    native = run_schedule(load(mixtures, name, "tied_q8"), SCHEDULES["chunks"], {"a": ids},
                          native_linear=True)["a"]
    assert mean_kl(lower, native) < Q8_MEAN_KL < mean_kl(higher, native)


# -- start-up, fields, refusals ---------------------------------------------------------------

@pytest.mark.integration
def test_the_load_log_names_the_mixture(mixtures, caplog):
    caplog.set_level(logging.INFO, logger="loom.model.loader")
    load_model(str(mixtures["qwen2_moe"].hf))
    arch = load(mixtures, "qwen2_moe", "hf").arch
    message = caplog.records[-1].getMessage()
    assert "8 experts, 2 active per token, a shared expert" in message
    active, total = arch.num_active_parameters / 1e6, arch.num_parameters / 1e6
    assert f"{active:.1f}M of {total:.1f}M parameters active" in message


def _hf_arch(name: str, **extra) -> object:
    spec = {**MOE_SPECS, **MIXED_MOE_SPECS}[name]
    return arch_from_hf_config({**spec.config, "model_type": spec.model_type,
                                "vocab_size": 300, **extra})


@pytest.mark.unit
def test_hf_config_fields_per_family():
    """What each mixture's config.json turns into: the experts' width (Mixtral's and OLMoE's
    intermediate_size, the Qwens' moe_intermediate_size), Mixtral always renormalised, the
    q/k norms' kind, Qwen2-MoE's qkv_bias and shared expert, dense layers from mlp_only_layers
    and decoder_sparse_step; transformers 5's num_local_experts for the Qwens' num_experts."""
    mixtral = _hf_arch("mixtral", norm_topk_prob=False)
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size,
            mixtral.norm_topk_prob, mixtral.qk_norm) == (8, 2, 64, True, None)
    olmoe = _hf_arch("olmoe")
    assert (olmoe.moe_intermediate_size, olmoe.norm_topk_prob, olmoe.qk_norm) == (
        64, False, "projection")
    qwen3 = _hf_arch("qwen3_moe")
    assert (qwen3.moe_intermediate_size, qwen3.norm_topk_prob, qwen3.qk_norm) == (32, True, "head")
    assert _hf_arch("qwen3_moe", num_local_experts=16, num_experts=None).num_experts == 16
    qwen2 = _hf_arch("qwen2_moe")
    assert qwen2.attention_bias and qwen2.shared_expert_intermediate_size == 64
    assert not _hf_arch("qwen2_moe", qkv_bias=False).attention_bias
    assert _hf_arch("qwen3_moe-dense").dense_layers == (0,)
    assert _hf_arch("qwen2_moe-step").dense_layers == (0, 2)
    assert _hf_arch("qwen2_moe", decoder_sparse_step=2, mlp_only_layers=[1]).dense_layers == (0, 1)
    assert [_hf_arch("qwen2_moe-step").has_experts(i) for i in range(4)] == [
        False, True, False, True]


@pytest.mark.unit
def test_hf_configs_loom_cannot_run_are_refused():
    with pytest.raises(ModelLoadError, match="clip_qkv"):
        _hf_arch("olmoe", clip_qkv=8.0)
    with pytest.raises(ModelLoadError, match="num_experts_per_tok"):
        _hf_arch("olmoe", num_experts_per_tok=9)
    with pytest.raises(ModelLoadError, match="lacks 'num_experts'"):
        _hf_arch("olmoe", num_experts=None)
    with pytest.raises(ModelLoadError, match="moe_intermediate_size must be a positive"):
        _hf_arch("qwen3_moe", moe_intermediate_size="32")


@pytest.mark.unit
def test_a_dense_model_is_all_active():
    arch = arch_from_hf_config({"model_type": "llama", "hidden_size": 64,
                                "intermediate_size": 128, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "vocab_size": 300})
    assert arch.num_experts == 0 and not arch.has_experts(0)
    assert arch.num_active_parameters == arch.num_parameters


def _gguf(arch: str, layers: int = 2, **keys) -> tuple[dict, dict[str, GGUFTensor]]:
    """A mixture's GGUF header and tensor index (no data), as llama.cpp's converter writes it:
    every layer with a router and stacked experts, q/k norms per head where `head_norm`."""
    meta = {"general.architecture": arch, "tokenizer.ggml.tokens": ["a"] * 300,
            f"{arch}.attention.head_count": 4, f"{arch}.embedding_length": 64,
            f"{arch}.block_count": layers, f"{arch}.feed_forward_length": 96,
            f"{arch}.attention.layer_norm_rms_epsilon": 1e-5, f"{arch}.expert_count": 8,
            f"{arch}.expert_used_count": 2,
            **{f"{arch}.{key}": value for key, value in keys.items()}}
    empty = np.zeros(0, np.uint8)
    names = ["ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]
    tensors = {f"blk.{i}.{n}.weight": GGUFTensor(f"blk.{i}.{n}.weight", (8, 64), "F32", empty)
               for i in range(layers) for n in names}
    return meta, tensors


@pytest.mark.unit
@pytest.mark.parametrize(("arch", "normalize"), [("llama", True), ("qwen3moe", True),
                                                 ("olmoe", False), ("qwen2moe", False)])
def test_gguf_renormalises_as_llama_cpp_does(arch, normalize):
    """llama.cpp's files do not say whether the chosen weights are renormalised: its graph
    decides per architecture, and so does loom. The experts' width: expert_feed_forward_length
    where the file has it (the Qwens), else feed_forward_length (Mixtral, OLMoE)."""
    meta, tensors = _gguf(arch)
    got = arch_from_gguf(meta, tensors, "x.gguf")
    assert (got.num_experts, got.num_experts_per_tok, got.norm_topk_prob) == (8, 2, normalize)
    assert got.moe_intermediate_size == 96
    meta[f"{arch}.expert_feed_forward_length"] = 32
    assert arch_from_gguf(meta, tensors, "x.gguf").moe_intermediate_size == 32


@pytest.mark.unit
def test_gguf_layers_without_a_router_are_dense():
    meta, tensors = _gguf("qwen3moe", layers=3)
    del tensors["blk.1.ffn_gate_inp.weight"]
    assert arch_from_gguf(meta, tensors, "x.gguf").dense_layers == (1,)


@pytest.mark.unit
def test_gguf_files_loom_cannot_run_are_refused():
    meta, tensors = _gguf("llama")
    for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        del tensors[f"blk.0.{name}.weight"]
    tensors["blk.0.ffn_down.0.weight"] = GGUFTensor("blk.0.ffn_down.0.weight", (64, 96), "F32",
                                                    np.zeros(0, np.uint8))
    with pytest.raises(ModelLoadError, match=r"each expert as tensors of its own.*convert"):
        arch_from_gguf(meta, tensors, "x.gguf")
    meta, tensors = _gguf("olmoe", **{"attention.clamp_kqv": 8.0})
    with pytest.raises(ModelLoadError, match="clamp_kqv"):
        arch_from_gguf(meta, tensors, "x.gguf")


@pytest.mark.integration
@pytest.mark.parametrize("arch", ["qwen3moe", "olmoe"])
def test_synthetic_gguf_loads_and_decodes_as_it_prefills(arch, tmp_path):
    """benchmarks/synthetic_gguf.py's mixtures (F16, the bundled model's vocabulary) load with
    the shape they were written with, and loom's engine decodes what a teacher-forced prefill
    of its own output predicts."""
    shape = synthetic_gguf.Shape(arch, hidden=64, ffn=32 if arch == "olmoe" else 96, layers=2,
                                 heads=2, kv_heads=1, head_dim=64 if arch == "qwen3moe" else 32,
                                 experts=8, experts_used=2, expert_ffn=32)
    path = tmp_path / f"{arch}.gguf"
    synthetic_gguf.write(shape, str(default_model_path()), str(path))
    got = read_arch(path)
    assert (got.num_experts, got.num_experts_per_tok, got.moe_intermediate_size) == (8, 2, 32)
    assert got.qk_norm == ("head" if arch == "qwen3moe" else "projection")
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB", max_model_len=256)
    ids = list(range(100, 120))
    out = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    generated = out[0].outputs[0].token_ids
    fed = ids + generated
    logprobs = run_schedule(load_model(str(path)), [[("a", 0, len(fed))]],
                            {"a": fed})["a"][len(ids) - 1:-1]
    sure = decided(logprobs, 1e-4)  # N(0, 0.02) weights: nearly flat logits
    assert sure.sum() >= 4
    assert logprobs.argmax(-1)[sure].tolist() == torch.tensor(generated)[sure].tolist()
