// loom: the few AVX-512 intrinsics loom's kernels use, each as two AVX2 halves, so that their
// AVX-512 code can be built and checked on a CPU without AVX-512 (tests only:
// LOOM_AVX512_ON_AVX2 in paged_attention.cpp, LOOM_AMX_ON_AVX2 in fused_ops.cpp; see
// tests/test_other_simd.py). Each one does lane for lane
// what the instruction does (fused multiply-add included), so results match a real AVX-512
// build's; only speed differs. Included after <immintrin.h>, whose own declarations the macros
// below then shadow.
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <cstring>

// Half i (0: lanes 0-7, 1: lanes 8-15) of a 512-bit vector, and two halves as one.
template <typename Half, typename Wide>
static inline Half avx512_half(Wide v, int i) {
  Half h;
  std::memcpy(&h, reinterpret_cast<const char*>(&v) + 32 * i, 32);
  return h;
}
template <typename Wide, typename Half>
static inline Wide avx512_join(Half lo, Half hi) {
  Wide v;
  std::memcpy(&v, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &hi, 32);
  return v;
}
static inline __m256 avx512_lo(__m512 v) { return avx512_half<__m256>(v, 0); }
static inline __m256 avx512_hi(__m512 v) { return avx512_half<__m256>(v, 1); }
static inline __m256i avx512i_lo(__m512i v) { return avx512_half<__m256i>(v, 0); }
static inline __m256i avx512i_hi(__m512i v) { return avx512_half<__m256i>(v, 1); }

static inline __m512 avx512_loadu_ps(const float* p) {
  return avx512_join<__m512>(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8));
}
static inline void avx512_storeu_ps(float* p, __m512 v) {
  _mm256_storeu_ps(p, avx512_lo(v));
  _mm256_storeu_ps(p + 8, avx512_hi(v));
}
static inline __m512 avx512_add_ps(__m512 a, __m512 b) {
  return avx512_join<__m512>(_mm256_add_ps(avx512_lo(a), avx512_lo(b)),
                             _mm256_add_ps(avx512_hi(a), avx512_hi(b)));
}
// fp32 -> bf16, rounding to nearest even (no NaNs here: -ffast-math), as VCVTNEPS2BF16.
static inline __m256bh avx512_cvtneps_pbh(__m512 v) {
  alignas(64) uint32_t bits[16];
  alignas(32) uint16_t out[16];
  std::memcpy(bits, &v, 64);
  for (int i = 0; i < 16; ++i)
    out[i] = static_cast<uint16_t>((bits[i] + 0x7FFFu + ((bits[i] >> 16) & 1u)) >> 16);
  __m256bh h;
  std::memcpy(&h, out, 32);
  return h;
}
static inline __m512 avx512_set1_ps(float x) {
  return avx512_join<__m512>(_mm256_set1_ps(x), _mm256_set1_ps(x));
}
static inline __m512 avx512_setzero_ps() { return avx512_set1_ps(0.f); }
static inline __m512 avx512_fmadd_ps(__m512 a, __m512 b, __m512 c) {
  return avx512_join<__m512>(_mm256_fmadd_ps(avx512_lo(a), avx512_lo(b), avx512_lo(c)),
                     _mm256_fmadd_ps(avx512_hi(a), avx512_hi(b), avx512_hi(c)));
}
static inline __m512 avx512_cvtph_ps(__m256i h) {  // 16 halves -> 16 floats
  return avx512_join<__m512>(_mm256_cvtph_ps(_mm256_castsi256_si128(h)),
                     _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
}
static inline __m512i avx512_cvtepu16_epi32(__m256i h) {
  return avx512_join<__m512i>(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)),
                      _mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)));
}
static inline __m512i avx512_slli_epi32(__m512i v, unsigned int n) {
  return avx512_join<__m512i>(_mm256_slli_epi32(avx512i_lo(v), n),
                              _mm256_slli_epi32(avx512i_hi(v), n));
}
static inline __m512 avx512_castsi512_ps(__m512i v) { __m512 f; std::memcpy(&f, &v, 64); return f; }

#define _mm512_loadu_ps avx512_loadu_ps
#define _mm512_load_ps avx512_loadu_ps
#define _mm512_add_ps avx512_add_ps
#define _mm512_cvtneps_pbh avx512_cvtneps_pbh
#define _mm512_storeu_ps avx512_storeu_ps
#define _mm512_set1_ps avx512_set1_ps
#define _mm512_setzero_ps avx512_setzero_ps
#define _mm512_fmadd_ps avx512_fmadd_ps
#define _mm512_cvtph_ps avx512_cvtph_ps
#define _mm512_cvtepu16_epi32 avx512_cvtepu16_epi32
#define _mm512_slli_epi32 avx512_slli_epi32
#define _mm512_castsi512_ps avx512_castsi512_ps
