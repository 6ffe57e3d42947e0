"""How fast this machine reads memory in runs of a given length at random places: the rate a
paged KV cache's blocks can be streamed at, which is what bounds decode attention over long
contexts. A buffer of --megabytes is cut into runs of each length, shuffled, and summed by
--threads threads (OpenMP, AVX2 loads), optionally prefetching the run --prefetch runs ahead
as the decode kernel does; best of three passes. One kv head's share of a 16-position block is
2 KB at fp16, a whole block's (three kv heads) 6 KB. Run from the repository root:

    python benchmarks/kernels/random_reads.py
    python benchmarks/kernels/random_reads.py --prefetch 1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*
import loom  # noqa: F401, E402 - before torch: it sets the OpenMP wait policy (loom/threads.py)
from benchmarks.harness import host_line  # noqa: E402

# isort: split
import torch  # noqa: E402
from torch.utils.cpp_extension import load_inline  # noqa: E402

SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

// GB/s of the best of three passes summing `total` bytes read as shuffled runs of `run` bytes.
double random_reads(int64_t total, int64_t run, int64_t prefetch, int64_t threads) {
  char* buf = static_cast<char*>(std::aligned_alloc(1 << 21, total));
  std::memset(buf, 1, total);
  const int64_t n = total / run;
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(1));
  double best = 1e30;
  float sink = 0.f;
  for (int pass = 0; pass < 3; ++pass) {
    const auto start = std::chrono::steady_clock::now();
    float sum = 0.f;
#pragma omp parallel num_threads(threads) reduction(+ : sum)
    {
      __m256 acc = _mm256_setzero_ps();
#pragma omp for schedule(static)
      for (int64_t i = 0; i < n; ++i) {
        if (prefetch > 0 && i + prefetch < n)
          for (int64_t b = 0; b < run; b += 64)
            _mm_prefetch(buf + order[i + prefetch] * run + b, _MM_HINT_T0);
        const float* p = reinterpret_cast<const float*>(buf + order[i] * run);
        for (int64_t j = 0; j < run / 4; j += 8) acc = _mm256_add_ps(acc, _mm256_load_ps(p + j));
      }
      float lanes[8];
      _mm256_storeu_ps(lanes, acc);
      for (float x : lanes) sum += x;
    }
    sink += sum;
    best = std::min(best, std::chrono::duration<double>(
                              std::chrono::steady_clock::now() - start).count());
  }
  std::free(buf);
  return sink == -1.f ? 0.0 : total / best / 1e9;
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=int, default=384)
    parser.add_argument("--runs", type=int, nargs="+",
                        default=[2048, 4096, 6144, 16384, 65536, 1 << 20])
    parser.add_argument("--prefetch", type=int, default=0, help="runs ahead (0: none)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    ops = load_inline("loom_random_reads", cpp_sources=SOURCE, functions=["random_reads"],
                      extra_cflags=["-O3", "-march=native", "-fopenmp"],
                      extra_ldflags=["-fopenmp"])
    print(f"{host_line()}; {args.threads} threads, {args.megabytes} MB, prefetch "
          f"{args.prefetch}\n\n| run bytes | GB/s |\n|--:|--:|")
    for run in args.runs:
        rate = ops.random_reads(args.megabytes << 20, run, args.prefetch, args.threads)
        print(f"| {run:,} | {rate:.1f} |", flush=True)


if __name__ == "__main__":
    main()
