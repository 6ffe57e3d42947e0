// loom: the mixture-of-experts kernel's pieces (block_quant_moe.h runs them): its rows'
// buffers, one panel pair over an expert's rows on either path, SiLU and the routing.
#pragma once
#include <cmath>
#include <vector>

#include "block_quant_fp32.h"
#include "block_quant_int8.h"

#ifdef LOOM_HAVE_AVX2
namespace moe {

// Rows of activations as quantize_row leaves them, for int_tile.
struct QuantRows {
  int8_t* q = nullptr;  // [rows, 2K]
  float* scale = nullptr;  // [rows, K / 32], likewise sum and centre
  float* sum = nullptr;
  float* centre = nullptr;
};

// One expert's part of a call.
struct Job {
  const uint8_t* gate_up;  // its interleaved pairs: I / 8 of them, K = H
  const uint8_t* down;     // its H / 16 pairs, K = I
  int gu_format, down_format;
  int64_t inter, rows;
  const int64_t* token;  // [rows]: each row's token
  const float* weight;   // [rows]: each row's weight in its token's sum
  bool gu_int8, down_int8;
  const float* x = nullptr;  // [rows, H]: fp32 gate_up inputs (x itself for the shared one)
  float* x_rows = nullptr;   // a routed expert's copy of them
  QuantRows qx;              // int8 gate_up inputs
  float* act = nullptr;      // [rows, I]
  QuantRows qa;              // int8 down inputs
};

// Bump allocation from one buffer per element type, sized by a first pass that only counts.
template <typename T>
struct Arena {
  std::vector<T> data;
  int64_t used = 0;
  T* take(int64_t n) {
    T* p = data.empty() ? nullptr : data.data() + used;
    used += n;
    return p;
  }
  void allocate() {
    data.assign(used, T());
    used = 0;
  }
};

template <int Bits>
static void quantize_rows(const float* x, int64_t rows, int64_t K, const QuantRows& q) {
  const int64_t nb = K / kQuantBlock;
  for (int64_t r = 0; r < rows; ++r)
    quantize_row<Bits>(x + r * K, K, q.q + r * 2 * K, q.scale + r * nb, q.sum + r * nb,
                       q.centre + r * nb);
}

static QuantRows take_quant_rows(Arena<int8_t>& bytes, Arena<float>& floats, int64_t rows,
                                 int64_t K) {
  const int64_t nb = K / kQuantBlock;
  return {bytes.take(rows * 2 * K), floats.take(rows * nb), floats.take(rows * nb),
          floats.take(rows * nb)};
}

static void copy_quant_row(const QuantRows& from, int64_t i, const QuantRows& to, int64_t j,
                           int64_t K) {
  const int64_t nb = K / kQuantBlock;
  std::memcpy(to.q + j * 2 * K, from.q + i * 2 * K, 2 * K);
  std::memcpy(to.scale + j * nb, from.scale + i * nb, nb * 4);
  std::memcpy(to.sum + j * nb, from.sum + i * nb, nb * 4);
  std::memcpy(to.centre + j * nb, from.centre + i * nb, nb * 4);
}

// Rows [0, n) of one panel pair (16 channels, K inputs) in tiles, each into tile [rows, 16]
// and handed to emit(first row, rows, tile): int8 tiles from q, or fp32 ones from x, which
// decode the pair into w [K, 16] as fp32_path does. `ahead`: the pair a thread computes
// next, prefetched by the first int8 tile (as int8_path does).
template <int F, typename Emit>
static void pair_rows(const uint8_t* pair, int64_t nb, int64_t K, int64_t n, bool int8,
                      const float* x, const QuantRows& q, float* w, const uint8_t* ahead,
                      const Emit& emit) {
  constexpr int64_t record = record_bytes(F);
  alignas(32) float tile[kTileRows * 16];
  if (int8) {
    for (int64_t r = 0; r < n; r += kIntTileRows) {
      const int64_t i = r * nb, rows = std::min<int64_t>(kIntTileRows, n - r);
      const int8_t* qx = q.q + r * 2 * K;
      for (int64_t half = 0; half < 2; ++half) {
        const uint8_t* prefetch =
            r == 0 && ahead != nullptr ? ahead + half * nb * record : nullptr;
#define LOOM_TILE(R)                                                                    \
  int_tile<F, R>(pair + half * nb * record, nb, qx, q.scale + i, q.sum + i, q.centre + i, \
                    K, tile + 8 * half, 16, nullptr, prefetch)
        switch (rows) {
          case 4: LOOM_TILE(4); break;
          case 3: LOOM_TILE(3); break;
          case 2: LOOM_TILE(2); break;
          default: LOOM_TILE(1); break;
        }
#undef LOOM_TILE
      }
      emit(r, rows, tile);
    }
    return;
  }
  int64_t r = n % kTileRows;
  if (r > 0) {
    decoding_rows<F>(r, pair, nb, w, x, K, tile, 16, nullptr);
    emit(0, r, tile);
  } else {
    decode_panel<F>(pair, nb, 0, w);
    decode_panel<F>(pair + nb * record, nb, 1, w);
  }
  for (; r < n; r += kTileRows) {
    panel_tile<kTileRows>(x + r * K, K, w, tile, 16, nullptr);
    emit(r, kTileRows, tile);
  }
}

template <typename Emit>
static void pair_rows_of(int format, const uint8_t* pair, int64_t nb, int64_t K, int64_t n,
                         bool int8, const float* x, const QuantRows& q, float* w,
                         const uint8_t* ahead, const Emit& emit) {
  if (format == kQ4)
    pair_rows<kQ4>(pair, nb, K, n, int8, x, q, w, ahead, emit);
  else if (format == kQ8)
    pair_rows<kQ8>(pair, nb, K, n, int8, x, q, w, ahead, emit);
  else
    pair_rows<kQ4K>(pair, nb, K, n, int8, x, q, w, ahead, emit);
}

static void quantize_rows_of(int bits, const float* x, int64_t rows, int64_t K,
                             const QuantRows& q) {
  if (bits == 4)
    quantize_rows<4>(x, rows, K, q);
  else
    quantize_rows<8>(x, rows, K, q);
}

// Past this e^-g overflows float32: -ffast-math assumes no infinities, so silu and the
// sigmoid gate take the limit (0) there instead of dividing by one.
constexpr float kExpLimit = 87.0f;

static inline float silu(float g) { return g < -kExpLimit ? 0.0f : g / (1.0f + std::exp(-g)); }

// a[c] = SiLU(g[c]) * g[8 + c] for one pair's 8 channels. Not inlined, so that every row
// runs this one body: inlined into a tile's loop over rows, GCC vectorized expf (libmvec)
// for some row counts and called it a lane at a time for others, which round apart, and a
// token's output then depended on how many others chose its expert.
__attribute__((noinline)) static void silu_times_up(const float* g, float* a) {
  for (int c = 0; c < 8; ++c) a[c] = silu(g[c]) * g[8 + c];
}

// The top k of E logits, highest first, ties to the lower id; their softmax weights.
static void route(const float* logits, int64_t E, int64_t k, bool normalize, int64_t* ids,
                  float* weights) {
  int64_t n = 0;
  for (int64_t e = 0; e < E; ++e) {
    const float v = logits[e];
    if (n == k && !(v > logits[ids[k - 1]])) continue;  // not above the last: it stays
    if (n < k) ++n;
    int64_t i = n - 1;
    for (; i > 0 && v > logits[ids[i - 1]]; --i) ids[i] = ids[i - 1];
    ids[i] = e;
  }
  float top = logits[ids[0]], total = 0.0f;
  for (int64_t e = 0; e < E; ++e) total += std::exp(logits[e] - top);
  float chosen = 0.0f;
  for (int64_t j = 0; j < k; ++j) chosen += weights[j] = std::exp(logits[ids[j]] - top) / total;
  if (normalize)
    for (int64_t j = 0; j < k; ++j) weights[j] /= chosen;
}

}  // namespace moe
#endif
