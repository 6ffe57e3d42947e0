// loom: RoPE on a step's query and key heads and the keys' and values' write into the paged
// caches, the first half of paged_attention.cpp's rope_write_decode.
#pragma once
#include <torch/extension.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "parallel_dynamic.h"

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
