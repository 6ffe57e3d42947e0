#!/usr/bin/env bash
# Re-measure every figure BENCHMARKS.md quotes, one benchmark at a time, into
# benchmarks/results/head/ (logs and result JSONs). Run from the repository root with loom's
# venv on a machine with nothing else running; peers need benchmarks/peers/setup_*.sh first.
#   bash benchmarks/regenerate.sh            # everything (about an hour on 2 cores)
#   PEER_CONCURRENCY=1,8 PEER_ROUNDS=2 bash benchmarks/regenerate.sh peers
#   bash benchmarks/regenerate.sh spec peers # only these parts
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
LOOM=${LOOM:-.venv/bin/loom}
OUT=benchmarks/results/head
NGRAM='{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4,"prompt_lookup_min":2}'
mkdir -p "$OUT"
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(host startup roofline static long http prefix spec peers)  # spec-http: by HTTP too

run() {  # name, command...: one benchmark, its output kept, under the shared lock
    local name=$1; shift
    echo "== $name: $*"
    flock /tmp/loom-bench.lock "$@" 2>&1 | tee "$OUT/$name.log" | grep -v " INFO " | tail -n 40
}

for part in "${parts[@]}"; do
    case $part in
        host) { date -u; git rev-parse --short HEAD; $PY -c "from loom import host; print(host.describe())"; } \
                | tee "$OUT/host.txt" ;;
        startup) run startup $PY benchmarks/startup.py --rounds 3 ;;
        roofline) run roofline $PY benchmarks/roofline.py --out "$OUT/roofline.json" ;;
        static) run continuous-vs-static bash -c \
                "cd benchmarks && ../$PY continuous_vs_static.py --max-num-seqs 16 --rounds 2" ;;
        long) run long-outputs $PY benchmarks/long_outputs.py --concurrency 8 --max-tokens 400 \
                --logprobs 5 --rounds 2 ;;
        http) run http-vs-offline $PY benchmarks/http_vs_offline.py --concurrency 1,32 ;;
        prefix) run prefix-cache $LOOM bench compare --trace benchmarks/traces/rag-20.jsonl \
                --rates 0.5 --output-dir "$OUT/prefix-cache" --config prefix-cache= \
                --config no-prefix-cache=--no-enable-prefix-caching \
                --server-flags '--kv-cache-memory 1GiB' ;;
        spec) run spec-decode $PY benchmarks/spec_decode.py --rounds 3 ;;
        spec-http) run spec-quote $LOOM bench compare --trace benchmarks/traces/quote-16.jsonl \
                --overlap 1,8 --output-dir "$OUT/spec-quote" --config plain= \
                --config ngram="--speculative-config '$NGRAM'"
              run spec-mixed $LOOM bench compare --trace benchmarks/traces/mixed-40.jsonl \
                -n 16 --overlap 1,8 --output-dir "$OUT/spec-mixed" --config plain= \
                --config ngram="--speculative-config '$NGRAM'" ;;
        peers) run peers $PY benchmarks/peers.py --servers llama.cpp-t2,vllm-cpu,loom \
                --concurrency "${PEER_CONCURRENCY:-1,8,32,64}" --rounds "${PEER_ROUNDS:-1}" \
                --out-dir "$OUT/peers" ;;
        *) echo "unknown part $part"; exit 2 ;;
    esac
done
