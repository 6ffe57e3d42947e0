// loom: y = x W^T (+ b) for fp32 x, with W held as the GGUF holds it: int8 codes q with one
// scale d and one offset m per block of 32 along a row, w = q * d + m (Q4_0, Q4_1 and Q8_0 all
// have this form). The codes are the file's own numbers, so the result is the fp32 product with
// the file's weights, not an approximation of it (only the summation order differs), and a
// decode step streams 1-byte codes instead of 4-byte floats.
//
// The weight is laid out once, at load time, in panels of 16 output channels: codes
// [N/16, K, 16] and scale/offset [N/16, K/32, 16], so that row k of a panel is 16 consecutive
// codes that decode into two AVX2 registers. Threads take panels one at a time
// (parallel_dynamic.h). Per panel:
// - up to 6 rows: each row k of codes is decoded into registers and used at once by a tile of
//   R rows x 16 channels;
// - more rows: the panel is decoded once to fp32 (K x 16 floats, at most ~100 KB, so it stays
//   in L2) and a 6 x 16 register tile runs over it, per k two panel loads, six broadcasts and
//   twelve FMAs, the classic AVX2 sgemm micro-kernel. The decode is amortised over every row.
// On the bundled model this beat oneDNN's prepacked fp32 matmul from 1 to 512 rows and came
// within 6% of it at 2,048 (benchmarks/linear_layout.py --native-only). Needs AVX2 + FMA.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <cstdlib>

#include "parallel_dynamic.h"
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

constexpr int64_t kPanel = 16;
constexpr int kTileRows = 6;  // rows per register tile; also the most decoded in registers

#ifdef LOOM_HAVE_AVX2
// Always inlined (and, in the tiles, with the row loops unrolled) so that everything stays in
// registers: without the unrolling GCC kept the tile's accumulators on the stack, ten stores
// per k, at half the speed.
#define LOOM_INLINE inline __attribute__((always_inline))

// One k of a panel: 16 int8 codes -> 16 floats code * scale + offset, in two vectors. d and m
// point at the 16 scales and offsets of the codes' block.
static LOOM_INLINE void decode16(const int8_t* q, const float* d, const float* m, __m256& w0,
                                 __m256& w1) {
  const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), _mm256_loadu_ps(d),
                       _mm256_loadu_ps(m));
  w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c, 8))),
                       _mm256_loadu_ps(d + 8), _mm256_loadu_ps(m + 8));
}

static void decode_panel(const int8_t* q, const float* s, const float* o, int64_t K, float* w) {
  for (int64_t k = 0; k < K; ++k) {
    const int64_t b = k / kQuantBlock;
    __m256 w0, w1;
    decode16(q + k * kPanel, s + b * kPanel, o + b * kPanel, w0, w1);
    _mm256_store_ps(w + k * kPanel, w0);
    _mm256_store_ps(w + k * kPanel + 8, w1);
  }
}

// The register tile shared by both paths: 16 channels (two vectors) x R rows of accumulators.
template <int R>
static LOOM_INLINE void tile_fma(const float* x, int64_t K, int64_t k, __m256 w0, __m256 w1,
                                 __m256 (&a0)[R], __m256 (&a1)[R]) {
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    const __m256 xv = _mm256_broadcast_ss(x + r * K + k);
    a0[r] = _mm256_fmadd_ps(xv, w0, a0[r]);
    a1[r] = _mm256_fmadd_ps(xv, w1, a1[r]);
  }
}

template <int R>
static LOOM_INLINE void tile_store(__m256 (&a0)[R], __m256 (&a1)[R], float* y, int64_t N,
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

// y[r, 0..15] = x[r] . panel (+ bias) for R <= 6 rows, from the decoded fp32 panel w.
template <int R>
static inline void panel_tile(const float* x, int64_t K, const float* w, float* y, int64_t N,
                              const float* bias) {
  __m256 a0[R], a1[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k)
    tile_fma<R>(x, K, k, _mm256_load_ps(w + k * kPanel), _mm256_load_ps(w + k * kPanel + 8),
                a0, a1);
  tile_store<R>(a0, a1, y, N, bias);
}

// The same product for a batch of at most 6 rows, without the fp32 panel: each row k of codes
// is decoded into registers and used at once. With so few rows per decoded weight, writing the
// panel out and reading it back costs more than it saves.
template <int R>
static inline void decoding_tile(const float* x, int64_t K, const int8_t* q, const float* s,
                                 const float* o, float* y, int64_t N, const float* bias) {
  __m256 a0[R], a1[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    // scale and offset are re-read from L1 at each k, as memory operands of the FMAs: held in
    // registers they would leave too few for six rows of accumulators
    const int64_t b = k / kQuantBlock;
    __m256 w0, w1;
    decode16(q + k * kPanel, s + b * kPanel, o + b * kPanel, w0, w1);
    tile_fma<R>(x, K, k, w0, w1, a0, a1);
  }
  tile_store<R>(a0, a1, y, N, bias);
}
#endif

torch::Tensor block_quant_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale,
                                 torch::Tensor offset, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(supported(), "block_quant_linear needs a CPU with AVX2 and FMA");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [rows, K] float32");
  TORCH_CHECK(q.dim() == 3 && q.size(2) == kPanel && q.scalar_type() == at::kChar &&
                  q.is_contiguous(), "q must be contiguous int8 panels [N / 16, K, 16]");
  const int64_t M = x.size(0), P = q.size(0), K = q.size(1), N = P * kPanel;
  TORCH_CHECK(x.size(1) == K && K % kQuantBlock == 0, "x [rows, K] with K a multiple of 32");
  TORCH_CHECK(scale.sizes() == offset.sizes() && scale.dim() == 3 && scale.size(0) == P &&
                  scale.size(1) == K / kQuantBlock && scale.size(2) == kPanel &&
                  scale.scalar_type() == at::kFloat && offset.scalar_type() == at::kFloat &&
                  scale.is_contiguous() && offset.is_contiguous(),
              "scale and offset must be contiguous float32 [N / 16, K / 32, 16]");
  TORCH_CHECK(!bias.has_value() || (bias->numel() == N && bias->scalar_type() == at::kFloat),
              "bias must be float32 [N]");
  x = x.contiguous();
  auto out = torch::empty({M, N}, x.options());
  if (M == 0) return out;
#ifdef LOOM_HAVE_AVX2
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* op = offset.data_ptr<float>();
  const torch::Tensor b = bias.has_value() ? bias->contiguous() : torch::Tensor();
  const float* bp = bias.has_value() ? b.data_ptr<float>() : nullptr;
  float* yp = out.data_ptr<float>();
  const int64_t nb = K / kQuantBlock;
  parallel_dynamic(P, [&](std::atomic<int64_t>& next) {
    float* w = M > kTileRows ? static_cast<float*>(std::aligned_alloc(64, K * kPanel * 4))
                             : nullptr;
    for (int64_t p; (p = next++) < P;) {
      const int8_t* pq = qp + p * K * kPanel;
      const float *ps = sp + p * nb * kPanel, *po = op + p * nb * kPanel;
      const float* pb = bp == nullptr ? nullptr : bp + p * kPanel;
      if (w != nullptr) decode_panel(pq, ps, po, K, w);
      for (int64_t r = 0; r < M; r += kTileRows) {
        const float* xr = xp + r * K;
        float* yr = yp + r * N + p * kPanel;
#define LOOM_TILE(R) \
  w != nullptr ? panel_tile<R>(xr, K, w, yr, N, pb) : decoding_tile<R>(xr, K, pq, ps, po, yr, N, pb)
        switch (std::min<int64_t>(kTileRows, M - r)) {
          case 6: LOOM_TILE(6); break;
          case 5: LOOM_TILE(5); break;
          case 4: LOOM_TILE(4); break;
          case 3: LOOM_TILE(3); break;
          case 2: LOOM_TILE(2); break;
          default: LOOM_TILE(1); break;
        }
#undef LOOM_TILE
      }
    }
    std::free(w);
  });
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("block_quant_linear", &block_quant_linear);
  m.def("supported", &supported);
}
