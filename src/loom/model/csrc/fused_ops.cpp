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
torch::Tensor to_bf16(torch::Tensor x) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), cols = x.size(1);
  auto out = torch::empty({rows, cols}, x.options().dtype(at::kBFloat16));
  const uint32_t* src = reinterpret_cast<const uint32_t*>(x.data_ptr<float>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, rows, grain(cols), [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin * cols; i < end * cols; ++i) {
      const uint32_t bits = src[i];
      dst[i] = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
    }
  });
  return out;
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
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == cols &&
                    bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "bias must be a contiguous [out] float32 tensor");
    b = bias->data_ptr<float>();
  }
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  LOOM_POOL_BINDINGS(m);
  m.def("bf16_linear", &bf16_linear);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("silu_mul", &silu_mul);
  m.def("to_bf16", &to_bf16);
}
