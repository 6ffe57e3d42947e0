"""Each model family's default settings against loom's most exact, `--dtype float32
--batched-matmul native --kv-cache-dtype float32`: mean KLD and top-1 agreement as
quality_table.py measures them (the bundled text, chunks fed as decoding runs, at batch 1 and
with 32 sequences sharing each step), for the files each family runs from:

- its tiny random-weight model (tests/model_fixtures.py: transformers at a fixed seed, the
  bundled model's vocabulary; Gemma 2's a small tokenizer of its own) as a Hugging Face folder
  and as llama.cpp's converter writes it in Q8_0;
- for the families benchmarks/synthetic_gguf.py writes, a synthetic GGUF (the bundled
  vocabulary, N(0, 0.02) weights, shapes whole K-quant blocks wide) through llama-quantize's
  Q4_K_M.

Random weights make no language: the tiny models' logits span tens of nats (weights N(0,
0.15)) and the synthetic ones' are nearly uniform, so a KLD still measures how far a setting
moves the distribution, while top-1 agreement only says how often the argmax survives, which
on nearly flat logits is a coin toss at every near-tie (fragile, not a quality bound).
`--model LABEL=PATH` adds any model (the bundled one as a folder: benchmarks/peers/gguf_to_hf.py).
Each setting of `--settings` is scored against the reference at the same batch size. Run from
the repository root:

    python benchmarks/engine/family_quality.py --chunks 16 --settings float32,bfloat16
    python benchmarks/engine/family_quality.py --families qwen3 --chunks 4 --csv ''

The first took about 10 minutes on 2 cores, the second half a minute (models made included).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(CHECKOUT))  # benchmarks.*
sys.path.insert(0, str(CHECKOUT / "tests"))  # the tiny models the tests build
from benchmarks import synthetic_gguf  # noqa: E402
from benchmarks.harness import commit, host_line  # noqa: E402
from loom.config import EngineConfig  # noqa: E402
from loom.eval.config import ScoringConfig  # noqa: E402
from loom.eval.metrics import KldResult, kl_divergence  # noqa: E402
from loom.eval.run import score_text  # noqa: E402
from loom.host import describe  # noqa: E402
from loom.model.arch import default_model_path  # noqa: E402

REFERENCE = {"dtype": "float32", "batched_matmul": "native", "kv_cache_dtype": "float32"}
SETTINGS = {"auto": {}, "bfloat16": {"dtype": "bfloat16"}, "float32": {"dtype": "float32"}}
CSV = CHECKOUT / "benchmarks" / "summaries" / "quality.csv"
LLAMA_BIN = Path(os.environ.get("LLAMA_BIN", "/tmp/loom-peers/build/bin"))
# synthetic_gguf's families, 256 wide (whole Q4_K blocks), 64-dim heads (the native kernel's)
SYNTHETIC = {
    "qwen3": synthetic_gguf.Shape("qwen3", 256, 512, 2, 4, 2, 64),
    "gemma3": synthetic_gguf.Shape("gemma3", 256, 512, 6, 4, 2, 64, window=16),
    "qwen3_moe": synthetic_gguf.Shape("qwen3moe", 256, 512, 2, 4, 2, 64, 8, 2, 256),
    "olmoe": synthetic_gguf.Shape("olmoe", 256, 256, 2, 4, 2, 64, 8, 2, 256),
}
FAMILIES = ("qwen3", "smollm3", "phi3", "gemma2", "gemma3", "mixtral", "qwen3_moe", "olmoe")


@dataclass(frozen=True)
class Model:
    family: str
    file: str  # what it runs from: "HF folder", "Q8_0", ...
    path: Path


def tiny_models(families: list[str], work: Path) -> list[Model]:
    """Each family's tiny model as a folder and its converter's Q8_0 (made once in `work`)."""
    from llama_cpp_tree import llama_cpp_tree
    from model_fixtures import (
        FAMILY_SPECS,
        MOE_SPECS,
        build_tiny_model,
        convert_with_llama_cpp,
        save_hf_folder,
    )

    specs = {**FAMILY_SPECS, **MOE_SPECS}
    models, jobs = [], []
    for name in families:
        folder, q8 = work / name, work / f"{name}-q8_0.gguf"
        if not (folder / "config.json").exists():
            save_hf_folder(build_tiny_model(specs[name]), folder, specs[name].tokenizer)
        if not q8.exists():
            jobs.append((folder, q8, "q8_0"))
        models += [Model(name, "HF folder", folder), Model(name, "Q8_0", q8)]
    if jobs:
        convert_with_llama_cpp(llama_cpp_tree(), jobs)
    return models


def synthetic_models(families: list[str], work: Path) -> list[Model]:
    """The synthetic Q4_K_M of each family synthetic_gguf writes (made once in `work`)."""
    models = []
    for name in (f for f in families if f in SYNTHETIC):
        f16, q4 = work / f"{name}-synthetic-f16.gguf", work / f"{name}-synthetic-Q4_K_M.gguf"
        if not q4.exists():
            synthetic_gguf.write(SYNTHETIC[name], str(default_model_path()), str(f16))
            subprocess.run([str(LLAMA_BIN / "llama-quantize"), str(f16), str(q4), "Q4_K_M"],
                           check=True, capture_output=True)
            f16.unlink()
        models.append(Model(name, "synthetic Q4_K_M", q4))
    return models


def measure(model: Model, batch: int, settings: list[str], chunks: int, context: int,
            threads: int | None) -> dict[str, KldResult]:
    scoring = ScoringConfig(context=context, max_chunks=chunks, batch_size=batch,
                            as_decode=True)

    def scored(flags: dict[str, str]) -> list:
        gc.collect()
        config = EngineConfig.from_kwargs(model=str(model.path), num_threads=threads, **flags)
        return list(score_text(None, scoring, config).scored)

    reference = scored(REFERENCE)
    return {name: kl_divergence(reference, scored(SETTINGS[name])) for name in settings}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--model", action="append", default=[], metavar="LABEL=PATH",
                        help="another model to measure (repeatable)")
    parser.add_argument("--no-tiny", action="store_true", help="only --model's models")
    parser.add_argument("--settings", default="auto", help=f"of {', '.join(SETTINGS)}")
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (the tiny models are fastest on one)")
    parser.add_argument("--work", default="/tmp/loom-family-quality",
                        help="where the models are made (kept for a rerun)")
    parser.add_argument("--csv", default=str(CSV), help="summary CSV to append to; '' = none")
    args = parser.parse_args()
    settings = args.settings.split(",")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    families = [] if args.no_tiny else args.families.split(",")
    models = tiny_models(families, work) + synthetic_models(families, work)
    models += [Model(label, "", Path(path))
               for label, path in (m.split("=", 1) for m in args.model)]
    host, rev = describe(), commit()
    command = ("python benchmarks/engine/family_quality.py " + " ".join(sys.argv[1:])).strip()
    print(f"{host_line()}; {args.chunks} chunks of {args.context} tokens")
    print("| model | file | setting | batch | mean KLD | p99 KLD | top-1 | ref PPL |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for model in models:
        for batch in (int(b) for b in args.batches.split(",")):
            results = measure(model, batch, settings, args.chunks, args.context, args.threads)
            for name, r in results.items():
                print(f"| {model.family} | {model.file} | {name} | {batch} | {r.mean_kld:.2e} "
                      f"| {r.p99_kld:.2e} | {100 * r.top1_agreement:.2f}% | "
                      f"{r.reference_perplexity:.1f} |", flush=True)
                label = f"{model.family} {model.file}".strip()
                rows.append([f"family-quality-{rev}",
                             f"{label}, {name}, batch {batch}: mean KLD / top-1 vs float32",
                             f"{r.mean_kld:.3g} / {100 * r.top1_agreement:.2f}%", command, rev,
                             host, datetime.date.today().isoformat()])
    if args.csv:
        new = not Path(args.csv).exists()
        with open(args.csv, "a", newline="") as f:
            writer = csv.writer(f, lineterminator="\n")
            if new:
                writer.writerow(["run", "figure", "value", "command", "commit", "host", "date"])
            writer.writerows(rows)


if __name__ == "__main__":
    main()
