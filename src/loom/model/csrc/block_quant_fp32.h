// loom: the native matmul's fp32 path (block_quant_linear.cpp: more than `int8_rows` rows).
#pragma once
#include <cstdlib>

#include "block_quant_formats.h"
#include "parallel_dynamic.h"

#ifdef LOOM_HAVE_AVX2

// Input 4g + j of a panel's 8 channels as fp32, from the words of code group g (its 32-byte
// chunk g / 2 for 4-bit codes, low nibbles for even g): word c of a code group holds channel
// c's 4 inputs, one per byte (a nibble of it for 4-bit codes), so input j's 8 channels are the
// group's 8 words shifted and masked, no byte shuffles. Q6_K's words are six_bit_group's, the
// codes joined, one a byte.
template <int Bits>
static LOOM_INLINE __m256 decoded_input(__m256i words, int g, int j, __m256 d, __m256 m) {
  const __m256i q =
      Bits == 4   ? _mm256_and_si256(_mm256_srli_epi32(words, 8 * j + 4 * (g % 2)),
                                     _mm256_set1_epi32(0x0F))
      : Bits == 6 ? _mm256_and_si256(_mm256_srli_epi32(words, 8 * j), _mm256_set1_epi32(0xFF))
                  : _mm256_srai_epi32(_mm256_slli_epi32(words, 24 - 8 * j), 24);
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m);
}

// The words of code group g of a record, as decoded_input takes them.
template <int F>
static LOOM_INLINE __m256i group_words(const uint8_t* rec, int g) {
  if constexpr (F == kQ6K) return six_bit_group(rec, g);
  return _mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(rec + 32 * (code_bits(F) == 4 ? g / 2 : g)));
}

// One 8-channel panel to fp32, into columns half * 8 .. half * 8 + 7 of w [K, 16].
template <int F>
static void decode_panel(const uint8_t* panel, int64_t nb, int half, float* w) {
  constexpr int Bits = code_bits(F);
  constexpr int64_t record = record_bytes(F);
  Super super;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* rec = panel + b * record;
    __m256 d[2], m[2];
    super_scales<F>(panel, b, super);
    half_scales<F>(panel, b, super, d, m);
    float* wb = w + b * kQuantBlock * 16 + 8 * half;
    for (int g = 0; g < 8; ++g) {
      const __m256i words = group_words<F>(rec, g);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j)
        _mm256_store_ps(wb + (4 * g + j) * 16,
                        decoded_input<Bits>(words, g, j, d[g / 4], m[g / 4]));
    }
  }
}

// a0/a1[r] += x[r, k] * the 16 weights of input k (w0: channels 0-7, w1: 8-15), rows r < R.
template <int R>
static LOOM_INLINE void accumulate_input(const float* x, int64_t K, int64_t k, __m256 w0,
                                         __m256 w1, __m256 (&a0)[R], __m256 (&a1)[R]) {
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    const __m256 xv = _mm256_broadcast_ss(x + r * K + k);
    a0[r] = _mm256_fmadd_ps(xv, w0, a0[r]);
    a1[r] = _mm256_fmadd_ps(xv, w1, a1[r]);
  }
}

template <int R>
static LOOM_INLINE void store_tile(__m256 (&a0)[R], __m256 (&a1)[R], float* y, int64_t N,
                                   const float* bias) {
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    if (bias != nullptr) {
      a0[r] = _mm256_add_ps(a0[r], _mm256_loadu_ps(bias));
      a1[r] = _mm256_add_ps(a1[r], _mm256_loadu_ps(bias + 8));
    }
    _mm256_storeu_ps(y + r * N, a0[r]);
    _mm256_storeu_ps(y + r * N + 8, a1[r]);
  }
}

// The first R < kTileRows rows of a panel pair (panel 2p at `pair`, 2p + 1 after it): decodes
// the pair into w [K, 16] for the tiles after it (column half * 8 + c: channel c of panel half)
// and computes its own rows from each input's weights while they are still in registers. A
// tile of fewer rows than kTileRows leaves FMA issue slots free (up to 4 rows it is bound by
// the latency of its FMA chains, one per accumulator), and the decode fills them; decoded in a
// pass of its own (decode_panel), the pair costs about one more row tile. At kTileRows rows
// this tile measured slower than that pass and a plain tile.
template <int F, int R>
static inline void decoding_tile(const uint8_t* pair, int64_t nb, float* w, const float* x,
                                 int64_t K, float* y, int64_t N, const float* bias) {
  constexpr int Bits = code_bits(F);
  constexpr int64_t record = record_bytes(F);
  __m256 a0[R], a1[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  Super super0, super1;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* rec0 = pair + b * record;
    const uint8_t* rec1 = pair + (nb + b) * record;
    __m256 d0[2], m0[2], d1[2], m1[2];
    super_scales<F>(pair, b, super0);
    super_scales<F>(pair + nb * record, b, super1);
    half_scales<F>(pair, b, super0, d0, m0);
    half_scales<F>(pair + nb * record, b, super1, d1, m1);
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      const __m256i words0 = group_words<F>(rec0, g), words1 = group_words<F>(rec1, g);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const int64_t k = b * kQuantBlock + 4 * g + j;
        const __m256 w0 = decoded_input<Bits>(words0, g, j, d0[g / 4], m0[g / 4]);
        const __m256 w1 = decoded_input<Bits>(words1, g, j, d1[g / 4], m1[g / 4]);
        _mm256_store_ps(w + k * 16, w0);
        _mm256_store_ps(w + k * 16 + 8, w1);
        accumulate_input<R>(x, K, k, w0, w1, a0, a1);
      }
    }
  }
  store_tile<R>(a0, a1, y, N, bias);
}

// y[r, 0..15] = x[r] . w (+ bias) for R <= 6 rows, from the decoded fp32 panel pair w.
template <int R>
static inline void panel_tile(const float* x, int64_t K, const float* w, float* y, int64_t N,
                              const float* bias) {
  __m256 a0[R], a1[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k)
    accumulate_input<R>(x, K, k, _mm256_load_ps(w + k * 16), _mm256_load_ps(w + k * 16 + 8),
                        a0, a1);
  store_tile<R>(a0, a1, y, N, bias);
}

// The first R rows of a panel pair, decoding it (decoding_tile), R < kTileRows.
template <int F>
static void decoding_rows(int64_t R, const uint8_t* pair, int64_t nb, float* w, const float* x,
                          int64_t K, float* y, int64_t N, const float* bias) {
  switch (R) {
    case 5: return decoding_tile<F, 5>(pair, nb, w, x, K, y, N, bias);
    case 4: return decoding_tile<F, 4>(pair, nb, w, x, K, y, N, bias);
    case 3: return decoding_tile<F, 3>(pair, nb, w, x, K, y, N, bias);
    case 2: return decoding_tile<F, 2>(pair, nb, w, x, K, y, N, bias);
    default: return decoding_tile<F, 1>(pair, nb, w, x, K, y, N, bias);
  }
}

// Each thread holds the index of the pair it does next, taken from the counter before it
// starts the current one, and prefetches that pair's records a share before each row tile: a
// pair is a few KB in two short runs, which the hardware prefetcher does not pick up in time,
// so without this the decode waited on memory. (A thread descheduled by a busy machine then
// holds two pairs up instead of one: a few microseconds more work after its time slice.)
// Rows are split into tiles of kTileRows, but for the first, which takes the remainder of M
// over kTileRows (1-5 rows) and decodes the pair as it goes (decoding_tile):
// 32 = 2 + 6 + 6 + 6 + 6 + 6. Where M is a multiple of kTileRows the pair is decoded by a pass
// of its own (decode_panel) before the tiles.
// y's rows are N floats apart, as int8_path's.
template <int F>
static void fp32_path(const float* xp, int64_t M, int64_t K, const uint8_t* wp, int64_t P,
                      const float* bp, float* yp, int64_t N) {
  constexpr int64_t record = record_bytes(F);
  const int64_t nb = K / kQuantBlock, pairs = P / 2;
  const int64_t pair_bytes = 2 * nb * record, pair_lines = (pair_bytes + 63) / 64;
  const int64_t first = M % kTileRows;  // the decoding tile's rows; none: decode_panel
  const bool decoding = first > 0;
  const int64_t tiles = (M + kTileRows - 1) / kTileRows;
  const int64_t lines_per_tile = (pair_lines + tiles - 1) / tiles;
  parallel_dynamic(pairs, [&](std::atomic<int64_t>& next) {
    float* w = static_cast<float*>(std::aligned_alloc(64, K * 16 * 4));
    for (int64_t p = next++, following; p < pairs; p = following) {
      following = next++;
      const char* ahead =
          following < pairs ? reinterpret_cast<const char*>(wp + following * pair_bytes) : nullptr;
      const float* pb = bp == nullptr ? nullptr : bp + p * 16;
      if (!decoding) {
        decode_panel<F>(wp + p * pair_bytes, nb, 0, w);
        decode_panel<F>(wp + p * pair_bytes + nb * record, nb, 1, w);
      }
      for (int64_t r = 0, t = 0; t < tiles; ++t) {
        if (ahead != nullptr)
          for (int64_t l = t * lines_per_tile; l < std::min(pair_lines, (t + 1) * lines_per_tile);
               ++l)
            _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
        if (decoding && t == 0) {
          decoding_rows<F>(first, wp + p * pair_bytes, nb, w, xp, K, yp + p * 16, N, pb);
          r = first;
          continue;
        }
        panel_tile<kTileRows>(xp + r * K, K, w, yp + r * N + p * 16, N, pb);
        r += kTileRows;
      }
    }
    std::free(w);
  });
}
#endif
