// loom: y = x W^T (+ b) for fp32 x, with W held as the GGUF holds it: codes q with one scale d
// and one offset m per block of 32 along a row, w = q * d + m (Q4_0, Q4_1 and Q8_0 all have
// this form), 4-bit codes packed two to a byte and d, m in fp16, the file's own sizes.
//
// The weight is laid out once, at load time (loom.model.linear.to_panels), in panels of 8
// output channels; a panel's block b of 32 inputs is one record:
// - 4-bit: 128 bytes of codes, then d[8] and m[8] as fp16. Byte i of 32-byte chunk t holds,
//   low nibble first, byte i of the 4 x 8 code groups 2t and 2t + 1, where code group g is the
//   32 codes of inputs 32b + 4g .. 32b + 4g + 3, channel-major: byte 4c + j = channel c,
//   input 32b + 4g + j. 0 <= q <= 15 (Q4_0's signed codes come shifted by 8, m = -8d).
// - 8-bit: the 8 code groups as signed bytes (256 bytes), then d[8] and m[8].
// A code group is one AVX2 register: 8 channels x 4 inputs, which is what _mm256_maddubs_epi16
// + _mm256_madd_epi16 sum into 8 int32 lanes, one per channel.
//
// Two ways to compute, chosen by the row count:
// - up to `int8_rows` rows (decode steps): x is quantized once per call, per block of 32, into
//   two int8 parts, x ~ dx * (q1 + q2 / 256) with dx = max|x| / 127 (llama.cpp's Q8_1 is q1
//   alone: on the bundled model that changed most greedy completions; with q2 they stay
//   fp32's, benchmarks/kernels/native_accuracy.py), and every code group is an integer dot
//   product, with no decode of the weight to floats; per block, in fp32, y += d * dx *
//   sum(q * qx) + m * sum(x), with the exact sum of x, so that the offset term carries no
//   rounding of x. The weight streams at its packed size. 4-bit codes take the two parts as bytes
//   (_mm256_maddubs_epi16, unsigned codes); 8-bit codes take them joined, as the int16
//   256 q1 + q2 (_mm256_madd_epi16 on the codes widened): the same integer sums in half the
//   instructions of two signed byte products.
// - more rows (batched decode, prefill): two panels are decoded once to fp32 (K x 16 floats, at
//   most ~100 KB, so it stays in L2; by a pass of their own or by the first row tile, see
//   fp32_path) and 6 x 16 register tiles run over it, per k two panel loads, six broadcasts
//   and twelve FMAs, the classic AVX2 sgemm micro-kernel: the fp32 product with the file's
//   weights (only the summation order differs from F.linear), the decode amortised over
//   every row.
// Threads take work units of a few panels from a shared counter (parallel_dynamic.h), and
// prefetch the unit they take next while they compute the current one. Needs AVX2, FMA and
// F16C.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "avx2_reduce.h"
#include "parallel_dynamic.h"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LOOM_HAVE_AVX2 1
#endif

constexpr int64_t kQuantBlock = 32;
constexpr int64_t kPanel = 8;                      // output channels per packed panel
constexpr int64_t kScaleBytes = 2 * kPanel * 2;    // d[8] and m[8], fp16
constexpr int64_t kRecord4 = 128 + kScaleBytes;    // one 4-bit block of a panel
constexpr int64_t kRecord8 = 256 + kScaleBytes;    // one 8-bit block of a panel
constexpr int kTileRows = 6;                       // rows per fp32 register tile
constexpr int kIntTileRows = 4;                    // rows per integer register tile
constexpr int64_t kUnitWeights = 262144;           // at most, per work unit of the int8 path
constexpr int64_t kUnitsPerThread = 4;             // at least, where the layer has the panels

bool supported() {
#ifdef LOOM_HAVE_AVX2
  return true;
#else
  return false;
#endif
}

#ifdef LOOM_HAVE_AVX2
// Always inlined (and, in the tiles, with the row loops unrolled) so that everything stays in
// registers: without the unrolling GCC kept the tile's accumulators on the stack, ten stores
// per k, at half the speed.
#define LOOM_INLINE inline __attribute__((always_inline))

static LOOM_INLINE __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// One row of x, per block of 32, as two int8 parts: x ~ dx * (q1 + q2 / 256), q1 = round(x / dx)
// with dx = max|x| / 127 and q2 the rounded rest in 1/256ths, both in [-127, 127] (127 keeps
// 256 q1 + q2 within int16): int16 precision. Per block: the scale dx / 256, the exact sum
// of x, and the centring term 8 * (sum x - sum of its quantized values) for 4-bit codes (see
// int_tile). For 4-bit codes the two parts' 32 codes are stored one after the other, as
// bytes; for 8-bit codes the block is the 32 int16 values 256 q1 + q2 (the same 64 bytes).
template <int Bits>
static void quantize_row(const float* x, int64_t K, int8_t* qx, float* scale, float* sum,
                         float* centre) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < K / kQuantBlock; ++b) {
    const float* xb = x + b * kQuantBlock;
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i);
    const __m256 amax = _mm256_max_ps(
        _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
        _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    const float m = hmax(amax);
    const __m256 inv = _mm256_set1_ps(m > 0.0f ? 127.0f / m : 0.0f);
    __m256i q1[4], q2[4], joined[4];
    __m256 total = _mm256_setzero_ps();  // sum of 256 q1 + q2, exact in fp32
    for (int i = 0; i < 4; ++i) {
      const __m256 t = _mm256_mul_ps(v[i], inv);
      const __m256 r1 = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256 r2 = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_round_ps(
          _mm256_mul_ps(_mm256_sub_ps(t, r1), _mm256_set1_ps(256.0f)),
          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
      const __m256 both = _mm256_fmadd_ps(r1, _mm256_set1_ps(256.0f), r2);
      total = _mm256_add_ps(total, both);
      q1[i] = _mm256_cvtps_epi32(r1);
      q2[i] = _mm256_cvtps_epi32(r2);
      joined[i] = _mm256_cvtps_epi32(both);
    }
    const float s = hsum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
    scale[b] = m / (127.0f * 256.0f);
    sum[b] = s;
    centre[b] = 8.0f * (s - scale[b] * hsum(total));
    // the packs interleave 128-bit lanes; the permutes put the values back in order
    if constexpr (Bits == 8) {
      for (int half = 0; half < 2; ++half)
        _mm256_storeu_si256(
            reinterpret_cast<__m256i*>(qx + 2 * b * kQuantBlock + 32 * half),
            _mm256_permute4x64_epi64(
                _mm256_packs_epi32(joined[2 * half], joined[2 * half + 1]), 0xD8));
      continue;
    }
    for (int part = 0; part < 2; ++part) {
      const __m256i* q = part == 0 ? q1 : q2;
      const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                                _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qx + (2 * b + part) * kQuantBlock),
                          _mm256_permutevar8x32_epi32(packed, order));
    }
  }
}

static LOOM_INLINE __m256 load_half8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The 4-bit code group g of a block record: 32 codes, byte 4c + j = channel c, input 4g + j.
static LOOM_INLINE __m256i nibble_group(const uint8_t* rec, int g) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * (g / 2)));
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  return _mm256_and_si256(g % 2 == 0 ? v : _mm256_srli_epi16(v, 4), low4);
}

// Half h of the 8-bit code group g, widened to int16: channels 4h .. 4h + 3, 4 inputs each.
static LOOM_INLINE __m256i byte_half_group(const uint8_t* rec, int g, int h) {
  return _mm256_cvtepi8_epi16(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 32 * g + 16 * h)));
}

// The 8-bit path's per-channel sums come out of _mm256_hadd_epi32 in the lane order
// c0 c1 c4 c5 c2 c3 c6 c7; a block's scales are put in that order and the sums put back at
// the end. The swap is its own inverse.
static LOOM_INLINE __m256 swap_middle_pairs(__m256 v) {
  return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
}

// t[r] = 256 sum(q * q1) + sum(q * q2) over one block, per channel, as fp32 (exact): for
// 4-bit codes two byte products per code group (_mm256_maddubs_epi16, unsigned codes, pair
// sums of at most 2 * 15 * 127, so eight groups' worth fit in int16), for 8-bit codes one
// int16 product per half group with x's joined form 256 q1 + q2 (_mm256_madd_epi16: pairs of
// at most 127 * 32767, int32 sums), in swap_middle_pairs' lane order.
template <int Bits, int R>
static LOOM_INLINE void block_sums(const uint8_t* rec, const int8_t* qx, int64_t K, int64_t b,
                                   __m256* t) {
  if constexpr (Bits == 4) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s1[R], s2[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) s1[r] = s2[r] = _mm256_setzero_si256();
    // two code groups (one 32-byte load) per iteration, not unrolled further: fully
    // unrolled, GCC computed every group's products first and spilled them
#pragma GCC unroll 1
    for (int g = 0; g < 8; g += 2) {
      const __m256i c0 = nibble_group(rec, g), c1 = nibble_group(rec, g + 1);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int8_t* q = qx + r * 2 * K + 2 * b * kQuantBlock + 4 * g;
        s1[r] = _mm256_add_epi16(s1[r], _mm256_add_epi16(_mm256_maddubs_epi16(c0, broadcast4(q)),
                                                         _mm256_maddubs_epi16(c1, broadcast4(q + 4))));
        s2[r] = _mm256_add_epi16(
            s2[r], _mm256_add_epi16(_mm256_maddubs_epi16(c0, broadcast4(q + kQuantBlock)),
                                    _mm256_maddubs_epi16(c1, broadcast4(q + kQuantBlock + 4))));
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      t[r] = _mm256_cvtepi32_ps(_mm256_add_epi32(
          _mm256_slli_epi32(_mm256_madd_epi16(s1[r], ones), 8), _mm256_madd_epi16(s2[r], ones)));
  } else {
    __m256i low[R], high[R];  // channels 0-3 and 4-7, two pair sums each
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) low[r] = high[r] = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int g = 0; g < 8; ++g) {
      const __m256i c0 = byte_half_group(rec, g, 0), c1 = byte_half_group(rec, g, 1);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        int64_t four;  // x's joined values for inputs 4g .. 4g + 3
        std::memcpy(&four, qx + r * 2 * K + 2 * b * kQuantBlock + 8 * g, 8);
        const __m256i xv = _mm256_set1_epi64x(four);
        low[r] = _mm256_add_epi32(low[r], _mm256_madd_epi16(c0, xv));
        high[r] = _mm256_add_epi32(high[r], _mm256_madd_epi16(c1, xv));
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) t[r] = _mm256_cvtepi32_ps(_mm256_hadd_epi32(low[r], high[r]));
  }
}

// y[r, 0..7] = x[r] . panel (+ bias) for R <= 4 rows, from the two-part int8 activations.
// Per block, with the integer dot products t1 = sum(q * q1), t2 = sum(q * q2) and a = dx / 256:
// y += d * (a * (256 t1 + t2) + centre) + m * sum(x). For 4-bit codes the centring term
// weighs the rounding error of x by q - 8 instead of q (0..15), a smaller weight; 8-bit codes
// are signed already and take no centring.
// `ahead`, where not null, is a panel of the work unit this thread takes next: each block's
// record there is prefetched as the same block is computed here.
template <int Bits, int R>
static inline void int_tile(const uint8_t* panel, int64_t nb, const int8_t* qx,
                            const float* scale, const float* sum, const float* centre,
                            int64_t K, float* y, int64_t N, const float* bias,
                            const uint8_t* ahead) {
  constexpr int64_t record = Bits == 4 ? kRecord4 : kRecord8;
  __m256 acc[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* rec = panel + b * record;
    if (ahead != nullptr) {
#pragma GCC unroll 8
      for (int64_t offset = 0; offset < record; offset += 64)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + b * record + offset), _MM_HINT_T0);
    }
    __m256 t[R];
    block_sums<Bits, R>(rec, qx, K, b, t);
    __m256 d = load_half8(rec + record - kScaleBytes);
    __m256 m = load_half8(rec + record - kScaleBytes / 2);
    if (Bits == 8) {
      d = swap_middle_pairs(d);
      m = swap_middle_pairs(m);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int64_t i = r * nb + b;
      const __m256 dot = Bits == 4 ? _mm256_fmadd_ps(t[r], _mm256_set1_ps(scale[i]),
                                                     _mm256_set1_ps(centre[i]))
                                   : _mm256_mul_ps(t[r], _mm256_set1_ps(scale[i]));
      acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sum[i]), _mm256_fmadd_ps(dot, d, acc[r]));
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    if (Bits == 8) acc[r] = swap_middle_pairs(acc[r]);
    if (bias != nullptr) acc[r] = _mm256_add_ps(acc[r], _mm256_loadu_ps(bias));
    _mm256_storeu_ps(y + r * N, acc[r]);
  }
}

template <int Bits>
static void int8_path(const float* xp, int64_t M, int64_t K, const uint8_t* wp, int64_t P,
                      const float* bp, float* yp) {
  constexpr int64_t record = Bits == 4 ? kRecord4 : kRecord8;
  const int64_t nb = K / kQuantBlock, N = P * kPanel;
  std::vector<int8_t> qx(M * 2 * K);
  std::vector<float> scale(M * nb), sum(M * nb), centre(M * nb);
  for (int64_t r = 0; r < M; ++r)
    quantize_row<Bits>(xp + r * K, K, qx.data() + r * 2 * K, scale.data() + r * nb,
                 sum.data() + r * nb, centre.data() + r * nb);
  // Units as long as kUnitWeights, but at least kUnitsPerThread a thread to balance (a busy
  // machine's descheduled thread holds up one unit): a unit is one run of memory, and long
  // runs stream faster (at decode sizes, on the bundled model and on a 1.7B-parameter one:
  // docs/benchmark-log.md, "Longer work units").
  const int64_t per_unit = std::max<int64_t>(
      1, std::min<int64_t>(kUnitWeights / (kPanel * K),
                           P / (kUnitsPerThread * at::get_num_threads())));
  const int64_t units = (P + per_unit - 1) / per_unit;
  // As in fp32_path, each thread holds the unit it does next and prefetches it while it
  // computes this one: a unit is a few KB, and the other threads' units lie between a thread's
  // own, so the hardware prefetcher, which follows one stream, restarts at every unit. With
  // the weights in cache this path ran at twice the rate it reached streaming from memory.
  parallel_dynamic(units, [&](std::atomic<int64_t>& next) {
    for (int64_t u = next++, following; u < units; u = following) {
      following = next++;
      for (int64_t p = u * per_unit, j = 0; p < std::min(P, (u + 1) * per_unit); ++p, ++j) {
        const uint8_t* panel = wp + p * nb * record;
        const int64_t ahead_panel = following * per_unit + j;
        const uint8_t* ahead =
            following < units && ahead_panel < P ? wp + ahead_panel * nb * record : nullptr;
        const float* pb = bp == nullptr ? nullptr : bp + p * kPanel;
        for (int64_t r = 0; r < M; r += kIntTileRows) {
          const int64_t i = r * nb;
          const int8_t* q = qx.data() + r * 2 * K;
          float* y = yp + r * N + p * kPanel;
          const uint8_t* prefetch = r == 0 ? ahead : nullptr;  // once per unit, not per tile
#define LOOM_TILE(R)                                                                          \
  int_tile<Bits, R>(panel, nb, q, scale.data() + i, sum.data() + i, centre.data() + i, K, y, N, \
                    pb, prefetch)
          switch (std::min<int64_t>(kIntTileRows, M - r)) {
            case 4: LOOM_TILE(4); break;
            case 3: LOOM_TILE(3); break;
            case 2: LOOM_TILE(2); break;
            default: LOOM_TILE(1); break;
          }
#undef LOOM_TILE
        }
      }
    }
  });
}

// Input 4g + j of a panel's 8 channels as fp32, from the words of code group g (its 32-byte
// chunk g / 2 for 4-bit codes, low nibbles for even g): word c of a code group holds channel
// c's 4 inputs, one per byte (a nibble of it for 4-bit codes), so input j's 8 channels are the
// group's 8 words shifted and masked, no byte shuffles.
template <int Bits>
static LOOM_INLINE __m256 decoded_input(__m256i words, int g, int j, __m256 d, __m256 m) {
  const __m256i q =
      Bits == 4 ? _mm256_and_si256(_mm256_srli_epi32(words, 8 * j + 4 * (g % 2)),
                                   _mm256_set1_epi32(0x0F))
                : _mm256_srai_epi32(_mm256_slli_epi32(words, 24 - 8 * j), 24);
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m);
}

// One 8-channel panel to fp32, into columns half * 8 .. half * 8 + 7 of w [K, 16].
template <int Bits>
static void decode_panel(const uint8_t* panel, int64_t nb, int half, float* w) {
  constexpr int64_t record = Bits == 4 ? kRecord4 : kRecord8;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* rec = panel + b * record;
    const __m256 d = load_half8(rec + record - kScaleBytes);
    const __m256 m = load_half8(rec + record - kScaleBytes / 2);
    float* wb = w + b * kQuantBlock * 16 + 8 * half;
    for (int g = 0; g < 8; ++g) {
      const __m256i words = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(rec + 32 * (Bits == 4 ? g / 2 : g)));
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j)
        _mm256_store_ps(wb + (4 * g + j) * 16, decoded_input<Bits>(words, g, j, d, m));
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
template <int Bits, int R>
static inline void decoding_tile(const uint8_t* pair, int64_t nb, float* w, const float* x,
                                 int64_t K, float* y, int64_t N, const float* bias) {
  constexpr int64_t record = Bits == 4 ? kRecord4 : kRecord8;
  __m256 a0[R], a1[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* rec0 = pair + b * record;
    const uint8_t* rec1 = pair + (nb + b) * record;
    const __m256 d0 = load_half8(rec0 + record - kScaleBytes);
    const __m256 m0 = load_half8(rec0 + record - kScaleBytes / 2);
    const __m256 d1 = load_half8(rec1 + record - kScaleBytes);
    const __m256 m1 = load_half8(rec1 + record - kScaleBytes / 2);
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      const int chunk = 32 * (Bits == 4 ? g / 2 : g);
      const __m256i words0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec0 + chunk));
      const __m256i words1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec1 + chunk));
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const int64_t k = b * kQuantBlock + 4 * g + j;
        const __m256 w0 = decoded_input<Bits>(words0, g, j, d0, m0);
        const __m256 w1 = decoded_input<Bits>(words1, g, j, d1, m1);
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
template <int Bits>
static void decoding_rows(int64_t R, const uint8_t* pair, int64_t nb, float* w, const float* x,
                          int64_t K, float* y, int64_t N, const float* bias) {
  switch (R) {
    case 5: return decoding_tile<Bits, 5>(pair, nb, w, x, K, y, N, bias);
    case 4: return decoding_tile<Bits, 4>(pair, nb, w, x, K, y, N, bias);
    case 3: return decoding_tile<Bits, 3>(pair, nb, w, x, K, y, N, bias);
    case 2: return decoding_tile<Bits, 2>(pair, nb, w, x, K, y, N, bias);
    default: return decoding_tile<Bits, 1>(pair, nb, w, x, K, y, N, bias);
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
template <int Bits>
static void fp32_path(const float* xp, int64_t M, int64_t K, const uint8_t* wp, int64_t P,
                      const float* bp, float* yp) {
  constexpr int64_t record = Bits == 4 ? kRecord4 : kRecord8;
  const int64_t nb = K / kQuantBlock, N = P * kPanel, pairs = P / 2;
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
        decode_panel<Bits>(wp + p * pair_bytes, nb, 0, w);
        decode_panel<Bits>(wp + p * pair_bytes + nb * record, nb, 1, w);
      }
      for (int64_t r = 0, t = 0; t < tiles; ++t) {
        if (ahead != nullptr)
          for (int64_t l = t * lines_per_tile; l < std::min(pair_lines, (t + 1) * lines_per_tile);
               ++l)
            _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
        if (decoding && t == 0) {
          decoding_rows<Bits>(first, wp + p * pair_bytes, nb, w, xp, K, yp + p * 16, N, pb);
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

// The records above, straight from a GGUF's blocks (uint8 [N, K / 32, header + codes]: fp16 d,
// then fp16 m if header is 4, then 16 bytes of 4-bit codes, byte j = input j low nibble and
// input j + 16 high, or 32 signed bytes). q4_0: the 4-bit codes count from 8, so m = -8d. One
// pass over the bytes at load time; numpy's byte shuffles made this most of the start-up.
torch::Tensor panels_from_blocks(torch::Tensor blocks, int64_t header, bool q4_0) {
  TORCH_CHECK(supported(), "panels_from_blocks needs a CPU with AVX2, FMA and F16C");
  TORCH_CHECK(blocks.dim() == 3 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.size(0) % kPanel == 0 && (header == 2 || header == 4),
              "blocks must be contiguous uint8 [N, K / 32, block bytes], N a multiple of 8");
  const int64_t code_bytes = blocks.size(2) - header;
  TORCH_CHECK(code_bytes == 16 || code_bytes == 32, "a block holds 16 or 32 bytes of codes");
  const bool four = code_bytes == 16;
  const int64_t P = blocks.size(0) / kPanel, nb = blocks.size(1), bytes = blocks.size(2);
  const int64_t record = four ? kRecord4 : kRecord8, codes_end = record - kScaleBytes;
  auto out = torch::empty({P, nb, record}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* rec = dst + (p * nb + b) * record;
        for (int64_t c = 0; c < kPanel; ++c) {
          const uint8_t* blk = src + ((p * kPanel + c) * nb + b) * bytes;
          // One code group (4 inputs of this channel) is one 32-bit word of the record.
          uint32_t w[8];
          std::memcpy(w, blk + header, code_bytes);
          if (four) {  // word 2u + h: inputs 8u + 4h + j (low nibbles) and those + 16 (high)
            constexpr uint32_t lo4 = 0x0F0F0F0F;
            const uint32_t in[4] = {w[0], w[1], w[2], w[3]};
            for (int u = 0; u < 2; ++u) {  // record word t: inputs 8t + j (low), 8t + 4 + j
              w[u] = (in[2 * u] & lo4) | ((in[2 * u + 1] & lo4) << 4);
              w[u + 2] = ((in[2 * u] >> 4) & lo4) | (in[2 * u + 1] & ~lo4);
            }
          }
          for (int64_t g = 0; g < code_bytes / 4; ++g)
            std::memcpy(rec + g * 4 * kPanel + 4 * c, &w[g], 4);
          uint16_t d, m = 0;
          std::memcpy(&d, blk, 2);
          if (header == 4) std::memcpy(&m, blk + 2, 2);
#ifdef LOOM_HAVE_AVX2
          if (q4_0) m = _cvtss_sh(-8.0f * _cvtsh_ss(d), 0);
#endif
          std::memcpy(rec + codes_end + 2 * c, &d, 2);
          std::memcpy(rec + codes_end + 2 * kPanel + 2 * c, &m, 2);
        }
      }
    }
  });
  return out;
}

// x [M, K] float32; panels uint8 [N / 8, K / 32, record] (4-bit or 8-bit records, told apart by
// their size); up to int8_rows rows take the int8 path, more the fp32 one.
torch::Tensor block_quant_linear(torch::Tensor x, torch::Tensor panels,
                                 c10::optional<torch::Tensor> bias, int64_t int8_rows) {
  TORCH_CHECK(supported(), "block_quant_linear needs a CPU with AVX2, FMA and F16C");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [rows, K] float32");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kByte && panels.is_contiguous() &&
                  (panels.size(2) == kRecord4 || panels.size(2) == kRecord8) &&
                  panels.size(0) % 2 == 0,
              "panels must be contiguous uint8 [N / 8, K / 32, record], N a multiple of 16");
  const int64_t M = x.size(0), P = panels.size(0), K = panels.size(1) * kQuantBlock;
  const int64_t N = P * kPanel;
  TORCH_CHECK(x.size(1) == K, "x must be [rows, K] with K = 32 * the panels' blocks");
  TORCH_CHECK(!bias.has_value() || (bias->numel() == N && bias->scalar_type() == at::kFloat),
              "bias must be float32 [N]");
  x = x.contiguous();
  auto out = torch::empty({M, N}, x.options());
  if (M == 0) return out;
#ifdef LOOM_HAVE_AVX2
  const torch::Tensor b = bias.has_value() ? bias->contiguous() : torch::Tensor();
  const float* bp = bias.has_value() ? b.data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = panels.data_ptr<uint8_t>();
  float* yp = out.data_ptr<float>();
  const bool four = panels.size(2) == kRecord4;
  if (M <= int8_rows)
    (four ? int8_path<4> : int8_path<8>)(xp, M, K, wp, P, bp, yp);
  else
    (four ? fp32_path<4> : fp32_path<8>)(xp, M, K, wp, P, bp, yp);
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Without the GIL: the HTTP server's event loop runs on while a step's matmuls do.
  m.def("block_quant_linear", &block_quant_linear, py::call_guard<py::gil_scoped_release>());
  m.def("panels_from_blocks", &panels_from_blocks, py::call_guard<py::gil_scoped_release>());
  m.def("supported", &supported);
  LOOM_POOL_BINDINGS(m);
}
