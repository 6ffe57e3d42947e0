// loom: the AMX tile intrinsics fused_ops.cpp uses, in software, so that its AMX kernel
// (amx_bf16_linear) can be built and checked on a CPU without AMX (tests only:
// LOOM_AMX_ON_AVX2, see tests/test_other_simd.py). Each thread has its own eight tiles and
// palette, as the hardware gives each thread its own tile state. TDPBF16PS is done as its
// definition reads: per fp32 lane of C, the two bf16 products of a pair widened to fp32 and
// added to it; only the order of the sums may differ from a real tile unit. Included after
// <immintrin.h>, whose own tile macros are replaced below.
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <cstring>

#include "avx512_on_avx2.h"

struct AmxTiles {
  alignas(64) uint8_t data[8][16 * 64];
  uint8_t rows[8];
  uint16_t colsb[8];
};
inline thread_local AmxTiles amx_tiles;

// The palette-1 layout the kernel's TileConfig follows: colsb[16] at byte 16, rows[16] at 48.
static inline void amx_loadconfig(const void* config) {
  const uint8_t* c = static_cast<const uint8_t*>(config);
  for (int t = 0; t < 8; ++t) {
    std::memcpy(&amx_tiles.colsb[t], c + 16 + 2 * t, 2);
    amx_tiles.rows[t] = c[48 + t];
  }
}
static inline void amx_release() {}
static inline void amx_zero(int t) { std::memset(amx_tiles.data[t], 0, 16 * 64); }
static inline void amx_loadd(int t, const void* base, int64_t stride) {
  for (int r = 0; r < amx_tiles.rows[t]; ++r)
    std::memcpy(amx_tiles.data[t] + 64 * r, static_cast<const uint8_t*>(base) + r * stride,
                amx_tiles.colsb[t]);
}
static inline void amx_stored(int t, void* base, int64_t stride) {
  for (int r = 0; r < amx_tiles.rows[t]; ++r)
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, amx_tiles.data[t] + 64 * r,
                amx_tiles.colsb[t]);
}
static inline float amx_bf16(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
// C[m][n] += sum over k of A[m][2k] B[k][2n] + A[m][2k + 1] B[k][2n + 1] (bf16 pairs).
static inline void amx_dpbf16ps(int c, int a, int b) {
  const int M = amx_tiles.rows[c], N = amx_tiles.colsb[c] / 4, K = amx_tiles.colsb[a] / 4;
  for (int m = 0; m < M; ++m) {
    float* cm = reinterpret_cast<float*>(amx_tiles.data[c] + 64 * m);
    const uint16_t* am = reinterpret_cast<const uint16_t*>(amx_tiles.data[a] + 64 * m);
    for (int k = 0; k < K; ++k) {
      const uint16_t* bk = reinterpret_cast<const uint16_t*>(amx_tiles.data[b] + 64 * k);
      for (int n = 0; n < N; ++n)
        cm[n] += amx_bf16(am[2 * k]) * amx_bf16(bk[2 * n]) +
                 amx_bf16(am[2 * k + 1]) * amx_bf16(bk[2 * n + 1]);
    }
  }
}

#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#define _tile_loadconfig amx_loadconfig
#define _tile_release amx_release
#define _tile_zero(t) amx_zero(t)
#define _tile_loadd(t, base, stride) amx_loadd(t, base, stride)
#define _tile_stored(t, base, stride) amx_stored(t, base, stride)
#define _tile_dpbf16ps(c, a, b) amx_dpbf16ps(c, a, b)
