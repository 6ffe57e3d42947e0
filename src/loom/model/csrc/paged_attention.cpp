// loom: decode attention straight from the paged KV cache, one query token per row, no
// gather; consecutive rows over one block table (a short prefill chunk's tokens, a decode's
// drafts) attend a tile of tokens at a time (Tile, below). Caches are indexed [block,
// position in block, kv head, dim] through their strides. K must have position stride 1
// (stored [blocks, kv_heads, dim, block_size], see new_kv_cache) so that q.K over a block is a
// vector FMA across its positions per dim, with the block's scores held in registers; V must
// have dim stride 1 so that p.V is a vector FMA across dims, with the tile's query rows'
// accumulators held in registers (new_kv_cache stores it [blocks, kv_heads, block_size, dim],
// so that one kv head's block is one contiguous run). Both need the shape known at compile
// time, hence the dispatch over (G query heads per kv head, head dim); other shapes use the
// torch path (`supported`). Work is split over tiles, or over (tile, kv head) pairs where the
// tiles are too few for the threads (for_each_item); a few long contexts are first cut into
// spans merged after (attend_spans). On AVX2 an intrinsics version
// (below) reads each K block once for all the tile's query rows and prefetches the next block;
// on AVX-512 the same plan runs 16 wide; elsewhere a portable version relies on the
// compiler's vectorizer. The model calls it through rope_write_decode (at the end), which also
// ropes q and k and writes the step's K/V: one call per layer from the QKV projection to the
// decode rows' output.
//
// The caches may hold a narrower type than the queries: fp32 queries over an fp16 cache (the
// layout llama.cpp uses by default) read half the bytes, and decode attention over long
// contexts is bound by those reads. Scores and sums stay fp32 either way.
//
// A layer's variants (attention.LayerAttention): a sliding window W, where the row at
// position p attends to positions p - W + 1 .. p only, and the blocks wholly before that are
// never read (their table entries may be any id: the sliding layers' KV group frees them);
// a softcap c, scores -> c tanh(scores / c) before the softmax (Gemma 2); per query head an
// attention sink, a learned logit that joins the softmax's denominator and nothing else
// (gpt-oss). A window is each row's first attended position (DecodeArgs::starts), so tiles
// and spans, which cut rows their own way, carry it as data:
//
//   W = 20, block size 16, a row of length 50 (query at 49) attends 30 .. 49:
//     table          [ b7 ][ b2 ][ b9 ][ b4 ]
//     positions       0-15  16-31 32-47 48-49
//     read                  ====  ====  ==      from b2 (its 30, 31), b9, b4; b7 never
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "avx2_reduce.h"
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

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const c10::BFloat16* p) {  // bf16 -> fp32 is a 16-bit shift
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline __m256 load8(const c10::Half* p) {  // F16C, which every AVX2 CPU has
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// e^x for x <= 0 (scores minus their maximum), 8 at a time: x = n ln 2 + r, |r| <= ln 2 / 2,
// e^r by Cephes' degree-5 polynomial (about 1 ulp), times 2^n through the exponent bits. Below
// -87 the result would be denormal: it is 0, as expf's would round to within 1e-38 of.
static inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(-87.0f);
  const __m256 underflow = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lowest);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                        5.0000001201e-1f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i scale = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(scale)));
}

// Scores of L positions -> probabilities, in place, 8 positions a vector (at short contexts
// std::exp one position at a time was most of a request's attention); returns the scores'
// log-sum-exp. sink (if set): a logit that joins the denominator only.
static inline float softmax(float* s, int64_t L, const float* sink) {
  const int64_t L8 = L / 8 * 8;
  __m256 mv = _mm256_set1_ps(s[0]);  // L >= 1
  for (int64_t p = 0; p < L8; p += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + p));
  float m = hmax(mv);
  for (int64_t p = L8; p < L; ++p) m = std::max(m, s[p]);
  if (sink != nullptr) m = std::max(m, *sink);
  const __m256 mb = _mm256_set1_ps(m);
  __m256 sv = _mm256_setzero_ps();
  for (int64_t p = 0; p < L8; p += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + p), mb));
    _mm256_storeu_ps(s + p, e);
    sv = _mm256_add_ps(sv, e);
  }
  float sum = hsum(sv) + (sink != nullptr ? std::exp(*sink - m) : 0.f);
  for (int64_t p = L8; p < L; ++p) { s[p] = std::exp(s[p] - m); sum += s[p]; }
  const float inv = 1.f / sum;
  for (int64_t p = 0; p < L8; p += 8)
    _mm256_storeu_ps(s + p, _mm256_mul_ps(_mm256_set1_ps(inv), _mm256_loadu_ps(s + p)));
  for (int64_t p = L8; p < L; ++p) s[p] *= inv;
  return m + std::log(sum);
}

// Scores x -> cap tanh(x / cap), in place, 8 at a time: tanh |y| = (1 - e) / (1 + e) with
// e = e^(-2 |y|) <= 1 (exp_nonpositive), the sign put back from y.
static inline void soft_cap(float* s, int64_t L, float cap) {
  const int64_t L8 = L / 8 * 8;
  const __m256 inv = _mm256_set1_ps(1.f / cap), capv = _mm256_set1_ps(cap);
  const __m256 sign = _mm256_set1_ps(-0.f), one = _mm256_set1_ps(1.f);
  for (int64_t p = 0; p < L8; p += 8) {
    const __m256 y = _mm256_mul_ps(_mm256_loadu_ps(s + p), inv);
    const __m256 e = exp_nonpositive(_mm256_mul_ps(_mm256_set1_ps(-2.f),
                                                   _mm256_andnot_ps(sign, y)));
    const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    _mm256_storeu_ps(s + p, _mm256_mul_ps(capv, _mm256_or_ps(t, _mm256_and_ps(sign, y))));
  }
  for (int64_t p = L8; p < L; ++p) s[p] = cap * std::tanh(s[p] / cap);
}

// Block tables scatter a request's context, so the hardware prefetcher stalls at every block:
// fetch the next block's rows (of row_bytes each) while this one is computed.
// The V block is also asked for, into L2, while the K pass reads its K block: a core here
// streams about half the machine's bandwidth at most, and without that the p.V pass waited on
// every V block it reached.
template <int Hint = _MM_HINT_T0, typename T>
static inline void prefetch_block(const T* base, int64_t rows, int64_t row_stride,
                                  int64_t row_bytes) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < row_bytes; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(base + r * row_stride) + b,
                   static_cast<_mm_hint>(Hint));
}

template <int D, int Hint = _MM_HINT_T0, typename T, typename C>
static inline void prefetch_k(const DecodeArgs<T, C>& a, int64_t block, int64_t kh) {
  prefetch_block<Hint>(a.k_block(block, kh), D, a.ks[3], kBlockSize * sizeof(C));
}

template <int D, int Hint = _MM_HINT_T0, typename T, typename C>
static inline void prefetch_v(const DecodeArgs<T, C>& a, int64_t block, int64_t kh) {
  prefetch_block<Hint>(a.v_block(block, kh), kBlockSize, a.vs[1], D * sizeof(C));
}

// One vector width's operations, for the p.V pass both SIMD kernels share.
struct Lanes8 {
  using V = __m256;
  static constexpr int kWidth = 8;
  template <typename C>
  static V load(const C* p) { return load8(p); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
};

// p.V: acc[g] = sum over positions of probability x V row. A block's positions are taken for a
// slice of DC dims at a time, the G heads' accumulators for that slice in registers, so the V
// block is read from L1 D / DC times instead of the accumulators going through memory for every
// position; the V block `Ahead` blocks on is prefetched meanwhile.
template <typename L, int DC, int Ahead, typename T, typename C, int G, int D>
static inline void weighted_values(const DecodeArgs<T, C>& a, const int64_t* table,
                                   int64_t num_blocks, int64_t len, int64_t kh,
                                   const float* scores, int64_t row, float (&acc)[G][D]) {
  constexpr int64_t BS = kBlockSize;
  constexpr int N = DC / L::kWidth;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const C* vb = a.v_block(table[b], kh);
    if (b + Ahead < num_blocks) prefetch_v<D>(a, table[b + Ahead], kh);
    const int64_t positions = std::min(BS, len - b * BS);
    for (int dc = 0; dc < D; dc += DC) {
      typename L::V acc_v[G][N];
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < N; ++j) acc_v[g][j] = L::load(&acc[g][dc + L::kWidth * j]);
      for (int64_t p = 0; p < positions; ++p) {
        const C* v = vb + p * a.vs[1] + dc;
        typename L::V vv[N];
        for (int j = 0; j < N; ++j) vv[j] = L::load(v + L::kWidth * j);
        for (int g = 0; g < G; ++g) {
          const typename L::V w = L::set1(scores[g * row + b * BS + p]);
          for (int j = 0; j < N; ++j) acc_v[g][j] = L::fmadd(w, vv[j], acc_v[g][j]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < N; ++j) L::store(&acc[g][dc + L::kWidth * j], acc_v[g][j]);
    }
  }
}

#if defined(__AVX512F__) || defined(LOOM_AVX512_ON_AVX2)
#if !defined(__AVX512F__)
#include "avx512_on_avx2.h"  // tests: this kernel on an AVX2 CPU
#endif
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

struct Lanes16 {
  using V = __m512;
  static constexpr int kWidth = 16;
  template <typename C>
  static V load(const C* p) { return load16(p); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
};

// AVX-512: q.K takes two blocks a step (a block's 16 positions are one vector), and p.V holds
// the R rows' accumulators for 64 dims (32 past 4 rows) in registers.
struct SimdPlan {
  using L = Lanes16;
  static constexpr int kScoreBlocks = 2;
  static constexpr int64_t kAhead = kPrefetchBlocks;
  template <int R, int D>
  static constexpr int value_dims() { return std::min(D, R <= 4 ? 64 : 32); }
};
#else
// AVX2: each K block is read once for all R rows (scores of 16 positions x R rows in
// registers, two vectors a row), and p.V takes 16 dims a pass (2 * R accumulators; 8 past 6
// rows).
struct SimdPlan {
  using L = Lanes8;
  static constexpr int kScoreBlocks = 1;
  static constexpr int64_t kAhead = 1;
  template <int R, int D>
  static constexpr int value_dims() { return R <= 6 ? 16 : 8; }
};
#endif  // __AVX512F__

// q.K for NB blocks at once (a block's 16 positions are 16 / L::kWidth vectors): each
// broadcast of a query value serves NB blocks, and R * N independent sums cover the FMA
// latency.
template <typename L, typename C, int R, int D, int NB>
static inline void block_scores(const C* const (&kb)[NB], int64_t dim_stride,
                                const float (&qf)[R][D], float* scores, int64_t row) {
  constexpr int PerBlock = kBlockSize / L::kWidth, N = NB * PerBlock;
  typename L::V s[R][N];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < N; ++j) s[r][j] = L::set1(0.f);
  for (int d = 0; d < D; ++d) {
    typename L::V k[N];
    for (int j = 0; j < N; ++j)
      k[j] = L::load(kb[j / PerBlock] + d * dim_stride + L::kWidth * (j % PerBlock));
    for (int r = 0; r < R; ++r) {
      const typename L::V qd = L::set1(qf[r][d]);
      for (int j = 0; j < N; ++j) s[r][j] = L::fmadd(qd, k[j], s[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < N; ++j) L::store(scores + r * row + L::kWidth * j, s[r][j]);
}

// One q.K step: the scores of blocks b .. b + NB - 1 (J: 0 .. NB - 1), the K blocks
// Plan::kAhead past them prefetched, and their V blocks asked into L2 for the p.V pass.
template <typename Plan, int NB, typename T, typename C, int R, int D, size_t... J>
static inline void score_step(const DecodeArgs<T, C>& a, const int64_t* table,
                              int64_t num_blocks, int64_t b, int64_t kh,
                              const float (&qf)[R][D], float* scores, int64_t row,
                              std::index_sequence<J...>) {
  for (int64_t ahead = b + NB; ahead < std::min(b + NB + Plan::kAhead, num_blocks); ++ahead)
    prefetch_k<D>(a, table[ahead], kh);
  (prefetch_v<D, _MM_HINT_T1>(a, table[b + J], kh), ...);
  const C* const kb[NB] = {a.k_block(table[b + J], kh)...};
  block_scores<typename Plan::L, C, R, D, NB>(kb, a.ks[3], qf, scores + b * kBlockSize, row);
}

// Either SIMD width (SimdPlan): q.K in steps of kScoreBlocks blocks, the softmax, then p.V
// (weighted_values) with its first kAhead V blocks prefetched.
template <typename T, typename C, int G, int D, int QT>
static void attend_tile(const DecodeArgs<T, C>& a, const Tile& t, int64_t kh,
                        std::vector<float>& scores) {
  using Plan = SimdPlan;
  constexpr int R = G * QT, NB = Plan::kScoreBlocks;
  constexpr int DC = Plan::template value_dims<R, D>();
  static_assert(kBlockSize % Plan::L::kWidth == 0 && D % DC == 0, "blocks of whole vectors");
  const TileContext c = tile_context(a, t);
  const int64_t num_blocks = c.num_blocks, Lp = c.padded_len;
  const int64_t* table = c.table;
  float qf[R][D];
  load_query<G>(a, t, kh, qf);
  scores.resize(R * Lp);
  float* s = scores.data();
  int64_t b = 0;
  for (; b + NB <= num_blocks; b += NB)
    score_step<Plan, NB>(a, table, num_blocks, b, kh, qf, s, Lp, std::make_index_sequence<NB>());
  for (; b < num_blocks; ++b)
    score_step<Plan, 1>(a, table, num_blocks, b, kh, qf, s, Lp, std::make_index_sequence<1>());
  for (int64_t ahead = 0; ahead < std::min(Plan::kAhead, num_blocks); ++ahead)
    prefetch_v<D>(a, table[ahead], kh);
  normalize_rows<G, R>(a, t, kh, s, Lp, c);
  float acc[R][D] = {};
  weighted_values<typename Plan::L, DC, Plan::kAhead>(a, table, num_blocks, c.len, kh, s, Lp,
                                                      acc);
  store_output<G>(acc, a, t, kh);
}
#else
// Scores of L positions -> probabilities, in place; returns the scores' log-sum-exp. sink (if
// set): a logit that joins the denominator only.
static inline float softmax(float* s, int64_t L, const float* sink) {
  float m = *std::max_element(s, s + L);
  if (sink != nullptr) m = std::max(m, *sink);
  float sum = sink != nullptr ? std::exp(*sink - m) : 0.f;
  for (int64_t p = 0; p < L; ++p) { s[p] = std::exp(s[p] - m); sum += s[p]; }
  const float inv = 1.f / sum;
  for (int64_t p = 0; p < L; ++p) s[p] *= inv;
  return m + std::log(sum);
}

static inline void soft_cap(float* s, int64_t L, float cap) {
  for (int64_t p = 0; p < L; ++p) s[p] = cap * std::tanh(s[p] / cap);
}

template <typename T, typename C, int G, int D, int QT>
static void attend_tile(const DecodeArgs<T, C>& a, const Tile& t, int64_t kh,
                        std::vector<float>& scores) {
  constexpr int64_t BS = kBlockSize;
  constexpr int R = G * QT;
  const TileContext c = tile_context(a, t);
  const int64_t L = c.len;  // rows padded: L + BS
  const int64_t* table = c.table;
  float qf[R][D];
  load_query<G>(a, t, kh, qf);
  scores.resize(R * (L + BS));
  for (int64_t b = 0; b * BS < L; ++b) {
    const C* kb = a.k_block(table[b], kh);
    for (int r = 0; r < R; ++r) {
      float s[BS] = {};
      for (int d = 0; d < D; ++d) {
        const float qd = qf[r][d];
        const C* krow = kb + d * a.ks[3];
#pragma omp simd
        for (int64_t p = 0; p < BS; ++p) s[p] += qd * static_cast<float>(krow[p]);
      }
      std::copy_n(s, BS, &scores[r * (L + BS) + b * BS]);  // row padded: whole blocks
    }
  }
  normalize_rows<G, R>(a, t, kh, scores.data(), L + BS, c);
  float acc[R][D] = {};
  for (int64_t p = 0; p < L; ++p) {
    const C* v = a.v_block(table[p / BS], kh) + (p % BS) * a.vs[1];
    float vf[D];
#pragma omp simd
    for (int d = 0; d < D; ++d) vf[d] = static_cast<float>(v[d]);
    for (int r = 0; r < R; ++r) {
      const float w = scores[r * (L + BS) + p];
#pragma omp simd
      for (int d = 0; d < D; ++d) acc[r][d] += w * vf[d];
    }
  }
  store_output<G>(acc, a, t, kh);
}

#endif

// Every row's attention, in tiles where rows share a block table (tile_rows).
template <typename T, typename C, int G, int D>
static void decode(const DecodeArgs<T, C>& a) {
  constexpr int QT = kTileTokens<G>;
  const std::vector<Tile> tiles = tile_rows(a, QT);
  for_each_item(a, tiles, [&](const Tile& t, int64_t kh, std::vector<float>& scores) {
    if (t.tokens == QT) return attend_tile<T, C, G, D, QT>(a, t, kh, scores);
    attend_tile<T, C, G, D, 1>(a, t, kh, scores);
  });
}

// (G, D) instantiated; anything else goes through torch. Head dim 256 is Gemma 3's (4, 2 or 8
// query heads per kv head there), so only the power-of-two G are built for it.
#define LOOM_FOR_EACH_SHAPE(X) \
  X(1, 64) X(2, 64) X(3, 64) X(4, 64) X(5, 64) X(6, 64) X(7, 64) X(8, 64) \
  X(1, 128) X(2, 128) X(3, 128) X(4, 128) X(5, 128) X(6, 128) X(7, 128) X(8, 128) \
  X(1, 256) X(2, 256) X(4, 256) X(8, 256)

// The (query, cache) types instantiated: fp32 over fp32 or fp16, bf16 over bf16.
static bool supported_types(c10::ScalarType dtype, c10::ScalarType cache_dtype) {
  return (dtype == at::kFloat && (cache_dtype == at::kFloat || cache_dtype == at::kHalf)) ||
         (dtype == at::kBFloat16 && cache_dtype == at::kBFloat16);
}

bool supported(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
               c10::ScalarType dtype, c10::ScalarType cache_dtype) {
  if (block_size != kBlockSize || num_heads % num_kv_heads != 0 ||
      !supported_types(dtype, cache_dtype))
    return false;
  const int64_t G = num_heads / num_kv_heads;
#define LOOM_MATCH(g, d) if (G == g && head_dim == d) return true;
  LOOM_FOR_EACH_SHAPE(LOOM_MATCH)
#undef LOOM_MATCH
  return false;
}

template <typename T, typename C>
static void decode_shape(const DecodeArgs<T, C>& a, int64_t G, int64_t D) {
#define LOOM_CALL(g, d) if (G == g && D == d) return decode<T, C, g, d>(a);
  LOOM_FOR_EACH_SHAPE(LOOM_CALL)
#undef LOOM_CALL
}

// fn(T{}, C{}) for the query and cache element types (the pairs `supported_types` admits).
template <typename Fn>
static void for_dtypes(c10::ScalarType dtype, c10::ScalarType cache_dtype, const Fn& fn) {
  if (dtype == at::kBFloat16) fn(c10::BFloat16{}, c10::BFloat16{});
  else if (cache_dtype == at::kHalf) fn(float{}, c10::Half{});
  else fn(float{}, float{});
}

static void check_caches(const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                         const torch::Tensor& block_tables, const torch::Tensor& context_lens) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "caches [blocks, block_size, kv_heads, dim], of one dtype");
  TORCH_CHECK(k_cache.stride(1) == 1, "K cache needs position stride 1 (see new_kv_cache)");
  TORCH_CHECK(v_cache.stride(3) == 1, "V cache needs dim stride 1");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.scalar_type() == at::kLong &&
                  context_lens.is_contiguous(), "context_lens: contiguous int64 [n]");
  TORCH_CHECK(context_lens.size(0) == 0 ||  // no decodes: any empty table
                  (block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong &&
                   block_tables.is_contiguous() && block_tables.size(0) == context_lens.size(0)),
              "block_tables: contiguous int64 [n, max_blocks]");
}

// Rows too few for every thread to take kTilesPerThread tiles leave threads idle, and read
// each kv head's share of a block as a run of its own (for_each_item). So a long context
// among them is cut into spans of blocks, each span attended as a row of its own that also
// gives the log-sum-exp (lse) of its scores, and the spans' outputs are merged after, as
// flash-decoding does:
//
//   row i, 40 blocks, 3 spans:   [ b0 .. b13 ][ b14 .. b27 ][ b28 .. b39 ]
//                                 out_0, lse_0  out_1, lse_1   out_2, lse_2
//   out_i = sum_s w_s out_s / (sum_s w_s + w_sink),   w_s = exp(lse_s - top),
//   w_sink = exp(sink - top) (0 without sinks),        top = max(max_s lse_s, sink)
//
// Only the blocks a row attends to are cut (a window's, from the block its first position is
// in), and the first span starts at that position: each span is a row of its own, with a
// start. The sink joins the merge, once, not each span's softmax.
//
// Spans are at least kMinSpanBlocks blocks, and as many as bring the rows to about
// kTilesPerThread per thread, in proportion to each row's blocks; contexts too short to make
// that many are not cut (fewer spans than that measured slower than none: the threads then
// take (span, kv head) pairs, and the copies and the merge cost more than they save).
constexpr int64_t kMinSpanBlocks = 8;

struct Spans {
  std::vector<int64_t> first;          // row i's spans are first[i] .. first[i + 1] - 1
  std::vector<int64_t> tables, lens;   // the spans as rows: [spans, max_blocks], [spans]
  std::vector<int64_t> starts;         // each span's first position attended, [spans]
  int64_t max_blocks = 0;
};

template <typename T, typename C>
static Spans spans_of(const DecodeArgs<T, C>& a, int64_t target) {
  // row i attends to blocks skip[i] .. skip[i] + blocks[i] - 1 of its table
  std::vector<int64_t> skip(a.n), blocks(a.n), per(a.n);
  int64_t total = 0;
  for (int64_t i = 0; i < a.n; ++i) {
    skip[i] = a.start(i) / kBlockSize;
    total += blocks[i] = (a.lens[i] + kBlockSize - 1) / kBlockSize - skip[i];
  }
  Spans sp;
  sp.first.push_back(0);
  if (total < target * kMinSpanBlocks) return sp;  // no spans: first.back() is 0
  for (int64_t i = 0; i < a.n; ++i) {
    const int64_t wanted = (blocks[i] * target + total - 1) / total;
    const int64_t count = std::clamp<int64_t>(wanted, 1,
                                              std::max<int64_t>(1, blocks[i] / kMinSpanBlocks));
    per[i] = (blocks[i] + count - 1) / count;
    sp.max_blocks = std::max(sp.max_blocks, per[i]);
    sp.first.push_back(sp.first.back() + (blocks[i] + per[i] - 1) / per[i]);
  }
  sp.tables.assign(sp.first.back() * sp.max_blocks, 0);
  for (int64_t i = 0; i < a.n; ++i) {
    const int64_t end = skip[i] + blocks[i];
    for (int64_t s = sp.first[i], b0 = skip[i]; s < sp.first[i + 1]; ++s, b0 += per[i]) {
      const int64_t b1 = std::min(end, b0 + per[i]);
      std::copy(a.table(i) + b0, a.table(i) + b1, sp.tables.begin() + s * sp.max_blocks);
      sp.lens.push_back(std::min(a.lens[i], b1 * kBlockSize) - b0 * kBlockSize);
      sp.starts.push_back(std::max<int64_t>(0, a.start(i) - b0 * kBlockSize));
    }
  }
  return sp;
}

// The spans' rows attended (a: the caller's arguments, its rows cut into sp), then merged
// into the caller's rows.
template <typename T, typename C>
static void attend_spans(const DecodeArgs<T, C>& a, const Spans& sp, int64_t H, int64_t D) {
  const int64_t spans = sp.first.back(), row = H * D;
  std::vector<T> q(spans * row), out(spans * row);
  std::vector<float> lse(spans * H);
  for (int64_t i = 0; i < a.n; ++i)
    for (int64_t s = sp.first[i]; s < sp.first[i + 1]; ++s)
      std::copy(a.q + i * a.q_row, a.q + i * a.q_row + row, q.begin() + s * row);
  DecodeArgs<T, C> b = a;
  b.q = q.data(), b.q_row = row, b.out = out.data(), b.out_row = row;
  b.bt = sp.tables.data(), b.lens = sp.lens.data(), b.n = spans, b.max_blocks = sp.max_blocks;
  b.lse = lse.data(), b.starts = sp.starts.data(), b.sinks = nullptr;
  decode_shape<T, C>(b, H / a.KVH, D);
  std::vector<float> acc(D);
  for (int64_t i = 0; i < a.n; ++i)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t first = sp.first[i], last = sp.first[i + 1];
      float top = lse[first * H + h], total = 0.f;
      for (int64_t s = first + 1; s < last; ++s) top = std::max(top, lse[s * H + h]);
      if (a.sinks != nullptr) {
        top = std::max(top, a.sinks[h]);
        total = std::exp(a.sinks[h] - top);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t s = first; s < last; ++s) {
        const float w = std::exp(lse[s * H + h] - top);
        const T* span_out = out.data() + s * row + h * D;
        total += w;
        for (int64_t d = 0; d < D; ++d) acc[d] += w * static_cast<float>(span_out[d]);
      }
      T* row_out = a.out + i * a.out_row + h * D;
      for (int64_t d = 0; d < D; ++d) row_out[d] = static_cast<T>(acc[d] / total);
    }
}

// What a layer's attention does beyond softmax(q.k scale) v (attention.LayerAttention):
// window 0 and softcap 0 for none; sinks undefined for none, else fp32 [heads].
struct Variant {
  int64_t window;
  double softcap;
  const c10::optional<torch::Tensor>& sinks;
};

static void check_variant(const Variant& v, int64_t H) {
  TORCH_CHECK(v.window >= 0 && v.softcap >= 0, "window and softcap must be >= 0 (0: none)");
  TORCH_CHECK(!v.sinks.has_value() ||
                  (v.sinks->dim() == 1 && v.sinks->size(0) == H &&
                   v.sinks->scalar_type() == at::kFloat && v.sinks->is_contiguous()),
              "sinks: contiguous float32 [heads]");
}

// Decode attention over the caches for the n = context_lens.size(0) queries at q (rows of
// q_row elements), into out (rows of out_row).
template <typename T, typename C>
static void attend(const T* q, int64_t q_row, T* out, int64_t out_row, int64_t H,
                   const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                   const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                   double scale, const Variant& variant) {
  if (context_lens.size(0) == 0) return;
  const int64_t KVH = k_cache.size(2), D = k_cache.size(3);
  DecodeArgs<T, C> a{q, q_row, out, out_row, k_cache.data_ptr<C>(), v_cache.data_ptr<C>(),
                  {}, {}, block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
                  context_lens.size(0), KVH, block_tables.size(1), static_cast<float>(scale)};
  for (int j = 0; j < 4; ++j) {
    a.ks[j] = k_cache.stride(j);
    a.vs[j] = v_cache.stride(j);
  }
  std::vector<int64_t> starts;
  if (variant.window > 0) {
    for (int64_t i = 0; i < a.n; ++i)
      starts.push_back(std::max<int64_t>(0, a.lens[i] - variant.window));
    a.starts = starts.data();
  }
  a.softcap = static_cast<float>(variant.softcap);
  if (variant.sinks.has_value()) a.sinks = variant.sinks->data_ptr<float>();
  const int64_t target = tiles_for_threads();
  if (a.n < target && at::get_num_threads() > 1) {  // the one place spans are decided
    const Spans sp = spans_of(a, target);
    if (sp.first.back() >= target) return attend_spans<T, C>(a, sp, H, D);
  }
  decode_shape<T, C>(a, H / KVH, D);
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     double scale, int64_t window, double softcap,
                                     const c10::optional<torch::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3, "q [n, heads, dim]");
  check_caches(k_cache, v_cache, block_tables, context_lens);
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  const Variant variant{window, softcap, sinks};
  check_variant(variant, H);
  TORCH_CHECK(n == context_lens.size(0), "one context length per query");
  TORCH_CHECK(supported(H, k_cache.size(2), D, k_cache.size(1), q.scalar_type(),
                        k_cache.scalar_type()) && D == k_cache.size(3),
              "shape or dtype not supported by the native kernel");
  q = q.contiguous();
  auto out = torch::empty_like(q);
  for_dtypes(q.scalar_type(), k_cache.scalar_type(), [&](auto tag, auto cache_tag) {
    using T = decltype(tag);
    using C = decltype(cache_tag);
    attend<T, C>(q.data_ptr<T>(), H * D, out.data_ptr<T>(), H * D, H, k_cache, v_cache,
                 block_tables, context_lens, scale, variant);
  });
  return out;
}

// Rotate-half RoPE of one head, in place, with the model's tables (cos repeated over both
// halves, sin negated on the first half): x = x * cos + (x2, x1) * sin.
template <typename T>
static inline void rope_head(T* x, const T* c, const T* s, int64_t D) {
  const int64_t half = D / 2;
#pragma omp simd
  for (int64_t d = 0; d < half; ++d) {
    const float x1 = static_cast<float>(x[d]), x2 = static_cast<float>(x[d + half]);
    x[d] = static_cast<T>(x1 * static_cast<float>(c[d]) + x2 * static_cast<float>(s[d]));
    x[d + half] = static_cast<T>(x2 * static_cast<float>(c[d + half]) +
                                 x1 * static_cast<float>(s[d + half]));
  }
}

// One head's D values into a cache row of the cache's type (element stride `stride`).
template <typename T, typename C>
static inline void store_head(const T* x, C* dst, int64_t D, int64_t stride) {
  for (int64_t d = 0; d < D; ++d) dst[d * stride] = static_cast<C>(static_cast<float>(x[d]));
}

#if defined(__AVX2__) && defined(__F16C__)
// fp32 into an fp16 cache, eight at a time with F16C (round to nearest even, as c10::Half's
// conversion, which one value at a time was half of a decode step's RoPE + KV write).
static inline void store_head(const float* x, c10::Half* dst, int64_t D, int64_t stride) {
  for (int64_t d = 0; d < D; d += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(x + d), _MM_FROUND_TO_NEAREST_INT);
    if (stride == 1) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d), h);
      continue;
    }
    alignas(16) uint16_t bits[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(bits), h);
    for (int j = 0; j < 8; ++j) std::memcpy(dst + (d + j) * stride, &bits[j], 2);
  }
}
#endif

// Tokens per task of the RoPE + KV write: a decode step's few tokens stay on the calling
// thread (no fork/join), a prefill chunk's are shared out.
constexpr int64_t kTokensPerTask = 64;

// RoPE on each token's H + KVH query and key heads (rows of qkv, in place), then its keys and
// values into their cache slots (block, offset), converted to the cache's type.
template <typename T, typename C>
static void rope_write(T* qkv, int64_t T_, int64_t H, const T* cos, const T* sin,
                       const int64_t* pos, const int64_t* blocks, const int64_t* offsets,
                       const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
  const int64_t KVH = k_cache.size(2), D = k_cache.size(3), row = (H + 2 * KVH) * D;
  C* kc = k_cache.data_ptr<C>();
  C* vc = v_cache.data_ptr<C>();
  const int64_t k0 = k_cache.stride(0), k1 = k_cache.stride(1), k2 = k_cache.stride(2),
                k3 = k_cache.stride(3), v0 = v_cache.stride(0), v1 = v_cache.stride(1),
                v2 = v_cache.stride(2);
  const int64_t tasks = (T_ + kTokensPerTask - 1) / kTokensPerTask;
  parallel_dynamic(tasks, [&](std::atomic<int64_t>& next) {
    for (int64_t task; (task = next++) < tasks;) {
      for (int64_t t = task * kTokensPerTask; t < std::min(T_, (task + 1) * kTokensPerTask);
           ++t) {
        T* x = qkv + t * row;
        for (int64_t h = 0; h < H + KVH; ++h) rope_head(x + h * D, cos + pos[t] * D,
                                                       sin + pos[t] * D, D);
        for (int64_t kh = 0; kh < KVH; ++kh) {
          const T* k = x + (H + kh) * D;
          const T* v = x + (H + KVH + kh) * D;
          C* kdst = kc + blocks[t] * k0 + offsets[t] * k1 + kh * k2;
          C* vdst = vc + blocks[t] * v0 + offsets[t] * v1 + kh * v2;
          store_head(k, kdst, D, k3);
          store_head(v, vdst, D, 1);
        }
      }
    }
  });
}

// One layer's work between the QKV projection and the output projection, for the rows the
// native kernel takes. qkv [tokens, (H + 2 KVH) D] (q heads, k heads, v heads): q and k are
// roped in place (prefill rows read them back for SDPA), every token's k and v go to its slot
// (slot_blocks, slot_offsets), and the first n = context_lens.size(0) rows, the decodes,
// attend over the caches into their rows of the returned [tokens, H D]; its other rows are
// left for the caller (uninitialized). window, softcap, sinks: the layer's variant (Variant).
torch::Tensor rope_write_decode(torch::Tensor qkv, int64_t num_heads, torch::Tensor cos,
                                torch::Tensor sin, torch::Tensor positions,
                                torch::Tensor k_cache, torch::Tensor v_cache,
                                torch::Tensor slot_blocks, torch::Tensor slot_offsets,
                                torch::Tensor block_tables, torch::Tensor context_lens,
                                double scale, int64_t window, double softcap,
                                const c10::optional<torch::Tensor>& sinks) {
  check_caches(k_cache, v_cache, block_tables, context_lens);
  const int64_t tokens = qkv.size(0), H = num_heads, KVH = k_cache.size(2), D = k_cache.size(3);
  const Variant variant{window, softcap, sinks};
  check_variant(variant, H);
  const auto dtype = qkv.scalar_type();
  TORCH_CHECK(supported(H, KVH, D, k_cache.size(1), dtype, k_cache.scalar_type()) &&
                  cos.scalar_type() == dtype && sin.scalar_type() == dtype,
              "shape or dtype not supported by the native kernel");
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(1) == (H + 2 * KVH) * D,
              "qkv must be a contiguous [tokens, (heads + 2 kv_heads) * head_dim] tensor");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == D && cos.is_contiguous() &&
                  sin.sizes() == cos.sizes() && sin.is_contiguous(),
              "cos, sin: contiguous [positions, head_dim] tables");
  for (const auto* t : {&positions, &slot_blocks, &slot_offsets})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == tokens && t->scalar_type() == at::kLong &&
                    t->is_contiguous(), "positions and slots: contiguous int64 [tokens]");
  TORCH_CHECK(context_lens.size(0) <= tokens, "more decodes than tokens");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* blocks = slot_blocks.data_ptr<int64_t>();
  const int64_t* offsets = slot_offsets.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)  // checked here: a worker thread cannot throw
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0) && blocks[t] >= 0 &&
                    blocks[t] < k_cache.size(0) && offsets[t] >= 0 &&
                    offsets[t] < k_cache.size(1), "position or slot out of range");
  auto out = torch::empty({tokens, H * D}, qkv.options());
  for_dtypes(dtype, k_cache.scalar_type(), [&](auto tag, auto cache_tag) {
    using T = decltype(tag);
    using C = decltype(cache_tag);
    rope_write<T, C>(qkv.data_ptr<T>(), tokens, H, cos.data_ptr<T>(), sin.data_ptr<T>(), pos,
                     blocks, offsets, k_cache, v_cache);
    attend<T, C>(qkv.data_ptr<T>(), qkv.size(1), out.data_ptr<T>(), H * D, H, k_cache,
                 v_cache, block_tables, context_lens, scale, variant);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("paged_decode_attention", &paged_decode_attention, py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"),
        py::arg("window") = 0, py::arg("softcap") = 0.0, py::arg("sinks") = py::none());
  m.def("rope_write_decode", &rope_write_decode, py::arg("qkv"), py::arg("num_heads"),
        py::arg("cos"), py::arg("sin"), py::arg("positions"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("slot_blocks"), py::arg("slot_offsets"),
        py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"),
        py::arg("window") = 0, py::arg("softcap") = 0.0, py::arg("sinks") = py::none());
  m.def("supported", &supported);
  LOOM_POOL_BINDINGS(m);
}
