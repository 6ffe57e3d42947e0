"""A model-shaped GGUF with random weights, for measuring what depends on a model's size only
(loading, conversion, start-up, memory, the step's kernels) at sizes no bundled file has: the
tokenizer and settings of a reference GGUF, the architecture's sizes from the flags, F16
weights drawn from N(0, 0.02) (norms 1). Quantize it with llama.cpp's `llama-quantize` to the
type to measure. Its text is noise. Architectures: `llama` (a dense Llama/SmolLM), `qwen3`
(Llama with per-head q/k norms), `gemma3` (per-head q/k norms, norms after attention and MLP
too, `--window`-wide sliding layers five in every six, as llama.cpp's graph lays them out
where a file names no pattern), and three mixtures of experts, `qwen3moe` (Qwen3-MoE:
per-head q/k norms, experts expert_feed_forward_length wide), `olmoe` (OLMoE: q/k norms over
the whole projections, experts feed_forward_length wide) and `mixtral` (llama.cpp's `llama`
with experts, feed_forward_length wide). None of the three has a shared expert. Tensors are
made and written one at a time, so memory holds one tensor, not the model. Run from the
repository root; the reference here is the bundled model (`python -c "from loom.model.arch
import default_model_path; print(default_model_path())"`), whose vocabulary the file takes
(any GGUF with a tokenizer will do, a vocab-only one too; `--chat-template FILE` replaces its
template).

SmolLM2-1.7B's shape:

    python benchmarks/synthetic_gguf.py --reference smollm2-135m-f16.gguf \\
        --hidden 2048 --ffn 8192 --layers 24 --heads 32 --kv-heads 32 --out big-f16.gguf
    llama-quantize big-f16.gguf big-Q4_K_M.gguf Q4_K_M

Qwen3-30B-A3B's shape (128 experts, 8 a token, 768 wide: about 30B weights, 60 GB in F16;
`--layers 12` makes a quarter of it, every layer the same shape):

    python benchmarks/synthetic_gguf.py --arch qwen3moe --reference $REF \\
        --hidden 2048 --ffn 6144 --layers 48 --heads 32 --kv-heads 4 --head-dim 128 \\
        --experts 128 --experts-used 8 --expert-ffn 768 --out qwen3moe-f16.gguf
    llama-quantize qwen3moe-f16.gguf qwen3moe-Q4_K_M.gguf Q4_K_M

OLMoE-1B-7B's shape (64 experts, 8 a token, 1024 wide: about 7B weights, 14 GB in F16):

    python benchmarks/synthetic_gguf.py --arch olmoe --reference $REF \\
        --hidden 2048 --ffn 1024 --layers 16 --heads 16 --kv-heads 16 \\
        --experts 64 --experts-used 8 --expert-ffn 1024 --out olmoe-f16.gguf
    llama-quantize olmoe-f16.gguf olmoe-Q4_K_M.gguf Q4_K_M

`--q4-k-m` skips the F16 file and llama-quantize (for a dense 8B shape: a 16 GB file and half an
hour of both cores on the Zen 4): it writes random Q4_K_M blocks directly, in the types
llama-quantize's Q4_K_M gives each tensor (`q4_k_m_type`), stacked experts too, so both servers
read the bytes and run the kernels a quantized model of the shape would; the weights are the
blocks' random codes under small fixed scales, not a quantized Gaussian. Qwen3-8B's shape
(4.3 GB) in 23 s on the Zen 4:

    python benchmarks/synthetic_gguf.py --arch qwen3 --reference $REF --q4-k-m \\
        --hidden 4096 --ffn 12288 --layers 36 --heads 32 --kv-heads 8 --head-dim 128 \\
        --out qwen3-8b-Q4_K_M.gguf

Qwen3-30B-A3B's shape with 32 experts instead of 128 (the same 8 a token and active size;
128 would be an 18 GB file that loom, reading Q4_K as Q4_1 and Q6_K as Q8_0, holds in ~20 GB):

    python benchmarks/synthetic_gguf.py --arch qwen3moe --reference $REF --q4-k-m \\
        --hidden 2048 --ffn 6144 --layers 48 --heads 32 --kv-heads 4 --head-dim 128 \\
        --experts 32 --experts-used 8 --expert-ffn 768 --out qwen3moe-32e-Q4_K_M.gguf

llama.cpp loads both: llama-quantize as above, then `llama-perplexity -m X-Q4_K_M.gguf -f
text.txt -c 128 --chunks 2 -nr` (`-nr`: llama.cpp's repacking for AMX crashed at start-up on the
AMX Xeon, for a dense file too) ran on a small shape of each; loom reads their expert
tensors, Q4_K with Q6_K in the downs of some layers, with `loom.model.moe.moe_from_gguf`.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from loom.model.gguf_file import read_gguf

ARCHITECTURES = ("llama", "qwen3", "gemma3", "qwen3moe", "olmoe", "mixtral")
MIXTURES = ("qwen3moe", "olmoe", "mixtral")
FFN_WIDE_EXPERTS = ("olmoe", "mixtral")  # experts feed_forward_length wide
GGUF_ARCHITECTURES = {"mixtral": "llama"}  # llama.cpp's name where it is not the flag's
HEAD_NORMED = ("qwen3", "gemma3", "qwen3moe")  # RMSNorm over each head's q and k
# The reference's architecture keys the file takes over (renamed); the others describe the
# reference's own shape and family (a Gemma 4 vocabulary's experts, per-layer head counts)
CARRIED_KEYS = ("context_length", "rope.freq_base", "attention.layer_norm_rms_epsilon")
GGUF_FILE_TYPE_F16 = 1  # general.file_type: mostly F16
GGUF_FILE_TYPE_Q4_K_M = 15  # general.file_type: llama-quantize's Q4_K_M
QType = gguf.GGMLQuantizationType
Q4_K, Q5_K, Q6_K, Q8_0 = QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.Q8_0


@dataclass(frozen=True)
class Shape:
    arch: str
    hidden: int
    ffn: int  # the dense MLP's width (OLMoE's and Mixtral's: their experts')
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0
    window: int = 0  # gemma3: the sliding layers' window

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"--arch must be one of {ARCHITECTURES}, got {self.arch!r}")
        moe = self.arch in MIXTURES
        if moe and not 1 <= self.experts_used <= self.experts:
            raise ValueError("--experts and --experts-used (1 .. --experts) are needed for "
                             f"{self.arch}")
        if moe and self.expert_ffn < 1:
            raise ValueError(f"--expert-ffn is needed for {self.arch}")
        if self.arch in FFN_WIDE_EXPERTS and self.expert_ffn != self.ffn:
            raise ValueError(f"{self.arch}'s experts are feed_forward_length wide: --ffn must "
                             "equal --expert-ffn")
        if not moe and self.experts:
            raise ValueError(f"{self.arch} has no experts: drop --experts")
        if (self.arch == "gemma3") != (self.window > 0):
            raise ValueError("--window is for gemma3, and needed there")


def metadata(shape: Shape) -> dict[str, int]:
    """The architecture's integer keys, by their GGUF names."""
    keys = {"embedding_length": shape.hidden, "feed_forward_length": shape.ffn,
            "block_count": shape.layers, "attention.head_count": shape.heads,
            "attention.head_count_kv": shape.kv_heads, "rope.dimension_count": shape.head_dim,
            "attention.key_length": shape.head_dim, "attention.value_length": shape.head_dim}
    if shape.arch in MIXTURES:
        keys |= {"expert_count": shape.experts, "expert_used_count": shape.experts_used,
                 "expert_feed_forward_length": shape.expert_ffn}
    if shape.window:
        keys["attention.sliding_window"] = shape.window
    return {f"{gguf_arch(shape.arch)}.{key}": value for key, value in keys.items()}


def gguf_arch(arch: str) -> str:
    """The file's general.architecture for the flag's `arch`."""
    return GGUF_ARCHITECTURES.get(arch, arch)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # numpy order: rows first
    kind: str  # "matrix" (F16, random), "router" (F32, random) or "norm" (F32, ones)


def tensor_specs(shape: Shape, vocab: int) -> list[TensorSpec]:
    """Every tensor llama.cpp's loader of the architecture asks for, in its names."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    specs = [TensorSpec("token_embd.weight", (vocab, h), "matrix"),
             TensorSpec("output_norm.weight", (h,), "norm")]
    if shape.arch in MIXTURES:  # each has an output layer of its own
        specs.append(TensorSpec("output.weight", (vocab, h), "matrix"))
    for layer in range(shape.layers):
        block = f"blk.{layer}."
        specs += [TensorSpec(block + norm + ".weight", (h,), "norm")
                  for norm in ("attn_norm", "ffn_norm")]
        specs += [TensorSpec(block + name + ".weight", dims, "matrix") for name, dims in (
            ("attn_q", (q, h)), ("attn_k", (kv, h)), ("attn_v", (kv, h)),
            ("attn_output", (h, q)))]
        if shape.arch in HEAD_NORMED:
            specs += [TensorSpec(block + f"attn_{x}_norm.weight", (shape.head_dim,), "norm")
                      for x in "qk"]
        if shape.arch == "gemma3":  # the attention's and the MLP's outputs normed too
            specs += [TensorSpec(block + norm + ".weight", (h,), "norm")
                      for norm in ("post_attention_norm", "post_ffw_norm")]
        elif shape.arch == "olmoe":  # RMSNorm over the whole projection
            specs += [TensorSpec(block + "attn_q_norm.weight", (q,), "norm"),
                      TensorSpec(block + "attn_k_norm.weight", (kv,), "norm")]
        if shape.arch in MIXTURES:
            e, i = shape.experts, shape.expert_ffn
            specs += [TensorSpec(block + "ffn_gate_inp.weight", (e, h), "router"),
                      TensorSpec(block + "ffn_gate_exps.weight", (e, i, h), "matrix"),
                      TensorSpec(block + "ffn_up_exps.weight", (e, i, h), "matrix"),
                      TensorSpec(block + "ffn_down_exps.weight", (e, h, i), "matrix")]
        else:
            specs += [TensorSpec(block + name + ".weight", dims, "matrix") for name, dims in (
                ("ffn_gate", (shape.ffn, h)), ("ffn_up", (shape.ffn, h)),
                ("ffn_down", (h, shape.ffn)))]
    return specs


def use_more_bits(layer: int, layers: int) -> bool:
    """llama-quantize's pick of the layers whose attn_v and ffn_down Q4_K_M gives Q6_K: the
    first and last eighth, and every third layer between."""
    return (layer < layers // 8 or layer >= 7 * layers // 8
            or (layer - layers // 8) % 3 == 2)


def q4_k_m_type(name: str, shape: Shape) -> gguf.GGMLQuantizationType:
    """The type llama-quantize's Q4_K_M gives a matrix of this writer's files
    (llama_tensor_get_type_impl in llama.cpp's src/llama-quant.cpp): Q6_K for the output
    layer, and for the token embeddings where they are tied to it (the dense architectures
    here), else Q4_K; Q6_K for attn_v and every ffn_down (ffn_down_exps too) in the layers
    use_more_bits picks; with exactly 8 experts (Mixtral) attn_v and attn_k Q8_0 and
    attn_output Q5_K; Q4_K elsewhere, the experts' gate and up among them. (The router,
    ffn_gate_inp, is never quantized: F32.)"""
    if name == "output.weight" or (name == "token_embd.weight"
                                   and shape.arch not in MIXTURES):
        return Q6_K
    parts = name.split(".")
    if parts[0] != "blk":
        return Q4_K
    kind, more_bits = parts[2], use_more_bits(int(parts[1]), shape.layers)
    if shape.experts == 8 and kind in ("attn_v", "attn_k"):
        return Q8_0
    if shape.experts == 8 and kind == "attn_output":
        return Q5_K
    if more_bits and (kind == "attn_v" or kind.startswith("ffn_down")):
        return Q6_K
    return Q4_K


def random_blocks(rng: np.random.Generator, rows: int, cols: int,
                  qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """`rows` x `cols` weights as random `qtype` blocks (uint8, a row of blocks a row): random
    codes, fixed fp16 scales small enough that the weights are about N(0, 0.02)'s size and
    centred (Q4_K and Q5_K: d * sc * q - dmin * m with q in 0..15 or 0..31, sc and m in
    0..63; Q6_K: d * sc * (q - 32) with int8 sub-block scales drawn from -16..16; Q8_0: d * q,
    q an int8)."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // block, nbytes), dtype=np.uint8)
    if qtype == Q4_K:  # d, dmin, 12 bytes of 6-bit scales and mins, 128 of codes
        blocks[:, :4] = np.array([7.5e-5, 5.5e-4], np.float16).view(np.uint8)
    elif qtype == Q5_K:  # as Q4_K, then 32 bytes of the codes' high bits
        blocks[:, :4] = np.array([3.75e-5, 5.5e-4], np.float16).view(np.uint8)
    elif qtype == Q8_0:  # d, 32 int8 codes
        blocks[:, :2] = np.array([2.7e-4], np.float16).view(np.uint8)
    else:  # Q6_K: 128 bytes of low bits, 64 of high bits, 16 int8 scales, d
        blocks[:, 192:208] = rng.integers(-16, 17, (len(blocks), 16), dtype=np.int8).view(
            np.uint8)
        blocks[:, 208:] = np.array([1.1e-4], np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def copy_settings(reference: Mapping[str, Any], writer: gguf.GGUFWriter, arch: str,
                  sizes: dict[str, int], chat_template: str | None = None) -> None:
    """Every key-value of `reference` (a header's metadata) but its architecture, which `arch`
    replaces in the CARRIED_KEYS named after it (its other architecture keys are left out), the
    sizes, which `sizes` gives, and its chat template where `chat_template` replaces it. Each
    value is written in the type llama.cpp's converter gives it: integers UINT32 (INT32 in
    arrays, as token types are), floats FLOAT32."""
    reference_arch = reference["general.architecture"]
    for name, value in reference.items():
        if name == "general.architecture":
            continue
        if name.startswith(reference_arch + "."):
            if name[len(reference_arch) + 1:] not in CARRIED_KEYS:
                continue
            name = arch + name[len(reference_arch):]
        if name in sizes or (chat_template is not None and name == "tokenizer.chat_template"):
            continue
        if isinstance(value, list):
            writer.add_array(name, value)
        elif isinstance(value, bool):
            writer.add_bool(name, value)
        elif isinstance(value, int):
            writer.add_uint32(name, value)
        elif isinstance(value, float):
            writer.add_float32(name, value)
        else:
            writer.add_string(name, value)
    for name, value in sizes.items():
        writer.add_uint32(name, value)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


def add_tensor_info(writer: gguf.GGUFWriter, spec: TensorSpec, shape: Shape,
                    q4_k_m: bool) -> None:
    """`spec`'s entry in the header: F16 (a random matrix), F32, or its Q4_K_M block type
    (a stacked expert tensor [E, N, K] as E * N rows of blocks)."""
    if q4_k_m and spec.kind == "matrix":
        qtype = q4_k_m_type(spec.name, shape)
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        byte_shape = (*spec.shape[:-1], spec.shape[-1] // block * nbytes)
        writer.add_tensor_info(spec.name, byte_shape, np.dtype(np.uint8),
                               int(np.prod(byte_shape)), raw_dtype=qtype)
        return
    dtype = np.dtype(np.float16 if spec.kind == "matrix" else np.float32)
    writer.add_tensor_info(spec.name, spec.shape, dtype, int(np.prod(spec.shape)) * dtype.itemsize)


def write(shape: Shape, reference: str | Mapping[str, Any], out: str, seed: int = 0,
          chat_template: str | None = None, q4_k_m: bool = False) -> None:
    """`reference`: a GGUF's path, or its header's metadata (a vocabulary amended first).
    `q4_k_m`: random Q4_K_M blocks (every width a multiple of 256, the K-quants' block)
    instead of F16 weights."""
    widths = (shape.hidden, shape.ffn, shape.heads * shape.head_dim, shape.expert_ffn)
    if q4_k_m and any(width % 256 for width in widths):
        raise ValueError(f"--q4-k-m writes widths that are multiples of 256, not {shape}")
    if isinstance(reference, str):
        reference = read_gguf(Path(reference)).metadata
    vocab = len(reference["tokenizer.ggml.tokens"])
    writer = gguf.GGUFWriter(out, gguf_arch(shape.arch))
    file_type = GGUF_FILE_TYPE_Q4_K_M if q4_k_m else GGUF_FILE_TYPE_F16
    copy_settings(reference, writer, gguf_arch(shape.arch),
                  {**metadata(shape), "general.file_type": file_type}, chat_template)
    specs = tensor_specs(shape, vocab)
    for spec in specs:
        add_tensor_info(writer, spec, shape, q4_k_m)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for spec in specs:
        if spec.kind == "norm":
            writer.write_tensor_data(np.ones(spec.shape, np.float32))
            continue
        if q4_k_m and spec.kind == "matrix":
            blocks = random_blocks(rng, int(np.prod(spec.shape[:-1])), spec.shape[-1],
                                   q4_k_m_type(spec.name, shape))
            writer.write_tensor_data(blocks.reshape(*spec.shape[:-1], -1))
            continue
        weights = rng.standard_normal(spec.shape, dtype=np.float32) * 0.02
        writer.write_tensor_data(weights.astype(np.float16) if spec.kind == "matrix"
                                 else weights)
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", required=True,
                        help="a GGUF whose tokenizer and settings the file takes")
    parser.add_argument("--arch", default="llama", choices=ARCHITECTURES)
    parser.add_argument("--hidden", type=int, required=True)
    parser.add_argument("--ffn", type=int, required=True,
                        help="the dense MLP's width (olmoe, mixtral: their experts')")
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--heads", type=int, required=True)
    parser.add_argument("--kv-heads", type=int, required=True)
    parser.add_argument("--head-dim", type=int, help="default: --hidden / --heads")
    parser.add_argument("--experts", type=int, default=0, help="experts per layer (MoE)")
    parser.add_argument("--experts-used", type=int, default=0, help="experts a token takes")
    parser.add_argument("--expert-ffn", type=int, default=0, help="an expert's width")
    parser.add_argument("--window", type=int, default=0,
                        help="gemma3: the sliding layers' window")
    parser.add_argument("--chat-template", help="a Jinja file replacing the reference's template")
    parser.add_argument("--q4-k-m", action="store_true",
                        help="random Q4_K_M blocks instead of F16 weights")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    try:
        shape = Shape(args.arch, args.hidden, args.ffn, args.layers, args.heads, args.kv_heads,
                      args.head_dim or args.hidden // args.heads, args.experts,
                      args.experts_used, args.expert_ffn, args.window)
    except ValueError as e:
        parser.error(str(e))
    template = None if args.chat_template is None else Path(args.chat_template).read_text()
    try:
        write(shape, args.reference, args.out, chat_template=template, q4_k_m=args.q4_k_m)
    except ValueError as e:
        parser.error(str(e))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
