"""Every CPU setting's quality against loom's most exact: KL divergence and top-1 agreement
vs `--dtype float32 --batched-matmul native --kv-cache-dtype float32`, as `loom eval kld`
measures them (loom.eval), on the bundled model and text, at batch 1 and with 32 sequences
sharing each step.

Chunks are fed as decoding runs (`--as-decode`: one token of each chunk a step), so at batch 1
every matmul has one row and at batch 32 thirty-two, as in decode at those batch sizes: the
bf16 copies loom uses above one row (`--batched-matmul`) only show at 32. The same chunks are
scored at both batch sizes, each setting against the reference at the same batch size.
Run from the repository root:

    python benchmarks/engine/quality_table.py          # about 5 minutes on 2 cores
    python benchmarks/engine/quality_table.py --chunks 8 --csv ''
    python benchmarks/engine/quality_table.py --kernel-isa avx2 --settings "default (auto)"

`--kernel-isa avx2` runs loom's kernels built as an AVX2-only CPU runs them (-mno-avx512f, as
tests/test_other_simd.py builds them), in a build folder of their own, so an AVX-512 host
measures the AVX2 hosts' numerics; Python's choices stay this host's, which for a GGUF are an
AVX2 host's too (float32, the native kernel, an fp16 KV cache).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*
from benchmarks.harness import host_line  # noqa: E402
from loom.config import EngineConfig  # noqa: E402
from loom.eval.config import ScoringConfig  # noqa: E402
from loom.eval.metrics import KldResult, kl_divergence  # noqa: E402
from loom.eval.run import score_text  # noqa: E402
from loom.host import describe  # noqa: E402
from loom.model import kernels  # noqa: E402

REFERENCE = {"dtype": "float32", "batched_matmul": "native", "kv_cache_dtype": "float32"}
SETTINGS = {
    "default (auto)": {},
    "--batched-matmul bfloat16": {"batched_matmul": "bfloat16"},
    "--batched-matmul native": {"batched_matmul": "native"},
    "--kv-cache-dtype bfloat16": {"kv_cache_dtype": "bfloat16"},
    "--kv-cache-dtype float32": {"kv_cache_dtype": "float32"},
}
CSV = Path(__file__).resolve().parents[1] / "summaries" / "quality.csv"


# extra compiler flags per --kernel-isa (a build folder of their own: not the product's build)
KERNEL_ISAS = {"native": [], "avx2": ["-mno-avx512f"]}


def use_kernel_isa(isa: str) -> None:
    """Build and load the kernels for `isa` instead of this host's own (before any loads)."""
    if KERNEL_ISAS[isa]:
        root = Path(os.environ.get("TORCH_EXTENSIONS_DIR")
                    or Path.home() / ".cache" / "torch_extensions")
        os.environ["TORCH_EXTENSIONS_DIR"] = str(root / f"isa-{isa}")
        kernels._CFLAGS = [*kernels._CFLAGS, *KERNEL_ISAS[isa]]


def measure(batch: int, chunks: int, context: int, settings: list[str]
            ) -> dict[str, KldResult]:
    scoring = ScoringConfig(context=context, max_chunks=chunks, batch_size=batch,
                            as_decode=True)
    reference = list(score_text(None, scoring, EngineConfig.from_kwargs(**REFERENCE)).scored)
    results = {}
    for name in settings:
        gc.collect()
        tested = score_text(None, scoring, EngineConfig.from_kwargs(**SETTINGS[name])).scored
        results[name] = kl_divergence(reference, tested)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help="comma-separated names of SETTINGS")
    parser.add_argument("--kernel-isa", default="native", choices=list(KERNEL_ISAS))
    parser.add_argument("--csv", default=str(CSV), help="summary CSV to append to; '' = none")
    args = parser.parse_args()
    use_kernel_isa(args.kernel_isa)
    settings = args.settings.split(",")
    host = describe() + ("" if args.kernel_isa == "native" else
                         f", {args.kernel_isa} kernel build")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    command = ("python benchmarks/engine/quality_table.py " + " ".join(sys.argv[1:])).strip()
    rows = []
    print(f"{host_line()}; {args.chunks} chunks of {args.context} tokens")
    print("| setting | batch | mean KLD | p99 KLD | top-1 agreement | PPL (ref PPL) |")
    print("|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        for name, r in measure(batch, args.chunks, args.context, settings).items():
            print(f"| {name} | {batch} | {r.mean_kld:.2e} | {r.p99_kld:.2e} | "
                  f"{100 * r.top1_agreement:.2f}% | {r.perplexity:.4f} "
                  f"({r.reference_perplexity:.4f}) |", flush=True)
            run = (f"quality-b{args.batches.replace(',', '-')}-{commit}"
                   + ("" if args.kernel_isa == "native" else f"-{args.kernel_isa}"))
            rows.append([run, f"{name}, batch {batch}: mean KLD / top-1 vs float32",
                         f"{r.mean_kld:.3g} / {100 * r.top1_agreement:.2f}%",
                         command, commit, host, datetime.date.today().isoformat()])
    if args.csv:
        new = not Path(args.csv).exists()
        with open(args.csv, "a", newline="") as f:
            writer = csv.writer(f)
            if new:
                writer.writerow(["run", "figure", "value", "command", "commit", "host", "date"])
            writer.writerows(rows)


if __name__ == "__main__":
    main()
