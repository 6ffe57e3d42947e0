"""A model-shaped GGUF with random weights, for measuring what depends on a model's size only
(loading, conversion, start-up, memory, the step's kernels) at sizes no bundled file has: the
tokenizer and settings of a reference GGUF, the architecture's sizes from the flags, F16
weights drawn from N(0, 0.02) (norms 1). Quantize it with llama.cpp's `llama-quantize` to the
type to measure. Its text is noise. Architectures: `llama` (a dense Llama/SmolLM), `qwen3`
(Llama's with per-head q/k norms and an output layer of its own), `gemma3` (Gemma 3: per-head
q/k norms, norms after attention and MLP too, `--sliding-window` positions in five layers of
six, tied embeddings), and two mixtures of experts, `qwen3moe` (Qwen3-MoE: per-head q/k
norms, experts expert_feed_forward_length wide) and `olmoe` (OLMoE: q/k norms over the whole
projections, experts feed_forward_length wide). Tensors are made and written one at a time,
so memory holds one tensor, not the model. Run from the repository root; the reference here is the
bundled model (`python -c "from loom.model.arch import default_model_path;
print(default_model_path())"`), whose vocabulary the file takes (any GGUF with a tokenizer
will do, a vocab-only one too).

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

Qwen3-8B's and Gemma-3-4B's (the latter's window 1024):

    python benchmarks/synthetic_gguf.py --arch qwen3 --reference $REF --hidden 4096 \
        --ffn 12288 --layers 36 --heads 32 --kv-heads 8 --head-dim 128 --out qwen3-f16.gguf
    python benchmarks/synthetic_gguf.py --arch gemma3 --reference $REF --hidden 2560 \
        --ffn 10240 --layers 34 --heads 8 --kv-heads 4 --head-dim 256 \
        --sliding-window 1024 --out gemma3-f16.gguf

llama.cpp loads the mixtures: llama-quantize as above, then `llama-perplexity -m X-Q4_K_M.gguf -f
text.txt -c 128 --chunks 2 -nr` (`-nr`: llama.cpp's repacking for AMX crashed at start-up on the
AMX Xeon, for a dense file too) ran on a small shape of each; loom reads their expert
tensors, Q4_K with Q6_K in the downs of some layers, with `loom.model.moe.moe_from_gguf`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import gguf
import numpy as np

ARCHITECTURES = ("llama", "qwen3", "gemma3", "qwen3moe", "olmoe")
MIXTURES = ("qwen3moe", "olmoe")
HEAD_NORMS = ("qwen3", "gemma3", "qwen3moe")  # an RMSNorm per head on q and k
OWN_OUTPUT = ("qwen3", "qwen3moe", "olmoe")  # an output layer, not the embeddings tied
GGUF_FILE_TYPE_F16 = 1  # general.file_type: mostly F16


@dataclass(frozen=True)
class Shape:
    arch: str
    hidden: int
    ffn: int  # the dense MLP's width (OLMoE: its experts')
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0
    sliding_window: int = 0  # gemma3's sliding layers' window

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"--arch must be one of {ARCHITECTURES}, got {self.arch!r}")
        moe = self.arch in MIXTURES
        if moe and not 1 <= self.experts_used <= self.experts:
            raise ValueError("--experts and --experts-used (1 .. --experts) are needed for "
                             f"{self.arch}")
        if moe and self.expert_ffn < 1:
            raise ValueError(f"--expert-ffn is needed for {self.arch}")
        if self.arch == "olmoe" and self.expert_ffn != self.ffn:
            raise ValueError("olmoe's experts are feed_forward_length wide: --ffn must equal "
                             "--expert-ffn")
        if not moe and self.experts:
            raise ValueError(f"{self.arch} has no experts: drop --experts")
        if (self.arch == "gemma3") != (self.sliding_window > 0):
            raise ValueError("--sliding-window (positive) is gemma3's, and needed for it")


def metadata(shape: Shape) -> dict[str, int]:
    """The architecture's integer keys, by their GGUF names."""
    keys = {"embedding_length": shape.hidden, "feed_forward_length": shape.ffn,
            "block_count": shape.layers, "attention.head_count": shape.heads,
            "attention.head_count_kv": shape.kv_heads, "rope.dimension_count": shape.head_dim,
            "attention.key_length": shape.head_dim, "attention.value_length": shape.head_dim}
    if shape.arch in MIXTURES:
        keys |= {"expert_count": shape.experts, "expert_used_count": shape.experts_used,
                 "expert_feed_forward_length": shape.expert_ffn}
    if shape.sliding_window:
        keys["attention.sliding_window"] = shape.sliding_window
    return {f"{shape.arch}.{key}": value for key, value in keys.items()}


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
    if shape.arch in OWN_OUTPUT:
        specs.append(TensorSpec("output.weight", (vocab, h), "matrix"))
    for layer in range(shape.layers):
        block = f"blk.{layer}."
        specs += [TensorSpec(block + norm + ".weight", (h,), "norm")
                  for norm in ("attn_norm", "ffn_norm")]
        specs += [TensorSpec(block + name + ".weight", dims, "matrix") for name, dims in (
            ("attn_q", (q, h)), ("attn_k", (kv, h)), ("attn_v", (kv, h)),
            ("attn_output", (h, q)))]
        if shape.arch == "gemma3":
            specs += [TensorSpec(block + norm + ".weight", (h,), "norm")
                      for norm in ("post_attention_norm", "post_ffw_norm")]
        if shape.arch in HEAD_NORMS:
            specs += [TensorSpec(block + f"attn_{x}_norm.weight", (shape.head_dim,), "norm")
                      for x in "qk"]
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


def copy_settings(reference: gguf.GGUFReader, writer: gguf.GGUFWriter, arch: str,
                  sizes: dict[str, int]) -> None:
    """Every key-value of `reference` but its architecture, which `arch` replaces in the keys
    named after it, and the sizes, which `sizes` gives."""
    arch_field = reference.fields["general.architecture"]
    reference_arch = bytes(arch_field.parts[arch_field.data[0]]).decode()
    for field in reference.fields.values():
        name = field.name
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name.startswith(reference_arch + "."):
            name = arch + name[len(reference_arch):]
        if name in sizes:
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            values = [field.parts[i] for i in field.data]
            if field.types[-1] == gguf.GGUFValueType.STRING:
                writer.add_array(name, [bytes(v).decode("utf-8", "replace") for v in values])
            else:
                writer.add_array(name, [v.tolist()[0] for v in values])
        elif field.types[0] == gguf.GGUFValueType.STRING:
            writer.add_string(name, bytes(field.parts[field.data[0]]).decode())
        else:
            writer.add_key_value(name, field.parts[field.data[0]].tolist()[0], field.types[0])
    for name, value in sizes.items():
        writer.add_uint32(name, value)


def write(shape: Shape, reference_path: str, out: str, seed: int = 0) -> None:
    reference = gguf.GGUFReader(reference_path)
    vocab = len(reference.fields["tokenizer.ggml.tokens"].data)
    writer = gguf.GGUFWriter(out, shape.arch)
    copy_settings(reference, writer, shape.arch,
                  {**metadata(shape), "general.file_type": GGUF_FILE_TYPE_F16})
    specs = tensor_specs(shape, vocab)
    for spec in specs:
        dtype = np.float16 if spec.kind == "matrix" else np.float32
        writer.add_tensor_info(spec.name, spec.shape, np.dtype(dtype),
                               int(np.prod(spec.shape)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for spec in specs:
        if spec.kind == "norm":
            writer.write_tensor_data(np.ones(spec.shape, np.float32))
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
                        help="the dense MLP's width (olmoe: its experts')")
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--heads", type=int, required=True)
    parser.add_argument("--kv-heads", type=int, required=True)
    parser.add_argument("--head-dim", type=int, help="default: --hidden / --heads")
    parser.add_argument("--experts", type=int, default=0, help="experts per layer (MoE)")
    parser.add_argument("--experts-used", type=int, default=0, help="experts a token takes")
    parser.add_argument("--expert-ffn", type=int, default=0, help="an expert's width")
    parser.add_argument("--sliding-window", type=int, default=0,
                        help="gemma3: positions its sliding layers attend to")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    try:
        shape = Shape(args.arch, args.hidden, args.ffn, args.layers, args.heads, args.kv_heads,
                      args.head_dim or args.hidden // args.heads, args.experts,
                      args.experts_used, args.expert_ffn, args.sliding_window)
    except ValueError as e:
        parser.error(str(e))
    write(shape, args.reference, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
