"""The fitted GPU step model against published measurements: every held-out row (the judged
TensorRT-LLM v1.0 rows and our own held-out split), published vs predicted throughput, the
mean and max |error|, and the H200/H100 ratios vs published.

    python benchmarks/planning/published_fit.py [--refit] [--markdown]

--refit fits on the training split first (as `loom simulate calibrate --published` does, without
writing the shipped file); otherwise the shipped fitted_profiles.json is scored.
"""

from __future__ import annotations

import argparse
import statistics

from loom.plan.fitted import FittedProfiles, shipped_profiles
from loom.plan.published import published_rows
from loom.sim.published_fit import Prediction, calibrate_published, predictions, split

FIGURES = {"output_tok_s": "throughput", "ttft_ms": "TTFT", "tpot_ms": "TPOT",
           "latency_ms": "latency"}


def _summary(name: str, preds: list[Prediction]) -> str:
    """Mean and max |error| of each figure the rows publish."""
    parts = []
    for key, label in FIGURES.items():
        errs = [abs(x - 1) * 100 for p in preds if (x := p.ratios().get(key)) is not None]
        parts.append(f"{label} |error| mean {statistics.mean(errs):.1f}%, max {max(errs):.1f}%"
                     f" over {len(errs)} rows" if errs else f"{label}: not published")
    return f"{name}: " + "; ".join(parts)


def _line(p: Prediction) -> str:
    r = p.row
    load = f"c{r.concurrency}" if r.concurrency else "offline"
    cells = [f"{FIGURES[k]} {getattr(r, k):,.1f}→{getattr(p, k):,.1f} ({x:.2f})"
             for k, x in p.ratios().items()]
    return f"  {r.engine} {r.model} {r.dtype} {r.gpu} TP{r.tp} {r.isl}/{r.osl} {load}: " + \
        ", ".join(cells)


def _ratios(preds: list[Prediction]) -> list[tuple[str, float, float]]:
    """(workload, published H200/H100, predicted H200/H100) per model and ISL/OSL on both."""
    by = {(p.row.model, p.row.isl, p.row.osl, p.row.gpu): p for p in preds}
    out = []
    for (model, isl, osl, gpu), p in sorted(by.items()):
        q = by.get((model, isl, osl, "h100-sxm"))
        if gpu == "h200" and q and p.row.output_tok_s and q.row.output_tok_s:
            out.append((f"{model} {isl}/{osl} (H200 TP{p.row.tp} / H100 TP{q.row.tp})",
                        p.row.output_tok_s / q.row.output_tok_s,
                        p.output_tok_s / q.output_tok_s))
    return out


def _markdown(preds: list[Prediction]) -> None:
    """Throughput rows only: vLLM's batch-8 latency rows publish no throughput (the summary
    lines give them)."""
    preds = [p for p in preds if p.ratio is not None]
    lengths = sorted({(p.row.isl, p.row.osl) for p in preds})
    print("| held-out rows (tok/s) | " + " | ".join(f"{i}/{o}" for i, o in lengths) + " |")
    print("|---" * (len(lengths) + 1) + "|")
    configs: dict[str, dict[tuple[int, int], Prediction]] = {}
    for p in preds:
        r = p.row
        name = f"{r.source.engine_version.split()[0]} {r.model} {r.dtype} {r.gpu} TP{r.tp}"
        configs.setdefault(name, {})[(r.isl, r.osl)] = p
    for name, cells in configs.items():
        text = [f"{c.row.output_tok_s:,.0f}→{c.output_tok_s:,.0f} ({c.ratio:.2f})"
                if (c := cells.get(k)) else "" for k in lengths]
        print(f"| {name} | " + " | ".join(text) + " |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--refit", action="store_true")
    ap.add_argument("--markdown", action="store_true",
                    help="held-out rows as one markdown table: a configuration per line, "
                         "published -> predicted (ratio) per ISL/OSL")
    args = ap.parse_args()
    rows = published_rows()
    fitted: FittedProfiles = calibrate_published(rows) if args.refit else shipped_profiles()
    parts = split(rows)
    if args.markdown:
        _markdown(predictions(parts.judged + parts.held_out, fitted))
        return
    held = {e: [r for r in parts.held_out if r.engine == e] for e in ("trtllm", "vllm")}
    for name, subset in (("judged (TensorRT-LLM v1.0)", parts.judged),
                         ("own held-out, TensorRT-LLM (Llama-3.1-70B TP4, v0.17)",
                          held["trtllm"]),
                         ("own held-out, vLLM (CI build 9515, H200)", held["vllm"]),
                         ("training, TensorRT-LLM", [r for r in parts.train
                                                     if r.engine == "trtllm"]),
                         ("training, vLLM (RTX 4090)", [r for r in parts.train
                                                        if r.engine == "vllm"])):
        preds = predictions(subset, fitted)
        print(_summary(name, preds))
        if name.startswith("training, T"):
            continue
        for p in preds:
            print(_line(p))
        ratios = _ratios(preds)
        if ratios:
            errs = [abs(b / a - 1) * 100 for _, a, b in ratios]
            print(f"H200/H100 ratios: |error| mean {statistics.mean(errs):.1f}%, max "
                  f"{max(errs):.1f}% over {len(ratios)} workloads")
            for label, a, b in ratios:
                print(f"  {label}: published {a:.2f}, predicted {b:.2f}")


if __name__ == "__main__":
    main()
