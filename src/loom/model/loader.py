"""Load a model: a GGUF file or a Hugging Face folder -> architecture, weights (named as in
transformers, whatever the format: a GGUF's are renamed, and what llama.cpp's converter did to
them undone) and tokenizer. Nothing is ever downloaded.

A GGUF's weights are dequantized only when the model asks for them: with the native matmul,
only the embedding and the norms are ever needed in fp32, a small part of the fp32 weights."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from loom.model.arch import (
    ROPE_TENSORS,
    ModelArch,
    ModelLoadError,
    arch_from_gguf,
    arch_from_hf_config,
    default_model_path,
    tokenizer_from_gguf,
    tokenizer_from_hf_folder,
)
from loom.model.gguf_file import GGUFTensor, dequantize, read_gguf
from loom.model.requant import (
    CONVERTED_KINDS,
    FILE_KINDS,
    conversion,
    converts_here,
    native_blocks,
)
from loom.model.weights import BlockQuantWeight, LazyWeights, LoadedModel

logger = logging.getLogger(__name__)

Array = TypeVar("Array", np.ndarray, torch.Tensor)


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
    "attn_qkv": "self_attn.qkv_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Where a family's GGUF name means another of transformers' tensors: Gemma's ffn_norm is the
# MLP's input norm (its post_attention_layernorm is the attention output's); Phi-3's ffn_up
# holds gate and up stacked, as its checkpoint's gate_up_proj does.
_GGUF_FAMILY_NAMES = {
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm"},
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm"},
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
}
# GGUF architectures whose Q/K rows llama.cpp's converter permuted (LlamaModel.undo_permute:
# interleaved RoPE in llama.cpp's graph)
_PERMUTED_QK = ("llama", "smollm3")


def _unpermute_rope(w: Array, num_heads: int) -> Array:
    """Undo llama.cpp's conversion-time Q/K row permutation (interleaved -> half-split RoPE)."""
    rows = w.shape[0]
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _load_gguf(path: Path) -> LoadedModel:
    gguf_file = read_gguf(path)
    meta = gguf_file.metadata
    tensors = {t.name: t for t in gguf_file.tensors}
    arch = arch_from_gguf(meta, tensors, path.name)
    makers, quant_makers, quant_shapes = {}, {}, {}
    conversions: Counter[str] = Counter()
    names = {**_GGUF_NAMES, **_GGUF_FAMILY_NAMES.get(arch.architecture, {})}
    for tensor in gguf_file.tensors:
        if tensor.name in ROPE_TENSORS:
            continue  # folded into arch.rope_scaling above
        name, heads = _hf_name(tensor.name, names), _permuted_heads(tensor.name, arch)
        # the converter stored Gemma's norm weights as 1 + w (llama.cpp's graph scales by w)
        shift = arch.norm_offset if name.endswith("norm.weight") else 0.0
        makers[name] = lambda t=tensor, heads=heads, shift=shift: _dequantized(t, heads, shift)
        if not _has_block_quant(tensor):
            continue
        quant_makers[name] = lambda t=tensor, heads=heads: _block_quant(t, heads)
        quant_shapes[name] = tuple(tensor.shape)
        if tensor.kind in CONVERTED_KINDS:
            conversions[conversion(tensor.kind)] += 1
        # fp32 weights are the file's values: a converted type's blocks round some of them
        if tensor.kind in FILE_KINDS:
            makers[name] = lambda name=name: block_quant[name].dequantize()
    block_quant = LazyWeights(quant_makers)

    tokenizer = tokenizer_from_gguf(meta)
    # The file name, not general.name ("Smollm2 135M 8k ..."): it is what users pass and see.
    return LoadedModel(arch, LazyWeights(makers), tokenizer, path.stem, block_quant,
                       quant_shapes, dict(conversions))


def _dequantized(tensor: GGUFTensor, heads: int | None, shift: float = 0.0) -> torch.Tensor:
    """A GGUF tensor in fp32, Q/K rows un-permuted (heads given) to transformers' layout, less
    `shift` (what the converter added). A vector (a norm's weight, a bias) is copied out of the
    file map: the model keeps it, and a view would keep the whole file mapped, and every page
    loading touched resident."""
    array = dequantize(tensor)
    if array.ndim == 1:
        array = array - shift if shift else array.copy()
    if heads is not None:
        array = _unpermute_rope(array, heads)
    return torch.from_numpy(np.ascontiguousarray(array))


def _permuted_heads(name: str, arch: ModelArch) -> int | None:
    """The head count of a Q or K tensor whose rows llama.cpp permuted (_PERMUTED_QK)."""
    if arch.architecture not in _PERMUTED_QK:
        return None
    if name.endswith(("attn_q.weight", "attn_q.bias")):
        return arch.num_heads
    if name.endswith(("attn_k.weight", "attn_k.bias")):
        return arch.num_kv_heads
    return None


def _has_block_quant(tensor: GGUFTensor) -> bool:
    """A 2-D tensor of a kind the native matmul reads, as it is or converted (requant.py,
    whose compiled conversion must build: else the tensor runs dequantized, as a type the
    native matmul never reads does)."""
    return len(tensor.shape) == 2 and (tensor.kind in FILE_KINDS
                                       or tensor.kind in CONVERTED_KINDS and converts_here())


def _block_quant(tensor: GGUFTensor, heads: int | None) -> BlockQuantWeight:
    """A tensor `_has_block_quant` takes as its blocks (Q4_0, Q4_1 and Q8_0: a view of the file
    map; other kinds converted), Q/K rows un-permuted (heads given)."""
    rows, cols = tensor.shape
    if tensor.kind in CONVERTED_KINDS:
        bq = native_blocks(tensor.kind, tensor.data, (rows, cols))
    else:
        bq = BlockQuantWeight(torch.from_numpy(tensor.data.reshape(rows, cols // 32, -1)),
                              tensor.kind)
    if heads is None:
        return bq
    return BlockQuantWeight(_unpermute_rope(bq.blocks, heads).contiguous(), bq.kind)


def _hf_name(gguf_name: str, names: dict[str, str] = _GGUF_NAMES) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    return f"{names[parts[0]]}.{parts[1]}"


# -- Hugging Face folder -----------------------------------------------------------------------

def _load_hf_folder(path: Path) -> LoadedModel:
    from safetensors.torch import load_file

    config_path = path / "config.json"
    if not config_path.exists():
        raise ModelLoadError(f"{str(path)!r} has no config.json")
    config = json.loads(config_path.read_text())
    arch = arch_from_hf_config(config)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{str(path)!r} has no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(str(file)))
    return LoadedModel(arch, weights, tokenizer_from_hf_folder(path, config), path.name)
