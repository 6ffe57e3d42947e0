"""Batched decode throughput next to this machine's roofline, as a percentage.

Measures, with the thread count loom uses (torch's default is every core this process may use):

* memory bandwidth: a STREAM-like read (`sum`) and copy over ~1 GiB fp32 tensors, best-of and
  median of several repeats (copy counts bytes read + bytes written, as STREAM does);
* matmul GFLOP/s at the model's own projection shapes (taken from the loaded model: fused qkv,
  o, fused gate_up, down, lm_head) for M = 1, 8, 32, 64, 256 tokens, in float32 and bfloat16,
  each in the weight layout the engine uses for that dtype (prepacked for oneDNN where
  `loom.model.linear` does so), plus one large square matmul (F.linear) for the machine's
  peak (best of two sweeps);
* loom's steady-state decode throughput at batch 1, 8, 32, 64: B requests with short prompts
  and ignore_eos go into the engine, it steps until every prompt is prefilled, then a few
  warm-up steps, then N decode-only steps are timed.

Roofline per dtype and batch size B: one decode step must read every weight once (in the form
the engine reads at that B: the native block-quantized kernel's panels, the GGUF's codes at
their own size plus fp16 block scales and offsets, where it runs, i.e. at every B with
`--linear-backend native`, else the fp32 weights) plus the KV cache of every sequence (context
tokens x layers x 2 x kv_heads x head_dim x dtype bytes), and do 2 x matmul params x B FLOPs
plus attention (4 x q_size x context per token per layer). memory time = bytes / best read
bandwidth; compute time = FLOPs / the best GFLOP/s measured at M = B over the model's shapes;
bound = max of the two; roofline tok/s = B / bound. The table also gives the bound with the
square-matmul peak as compute ceiling ("ideal"), and the time of just the step's matmuls on the
model's own weights ("matmul ms"; the per-shape microbenchmarks reuse one weight, so every
shape but lm_head runs from cache there, while this streams every weight from memory as a real
step does). Run from the repository root:

    python benchmarks/engine/roofline.py            # about a minute on 2 idle cores
    python benchmarks/engine/roofline.py --quick    # smoke run
    python benchmarks/engine/roofline.py --threads 1 --out roofline.json
    python benchmarks/engine/roofline.py --dtypes auto     # only what the engine picks on this CPU

"auto" decodes at the engine's own dtype choice: on a CPU with native bf16 that is float32 on
the native kernel up to a few rows (16; 3 with AMX) and bf16 copies of the weights above
(model/linear.py), and
its bound then takes, at each B, the bytes and the per-shape matmul speed of the path that
runs there.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*
import loom  # noqa: F401, E402 - before torch: it sets the OpenMP wait policy (loom/threads.py)
from benchmarks.harness import best_and_median, host_line  # noqa: E402

# isort: split
import torch  # noqa: E402

from loom import LLM, SamplingParams  # noqa: E402
from loom.bench.sysinfo import hardware  # noqa: E402
from loom.model.decoder import DecoderModel  # noqa: E402
from loom.model.linear import Linear, onednn_prepack_supported  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# "auto": the engine's own choice on this CPU; on one with native bf16 that is float32 with the
# native kernel up to the backends' bf16_above_rows and bf16 matmuls above, so its bound
# takes the bytes and the matmul speed of whichever runs at that B.
DECODE_DTYPES = ["auto", *DTYPES]


# -- machine figures --------------------------------------------------------------------------

def measure_bandwidth(size_bytes: int, repeats: int) -> dict[str, float]:
    """GB/s (1e9 bytes/s) of a read (sum) and a copy over `size_bytes` fp32 tensors."""
    n = size_bytes // 4
    src = torch.ones(n, dtype=torch.float32)  # filled, so every page is really backed
    dst = torch.zeros(n, dtype=torch.float32)
    nbytes = n * 4
    read_best, read_median = best_and_median(src.sum, repeats)
    copy_best, copy_median = best_and_median(lambda: dst.copy_(src), repeats)
    return {"size_bytes": nbytes, "repeats": repeats,
            "read_best_gbs": nbytes / read_best / 1e9,
            "read_median_gbs": nbytes / read_median / 1e9,
            "copy_best_gbs": 2 * nbytes / copy_best / 1e9,
            "copy_median_gbs": 2 * nbytes / copy_median / 1e9}


def _time_linear(x: torch.Tensor, linear: Linear, min_time: float) -> float:
    """Seconds per linear(x): the best of many ~2 ms batches of calls filling min_time.
    Best-of, not mean, so that other processes preempting a thread count as little as
    possible."""
    for _ in range(2):
        linear(x)
    start = time.perf_counter()
    linear(x)
    n = max(1, int(0.002 / max(time.perf_counter() - start, 1e-7)))
    best, batches, begin = float("inf"), 0, time.perf_counter()
    while batches < 5 or time.perf_counter() - begin < min_time:
        start = time.perf_counter()
        for _ in range(n):
            linear(x)
        best = min(best, (time.perf_counter() - start) / n)
        batches += 1
    return best


@torch.inference_mode()
def measure_matmuls(shapes: dict[str, tuple[int, int]], ms: list[int], square: int,
                    min_time: float, rounds: int, dtypes: list[str]) -> dict[str, Any]:
    """GFLOP/s of x[M, in] @ w[out, in]^T per dtype, shape and M; and of a square matmul. The
    whole sweep runs `rounds` times and each figure keeps its best round, so a burst of other
    load on the machine spoils one round of a figure rather than the figure."""
    out: dict[str, Any] = {}
    for round_ in range(rounds):
        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]
            result = out.setdefault(dtype_name, {"shapes": {}, "square_n": square,
                                                 "square_gflops": 0.0})
            for name, (k, n) in shapes.items():
                # in the layout the engine uses for this dtype (prepacked for oneDNN or not)
                linear = Linear(torch.randn(n, k, dtype=dtype), prepack=onednn_prepack_supported(
                    torch.device("cpu"), dtype))
                for m in ms:
                    x = torch.randn(m, k, dtype=dtype)
                    seconds = _time_linear(x, linear, min_time)
                    best = result["shapes"].setdefault(name, {}).get(m)
                    if best is None or seconds < best["seconds"]:
                        result["shapes"][name][m] = {"seconds": seconds,
                                                     "gflops": 2 * m * k * n / seconds / 1e9}
            a = torch.randn(square, square, dtype=dtype)
            b = torch.randn(square, square, dtype=dtype)
            gflops = 2 * square**3 / _time_linear(a, Linear(b), min_time * 4) / 1e9
            result["square_gflops"] = max(result["square_gflops"], gflops)
        print(f"  round {round_ + 1}/{rounds} done", flush=True)
    return out


# -- the model --------------------------------------------------------------------------------

def model_shapes(model: DecoderModel) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection a decode step runs."""
    layer = model.layers[0]
    linears = {"qkv": layer.qkv, "o": layer.o, "gate_up": layer.gate_up, "down": layer.down,
               "lm_head": model.lm_head}
    return {name: (lin.in_features, lin.out_features) for name, lin in linears.items()}


def model_figures(model: DecoderModel, kv_dtype: torch.dtype) -> dict[str, Any]:
    """Parameters and bytes one decode step reads, independent of the batch; the KV cache's
    bytes at its own dtype (float16 by default on a CPU, whatever the model's)."""
    arch = model.arch
    linears = [lin for layer in model.layers for lin in (
        layer.qkv, layer.o, layer.gate_up, layer.down)]
    norms = [w for layer in model.layers for w in (
        layer.input_norm, layer.post_attn_norm, layer.pre_mlp_norm, layer.post_mlp_norm)
        if w is not None]  # the post-norms are Gemma's only
    norms.append(model.final_norm)
    linears.append(model.lm_head)
    matmul_params = sum(lin.num_params for lin in linears)
    itemsize = model.dtype.itemsize
    norm_bytes = sum(w.numel() for w in norms) * itemsize
    # The native kernel's bytes: its panels (codes, scales and offsets) where a Linear has them.
    block_quant_bytes = sum(
        sum(t.numel() * t.element_size() for t in lin.panel_tensors())
        if lin.panels is not None else lin.num_params * itemsize
        for lin in linears)
    batched = [w for lin in linears for w in lin.bf16_copy_tensors()]
    return {
        "model_dtype": str(model.dtype).removeprefix("torch."),
        "matmul_params": matmul_params,
        "weight_bytes": matmul_params * itemsize + norm_bytes,
        "block_quant_weight_bytes": (block_quant_bytes + norm_bytes
                                     if any(lin.panels is not None for lin in linears)
                                     else None),
        # the bf16 copies that calls of more than bf16_above_rows rows read, where kept
        "batched_bf16_weight_bytes": (sum(w.numel() * w.element_size() for w in batched)
                                      + norm_bytes if batched else None),
        "kv_bytes_per_token": (2 * arch.num_layers * arch.num_kv_heads * arch.head_dim
                               * kv_dtype.itemsize),
        "attn_flops_per_token_per_ctx": 4 * arch.num_layers * arch.num_heads * arch.head_dim,
        "num_layers": arch.num_layers,
    }


@torch.inference_mode()
def measure_matmul_step(model: DecoderModel, batch: int, repeats: int) -> float:
    """Median seconds of just the matmuls of one decode step at batch B, on the model's own
    weights (so they stream from memory as in a real step): per layer qkv, o, gate_up, down,
    then lm_head."""
    arch, dtype = model.arch, model.dtype
    h = torch.randn(batch, arch.hidden_size, dtype=dtype)
    a = torch.randn(batch, arch.num_heads * arch.head_dim, dtype=dtype)
    m = torch.randn(batch, arch.intermediate_size, dtype=dtype)

    def step() -> None:
        for layer in model.layers:
            layer.qkv(h)
            layer.o(a)
            layer.gate_up(h)
            layer.down(m)
        model.lm_head(h)

    return best_and_median(step, repeats)[1]


def measure_decode(llm: LLM, batch: int, steps: int, warmup: int, prompt_len: int
                   ) -> dict[str, float]:
    """Steady-state decode: B requests prefilled, `warmup` steps, then `steps` timed steps."""
    engine = llm.engine
    params = SamplingParams(max_tokens=warmup + steps + 4, temperature=0, ignore_eos=True)
    ids = [f"roofline-b{batch}-{i}" for i in range(batch)]
    for i, request_id in enumerate(ids):
        # distinct prompts, so prefix caching cannot share blocks between requests
        prompt = [1000 + (i * 7919 + j * 104729) % 40000 for j in range(prompt_len)]
        engine.add_request(request_id, prompt, params)
    states = [engine.states[r] for r in ids]
    while any(len(s.request.output_token_ids) < 1 for s in states):
        engine.step()  # past the prefills: from here on every step is decode-only
    for _ in range(warmup):
        engine.step()
    outputs_before = sum(len(s.request.output_token_ids) for s in states)
    context_before = sum(s.request.num_prompt_tokens for s in states) + outputs_before
    step_times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)
    elapsed = sum(step_times)
    generated = sum(len(s.request.output_token_ids) for s in states) - outputs_before
    if generated != batch * steps:
        raise RuntimeError(f"expected {batch * steps} decoded tokens, got {generated}")
    for request_id in ids:
        engine.abort_request(request_id)
    # A decode step at context c (tokens already cached) attends over c + 1 tokens.
    mean_context = context_before / batch + (steps - 1) / 2 + 1
    median = statistics.median(step_times)
    return {"batch": batch, "steps": steps, "seconds": elapsed, "mean_context": mean_context,
            "mean_step_ms": elapsed / steps * 1e3, "mean_tok_s": batch * steps / elapsed,
            "step_ms": median * 1e3, "tok_s": batch / median,
            "step_ms_all": [t * 1e3 for t in step_times]}


# -- the roofline -----------------------------------------------------------------------------

def roofline_row(dtype_name: str, decode: dict[str, float], figures: dict[str, Any],
                 matmuls: dict[str, Any], bandwidth_gbs: float,
                 shapes: dict[str, tuple[int, int]]) -> dict[str, Any]:
    b, ctx = decode["batch"], decode["mean_context"]
    kv_bytes = b * ctx * figures["kv_bytes_per_token"]
    native = figures["block_quant_weight_bytes"] is not None
    wide_bf16 = figures["bf16_above_rows"] is not None and b > figures["bf16_above_rows"]
    weights = ("batched_bf16_weight_bytes" if wide_bf16
               else "block_quant_weight_bytes" if native else "weight_bytes")
    step_bytes = figures[weights] + kv_bytes
    matmul_dtype = "bfloat16" if wide_bf16 else figures["model_dtype"]
    per_shape = matmuls[matmul_dtype]["shapes"]
    flops = 2 * figures["matmul_params"] * b + b * ctx * figures["attn_flops_per_token_per_ctx"]
    peak_at_m = max(per_shape[name][b]["gflops"] for name in shapes)
    square_peak = matmuls[matmul_dtype]["square_gflops"]
    mem_s = step_bytes / (bandwidth_gbs * 1e9)
    compute_s = flops / (peak_at_m * 1e9)
    bound_s = max(mem_s, compute_s)
    ideal_s = max(mem_s, flops / (max(square_peak, peak_at_m) * 1e9))
    measured_s = decode["step_ms"] / 1e3
    return {
        "dtype": (dtype_name + (f" = {figures['model_dtype']}" if dtype_name == "auto" else "")
                  + (" native" if native else "") + (", bf16 matmuls" if wide_bf16 else "")),
        "batch": b, "mean_context": ctx,
        "step_ms": decode["step_ms"], "tok_s": decode["tok_s"],
        "mean_tok_s": decode["mean_tok_s"],
        "step_bytes": step_bytes, "kv_bytes": kv_bytes, "step_flops": flops,
        "effective_gbs": step_bytes / measured_s / 1e9,
        "peak_gflops_at_m": peak_at_m,
        "memory_ms": mem_s * 1e3, "compute_ms": compute_s * 1e3,
        "bound": "memory" if mem_s >= compute_s else "compute",
        "roofline_tok_s": b / bound_s, "pct_of_roofline": 100 * bound_s / measured_s,
        "ideal_tok_s": b / ideal_s, "pct_of_ideal": 100 * ideal_s / measured_s,
        "matmul_ms": decode["matmul_ms"],
    }


def print_report(machine: dict[str, Any], rows: list[dict[str, Any]],
                 figures: dict[str, dict[str, Any]], shapes: dict[str, tuple[int, int]],
                 ms: list[int]) -> None:
    bw = machine["bandwidth"]
    print(f"\n## Machine ({machine['cpu']}, {machine['threads']} threads, "
          f"torch {machine['torch']})\n")
    print(f"- memory read (sum over {bw['size_bytes'] / 2**30:.2f} GiB): best "
          f"{bw['read_best_gbs']:.1f} GB/s, median {bw['read_median_gbs']:.1f} GB/s "
          f"({bw['repeats']} repeats)")
    print(f"- memory copy (read + write counted): best {bw['copy_best_gbs']:.1f} GB/s, "
          f"median {bw['copy_median_gbs']:.1f} GB/s")
    matmuls = machine["matmul"]
    for dtype_name in matmuls:
        print(f"- {dtype_name} square matmul {matmuls[dtype_name]['square_n']}^3: "
              f"{matmuls[dtype_name]['square_gflops']:.1f} GFLOP/s")
    for dtype_name, f in figures.items():
        native = (f"; {f['block_quant_weight_bytes'] / 1e6:.1f} MB as the GGUF's blocks "
                  "(native kernel)"
                  if f["block_quant_weight_bytes"] else "")
        print(f"- {dtype_name} model: {f['matmul_params'] / 1e6:.1f} M matmul params, "
              f"{f['weight_bytes'] / 1e6:.1f} MB weights read per step{native}, "
              f"{f['kv_bytes_per_token'] / 1e3:.1f} kB KV per context token")
    print("\n### Matmul GFLOP/s at the model's shapes (in -> out), by M\n")
    print("| dtype | shape | " + " | ".join(f"M={m}" for m in ms) + " |")
    print("|---|---|" + "---:|" * len(ms))
    for dtype_name in matmuls:
        for name, (k, n) in shapes.items():
            cells = " | ".join(f"{matmuls[dtype_name]['shapes'][name][m]['gflops']:.1f}"
                               for m in ms)
            print(f"| {dtype_name} | {name} {k}->{n} | {cells} |")
    print(f"\n### Decode vs roofline (bandwidth {bw['read_best_gbs']:.1f} GB/s)\n")
    print("| dtype | B | ctx | step ms | tok/s | mean tok/s | MB/step | eff. GB/s | mem ms "
          "| compute ms | roofline tok/s | % of roofline | % of ideal | matmul ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['dtype']} | {r['batch']} | {r['mean_context']:.0f} | {r['step_ms']:.1f} "
              f"| {r['tok_s']:.1f} | {r['mean_tok_s']:.1f} | {r['step_bytes'] / 1e6:.0f} "
              f"| {r['effective_gbs']:.1f} "
              f"| {r['memory_ms']:.1f} | {r['compute_ms']:.1f} | {r['roofline_tok_s']:.0f} "
              f"| {r['pct_of_roofline']:.0f}% | {r['pct_of_ideal']:.0f}% "
              f"| {r['matmul_ms']:.1f} |")
    print("\nstep ms: median of the timed decode steps (tok/s = B / that, and the % columns use "
          "it), so that other load on the machine counts less; mean tok/s: all timed steps. "
          "ctx: mean context per sequence over the timed steps; compute ms uses the best "
          "GFLOP/s measured at M = B; ideal uses the square-matmul peak instead; matmul ms: "
          "median time of just the step's matmuls (the model's own projections at M = "
          "B), i.e. step ms minus that is attention, sampling and engine overhead.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="torch threads for everything (default: the cores this process "
                             "may use, as loom does)")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--batches", type=int, nargs="+", default=None,
                        help="decode batch sizes (default 1 8 32 64; quick: 1 8)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed decode steps per batch size (default 32; quick: 3)")
    parser.add_argument("--prompt-len", type=int, default=16, help="prompt tokens per request")
    parser.add_argument("--dtypes", nargs="+", default=DECODE_DTYPES, choices=DECODE_DTYPES,
                        help="dtypes to decode in (default: all)")
    parser.add_argument("--out", help="also write every figure to this JSON file")
    args = parser.parse_args()
    quick = args.quick
    batches = args.batches or ([1, 8] if quick else [1, 8, 32, 64])
    steps = args.steps or (3 if quick else 32)
    warmup = 1 if quick else 4
    ms = sorted(set(batches) | ({1, 8} if quick else {1, 8, 32, 64, 256}))
    torch.set_num_threads(args.threads)
    print(host_line(), flush=True)

    decodes: dict[str, list[dict[str, float]]] = {}
    figures: dict[str, dict[str, Any]] = {}
    shapes: dict[str, tuple[int, int]] = {}
    for dtype_name in args.dtypes:
        print(f"decode, {dtype_name}: loading the model...", flush=True)
        llm = LLM(dtype=dtype_name, num_threads=args.threads, kv_cache_memory="512MiB",
                  max_num_seqs=max(64, max(batches)),
                  max_num_batched_tokens=max(512, max(batches)))
        model = llm.engine.runner.model
        shapes = model_shapes(model)
        figures[dtype_name] = model_figures(model, llm.engine.runner.kv_caches[0][0].dtype)
        figures[dtype_name]["bf16_above_rows"] = llm.engine.runner.backends.bf16_above_rows
        decodes[dtype_name] = []
        for b in batches:
            result = measure_decode(llm, b, steps, warmup, args.prompt_len)
            result["matmul_ms"] = measure_matmul_step(model, b, 3 if quick else 7) * 1e3
            decodes[dtype_name].append(result)
            print(f"  B={b}: {result['step_ms']:.1f} ms/step, {result['tok_s']:.1f} tok/s",
                  flush=True)
        del llm, model
        gc.collect()

    print("memory bandwidth...", flush=True)
    size = 2**28 if quick else 2**30
    bandwidth = measure_bandwidth(size, 3 if quick else 7)
    print("matmuls...", flush=True)
    # the dtypes the decodes' matmuls ran in
    ran = {f["model_dtype"] for f in figures.values()} | {
        "bfloat16" for f in figures.values() if f["batched_bf16_weight_bytes"] is not None}
    matmul_dtypes = [d for d in DTYPES if d in ran]
    matmuls = measure_matmuls(shapes, ms, 1024 if quick else 2048, 0.02 if quick else 0.1,
                              1 if quick else 2, matmul_dtypes)
    machine = {"cpu": hardware()["cpu_model"], "threads": args.threads,
               "cores_available": len(os.sched_getaffinity(0)), "torch": torch.__version__,
               "bandwidth": bandwidth, "matmul": matmuls}
    rows = [roofline_row(dtype_name, d, figures[dtype_name], matmuls,
                         bandwidth["read_best_gbs"], shapes)
            for dtype_name in args.dtypes for d in decodes[dtype_name]]
    print_report(machine, rows, figures, shapes, ms)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine, "model": {"shapes": shapes, "figures": figures},
                       "decode": decodes, "roofline": rows,
                       "settings": {"batches": batches, "steps": steps, "warmup": warmup,
                                    "prompt_len": args.prompt_len, "quick": quick}},
                      f, indent=2)
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
