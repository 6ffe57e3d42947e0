"""Engine steps with the fused add + RMSNorm and SiLU * up kernels against torch's ops, in one
process and interleaved step by step (the model's `fused_ops` is switched between steps), so
that the machine's drift hits both sides alike. Run from the repository root:

    python benchmarks/kernels/fused_ops.py
    python benchmarks/kernels/fused_ops.py --batches 1 8 --steps 40 --prefill-rounds 2

Decode: B requests with 32-token prompts, prefilled, then `--steps` decode-only steps, every
other one fused. Prefill: steps that each prefill one new 2,048-token prompt (prefix caching
off), alternating. Prints the median step time of each side and fused / torch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*
import loom  # noqa: F401, E402 - before torch: it sets the OpenMP wait policy (loom/threads.py)
from benchmarks.harness import host_line  # noqa: E402

# isort: split
import torch  # noqa: E402

from loom import LLM, SamplingParams  # noqa: E402
from loom.model.kernels import fused_ops  # noqa: E402


def timed_step(engine, fused: bool) -> float:
    engine.runner.model.fused_ops = fused_ops() if fused else None
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def decode(batch: int, steps: int) -> dict[bool, list[float]]:
    engine = LLM(kv_cache_memory="512MiB", max_model_len=2048, dtype="float32").engine
    params = SamplingParams(max_tokens=steps + 16, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [(7 + 13 * i + j) % 40000 for j in range(32)], params)
    while any(not s.request.output_token_ids for s in engine.states.values()):
        engine.step()
    for _ in range(4):
        engine.step()
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(steps):
        times[i % 2 == 1].append(timed_step(engine, i % 2 == 1))
    return times


def prefill(rounds: int, prompt_len: int) -> dict[bool, list[float]]:
    engine = LLM(kv_cache_memory="512MiB", max_model_len=4096, dtype="float32",
                 enable_prefix_caching=False, max_num_batched_tokens=prompt_len).engine
    params = SamplingParams(max_tokens=1, temperature=0)
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(2 * rounds + 1):
        engine.add_request(f"p{i}", [(11 + 17 * i + j) % 40000 for j in range(prompt_len)],
                           params)
        elapsed = timed_step(engine, i % 2 == 1)
        if i > 0:  # the first prefill also warms up
            times[i % 2 == 1].append(elapsed)
        while engine.has_unfinished_requests():
            engine.step()
    return times


def report(label: str, times: dict[bool, list[float]]) -> None:
    torch_ms, fused_ms = (statistics.median(times[f]) * 1e3 for f in (False, True))
    print(f"| {label} | {torch_ms:.2f} | {fused_ms:.2f} | {fused_ms / torch_ms:.3f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--steps", type=int, default=60, help="decode steps per batch size")
    parser.add_argument("--prefill-rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=2048)
    args = parser.parse_args()
    if fused_ops() is None:
        raise SystemExit("the fused kernels did not build; nothing to compare")
    print(f"{host_line()}; torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| step | torch ops ms | fused ms | fused / torch |\n|---|--:|--:|--:|")
    for batch in args.batches:
        report(f"decode, B = {batch}", decode(batch, args.steps))
    if args.prefill_rounds:
        report(f"prefill, {args.prompt_len} tokens", prefill(args.prefill_rounds,
                                                             args.prompt_len))


if __name__ == "__main__":
    main()
