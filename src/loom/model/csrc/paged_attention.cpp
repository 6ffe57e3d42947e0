#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

// loom: decode attention straight from the paged KV cache: one query token per request, no gather.
// q [n, H, D]; caches [blocks, block_size, KVH, D]; block_tables [n, max_blocks];
// context_lens [n]. Returns [n, H, D]. Work is split over (request, kv head) pairs; the G
// query heads sharing a kv head reuse each K/V row while it is in cache.
template <typename T>
static void decode(const T* q, const T* kc, const T* vc, const int64_t* bt, const int64_t* lens,
                   T* out, int64_t n, int64_t H, int64_t KVH, int64_t D, int64_t BS,
                   int64_t max_blocks, float scale) {
  const int64_t G = H / KVH;
  at::parallel_for(0, n * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t i = idx / KVH, kh = idx % KVH, L = lens[i];
      scores.resize(G * L);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = static_cast<float>(q[(i * H + kh * G + g) * D + d]) * scale;
      for (int64_t p = 0; p < L; ++p) {
        const int64_t block = bt[i * max_blocks + p / BS];
        const T* k = kc + ((block * BS + p % BS) * KVH + kh) * D;
        float kf[256];
        for (int64_t d = 0; d < D; ++d) kf[d] = static_cast<float>(k[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = &qf[g * D];
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qg[d] * kf[d];
          scores[g * L + p] = s;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = &scores[g * L];
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < L; ++p) m = std::max(m, sg[p]);
        float sum = 0.f;
        for (int64_t p = 0; p < L; ++p) { sg[p] = std::exp(sg[p] - m); sum += sg[p]; }
        const float inv = 1.f / sum;
        for (int64_t p = 0; p < L; ++p) sg[p] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = 0; p < L; ++p) {
        const int64_t block = bt[i * max_blocks + p / BS];
        const T* v = vc + ((block * BS + p % BS) * KVH + kh) * D;
        float vf[256];
        for (int64_t d = 0; d < D; ++d) vf[d] = static_cast<float>(v[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float w = scores[g * L + p];
          float* ag = &acc[g * D];
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] += w * vf[d];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          out[(i * H + kh * G + g) * D + d] = static_cast<T>(acc[g * D + d]);
    }
  });
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q [n,H,D], caches [blocks,bs,KVH,D]");
  TORCH_CHECK(q.size(2) <= 256, "head_dim above 256");
  q = q.contiguous();
  auto bt = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = torch::empty_like(q);
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), max_blocks = bt.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                     v_cache.data_ptr<scalar_t>(), bt.data_ptr<int64_t>(),
                     lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), n, H, KVH, D, BS,
                     max_blocks, static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention);
}
