"""A sliding-window model end to end, against transformers' Mistral with `sliding_window` set
(which applies the window on every layer): a tiny random-weight model, float32, through the
real engine (chunked prefill, decodes, the sliding layers' own KV group), on the native
kernel and on the torch path; preemption by recompute; the memory a long request holds; how
the runner sizes the groups."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from model_fixtures import TinySpec, build_tiny_model, save_hf_folder

from loom.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from loom.core.batch import SlidingKVGroup
from loom.engine.core import EngineCore
from loom.model.arch import ModelInfo
from loom.model.backends import Backends
from loom.model.decoder import DecoderModel
from loom.model.kernels import fused_ops, paged_attention_ops
from loom.model.loader import load_model
from loom.model.runner import ModelRunner
from loom.outputs import RequestOutput
from loom.sampling import SamplingParams

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_torch_thread")]

WINDOW = 24  # more than a block of 16, not a multiple of it
# head_dim 64 and two query heads per kv head: shapes the native kernel takes
SPEC = TinySpec("mistral-sliding", "mistral", dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-5,
    rope_theta=10000.0, sliding_window=WINDOW, tie_word_embeddings=False, bos_token_id=0,
    eos_token_id=2), seed=11)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """(transformers' model, loom's LoadedModel with every layer a sliding one)."""
    model = build_tiny_model(SPEC)
    assert model.config.sliding_window == WINDOW
    loaded = load_model(str(save_hf_folder(model, tmp_path_factory.mktemp("mistral"))))
    # (the loader caps a windowed model's context at its window, so the context is put back)
    arch = replace(loaded.arch, layer_types=("sliding_attention",) * loaded.arch.num_layers,
                   sliding_window=WINDOW,
                   max_position_embeddings=model.config.max_position_embeddings)
    return model, replace(loaded, arch=arch)


def engine_for(loaded, native: bool, num_blocks: int = 64, max_num_batched_tokens: int = 40,
               max_num_seqs: int = 4) -> EngineCore:
    """The real engine over loom's model of `loaded`, float32 with an fp32 KV cache."""
    if native and paged_attention_ops() is None:
        pytest.skip("no C++ compiler for the kernels")
    cpu, ops = torch.device("cpu"), fused_ops()
    model = DecoderModel(loaded.arch, loaded.weights, torch.float32, cpu, fused_ops=ops)
    backends = Backends(device=cpu, dtype=torch.float32, kv_dtype=torch.float32, num_threads=0,
                        native_decode=native, linear="torch", fused_ops=ops)
    info = ModelInfo(loaded.name, loaded.tokenizer, loaded.arch.vocab_size,
                     loaded.arch.max_position_embeddings)
    runner = ModelRunner(model, backends, block_size=16, info=info)
    return EngineCore(EngineConfig(
        model=ModelConfig(max_model_len=512),
        cache=CacheConfig(block_size=16, num_kv_blocks=num_blocks, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                  max_num_seqs=max_num_seqs)), runner=runner)


def prompt(length: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def run(engine: EngineCore, prompts: dict[str, list[int]], max_tokens: int,
        **params) -> dict[str, RequestOutput]:
    for request_id, ids in prompts.items():
        engine.add_request(request_id, ids, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                           ignore_eos=True, **params))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step()[0] if o.finished)
    return finished


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_logits_match_transformers_over_several_windows(mistral, native: bool) -> None:
    """A prompt of 150 tokens (six windows) in chunks of 40, then 40 greedy decodes: every
    position's logits (prompt positions through prompt_logprobs, which makes the runner
    compute them) against transformers' on the whole sequence. The sliding group holds a
    window's blocks throughout, not the context's."""
    model, loaded = mistral
    engine = engine_for(loaded, native)
    kv = engine.kv_cache
    assert kv.sliding is not None and kv.sliding.window == WINDOW
    captured: list[torch.Tensor] = []
    compute_logits = engine.runner.model.compute_logits
    engine.runner.model.compute_logits = lambda hidden: captured.append(
        compute_logits(hidden).float()) or captured[-1]
    ids = prompt(150, seed=1, vocab=model.config.vocab_size)
    engine.add_request("r", ids, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                prompt_logprobs=0))
    most_held, output = 0, None
    while engine.has_unfinished_requests():
        outputs = engine.step()[0]
        most_held = max(most_held, kv.sliding_pool.num_blocks - kv.sliding_pool.num_free_blocks)
        output = outputs[-1] if outputs else output
    tokens = ids + output.outputs[0].token_ids
    actual = torch.cat(captured)  # positions 0 .. len(tokens) - 2, in order
    with torch.no_grad():
        expected = model(torch.tensor([tokens[:-1]])).logits[0].float()
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=2e-3, rtol=0)
    # a window of 24 spans 3 blocks; a chunk of 40 tokens adds 3 more
    assert most_held <= 6
    assert len(tokens) > 7 * WINDOW


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_a_preempted_sliding_request_gives_the_same_greedy_tokens(mistral,
                                                                   native: bool) -> None:
    """Three requests that outgrow 20 full blocks together: the latest is preempted (both
    groups freed) and recomputed, and each gives the tokens it gives alone."""
    _, loaded = mistral
    vocab = loaded.arch.vocab_size
    prompts = {f"r{i}": prompt(90 + 10 * i, seed=10 + i, vocab=vocab) for i in range(3)}
    alone = {request_id: run(engine_for(loaded, native), {request_id: ids}, 40)
             for request_id, ids in prompts.items()}
    engine = engine_for(loaded, native, num_blocks=20)
    together = run(engine, prompts, 40)
    assert engine.scheduler.num_preemptions >= 1
    for request_id, outputs in alone.items():
        assert (together[request_id].outputs[0].token_ids
                == outputs[request_id].outputs[0].token_ids)
    sliding = engine.kv_cache.sliding_pool
    assert sliding.num_free_blocks == sliding.num_blocks


def test_the_runner_sizes_both_groups_from_the_budget_and_says_so(mistral, caplog) -> None:
    """Every layer sliding: the budget is the sliding pool's (the full group is bookkeeping),
    the tensors are as large as the layout says, and the start-up log names both groups."""
    _, loaded = mistral
    runner = engine_for(loaded, native=False).runner
    scheduler = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8)
    with caplog.at_level("INFO", logger="loom.model.runner"):
        num_blocks = runner.determine_num_kv_blocks(CacheConfig(kv_cache_memory="64MiB"), 512,
                                                    scheduler)
    group = runner.initialize_kv_cache(num_blocks)
    assert num_blocks == 8 * 512 // 16  # max_num_seqs requests of max_model_len
    assert group.window == WINDOW
    assert group.num_blocks == SlidingKVGroup.blocks_needed(WINDOW, 16, 8, 64)  # all it needs
    assert all(k.shape[0] == group.num_blocks + 1 for k, _ in runner.kv_caches)  # + null block
    assert "sliding-window layers (window 24)" in caplog.text
