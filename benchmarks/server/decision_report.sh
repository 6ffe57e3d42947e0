#!/usr/bin/env bash
# The decision report for loom on this machine: continuous batching against the fixed-batch
# baseline (--scheduler static) and a second token budget (--max-num-batched-tokens 512 against
# the default), on one small mixed trace (chat, long prompts, RAG, multi-turn sessions) at one
# offered rate with a burst, each configuration twice (interleaved, a fresh server each time).
# Writes compare results, report.html and report.md into the output directory.
#
#   bash benchmarks/server/decision_report.sh [OUT_DIR]     (default: benchmarks/results/decision)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/decision}
loom=${LOOM:-.venv/bin/loom}
slo=ttft_p95=2,e2e_p95=20
mkdir -p "$out"
"$loom" bench trace --mix chat=0.45,long=0.15,rag=0.2,session=0.2 -n 20 --seed 7 \
  --cancel-fraction 0 -o "$out/trace.jsonl"
flock /tmp/loom-bench.lock "$loom" bench compare --trace "$out/trace.jsonl" --output-dir "$out" \
  --rates 0.5 --burst 3x:8s@6s --repeats 2 --slo "$slo" \
  --config continuous= --config static='--scheduler static' \
  --config budget-512='--max-num-batched-tokens 512'
"$loom" bench report "$out" --slo "$slo"
