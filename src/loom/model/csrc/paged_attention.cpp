// loom: decode attention straight from the paged KV cache, one query token per request, no
// gather. Caches are indexed [block, position in block, kv head, dim] through their strides.
// K must have position stride 1 (stored [blocks, kv_heads, dim, block_size], see
// new_kv_cache) so that q.K over a block is a vector FMA across its positions per dim, with
// the block's scores held in registers; V must have dim stride 1 so that p.V is a vector FMA
// across dims, with the G heads' accumulators held in registers. Both need the shape known at
// compile time, hence the dispatch over (G query heads per kv head, head dim); other shapes
// use the torch path (`supported`). Work is split over (request, kv head) pairs.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

constexpr int64_t kBlockSize = 16;

template <typename T, int G, int D>
static void decode(const T* q, const T* kc, const T* vc, const int64_t* bt, const int64_t* lens,
                   T* out, int64_t n, int64_t KVH, int64_t max_blocks, const int64_t* ks,
                   const int64_t* vs, float scale) {
  constexpr int64_t BS = kBlockSize;
  const int64_t H = G * KVH;
  at::parallel_for(0, n * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t i = idx / KVH, kh = idx % KVH, L = lens[i];
      float qf[G][D];
      for (int g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d)
          qf[g][d] = static_cast<float>(q[(i * H + kh * G + g) * D + d]) * scale;
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
      for (int g = 0; g < G; ++g) {
        float* sg = &scores[g * (L + BS)];
        const float m = *std::max_element(sg, sg + L);
        float sum = 0.f;
        for (int64_t p = 0; p < L; ++p) { sg[p] = std::exp(sg[p] - m); sum += sg[p]; }
        const float inv = 1.f / sum;
        for (int64_t p = 0; p < L; ++p) sg[p] *= inv;
      }
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
      for (int g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d)
          out[(i * H + kh * G + g) * D + d] = static_cast<T>(acc[g][d]);
    }
  });
}

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
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_decode", [&] {
    decode_shape<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                           v_cache.data_ptr<scalar_t>(), bt.data_ptr<int64_t>(),
                           lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), n, H / KVH, D,
                           KVH, bt.size(1), ks, vs, static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention);
  m.def("supported", &supported);
}
