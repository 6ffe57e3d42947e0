// loom: the native matmul's panel records (block_quant_linear.cpp says what each holds):
// their sizes and formats, and the per-block reads of scales and codes every path shares.
#pragma once
#include <cstdint>
#include <cstring>

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
constexpr int64_t kRecordQ6K = 192 + 2 * kPanel + 4;  // one Q6_K block of a panel
constexpr int64_t kQ6ShareAt = 192 + 2 * kPanel;      // where a Q6_K record's d share is
// Record formats, named by the code width they compute with but the K-quants' own.
enum Format : int { kQ4 = 4, kQ8 = 8, kQ4K = 44, kQ6K = 66 };
constexpr int code_bits(int F) { return F == kQ8 ? 8 : F == kQ6K ? 6 : 4; }
constexpr int64_t record_bytes(int F) {
  return F == kQ4 ? kRecord4 : F == kQ8 ? kRecord8 : F == kQ4K ? kRecordK4 : kRecordQ6K;
}
constexpr int64_t share_at(int F) { return F == kQ4K ? kShareAt : kQ6ShareAt; }
static int format_of(int64_t record) {
  return record == kRecord4 ? kQ4 : record == kRecord8 ? kQ8 : record == kRecordK4 ? kQ4K : kQ6K;
}
static bool is_record(int64_t size) {
  return size == kRecord4 || size == kRecord8 || size == kRecordK4 || size == kRecordQ6K;
}
constexpr int kTileRows = 6;                       // rows per fp32 register tile
constexpr int kIntTileRows = 4;                    // rows per integer register tile
constexpr int64_t kUnitWeights = 262144;           // at most, per work unit of the int8 path
constexpr int64_t kUnitsPerThread = 4;             // at least, where the layer has the panels

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

static LOOM_INLINE __m256 load_half8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

static LOOM_INLINE __m256 load_u8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// A K-quant super-block's d and -dmin per channel (unused by the other formats), gathered from
// the shares of its 8 records (one dword each: d low, dmin high, Q6_K's 0) at its first block,
// b % 8 == 0:
// once per 8 blocks, as a gather per block cost the int8 path a third of its speed.
struct Super {
  __m256 d = _mm256_setzero_ps(), m = _mm256_setzero_ps();
};

template <int F>
static LOOM_INLINE void super_scales(const uint8_t* panel, int64_t b, Super& s) {
  if constexpr (F == kQ4K || F == kQ6K) {
    if ((b & 7) != 0) return;
    constexpr int64_t record = record_bytes(F);
    const __m256i at = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                          _mm256_set1_epi32(static_cast<int>(record)));
    const __m256i share = _mm256_i32gather_epi32(
        reinterpret_cast<const int*>(panel + b * record + share_at(F)), at, 1);
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
// `panel` (Q4_K's: d * sc and -dmin * mn, from its super-block's `s`; Q6_K's, for inputs
// 16 half .. 16 half + 15: d * sc_half and -32 d * sc_half).
template <int F>
static LOOM_INLINE void block_scales(const uint8_t* panel, int64_t b, const Super& s,
                                     __m256& d, __m256& m, int half = 0) {
  constexpr int64_t record = record_bytes(F);
  const uint8_t* rec = panel + b * record;
  if constexpr (F == kQ4K) {
    d = _mm256_mul_ps(s.d, load_u8x8(rec + 128));
    m = _mm256_mul_ps(s.m, load_u8x8(rec + 128 + kPanel));
  } else if constexpr (F == kQ6K) {
    d = _mm256_mul_ps(s.d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                               reinterpret_cast<const __m128i*>(rec + 192 + kPanel * half)))));
    m = _mm256_mul_ps(d, _mm256_set1_ps(-32.0f));
  } else {
    d = load_half8(rec + record - kScaleBytes);
    m = load_half8(rec + record - kScaleBytes / 2);
  }
}

// Both halves' (block_scales): code groups 4h .. 4h + 3 take d[h], m[h]. One scale a block
// but for Q6_K.
template <int F>
static LOOM_INLINE void half_scales(const uint8_t* panel, int64_t b, const Super& s, __m256 (&d)[2],
                                    __m256 (&m)[2]) {
  block_scales<F>(panel, b, s, d[0], m[0], 0);
  if constexpr (F == kQ6K) {
    block_scales<F>(panel, b, s, d[1], m[1], 1);
  } else {
    d[1] = d[0];
    m[1] = m[0];
  }
}

// The 4-bit code group g of a block record: 32 codes, byte 4c + j = channel c, input 4g + j.
static LOOM_INLINE __m256i nibble_group(const uint8_t* rec, int g) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * (g / 2)));
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  return _mm256_and_si256(g % 2 == 0 ? v : _mm256_srli_epi16(v, 4), low4);
}

// The 6-bit code group g of a Q6_K record (codes 0..63, w = (q - 32) d sc): the low nibbles as
// a 4-bit record's, the high 2 bits at bits 2 (g % 4) of the 32 bytes at 128 + 32 (g / 4).
static LOOM_INLINE __m256i six_bit_group(const uint8_t* rec, int g) {
  const __m256i high =
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 128 + 32 * (g / 4)));
  const __m256i two = _mm256_and_si256(_mm256_srl_epi16(high, _mm_cvtsi32_si128(2 * (g % 4))),
                                       _mm256_set1_epi8(3));
  return _mm256_or_si256(nibble_group(rec, g), _mm256_slli_epi16(two, 4));
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
#endif
