// loom: paged_attention.cpp's rows and tiles: the decode call's arguments (DecodeArgs), the
// tiles its rows are cut into and how threads share them out, and each tile's query load,
// normalization and output store, which every SIMD width's kernel (paged_attention_simd.h)
// shares. The layout and plan are described at the top of paged_attention.cpp.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <vector>

#include "parallel_dynamic.h"

constexpr int64_t kBlockSize = 16;

// How many blocks ahead the AVX-512 kernel prefetches K (and V in the p.V pass): one ahead
// left it waiting on memory, four evicted what it was about to read
// (benchmarks/kernels/decode_kernel.py --layers 30 times them over caches too big to stay
// cached, as in the model).
constexpr int64_t kPrefetchBlocks = 2;

// Below this much work (context positions x kv heads, summed over the requests) a decode call
// runs on the calling thread: handing it to other threads cost more than splitting saved for a
// single short request. Measured when parallel_dynamic ran on torch's sleeping OpenMP threads;
// its own helpers (parallel_dynamic.h) wake faster, and the threshold was not re-tuned for them
// (benchmarks/engine/decode_step_ops.py times the step).
constexpr int64_t kParallelWork = 2048;

// parallel_dynamic when the work is worth the other threads, else the worker on this thread.
template <typename Worker>
static void parallel_if(bool worth_it, int64_t n, const Worker& worker) {
  if (worth_it) return parallel_dynamic(n, worker);
  std::atomic<int64_t> next{0};
  worker(next);
}

// Tiles per thread from which a thread takes whole tiles, all their kv heads (for_each_item).
constexpr int64_t kTilesPerThread = 4;

// The tiles a call needs for its threads to take whole ones (for_each_item); calls with fewer
// rows have their long contexts cut into spans up to about that many (attend).
static int64_t tiles_for_threads() { return kTilesPerThread * at::get_num_threads(); }


// A work item's query rows: the G heads of `tokens` consecutive rows from `first`. A prefill
// chunk's tokens (and a decode's draft tokens) come as consecutive rows of one request, each
// over its blocks up to its own position: a tile of them reads each K and V block once for
// all of its tokens instead of once per token.
//
//   rows first .. first+2 of a chunk, one kv head, block size 16:
//     table (the tile's last row's)  [ b7 ][ b2 ][ b9 ]
//     row first     (len 35)         ==================  positions 0-34
//     row first + 1 (len 36)         ===================
//     row first + 2 (len 37)         ====================
//   q.K runs over the last row's 37 positions for all three rows; each row's softmax covers its
//   own length and zeroes the rest, so p.V over 37 positions adds nothing past a row's end.
struct Tile {
  int64_t first;
  int tokens;
};

// Requests arrive sorted by context length, shortest first. Threads take their items (tiles,
// or (tile, kv head) pairs: for_each_item) one at a time (parallel_dynamic.h), longest first,
// so the short ones at the end even out the threads' finishing times.
static inline int64_t longest_first(int64_t k, int64_t n) { return n - 1 - k; }

// One decode-attention call: query i's head h is at q + i * q_row + h * D and its output at
// out + i * out_row + h * D (rows of a fused QKV projection, or of a tensor of their own);
// request i's context is lens[i] positions in the blocks bt[i * max_blocks ...].
template <typename T, typename C>
struct DecodeArgs {
  const T* q;
  int64_t q_row;
  T* out;
  int64_t out_row;
  const C* kc;
  const C* vc;
  int64_t ks[4], vs[4];  // cache strides, indexed [block, position, kv head, dim]
  const int64_t* bt;
  const int64_t* lens;
  int64_t n, KVH, max_blocks;
  float scale;
  float* lse = nullptr;  // if set: each row's log-sum-exp of its scores, [n, KVH * G]
  // if set: row i attends to positions starts[i] .. lens[i] - 1 (a sliding window), else all
  const int64_t* starts = nullptr;
  float softcap = 0.f;  // if > 0: scores -> softcap * tanh(scores / softcap)
  const float* sinks = nullptr;  // if set: each query head's sink logit, [KVH * G]

  const int64_t* table(int64_t i) const { return bt + i * max_blocks; }
  int64_t start(int64_t i) const { return starts != nullptr ? starts[i] : 0; }
  // kv head kh's K rows ([dim, position]) and V rows ([position, dim]) in cache block `block`
  const C* k_block(int64_t block, int64_t kh) const { return kc + block * ks[0] + kh * ks[2]; }
  const C* v_block(int64_t block, int64_t kh) const { return vc + block * vs[0] + kh * vs[2]; }
};

// Whether the call's positions to attend (x kv heads) are worth the other threads.
template <typename T, typename C>
static bool worth_threads(const DecodeArgs<T, C>& a) {
  int64_t work = 0;
  for (int64_t i = 0; i < a.n && work < kParallelWork; ++i)
    work += (a.lens[i] - a.start(i)) * a.KVH;
  return work >= kParallelWork;
}

// Whether rows first .. first + tokens - 1 can share the last one's block table: each row's
// blocks are that table's first blocks, and its context ends at most a block before the
// last row's (work past a row's end is wasted, so only near neighbours share).
template <typename T, typename C>
static bool shares_table(const DecodeArgs<T, C>& a, int64_t first, int tokens) {
  const int64_t last = first + tokens - 1;
  const int64_t* table = a.table(last);
  for (int64_t r = first; r < last; ++r) {
    if (a.lens[r] > a.lens[last] || a.lens[last] - a.lens[r] > kBlockSize) return false;
    const int64_t blocks = (a.lens[r] + kBlockSize - 1) / kBlockSize;
    if (!std::equal(table, table + blocks, a.table(r))) return false;
  }
  return true;
}

// The rows as tiles of `tokens` rows where they share a table (shares_table), else of one.
template <typename T, typename C>
static std::vector<Tile> tile_rows(const DecodeArgs<T, C>& a, int tokens) {
  std::vector<Tile> tiles;
  for (int64_t r = 0; r < a.n;) {
    const int count = tokens > 1 && r + tokens <= a.n && shares_table(a, r, tokens) ? tokens : 1;
    tiles.push_back({r, count});
    r += count;
  }
  return tiles;
}

// item(tile, kh, scores) for every (tile, kv head) pair, on the threads parallel_if picks,
// longest first; scores is the thread's buffer, reused across its items.
//
// Where there are tiles enough to keep every thread busy (kTilesPerThread each), a thread
// takes a whole tile and runs its kv heads one after the other, instead of taking (tile, kv
// head) pairs. A block's kv heads lie side by side in the cache ([block, kv head, ...]), and
// one kv head's share of a block is a short run (2 KB for SmolLM2 at fp16): taken by
// different threads at different times, each was a random read of its own, and memory streams
// short runs at random places much slower than longer ones (benchmarks/kernels/random_reads.py;
// the kernel before and after: decode_kernel.py --layers 30 --against). Fewer tiles (one long
// request) keep the pairs, so that its kv heads run in parallel.
template <typename T, typename C, typename Item>
static void for_each_item(const DecodeArgs<T, C>& a, const std::vector<Tile>& tiles,
                          const Item& item) {
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
  const bool by_tile = num_tiles >= tiles_for_threads();
  const int64_t n = by_tile ? num_tiles : num_tiles * a.KVH;
  parallel_if(worth_threads(a), n, [&](std::atomic<int64_t>& next) {
    std::vector<float> scores;
    for (int64_t idx; (idx = next++) < n;) {
      if (!by_tile) {
        item(tiles[longest_first(idx / a.KVH, num_tiles)], idx % a.KVH, scores);
        continue;
      }
      for (int64_t kh = 0; kh < a.KVH; ++kh)
        item(tiles[longest_first(idx, num_tiles)], kh, scores);
    }
  });
}

// Query row r of a tile is head kh * G + r % G of its row first + r / G.
template <int G>
static inline int64_t row_of(const Tile& t, int r) { return t.first + r / G; }

// The tile's R = G x tile tokens query rows of kv head kh, scaled, as fp32.
template <int G, typename T, typename C, int R, int D>
static inline void load_query(const DecodeArgs<T, C>& a, const Tile& t, int64_t kh,
                              float (&qf)[R][D]) {
  for (int r = 0; r < R; ++r)
    for (int d = 0; d < D; ++d)
      qf[r][d] = static_cast<float>(a.q[row_of<G>(t, r) * a.q_row + (kh * G + r % G) * D + d]) *
                 a.scale;
}

template <int G, typename T, typename C, int R, int D>
static inline void store_output(const float (&acc)[R][D], const DecodeArgs<T, C>& a,
                                const Tile& t, int64_t kh) {
  for (int r = 0; r < R; ++r)
    for (int d = 0; d < D; ++d)
      a.out[row_of<G>(t, r) * a.out_row + (kh * G + r % G) * D + d] = static_cast<T>(acc[r][d]);
}

static inline float softmax(float* s, int64_t L, const float* sink);
static inline void soft_cap(float* s, int64_t L, float cap);

// A tile's context: the blocks from the first its rows attend to (the window's, else the
// first) up to its last row's end. `first` is the position that starts block table[0];
// lengths count from there.
struct TileContext {
  int64_t len, num_blocks, padded_len;
  const int64_t* table;
  int64_t first;
};

template <typename T, typename C>
static inline TileContext tile_context(const DecodeArgs<T, C>& a, const Tile& t) {
  const int64_t last = t.first + t.tokens - 1;
  int64_t skipped = a.start(last) / kBlockSize;  // blocks wholly before every row's window
  for (int64_t r = t.first; r < last; ++r) skipped = std::min(skipped, a.start(r) / kBlockSize);
  const int64_t num_blocks = (a.lens[last] + kBlockSize - 1) / kBlockSize - skipped;
  const int64_t first = skipped * kBlockSize;
  return {a.lens[last] - first, num_blocks, num_blocks * kBlockSize, a.table(last) + skipped,
          first};
}

// Each of the R score rows (row stride `row`, scores over the tile's context c) to
// probabilities over its own row's positions (its window's, up to its length), zero elsewhere.
template <int G, int R, typename T, typename C>
static inline void normalize_rows(const DecodeArgs<T, C>& a, const Tile& t, int64_t kh,
                                  float* scores, int64_t row, const TileContext& c) {
  for (int r = 0; r < R; ++r) {
    const int64_t i = row_of<G>(t, r), head = kh * G + r % G;
    const int64_t lo = a.start(i) - c.first, hi = a.lens[i] - c.first;
    float* s = scores + r * row;
    if (a.softcap > 0.f) soft_cap(s + lo, hi - lo, a.softcap);
    const float lse = softmax(s + lo, hi - lo, a.sinks != nullptr ? a.sinks + head : nullptr);
    if (a.lse != nullptr) a.lse[i * a.KVH * G + head] = lse;
    std::fill(s, s + lo, 0.f);
    std::fill(s + hi, s + c.len, 0.f);
  }
}

// Query tokens per tile: the G heads of each token take registers in q.K and p.V, and up to
// six rows fit AVX2's sixteen; a kv head with more query heads than three runs one token.
template <int G>
constexpr int kTileTokens = G <= 3 ? 6 / G : 1;
