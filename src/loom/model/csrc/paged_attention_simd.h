// loom: paged_attention.cpp's per-tile kernels: q.K over a tile's blocks, the softmax and
// p.V, on AVX2 with intrinsics, on AVX-512 the same plan 16 wide (SimdPlan), elsewhere a
// portable version left to the compiler's vectorizer. Each attends one Tile (attend_tile).
#pragma once
#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "avx2_reduce.h"
#include "paged_attention_tiles.h"

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

// The vector operations of the q.K and p.V passes, overloaded on the vector type (load and
// set1 take a value of it for a tag) so that one Lanes (below) serves both widths.
template <typename C>
static inline __m256 lanes_load(__m256, const C* p) { return load8(p); }
static inline __m256 lanes_set1(__m256, float x) { return _mm256_set1_ps(x); }
static inline __m256 lanes_fmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
static inline void lanes_store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

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

template <typename C>
static inline __m512 lanes_load(__m512, const C* p) { return load16(p); }
static inline __m512 lanes_set1(__m512, float x) { return _mm512_set1_ps(x); }
static inline __m512 lanes_fmadd(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
static inline void lanes_store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
#endif  // __AVX512F__

// One vector width's operations (Vec: __m256 or __m512), for the passes both SIMD kernels
// share; defined after both widths' overloads, which its calls find by ordinary lookup.
template <typename Vec>
struct Lanes {
  using V = Vec;
  static constexpr int kWidth = sizeof(V) / sizeof(float);
  template <typename C>
  static V load(const C* p) { return lanes_load(V{}, p); }
  static V set1(float x) { return lanes_set1(V{}, x); }
  static V fmadd(V a, V b, V c) { return lanes_fmadd(a, b, c); }
  static void store(float* p, V v) { lanes_store(p, v); }
};

#if defined(__AVX512F__) || defined(LOOM_AVX512_ON_AVX2)
// AVX-512: q.K takes two blocks a step (a block's 16 positions are one vector), and p.V holds
// the R rows' accumulators for 64 dims (32 past 4 rows) in registers.
struct SimdPlan {
  using L = Lanes<__m512>;
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
  using L = Lanes<__m256>;
  static constexpr int kScoreBlocks = 1;
  static constexpr int64_t kAhead = 1;
  template <int R, int D>
  static constexpr int value_dims() { return R <= 6 ? 16 : 8; }
};
#endif  // __AVX512F__

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
