"""How many tokens another model's tokenizer counts for text SmolLM2's counts as N: the factor
`loom simulate` warns with when a trace counted by SmolLM2 (loom's default tokenizer) is
replayed against a model whose tokenizer it was not given.

Reads only vocabularies: the bundled SmolLM2 GGUF and llama.cpp's vocab GGUFs (vendored under
.venv/llama.cpp/models). The sample is this repository's README.md and docs/*.md (English
prose with some code and tables). Prints one line per vocabulary; the ratios are what
src/loom/plan/models.json records as `tokens_per_smollm2_token`.

    python benchmarks/planning/tokenizer_ratio.py
"""

from __future__ import annotations

from pathlib import Path

from loom.workload.tokens import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
VOCABS = {"llama-3 (ggml-vocab-llama-bpe)": "ggml-vocab-llama-bpe.gguf",
          "qwen2 / qwen3 (ggml-vocab-qwen2)": "ggml-vocab-qwen2.gguf"}


def sample_text() -> str:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return "\n".join(p.read_text() for p in files)


def count(tokenizer_path: Path | None, text: str) -> int:
    return len(load_tokenizer(tokenizer_path).encode(text, add_special_tokens=False).ids)


def main() -> None:
    text = sample_text()
    base = count(None, text)
    print(f"sample: README.md + docs/*.md, {len(text):,} characters; SmolLM2: {base:,} tokens")
    models = ROOT / ".venv" / "llama.cpp" / "models"
    for name, file in VOCABS.items():
        n = count(models / file, text)
        print(f"{name}: {n:,} tokens, {n / base:.3f} per SmolLM2 token")


if __name__ == "__main__":
    main()
