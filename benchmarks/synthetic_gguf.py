"""A model-shaped GGUF with random weights, for measuring what depends on a model's size only
(loading, conversion, start-up, memory) at sizes no bundled file has: the tokenizer and
settings of a reference GGUF, the architecture's sizes from the flags, F16 weights drawn from
N(0, 0.02). Quantize it with llama.cpp's `llama-quantize` to the type to measure. Its text is
noise. Run from the repository root, e.g. SmolLM2-1.7B's shape:

    python benchmarks/synthetic_gguf.py --reference smollm2-135m-f16.gguf \\
        --hidden 2048 --ffn 8192 --layers 24 --heads 32 --kv-heads 32 --out big-f16.gguf
    llama-quantize big-f16.gguf big-Q4_K_M.gguf Q4_K_M
"""

from __future__ import annotations

import argparse

import gguf
import numpy as np


def copy_settings(reference: gguf.GGUFReader, writer: gguf.GGUFWriter,
                  sizes: dict[str, int]) -> None:
    """Every key-value of `reference` but the architecture's sizes, which `sizes` gives."""
    for field in reference.fields.values():
        name = field.name
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name in sizes:
            writer.add_uint32(name, sizes[name])
        elif field.types[0] == gguf.GGUFValueType.ARRAY:
            values = [field.parts[i] for i in field.data]
            if field.types[-1] == gguf.GGUFValueType.STRING:
                writer.add_array(name, [bytes(v).decode("utf-8", "replace") for v in values])
            else:
                writer.add_array(name, [v.tolist()[0] for v in values])
        elif field.types[0] == gguf.GGUFValueType.STRING:
            writer.add_string(name, bytes(field.parts[field.data[0]]).decode())
        else:
            writer.add_key_value(name, field.parts[field.data[0]].tolist()[0], field.types[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", required=True, help="a Llama-architecture GGUF")
    parser.add_argument("--hidden", type=int, required=True)
    parser.add_argument("--ffn", type=int, required=True)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--heads", type=int, required=True)
    parser.add_argument("--kv-heads", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    reference = gguf.GGUFReader(args.reference)
    vocab = next(t for t in reference.tensors if t.name == "token_embd.weight").shape[1]
    arch, head_dim = "llama", args.hidden // args.heads
    writer = gguf.GGUFWriter(args.out, arch)
    copy_settings(reference, writer, {
        f"{arch}.embedding_length": args.hidden, f"{arch}.feed_forward_length": args.ffn,
        f"{arch}.block_count": args.layers, f"{arch}.attention.head_count": args.heads,
        f"{arch}.attention.head_count_kv": args.kv_heads,
        f"{arch}.rope.dimension_count": head_dim, f"{arch}.attention.key_length": head_dim,
        f"{arch}.attention.value_length": head_dim})
    rng = np.random.default_rng(0)

    def matrix(name: str, rows: int, cols: int) -> None:
        weights = rng.standard_normal((rows, cols), dtype=np.float32) * 0.02
        writer.add_tensor(name, weights.astype(np.float16))

    kv_rows = head_dim * args.kv_heads
    matrix("token_embd.weight", int(vocab), args.hidden)
    writer.add_tensor("output_norm.weight", np.ones(args.hidden, np.float32))
    for layer in range(args.layers):
        block = f"blk.{layer}."
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(block + norm + ".weight", np.ones(args.hidden, np.float32))
        for name, rows, cols in (("attn_q", args.hidden, args.hidden),
                                 ("attn_k", kv_rows, args.hidden),
                                 ("attn_v", kv_rows, args.hidden),
                                 ("attn_output", args.hidden, args.hidden),
                                 ("ffn_gate", args.ffn, args.hidden),
                                 ("ffn_up", args.ffn, args.hidden),
                                 ("ffn_down", args.hidden, args.ffn)):
            matrix(block + name + ".weight", rows, cols)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
