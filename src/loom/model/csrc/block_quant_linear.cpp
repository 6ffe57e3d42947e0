// loom: y = x W^T (+ b) for fp32 x, with W held as the GGUF holds it: codes q with one scale d
// and one offset m per block of 32 along a row, w = q * d + m (Q4_0, Q4_1 and Q8_0 all have
// this form), 4-bit codes packed two to a byte and d, m in fp16, the file's own sizes.
//
// The weight is laid out once, at load time (loom.model.linear.to_panels), in panels of 8
// output channels; a panel's block b of 32 inputs is one record:
// - 4-bit: 128 bytes of codes, then d[8] and m[8] as fp16. Byte i of 32-byte chunk t holds,
//   low nibble first, byte i of the 4 x 8 code groups 2t and 2t + 1, where code group g is the
//   32 codes of inputs 32b + 4g .. 32b + 4g + 3, channel-major: byte 4c + j = channel c,
//   input 32b + 4g + j. 0 <= q <= 15 (Q4_0's signed codes come shifted by 8, m = -8d).
// - 8-bit: the 8 code groups as signed bytes (256 bytes), then d[8] and m[8].
// - Q4_K's own: the 4-bit record's 128 bytes of codes, then per channel the block's 6-bit
//   scale sc[8] and min mn[8] as bytes, then a share of the super-block's fp16 d and dmin: the
//   record of block b holds channel b % 8's (4 bytes; a super-block is 8 blocks, so its 8
//   records hold all 8 channels'). w = q * (d sc) - dmin mn, both products exact in fp32, so
//   the weights are the file's to the bit at 148 bytes a record (4.625 bits a weight; Q4_K's
//   4.5, Q4_1's 5). K a multiple of 256.
// - Q6_K's own: codes 0..63 (w = (q - 32) * d sc, a scale sc per 16 inputs): their low 4 bits
//   as the 4-bit record's 128 bytes, then their high 2 bits, 64 bytes: bits 2 (g % 4) of byte
//   4c + j of 32-byte chunk g / 4 belong to input 4g + j of channel c; then per channel the two
//   int8 scales, sc[8] for inputs 0-15 and sc[8] for 16-31, then the share of the super-block's
//   fp16 d as Q4_K's (2 bytes and 2 of padding). The file's weights to the bit, at 212 bytes a
//   record (6.625 bits a weight; Q6_K's 6.5625, Q8_0's 8.5). K a multiple of 256.
// A code group is one AVX2 register: 8 channels x 4 inputs, which is what _mm256_maddubs_epi16
// + _mm256_madd_epi16 sum into 8 int32 lanes, one per channel (AVX512-VNNI's
// _mm256_dpbusd_epi32 in one instruction, where the build has it).
//
// Two ways to compute, chosen by the row count:
// - up to `int8_rows` rows (decode steps): x is quantized once per call, per block of 32, into
//   two int8 parts, x ~ dx * (q1 + q2 / 256) with dx = max|x| / 127 (llama.cpp's Q8_1 is q1
//   alone: on the bundled model that changed most greedy completions; with q2 they stay
//   fp32's, benchmarks/kernels/native_accuracy.py), and every code group is an integer dot
//   product, with no decode of the weight to floats; per block, in fp32, y += d * dx *
//   sum(q * qx) + m * sum(x), with the exact sum of x, so that the offset term carries no
//   rounding of x. The weight streams at its packed size. 4-bit codes take the two parts as bytes
//   (_mm256_maddubs_epi16, unsigned codes); 8-bit codes take them joined, as the int16
//   256 q1 + q2 (_mm256_madd_epi16 on the codes widened): the same integer sums in half the
//   instructions of two signed byte products.
// - more rows (batched decode, prefill): two panels are decoded once to fp32 (K x 16 floats, at
//   most ~100 KB, so it stays in L2; by a pass of their own or by the first row tile, see
//   fp32_path) and 6 x 16 register tiles run over it, per k two panel loads, six broadcasts
//   and twelve FMAs, the classic AVX2 sgemm micro-kernel: the fp32 product with the file's
//   weights (only the summation order differs from F.linear), the decode amortised over
//   every row.
// Threads take work units of a few panels from a shared counter (parallel_dynamic.h), and
// prefetch the unit they take next while they compute the current one. Needs AVX2, FMA and
// F16C.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "block_quant_fp32.h"
#include "block_quant_int8.h"
#include "block_quant_moe.h"

bool supported() {
#ifdef LOOM_HAVE_AVX2
  return true;
#else
  return false;
#endif
}

// Whether the int8 path's dot products were built with AVX512-VNNI (block_sums): it then
// crosses over to the fp32 path at more rows (loom.model.linear picks the row limits by it).
bool vnni() {
#ifdef LOOM_HAVE_VNNI
  return true;
#else
  return false;
#endif
}

// The records this file's top describes, straight from a GGUF's blocks (uint8 [N, K / 32,
// header + codes]: fp16 d, then fp16 m if header is 4, then 16 bytes of 4-bit codes, byte
// j = input j low nibble and input j + 16 high, or 32 signed bytes). q4_0: the 4-bit codes
// count from 8, so m = -8d.
// header 6: Q4_K's blocks of 32 (weights.py: fp16 d, dmin, then the block's 6-bit scale and
// min as bytes, then 4-bit codes) -> Q4_K records. 24 bytes of codes after a header of 4:
// Q6_K's blocks of 32 (weights.py: fp16 d, the two int8 scales, 16 bytes of low nibbles as
// Q4_1's codes, 8 of high 2 bits, byte j holding inputs j, j + 8, j + 16, j + 24 from bit 0
// up) -> Q6_K records. One pass over the bytes at load time; numpy's byte shuffles made this
// most of the start-up.
torch::Tensor panels_from_blocks(torch::Tensor blocks, int64_t header, bool q4_0) {
  TORCH_CHECK(supported(), "panels_from_blocks needs a CPU with AVX2, FMA and F16C");
  TORCH_CHECK(blocks.dim() == 3 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.size(0) % kPanel == 0 && (header == 2 || header == 4 || header == 6),
              "blocks must be contiguous uint8 [N, K / 32, block bytes], N a multiple of 8");
  const int64_t code_bytes = blocks.size(2) - header;
  TORCH_CHECK(code_bytes == 16 || (code_bytes == 32 && header != 6) ||
                  (code_bytes == 24 && header == 4),
              "a block holds 16 or 32 bytes of codes (Q4_K's 16, Q6_K's 24)");
  const bool q6 = code_bytes == 24, k4 = header == 6;
  const int64_t nibble_bytes = q6 ? 16 : code_bytes;
  const bool four = nibble_bytes == 16;
  const int64_t P = blocks.size(0) / kPanel, nb = blocks.size(1), bytes = blocks.size(2);
  TORCH_CHECK(!(k4 || q6) || nb % kPanel == 0, "K-quant rows hold whole blocks of 256");
  const int64_t record = q6 ? kRecordQ6K : k4 ? kRecordK4 : four ? kRecord4 : kRecord8;
  const int64_t codes_end = record - kScaleBytes;
  auto out = torch::empty({P, nb, record}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* rec = dst + (p * nb + b) * record;
        for (int64_t c = 0; c < kPanel; ++c) {
          const uint8_t* blk = src + ((p * kPanel + c) * nb + b) * bytes;
          // One code group (4 inputs of this channel) is one 32-bit word of the record.
          uint32_t w[8];
          std::memcpy(w, blk + header, nibble_bytes);
          if (four) {  // word 2u + h: inputs 8u + 4h + j (low nibbles) and those + 16 (high)
            constexpr uint32_t lo4 = 0x0F0F0F0F;
            const uint32_t in[4] = {w[0], w[1], w[2], w[3]};
            for (int u = 0; u < 2; ++u) {  // record word t: inputs 8t + j (low), 8t + 4 + j
              w[u] = (in[2 * u] & lo4) | ((in[2 * u + 1] & lo4) << 4);
              w[u + 2] = ((in[2 * u] >> 4) & lo4) | (in[2 * u + 1] & ~lo4);
            }
          }
          for (int64_t g = 0; g < nibble_bytes / 4; ++g)
            std::memcpy(rec + g * 4 * kPanel + 4 * c, &w[g], 4);
          if (q6) {
            for (int h = 0; h < 2; ++h)
              for (int j = 0; j < 4; ++j) {  // the high bits of inputs 4g + j, g = 4h .. 4h + 3
                int byte = 0;
                for (int s = 0, i = 16 * h + j; s < 4; ++s, i += 4)
                  byte |= ((blk[20 + i % 8] >> (2 * (i / 8))) & 3) << (2 * s);
                rec[128 + 32 * h + 4 * c + j] = static_cast<uint8_t>(byte);
              }
            rec[192 + c] = blk[2];
            rec[192 + kPanel + c] = blk[3];
            if (b % kPanel == c) {  // its d
              std::memcpy(rec + kQ6ShareAt, blk, 2);
              rec[kQ6ShareAt + 2] = rec[kQ6ShareAt + 3] = 0;
            }
            continue;
          }
          if (k4) {
            rec[128 + c] = blk[4];
            rec[128 + kPanel + c] = blk[5];
            if (b % kPanel == c) std::memcpy(rec + kShareAt, blk, 4);  // its d and dmin
            continue;
          }
          uint16_t d, m = 0;
          std::memcpy(&d, blk, 2);
          if (header == 4) std::memcpy(&m, blk + 2, 2);
#ifdef LOOM_HAVE_AVX2
          if (q4_0) m = _cvtss_sh(-8.0f * _cvtsh_ss(d), 0);
#endif
          std::memcpy(rec + codes_end + 2 * c, &d, 2);
          std::memcpy(rec + codes_end + 2 * kPanel + 2 * c, &m, 2);
        }
      }
    }
  });
  return out;
}

// x [M, K] float32; parts: the panels (uint8 [N_i / 8, K / 32, record]: 4-bit, 8-bit or K-quant
// records, told apart by their size) of a projection's outputs stacked in order, each part in
// its own record kind (a fused qkv of Q4_K q, k and Q6_K v reads each at its own size: one kind
// for the stack took I8 at 9 bits a weight); y [M, sum N_i], part i's columns written in place.
// Part i takes the int8 path up to int8_rows[i] rows, the fp32 one above.
torch::Tensor block_quant_linear_parts(torch::Tensor x, const std::vector<torch::Tensor>& parts,
                                       c10::optional<torch::Tensor> bias,
                                       const std::vector<int64_t>& int8_rows) {
  TORCH_CHECK(supported(), "block_quant_linear needs a CPU with AVX2, FMA and F16C");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [rows, K] float32");
  TORCH_CHECK(!parts.empty() && parts.size() == int8_rows.size(),
              "one int8 row limit per part of panels");
  int64_t N = 0;
  for (const torch::Tensor& panels : parts) {
    TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kByte &&
                    panels.is_contiguous() && is_record(panels.size(2)) &&
                    panels.size(0) % 2 == 0 &&
                    ((panels.size(2) != kRecordK4 && panels.size(2) != kRecordQ6K) ||
                     panels.size(1) % kPanel == 0),
                "panels must be contiguous uint8 [N / 8, K / 32, record], N a multiple of 16");
    TORCH_CHECK(x.size(1) == panels.size(1) * kQuantBlock,
                "x must be [rows, K] with K = 32 * the panels' blocks");
    N += panels.size(0) * kPanel;
  }
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(!bias.has_value() || (bias->numel() == N && bias->scalar_type() == at::kFloat),
              "bias must be float32 [N]");
  x = x.contiguous();
  auto out = torch::empty({M, N}, x.options());
  if (M == 0) return out;
#ifdef LOOM_HAVE_AVX2
  const torch::Tensor b = bias.has_value() ? bias->contiguous() : torch::Tensor();
  const float* xp = x.data_ptr<float>();
  for (size_t i = 0, column = 0; i < parts.size(); ++i) {
    const torch::Tensor& panels = parts[i];
    const int64_t P = panels.size(0);
    const uint8_t* wp = panels.data_ptr<uint8_t>();
    const float* bp = bias.has_value() ? b.data_ptr<float>() + column : nullptr;
    float* yp = out.data_ptr<float>() + column;
    const int format = format_of(panels.size(2));
    const bool int8 = M <= int8_rows[i];
    if (format == kQ4)
      (int8 ? int8_path<kQ4> : fp32_path<kQ4>)(xp, M, K, wp, P, bp, yp, N);
    else if (format == kQ8)
      (int8 ? int8_path<kQ8> : fp32_path<kQ8>)(xp, M, K, wp, P, bp, yp, N);
    else if (format == kQ4K)
      (int8 ? int8_path<kQ4K> : fp32_path<kQ4K>)(xp, M, K, wp, P, bp, yp, N);
    else
      (int8 ? int8_path<kQ6K> : fp32_path<kQ6K>)(xp, M, K, wp, P, bp, yp, N);
    column += P * kPanel;
  }
#endif
  return out;
}

// One part: x [M, K] float32, panels uint8 [N / 8, K / 32, record].
torch::Tensor block_quant_linear(torch::Tensor x, torch::Tensor panels,
                                 c10::optional<torch::Tensor> bias, int64_t int8_rows) {
  return block_quant_linear_parts(x, {panels}, bias, {int8_rows});
}


// x [T, H] float32, logits [T, E] float32; gate_up uint8 [E, I / 4, H / 32, record] (each
// expert's gate and up panels interleaved: gate panel p, up panel p), down uint8 [E, H / 8,
// I / 32, record]; the shared expert's the same without E, shared_gate float32 [H] (or none:
// weight 1). The experts' SiLU-gated MLPs summed by their router weights -> [T, H].
torch::Tensor moe_experts(torch::Tensor x, torch::Tensor logits, int64_t top_k, bool normalize,
                          torch::Tensor gate_up, torch::Tensor down,
                          c10::optional<torch::Tensor> shared_gate_up,
                          c10::optional<torch::Tensor> shared_down,
                          c10::optional<torch::Tensor> shared_gate, int64_t int8_rows_4bit,
                          int64_t int8_rows_8bit) {
  TORCH_CHECK(supported(), "moe_experts needs a CPU with AVX2, FMA and F16C");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % 16 == 0,
              "x must be [tokens, H] float32, H a multiple of 16");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(0) == T,
              "logits must be [tokens, experts] float32");
  const int64_t E = logits.size(1);
  TORCH_CHECK(top_k >= 1 && top_k <= E, "top_k must be between 1 and the expert count");
  const auto check = [&](const torch::Tensor& gu, const torch::Tensor& dn, int64_t dims,
                         const char* what) {
    const auto record_ok = [](const torch::Tensor& t) {
      return is_record(t.size(-1)) && t.size(-1) != kRecordQ6K;  // Q6_K: dense layers'
    };
    TORCH_CHECK(gu.dim() == dims && dn.dim() == dims && gu.scalar_type() == at::kByte &&
                    dn.scalar_type() == at::kByte && gu.is_contiguous() && dn.is_contiguous() &&
                    record_ok(gu) && record_ok(dn),
                what, " panels must be contiguous uint8 with 4-bit, 8-bit or Q4_K records");
    const int64_t inter = gu.size(-3) * kPanel / 2;
    TORCH_CHECK(gu.size(-3) % 8 == 0 && gu.size(-2) * kQuantBlock == H &&
                    dn.size(-3) * kPanel == H && dn.size(-2) * kQuantBlock == inter,
                what, " panels must be gate_up [I / 4, H / 32, record] and down [H / 8, I / 32, "
                "record], I a multiple of 32");
    if (dims == 4)
      TORCH_CHECK(gu.size(0) == E && dn.size(0) == E, what, " panels must hold every expert");
  };
  check(gate_up, down, 4, "the experts'");
  TORCH_CHECK(shared_gate_up.has_value() == shared_down.has_value(),
              "a shared expert needs both its gate_up and down panels");
  if (shared_gate_up.has_value()) check(*shared_gate_up, *shared_down, 3, "the shared expert's");
  TORCH_CHECK(!shared_gate.has_value() ||
                  (shared_gate_up.has_value() && shared_gate->numel() == H &&
                   shared_gate->scalar_type() == at::kFloat),
              "shared_gate must be float32 [H], with a shared expert");
  auto out = torch::zeros({T, H}, x.options());
  if (T == 0) return out;
#ifdef LOOM_HAVE_AVX2
  x = x.contiguous();
  logits = logits.contiguous();
  const torch::Tensor gate = shared_gate.has_value() ? shared_gate->contiguous() : torch::Tensor();
  const moe::Matrices routed = moe::matrices(gate_up, down);
  moe::Matrices shared_matrices{};
  if (shared_gate_up.has_value()) shared_matrices = moe::matrices(*shared_gate_up, *shared_down);
  moe::run(x.data_ptr<float>(), T, H, logits.data_ptr<float>(), E, top_k, normalize, routed,
           shared_gate_up.has_value() ? &shared_matrices : nullptr,
           shared_gate.has_value() ? gate.data_ptr<float>() : nullptr, int8_rows_4bit,
           int8_rows_8bit, out.data_ptr<float>());
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Without the GIL: the HTTP server's event loop runs on while a step's matmuls do.
  m.def("block_quant_linear", &block_quant_linear, py::call_guard<py::gil_scoped_release>());
  m.def("block_quant_linear_parts", &block_quant_linear_parts,
        py::call_guard<py::gil_scoped_release>());
  m.def("panels_from_blocks", &panels_from_blocks, py::call_guard<py::gil_scoped_release>());
  m.def("moe_experts", &moe_experts, py::call_guard<py::gil_scoped_release>());
  m.def("supported", &supported);
  m.def("vnni", &vnni);
  LOOM_POOL_BINDINGS(m);
}
