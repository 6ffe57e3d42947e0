// loom: decode attention straight from the paged KV cache, one query token per row, no gather;
// consecutive rows over one block table (a short prefill chunk's tokens, a decode's drafts) attend
// a tile of tokens at a time (Tile, paged_attention_tiles.h). Caches are indexed [block, position
// in block, kv head, dim] through their strides. K must have position stride 1 (stored [blocks,
// kv_heads, dim, block_size], see new_kv_cache) so that q.K over a block is a vector FMA across its
// positions per dim, with the block's scores held in registers; V must have dim stride 1 so that
// p.V is a vector FMA across dims, with the tile's query rows' accumulators held in registers
// (new_kv_cache stores it [blocks, kv_heads, block_size, dim], so that one kv head's block is one
// contiguous run). Both need the shape known at compile time, hence the dispatch over (G query
// heads per kv head, head dim); other shapes use the torch path (`supported`). Work is split over
// tiles, or over (tile, kv head) pairs where the tiles are too few for the threads (for_each_item);
// a few long contexts are first cut into spans merged after (attend_spans). On AVX2 an intrinsics
// version (paged_attention_simd.h) reads each K block once for all the tile's query rows and
// prefetches the next block; on AVX-512 the same plan runs 16 wide; elsewhere a portable version
// relies on the compiler's vectorizer. The model calls it through rope_write_decode (at the end),
// which also ropes q and k and writes the step's K/V: one call per layer from the QKV projection to
// the decode rows' output.
//
// The caches may hold a narrower type than the queries: fp32 queries over an fp16 cache (the
// layout llama.cpp uses by default) read half the bytes, and decode attention over long
// contexts is bound by those reads. Scores and sums stay fp32 either way.
//
// A layer's variants (attention.LayerAttention): a sliding window W, where the row at
// position p attends to positions p - W + 1 .. p only, and the blocks wholly before that are
// never read (their table entries may be any id: the sliding layers' KV group frees them);
// a softcap c, scores -> c tanh(scores / c) before the softmax (Gemma 2); per query head an
// attention sink, a learned logit that joins the softmax's denominator and nothing else
// (gpt-oss). A window is each row's first attended position (DecodeArgs::starts), so tiles
// and spans, which cut rows their own way, carry it as data:
//
//   W = 20, block size 16, a row of length 50 (query at 49) attends 30 .. 49:
//     table          [ b7 ][ b2 ][ b9 ][ b4 ]
//     positions       0-15  16-31 32-47 48-49
//     read                  ====  ====  ==      from b2 (its 30, 31), b9, b4; b7 never
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "paged_attention_simd.h"
#include "paged_attention_tiles.h"
#include "parallel_dynamic.h"
#include "rope_write.h"

// Every row's attention, in tiles where rows share a block table (tile_rows).
template <typename T, typename C, int G, int D>
static void decode(const DecodeArgs<T, C>& a) {
  constexpr int QT = kTileTokens<G>;
  const std::vector<Tile> tiles = tile_rows(a, QT);
  for_each_item(a, tiles, [&](const Tile& t, int64_t kh, std::vector<float>& scores) {
    if (t.tokens == QT) return attend_tile<T, C, G, D, QT>(a, t, kh, scores);
    attend_tile<T, C, G, D, 1>(a, t, kh, scores);
  });
}

// (G, D) instantiated; anything else goes through torch. Head dim 256 is Gemma 3's (4, 2 or 8
// query heads per kv head there), so only the power-of-two G are built for it.
#define LOOM_FOR_EACH_SHAPE(X) \
  X(1, 64) X(2, 64) X(3, 64) X(4, 64) X(5, 64) X(6, 64) X(7, 64) X(8, 64) \
  X(1, 128) X(2, 128) X(3, 128) X(4, 128) X(5, 128) X(6, 128) X(7, 128) X(8, 128) \
  X(1, 256) X(2, 256) X(4, 256) X(8, 256)

// The (query, cache) types instantiated: fp32 over fp32 or fp16, bf16 over bf16.
static bool supported_types(c10::ScalarType dtype, c10::ScalarType cache_dtype) {
  return (dtype == at::kFloat && (cache_dtype == at::kFloat || cache_dtype == at::kHalf)) ||
         (dtype == at::kBFloat16 && cache_dtype == at::kBFloat16);
}

bool supported(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
               c10::ScalarType dtype, c10::ScalarType cache_dtype) {
  if (block_size != kBlockSize || num_heads % num_kv_heads != 0 ||
      !supported_types(dtype, cache_dtype))
    return false;
  const int64_t G = num_heads / num_kv_heads;
#define LOOM_MATCH(g, d) if (G == g && head_dim == d) return true;
  LOOM_FOR_EACH_SHAPE(LOOM_MATCH)
#undef LOOM_MATCH
  return false;
}

template <typename T, typename C>
static void decode_shape(const DecodeArgs<T, C>& a, int64_t G, int64_t D) {
#define LOOM_CALL(g, d) if (G == g && D == d) return decode<T, C, g, d>(a);
  LOOM_FOR_EACH_SHAPE(LOOM_CALL)
#undef LOOM_CALL
}

// fn(T{}, C{}) for the query and cache element types (the pairs `supported_types` admits).
template <typename Fn>
static void for_dtypes(c10::ScalarType dtype, c10::ScalarType cache_dtype, const Fn& fn) {
  if (dtype == at::kBFloat16) fn(c10::BFloat16{}, c10::BFloat16{});
  else if (cache_dtype == at::kHalf) fn(float{}, c10::Half{});
  else fn(float{}, float{});
}

static void check_caches(const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                         const torch::Tensor& block_tables, const torch::Tensor& context_lens) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "caches [blocks, block_size, kv_heads, dim], of one dtype");
  TORCH_CHECK(k_cache.stride(1) == 1, "K cache needs position stride 1 (see new_kv_cache)");
  TORCH_CHECK(v_cache.stride(3) == 1, "V cache needs dim stride 1");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.scalar_type() == at::kLong &&
                  context_lens.is_contiguous(), "context_lens: contiguous int64 [n]");
  TORCH_CHECK(context_lens.size(0) == 0 ||  // no decodes: any empty table
                  (block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong &&
                   block_tables.is_contiguous() && block_tables.size(0) == context_lens.size(0)),
              "block_tables: contiguous int64 [n, max_blocks]");
}

// Rows too few for every thread to take kTilesPerThread tiles leave threads idle, and read
// each kv head's share of a block as a run of its own (for_each_item). So a long context
// among them is cut into spans of blocks, each span attended as a row of its own that also
// gives the log-sum-exp (lse) of its scores, and the spans' outputs are merged after, as
// flash-decoding does:
//
//   row i, 40 blocks, 3 spans:   [ b0 .. b13 ][ b14 .. b27 ][ b28 .. b39 ]
//                                 out_0, lse_0  out_1, lse_1   out_2, lse_2
//   out_i = sum_s w_s out_s / (sum_s w_s + w_sink),   w_s = exp(lse_s - top),
//   w_sink = exp(sink - top) (0 without sinks),        top = max(max_s lse_s, sink)
//
// Only the blocks a row attends to are cut (a window's, from the block its first position is
// in), and the first span starts at that position: each span is a row of its own, with a
// start. The sink joins the merge, once, not each span's softmax.
//
// Spans are at least kMinSpanBlocks blocks, and as many as bring the rows to about
// kTilesPerThread per thread, in proportion to each row's blocks; contexts too short to make
// that many are not cut (fewer spans than that measured slower than none: the threads then
// take (span, kv head) pairs, and the copies and the merge cost more than they save).
constexpr int64_t kMinSpanBlocks = 8;

struct Spans {
  std::vector<int64_t> first;          // row i's spans are first[i] .. first[i + 1] - 1
  std::vector<int64_t> tables, lens;   // the spans as rows: [spans, max_blocks], [spans]
  std::vector<int64_t> starts;         // each span's first position attended, [spans]
  int64_t max_blocks = 0;
};

template <typename T, typename C>
static Spans spans_of(const DecodeArgs<T, C>& a, int64_t target) {
  // row i attends to blocks skip[i] .. skip[i] + blocks[i] - 1 of its table
  std::vector<int64_t> skip(a.n), blocks(a.n), per(a.n);
  int64_t total = 0;
  for (int64_t i = 0; i < a.n; ++i) {
    skip[i] = a.start(i) / kBlockSize;
    total += blocks[i] = (a.lens[i] + kBlockSize - 1) / kBlockSize - skip[i];
  }
  Spans sp;
  sp.first.push_back(0);
  if (total < target * kMinSpanBlocks) return sp;  // no spans: first.back() is 0
  for (int64_t i = 0; i < a.n; ++i) {
    const int64_t wanted = (blocks[i] * target + total - 1) / total;
    const int64_t count = std::clamp<int64_t>(wanted, 1,
                                              std::max<int64_t>(1, blocks[i] / kMinSpanBlocks));
    per[i] = (blocks[i] + count - 1) / count;
    sp.max_blocks = std::max(sp.max_blocks, per[i]);
    sp.first.push_back(sp.first.back() + (blocks[i] + per[i] - 1) / per[i]);
  }
  sp.tables.assign(sp.first.back() * sp.max_blocks, 0);
  for (int64_t i = 0; i < a.n; ++i) {
    const int64_t end = skip[i] + blocks[i];
    for (int64_t s = sp.first[i], b0 = skip[i]; s < sp.first[i + 1]; ++s, b0 += per[i]) {
      const int64_t b1 = std::min(end, b0 + per[i]);
      std::copy(a.table(i) + b0, a.table(i) + b1, sp.tables.begin() + s * sp.max_blocks);
      sp.lens.push_back(std::min(a.lens[i], b1 * kBlockSize) - b0 * kBlockSize);
      sp.starts.push_back(std::max<int64_t>(0, a.start(i) - b0 * kBlockSize));
    }
  }
  return sp;
}

// The spans' rows attended (a: the caller's arguments, its rows cut into sp), then merged
// into the caller's rows.
template <typename T, typename C>
static void attend_spans(const DecodeArgs<T, C>& a, const Spans& sp, int64_t H, int64_t D) {
  const int64_t spans = sp.first.back(), row = H * D;
  std::vector<T> q(spans * row), out(spans * row);
  std::vector<float> lse(spans * H);
  for (int64_t i = 0; i < a.n; ++i)
    for (int64_t s = sp.first[i]; s < sp.first[i + 1]; ++s)
      std::copy(a.q + i * a.q_row, a.q + i * a.q_row + row, q.begin() + s * row);
  DecodeArgs<T, C> b = a;
  b.q = q.data(), b.q_row = row, b.out = out.data(), b.out_row = row;
  b.bt = sp.tables.data(), b.lens = sp.lens.data(), b.n = spans, b.max_blocks = sp.max_blocks;
  b.lse = lse.data(), b.starts = sp.starts.data(), b.sinks = nullptr;
  decode_shape<T, C>(b, H / a.KVH, D);
  std::vector<float> acc(D);
  for (int64_t i = 0; i < a.n; ++i)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t first = sp.first[i], last = sp.first[i + 1];
      float top = lse[first * H + h], total = 0.f;
      for (int64_t s = first + 1; s < last; ++s) top = std::max(top, lse[s * H + h]);
      if (a.sinks != nullptr) {
        top = std::max(top, a.sinks[h]);
        total = std::exp(a.sinks[h] - top);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t s = first; s < last; ++s) {
        const float w = std::exp(lse[s * H + h] - top);
        const T* span_out = out.data() + s * row + h * D;
        total += w;
        for (int64_t d = 0; d < D; ++d) acc[d] += w * static_cast<float>(span_out[d]);
      }
      T* row_out = a.out + i * a.out_row + h * D;
      for (int64_t d = 0; d < D; ++d) row_out[d] = static_cast<T>(acc[d] / total);
    }
}

// What a layer's attention does beyond softmax(q.k scale) v (attention.LayerAttention):
// window 0 and softcap 0 for none; sinks undefined for none, else fp32 [heads].
struct Variant {
  int64_t window;
  double softcap;
  const c10::optional<torch::Tensor>& sinks;
};

static void check_variant(const Variant& v, int64_t H) {
  TORCH_CHECK(v.window >= 0 && v.softcap >= 0, "window and softcap must be >= 0 (0: none)");
  TORCH_CHECK(!v.sinks.has_value() ||
                  (v.sinks->dim() == 1 && v.sinks->size(0) == H &&
                   v.sinks->scalar_type() == at::kFloat && v.sinks->is_contiguous()),
              "sinks: contiguous float32 [heads]");
}

// Decode attention over the caches for the n = context_lens.size(0) queries at q (rows of
// q_row elements), into out (rows of out_row).
template <typename T, typename C>
static void attend(const T* q, int64_t q_row, T* out, int64_t out_row, int64_t H,
                   const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                   const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                   double scale, const Variant& variant) {
  if (context_lens.size(0) == 0) return;
  const int64_t KVH = k_cache.size(2), D = k_cache.size(3);
  DecodeArgs<T, C> a{q, q_row, out, out_row, k_cache.data_ptr<C>(), v_cache.data_ptr<C>(),
                  {}, {}, block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
                  context_lens.size(0), KVH, block_tables.size(1), static_cast<float>(scale)};
  for (int j = 0; j < 4; ++j) {
    a.ks[j] = k_cache.stride(j);
    a.vs[j] = v_cache.stride(j);
  }
  std::vector<int64_t> starts;
  if (variant.window > 0) {
    for (int64_t i = 0; i < a.n; ++i)
      starts.push_back(std::max<int64_t>(0, a.lens[i] - variant.window));
    a.starts = starts.data();
  }
  a.softcap = static_cast<float>(variant.softcap);
  if (variant.sinks.has_value()) a.sinks = variant.sinks->data_ptr<float>();
  const int64_t target = tiles_for_threads();
  if (a.n < target && at::get_num_threads() > 1) {  // the one place spans are decided
    const Spans sp = spans_of(a, target);
    if (sp.first.back() >= target) return attend_spans<T, C>(a, sp, H, D);
  }
  decode_shape<T, C>(a, H / KVH, D);
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     double scale, int64_t window, double softcap,
                                     const c10::optional<torch::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3, "q [n, heads, dim]");
  check_caches(k_cache, v_cache, block_tables, context_lens);
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  const Variant variant{window, softcap, sinks};
  check_variant(variant, H);
  TORCH_CHECK(n == context_lens.size(0), "one context length per query");
  TORCH_CHECK(supported(H, k_cache.size(2), D, k_cache.size(1), q.scalar_type(),
                        k_cache.scalar_type()) && D == k_cache.size(3),
              "shape or dtype not supported by the native kernel");
  q = q.contiguous();
  auto out = torch::empty_like(q);
  for_dtypes(q.scalar_type(), k_cache.scalar_type(), [&](auto tag, auto cache_tag) {
    using T = decltype(tag);
    using C = decltype(cache_tag);
    attend<T, C>(q.data_ptr<T>(), H * D, out.data_ptr<T>(), H * D, H, k_cache, v_cache,
                 block_tables, context_lens, scale, variant);
  });
  return out;
}

// One layer's work between the QKV projection and the output projection, for the rows the
// native kernel takes. qkv [tokens, (H + 2 KVH) D] (q heads, k heads, v heads): q and k are
// roped in place (prefill rows read them back for SDPA), every token's k and v go to its slot
// (slot_blocks, slot_offsets), and the first n = context_lens.size(0) rows, the decodes,
// attend over the caches into their rows of the returned [tokens, H D]; its other rows are
// left for the caller (uninitialized). window, softcap, sinks: the layer's variant (Variant).
torch::Tensor rope_write_decode(torch::Tensor qkv, int64_t num_heads, torch::Tensor cos,
                                torch::Tensor sin, torch::Tensor positions,
                                torch::Tensor k_cache, torch::Tensor v_cache,
                                torch::Tensor slot_blocks, torch::Tensor slot_offsets,
                                torch::Tensor block_tables, torch::Tensor context_lens,
                                double scale, int64_t window, double softcap,
                                const c10::optional<torch::Tensor>& sinks) {
  check_caches(k_cache, v_cache, block_tables, context_lens);
  const int64_t tokens = qkv.size(0), H = num_heads, KVH = k_cache.size(2), D = k_cache.size(3);
  const Variant variant{window, softcap, sinks};
  check_variant(variant, H);
  const auto dtype = qkv.scalar_type();
  TORCH_CHECK(supported(H, KVH, D, k_cache.size(1), dtype, k_cache.scalar_type()) &&
                  cos.scalar_type() == dtype && sin.scalar_type() == dtype,
              "shape or dtype not supported by the native kernel");
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(1) == (H + 2 * KVH) * D,
              "qkv must be a contiguous [tokens, (heads + 2 kv_heads) * head_dim] tensor");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == D && cos.is_contiguous() &&
                  sin.sizes() == cos.sizes() && sin.is_contiguous(),
              "cos, sin: contiguous [positions, head_dim] tables");
  for (const auto* t : {&positions, &slot_blocks, &slot_offsets})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == tokens && t->scalar_type() == at::kLong &&
                    t->is_contiguous(), "positions and slots: contiguous int64 [tokens]");
  TORCH_CHECK(context_lens.size(0) <= tokens, "more decodes than tokens");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* blocks = slot_blocks.data_ptr<int64_t>();
  const int64_t* offsets = slot_offsets.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)  // checked here: a worker thread cannot throw
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0) && blocks[t] >= 0 &&
                    blocks[t] < k_cache.size(0) && offsets[t] >= 0 &&
                    offsets[t] < k_cache.size(1), "position or slot out of range");
  auto out = torch::empty({tokens, H * D}, qkv.options());
  for_dtypes(dtype, k_cache.scalar_type(), [&](auto tag, auto cache_tag) {
    using T = decltype(tag);
    using C = decltype(cache_tag);
    rope_write<T, C>(qkv.data_ptr<T>(), tokens, H, cos.data_ptr<T>(), sin.data_ptr<T>(), pos,
                     blocks, offsets, k_cache, v_cache);
    attend<T, C>(qkv.data_ptr<T>(), qkv.size(1), out.data_ptr<T>(), H * D, H, k_cache,
                 v_cache, block_tables, context_lens, scale, variant);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("paged_decode_attention", &paged_decode_attention, py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"),
        py::arg("window") = 0, py::arg("softcap") = 0.0, py::arg("sinks") = py::none());
  m.def("rope_write_decode", &rope_write_decode, py::arg("qkv"), py::arg("num_heads"),
        py::arg("cos"), py::arg("sin"), py::arg("positions"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("slot_blocks"), py::arg("slot_offsets"),
        py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"),
        py::arg("window") = 0, py::arg("softcap") = 0.0, py::arg("sinks") = py::none());
  m.def("supported", &supported);
  LOOM_POOL_BINDINGS(m);
}
