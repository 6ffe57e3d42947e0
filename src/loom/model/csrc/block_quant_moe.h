// loom: mixture-of-experts layers (loom.model.moe).
//
// One call per MoE layer and step: routing, then every expert that has tokens, then the
// weighted sum, with the tiles above on the same panel records, so each token reads only its
// chosen experts' weights, in their quantized blocks. Steps of the call:
// 1. Route (a loop over tokens): per token the top_k experts by router logit, ties to the lower
//    expert id, each weighted by the softmax over all the logits at its own, divided by the
//    sum of the chosen ones' where `normalize` (Mixtral, Qwen3-MoE; Mixtral's softmax over the
//    top-k logits is the same weights). The tokens are then grouped by expert, in token order:
//    an expert's rows.
// 2. Its rows' inputs (a loop over tokens): each token's x quantized once per code width the
//    int8 tiles need (quantize_row), then copied to its experts' rows; the shared expert's
//    gate, sigmoid(x . g), where there is one.
// 3. gate_up -> SiLU(gate) * up (a loop over units of one expert's panel pairs): an expert's
//    gate_up panels come interleaved, gate panel p then up panel p, so a pair's 16 outputs are
//    8 gate and the same channels' 8 up, and only SiLU * up is stored ([rows, I]). Its unit
//    also quantizes the blocks it wrote, where the expert's down runs on the int8 path.
// 4. down and the weighted sum (a loop over runs of output pairs): a unit takes its pairs of
//    every expert in turn, so one thread sums each output, in expert order (routed by id, the
//    shared one last): the same result whatever the thread count.
// An expert of n rows takes the int8 path where n <= the int8 row limit of its code width (as
// a dense layer does, by each matrix's code width), else the fp32 one. The shared expert
// (Qwen2-MoE's) is one more expert every token takes, with its own sizes and weight.
#pragma once
#include <torch/extension.h>
#include <algorithm>

#include "block_quant_moe_tiles.h"

#ifdef LOOM_HAVE_AVX2
namespace moe {

struct Matrices {  // one expert's panels, or E experts' stacked
  const uint8_t* gate_up;
  const uint8_t* down;
  int gu_format, down_format;
  int64_t inter;
  int64_t gu_stride, down_stride;  // bytes from one expert to the next
};

static Matrices matrices(const torch::Tensor& gate_up, const torch::Tensor& down) {
  const int64_t d = gate_up.dim();
  const int gu_format = format_of(gate_up.size(d - 1));
  const int down_format = format_of(down.size(d - 1));
  const int64_t inter = gate_up.size(d - 3) * kPanel / 2;
  return {gate_up.data_ptr<uint8_t>(), down.data_ptr<uint8_t>(), gu_format, down_format, inter,
          inter / kPanel * 2 * gate_up.size(d - 2) * record_bytes(gu_format),
          down.size(d - 3) * down.size(d - 2) * record_bytes(down_format)};
}

static void run(const float* xp, int64_t T, int64_t H, const float* logits, int64_t E,
                int64_t k, bool normalize, const Matrices& routed, const Matrices* shared,
                const float* shared_gate, int64_t int8_rows_4bit, int64_t int8_rows_8bit,
                float* out) {
  const auto int8_rows = [&](int format) {
    return code_bits(format) == 4 ? int8_rows_4bit : int8_rows_8bit;
  };
  const int64_t nbH = H / kQuantBlock;
  // 1. routing
  std::vector<int64_t> ids(T * k);
  std::vector<float> weights(T * k);
  parallel_dynamic(T, [&](std::atomic<int64_t>& next) {
    for (int64_t t; (t = next++) < T;)
      route(logits + t * E, E, k, normalize, ids.data() + t * k, weights.data() + t * k);
  });
  std::vector<int64_t> count(E, 0), first(E + 1, 0), local(T * k);
  for (int64_t i = 0; i < T * k; ++i) local[i] = count[ids[i]]++;
  for (int64_t e = 0; e < E; ++e) first[e + 1] = first[e] + count[e];
  std::vector<int64_t> token(T * k + (shared ? T : 0));
  std::vector<float> weight(token.size());
  for (int64_t i = 0; i < T * k; ++i) {
    token[first[ids[i]] + local[i]] = i / k;
    weight[first[ids[i]] + local[i]] = weights[i];
  }
  std::vector<Job> jobs;
  std::vector<int64_t> job_of(E, -1);
  for (int64_t e = 0; e < E; ++e) {
    if (count[e] == 0) continue;
    job_of[e] = static_cast<int64_t>(jobs.size());
    jobs.push_back({routed.gate_up + e * routed.gu_stride, routed.down + e * routed.down_stride,
                    routed.gu_format, routed.down_format, routed.inter, count[e],
                    token.data() + first[e], weight.data() + first[e],
                    count[e] <= int8_rows(routed.gu_format),
                    count[e] <= int8_rows(routed.down_format)});
  }
  if (shared) {
    for (int64_t t = 0; t < T; ++t) token[T * k + t] = t;
    jobs.push_back({shared->gate_up, shared->down, shared->gu_format, shared->down_format,
                    shared->inter, T, token.data() + T * k, weight.data() + T * k,
                    T <= int8_rows(shared->gu_format), T <= int8_rows(shared->down_format)});
  }
  // Buffers: each token's quantized x per code width the int8 gate_up tiles need, the
  // routed experts' rows of x (fp32 or quantized), every expert's SiLU * up (and its
  // quantized rows for int8 down tiles).
  bool quantized_tokens[2] = {false, false};  // 4-bit, 8-bit layouts
  for (const Job& job : jobs)
    if (job.gu_int8) quantized_tokens[code_bits(job.gu_format) == 8] = true;
  Arena<int8_t> bytes;
  Arena<float> floats;
  QuantRows tokens_q[2];
  int64_t inter_max = 0;
  for (int pass = 0; pass < 2; ++pass) {
    for (int b = 0; b < 2; ++b)
      if (quantized_tokens[b]) tokens_q[b] = take_quant_rows(bytes, floats, T, H);
    for (size_t j = 0; j < jobs.size(); ++j) {
      Job& job = jobs[j];
      const bool is_shared = shared && j + 1 == jobs.size();
      if (job.gu_int8)
        job.qx = is_shared ? tokens_q[code_bits(job.gu_format) == 8]
                           : take_quant_rows(bytes, floats, job.rows, H);
      else if (is_shared)
        job.x = xp;
      else
        job.x = job.x_rows = floats.take(job.rows * H);
      job.act = floats.take(job.rows * job.inter);
      if (job.down_int8) job.qa = take_quant_rows(bytes, floats, job.rows, job.inter);
      inter_max = std::max(inter_max, job.inter);
    }
    if (pass == 0) {
      bytes.allocate();
      floats.allocate();
    }
  }
  // 2. the rows' inputs
  parallel_dynamic(T, [&](std::atomic<int64_t>& next) {
    for (int64_t t; (t = next++) < T;) {
      const float* xt = xp + t * H;
      for (int b = 0; b < 2; ++b)
        if (quantized_tokens[b]) {
          const QuantRows& q = tokens_q[b];
          (b == 0 ? quantize_row<4> : quantize_row<8>)(
              xt, H, q.q + t * 2 * H, q.scale + t * nbH, q.sum + t * nbH, q.centre + t * nbH);
        }
      for (int64_t j = 0; j < k; ++j) {
        const int64_t i = t * k + j;
        const Job& job = jobs[job_of[ids[i]]];
        if (job.gu_int8)
          copy_quant_row(tokens_q[code_bits(job.gu_format) == 8], t, job.qx, local[i], H);
        else
          std::memcpy(job.x_rows + local[i] * H, xt, H * 4);
      }
      if (shared) {
        float gate = 1.0f;
        if (shared_gate != nullptr) {
          float dot = 0.0f;
          for (int64_t c = 0; c < H; ++c) dot += xt[c] * shared_gate[c];
          gate = dot < -kExpLimit ? 0.0f : 1.0f / (1.0f + std::exp(-dot));
        }
        weight[T * k + t] = gate;
      }
    }
  });
  // 3. gate_up -> SiLU * up. Units: (job, a run of 32-channel blocks of its I), as long as
  // the int8 path's units where the expert is on it, one block where it is on the fp32 one.
  struct Unit {
    int64_t job, begin, end;  // blocks of 32 intermediate channels: 4 pairs each
  };
  std::vector<Unit> units;
  const int64_t int8_blocks = std::max<int64_t>(1, kUnitWeights / (2 * kQuantBlock * H));
  for (size_t j = 0; j < jobs.size(); ++j) {
    const int64_t blocks = jobs[j].inter / kQuantBlock, step = jobs[j].gu_int8 ? int8_blocks : 1;
    for (int64_t b = 0; b < blocks; b += step)
      units.push_back({static_cast<int64_t>(j), b, std::min(blocks, b + step)});
  }
  const int64_t num_units = static_cast<int64_t>(units.size());
  const auto gu_pair = [&](const Unit& unit, int64_t i) {  // pair i of the unit
    const Job& job = jobs[unit.job];
    return job.gate_up + (4 * unit.begin + i) * 2 * nbH * record_bytes(job.gu_format);
  };
  parallel_dynamic(num_units, [&](std::atomic<int64_t>& next) {
    float* w = static_cast<float*>(std::aligned_alloc(64, H * 16 * 4));
    for (int64_t u = next++, following; u < num_units; u = following) {
      following = next++;
      const Unit& unit = units[u];
      const Job& job = jobs[unit.job];
      const int64_t I = job.inter;
      for (int64_t i = 0; i < 4 * (unit.end - unit.begin); ++i) {
        const int64_t channel = 8 * (4 * unit.begin + i);
        const uint8_t* ahead =
            following < num_units && i < 4 * (units[following].end - units[following].begin)
                ? gu_pair(units[following], i)
                : nullptr;
        pair_rows_of(job.gu_format, gu_pair(unit, i), nbH, H, job.rows, job.gu_int8, job.x,
                     job.qx, w, ahead, [&](int64_t r, int64_t rows, const float* tile) {
                       for (int64_t j = 0; j < rows; ++j)
                         silu_times_up(tile + 16 * j, job.act + (r + j) * I + channel);
                     });
      }
      if (job.down_int8) {
        const int64_t nbI = I / kQuantBlock, b = unit.begin;
        const QuantRows& q = job.qa;
        for (int64_t r = 0; r < job.rows; ++r)
          quantize_rows_of(code_bits(job.down_format), job.act + r * I + b * kQuantBlock, 1,
                           (unit.end - b) * kQuantBlock,
                           {q.q + r * 2 * I + 2 * b * kQuantBlock, q.scale + r * nbI + b,
                            q.sum + r * nbI + b, q.centre + r * nbI + b});
      }
    }
    std::free(w);
  });
  // 4. down and the weighted sum. Units: runs of the output's H / 16 pairs, as long as the
  // int8 path's, but at least kUnitsPerThread a thread.
  const int64_t pairs = H / 16;
  const int64_t per_unit = std::max<int64_t>(
      1, std::min<int64_t>(kUnitWeights / (2 * kPanel * inter_max),
                           pairs / (kUnitsPerThread * at::get_num_threads())));
  const int64_t down_units = (pairs + per_unit - 1) / per_unit;
  const auto down_pair = [&](const Job& job, int64_t p) {
    return job.down + p * 2 * (job.inter / kQuantBlock) * record_bytes(job.down_format);
  };
  parallel_dynamic(down_units, [&](std::atomic<int64_t>& next) {
    float* w = static_cast<float*>(std::aligned_alloc(64, inter_max * 16 * 4));
    for (int64_t u = next++, following; u < down_units; u = following) {
      following = next++;
      const int64_t begin = u * per_unit, end = std::min(pairs, begin + per_unit);
      for (size_t j = 0; j < jobs.size(); ++j) {
        const Job& job = jobs[j];
        const Job* next_job = j + 1 < jobs.size() ? &jobs[j + 1] : nullptr;
        for (int64_t p = begin; p < end; ++p) {
          // prefetched: this pair of the next expert, or of the first in the next unit
          const int64_t ahead_pair = next_job ? p : following * per_unit + (p - begin);
          const uint8_t* ahead =
              next_job ? down_pair(*next_job, ahead_pair)
              : following < down_units && ahead_pair < pairs ? down_pair(jobs[0], ahead_pair)
                                                             : nullptr;
          pair_rows_of(job.down_format, down_pair(job, p), job.inter / kQuantBlock, job.inter,
                       job.rows, job.down_int8, job.act, job.qa, w, ahead,
                       [&](int64_t r, int64_t rows, const float* tile) {
                         for (int64_t i = 0; i < rows; ++i) {
                           float* o = out + job.token[r + i] * H + 16 * p;
                           const __m256 scale = _mm256_set1_ps(job.weight[r + i]);
                           for (int half = 0; half < 2; ++half)
                             _mm256_storeu_ps(o + 8 * half, _mm256_fmadd_ps(
                                 scale, _mm256_loadu_ps(tile + 16 * i + 8 * half),
                                 _mm256_loadu_ps(o + 8 * half)));
                         }
                       });
        }
      }
    }
    std::free(w);
  });
}

}  // namespace moe
#endif
