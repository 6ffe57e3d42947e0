// loom: decode attention straight from the paged KV cache, one query token per request, no
// gather. Caches are indexed [block, position in block, kv head, dim] through their strides.
// K must have position stride 1 (stored [blocks, kv_heads, dim, block_size], see
// new_kv_cache) so that q.K over a block is a vector FMA across its positions per dim, with
// the block's scores held in registers; V must have dim stride 1 so that p.V is a vector FMA
// across dims, with the G heads' accumulators held in registers. Both need the shape known at
// compile time, hence the dispatch over (G query heads per kv head, head dim); other shapes
// use the torch path (`supported`). Work is split over (request, kv head) pairs. On AVX2 an
// intrinsics version (below) reads each K block once for all G heads and prefetches the next
// block; elsewhere a portable version relies on the compiler's vectorizer.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

#include "parallel_dynamic.h"

constexpr int64_t kBlockSize = 16;

// Requests arrive sorted by context length, shortest first. Threads take (request, kv head)
// items one at a time (parallel_dynamic.h), longest request first, so the short ones at the
// end even out the threads' finishing times.
static inline int64_t longest_first(int64_t k, int64_t n) { return n - 1 - k; }

// The G query heads of kv head kh of request i, scaled, as fp32.
template <typename T, int G, int D>
static inline void load_query(const T* q, int64_t i, int64_t H, int64_t kh, float scale,
                              float (&qf)[G][D]) {
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d)
      qf[g][d] = static_cast<float>(q[(i * H + kh * G + g) * D + d]) * scale;
}

// Scores of L positions -> probabilities, in place.
static inline void softmax(float* s, int64_t L) {
  const float m = *std::max_element(s, s + L);
  float sum = 0.f;
  for (int64_t p = 0; p < L; ++p) { s[p] = std::exp(s[p] - m); sum += s[p]; }
  const float inv = 1.f / sum;
  for (int64_t p = 0; p < L; ++p) s[p] *= inv;
}

template <typename T, int G, int D>
static inline void store_output(const float (&acc)[G][D], T* out, int64_t i, int64_t H,
                                int64_t kh) {
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d)
      out[(i * H + kh * G + g) * D + d] = static_cast<T>(acc[g][d]);
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const c10::BFloat16* p) {  // bf16 -> fp32 is a 16-bit shift
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Block tables scatter a request's context, so the hardware prefetcher stalls at every block:
// fetch the next block's rows (of row_bytes each) while this one is computed.
template <typename T>
static inline void prefetch_block(const T* base, int64_t rows, int64_t row_stride,
                                  int64_t row_bytes) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < row_bytes; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(base + r * row_stride) + b, _MM_HINT_T0);
}

// AVX2: each K block is read once for all G heads (scores of 16 positions x G heads in
// registers), and p.V runs over a block's positions for a slice of DC dims at a time, the G
// heads' accumulators for that slice in registers, so the V block is read from L1 D / DC times
// instead of the accumulators going through memory for every position.
template <typename T, int G, int D>
static void decode(const T* q, const T* kc, const T* vc, const int64_t* bt, const int64_t* lens,
                   T* out, int64_t n, int64_t KVH, int64_t max_blocks, const int64_t* ks,
                   const int64_t* vs, float scale) {
  constexpr int64_t BS = kBlockSize;
  constexpr int DC = G <= 4 ? 16 : 8;  // dims per p.V pass: 2 * G (or G) accumulators
  static_assert(BS == 16 && D % DC == 0, "block of 16 positions = 2 vectors");
  const int64_t H = G * KVH;
  parallel_dynamic(n * KVH, [&](std::atomic<int64_t>& next) {
    std::vector<float> scores;
    for (int64_t idx; (idx = next++) < n * KVH;) {
      const int64_t i = longest_first(idx / KVH, n), kh = idx % KVH, L = lens[i];
      const int64_t num_blocks = (L + BS - 1) / BS, Lp = num_blocks * BS;
      const int64_t* table = bt + i * max_blocks;
      float qf[G][D];
      load_query(q, i, H, kh, scale, qf);
      scores.resize(G * Lp);
      for (int64_t b = 0; b < num_blocks; ++b) {
        const T* kb = kc + table[b] * ks[0] + kh * ks[2];
        if (b + 1 < num_blocks)
          prefetch_block(kc + table[b + 1] * ks[0] + kh * ks[2], D, ks[3], BS * sizeof(T));
        __m256 s[G][2];
        for (int g = 0; g < G; ++g) s[g][0] = s[g][1] = _mm256_setzero_ps();
        for (int d = 0; d < D; ++d) {
          const __m256 k0 = load8(kb + d * ks[3]), k1 = load8(kb + d * ks[3] + 8);
          for (int g = 0; g < G; ++g) {
            const __m256 qd = _mm256_set1_ps(qf[g][d]);
            s[g][0] = _mm256_fmadd_ps(qd, k0, s[g][0]);
            s[g][1] = _mm256_fmadd_ps(qd, k1, s[g][1]);
          }
        }
        for (int g = 0; g < G; ++g) {
          _mm256_storeu_ps(&scores[g * Lp + b * BS], s[g][0]);
          _mm256_storeu_ps(&scores[g * Lp + b * BS + 8], s[g][1]);
        }
      }
      for (int g = 0; g < G; ++g) softmax(&scores[g * Lp], L);
      float acc[G][D] = {};
      for (int64_t b = 0; b < num_blocks; ++b) {
        const T* vb = vc + table[b] * vs[0] + kh * vs[2];
        if (b + 1 < num_blocks)
          prefetch_block(vc + table[b + 1] * vs[0] + kh * vs[2], BS, vs[1], D * sizeof(T));
        const int64_t positions = std::min(BS, L - b * BS);
        for (int dc = 0; dc < D; dc += DC) {
          __m256 a[G][DC / 8];
          for (int g = 0; g < G; ++g)
            for (int j = 0; j < DC / 8; ++j) a[g][j] = _mm256_loadu_ps(&acc[g][dc + 8 * j]);
          for (int64_t p = 0; p < positions; ++p) {
            const T* v = vb + p * vs[1] + dc;
            __m256 vv[DC / 8];
            for (int j = 0; j < DC / 8; ++j) vv[j] = load8(v + 8 * j);
            for (int g = 0; g < G; ++g) {
              const __m256 w = _mm256_set1_ps(scores[g * Lp + b * BS + p]);
              for (int j = 0; j < DC / 8; ++j) a[g][j] = _mm256_fmadd_ps(w, vv[j], a[g][j]);
            }
          }
          for (int g = 0; g < G; ++g)
            for (int j = 0; j < DC / 8; ++j) _mm256_storeu_ps(&acc[g][dc + 8 * j], a[g][j]);
        }
      }
      store_output(acc, out, i, H, kh);
    }
  });
}
#else
template <typename T, int G, int D>
static void decode(const T* q, const T* kc, const T* vc, const int64_t* bt, const int64_t* lens,
                   T* out, int64_t n, int64_t KVH, int64_t max_blocks, const int64_t* ks,
                   const int64_t* vs, float scale) {
  constexpr int64_t BS = kBlockSize;
  const int64_t H = G * KVH;
  parallel_dynamic(n * KVH, [&](std::atomic<int64_t>& next) {
    std::vector<float> scores;
    for (int64_t idx; (idx = next++) < n * KVH;) {
      const int64_t i = longest_first(idx / KVH, n), kh = idx % KVH, L = lens[i];
      float qf[G][D];
      load_query(q, i, H, kh, scale, qf);
      scores.resize(G * (L + BS));
      for (int64_t b = 0; b * BS < L; ++b) {
        const T* kb = kc + bt[i * max_blocks + b] * ks[0] + kh * ks[2];
        for (int g = 0; g < G; ++g) {
          float s[BS] = {};
          for (int d = 0; d < D; ++d) {
            const float qd = qf[g][d];
            const T* krow = kb + d * ks[3];
#pragma omp simd
            for (int64_t p = 0; p < BS; ++p) s[p] += qd * static_cast<float>(krow[p]);
          }
          std::copy_n(s, BS, &scores[g * (L + BS) + b * BS]);  // row padded: whole blocks
        }
      }
      for (int g = 0; g < G; ++g) softmax(&scores[g * (L + BS)], L);
      float acc[G][D] = {};
      for (int64_t p = 0; p < L; ++p) {
        const T* v = vc + bt[i * max_blocks + p / BS] * vs[0] + (p % BS) * vs[1] + kh * vs[2];
        float vf[D];
#pragma omp simd
        for (int d = 0; d < D; ++d) vf[d] = static_cast<float>(v[d]);
        for (int g = 0; g < G; ++g) {
          const float w = scores[g * (L + BS) + p];
#pragma omp simd
          for (int d = 0; d < D; ++d) acc[g][d] += w * vf[d];
        }
      }
      store_output(acc, out, i, H, kh);
    }
  });
}

#endif

// (G, D) instantiated; anything else goes through torch.
#define LOOM_FOR_EACH_SHAPE(X) \
  X(1, 64) X(2, 64) X(3, 64) X(4, 64) X(5, 64) X(6, 64) X(7, 64) X(8, 64) \
  X(1, 128) X(2, 128) X(3, 128) X(4, 128) X(5, 128) X(6, 128) X(7, 128) X(8, 128)

bool supported(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
               c10::ScalarType dtype) {
  if (block_size != kBlockSize || num_heads % num_kv_heads != 0 ||
      (dtype != at::kFloat && dtype != at::kBFloat16))
    return false;
  const int64_t G = num_heads / num_kv_heads;
#define LOOM_MATCH(g, d) if (G == g && head_dim == d) return true;
  LOOM_FOR_EACH_SHAPE(LOOM_MATCH)
#undef LOOM_MATCH
  return false;
}

template <typename T>
static void decode_shape(const T* q, const T* kc, const T* vc, const int64_t* bt,
                         const int64_t* lens, T* out, int64_t n, int64_t G, int64_t D,
                         int64_t KVH, int64_t max_blocks, const int64_t* ks, const int64_t* vs,
                         float scale) {
#define LOOM_CALL(g, d) \
  if (G == g && D == d) return decode<T, g, d>(q, kc, vc, bt, lens, out, n, KVH, max_blocks, \
                                               ks, vs, scale);
  LOOM_FOR_EACH_SHAPE(LOOM_CALL)
#undef LOOM_CALL
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "q [n, heads, dim]; caches [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(k_cache.stride(1) == 1, "K cache needs position stride 1 (see new_kv_cache)");
  TORCH_CHECK(v_cache.stride(3) == 1, "V cache needs dim stride 1");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(2);
  TORCH_CHECK(supported(H, KVH, D, k_cache.size(1), q.scalar_type()),
              "shape or dtype not supported by the native kernel");
  q = q.contiguous();
  auto bt = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = torch::empty_like(q);
  const int64_t ks[4] = {k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                         k_cache.stride(3)};
  const int64_t vs[4] = {v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                         v_cache.stride(3)};
  auto run = [&](auto type_tag) {  // float32 and bfloat16 only (checked by `supported`)
    using T = decltype(type_tag);
    decode_shape<T>(q.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                    bt.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<T>(), n,
                    H / KVH, D, KVH, bt.size(1), ks, vs, static_cast<float>(scale));
  };
  if (q.scalar_type() == at::kFloat) run(float{});
  else run(c10::BFloat16{});
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention);
  m.def("supported", &supported);
}
