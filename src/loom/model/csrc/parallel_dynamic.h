// loom: parallel loops that tolerate a busy machine, on helpers that wake at once.
//
// Work split. at::parallel_for gives each thread one fixed range: a thread descheduled for a
// time slice (the HTTP server's thread, a benchmark client, another program) holds the whole
// call up. Here the threads take indices one at a time from a shared counter, so the ones
// still running take over the work of one that is not, and the caller never waits for a
// helper that has not started: only for one in the middle of an index.
//
// Waking. A decode step makes hundreds of these calls, tens of microseconds apart. torch's
// OpenMP pool, with the OMP_WAIT_POLICY=PASSIVE loom sets (loom/threads.py), puts its helpers
// to sleep after every call, and waking one costs a futex round trip per call: at one sequence
// that was a fifth of the step. Spinning instead (libgomp's default) is a collapse on a busy
// machine: a spinning helper burns the time slice the thread it waits for needed. So the
// helpers here wait by yielding: `sched_yield` in a loop keeps the core only while nothing else
// wants it, and after `kYieldWindow` without work a helper sleeps on a futex, so an idle
// engine costs nothing. On a machine busy with other programs a yielding helper waits its turn
// behind them for a whole time slice, while one woken from the futex is run at once (the
// scheduler favours a thread that slept), so the pool watches whether its helpers make it to
// the jobs: when they miss more than a quarter of a window of jobs it goes back to sleeping
// after every job, as the passive policy does, and tries yielding again a while later.
//
//   caller:  publish job, generation++ ── run indices ── close ── wait for helpers inside
//   helper:  yield ... sees generation ── enter ── run indices ── leave ── yield ... sleep
//
// A helper enters only while the job is open and the caller returns only once no helper is
// inside, so the job (on the caller's stack) outlives every use of it. One job at a time per
// pool: a call that finds the pool busy (another thread's, or nested) runs on its own thread.
// One pool for all the extensions. Each compiles this header, so each would have a pool of its
// own, and a step alternates between them (matmul, attention, matmul): their helpers, one per
// extension per spare core, took turns on the cores, and a helper asleep by the time its
// extension's next call came had to be woken for it (docs/benchmark-log.md, "One helper pool
// for every extension"). So the first extension kernels.py loads makes the pool and the others
// adopt it (LOOM_POOL_BINDINGS) before any job.
#pragma once
#include <ATen/Parallel.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <mutex>
#include <thread>

namespace loom_parallel {

constexpr auto kYieldWindow = std::chrono::milliseconds(2);
constexpr int kProbeJobs = 64;     // jobs per window in which helpers' misses are counted
constexpr int kMissLimit = 16;     // misses in a window that turn yielding off
constexpr int kSleepJobs = 1024;   // jobs run with sleeping helpers before yielding is retried
inline thread_local bool in_job = false;  // this thread runs a job's worker: nested calls stay

class Pool {
 public:
  using Task = void (*)(const void* worker, std::atomic<int64_t>& next);

  // The process's pool: the first extension to run a job makes it, unless kernels.py has
  // already handed this one another extension's (`adopt`). Never destroyed: helpers may still
  // be waiting at exit.
  static Pool& instance() {
    Pool* pool = slot().load();
    if (pool != nullptr) return *pool;
    Pool* fresh = new Pool();  // no helpers until its first job, so a losing one is just freed
    if (slot().compare_exchange_strong(pool, fresh)) return *fresh;
    delete fresh;
    return *pool;
  }

  static void adopt(Pool* pool) { slot().store(pool); }

  // Runs task(worker, next) on this thread and on up to `helpers` helpers; returns when all
  // are done. False (nothing run) when the pool is busy with another call.
  bool run(int64_t helpers, Task task, const void* worker, std::atomic<int64_t>& next) {
    std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
    if (!lock.owns_lock()) return false;
    grow(helpers);
    task_ = task;
    worker_ = worker;
    next_ = &next;
    seats_.store(helpers);
    open_.store(true);
    generation_.fetch_add(1);
    if (sleepers_.load() > 0)
      syscall(SYS_futex, &generation_, FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
    task(worker, next);
    open_.store(false);
    while (inside_.load() > 0) sched_yield();
    count_misses(seats_.load() > 0);
    return true;
  }

 private:
  static std::atomic<Pool*>& slot() {  // this extension's pointer to the process's pool
    static std::atomic<Pool*> pool{nullptr};
    return pool;
  }

  void grow(int64_t helpers) {
    for (; started_ < helpers; ++started_) std::thread([this] { serve(); }).detach();
  }

  // Under mutex_: the adaptive choice between yielding and sleeping (see the top of the file).
  void count_misses(bool missed) {
    misses_ += missed;
    if (++jobs_ < (yielding_.load() ? kProbeJobs : kSleepJobs)) return;
    yielding_.store(!yielding_.load() || misses_ <= kMissLimit);
    jobs_ = misses_ = 0;
  }

  void serve() {
    uint32_t seen = generation_.load();
    for (;;) {
      seen = wait_for_job(seen);
      inside_.fetch_add(1);  // then open_: the caller closes first, then waits for inside_
      if (open_.load() && seats_.fetch_sub(1) > 0) task_(worker_, *next_);
      inside_.fetch_sub(1);
    }
  }

  uint32_t wait_for_job(uint32_t seen) {
    auto since = std::chrono::steady_clock::now();
    while (generation_.load() == seen) {
      if (yielding_.load() && std::chrono::steady_clock::now() - since < kYieldWindow) {
        sched_yield();
        continue;
      }
      sleepers_.fetch_add(1);  // before the futex re-checks the generation: no lost wake-up
      syscall(SYS_futex, &generation_, FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0);
      sleepers_.fetch_sub(1);
      since = std::chrono::steady_clock::now();
    }
    return generation_.load();
  }

  std::mutex mutex_;  // one job at a time; held by the caller for the whole job
  int64_t started_ = 0;  // helpers made so far (under mutex_)
  Task task_ = nullptr;
  const void* worker_ = nullptr;
  std::atomic<int64_t>* next_ = nullptr;
  std::atomic<int64_t> seats_{0};  // helpers that may still join this job
  std::atomic<bool> open_{false};
  std::atomic<int64_t> inside_{0};  // helpers between entering and leaving a job
  alignas(64) std::atomic<uint32_t> generation_{0};  // a futex word: bumped per job
  std::atomic<int64_t> sleepers_{0};
  std::atomic<bool> yielding_{true};  // helpers yield between jobs (else sleep at once)
  int jobs_ = 0, misses_ = 0;  // this window's (under mutex_)
};

}  // namespace loom_parallel

// Calls worker(next) once on each of up to at::get_num_threads() threads; the worker loops
// `for (i; (i = next++) < n;)` and may keep per-thread state (buffers) across the indices it
// takes.
template <typename Worker>
inline void parallel_dynamic(int64_t n, const Worker& worker) {
  std::atomic<int64_t> next{0};
  const int64_t num_threads = std::min<int64_t>(n, at::get_num_threads());
  const auto task = [](const void* w, std::atomic<int64_t>& counter) {
    loom_parallel::in_job = true;
    (*static_cast<const Worker*>(w))(counter);
    loom_parallel::in_job = false;
  };
  if (num_threads <= 1 || loom_parallel::in_job ||
      !loom_parallel::Pool::instance().run(num_threads - 1, task, &worker, next))
    worker(next);
}

// The Python side of the shared pool (kernels.py): `pool_address` of the first extension
// loaded, handed to `adopt_pool` of each other one.
#define LOOM_POOL_BINDINGS(m)                                                        \
  m.def("pool_address",                                                             \
        [] { return reinterpret_cast<intptr_t>(&loom_parallel::Pool::instance()); }); \
  m.def("adopt_pool", [](intptr_t address) {                                        \
    loom_parallel::Pool::adopt(reinterpret_cast<loom_parallel::Pool*>(address));    \
  })
