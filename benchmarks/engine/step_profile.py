"""Where one busy engine step's time goes, and the model's idle gap with and without async
scheduling. Run from the repository root:

    python benchmarks/engine/step_profile.py --dtype bfloat16
    python benchmarks/engine/step_profile.py --decodes 1 --prefill 0 --skip-idle   # one user

1. A busy step: 32 requests decoding plus one 256-token prefill chunk (mixed-batch steps are
   what a loaded server runs; `--prefill 0`: decode-only steps). Each phase of
   `EngineCore.step` is timed over several steps — scheduling, input preparation, the forward
   pass, logits + sampling, scheduler update, output processing (detokenize, stop strings,
   metrics) — and one step is run under the torch profiler to split the forward pass by kind
   of op.
2. The engine issue's 64-request mixed workload offline, async scheduling off then on
   (alternating, `--rounds`): wall time, output tok/s, and the model's idle time between
   back-to-back forward passes (`loom:model_idle_seconds`).

The HTTP/streaming share comes from `benchmarks/server/server_profile.py` (py-spy on a live server).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*
import loom  # noqa: F401, E402 - before torch: it sets the OpenMP wait policy (loom/threads.py)
from benchmarks.harness import host_line  # noqa: E402

# isort: split
import torch  # noqa: E402

from benchmarks.engine.workload import bundled_tokenizer, mixed_workload, run_offline  # noqa: E402
from loom import LLM, SamplingParams  # noqa: E402
from loom.engine.core import EngineCore  # noqa: E402
from loom.model.kernels import (  # noqa: E402
    block_quant_linear_ops,
    fused_ops,
    paged_attention_ops,
)

OP_KINDS = {  # torch profiler op name -> kind, first match wins
    "matmul (native, GGUF blocks)": ("loom::block_quant_linear",),
    # the slices the calling thread runs show as mkldnn ops under it; the helpers' are unseen
    "matmul (bf16 copies, loom's threads)": ("loom::bf16_linear", "loom::amx_bf16_linear",
                                             "mkldnn::_linear_pointwise"),
    "add + RMSNorm, SiLU * up (native)": ("loom::add_rms_norm", "loom::silu_mul"),
    "matmul (linear/mm)": ("aten::addmm", "aten::mm", "aten::linear", "aten::matmul",
                           "aten::bmm"),
    "RoPE + KV write + decode attention (native)": ("loom::rope_write_decode",
                                                    "loom::paged_decode_attention"),
    "prefill attention (SDPA)": ("aten::_scaled_dot_product", "aten::scaled_dot_product"),
    "KV gather (index)": ("aten::index", "aten::permute", "aten::reshape", "aten::clone"),
    "KV write (index_copy)": ("aten::index_copy",),
    "norms (rms_norm)": ("aten::rms_norm", "aten::_fused_rms_norm"),
    "rope + elementwise": ("aten::mul", "aten::add", "aten::sub", "aten::cat", "aten::silu",
                           "aten::neg"),
}


def timed(phases: dict[str, list[float]], name: str, fn: Callable) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            phases[name].append(time.perf_counter() - start)
    return wrapper


def busy_engine(dtype: str, num_decodes: int, prefill_len: int,
                model: str | None = None) -> EngineCore:
    engine = LLM(model=model, dtype=dtype, kv_cache_memory="1GiB", max_num_batched_tokens=512,
                 max_num_seqs=num_decodes + 4).engine
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    for i in range(num_decodes):
        engine.add_request(f"d{i}", [1 + (i * 7 + j) % 4000 for j in range(60 + i * 8)], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens
              for r in engine.scheduler.requests.values()):
        engine.step()
    return engine


def add_prefill(engine: EngineCore, tag: str, prefill_len: int) -> None:
    """A prompt of its own per tag: one prompt for every step would be prefilled once and then
    found in the prefix cache."""
    if prefill_len == 0:
        return
    start = zlib.crc32(tag.encode())
    engine.add_request(tag, [100 + (start + j * 13) % 20000 for j in range(prefill_len)],
                       SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))


def profile_busy_step(dtype: str, num_decodes: int, prefill_len: int, steps: int,
                      model_path: str | None = None) -> None:
    engine = busy_engine(dtype, num_decodes, prefill_len, model_path)
    runner, model = engine.runner, engine.runner.model
    phases: dict[str, list[float]] = collections.defaultdict(list)
    engine.scheduler.schedule = timed(phases, "schedule", engine.scheduler.schedule)
    runner._prepare = timed(phases, "prepare inputs", runner._prepare)
    model.forward = timed(phases, "forward", model.forward)
    model.compute_logits = timed(phases, "lm_head (logits)", model.compute_logits)
    runner.sampler.sample = timed(phases, "sampling", runner.sampler.sample)
    engine.scheduler.update = timed(phases, "scheduler update", engine.scheduler.update)
    engine._process = timed(phases, "process outputs", engine._process)
    step = timed(phases, "whole step", engine.step)
    for i in range(steps):
        add_prefill(engine, f"p{i}", prefill_len)
        step()
    tokens = num_decodes + prefill_len
    print(f"\n### One busy step: {num_decodes} decodes + a {prefill_len}-token prefill "
          f"({tokens} tokens), {dtype}, {torch.get_num_threads()} threads; "
          f"median of {steps} steps\n")
    whole = statistics.median(phases.pop("whole step"))
    print("| phase | ms | share of step |\n|---|---|---|")
    accounted = 0.0
    for name, values in phases.items():
        ms = statistics.median(values) * 1e3
        accounted += ms
        print(f"| {name} | {ms:.2f} | {ms / (whole * 1e3):.1%} |")
    rest = whole * 1e3 - accounted
    print(f"| rest of step (Python glue) | {rest:.2f} | {rest / (whole * 1e3):.1%} |")
    print(f"| **whole step** | **{whole * 1e3:.2f}** | 100% |")

    add_prefill(engine, "profiled", prefill_len)
    label_native_ops()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        engine.step()
        step_us = (time.perf_counter() - start) * 1e6
    by_kind: dict[str, float] = collections.defaultdict(float)
    total_self = 0.0
    for event in prof.key_averages():
        if event.key.startswith("ProfilerStep") or event.key == "forward":
            continue
        total_self += event.self_cpu_time_total
        kind = next((k for k, names in OP_KINDS.items()
                     if any(event.key.startswith(n) for n in names)), "other ops")
        by_kind[kind] += event.self_cpu_time_total
    print("\nOne more such step under the torch profiler, by kind of op (self CPU time; the "
          "profiler slows dispatch, so shares matter more than ms):\n")
    print("| kind | ms | share of step |\n|---|---|---|")
    for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"| {kind} | {us / 1e3:.2f} | {us / step_us:.1%} |")
    outside = step_us - total_self
    print(f"| Python + dispatch between ops | {outside / 1e3:.2f} | {outside / step_us:.1%} |")
    num_ops = sum(e.count for e in prof.key_averages())
    print(f"\n{num_ops} torch ops dispatched in the profiled step.")


def label_native_ops() -> None:
    """A pybind call is invisible to the torch profiler: wrap each native kernel in a
    record_function named loom::<kernel> (the model calls them through their modules)."""
    kernels = ((paged_attention_ops(), "paged_decode_attention"),
               (paged_attention_ops(), "rope_write_decode"),
               (block_quant_linear_ops(), "block_quant_linear"),
               (fused_ops(), "bf16_linear"), (fused_ops(), "amx_bf16_linear"),
               (fused_ops(), "add_rms_norm"), (fused_ops(), "silu_mul"))
    for module, name in kernels:
        if module is None:
            continue
        kernel = getattr(module, name)

        def labelled(*args: Any, kernel: Callable = kernel, name: str = name) -> torch.Tensor:
            with torch.profiler.record_function(f"loom::{name}"):
                return kernel(*args)
        setattr(module, name, labelled)


def histogram_totals(engine: EngineCore, name: str) -> tuple[float, float]:
    """(sum, count) of one of the engine's histograms."""
    total = count = 0.0
    for family in engine.metrics.registry.collect():
        if family.name == name:
            for sample in family.samples:
                if sample.name.endswith("_sum"):
                    total = sample.value
                elif sample.name.endswith("_count"):
                    count = sample.value
    return total, count


def idle_gap(dtype: str, rounds: int, max_num_seqs: int) -> None:
    items = mixed_workload(bundled_tokenizer())
    results: dict[bool, list[tuple[float, float, float, float, float]]] = {False: [], True: []}
    for _ in range(rounds):
        for async_scheduling in (False, True):
            engine = LLM(dtype=dtype, async_scheduling=async_scheduling,
                         max_num_seqs=max_num_seqs, kv_cache_memory="1536MiB").engine
            wall = run_offline(engine, items)
            idle, gaps = histogram_totals(engine, "loom:model_idle_seconds")
            forward, steps = histogram_totals(engine, "loom:model_forward_seconds")
            output = sum(item.max_tokens for item in items)
            results[async_scheduling].append((wall, output / wall, idle / max(gaps, 1) * 1e3,
                                              idle / wall, steps))
            print(f"  async={async_scheduling}: wall {wall:.1f}s, {output / wall:.1f} tok/s, "
                  f"idle {idle:.2f}s over {gaps:.0f} gaps, forward {forward:.1f}s in "
                  f"{steps:.0f} steps", flush=True)
    print(f"\n### Idle gap between forward passes: 64-request mixed workload, {dtype}, "
          f"max_num_seqs {max_num_seqs}, medians of {rounds}\n")
    print("| async scheduling | wall (s) | output tok/s | mean idle gap (ms) | idle share of "
          "wall | steps |\n|---|---|---|---|---|---|")
    for flag, runs in results.items():
        med = [statistics.median(col) for col in zip(*runs)]
        print(f"| {'on' if flag else 'off'} | {med[0]:.1f} | {med[1]:.1f} | {med[2]:.2f} | "
              f"{med[3]:.1%} | {med[4]:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file or HF folder (default: the "
                        "bundled model); the busy-step profile only")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--decodes", type=int, default=32)
    parser.add_argument("--prefill", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--skip-idle", action="store_true", help="only the busy-step profile")
    args = parser.parse_args()
    print(host_line())
    profile_busy_step(args.dtype, args.decodes, args.prefill, args.steps, args.model)
    if not args.skip_idle:
        idle_gap(args.dtype, args.rounds, args.max_num_seqs)


if __name__ == "__main__":
    main()
