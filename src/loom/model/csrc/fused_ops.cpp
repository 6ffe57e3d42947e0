// loom: the elementwise work between a layer's matmuls, fused into one pass each.
//
// torch runs F.rms_norm on CPU as about eight ops (square, mean, add, rsqrt, two multiplies,
// dtype casts): 20-30 us a call at 1-32 rows of this model's 576 channels, 61 calls a step.
// The residual add before it is one more op, and SiLU(gate) * up three more (chunk, silu,
// mul) with two passes over memory. Here each is one loop over the rows: float32, rows split
// over threads only when a row block is worth a fork/join.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>
#include <vector>

#include "parallel_dynamic.h"

// Rows per parallel task: about 256K elements. These loops run at memory speed, and waking
// torch's sleeping threads (OMP_WAIT_POLICY=PASSIVE, loom/threads.py) costs more than a
// decode step's rows take on one thread: at 32 rows of this model two threads were 3x slower
// for the norm, level for SiLU * up. Prefill chunks still split.
static int64_t grain(int64_t cols) { return std::max<int64_t>(1, 262144 / cols); }

static void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.is_contiguous(), name,
              " must be a contiguous [rows, cols] float32 tensor");
}

// hidden += delta (when given), in place; returns rms_norm(hidden) * weight, as
// x * (1 / sqrt(mean(x^2) + eps)) * w.
torch::Tensor add_rms_norm(torch::Tensor hidden, c10::optional<torch::Tensor> delta,
                           torch::Tensor weight, double eps) {
  check_rows(hidden, "hidden");
  const int64_t rows = hidden.size(0), cols = hidden.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == cols && weight.scalar_type() == at::kFloat &&
                  weight.is_contiguous(), "weight must be a contiguous [cols] float32 tensor");
  if (delta.has_value()) {
    check_rows(*delta, "delta");
    TORCH_CHECK(delta->sizes() == hidden.sizes(), "delta must have hidden's shape");
  }
  auto out = torch::empty({rows, cols}, hidden.options());  // one op (empty_like is two)
  float* h = hidden.data_ptr<float>();
  const float* d = delta.has_value() ? delta->data_ptr<float>() : nullptr;
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float epsf = static_cast<float>(eps);
  at::parallel_for(0, rows, grain(cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* hr = h + r * cols;
      float* orow = o + r * cols;
      float sum_sq = 0.f;
      if (d != nullptr) {
        const float* dr = d + r * cols;
#pragma omp simd reduction(+ : sum_sq)
        for (int64_t c = 0; c < cols; ++c) {
          const float v = hr[c] + dr[c];
          hr[c] = v;
          sum_sq += v * v;
        }
      } else {
#pragma omp simd reduction(+ : sum_sq)
        for (int64_t c = 0; c < cols; ++c) sum_sq += hr[c] * hr[c];
      }
      const float inv_rms = 1.f / std::sqrt(sum_sq / static_cast<float>(cols) + epsf);
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) orow[c] = hr[c] * inv_rms * w[c];
    }
  });
  return out;
}

// e^x for float32 by Cephes' expf method (range reduction to |r| <= ln2/2, degree-6
// polynomial, scale by 2^n through the exponent bits), within ~2 ulp of std::exp. Written out
// so that the compiler vectorizes the loop calling it; glibc's expf is a scalar call. x is
// clamped so that 2^n stays a normal float: -ffast-math assumes no infinities or NaNs.
static inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.3f), 88.f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// gate_up [rows, 2n] (gate, then up) -> silu(gate) * up [rows, n], silu(g) = g / (1 + e^-g).
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even number of columns");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = torch::empty({rows, n}, gate_up.options());
  const float* gu = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, grain(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gu + r * 2 * n;
      const float* u = g + n;
      float* orow = o + r * n;
      // Below -87 silu(g) is under 1e-35 in size, and e^-g clamped to e^88 would leave
      // g / e^88 there (-6e-9 at g = -1e30, whatever the compiler made of it): zero instead.
#pragma omp simd
      for (int64_t c = 0; c < n; ++c)
        orow[c] = g[c] < -87.f ? 0.f : g[c] / (1.f + exp_approx(-g[c])) * u[c];
    }
  });
  return out;
}

// float32 -> bfloat16, rounding to nearest even as torch's cast does: the way into
// bf16_linear's matmul. torch's cast forks onto the thread pool from 32K elements, about 60 us
// a call on two cores (a 32-row decode step has 60 such calls), where one thread copies these
// rows in a few.
static void round_to_bf16(const float* x, int64_t n, uint16_t* out) {
  const uint32_t* src = reinterpret_cast<const uint32_t*>(x);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = src[i];
    out[i] = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  }
}

torch::Tensor to_bf16(torch::Tensor x) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), cols = x.size(1);
  auto out = torch::empty({rows, cols}, x.options().dtype(at::kBFloat16));
  const float* src = x.data_ptr<float>();
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, rows, grain(cols), [&](int64_t begin, int64_t end) {
    round_to_bf16(src + begin * cols, (end - begin) * cols, dst + begin * cols);
  });
  return out;
}

// The bias of a matmul with `cols` outputs, checked, or nullptr for none.
static const float* bias_data(const c10::optional<torch::Tensor>& bias, int64_t cols) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == cols && bias->scalar_type() == at::kFloat &&
                  bias->is_contiguous(), "bias must be a contiguous [out] float32 tensor");
  return bias->data_ptr<float>();
}

// oneDNN's matmul on a weight it packed at load time (torch.ops.mkldnn._reorder_linear_weight):
// otherwise each call re-lays out the weight for the bf16 dot products, a quarter of a
// 32-row step's matmul time.
static torch::Tensor packed_matmul(const torch::Tensor& x, const torch::Tensor& packed) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                            const std::optional<at::Tensor>&, std::string_view,
                            c10::List<std::optional<at::Scalar>>,
                            std::optional<std::string_view>)>();
  return op.call(x, packed, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(), "");
}

// y = x W^T + b with x float32 [rows, K] and W bfloat16 [N, K] given as slices of its output
// channels (each [n_i, K], dense or packed by oneDNN), as a bfloat16 model's matmul computes
// it: x rounded to bf16, oneDNN's product (fp32 sums) rounded to bf16, then widened to float32
// and the bias added. What is loom's is who runs the matmul. Called from Python, oneDNN forks
// onto torch's OpenMP pool, whose helpers sleep between calls under OMP_WAIT_POLICY=PASSIVE:
// waking them cost 60-90 us a call on two cores, a fifth of a 32-row step's matmuls. Here the
// slices are taken one at a time by the threads of parallel_dynamic.h's yielding pool, each
// a one-thread oneDNN matmul (that thread's OpenMP team set to one for it) whose product is
// cast straight into out's columns. A slice's blocking can differ from a whole-matrix call's,
// so sums may round apart by one bf16 ulp.
torch::Tensor bf16_linear(torch::Tensor x, std::vector<torch::Tensor> slices,
                          c10::optional<torch::Tensor> bias) {
  check_rows(x, "x");
  TORCH_CHECK(!slices.empty(), "slices must not be empty");
  std::vector<int64_t> starts{0};
  for (const auto& w : slices) {
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(1) == x.size(1) &&
                    (w.is_mkldnn() || w.is_contiguous()),
                "slices must be [out, in] bfloat16 tensors (contiguous or oneDNN-packed) "
                "with x's in");
    starts.push_back(starts.back() + w.size(0));
  }
  const int64_t rows = x.size(0), cols = starts.back();
  const int64_t count = static_cast<int64_t>(slices.size());
  const float* b = bias_data(bias, cols);
  const torch::Tensor xb = to_bf16(x);
  auto out = torch::empty({rows, cols}, x.options());
  float* dst = out.data_ptr<float>();
  parallel_dynamic(count, [&](std::atomic<int64_t>& next) {
    at::internal::lazy_init_num_threads();  // torch's first-use setup would undo the next line
    const int team = omp_get_max_threads();
    omp_set_num_threads(1);
    for (int64_t i; (i = next++) < count;) {
      const torch::Tensor& w = slices[i];
      const torch::Tensor y = w.is_mkldnn() ? packed_matmul(xb, w) : at::linear(xb, w);
      const int64_t begin = starts[i], width = w.size(0);
      const uint16_t* src = reinterpret_cast<const uint16_t*>(y.data_ptr<at::BFloat16>());
      for (int64_t r = 0; r < rows; ++r) {
        uint32_t* bits = reinterpret_cast<uint32_t*>(dst + r * cols + begin);
        const uint16_t* yr = src + r * width;
#pragma omp simd
        for (int64_t c = 0; c < width; ++c) bits[c] = uint32_t{yr[c]} << 16;
        if (b == nullptr) continue;
        float* orow = dst + r * cols + begin;
#pragma omp simd
        for (int64_t c = 0; c < width; ++c) orow[c] += b[begin + c];
      }
    }
    omp_set_num_threads(team);
  });
  return out;
}

// y = x W^T + b on AMX tiles, with W bfloat16 [N, K] in `amx_tiles` layout (model/linear.py):
// [N / 32, K / 32, 2, 16, 16, 2], i.e. for each block of 32 output channels and each step of
// 32 inputs, two B tiles of 16 rows (input pairs) x 16 channels x 2 (the pair), the layout
// TDPBF16PS reads. Same rounding as bf16_linear: x rounded to bf16, fp32 sums rounded to
// bf16, widened, bias added in fp32. Why a kernel of loom's own: at decode row counts a step's
// matmuls are bound by streaming the weights from memory, and oneDNN's calls on these small
// shapes took far longer than the stream; the loop below reads each weight block once per call
// and keeps up with the stream to a few tens of rows (docs/benchmark-log.md, "The AMX tile
// kernel"). Threads
// take (panel of rows, block of 32 channels) items one at a time from parallel_dynamic's
// counter, panel by panel: a prefill's x (megabytes) would otherwise be read from memory once
// per block, while a panel of kAmxPanelRows rows stays in L2 across the blocks and only the
// weight is read again per panel.
//
//   x (rows padded to 16, zeros)      W block nb (32 channels)
//   rows m0 .. m0+15  -> A tile 4  x  B tile 6 (channels 0-15)  -> C tile 0
//                                  x  B tile 7 (channels 16-31) -> C tile 1
//   rows m0+16 .. +31 -> A tile 5  x  B tile 6                   -> C tile 2
//                                  x  B tile 7                   -> C tile 3
//   summed over the K / 32 steps, then C tiles -> bf16 -> fp32 (+ bias) into out's columns.
#if (defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)) || \
    defined(LOOM_AMX_ON_AVX2)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#if !defined(__AMX_TILE__)
#include "amx_on_avx2.h"  // tests: this kernel on a CPU without AMX, its tiles in software
#endif

constexpr int64_t kAmxBlock = 32;  // output channels per block, inputs per step
constexpr int64_t kAmxPanelRows = 256;  // rows of x per item (x's bf16 panel in L2)
// Elements of x from which its rounding to bf16 is shared out over the pool (a prefill
// chunk's; a decode step's is a few microseconds on the calling thread).
constexpr int64_t kParallelRounding = 1 << 16;

// Linux hands out the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA), once per process; a kernel or VM without it says no.
bool amx_available() {
#if defined(__AMX_TILE__)
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return permitted;
#else
  return true;  // the tiles in software (amx_on_avx2.h)
#endif
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Eight tiles of 16 rows x 64 bytes: C 0-3 (16 x 16 fp32), A 4-5 (16 x 32 bf16), B 6-7.
static void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// x (fp32 [rows, K]) into bf16 [padded rows, K], rounded as to_bf16, pad rows zero; a
// prefill's rows in tasks of 64 on the pool.
static void to_bf16_padded(const float* x, int64_t rows, int64_t padded, int64_t K,
                           uint16_t* out) {
  std::memset(out + rows * K, 0, (padded - rows) * K * sizeof(uint16_t));
  constexpr int64_t kRowsPerTask = 64;
  if (rows * K < kParallelRounding) return round_to_bf16(x, rows * K, out);
  const int64_t tasks = (rows + kRowsPerTask - 1) / kRowsPerTask;
  parallel_dynamic(tasks, [&](std::atomic<int64_t>& next) {
    for (int64_t t; (t = next++) < tasks;) {
      const int64_t begin = t * kRowsPerTask, end = std::min(rows, begin + kRowsPerTask);
      round_to_bf16(x + begin * K, (end - begin) * K, out + begin * K);
    }
  });
}

// Up to 32 rows of one block's sums (buf, [32, 32] fp32) into out: rounded to bf16 and
// widened, as a bf16 matmul's product, plus the bias.
static void store_block(const float* buf, int64_t rows, const float* bias, float* out,
                        int64_t out_row) {
  for (int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < 32; c += 16) {
      const __m256i h =
          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_load_ps(buf + r * 32 + c)));
      __m512 y = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      if (bias != nullptr) y = _mm512_add_ps(y, _mm512_loadu_ps(bias + c));
      _mm512_storeu_ps(out + r * out_row + c, y);
    }
}

// One block of 32 output channels for every row: x_bf16 [padded, K] (row stride K), w_block
// the block's K / 32 steps of two B tiles.
static void amx_block(const uint16_t* x_bf16, int64_t rows, int64_t padded, int64_t K,
                      const uint16_t* w_block, const float* bias, float* out, int64_t out_row) {
  alignas(64) float buf[32 * 32];
  const int64_t stride = K * sizeof(uint16_t), steps = K / kAmxBlock;
  for (int64_t m0 = 0; m0 < padded; m0 += 32) {
    const bool two = m0 + 16 < padded;  // a second A tile of rows
    const uint16_t* a = x_bf16 + m0 * K;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < steps; ++k) {
      const uint16_t* b = w_block + k * 2 * 512;
      _tile_loadd(4, a + k * kAmxBlock, stride);
      _tile_loadd(6, b, 64);
      _tile_loadd(7, b + 512, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (!two) continue;
      _tile_loadd(5, a + 16 * K + k * kAmxBlock, stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, buf, 128);
    _tile_stored(1, buf + 16, 128);
    if (two) {
      _tile_stored(2, buf + 512, 128);
      _tile_stored(3, buf + 528, 128);
    }
    store_block(buf, std::min<int64_t>(32, rows - m0), bias, out + m0 * out_row, out_row);
  }
}

torch::Tensor amx_bf16_linear(torch::Tensor x, torch::Tensor tiles,
                              c10::optional<torch::Tensor> bias) {
  check_rows(x, "x");
  TORCH_CHECK(amx_available(), "this process may not use AMX tiles (arch_prctl refused)");
  TORCH_CHECK(tiles.dim() == 6 && tiles.scalar_type() == at::kBFloat16 && tiles.is_contiguous() &&
                  tiles.size(1) * kAmxBlock == x.size(1) && tiles.size(2) == 2 &&
                  tiles.size(3) == 16 && tiles.size(4) == 16 && tiles.size(5) == 2,
              "tiles must be a contiguous bfloat16 [N/32, K/32, 2, 16, 16, 2] tensor "
              "(linear.amx_tiles) with x's K");
  const int64_t rows = x.size(0), K = x.size(1), blocks = tiles.size(0),
                cols = blocks * kAmxBlock, padded = (rows + 15) / 16 * 16;
  const float* b = bias_data(bias, cols);
  auto out = torch::empty({rows, cols}, x.options());
  if (rows == 0) return out;
  auto xb = torch::empty({padded, K}, x.options().dtype(at::kBFloat16));
  uint16_t* x_bf16 = reinterpret_cast<uint16_t*>(xb.data_ptr<at::BFloat16>());
  to_bf16_padded(x.data_ptr<float>(), rows, padded, K, x_bf16);
  const uint16_t* w = reinterpret_cast<const uint16_t*>(tiles.data_ptr<at::BFloat16>());
  float* o = out.data_ptr<float>();
  const int64_t panels = (padded + kAmxPanelRows - 1) / kAmxPanelRows, items = panels * blocks;
  parallel_dynamic(items, [&](std::atomic<int64_t>& next) {
    configure_tiles();  // tile state is per thread
    for (int64_t item; (item = next++) < items;) {
      const int64_t nb = item % blocks, r0 = item / blocks * kAmxPanelRows;
      amx_block(x_bf16 + r0 * K, std::min(kAmxPanelRows, rows - r0),
                std::min(kAmxPanelRows, padded - r0), K, w + nb * K * kAmxBlock,
                b == nullptr ? nullptr : b + nb * kAmxBlock, o + r0 * cols + nb * kAmxBlock,
                cols);
    }
    _tile_release();  // back to the init state: a context switch then saves no tile data
  });
  return out;
}
#else
bool amx_available() { return false; }

torch::Tensor amx_bf16_linear(torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "this build has no AMX kernel (compiled for a CPU without AMX bf16)");
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  LOOM_POOL_BINDINGS(m);
  m.def("bf16_linear", &bf16_linear);
  m.def("amx_bf16_linear", &amx_bf16_linear);
  m.def("amx_available", &amx_available);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("silu_mul", &silu_mul);
  m.def("to_bf16", &to_bf16);
}
