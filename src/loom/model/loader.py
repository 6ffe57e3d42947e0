"""Load a model: a GGUF file or a Hugging Face folder -> architecture, weights (named as in
transformers, whatever the format: a GGUF's are renamed, and what llama.cpp's converter did to
them undone) and tokenizer. Nothing is ever downloaded.

A GGUF's weights are dequantized only when the model asks for them: with the native matmul,
only the embedding, the norms and the routers of a mixture of experts are ever needed in fp32,
a small part of the fp32 weights. A mixture's stacked expert tensors ([experts, rows, cols])
keep that shape in fp32 and are E * rows rows of blocks (model/moe.py takes them apart)."""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from loom.model.arch import ROPE_TENSORS, ModelArch, ModelLoadError, default_model_path
from loom.model.arch_gguf import arch_from_gguf
from loom.model.arch_hf import arch_from_hf_config
from loom.model.gguf_file import GGUFTensor, dequantize, read_gguf
from loom.model.model_files import tokenizer_from_gguf, tokenizer_from_hf_folder
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
    logger.info("loaded %s (%s, %d layers%s) in %.1f s", loaded.name, loaded.arch.architecture,
                loaded.arch.num_layers, _mixture(loaded.arch), time.perf_counter() - start)
    return loaded


def _mixture(arch: ModelArch) -> str:
    """What the load log says of a mixture of experts: its experts, and the weights a token
    goes through of the whole."""
    if not arch.num_experts:
        return ""
    parts = [f"{arch.num_experts} experts, {arch.num_experts_per_tok} active per token"]
    if arch.shared_expert_intermediate_size:
        parts.append("a shared expert")
    if arch.dense_layers:
        parts.append(f"{len(arch.dense_layers)} dense layers")
    parts.append(f"{_count(arch.num_active_parameters)} of {_count(arch.num_parameters)} "
                 "parameters active")
    return ", " + ", ".join(parts)


def _count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


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
    # a mixture of experts: the router, the shared expert and its gate
    "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# A mixture's stacked experts [E, N, K], named without ".weight", as transformers 5 names its
# stacked gate_up_proj and down_proj
GGUF_STACKED_EXPERTS = {
    "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_gate_up_exps": "mlp.experts.gate_up_proj", "ffn_down_exps": "mlp.experts.down_proj"}
_GGUF_NAMES |= GGUF_STACKED_EXPERTS
# Small fp32 weights a model keeps beside its quantized ones: copied out of the file map (a
# view would keep the whole file mapped, and every page loading touched resident)
_ROUTERS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")
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
    arch = arch_from_gguf(meta, {t.name: t for t in gguf_file.tensors}, path.name)
    weights = gguf_weights(gguf_file.tensors, arch)
    tokenizer = tokenizer_from_gguf(meta)
    # The file name, not general.name ("Smollm2 135M 8k ..."): it is what users pass and see.
    return LoadedModel(arch, weights.weights, tokenizer, path.stem, weights.block_quant,
                       weights.conversions)


@dataclass(frozen=True)
class GGUFWeights:
    """A GGUF's tensors by transformers' names, each made on first use: in fp32 and, for the
    kinds the native matmul reads, as blocks."""

    weights: LazyWeights[torch.Tensor]
    block_quant: LazyWeights[BlockQuantWeight]
    conversions: dict[str, int]  # how many tensors each conversion makes (requant.conversion)


def gguf_weights(tensors: Iterable[GGUFTensor], arch: ModelArch | None = None) -> GGUFWeights:
    """The tensors renamed, and what llama.cpp's converter did to them undone for the model's
    `arch` (its family's names, permuted Q/K rows, Gemma's 1 + w norms); arch None: the
    renaming alone, for a layer's tensors without their model (moe.moe_from_gguf)."""
    makers, quant_makers = {}, {}
    conversions: Counter[str] = Counter()
    family = _GGUF_FAMILY_NAMES.get(arch.architecture, {}) if arch is not None else {}
    names = {**_GGUF_NAMES, **family}
    for tensor in tensors:
        if tensor.name in ROPE_TENSORS:
            continue  # folded into arch.rope_scaling
        name = _hf_name(tensor.name, names)
        heads = _permuted_heads(tensor.name, arch) if arch is not None else None
        # the converter stored Gemma's norm weights as 1 + w (llama.cpp's graph scales by w)
        shift = arch.norm_offset if arch is not None and name.endswith("norm.weight") else 0.0
        makers[name] = lambda t=tensor, heads=heads, shift=shift: _dequantized(
            t, heads, shift, copy=t.name.endswith(_ROUTERS))
        if not _has_block_quant(tensor):
            continue
        quant_makers[name] = lambda t=tensor, heads=heads: _block_quant(t, heads)
        if tensor.kind in CONVERTED_KINDS:
            conversions[conversion(tensor.kind)] += 1
        # fp32 weights are the file's values: a converted type's blocks round some of them
        if tensor.kind in FILE_KINDS:
            makers[name] = lambda name=name, shape=tensor.shape: (
                block_quant[name].dequantize().view(shape))
    block_quant = LazyWeights(quant_makers)
    return GGUFWeights(LazyWeights(makers), block_quant, dict(conversions))


def _dequantized(tensor: GGUFTensor, heads: int | None, shift: float = 0.0,
                 copy: bool = False) -> torch.Tensor:
    """A GGUF tensor in fp32, Q/K rows un-permuted (heads given) to transformers' layout, less
    `shift` (what the converter added). A vector (a norm's weight, a bias), and what `copy`
    asks for, is copied out of the file map: the model keeps it, and a view would keep the
    whole file mapped, and every page loading touched resident."""
    array = dequantize(tensor)
    if array.ndim == 1 or copy:
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
    """A matrix (2-D) or stacked experts' matrices (3-D) of a kind the native matmul reads, as
    it is or converted (requant.py, whose compiled conversion must build: else the tensor runs
    dequantized, as a type the native matmul never reads does)."""
    return len(tensor.shape) in (2, 3) and (tensor.kind in FILE_KINDS or
                                            tensor.kind in CONVERTED_KINDS and converts_here())


def _block_quant(tensor: GGUFTensor, heads: int | None) -> BlockQuantWeight:
    """A tensor `_has_block_quant` takes as its blocks (Q4_0, Q4_1 and Q8_0: a view of the file
    map; other kinds converted), Q/K rows un-permuted (heads given); a 3-D one as its E * N
    rows."""
    rows, cols = math.prod(tensor.shape[:-1]), tensor.shape[-1]
    if tensor.kind in CONVERTED_KINDS:
        bq = native_blocks(tensor.kind, tensor.data, tensor.shape)
    else:
        bq = BlockQuantWeight(torch.from_numpy(tensor.data.reshape(rows, cols // 32, -1)),
                              tensor.kind)
    if heads is None:
        return bq
    return BlockQuantWeight(_unpermute_rope(bq.blocks, heads).contiguous(), bq.kind)


def _hf_name(gguf_name: str, names: dict[str, str] = _GGUF_NAMES) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        suffix = "" if parts[2] in GGUF_STACKED_EXPERTS else f".{parts[3]}"
        return f"model.layers.{parts[1]}.{names[parts[2]]}{suffix}"
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
