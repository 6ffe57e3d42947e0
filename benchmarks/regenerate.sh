#!/usr/bin/env bash
# Re-run the commands behind BENCHMARKS.md's figures, recreating their raw output (logs, result
# JSONs, reports) under benchmarks/results/, which git ignores: what is committed is one row
# per figure in benchmarks/summaries/<part>.csv, and each distinct command there (a "run")
# runs once, under the shared benchmark lock, with
#   $OUT            its own folder, benchmarks/results/<part>/<run>/ (its output: log.txt)
#   $(tree REV)     a copy of the checkout at git revision REV (git archive), made once: the
#                   other side of a before/after, on PYTHONPATH as $(tree REV)/src
#   $(model NAME)   a GGUF under benchmarks/results/models/, made once: `bundled` (the bundled
#                   model's own file), smollm2-135m-f16 (the bundled model converted by
#                   llama.cpp's convert_hf_to_gguf.py), smollm2-135m-<TYPE> (that quantized
#                   by llama-quantize), big-f16 (SmolLM2-1.7B's shape with random weights,
#                   benchmarks/synthetic_gguf.py), big-<TYPE>, gemma3-4b-<TYPE> and
#                   olmoe-<TYPE> (those models' shapes, likewise; the bundled vocabulary),
#                   qwen3-8b-Q4_K_M and llama32-3b-Q4_K_M (random blocks: synthetic_gguf.py
#                   --q4-k-m)
#   $NGRAM          the n-gram speculative config
# and this checkout's .venv first on PATH. Run it on a machine with nothing else running; the
# peers need benchmarks/peers/setup_*.sh first, the GGUFs llama.cpp's llama-quantize
# ($LLAMA_BIN, default /tmp/loom-peers/build/bin) and convert_hf_to_gguf.py ($LLAMA_TREE,
# default .venv/llama.cpp, unpacked by scripts/setup.sh --test; it imports sentencepiece:
# `.venv/bin/pip install sentencepiece`). A run's host, date and commit head its log.
#
#   bash benchmarks/regenerate.sh --list               # every run and its command; runs nothing
#   bash benchmarks/regenerate.sh engine server        # the runs of these parts
#   bash benchmarks/regenerate.sh peers:avx2-c1-c8     # one run
#   bash benchmarks/regenerate.sh                      # everything (many hours on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
export CHECKOUT=$PWD
export PATH="$CHECKOUT/.venv/bin:$PATH"
export RESULTS=${RESULTS:-$CHECKOUT/benchmarks/results}
export LLAMA_BIN=${LLAMA_BIN:-/tmp/loom-peers/build/bin}
export LLAMA_TREE=${LLAMA_TREE:-$CHECKOUT/.venv/llama.cpp}
export NGRAM='{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4,"prompt_lookup_min":2}'
LOCK=/tmp/loom-bench.lock

fail() {  # MESSAGE: stop the run that asked (a $(tree) or $(model) inside its command)
    echo "regenerate: $*" >&2
    kill -s TERM $$
    return 1
}

tree() {  # REV: a copy of the checkout at REV, made once; prints its path
    local dir=$RESULTS/trees/$1
    if [ ! -d "$dir" ]; then
        rm -rf "$dir.part" && mkdir -p "$dir.part" \
            && git -C "$CHECKOUT" archive -o "$dir.part.tar" "$1" \
            && tar -x -C "$dir.part" -f "$dir.part.tar" && rm "$dir.part.tar" \
            && mv "$dir.part" "$dir" || { fail "no tree for $1"; return 1; }
    fi
    echo "$dir"
}

model() {  # NAME: a GGUF, made once; prints its path
    local name=$1 file=$RESULTS/models/$1.gguf
    if [ "$name" = bundled ]; then
        python -c "from loom.model.arch import default_model_path; print(default_model_path())"
        return
    fi
    if [ ! -f "$file" ]; then
        mkdir -p "$RESULTS/models"
        case $name in
            smollm2-135m-f16)
                python "$CHECKOUT/benchmarks/peers/gguf_to_hf.py" --out "$RESULTS/models/hf" >&2 \
                    && python "$LLAMA_TREE/convert_hf_to_gguf.py" "$RESULTS/models/hf" \
                        --outtype f16 --outfile "$file.part" >&2 ;;
            big-f16)
                local reference
                reference=$(model smollm2-135m-f16) \
                    && python "$CHECKOUT/benchmarks/synthetic_gguf.py" --reference "$reference" \
                        --hidden 2048 --ffn 8192 --layers 24 --heads 32 --kv-heads 32 \
                        --out "$file.part" >&2 ;;
            gemma3-4b-f16)  # Gemma-3-4B's shape, random weights
                python "$CHECKOUT/benchmarks/synthetic_gguf.py" --arch gemma3 \
                    --reference "$(model bundled)" --hidden 2560 --ffn 10240 --layers 34 \
                    --heads 8 --kv-heads 4 --head-dim 256 --window 1024 \
                    --out "$file.part" >&2 ;;
            olmoe-f16)  # OLMoE-1B-7B's shape, random weights
                python "$CHECKOUT/benchmarks/synthetic_gguf.py" --arch olmoe \
                    --reference "$(model bundled)" --hidden 2048 --ffn 1024 --layers 16 \
                    --heads 16 --kv-heads 16 --experts 64 --experts-used 8 --expert-ffn 1024 \
                    --out "$file.part" >&2 ;;
            qwen3-8b-Q4_K_M)  # Qwen3-8B's shape, random Q4_K_M blocks written directly
                python "$CHECKOUT/benchmarks/synthetic_gguf.py" --arch qwen3 --q4-k-m \
                    --reference "$(model bundled)" --hidden 4096 --ffn 12288 --layers 36 \
                    --heads 32 --kv-heads 8 --head-dim 128 --out "$file.part" >&2 ;;
            llama32-3b-Q4_K_M)  # Llama-3.2-3B's shape, likewise
                python "$CHECKOUT/benchmarks/synthetic_gguf.py" --arch llama --q4-k-m \
                    --reference "$(model bundled)" --hidden 3072 --ffn 8192 --layers 28 \
                    --heads 24 --kv-heads 8 --out "$file.part" >&2 ;;
            smollm2-135m-*|big-*|gemma3-4b-*|olmoe-*)
                local source
                source=$(model "${name%-*}-f16") \
                    && "$LLAMA_BIN/llama-quantize" "$source" "$file.part" "${name##*-}" >&2 ;;
            *) false ;;
        esac && mv "$file.part" "$file" || { fail "could not make model $name"; return 1; }
    fi
    echo "$file"
}
export -f fail tree model

runs() {  # [PART[:RUN] ...]: "part<TAB>run<TAB>command", each distinct run once
    python - "$@" <<'EOF'
import csv
import sys
from pathlib import Path

wanted, found, seen = sys.argv[1:], set(), set()
for path in sorted(Path("benchmarks/summaries").glob("*.csv")):
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            key = f"{path.stem}:{row['run']}"
            if not row["command"] or key in seen:
                continue  # a throwaway script's figure, or a run already listed
            if wanted and path.stem not in wanted and key not in wanted:
                continue
            seen.add(key)
            found.update((path.stem, key))
            print(path.stem, row["run"], row["command"], sep="\t")
if unknown := [name for name in wanted if name not in found]:
    sys.exit(f"no such part or run: {' '.join(unknown)} (--list names them)")
EOF
}

list=false
if [ "${1:-}" = --list ]; then list=true; shift; fi
chosen=$(runs "$@")
failed=0
while IFS=$'\t' read -r part run command; do
    [ -n "$part" ] || continue
    if $list; then printf '%s:%s\t%s\n' "$part" "$run" "$command"; continue; fi
    export OUT=$RESULTS/$part/$run
    mkdir -p "$OUT"
    echo "== $part:$run: $command"
    { echo "# $command"; python -c "from benchmarks.harness import host_line; print(host_line())"
    } > "$OUT/log.txt"
    if flock "$LOCK" bash -c "$command" >> "$OUT/log.txt" 2>&1 < /dev/null; then
        tail -n 5 "$OUT/log.txt"
    else
        echo "   failed: $OUT/log.txt"; failed=$((failed + 1))
    fi
done <<< "$chosen"
[ "$failed" = 0 ] || { echo "$failed run(s) failed"; exit 1; }
