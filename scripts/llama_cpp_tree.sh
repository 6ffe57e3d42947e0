#!/usr/bin/env bash
# Unpacks the parts of llama.cpp's tree that loom's tests read, from the llama-cpp-python sdist
# on PyPI (the same sdist benchmarks/peers/setup_llama_cpp.sh builds llama-server from):
# the vocab-only GGUFs with their tokenizer tests (models/ggml-vocab-*.gguf + .inp/.out), the
# chat templates (models/templates/*.jinja) and the HF -> GGUF converter (convert_hf_to_gguf.py,
# conversion/, gguf-py/). Nothing of it is committed; the tests find it at $LOOM_LLAMA_CPP_TREE,
# by default .venv/llama.cpp. Run again, it keeps what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
DEST=${LOOM_LLAMA_CPP_TREE:-.venv/llama.cpp}
PY=${PYTHON:-.venv/bin/python}
if [ -f "$DEST/VERSION" ] && [ "$(cat "$DEST/VERSION")" = "$VERSION" ]; then
    echo "llama.cpp tree $VERSION already in $DEST"; exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PY" -m pip download --disable-pip-version-check -q --no-deps --no-binary :all: \
    -d "$work" "llama-cpp-python==$VERSION"
top="llama_cpp_python-$VERSION/vendor/llama.cpp"
vocabs=(qwen2 qwen35 llama-bpe llama-spm phi-3 gemma-4 gpt-2 deepseek-llm command-r)
members=("$top/models/templates" "$top/convert_hf_to_gguf.py" "$top/conversion" "$top/gguf-py"
         "$top/LICENSE")
for v in "${vocabs[@]}"; do
    for ext in "" .inp .out; do members+=("$top/models/ggml-vocab-$v.gguf$ext"); done
done
tar xzf "$work/llama_cpp_python-$VERSION.tar.gz" -C "$work" "${members[@]}" 2>/dev/null || \
    tar xzf "$work/llama_cpp_python-$VERSION.tar.gz" -C "$work" --wildcards "${members[@]}"
rm -rf "$DEST"
mkdir -p "$(dirname "$DEST")"
mv "$work/$top" "$DEST"
echo "$VERSION" >"$DEST/VERSION"
echo "llama.cpp tree $VERSION unpacked in $DEST"
