"""loom's Llama-family decoder against transformers' own implementation, on tiny random-weight
Llama (tied; Llama-3.1 RoPE scaling, untied; attention and MLP biases), Qwen2 (q/k/v bias, padded
vocab) and Mistral (head_dim != hidden / heads) models, each loaded by loom both from a Hugging
Face folder and from a GGUF file written the way llama.cpp's converter writes it (Q/K rows
permuted, Llama-3 scaling as a rope_freqs tensor).

Every path through the paged KV cache is compared with a full transformers forward: one-shot
prefill, prefill then decodes, a prefill split into chunks, and one step mixing all of them.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from model_fixtures import (
    TINY_SPECS,
    Chunk,
    build_tiny_model,
    llama3_rope_factors,
    make_runner,
    save_hf_folder,
    step_logits,
    write_gguf,
)

from loom.core.batch import ScheduledRequest, SchedulerOutput
from loom.model.arch import ModelArch
from loom.model.decoder import rope_inv_freq
from loom.model.loader import load_model
from loom.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


ATOL = 1e-4  # fp32; observed differences are ~5e-6 on logits of magnitude ~5


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=1e-5)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """family -> (transformers model, HF folder, GGUF file); built once for the module."""
    built = {}
    for name, spec in TINY_SPECS.items():
        model = build_tiny_model(spec)
        root = tmp_path_factory.mktemp(name)
        built[name] = (model, save_hf_folder(model, root / "hf"),
                       write_gguf(model, root / f"{name}.gguf"))
    return built


CASES = [(family, fmt) for family in TINY_SPECS for fmt in ("hf", "gguf")]


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{fmt}" for f, fmt in CASES])
def case(request, tiny_models):
    family, fmt = request.param
    model, hf_dir, gguf_path = tiny_models[family]
    loaded = load_model(str(hf_dir if fmt == "hf" else gguf_path))
    return model, loaded


def prompt(model, length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (length,), generator=g).tolist()


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.integration
def test_prefill_logits_match_transformers(case):
    model, loaded = case
    ids = prompt(model, 23, seed=0)
    runner = make_runner(loaded)
    logits = step_logits(runner, [Chunk("a", ids, 0, [5, 3, 9, 1, 7, 11])])["a"]
    assert logits.shape == (23, model.config.vocab_size)
    assert_logits_close(logits, reference_logits(model, ids))


@pytest.mark.integration
def test_decodes_after_prefill_read_the_paged_cache(case):
    model, loaded = case
    ids = prompt(model, 22, seed=1)
    expected = reference_logits(model, ids)
    runner = make_runner(loaded)
    blocks = [12, 2, 30, 4, 17, 8]  # scattered: positions 16.. live in block 17
    n = 18
    got = [step_logits(runner, [Chunk("a", ids[:n], 0, blocks)])["a"]]
    for pos in range(n, len(ids)):  # each decode attends over cached K/V through the table
        got.append(step_logits(runner, [Chunk("a", [ids[pos]], pos, blocks)])["a"])
    assert_logits_close(torch.cat(got), expected)


@pytest.mark.integration
@pytest.mark.parametrize("split", [[9, 14], [4, 1, 11, 7]], ids=["two-chunks", "uneven-chunks"])
def test_chunked_prefill_equals_full_forward(case, split):
    """Chunk boundaries off block boundaries (block size 4); a 1-token chunk takes the decode
    path mid-prompt."""
    model, loaded = case
    ids = prompt(model, sum(split), seed=2)
    runner = make_runner(loaded)
    blocks = [40, 41, 3, 50, 6, 22]
    got, start = [], 0
    for size in split:
        got.append(step_logits(runner, [Chunk("a", ids[start:start + size], start, blocks)])["a"])
        start += size
    assert_logits_close(torch.cat(got), reference_logits(model, ids))


@pytest.mark.integration
def test_mixed_step_of_decodes_chunks_and_prefills(case):
    """One step holding two decodes, a second prefill chunk and a fresh prefill, each request
    with its own scattered blocks, gives every request the logits it gets alone."""
    model, loaded = case
    a, b, c, d = (prompt(model, n, seed=10 + i) for i, n in enumerate([13, 20, 11, 6]))
    tables = {"a": [1, 20, 7, 33], "b": [2, 9, 14, 25, 31], "c": [5, 11, 19], "d": [40, 3]}
    runner = make_runner(loaded)
    first = step_logits(runner, [Chunk("a", a[:12], 0, tables["a"]),
                                 Chunk("b", b[:8], 0, tables["b"]),
                                 Chunk("d", d[:5], 0, tables["d"])])
    mixed = step_logits(runner, [Chunk("b", b[8:], 8, tables["b"]),
                                 Chunk("a", a[12:], 12, tables["a"]),
                                 Chunk("c", c, 0, tables["c"]),
                                 Chunk("d", d[5:], 5, tables["d"])])
    for rid, ids in zip("abcd", (a, b, c, d)):
        got = torch.cat([first[rid], mixed[rid]]) if rid in first else mixed[rid]
        assert_logits_close(got, reference_logits(model, ids))


@pytest.mark.integration
def test_runner_execute_prompt_logprobs_and_greedy_token(tiny_models):
    """ModelRunner.execute end to end over a chunked prompt: prompt logprobs (and their top-2)
    and the greedy token equal transformers' log-softmax and argmax."""
    model, _, gguf_path = tiny_models["llama3"]
    runner = make_runner(load_model(str(gguf_path)))
    ids = prompt(model, 19, seed=3)
    params = SamplingParams(temperature=0, prompt_logprobs=2, max_tokens=1)
    blocks = [8, 1, 15, 4, 9]
    logprobs = []
    for start, end in [(0, 10), (10, 19)]:
        item = ScheduledRequest("r", ids[start:end], start, blocks, params, end == len(ids), ids)
        out = runner.execute(SchedulerOutput(scheduled=[item]))
        first, entries = out.prompt_logprobs["r"]
        assert first == len(logprobs) + 1
        logprobs += entries
    expected = reference_logits(model, ids).log_softmax(-1)
    assert [e.token_id for e in logprobs] == ids[1:]
    torch.testing.assert_close(torch.tensor([e.logprob for e in logprobs]),
                               expected[torch.arange(len(ids) - 1), ids[1:]], atol=ATOL, rtol=0)
    top2 = expected[:-1].topk(2, dim=-1).indices.tolist()
    assert [[t for t, _ in e.top] for e in logprobs] == top2
    assert out.sampled_token_ids["r"] == int(expected[-1].argmax())


@pytest.mark.integration
@pytest.mark.parametrize("family", list(TINY_SPECS))
def test_gguf_and_hf_folder_give_the_same_architecture(tiny_models, family):
    model, hf_dir, gguf_path = tiny_models[family]
    from_hf, from_gguf = load_model(str(hf_dir)), load_model(str(gguf_path))
    # GGUF keeps eps as float32; rope_scaling is compared through the frequencies (ModelArch
    # equality ignores it: the GGUF form is llama.cpp's rope_freqs tensor)
    assert from_gguf.arch.rms_norm_eps == pytest.approx(from_hf.arch.rms_norm_eps, rel=1e-6)
    # and llama.cpp converts Mistral to arch 'llama'
    assert from_gguf.arch.architecture == ("qwen2" if family == "qwen2" else "llama")
    same = {"rms_norm_eps": 0.0, "architecture": ""}
    assert replace(from_hf.arch, **same) == replace(from_gguf.arch, **same)
    torch.testing.assert_close(rope_inv_freq(from_gguf.arch), rope_inv_freq(from_hf.arch),
                               rtol=1e-6, atol=0)
    assert from_hf.arch.vocab_size == model.config.vocab_size
    assert from_hf.arch.tie_word_embeddings == model.config.tie_word_embeddings
    assert from_hf.arch.attention_bias == (family in ("qwen2", "llama-bias"))
    assert from_hf.arch.head_dim == (32 if family == "mistral" else 16)
    assert set(from_hf.weights) == set(from_gguf.weights)
    for name, tensor in from_hf.weights.items():
        torch.testing.assert_close(from_gguf.weights[name], tensor, atol=0, rtol=0, msg=name)


# -- RoPE frequencies against transformers' own initialisers (pure) ---------------------------

def _arch(**rope) -> ModelArch:
    return ModelArch("llama", 64, 128, 2, 4, 2, 16, 300, 1e-5, rope.pop("theta"), 256, False,
                     False, rope.pop("scaling", None))


@pytest.mark.unit
@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},  # Llama-3.2's values, legacy "type" key
], ids=["default", "linear", "llama3", "llama3-3.2"])
def test_rope_inv_freq_matches_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theta = 500000.0
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=theta,
                         rope_scaling=scaling, max_position_embeddings=256)
    kind = config.rope_parameters["rope_type"]
    if kind == "default":
        dim = 16
        expected = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    else:
        expected, attention_factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
        assert attention_factor == 1.0  # loom applies no attention scaling
    torch.testing.assert_close(rope_inv_freq(_arch(theta=theta, scaling=scaling)),
                               expected.float(), rtol=1e-6, atol=0)


@pytest.mark.unit
def test_llama_cpp_rope_freq_factors_equal_llama3_scaling():
    """A GGUF's rope_freqs tensor (what llama.cpp writes for Llama-3 scaling) divides the base
    frequencies to the same values as transformers' llama3 rope type."""
    spec = TINY_SPECS["llama3"]
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=300, **spec.config)
    factors = llama3_rope_factors(config).tolist()
    scaled = rope_inv_freq(_arch(theta=500000.0, scaling=spec.config["rope_scaling"]))
    from_factors = rope_inv_freq(_arch(theta=500000.0, scaling={
        "rope_type": "freq_factors", "freq_factors": factors}))
    torch.testing.assert_close(from_factors, scaled, rtol=1e-6, atol=0)
    assert factors[0] == 1.0 and factors[-1] == 8.0 and 1.0 < factors[1] < 8.0  # all 3 regions
