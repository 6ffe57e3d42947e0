#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (CPU, Release) from the llama.cpp tree vendored in the
# PyPI sdist of llama-cpp-python. Nothing is committed: the sdist comes from PyPI and the
# binary lands in $PEERS_DIR (default /tmp/loom-peers). ~15 min on 2 cores.
set -euo pipefail
PEERS_DIR=${PEERS_DIR:-/tmp/loom-peers}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PY=${PYTHON:-python3}
mkdir -p "$PEERS_DIR"
cd "$PEERS_DIR"
if [ -x llama-server ]; then echo "llama-server already built: $PEERS_DIR/llama-server"; exit 0; fi
if [ ! -f "llama_cpp_python-$VERSION.tar.gz" ]; then
  "$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION"
fi
tar xzf "llama_cpp_python-$VERSION.tar.gz"
SRC="llama_cpp_python-$VERSION/vendor/llama.cpp"
cmake -S "$SRC" -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF
cmake --build build --config Release -j "$(nproc)" --target llama-server
cp build/bin/llama-server .
echo "built $PEERS_DIR/llama-server"
