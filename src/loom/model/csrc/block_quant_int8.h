// loom: the native matmul's int8 path (block_quant_linear.cpp: up to `int8_rows` rows).
#pragma once
#include <ATen/Parallel.h>
#include <vector>

#include "avx2_reduce.h"
#include "block_quant_formats.h"
#include "parallel_dynamic.h"

#ifdef LOOM_HAVE_AVX2
// One row of x, per block of 32, as two int8 parts: x ~ dx * (q1 + q2 / 256), q1 = round(x / dx)
// with dx = max|x| / 127 and q2 the rounded rest in 1/256ths, both in [-127, 127] (127 keeps
// 256 q1 + q2 within int16): int16 precision. Per block: the scale dx / 256, the exact sum
// of x, and the centring term 8 * (sum x - sum of its quantized values) for 4-bit codes (see
// int_tile). For 4-bit codes the two parts' 32 codes are stored one after the other, as
// bytes; for 8-bit codes the block is the 32 int16 values 256 q1 + q2 (the same 64 bytes).
// Q6_K's 6-bit codes (Bits 6) take the bytes as 4-bit ones do, and in place of the sum and
// the centring term the offset of each half of 16, -32 * (the sum of its 256 q1 + q2): the
// codes' -32, on x's quantized values (exact, in integers under 2^24).
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
    __m256 total[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};  // of 256 q1 + q2 per 16
    for (int i = 0; i < 4; ++i) {
      const __m256 t = _mm256_mul_ps(v[i], inv);
      const __m256 r1 = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256 r2 = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_round_ps(
          _mm256_mul_ps(_mm256_sub_ps(t, r1), _mm256_set1_ps(256.0f)),
          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
      const __m256 both = _mm256_fmadd_ps(r1, _mm256_set1_ps(256.0f), r2);
      total[i / 2] = _mm256_add_ps(total[i / 2], both);  // exact in fp32
      q1[i] = _mm256_cvtps_epi32(r1);
      q2[i] = _mm256_cvtps_epi32(r2);
      joined[i] = _mm256_cvtps_epi32(both);
    }
    const float s = hsum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
    scale[b] = m / (127.0f * 256.0f);
    if constexpr (Bits == 6) {
      sum[b] = -32.0f * hsum(total[0]);
      centre[b] = -32.0f * hsum(total[1]);
    } else {
      sum[b] = s;
      centre[b] = 8.0f * (s - scale[b] * hsum(_mm256_add_ps(total[0], total[1])));
    }
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

// One step of group_pair_sums: acc plus one row's byte products with code groups c0 and c1
// (x's part at q, four values a group). With VNNI two _mm256_dpbusd_epi32 into int32 sums;
// without, two _mm256_maddubs_epi16 pair sums added as int16 (4-bit codes: at most 2 * 15 *
// 127 a group, so eight groups' fit) or, for 6-bit codes (2 * 63 * 127: two groups' fit),
// widened to int32 first.
template <bool SixBit>
static LOOM_INLINE __m256i add_products(__m256i acc, __m256i c0, __m256i c1, const int8_t* q) {
#ifdef LOOM_HAVE_VNNI
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(acc, c0, broadcast4(q)), c1, broadcast4(q + 4));
#else
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(c0, broadcast4(q)),
                                         _mm256_maddubs_epi16(c1, broadcast4(q + 4)));
  if constexpr (SixBit)
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  else
    return _mm256_add_epi16(acc, pairs);
#endif
}

// s1[r], s2[r]: the byte products of code groups g0 .. g1 - 1 of one block with row r's q1 and
// q2 parts, from zero; 4-bit codes (nibble_group) or Q6_K's 0..63 ones (six_bit_group). The
// one loop both block_sums (4-bit) and six_bit_sums run, so their VNNI and AVX2 products
// cannot drift apart; add_products says what the sums hold.
template <bool SixBit, int R>
static LOOM_INLINE void group_pair_sums(const uint8_t* rec, const int8_t* qx, int64_t K,
                                        int64_t b, int g0, int g1, __m256i (&s1)[R],
                                        __m256i (&s2)[R]) {
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) s1[r] = s2[r] = _mm256_setzero_si256();
  // two code groups (one 32-byte load) per iteration, not unrolled further: fully
  // unrolled, GCC computed every group's products first and spilled them
#pragma GCC unroll 1
  for (int g = g0; g < g1; g += 2) {
    const __m256i c0 = SixBit ? six_bit_group(rec, g) : nibble_group(rec, g);
    const __m256i c1 = SixBit ? six_bit_group(rec, g + 1) : nibble_group(rec, g + 1);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int8_t* q = qx + r * 2 * K + 2 * b * kQuantBlock + 4 * g;
      s1[r] = add_products<SixBit>(s1[r], c0, c1, q);
      s2[r] = add_products<SixBit>(s2[r], c0, c1, q + kQuantBlock);
    }
  }
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
    __m256i s1[R], s2[R];  // int32 per channel with VNNI, int16 pair sums without
    group_pair_sums<false>(rec, qx, K, b, 0, 8, s1, s2);
#ifndef LOOM_HAVE_VNNI
    const __m256i ones = _mm256_set1_epi16(1);
#endif
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

// Q6_K's block_sums: t[h][r] = 256 sum(q * q1) + sum(q * q2) over inputs 16h .. 16h + 15 of
// one block, per channel (int32 exact; as fp32 rounded where it passes 2^24, far below the
// rounding of x). Codes 0..63 take the byte products of 4-bit ones; without VNNI a pair sum is
// at most 2 * 63 * 127, so two code groups' fit in int16 before they are widened.
template <int R>
static LOOM_INLINE void six_bit_sums(const uint8_t* rec, const int8_t* qx, int64_t K, int64_t b,
                                     __m256 (&t)[2][R]) {
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    __m256i s1[R], s2[R];
    group_pair_sums<true>(rec, qx, K, b, 4 * h, 4 * h + 4, s1, s2);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      t[h][r] = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(s1[r], 8), s2[r]));
  }
}

// y[r, 0..7] = x[r] . panel (+ bias) for R <= 4 rows, from the two-part int8 activations.
// Per block, with the integer dot products t1 = sum(q * q1), t2 = sum(q * q2) and a = dx / 256:
// y += d * (a * (256 t1 + t2) + centre) + m * sum(x). For 4-bit codes the centring term
// weighs the rounding error of x by q - 8 instead of q (0..15), a smaller weight; 8-bit codes
// are signed already and take no centring. Q6_K's, per half of 16 with its own d and the
// offset quantize_row<6> left in sum and centre: y += d_h * a * (256 t1 + t2 + offset_h).
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
      // into L2 (T1): a unit ahead is up to kUnitWeights weights (~150 KB of Q4_K records),
      // far more than L1 holds, and prefetched into L1 (T0) it pushed out the lines in use:
      // one user's matmul chain on the Qwen3-8B-shaped Q4_K_M took 184 ms (24 GB/s) with T0,
      // 143 ms (31 GB/s, this host's read bandwidth) with T1 (docs/benchmark-log.md, dense49)
#pragma GCC unroll 8
      for (int64_t offset = 0; offset < record; offset += 64)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + b * record + offset), _MM_HINT_T1);
    }
    super_scales<F>(panel, b, super);
    if constexpr (F == kQ6K) {
      __m256 t[2][R], d[2], m[2];
      six_bit_sums<R>(rec, qx, K, b, t);
      half_scales<F>(panel, b, super, d, m);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int64_t i = r * nb + b;
        const __m256 a = _mm256_set1_ps(scale[i]);
        acc[r] = _mm256_fmadd_ps(
            _mm256_mul_ps(_mm256_add_ps(t[0][r], _mm256_set1_ps(sum[i])), a), d[0], acc[r]);
        acc[r] = _mm256_fmadd_ps(
            _mm256_mul_ps(_mm256_add_ps(t[1][r], _mm256_set1_ps(centre[i])), a), d[1], acc[r]);
      }
      continue;
    }
    __m256 t[R];
    block_sums<Bits, R>(rec, qx, K, b, t);
    __m256 d, m;
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

// y's rows are N floats apart (N >= the panels' P * 8 outputs: a part of a stacked output).
template <int F>
static void int8_path(const float* xp, int64_t M, int64_t K, const uint8_t* wp, int64_t P,
                      const float* bp, float* yp, int64_t N) {
  constexpr int Bits = code_bits(F);
  constexpr int64_t record = record_bytes(F);
  const int64_t nb = K / kQuantBlock;
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
#endif
