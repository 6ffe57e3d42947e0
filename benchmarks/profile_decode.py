"""Torch-profiler breakdown of decode steps (12 requests, contexts 40-1100 tokens, fp32), and
a matmul micro-benchmark of fp32 vs bf16 at the model's shapes. Run from the repository root:

    python benchmarks/profile_decode.py
"""

from __future__ import annotations

import time

import loom  # noqa: F401 - before torch: it sets the OpenMP wait policy (loom/threads.py)

# isort: split
import torch
from torch.profiler import ProfilerActivity, profile

from loom import LLM, SamplingParams


def decode_profile() -> None:
    engine = LLM(kv_cache_memory="512MiB", max_model_len=2048).engine
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    for i, length in enumerate([40] * 6 + [520] * 4 + [1100] * 2):
        engine.add_request(f"r{i}", [(5 + i * 7 + j) % 40000 for j in range(length)], params)
    while any(len(s.request.output_token_ids) < 2 for s in engine.states.values()):
        engine.step()  # past the prefills: from here on every step is decode-only
    start = time.perf_counter()
    for _ in range(10):
        engine.step()
    print(f"decode step: {(time.perf_counter() - start) * 100:.1f} ms")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))


def matmul_speed() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        for m in (1, 8, 16, 512):
            x, w = torch.randn(m, 576, dtype=dtype), torch.randn(3072, 576, dtype=dtype)
            for _ in range(3):
                torch.nn.functional.linear(x, w)
            n = 200 if m < 100 else 20
            start = time.perf_counter()
            for _ in range(n):
                torch.nn.functional.linear(x, w)
            seconds = (time.perf_counter() - start) / n
            print(f"{dtype} m={m}: {seconds * 1e3:.3f} ms, "
                  f"{2 * m * 576 * 3072 / seconds / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
    decode_profile()
    matmul_speed()
