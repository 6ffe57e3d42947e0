// loom: GGUF block types the native matmul does not read, re-expressed at load as blocks of 32
// it does (which types, why, and what each costs in accuracy: loom/model/requant.py and
// docs/gguf-types.md). One pass over the file's bytes per tensor, blocks in parallel: numpy's
// bit shuffles took about 4 ns a weight (14 for Q6_K), most of a K-quant model's start-up.
// test_requant checks every type against gguf's own decoder.
//
// Output blocks, per 32 weights (loom/model/weights.py BLOCK_LAYOUT):
//   Q4_1  [ d, m (fp16) | 16 bytes: input j's code in byte j's low nibble, input j + 16's high ]
//   Q8_0  [ d (fp16)    | 32 int8 codes ]
//   I8    [ d, m (fp16) | 32 int8 codes ]
//   Q4_K  [ d, dmin (fp16, the super-block's) | scale, min (6 bits, a byte each) | 16 bytes
//           of codes as Q4_1's ]: Q4_K's own numbers, w = (d scale) q - dmin min exactly
//   Q6_K  [ d (fp16, the super-block's) | scale 0, scale 1 (int8, inputs 0-15, 16-31) | 16
//           bytes of the codes' low nibbles as Q4_1's | 8 of their high 2 bits: byte j holds
//           inputs j, j + 8, j + 16, j + 24 from bit 0 up ]: Q6_K's own, w = (d scale) (q - 32)
//
// numpy arrays in and out, and none of torch's headers but its fp16 type: a module of its own
// that compiles in seconds, called where requant.py already holds the file's bytes as numpy.
// Built without -ffast-math and without fused multiply-adds (loom/model/kernels.py): either
// could change a code (w / scale computed as w * (1 / scale), d * q - m rounded once). This is
// IEEE arithmetic, in gguf's order of operations.
#include <c10/util/Half.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace py = pybind11;

namespace {

constexpr int kGroup = 32;

enum class Native { Q4_1, Q8_0, I8, Q4_K, Q6_K };

constexpr int64_t native_bytes(Native kind) {
  return kind == Native::Q4_1 ? 4 + 16 : kind == Native::Q8_0 ? 2 + 32
         : kind == Native::I8 ? 4 + 32 : kind == Native::Q4_K ? 6 + 16 : 4 + 24;
}

uint16_t fp16_bits(float value) { return c10::Half(value).x; }

float fp16_float(uint16_t bits) {
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

uint16_t raw_fp16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return bits;
}

float fp16_value(const uint8_t* p) { return fp16_float(raw_fp16(p)); }

// 32 4-bit codes in 16 bytes: input j's in byte j's low nibble, input j + 16's in its high.
void pack_nibbles(const int8_t* codes, uint8_t* out) {
  for (int j = 0; j < 16; ++j)
    out[j] = static_cast<uint8_t>((codes[j] & 0x0F) | (codes[j + 16] << 4));
}

// One output block from its 32 codes and the bits of its fp16 scale and offset.
void write_block(uint8_t* out, Native kind, const int8_t* codes, uint16_t d, uint16_t m) {
  std::memcpy(out, &d, 2);
  if (kind == Native::Q8_0) {
    std::memcpy(out + 2, codes, kGroup);
    return;
  }
  std::memcpy(out + 2, &m, 2);
  if (kind == Native::I8) {
    std::memcpy(out + 4, codes, kGroup);
    return;
  }
  pack_nibbles(codes, out + 4);
}

// Symmetric 8-bit codes for 32 weights: the scale is max |w| / 127 rounded to fp16, or the
// next fp16 value up where that rounding went down (no code passes 127); a zero scale leaves
// every code 0. Eight running maxima, so that GCC vectorizes the maximum without -ffast-math
// (which order it takes them in does not matter: a maximum has no rounding).
void requantize_group(const float* w, uint8_t* out) {
  float lane_max[8] = {};
  for (int j = 0; j < kGroup; ++j) lane_max[j % 8] = std::max(lane_max[j % 8], std::fabs(w[j]));
  float amax = 0.0f;
  for (float m : lane_max) amax = std::max(amax, m);
  uint16_t bits = fp16_bits(amax / 127.0f);
  float scale = fp16_float(bits);
  if (scale * 127.0f < amax && bits < 0x7C00) {  // below +inf: one fp16 step up
    ++bits;
    scale = fp16_float(bits);
  }
  int8_t codes[kGroup] = {};
  if (scale != 0.0f)
    for (int j = 0; j < kGroup; ++j)
      codes[j] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f,
                                                               std::nearbyint(w[j] / scale))));
  write_block(out, Native::Q8_0, codes, bits, 0);
}

// Q4_K's and Q5_K's 6-bit scale and min of sub-block s, from their 12 packed bytes (gguf's
// Q4_K.get_scale_min): sub-blocks 0-3 in the low 6 bits of bytes s and s + 4, 4-7 in the
// nibbles of bytes s + 4 with the top 2 bits of bytes s - 4 and s.
void scale_min(const uint8_t* q, int s, int& scale, int& min) {
  if (s < 4) {
    scale = q[s] & 0x3F;
    min = q[s + 4] & 0x3F;
  } else {
    scale = (q[s + 4] & 0x0F) | ((q[s - 4] >> 2) & 0x30);
    min = (q[s + 4] >> 4) | ((q[s] >> 2) & 0x30);
  }
}

// Each converts one block of its type (`src`) into the output blocks at `dst`.

// Q5_0 [d | 32 fifth bits | 16 bytes of low nibbles], codes from 16 -> Q8_0.
// Q5_1 [d, m | the same], codes from 0 -> I8.
template <bool WithOffset>
void q5_block(const uint8_t* src, uint8_t* dst) {
  const uint8_t* qh = src + (WithOffset ? 4 : 2);
  const uint8_t* qs = qh + 4;
  uint32_t high;
  std::memcpy(&high, qh, 4);
  int8_t codes[kGroup];
  for (int j = 0; j < kGroup; ++j) {
    const int low = j < 16 ? qs[j] & 0x0F : qs[j - 16] >> 4;
    codes[j] = static_cast<int8_t>((low | (((high >> j) & 1) << 4)) - (WithOffset ? 0 : 16));
  }
  write_block(dst, WithOffset ? Native::I8 : Native::Q8_0, codes, raw_fp16(src),
              WithOffset ? raw_fp16(src + 2) : 0);
}

// Q4_K [d, dmin | 12 bytes of 6-bit scales and mins | 128 bytes of codes] -> 8 x Q4_K's
// blocks of 32 above; Q5_K the same with 32 bytes of fifth bits before the codes -> 8 x I8,
// scale d * scale_s and offset -dmin * min_s rounded to fp16. Sub-block 2i's codes are the
// low nibbles of code bytes 32i .. 32i + 31, 2i + 1's the high ones; sub-block s's fifth bits
// are bit s of the 32 bytes.
template <bool FiveBits>
void k_block(const uint8_t* src, uint8_t* dst) {
  const float d = fp16_value(src), dmin = fp16_value(src + 2);
  const uint8_t* qh = src + 16;
  const uint8_t* qs = src + (FiveBits ? 48 : 16);
  constexpr Native kind = FiveBits ? Native::I8 : Native::Q4_K;
  for (int s = 0; s < 8; ++s) {
    int scale, min;
    scale_min(src + 4, s, scale, min);
    int8_t codes[kGroup];
    for (int j = 0; j < kGroup; ++j) {
      int code = (qs[32 * (s / 2) + j] >> (4 * (s % 2))) & 0x0F;
      if (FiveBits) code |= ((qh[j] >> s) & 1) << 4;
      codes[j] = static_cast<int8_t>(code);
    }
    if (!FiveBits) {
      uint8_t* out = dst + s * native_bytes(kind);
      std::memcpy(out, src, 4);
      out[4] = static_cast<uint8_t>(scale);
      out[5] = static_cast<uint8_t>(min);
      pack_nibbles(codes, out + 6);
      continue;
    }
    write_block(dst + s * native_bytes(kind), kind, codes,
                fp16_bits(d * static_cast<float>(scale)),
                fp16_bits(-dmin * static_cast<float>(min)));
  }
}

// IQ4_NL's and IQ4_XS's 16 levels: a 4-bit index picks one (llama.cpp's kvalues_iq4nl).
constexpr int8_t kIq4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                   1,    13,   25,  38,  53,  69,  89,  113};

void iq4_codes(const uint8_t* qs, int8_t* codes) {
  for (int j = 0; j < 16; ++j) {
    codes[j] = kIq4Levels[qs[j] & 0x0F];
    codes[j + 16] = kIq4Levels[qs[j] >> 4];
  }
}

// IQ4_NL [d | 16 bytes of indices] -> Q8_0, the levels as codes and d as it is.
void iq4_nl_block(const uint8_t* src, uint8_t* dst) {
  int8_t codes[kGroup];
  iq4_codes(src + 2, codes);
  write_block(dst, Native::Q8_0, codes, raw_fp16(src), 0);
}

// IQ4_XS [d | 2 bytes of the sub-scales' high 2 bits | 4 of their low 4 | 8 x 16 bytes of
// indices] -> 8 x Q8_0, sub-block s scaled by d * (its 6-bit scale - 32) rounded to fp16.
void iq4_xs_block(const uint8_t* src, uint8_t* dst) {
  const float d = fp16_value(src);
  uint16_t high;
  std::memcpy(&high, src + 2, 2);
  for (int s = 0; s < 8; ++s) {
    const int low = (src[4 + s / 2] >> (4 * (s % 2))) & 0x0F;
    const int scale = low | (((high >> (2 * s)) & 3) << 4);
    int8_t codes[kGroup];
    iq4_codes(src + 8 + 16 * s, codes);
    write_block(dst + s * native_bytes(Native::Q8_0), Native::Q8_0, codes,
                fp16_bits(d * static_cast<float>(scale - 32)), 0);
  }
}

// Q6_K [128 bytes of low nibbles | 64 of high 2 bits | 16 int8 scales | d] -> 8 x its own
// blocks of 32 above (Q8_0: 8 x Q8_0, its weights, gguf's (d * scale) * (code - 32), quantized
// again per 32, for the mixture-of-experts kernel, which has no Q6_K records). Group u of half
// h (weights 128h + 32u ..): low nibble u / 2 of low bytes 64h + 32 (u % 2) .., bits 2u of
// high bytes 32h ...
template <Native Kind>
void q6_k_block(const uint8_t* src, uint8_t* dst) {
  const int8_t* scales = reinterpret_cast<const int8_t*>(src + 192);
  const float d = fp16_value(src + 208);
  for (int h = 0; h < 2; ++h)
    for (int u = 0; u < 4; ++u) {
      const uint8_t* low = src + 64 * h + 32 * (u % 2);
      const uint8_t* high = src + 128 + 32 * h;
      const int first = 8 * h + 2 * u;  // the scale of the group's first 16 weights
      int8_t codes[kGroup];
      for (int j = 0; j < kGroup; ++j)
        codes[j] = static_cast<int8_t>(((low[j] >> (4 * (u / 2))) & 0x0F) |
                                       (((high[j] >> (2 * u)) & 3) << 4));
      uint8_t* out = dst + (4 * h + u) * native_bytes(Kind);
      if constexpr (Kind == Native::Q6_K) {
        std::memcpy(out, src + 208, 2);
        out[2] = static_cast<uint8_t>(scales[first]);
        out[3] = static_cast<uint8_t>(scales[first + 1]);
        pack_nibbles(codes, out + 4);
        for (int j = 0; j < 8; ++j) {
          int byte = 0;
          for (int s = 0; s < 4; ++s) byte |= ((codes[j + 8 * s] >> 4) & 3) << (2 * s);
          out[20 + j] = static_cast<uint8_t>(byte);
        }
        continue;
      }
      float w[kGroup];
      for (int j = 0; j < kGroup; ++j)
        w[j] = d * static_cast<float>(scales[first + j / 16]) * static_cast<float>(codes[j] - 32);
      requantize_group(w, out);
    }
}

// Q3_K [32 bytes of high bits | 64 of low 2 bits | 12 of 6-bit scales | d] and Q2_K [16 bytes
// of 4-bit scales and mins | 64 of 2-bit codes | d, dmin] -> 8 x Q8_0, their weights (gguf's,
// a scale per 16) quantized again per 32. Group b (weights 32b ..) of either: bits 2 (b % 4)
// of code bytes 32 (b / 4) ..; Q3_K's code is those less 4 where bit b of high byte j is 0,
// times d * (its 6-bit scale - 32); Q2_K's is (d * scale) * code - dmin * min.
template <bool Q3>
void low_k_block(const uint8_t* src, uint8_t* dst) {
  const uint8_t* codes = src + (Q3 ? 32 : 16);
  const uint8_t* packed = src + 96;  // Q3_K's scales
  const float d = fp16_value(src + (Q3 ? 108 : 80)), dmin = Q3 ? 0.0f : fp16_value(src + 82);
  for (int b = 0; b < 8; ++b) {
    float scale[2], offset[2] = {0.0f, 0.0f};
    for (int half = 0; half < 2; ++half) {
      const int k = 2 * b + half;  // the scale of weights 16k ..
      if (Q3) {
        const int six = ((packed[k % 8] >> (4 * (k / 8))) & 0x0F) |
                        (((packed[8 + k % 4] >> (2 * (k / 4))) & 3) << 4);
        scale[half] = d * static_cast<float>(six - 32);
      } else {
        scale[half] = d * static_cast<float>(src[k] & 0x0F);
        offset[half] = dmin * static_cast<float>(src[k] >> 4);
      }
    }
    float w[kGroup];
    for (int j = 0; j < kGroup; ++j) {
      int code = (codes[32 * (b / 4) + j] >> (2 * (b % 4))) & 3;
      if (Q3 && ((src[j] >> b) & 1) == 0) code -= 4;
      w[j] = scale[j / 16] * static_cast<float>(code) - offset[j / 16];
    }
    requantize_group(w, dst + b * native_bytes(Native::Q8_0));
  }
}

struct SourceKind {
  const char* name;
  int64_t weights, bytes;  // per block of the file's type
  Native native;
  void (*convert)(const uint8_t*, uint8_t*);
};

constexpr SourceKind kSourceKinds[] = {
    {"Q5_0", 32, 22, Native::Q8_0, q5_block<false>},
    {"Q5_1", 32, 24, Native::I8, q5_block<true>},
    {"Q4_K", 256, 144, Native::Q4_K, k_block<false>},
    {"Q5_K", 256, 176, Native::I8, k_block<true>},
    {"IQ4_NL", 32, 18, Native::Q8_0, iq4_nl_block},
    {"IQ4_XS", 256, 136, Native::Q8_0, iq4_xs_block},
    {"Q6_K", 256, 210, Native::Q6_K, q6_k_block<Native::Q6_K>},
    {"Q6_K as Q8_0", 256, 210, Native::Q8_0, q6_k_block<Native::Q8_0>},
    {"Q3_K", 256, 110, Native::Q8_0, low_k_block<true>},
    {"Q2_K", 256, 84, Native::Q8_0, low_k_block<false>},
};

const SourceKind& source_kind(const std::string& name) {
  for (const SourceKind& kind : kSourceKinds)
    if (name == kind.name) return kind;
  throw std::invalid_argument("no native conversion for GGUF type " + name);
}

using Bytes = py::array_t<uint8_t, py::array::c_style>;

// data: uint8 [rows, bytes per row] of GGUF type `kind`, rows of `cols` weights -> uint8
// [rows, cols / 32, native block bytes].
Bytes native_blocks(const Bytes& data, const std::string& kind, int64_t cols) {
  const SourceKind& source = source_kind(kind);
  if (cols % source.weights != 0)
    throw std::invalid_argument(kind + " rows hold whole blocks of " +
                                std::to_string(source.weights) + " weights");
  const int64_t blocks = cols / source.weights;
  if (data.ndim() != 2 || data.shape(1) != blocks * source.bytes)
    throw std::invalid_argument("data must be uint8 [rows, " +
                                std::to_string(blocks * source.bytes) + "]");
  const int64_t rows = data.shape(0), out_bytes = native_bytes(source.native);
  const int64_t per_block = source.weights / kGroup * out_bytes, count = rows * blocks;
  Bytes out({rows, cols / kGroup, out_bytes});
  const uint8_t* src = data.data();
  uint8_t* dst = out.mutable_data();
  {
    py::gil_scoped_release release;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < count; ++b) source.convert(src + b * source.bytes, dst + b * per_block);
  }
  return out;
}

// weights: float32 [rows, cols] -> Q8_0 blocks uint8 [rows, cols / 32, 34], as Q6_K's above.
using Floats = py::array_t<float, py::array::c_style | py::array::forcecast>;

Bytes requantized_q8_0(const Floats& weights) {
  if (weights.ndim() != 2 || weights.shape(1) % kGroup != 0)
    throw std::invalid_argument("weights must be float32 [rows, cols], cols a multiple of 32");
  const int64_t rows = weights.shape(0), cols = weights.shape(1);
  const int64_t groups = rows * cols / kGroup, out_bytes = native_bytes(Native::Q8_0);
  Bytes out({rows, cols / kGroup, out_bytes});
  const float* src = weights.data();
  uint8_t* dst = out.mutable_data();
  {
    py::gil_scoped_release release;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; ++g) requantize_group(src + g * kGroup, dst + g * out_bytes);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("native_blocks", &native_blocks);
  m.def("requantized_q8_0", &requantized_q8_0);
  py::list kinds;  // the GGUF types native_blocks reads (and "Q6_K as Q8_0")
  for (const SourceKind& kind : kSourceKinds) kinds.append(kind.name);
  m.attr("kinds") = py::tuple(kinds);
}
