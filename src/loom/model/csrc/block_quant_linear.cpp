// loom: y = x W^T (+ b) for a few rows of fp32 x, with W held as the GGUF holds it: int8 codes
// q with one scale d and one offset m per block of 32 along a row, w = q * d + m (Q4_0, Q4_1
// and Q8_0 all have this form). At decode-sized batches an fp32 matmul is bound by streaming
// fp32 weights; reading 1-byte codes instead moves a quarter of the bytes, and the codes are
// the file's own numbers, so the result is the fp32 product with the file's weights, not an
// approximation of it (only the summation order differs).
//
// Work is split over pairs of output channels. For each group of up to 4 input rows, the pair's
// codes are decoded into registers as the dot products go: a register tile of 4 rows x 2
// channels x 8 lanes, 8 accumulators, 8 FMAs per 8 codes of each channel. Decoding again for
// every 4 rows was faster than decoding once into a row buffer at 6-16 rows. Past about 24 rows
// the FMAs dominate and oneDNN's fp32 kernels win (benchmarks/linear_layout.py), so the engine
// only sends small batches here. Needs AVX2 + FMA (`supported`).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LOOM_HAVE_AVX2 1
#endif

constexpr int64_t kQuantBlock = 32;

bool supported() {
#ifdef LOOM_HAVE_AVX2
  return true;
#else
  return false;
#endif
}

#ifdef LOOM_HAVE_AVX2
static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

static inline __m256 decode8(const int8_t* q, __m256 d, __m256 m) {
  const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)), d, m);
}

// out[r, 0..1] = x[r] . w0, x[r] . w1 for R <= 4 rows, decoding channels c and c + 1 into
// registers as it goes.
template <int R>
static inline void tile(const float* x, int64_t K, const int8_t* q0, const int8_t* q1,
                        const float* s0, const float* s1, const float* o0, const float* o1,
                        float* out, int64_t ldo, int64_t num_channels) {
  __m256 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / kQuantBlock; ++b) {
    const __m256 d0 = _mm256_set1_ps(s0[b]), m0 = _mm256_set1_ps(o0[b]);
    const __m256 d1 = _mm256_set1_ps(s1[b]), m1 = _mm256_set1_ps(o1[b]);
    for (int64_t k = b * kQuantBlock; k < (b + 1) * kQuantBlock; k += 8) {
      const __m256 v0 = decode8(q0 + k, d0, m0), v1 = decode8(q1 + k, d1, m1);
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_loadu_ps(x + r * K + k);
        a0[r] = _mm256_fmadd_ps(v0, xv, a0[r]);
        a1[r] = _mm256_fmadd_ps(v1, xv, a1[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    out[r * ldo] = hsum(a0[r]);
    if (num_channels == 2) out[r * ldo + 1] = hsum(a1[r]);
  }
}
#endif

torch::Tensor block_quant_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale,
                                 torch::Tensor offset, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(supported(), "block_quant_linear needs a CPU with AVX2 and FMA");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [rows, K] float32");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous(),
              "q must be contiguous int8 [N, K]");
  const int64_t M = x.size(0), N = q.size(0), K = q.size(1);
  TORCH_CHECK(x.size(1) == K && K % kQuantBlock == 0, "x [rows, K] with K a multiple of 32");
  TORCH_CHECK(scale.sizes() == offset.sizes() && scale.size(0) == N &&
                  scale.size(1) == K / kQuantBlock && scale.scalar_type() == at::kFloat &&
                  offset.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  offset.is_contiguous(),
              "scale and offset must be contiguous float32 [N, K / 32]");
  x = x.contiguous();
  auto out = torch::empty({M, N}, x.options());
  if (M == 0) return out;
#ifdef LOOM_HAVE_AVX2
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* op = offset.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  const int64_t nb = K / kQuantBlock, num_pairs = (N + 1) / 2;
  at::parallel_for(0, num_pairs, 8, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t c = 2 * pair, nc = std::min<int64_t>(2, N - c), c1 = c + nc - 1;
      for (int64_t r = 0; r < M; r += 4) {
#define LOOM_TILE(R) tile<R>(xp + r * K, K, qp + c * K, qp + c1 * K, sp + c * nb, sp + c1 * nb, \
                             op + c * nb, op + c1 * nb, yp + r * N + c, N, nc)
        switch (std::min<int64_t>(4, M - r)) {
          case 4: LOOM_TILE(4); break;
          case 3: LOOM_TILE(3); break;
          case 2: LOOM_TILE(2); break;
          default: LOOM_TILE(1); break;
        }
#undef LOOM_TILE
      }
    }
  });
#endif
  if (bias.has_value()) out.add_(*bias);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("block_quant_linear", &block_quant_linear);
  m.def("supported", &supported);
}
