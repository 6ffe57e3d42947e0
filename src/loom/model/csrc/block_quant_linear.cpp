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
// - Q4_K's own: the 4-bit record's 128 bytes of codes, then per channel the block's 6-bit
//   scale sc[8] and min mn[8] as bytes, then a share of the super-block's fp16 d and dmin: the
//   record of block b holds channel b % 8's (4 bytes; a super-block is 8 blocks, so its 8
//   records hold all 8 channels'). w = q * (d sc) - dmin mn, both products exact in fp32, so
//   the weights are the file's to the bit at 148 bytes a record (4.625 bits a weight; Q4_K's
//   4.5, Q4_1's 5). K a multiple of 256.
// A code group is one AVX2 register: 8 channels x 4 inputs, which is what _mm256_maddubs_epi16
// + _mm256_madd_epi16 sum into 8 int32 lanes, one per channel (AVX512-VNNI's
// _mm256_dpbusd_epi32 in one instruction, where the build has it).
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
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define LOOM_HAVE_VNNI 1
#endif
#endif

constexpr int64_t kQuantBlock = 32;
constexpr int64_t kPanel = 8;                      // output channels per packed panel
constexpr int64_t kScaleBytes = 2 * kPanel * 2;    // d[8] and m[8], fp16
constexpr int64_t kRecord4 = 128 + kScaleBytes;    // one 4-bit block of a panel
constexpr int64_t kRecord8 = 256 + kScaleBytes;    // one 8-bit block of a panel
constexpr int64_t kRecordK4 = 128 + 2 * kPanel + 4;  // one Q4_K block of a panel
constexpr int64_t kShareAt = 128 + 2 * kPanel;       // where a Q4_K record's d, dmin share is
// Record formats, named by the code width they compute with but Q4_K's own.
enum Format : int { kQ4 = 4, kQ8 = 8, kQ4K = 44 };
constexpr int code_bits(int F) { return F == kQ8 ? 8 : 4; }
constexpr int64_t record_bytes(int F) {
  return F == kQ4 ? kRecord4 : F == kQ8 ? kRecord8 : kRecordK4;
}
static int format_of(int64_t record) {
  return record == kRecord4 ? kQ4 : record == kRecord8 ? kQ8 : kQ4K;
}
static bool is_record(int64_t size) {
  return size == kRecord4 || size == kRecord8 || size == kRecordK4;
}
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

// Whether the int8 path's dot products were built with AVX512-VNNI (block_sums): it then
// crosses over to the fp32 path at more rows (loom.model.linear picks the row limits by it).
bool vnni() {
#ifdef LOOM_HAVE_VNNI
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

static LOOM_INLINE __m256 load_u8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// A Q4_K super-block's d and -dmin per channel (unused by the other formats), gathered from
// the shares of its 8 records (one dword each: d low, dmin high) at its first block, b % 8 == 0:
// once per 8 blocks, as a gather per block cost the int8 path a third of its speed.
struct Super {
  __m256 d = _mm256_setzero_ps(), m = _mm256_setzero_ps();
};

template <int F>
static LOOM_INLINE void super_scales(const uint8_t* panel, int64_t b, Super& s) {
  if constexpr (F == kQ4K) {
    if ((b & 7) != 0) return;
    constexpr int64_t record = record_bytes(F);
    const __m256i at = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                          _mm256_set1_epi32(static_cast<int>(record)));
    const __m256i share = _mm256_i32gather_epi32(
        reinterpret_cast<const int*>(panel + b * record + kShareAt), at, 1);
    // per 128-bit lane [d x 4, dmin x 4]; the permute joins the lanes' d and dmin
    const __m256i halves = _mm256_permute4x64_epi64(
        _mm256_packus_epi32(_mm256_and_si256(share, _mm256_set1_epi32(0xFFFF)),
                            _mm256_srli_epi32(share, 16)), 0xD8);
    s.d = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
    s.m = _mm256_xor_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1)),
                        _mm256_set1_ps(-0.0f));
  }
}

// Block b's scale d and offset m per channel (w = q * d + m) in fp32, from its record in
// `panel` (Q4_K's: d * sc and -dmin * mn, from its super-block's `s`).
template <int F>
static LOOM_INLINE void block_scales(const uint8_t* panel, int64_t b, const Super& s,
                                     __m256& d, __m256& m) {
  constexpr int64_t record = record_bytes(F);
  const uint8_t* rec = panel + b * record;
  if constexpr (F == kQ4K) {
    d = _mm256_mul_ps(s.d, load_u8x8(rec + 128));
    m = _mm256_mul_ps(s.m, load_u8x8(rec + 128 + kPanel));
  } else {
    d = load_half8(rec + record - kScaleBytes);
    m = load_half8(rec + record - kScaleBytes / 2);
  }
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
// at most 127 * 32767, int32 sums), in swap_middle_pairs' lane order. With AVX512-VNNI each
// product and its sum into the int32 accumulators is one instruction (_mm256_dpbusd_epi32 for
// 4-bit codes, _mm256_dpwssd_epi32 for 8-bit ones; neither saturates): the same integers, so
// the same output bit for bit, in a third of the instructions for 4-bit codes.
template <int Bits, int R>
static LOOM_INLINE void block_sums(const uint8_t* rec, const int8_t* qx, int64_t K, int64_t b,
                                   __m256* t) {
  if constexpr (Bits == 4) {
#ifndef LOOM_HAVE_VNNI
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    __m256i s1[R], s2[R];  // int32 per channel with VNNI, int16 pair sums without
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
#ifdef LOOM_HAVE_VNNI
        s1[r] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(s1[r], c0, broadcast4(q)), c1,
                                    broadcast4(q + 4));
        s2[r] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(s2[r], c0, broadcast4(q + kQuantBlock)),
                                    c1, broadcast4(q + kQuantBlock + 4));
#else
        s1[r] = _mm256_add_epi16(s1[r], _mm256_add_epi16(_mm256_maddubs_epi16(c0, broadcast4(q)),
                                                         _mm256_maddubs_epi16(c1, broadcast4(q + 4))));
        s2[r] = _mm256_add_epi16(
            s2[r], _mm256_add_epi16(_mm256_maddubs_epi16(c0, broadcast4(q + kQuantBlock)),
                                    _mm256_maddubs_epi16(c1, broadcast4(q + kQuantBlock + 4))));
#endif
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#ifdef LOOM_HAVE_VNNI
      t[r] = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(s1[r], 8), s2[r]));
#else
      t[r] = _mm256_cvtepi32_ps(_mm256_add_epi32(
          _mm256_slli_epi32(_mm256_madd_epi16(s1[r], ones), 8), _mm256_madd_epi16(s2[r], ones)));
#endif
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
#ifdef LOOM_HAVE_VNNI
        low[r] = _mm256_dpwssd_epi32(low[r], c0, xv);
        high[r] = _mm256_dpwssd_epi32(high[r], c1, xv);
#else
        low[r] = _mm256_add_epi32(low[r], _mm256_madd_epi16(c0, xv));
        high[r] = _mm256_add_epi32(high[r], _mm256_madd_epi16(c1, xv));
#endif
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
template <int F, int R>
static inline void int_tile(const uint8_t* panel, int64_t nb, const int8_t* qx,
                            const float* scale, const float* sum, const float* centre,
                            int64_t K, float* y, int64_t N, const float* bias,
                            const uint8_t* ahead) {
  constexpr int Bits = code_bits(F);
  constexpr int64_t record = record_bytes(F);
  __m256 acc[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  Super super;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* rec = panel + b * record;
    if (ahead != nullptr) {
#pragma GCC unroll 8
      for (int64_t offset = 0; offset < record; offset += 64)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + b * record + offset), _MM_HINT_T0);
    }
    __m256 t[R];
    block_sums<Bits, R>(rec, qx, K, b, t);
    __m256 d, m;
    super_scales<F>(panel, b, super);
    block_scales<F>(panel, b, super, d, m);
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

template <int F>
static void int8_path(const float* xp, int64_t M, int64_t K, const uint8_t* wp, int64_t P,
                      const float* bp, float* yp) {
  constexpr int Bits = code_bits(F);
  constexpr int64_t record = record_bytes(F);
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
  int_tile<F, R>(panel, nb, q, scale.data() + i, sum.data() + i, centre.data() + i, K, y, N, \
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
template <int F>
static void decode_panel(const uint8_t* panel, int64_t nb, int half, float* w) {
  constexpr int Bits = code_bits(F);
  constexpr int64_t record = record_bytes(F);
  Super super;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* rec = panel + b * record;
    __m256 d, m;
    super_scales<F>(panel, b, super);
    block_scales<F>(panel, b, super, d, m);
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
    __m256 d0, m0, d1, m1;
    super_scales<F>(pair, b, super0);
    super_scales<F>(pair + nb * record, b, super1);
    block_scales<F>(pair, b, super0, d0, m0);
    block_scales<F>(pair + nb * record, b, super1, d1, m1);
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
template <int F>
static void fp32_path(const float* xp, int64_t M, int64_t K, const uint8_t* wp, int64_t P,
                      const float* bp, float* yp) {
  constexpr int64_t record = record_bytes(F);
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

// The records above, straight from a GGUF's blocks (uint8 [N, K / 32, header + codes]: fp16 d,
// then fp16 m if header is 4, then 16 bytes of 4-bit codes, byte j = input j low nibble and
// input j + 16 high, or 32 signed bytes). q4_0: the 4-bit codes count from 8, so m = -8d.
// header 6: Q4_K's blocks of 32 (weights.py: fp16 d, dmin, then the block's 6-bit scale and
// min as bytes, then 4-bit codes) -> Q4_K records. One pass over the bytes at load time;
// numpy's byte shuffles made this most of the start-up.
torch::Tensor panels_from_blocks(torch::Tensor blocks, int64_t header, bool q4_0) {
  TORCH_CHECK(supported(), "panels_from_blocks needs a CPU with AVX2, FMA and F16C");
  TORCH_CHECK(blocks.dim() == 3 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.size(0) % kPanel == 0 && (header == 2 || header == 4 || header == 6),
              "blocks must be contiguous uint8 [N, K / 32, block bytes], N a multiple of 8");
  const int64_t code_bytes = blocks.size(2) - header;
  TORCH_CHECK(code_bytes == 16 || (code_bytes == 32 && header != 6),
              "a block holds 16 or 32 bytes of codes (Q4_K's 16)");
  const bool four = code_bytes == 16, k4 = header == 6;
  const int64_t P = blocks.size(0) / kPanel, nb = blocks.size(1), bytes = blocks.size(2);
  TORCH_CHECK(!k4 || nb % kPanel == 0, "Q4_K rows hold whole blocks of 256");
  const int64_t record = k4 ? kRecordK4 : four ? kRecord4 : kRecord8;
  const int64_t codes_end = record - kScaleBytes;
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
          if (k4) {
            rec[128 + c] = blk[4];
            rec[128 + kPanel + c] = blk[5];
            if (b % kPanel == c) std::memcpy(rec + kShareAt, blk, 4);  // its d and dmin
            continue;
          }
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

// x [M, K] float32; panels uint8 [N / 8, K / 32, record] (4-bit, 8-bit or Q4_K records, told
// apart by their size); up to int8_rows rows take the int8 path, more the fp32 one.
torch::Tensor block_quant_linear(torch::Tensor x, torch::Tensor panels,
                                 c10::optional<torch::Tensor> bias, int64_t int8_rows) {
  TORCH_CHECK(supported(), "block_quant_linear needs a CPU with AVX2, FMA and F16C");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [rows, K] float32");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kByte && panels.is_contiguous() &&
                  is_record(panels.size(2)) && panels.size(0) % 2 == 0 &&
                  (panels.size(2) != kRecordK4 || panels.size(1) % kPanel == 0),
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
  const int format = format_of(panels.size(2));
  const bool int8 = M <= int8_rows;
  if (format == kQ4)
    (int8 ? int8_path<kQ4> : fp32_path<kQ4>)(xp, M, K, wp, P, bp, yp);
  else if (format == kQ8)
    (int8 ? int8_path<kQ8> : fp32_path<kQ8>)(xp, M, K, wp, P, bp, yp);
  else
    (int8 ? int8_path<kQ4K> : fp32_path<kQ4K>)(xp, M, K, wp, P, bp, yp);
#endif
  return out;
}

// ---- Mixture-of-experts layers (loom.model.moe) ---------------------------------------------
//
// One call per MoE layer and step: routing, then every expert that has tokens, then the
// weighted sum, with the tiles above on the same panel records, so each token reads only its
// chosen experts' weights, in their quantized blocks. Steps of the call:
// 1. Route (a loop over tokens): per token the top_k experts by router logit, ties to the lower
//    expert id, each weighted by the softmax over all the logits at its own, divided by the
//    sum of the chosen ones' where `normalize` (Mixtral, Qwen3-MoE; Mixtral's softmax over the
//    top-k logits is the same weights). The tokens are then grouped by expert, in token order:
//    an expert's rows.
// 2. Its rows' inputs (a loop over tokens): each token's x quantized once per code width the
//    int8 tiles need (quantize_row), then copied to its experts' rows; the shared expert's
//    gate, sigmoid(x . g), where there is one.
// 3. gate_up -> SiLU(gate) * up (a loop over units of one expert's panel pairs): an expert's
//    gate_up panels come interleaved, gate panel p then up panel p, so a pair's 16 outputs are
//    8 gate and the same channels' 8 up, and only SiLU * up is stored ([rows, I]). Its unit
//    also quantizes the blocks it wrote, where the expert's down runs on the int8 path.
// 4. down and the weighted sum (a loop over runs of output pairs): a unit takes its pairs of
//    every expert in turn, so one thread sums each output, in expert order (routed by id, the
//    shared one last): the same result whatever the thread count.
// An expert of n rows takes the int8 path where n <= the int8 row limit of its code width (as
// a dense layer does, by each matrix's code width), else the fp32 one. The shared expert
// (Qwen2-MoE's) is one more expert every token takes, with its own sizes and weight.
#ifdef LOOM_HAVE_AVX2
namespace moe {

// Rows of activations as quantize_row leaves them, for int_tile.
struct QuantRows {
  int8_t* q = nullptr;  // [rows, 2K]
  float* scale = nullptr;  // [rows, K / 32], likewise sum and centre
  float* sum = nullptr;
  float* centre = nullptr;
};

// One expert's part of a call.
struct Job {
  const uint8_t* gate_up;  // its interleaved pairs: I / 8 of them, K = H
  const uint8_t* down;     // its H / 16 pairs, K = I
  int gu_format, down_format;
  int64_t inter, rows;
  const int64_t* token;  // [rows]: each row's token
  const float* weight;   // [rows]: each row's weight in its token's sum
  bool gu_int8, down_int8;
  const float* x = nullptr;  // [rows, H]: fp32 gate_up inputs (x itself for the shared one)
  float* x_rows = nullptr;   // a routed expert's copy of them
  QuantRows qx;              // int8 gate_up inputs
  float* act = nullptr;      // [rows, I]
  QuantRows qa;              // int8 down inputs
};

// Bump allocation from one buffer per element type, sized by a first pass that only counts.
template <typename T>
struct Arena {
  std::vector<T> data;
  int64_t used = 0;
  T* take(int64_t n) {
    T* p = data.empty() ? nullptr : data.data() + used;
    used += n;
    return p;
  }
  void allocate() {
    data.assign(used, T());
    used = 0;
  }
};

template <int Bits>
static void quantize_rows(const float* x, int64_t rows, int64_t K, const QuantRows& q) {
  const int64_t nb = K / kQuantBlock;
  for (int64_t r = 0; r < rows; ++r)
    quantize_row<Bits>(x + r * K, K, q.q + r * 2 * K, q.scale + r * nb, q.sum + r * nb,
                       q.centre + r * nb);
}

static QuantRows take_quant_rows(Arena<int8_t>& bytes, Arena<float>& floats, int64_t rows,
                                 int64_t K) {
  const int64_t nb = K / kQuantBlock;
  return {bytes.take(rows * 2 * K), floats.take(rows * nb), floats.take(rows * nb),
          floats.take(rows * nb)};
}

static void copy_quant_row(const QuantRows& from, int64_t i, const QuantRows& to, int64_t j,
                           int64_t K) {
  const int64_t nb = K / kQuantBlock;
  std::memcpy(to.q + j * 2 * K, from.q + i * 2 * K, 2 * K);
  std::memcpy(to.scale + j * nb, from.scale + i * nb, nb * 4);
  std::memcpy(to.sum + j * nb, from.sum + i * nb, nb * 4);
  std::memcpy(to.centre + j * nb, from.centre + i * nb, nb * 4);
}

// Rows [0, n) of one panel pair (16 channels, K inputs) in tiles, each into tile [rows, 16]
// and handed to emit(first row, rows, tile): int8 tiles from q, or fp32 ones from x, which
// decode the pair into w [K, 16] as fp32_path does. `ahead`: the pair a thread computes
// next, prefetched by the first int8 tile (as int8_path does).
template <int F, typename Emit>
static void pair_rows(const uint8_t* pair, int64_t nb, int64_t K, int64_t n, bool int8,
                      const float* x, const QuantRows& q, float* w, const uint8_t* ahead,
                      const Emit& emit) {
  constexpr int64_t record = record_bytes(F);
  alignas(32) float tile[kTileRows * 16];
  if (int8) {
    for (int64_t r = 0; r < n; r += kIntTileRows) {
      const int64_t i = r * nb, rows = std::min<int64_t>(kIntTileRows, n - r);
      const int8_t* qx = q.q + r * 2 * K;
      for (int64_t half = 0; half < 2; ++half) {
        const uint8_t* prefetch =
            r == 0 && ahead != nullptr ? ahead + half * nb * record : nullptr;
#define LOOM_TILE(R)                                                                    \
  int_tile<F, R>(pair + half * nb * record, nb, qx, q.scale + i, q.sum + i, q.centre + i, \
                    K, tile + 8 * half, 16, nullptr, prefetch)
        switch (rows) {
          case 4: LOOM_TILE(4); break;
          case 3: LOOM_TILE(3); break;
          case 2: LOOM_TILE(2); break;
          default: LOOM_TILE(1); break;
        }
#undef LOOM_TILE
      }
      emit(r, rows, tile);
    }
    return;
  }
  int64_t r = n % kTileRows;
  if (r > 0) {
    decoding_rows<F>(r, pair, nb, w, x, K, tile, 16, nullptr);
    emit(0, r, tile);
  } else {
    decode_panel<F>(pair, nb, 0, w);
    decode_panel<F>(pair + nb * record, nb, 1, w);
  }
  for (; r < n; r += kTileRows) {
    panel_tile<kTileRows>(x + r * K, K, w, tile, 16, nullptr);
    emit(r, kTileRows, tile);
  }
}

template <typename Emit>
static void pair_rows_of(int format, const uint8_t* pair, int64_t nb, int64_t K, int64_t n,
                         bool int8, const float* x, const QuantRows& q, float* w,
                         const uint8_t* ahead, const Emit& emit) {
  if (format == kQ4)
    pair_rows<kQ4>(pair, nb, K, n, int8, x, q, w, ahead, emit);
  else if (format == kQ8)
    pair_rows<kQ8>(pair, nb, K, n, int8, x, q, w, ahead, emit);
  else
    pair_rows<kQ4K>(pair, nb, K, n, int8, x, q, w, ahead, emit);
}

static void quantize_rows_of(int bits, const float* x, int64_t rows, int64_t K,
                             const QuantRows& q) {
  if (bits == 4)
    quantize_rows<4>(x, rows, K, q);
  else
    quantize_rows<8>(x, rows, K, q);
}

// Past this e^-g overflows float32: -ffast-math assumes no infinities, so silu and the
// sigmoid gate take the limit (0) there instead of dividing by one.
constexpr float kExpLimit = 87.0f;

static inline float silu(float g) { return g < -kExpLimit ? 0.0f : g / (1.0f + std::exp(-g)); }

// a[c] = SiLU(g[c]) * g[8 + c] for one pair's 8 channels. Not inlined, so that every row
// runs this one body: inlined into a tile's loop over rows, GCC vectorized expf (libmvec)
// for some row counts and called it a lane at a time for others, which round apart, and a
// token's output then depended on how many others chose its expert.
__attribute__((noinline)) static void silu_times_up(const float* g, float* a) {
  for (int c = 0; c < 8; ++c) a[c] = silu(g[c]) * g[8 + c];
}

// The top k of E logits, highest first, ties to the lower id; their softmax weights.
static void route(const float* logits, int64_t E, int64_t k, bool normalize, int64_t* ids,
                  float* weights) {
  int64_t n = 0;
  for (int64_t e = 0; e < E; ++e) {
    const float v = logits[e];
    if (n == k && !(v > logits[ids[k - 1]])) continue;  // not above the last: it stays
    if (n < k) ++n;
    int64_t i = n - 1;
    for (; i > 0 && v > logits[ids[i - 1]]; --i) ids[i] = ids[i - 1];
    ids[i] = e;
  }
  float top = logits[ids[0]], total = 0.0f;
  for (int64_t e = 0; e < E; ++e) total += std::exp(logits[e] - top);
  float chosen = 0.0f;
  for (int64_t j = 0; j < k; ++j) chosen += weights[j] = std::exp(logits[ids[j]] - top) / total;
  if (normalize)
    for (int64_t j = 0; j < k; ++j) weights[j] /= chosen;
}

struct Matrices {  // one expert's panels, or E experts' stacked
  const uint8_t* gate_up;
  const uint8_t* down;
  int gu_format, down_format;
  int64_t inter;
  int64_t gu_stride, down_stride;  // bytes from one expert to the next
};

static Matrices matrices(const torch::Tensor& gate_up, const torch::Tensor& down) {
  const int64_t d = gate_up.dim();
  const int gu_format = format_of(gate_up.size(d - 1));
  const int down_format = format_of(down.size(d - 1));
  const int64_t inter = gate_up.size(d - 3) * kPanel / 2;
  return {gate_up.data_ptr<uint8_t>(), down.data_ptr<uint8_t>(), gu_format, down_format, inter,
          inter / kPanel * 2 * gate_up.size(d - 2) * record_bytes(gu_format),
          down.size(d - 3) * down.size(d - 2) * record_bytes(down_format)};
}

static void run(const float* xp, int64_t T, int64_t H, const float* logits, int64_t E,
                int64_t k, bool normalize, const Matrices& routed, const Matrices* shared,
                const float* shared_gate, int64_t int8_rows_4bit, int64_t int8_rows_8bit,
                float* out) {
  const auto int8_rows = [&](int format) {
    return code_bits(format) == 4 ? int8_rows_4bit : int8_rows_8bit;
  };
  const int64_t nbH = H / kQuantBlock;
  // 1. routing
  std::vector<int64_t> ids(T * k);
  std::vector<float> weights(T * k);
  parallel_dynamic(T, [&](std::atomic<int64_t>& next) {
    for (int64_t t; (t = next++) < T;)
      route(logits + t * E, E, k, normalize, ids.data() + t * k, weights.data() + t * k);
  });
  std::vector<int64_t> count(E, 0), first(E + 1, 0), local(T * k);
  for (int64_t i = 0; i < T * k; ++i) local[i] = count[ids[i]]++;
  for (int64_t e = 0; e < E; ++e) first[e + 1] = first[e] + count[e];
  std::vector<int64_t> token(T * k + (shared ? T : 0));
  std::vector<float> weight(token.size());
  for (int64_t i = 0; i < T * k; ++i) {
    token[first[ids[i]] + local[i]] = i / k;
    weight[first[ids[i]] + local[i]] = weights[i];
  }
  std::vector<Job> jobs;
  std::vector<int64_t> job_of(E, -1);
  for (int64_t e = 0; e < E; ++e) {
    if (count[e] == 0) continue;
    job_of[e] = static_cast<int64_t>(jobs.size());
    jobs.push_back({routed.gate_up + e * routed.gu_stride, routed.down + e * routed.down_stride,
                    routed.gu_format, routed.down_format, routed.inter, count[e],
                    token.data() + first[e], weight.data() + first[e],
                    count[e] <= int8_rows(routed.gu_format),
                    count[e] <= int8_rows(routed.down_format)});
  }
  if (shared) {
    for (int64_t t = 0; t < T; ++t) token[T * k + t] = t;
    jobs.push_back({shared->gate_up, shared->down, shared->gu_format, shared->down_format,
                    shared->inter, T, token.data() + T * k, weight.data() + T * k,
                    T <= int8_rows(shared->gu_format), T <= int8_rows(shared->down_format)});
  }
  // Buffers: each token's quantized x per code width the int8 gate_up tiles need, the
  // routed experts' rows of x (fp32 or quantized), every expert's SiLU * up (and its
  // quantized rows for int8 down tiles).
  bool quantized_tokens[2] = {false, false};  // 4-bit, 8-bit layouts
  for (const Job& job : jobs)
    if (job.gu_int8) quantized_tokens[code_bits(job.gu_format) == 8] = true;
  Arena<int8_t> bytes;
  Arena<float> floats;
  QuantRows tokens_q[2];
  int64_t inter_max = 0;
  for (int pass = 0; pass < 2; ++pass) {
    for (int b = 0; b < 2; ++b)
      if (quantized_tokens[b]) tokens_q[b] = take_quant_rows(bytes, floats, T, H);
    for (size_t j = 0; j < jobs.size(); ++j) {
      Job& job = jobs[j];
      const bool is_shared = shared && j + 1 == jobs.size();
      if (job.gu_int8)
        job.qx = is_shared ? tokens_q[code_bits(job.gu_format) == 8]
                           : take_quant_rows(bytes, floats, job.rows, H);
      else if (is_shared)
        job.x = xp;
      else
        job.x = job.x_rows = floats.take(job.rows * H);
      job.act = floats.take(job.rows * job.inter);
      if (job.down_int8) job.qa = take_quant_rows(bytes, floats, job.rows, job.inter);
      inter_max = std::max(inter_max, job.inter);
    }
    if (pass == 0) {
      bytes.allocate();
      floats.allocate();
    }
  }
  // 2. the rows' inputs
  parallel_dynamic(T, [&](std::atomic<int64_t>& next) {
    for (int64_t t; (t = next++) < T;) {
      const float* xt = xp + t * H;
      for (int b = 0; b < 2; ++b)
        if (quantized_tokens[b]) {
          const QuantRows& q = tokens_q[b];
          (b == 0 ? quantize_row<4> : quantize_row<8>)(
              xt, H, q.q + t * 2 * H, q.scale + t * nbH, q.sum + t * nbH, q.centre + t * nbH);
        }
      for (int64_t j = 0; j < k; ++j) {
        const int64_t i = t * k + j;
        const Job& job = jobs[job_of[ids[i]]];
        if (job.gu_int8)
          copy_quant_row(tokens_q[code_bits(job.gu_format) == 8], t, job.qx, local[i], H);
        else
          std::memcpy(job.x_rows + local[i] * H, xt, H * 4);
      }
      if (shared) {
        float gate = 1.0f;
        if (shared_gate != nullptr) {
          float dot = 0.0f;
          for (int64_t c = 0; c < H; ++c) dot += xt[c] * shared_gate[c];
          gate = dot < -kExpLimit ? 0.0f : 1.0f / (1.0f + std::exp(-dot));
        }
        weight[T * k + t] = gate;
      }
    }
  });
  // 3. gate_up -> SiLU * up. Units: (job, a run of 32-channel blocks of its I), as long as
  // the int8 path's units where the expert is on it, one block where it is on the fp32 one.
  struct Unit {
    int64_t job, begin, end;  // blocks of 32 intermediate channels: 4 pairs each
  };
  std::vector<Unit> units;
  const int64_t int8_blocks = std::max<int64_t>(1, kUnitWeights / (2 * kQuantBlock * H));
  for (size_t j = 0; j < jobs.size(); ++j) {
    const int64_t blocks = jobs[j].inter / kQuantBlock, step = jobs[j].gu_int8 ? int8_blocks : 1;
    for (int64_t b = 0; b < blocks; b += step)
      units.push_back({static_cast<int64_t>(j), b, std::min(blocks, b + step)});
  }
  const int64_t num_units = static_cast<int64_t>(units.size());
  const auto gu_pair = [&](const Unit& unit, int64_t i) {  // pair i of the unit
    const Job& job = jobs[unit.job];
    return job.gate_up + (4 * unit.begin + i) * 2 * nbH * record_bytes(job.gu_format);
  };
  parallel_dynamic(num_units, [&](std::atomic<int64_t>& next) {
    float* w = static_cast<float*>(std::aligned_alloc(64, H * 16 * 4));
    for (int64_t u = next++, following; u < num_units; u = following) {
      following = next++;
      const Unit& unit = units[u];
      const Job& job = jobs[unit.job];
      const int64_t I = job.inter;
      for (int64_t i = 0; i < 4 * (unit.end - unit.begin); ++i) {
        const int64_t channel = 8 * (4 * unit.begin + i);
        const uint8_t* ahead =
            following < num_units && i < 4 * (units[following].end - units[following].begin)
                ? gu_pair(units[following], i)
                : nullptr;
        pair_rows_of(job.gu_format, gu_pair(unit, i), nbH, H, job.rows, job.gu_int8, job.x,
                     job.qx, w, ahead, [&](int64_t r, int64_t rows, const float* tile) {
                       for (int64_t j = 0; j < rows; ++j)
                         silu_times_up(tile + 16 * j, job.act + (r + j) * I + channel);
                     });
      }
      if (job.down_int8) {
        const int64_t nbI = I / kQuantBlock, b = unit.begin;
        const QuantRows& q = job.qa;
        for (int64_t r = 0; r < job.rows; ++r)
          quantize_rows_of(code_bits(job.down_format), job.act + r * I + b * kQuantBlock, 1,
                           (unit.end - b) * kQuantBlock,
                           {q.q + r * 2 * I + 2 * b * kQuantBlock, q.scale + r * nbI + b,
                            q.sum + r * nbI + b, q.centre + r * nbI + b});
      }
    }
    std::free(w);
  });
  // 4. down and the weighted sum. Units: runs of the output's H / 16 pairs, as long as the
  // int8 path's, but at least kUnitsPerThread a thread.
  const int64_t pairs = H / 16;
  const int64_t per_unit = std::max<int64_t>(
      1, std::min<int64_t>(kUnitWeights / (2 * kPanel * inter_max),
                           pairs / (kUnitsPerThread * at::get_num_threads())));
  const int64_t down_units = (pairs + per_unit - 1) / per_unit;
  const auto down_pair = [&](const Job& job, int64_t p) {
    return job.down + p * 2 * (job.inter / kQuantBlock) * record_bytes(job.down_format);
  };
  parallel_dynamic(down_units, [&](std::atomic<int64_t>& next) {
    float* w = static_cast<float*>(std::aligned_alloc(64, inter_max * 16 * 4));
    for (int64_t u = next++, following; u < down_units; u = following) {
      following = next++;
      const int64_t begin = u * per_unit, end = std::min(pairs, begin + per_unit);
      for (size_t j = 0; j < jobs.size(); ++j) {
        const Job& job = jobs[j];
        const Job* next_job = j + 1 < jobs.size() ? &jobs[j + 1] : nullptr;
        for (int64_t p = begin; p < end; ++p) {
          // prefetched: this pair of the next expert, or of the first in the next unit
          const int64_t ahead_pair = next_job ? p : following * per_unit + (p - begin);
          const uint8_t* ahead =
              next_job ? down_pair(*next_job, ahead_pair)
              : following < down_units && ahead_pair < pairs ? down_pair(jobs[0], ahead_pair)
                                                             : nullptr;
          pair_rows_of(job.down_format, down_pair(job, p), job.inter / kQuantBlock, job.inter,
                       job.rows, job.down_int8, job.act, job.qa, w, ahead,
                       [&](int64_t r, int64_t rows, const float* tile) {
                         for (int64_t i = 0; i < rows; ++i) {
                           float* o = out + job.token[r + i] * H + 16 * p;
                           const __m256 scale = _mm256_set1_ps(job.weight[r + i]);
                           for (int half = 0; half < 2; ++half)
                             _mm256_storeu_ps(o + 8 * half, _mm256_fmadd_ps(
                                 scale, _mm256_loadu_ps(tile + 16 * i + 8 * half),
                                 _mm256_loadu_ps(o + 8 * half)));
                         }
                       });
        }
      }
    }
    std::free(w);
  });
}

}  // namespace moe
#endif

// x [T, H] float32, logits [T, E] float32; gate_up uint8 [E, I / 4, H / 32, record] (each
// expert's gate and up panels interleaved: gate panel p, up panel p), down uint8 [E, H / 8,
// I / 32, record]; the shared expert's the same without E, shared_gate float32 [H] (or none:
// weight 1). The experts' SiLU-gated MLPs summed by their router weights -> [T, H].
torch::Tensor moe_experts(torch::Tensor x, torch::Tensor logits, int64_t top_k, bool normalize,
                          torch::Tensor gate_up, torch::Tensor down,
                          c10::optional<torch::Tensor> shared_gate_up,
                          c10::optional<torch::Tensor> shared_down,
                          c10::optional<torch::Tensor> shared_gate, int64_t int8_rows_4bit,
                          int64_t int8_rows_8bit) {
  TORCH_CHECK(supported(), "moe_experts needs a CPU with AVX2, FMA and F16C");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % 16 == 0,
              "x must be [tokens, H] float32, H a multiple of 16");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(0) == T,
              "logits must be [tokens, experts] float32");
  const int64_t E = logits.size(1);
  TORCH_CHECK(top_k >= 1 && top_k <= E, "top_k must be between 1 and the expert count");
  const auto check = [&](const torch::Tensor& gu, const torch::Tensor& dn, int64_t dims,
                         const char* what) {
    const auto record_ok = [](const torch::Tensor& t) {
      return is_record(t.size(-1));
    };
    TORCH_CHECK(gu.dim() == dims && dn.dim() == dims && gu.scalar_type() == at::kByte &&
                    dn.scalar_type() == at::kByte && gu.is_contiguous() && dn.is_contiguous() &&
                    record_ok(gu) && record_ok(dn),
                what, " panels must be contiguous uint8 with 4-bit, 8-bit or Q4_K records");
    const int64_t inter = gu.size(-3) * kPanel / 2;
    TORCH_CHECK(gu.size(-3) % 8 == 0 && gu.size(-2) * kQuantBlock == H &&
                    dn.size(-3) * kPanel == H && dn.size(-2) * kQuantBlock == inter,
                what, " panels must be gate_up [I / 4, H / 32, record] and down [H / 8, I / 32, "
                "record], I a multiple of 32");
    if (dims == 4)
      TORCH_CHECK(gu.size(0) == E && dn.size(0) == E, what, " panels must hold every expert");
  };
  check(gate_up, down, 4, "the experts'");
  TORCH_CHECK(shared_gate_up.has_value() == shared_down.has_value(),
              "a shared expert needs both its gate_up and down panels");
  if (shared_gate_up.has_value()) check(*shared_gate_up, *shared_down, 3, "the shared expert's");
  TORCH_CHECK(!shared_gate.has_value() ||
                  (shared_gate_up.has_value() && shared_gate->numel() == H &&
                   shared_gate->scalar_type() == at::kFloat),
              "shared_gate must be float32 [H], with a shared expert");
  auto out = torch::zeros({T, H}, x.options());
  if (T == 0) return out;
#ifdef LOOM_HAVE_AVX2
  x = x.contiguous();
  logits = logits.contiguous();
  const torch::Tensor gate = shared_gate.has_value() ? shared_gate->contiguous() : torch::Tensor();
  const moe::Matrices routed = moe::matrices(gate_up, down);
  moe::Matrices shared_matrices{};
  if (shared_gate_up.has_value()) shared_matrices = moe::matrices(*shared_gate_up, *shared_down);
  moe::run(x.data_ptr<float>(), T, H, logits.data_ptr<float>(), E, top_k, normalize, routed,
           shared_gate_up.has_value() ? &shared_matrices : nullptr,
           shared_gate.has_value() ? gate.data_ptr<float>() : nullptr, int8_rows_4bit,
           int8_rows_8bit, out.data_ptr<float>());
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Without the GIL: the HTTP server's event loop runs on while a step's matmuls do.
  m.def("block_quant_linear", &block_quant_linear, py::call_guard<py::gil_scoped_release>());
  m.def("panels_from_blocks", &panels_from_blocks, py::call_guard<py::gil_scoped_release>());
  m.def("moe_experts", &moe_experts, py::call_guard<py::gil_scoped_release>());
  m.def("supported", &supported);
  m.def("vnni", &vnni);
  LOOM_POOL_BINDINGS(m);
}
