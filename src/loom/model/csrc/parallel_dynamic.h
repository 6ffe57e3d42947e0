// loom: parallel loops that tolerate a busy machine.
//
// at::parallel_for gives each of torch's threads one fixed range. When the cores are shared
// with other work (the HTTP server's thread, a benchmark client), a thread that is descheduled
// for a time slice holds up the whole call while the others wait at its end. Here the threads
// instead take indices one at a time from a shared counter, so the ones still running take over
// the work of one that is not. On the 2-core host a background process using ~9% of one core
// slowed the offline engine by 10-22% with fixed ranges (BENCHMARKS.md, "What serving
// costs on 2 cores").
#pragma once
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cstdint>

// Calls worker(next) once on each thread; the worker loops `for (i; (i = next++) < n;)` and may
// keep per-thread state (buffers) across the indices it takes.
template <typename Worker>
inline void parallel_dynamic(int64_t n, const Worker& worker) {
  std::atomic<int64_t> next{0};
  const int64_t num_threads = std::min<int64_t>(n, at::get_num_threads());
  at::parallel_for(0, std::max<int64_t>(num_threads, 1), 1,
                   [&](int64_t, int64_t) { worker(next); });
}
