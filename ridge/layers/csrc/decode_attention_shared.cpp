// Decode attention where every query head reads one shared KV head: DeepSeek's latent
// attention (MLA) absorbed into multi-query attention, whose "key" per token is the cache
// vector c = [latent (r) | k_rope (p)] and whose value is c's first r dims (layers/mla.py).
//
// The per-(sequence, KV head) kernels (decode_ops.cpp) run one job per sequence here, one
// thread at batch 1, and put tokens in a vector's lanes (16 K rows transposed). With 16+
// heads on one key, heads go in the lanes instead, and a sequence's context is split into
// chunks of CT tokens that the threads share:
//
//   pass 1, per (sequence, chunk):  s[t][h] = bf16(q_h . c_t) * scale    (16 heads a vector:
//           one vdpbf16ps per pair of dims, the key's pair broadcast; 8 tokens in flight),
//           the chunk's max m and sum l of exp(s - m) per head
//   merge, per sequence:            M = max m, L = sum l e^(m - M)
//   pass 2, per (sequence, chunk):  p = bf16(e^(s - M) / L) (torch's softmax, then its cast)
//           o[h][d] += p[t][h] v[t][d] over the chunk (one vdpbf16ps per token pair and d: the
//           two tokens' probabilities of 16 heads against their (v[t][d], v[t+1][d]) pair)
//   reduce, per sequence:           out = bf16(sum over chunks of o)
//
// so it computes what the gathered torch path computes (bf16 scores, an fp32 softmax rounded
// to bf16, fp32 sums, one bf16 rounding) up to the order of fp32 sums and exp's last bits,
// and reads each cache vector twice from memory or cache, never a gathered copy.
//
// An int8 or fp8 latent cache (codes and fp16 scales per 32 dims, kv/cache.py) runs the same
// chunks with the arithmetic of decode_attention_quant.cpp, heads in lanes instead of tokens:
//
//   int8:  each head's query in int8 per group of 32 (quantize_query); per token and group
//          vpdpbusd of the token's codes (+ 128, broadcast) against 16 heads' codes, then
//          s += int(dot) * (k scale * q scale): the scores decode_attention_quant.cpp computes,
//          bit for bit (the same integers, the same float ops in the same order)
//   fp8:   the token's codes decoded to fp32 and multiplied into 16 heads' fp32 queries
//   both:  fp32 probabilities (that kernel's softmax: no bf16 rounding), values dequantized
//          in fp32 (codes times their group's scale), o[h][d] += p[t][h] v[t][d] in fp32
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "kv_codes.h"
#include "paged_rows.h"
#include "simd_math.h"

namespace {

using bf16 = at::BFloat16;
constexpr int64_t LANES = 16;  // heads per vector
constexpr int64_t CT = 128;    // tokens per chunk (a job): 32 jobs at a 4k context
constexpr int TOKENS = 8;      // scores in flight (8 chains of vdpbf16ps, latency ~5)
constexpr int DB = 16;         // output dims per pass over a chunk (16 accumulators)

// The jobs: (sequence, chunk of CT tokens), a sequence's chunks consecutive from first[b].
struct ChunkJobs {
  std::vector<int64_t> first;
  const int64_t* lens;
  int64_t count;

  ChunkJobs(const int64_t* lp, int64_t B, int64_t capacity) : first(B + 1, 0), lens(lp) {
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(lp[b] >= 1 && lp[b] <= capacity, "decode_attention_shared: context length out of range");
      first[b + 1] = first[b] + (lp[b] + CT - 1) / CT;
    }
    count = first[B];
  }

  // job -> its sequence b, its first token t0 and its n tokens
  void at(int64_t job, int64_t& b, int64_t& t0, int64_t& n) const {
    b = std::upper_bound(first.begin(), first.end(), job) - first.begin() - 1;
    t0 = (job - first[b]) * CT;
    n = std::min<int64_t>(CT, lens[b] - t0);
  }
};

// Per job and group: its chunk's scores [t][lane], their max and sum of exp(s - max), and its
// partial outputs o[d][lane] (a batch of uneven contexts holds only its tokens' scores)
struct ChunkBuffers {
  torch::Tensor scores_t, stats_t, part_t;
  float *scores, *stats, *part;

  ChunkBuffers(int64_t jobs, int64_t HG, int64_t DV)
      : scores_t(torch::empty({jobs, HG, CT, LANES}, torch::dtype(torch::kFloat32))),
        stats_t(torch::empty({jobs, HG, 2, LANES}, torch::dtype(torch::kFloat32))),
        part_t(torch::empty({jobs, HG, DV, LANES}, torch::dtype(torch::kFloat32))),
        scores(scores_t.data_ptr<float>()),
        stats(stats_t.data_ptr<float>()),
        part(part_t.data_ptr<float>()) {}
};

// One group's chunk statistics from its n scores s[t][lane]: st = (max m, sum of exp(s - m))
inline void chunk_stats(const float* s, int64_t n, float* st) {
  __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) m = _mm512_max_ps(m, _mm512_load_ps(s + t * LANES));
  for (int64_t t = 0; t < n; ++t) l = _mm512_add_ps(l, exp512(_mm512_sub_ps(_mm512_load_ps(s + t * LANES), m)));
  _mm512_storeu_ps(st, m);
  _mm512_storeu_ps(st + LANES, l);
}

// Per sequence and group, the max over its chunks and the sum of exp against it, kept where
// its first chunk's stats were (stats [job][group][2][lane])
void merge_stats(const ChunkJobs& jobs, int64_t B, int64_t HG, float* stats) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < HG; ++g) {
      const int64_t j0 = jobs.first[b], j1 = jobs.first[b + 1];
      __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();
      for (int64_t job = j0; job < j1; ++job) m = _mm512_max_ps(m, _mm512_loadu_ps(stats + ((job * HG + g) * 2) * LANES));
      for (int64_t job = j0; job < j1; ++job) {
        const float* st = stats + ((job * HG + g) * 2) * LANES;
        l = _mm512_fmadd_ps(_mm512_loadu_ps(st + LANES), exp512(_mm512_sub_ps(_mm512_loadu_ps(st), m)), l);
      }
      float* st = stats + ((j0 * HG + g) * 2) * LANES;
      _mm512_storeu_ps(st, m);
      _mm512_storeu_ps(st + LANES, l);
    }
}

// out[b][h][d] = T(sum over the sequence's chunks of part[job][group][d][lane])
template <typename T>
void reduce_parts(const ChunkJobs& jobs, int64_t B, int64_t H, int64_t HG, int64_t DV, const float* part, T* op) {
  at::parallel_for(0, B * HG, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float lanes[LANES];
    for (int64_t bg = begin; bg < end; ++bg) {
      const int64_t b = bg / HG, g = bg % HG;
      for (int64_t d = 0; d < DV; ++d) {
        __m512 sum = _mm512_setzero_ps();
        for (int64_t job = jobs.first[b]; job < jobs.first[b + 1]; ++job)
          sum = _mm512_add_ps(sum, _mm512_load_ps(part + ((job * HG + g) * DV + d) * LANES));
        _mm512_store_ps(lanes, sum);
        for (int64_t i = 0; i < LANES && g * LANES + i < H; ++i) op[(b * H + g * LANES + i) * DV + d] = static_cast<T>(lanes[i]);
      }
    }
  });
}

// Scores of n (<= TOKENS) tokens for one group of 16 heads: s[i][16] = bf16(q . c_i) * scale
inline void score_tokens(const int32_t* qt, const int32_t* const* k32, int n, int64_t DP, __m512 scale, float* s) {
  __m512 acc[TOKENS];
  for (int i = 0; i < TOKENS; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < DP; ++p) {
    const __m512bh qv = (__m512bh)_mm512_load_si512(qt + p * LANES);
#pragma GCC unroll 8
    for (int i = 0; i < TOKENS; ++i)
      if (i < n) acc[i] = _mm512_dpbf16_ps(acc[i], qv, (__m512bh)_mm512_set1_epi32(k32[i][p]));
  }
  for (int i = 0; i < n; ++i) _mm512_store_ps(s + i * LANES, _mm512_mul_ps(round16(acc[i]), scale));
}

// int8 scores of TOKENS tokens (tail tokens repeat a valid one) for one group of 16 heads:
// per group gi of GS dims, the heads' query codes qc[p][lane] (4 a lane) against each token's
// codes + 128 (kb[i][p], 4 a word), started at qs[gi] (-128 times the heads' code sums), then
// s += int * (token's k scale * the head's qf[gi]). s[i][16] for i < n.
inline void score_tokens_int8(const int32_t* qc, const int32_t* qs, const float* qf, const int32_t* kb, const float* ks,
                              int n, int64_t NGR, int64_t QG, float* s) {
  const int64_t DQ = NGR * QG;
  __m512 sacc[TOKENS];
  for (int i = 0; i < TOKENS; ++i) sacc[i] = _mm512_setzero_ps();
  for (int64_t gi = 0; gi < NGR; ++gi) {
    __m512i acc[TOKENS];
    const __m512i start = _mm512_load_si512(qs + gi * LANES);
    for (int i = 0; i < TOKENS; ++i) acc[i] = start;
    for (int64_t p = gi * QG; p < (gi + 1) * QG; ++p) {
      const __m512i qv = _mm512_load_si512(qc + p * LANES);
#pragma GCC unroll 8
      for (int i = 0; i < TOKENS; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_set1_epi32(kb[i * DQ + p]), qv);
    }
    const __m512 qfv = _mm512_load_ps(qf + gi * LANES);
    for (int i = 0; i < TOKENS; ++i)
      sacc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i]), _mm512_mul_ps(_mm512_set1_ps(ks[i * NGR + gi]), qfv), sacc[i]);
  }
  for (int i = 0; i < n; ++i) _mm512_store_ps(s + i * LANES, sacc[i]);
}

// fp8 scores, the same way: the tokens' decoded codes kf[i][d] (value / 256) against the heads'
// fp32 query qv[d][lane], per group times the token's k scale; s = sum * 256 * scale.
inline void score_tokens_fp8(const float* qv, const float* kf, const float* ks, int n, int64_t D, int64_t NGR,
                             int64_t GS, __m512 unit_scale, float* s) {
  __m512 sacc[TOKENS];
  for (int i = 0; i < TOKENS; ++i) sacc[i] = _mm512_setzero_ps();
  for (int64_t gi = 0; gi < NGR; ++gi) {
    __m512 dot[TOKENS];
    for (int i = 0; i < TOKENS; ++i) dot[i] = _mm512_setzero_ps();
    for (int64_t d = gi * GS; d < (gi + 1) * GS; ++d) {
      const __m512 q = _mm512_load_ps(qv + d * LANES);
#pragma GCC unroll 8
      for (int i = 0; i < TOKENS; ++i) dot[i] = _mm512_fmadd_ps(q, _mm512_set1_ps(kf[i * D + d]), dot[i]);
    }
    for (int i = 0; i < TOKENS; ++i) sacc[i] = _mm512_fmadd_ps(dot[i], _mm512_set1_ps(ks[i * NGR + gi]), sacc[i]);
  }
  for (int i = 0; i < n; ++i) _mm512_store_ps(s + i * LANES, _mm512_mul_ps(sacc[i], unit_scale));
}

// The query of each sequence and head laid out with heads in lanes, as the scores read it.
struct SharedQuery {
  torch::Tensor codes, sums, scales, values;  // int8: [b][g][D/4][lane], [b][g][NGR][lane] x2; fp8: [b][g][D][lane]
};

template <typename T>
SharedQuery query_lanes(const T* qp, int64_t B, int64_t H, int64_t D, int64_t HG, int64_t NGR, float scale, bool fp8) {
  const int64_t GS = D / NGR;
  SharedQuery out;
  std::vector<float> x(D);
  if (fp8) {
    out.values = torch::zeros({B, HG, D, LANES}, torch::dtype(torch::kFloat32));
    float* v = out.values.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) v[((b * HG + h / LANES) * D + d) * LANES + h % LANES] = static_cast<float>(qp[(b * H + h) * D + d]);
    return out;
  }
  out.codes = torch::zeros({B, HG, D / 4, LANES}, torch::dtype(torch::kInt32));
  out.sums = torch::zeros({B, HG, NGR, LANES}, torch::dtype(torch::kInt32));
  out.scales = torch::zeros({B, HG, NGR, LANES}, torch::dtype(torch::kFloat32));
  int32_t* codes = out.codes.data_ptr<int32_t>();
  int32_t* sums = out.sums.data_ptr<int32_t>();
  float* scales = out.scales.data_ptr<float>();
  std::vector<int8_t> qq(D);
  std::vector<int32_t> qsum(NGR);
  std::vector<float> qf(NGR);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t d = 0; d < D; ++d) x[d] = static_cast<float>(qp[(b * H + h) * D + d]);
      quantize_query(x.data(), D, GS, scale, qq.data(), qsum.data(), qf.data());
      const int64_t g = h / LANES, lane = h % LANES;
      for (int64_t p = 0; p < D / 4; ++p) std::memcpy(&codes[((b * HG + g) * (D / 4) + p) * LANES + lane], &qq[4 * p], 4);
      for (int64_t gi = 0; gi < NGR; ++gi) {
        sums[((b * HG + g) * NGR + gi) * LANES + lane] = qsum[gi];
        scales[((b * HG + g) * NGR + gi) * LANES + lane] = qf[gi];
      }
    }
  return out;
}

// q (B, H, D) contiguous -> out (B, H, DV)
template <typename T>
void attend_shared_quant(const T* qp, int64_t B, int64_t H, int64_t D, const uint8_t* kp, const at::Half* ksp,
                         const int64_t* tp, const int64_t* lp, int64_t max_blocks, int64_t BS, int64_t NGR, int64_t DV,
                         float scale, bool fp8, T* op) {
  const int64_t HG = (H + LANES - 1) / LANES;
  const int64_t GS = D / NGR, QG = GS / 4, NDB = DV / DB;
  const ChunkJobs jobs(lp, B, max_blocks * BS);
  const SharedQuery query = query_lanes<T>(qp, B, H, D, HG, NGR, scale, fp8);
  const float* q_values = fp8 ? query.values.data_ptr<float>() : nullptr;
  const int32_t* q_codes = fp8 ? nullptr : query.codes.data_ptr<int32_t>();
  const int32_t* q_sums = fp8 ? nullptr : query.sums.data_ptr<int32_t>();
  const float* q_scales = fp8 ? nullptr : query.scales.data_ptr<float>();
  const ChunkBuffers buf(jobs.count, HG, DV);
  float *scores = buf.scores, *stats = buf.stats, *part = buf.part;
  const float code_unit = fp8 ? FP8_CODE_UNIT : 1.f;
  const __m512 unit_scale = _mm512_set1_ps(code_unit * scale);

  // pass 1: scores, and each chunk's max and sum of exp per head
  at::parallel_for(0, jobs.count, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> rows;
    // the TOKENS tokens' codes as the scores read them (int8: + 128; fp8: decoded), k scales
    std::vector<float> kf(fp8 ? TOKENS * D : 0), ks(TOKENS * NGR);
    std::vector<int32_t> kb(fp8 ? 0 : TOKENS * D / 4);
    for (int64_t job = begin; job < end; ++job) {
      int64_t b, t0, n;
      jobs.at(job, b, t0, n);
      paged_rows_from(tp + b * max_blocks, t0, n, BS, 1, 0, rows);
      for (int64_t i = 0; i < n; i += TOKENS) {
        const int cnt = static_cast<int>(std::min<int64_t>(TOKENS, n - i));
        for (int j = 0; j < TOKENS; ++j) {
          const int64_t row = rows[i + std::min(j, cnt - 1)];  // tail tokens repeat a valid one
          const uint8_t* src = kp + row * D;
          for (int64_t gi = 0; gi < NGR; ++gi) ks[j * NGR + gi] = half_to_float(ksp + row * NGR + gi);
          if (fp8) {
            for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(&kf[j * D + d], fp8x16(src + d));
          } else {
            const __m128i flip = _mm_set1_epi8(static_cast<char>(0x80));
            for (int64_t d = 0; d < D; d += 16)
              _mm_storeu_si128(reinterpret_cast<__m128i*>(&kb[j * D / 4 + d / 4]),
                               _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d)), flip));
          }
        }
        if (i + TOKENS < n)  // the next tokens' rows (blocks lie anywhere in the pool)
          for (int j = 0; j < std::min<int64_t>(TOKENS, n - i - TOKENS); ++j)
            for (int64_t c = 0; c < D; c += 64) _mm_prefetch((const char*)(kp + rows[i + TOKENS + j] * D) + c, _MM_HINT_T0);
        for (int64_t g = 0; g < HG; ++g) {
          float* s = scores + ((job * HG + g) * CT + i) * LANES;
          if (fp8)
            score_tokens_fp8(q_values + (b * HG + g) * D * LANES, kf.data(), ks.data(), cnt, D, NGR, GS, unit_scale, s);
          else
            score_tokens_int8(q_codes + (b * HG + g) * (D / 4) * LANES, q_sums + (b * HG + g) * NGR * LANES,
                              q_scales + (b * HG + g) * NGR * LANES, kb.data(), ks.data(), cnt, NGR, QG, s);
        }
      }
      for (int64_t g = 0; g < HG; ++g)
        chunk_stats(scores + (job * HG + g) * CT * LANES, n, stats + (job * HG + g) * 2 * LANES);
    }
  });

  merge_stats(jobs, B, HG, stats);

  // pass 2: fp32 probabilities in place of the scores, values dequantized a block of 16 dims
  // at a time, each chunk's share of the output
  at::parallel_for(0, jobs.count, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> rows;
    std::vector<float> unit(CT * NGR);  // [token][group]: the value of a code unit
    alignas(64) float vb[CT * DB];       // [token][16 dims]: codes times their group's scale
    for (int64_t job = begin; job < end; ++job) {
      int64_t b, t0, n;
      jobs.at(job, b, t0, n);
      paged_rows_from(tp + b * max_blocks, t0, n, BS, 1, 0, rows);
      for (int64_t g = 0; g < HG; ++g) {
        const float* st = stats + ((jobs.first[b] * HG + g) * 2) * LANES;
        const __m512 m = _mm512_loadu_ps(st), inv = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_loadu_ps(st + LANES));
        float* s = scores + (job * HG + g) * CT * LANES;
        for (int64_t t = 0; t < n; ++t)
          _mm512_store_ps(s + t * LANES, _mm512_mul_ps(exp512(_mm512_sub_ps(_mm512_load_ps(s + t * LANES), m)), inv));
      }
      for (int64_t t = 0; t < n; ++t)
        for (int64_t gi = 0; gi < NGR; ++gi) unit[t * NGR + gi] = half_to_float(ksp + rows[t] * NGR + gi) * code_unit;
      for (int64_t d0 = 0; d0 < DV; d0 += DB) {
        const int64_t gi = d0 / GS;
        for (int64_t t = 0; t < n; ++t) {
          const uint8_t* src = kp + rows[t] * D + d0;
          _mm512_store_ps(vb + t * DB, _mm512_mul_ps(fp8 ? fp8x16(src) : int8x16(src), _mm512_set1_ps(unit[t * NGR + gi])));
        }
        for (int64_t g = 0; g < HG; ++g) {
          const float* p = scores + (job * HG + g) * CT * LANES;
          __m512 acc[DB];
          for (int j = 0; j < DB; ++j) acc[j] = _mm512_setzero_ps();
          for (int64_t t = 0; t < n; ++t) {
            const __m512 pv = _mm512_load_ps(p + t * LANES);
#pragma GCC unroll 16
            for (int j = 0; j < DB; ++j) acc[j] = _mm512_fmadd_ps(pv, _mm512_set1_ps(vb[t * DB + j]), acc[j]);
          }
          float* o = part + ((job * HG + g) * DV + d0) * LANES;
          for (int j = 0; j < DB; ++j) _mm512_store_ps(o + j * LANES, acc[j]);
        }
      }
    }
  });

  reduce_parts<T>(jobs, B, H, HG, DV, part, op);
}

}  // namespace

torch::Tensor paged_decode_attention_shared(torch::Tensor q, torch::Tensor cache, torch::Tensor block_tables,
                                            torch::Tensor context_lens, double scale, int64_t value_dim) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && cache.scalar_type() == at::kBFloat16 && q.device().is_cpu(),
              "decode_attention_shared: bf16 tensors on the CPU expected");
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 4 && cache.size(2) == 1 && cache.is_contiguous(),
              "decode_attention_shared: q (B, H, D) and one contiguous KV head (blocks, BS, 1, D) expected");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), BS = cache.size(1);
  TORCH_CHECK(cache.size(3) == D && D % 2 == 0, "decode_attention_shared: the cache's width must be q's (even)");
  TORCH_CHECK(value_dim > 0 && value_dim <= D && value_dim % DB == 0,
              "decode_attention_shared: value_dim must be a multiple of 16, at most the head size");
  auto tables = block_tables.contiguous();
  auto lens_t = context_lens.contiguous();
  auto qc = q.contiguous();
  auto out = torch::empty({B, H, value_dim}, q.options());
  paged_decode_attention_shared_into(qc.data_ptr<bf16>(), B, H, D, cache.data_ptr<bf16>(), BS, tables.data_ptr<int64_t>(),
                                     tables.size(1), lens_t.data_ptr<int64_t>(), scale, value_dim, out.data_ptr<bf16>());
  return out;
}

void paged_decode_attention_shared_into(const bf16* q, int64_t B, int64_t H, int64_t D, const bf16* kp, int64_t BS,
                                        const int64_t* tp, int64_t max_blocks, const int64_t* lp, double scale,
                                        int64_t value_dim, bf16* op) {
  const int64_t HG = (H + LANES - 1) / LANES, DP = D / 2, DV = value_dim, NDB = DV / DB;
  const int32_t* k32 = reinterpret_cast<const int32_t*>(kp);
  const ChunkJobs jobs(lp, B, max_blocks * BS);

  // q as pairs with heads in lanes: qt[b][g][p][lane] = (q[h][2p], q[h][2p + 1]), h = 16 g + lane
  auto qt_t = torch::zeros({B, HG, DP, LANES}, torch::dtype(torch::kInt32));
  {
    const int32_t* q32 = reinterpret_cast<const int32_t*>(q);
    int32_t* qt = qt_t.data_ptr<int32_t>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t p = 0; p < DP; ++p) qt[((b * HG + h / LANES) * DP + p) * LANES + h % LANES] = q32[(b * H + h) * DP + p];
  }
  const int32_t* qt = qt_t.data_ptr<int32_t>();
  const ChunkBuffers buf(jobs.count, HG, DV);
  float *scores = buf.scores, *stats = buf.stats, *part = buf.part;
  const __m512 vscale = _mm512_set1_ps(static_cast<float>(scale));

  // pass 1: scores, and each chunk's max and sum of exp per head
  at::parallel_for(0, jobs.count, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> rows;
    for (int64_t job = begin; job < end; ++job) {
      int64_t b, t0, n;
      jobs.at(job, b, t0, n);
      paged_rows_from(tp + b * max_blocks, t0, n, BS, 1, 0, rows);  // this chunk's
      for (int64_t i = 0; i < n; i += TOKENS) {
        const int cnt = static_cast<int>(std::min<int64_t>(TOKENS, n - i));
        const int32_t* k[TOKENS];
        for (int j = 0; j < TOKENS; ++j) k[j] = k32 + rows[i + std::min(j, cnt - 1)] * DP;
        if (i + TOKENS < n)  // the next tokens' vectors (blocks lie anywhere in the pool)
          for (int j = 0; j < std::min<int64_t>(TOKENS, n - i - TOKENS); ++j)
            for (int64_t c = 0; c < 2 * D; c += 64) _mm_prefetch((const char*)(kp + rows[i + TOKENS + j] * D) + c, _MM_HINT_T0);
        for (int64_t g = 0; g < HG; ++g)
          score_tokens(qt + (b * HG + g) * DP * LANES, k, cnt, DP, vscale, scores + ((job * HG + g) * CT + i) * LANES);
      }
      for (int64_t g = 0; g < HG; ++g)
        chunk_stats(scores + (job * HG + g) * CT * LANES, n, stats + (job * HG + g) * 2 * LANES);
    }
  });

  merge_stats(jobs, B, HG, stats);

  // pass 2: probabilities, and each chunk's share of the output
  at::parallel_for(0, jobs.count, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> rows;
    const int64_t T2 = (CT + 1) / 2;
    std::vector<int32_t> vp2(NDB * T2 * DB);       // [d block][token pair][16 d]: (v[t][d], v[t + 1][d])
    std::vector<int32_t> pp(T2 * LANES);           // [token pair][lane]: (p[t][h], p[t + 1][h])
    // permutations interleaving two rows' 32 bf16: (a0 b0 a1 b1 .. a15 b15), then a16 ..
    // and one vector's two halves the same way (pair)
    alignas(64) int16_t lo_idx[32], hi_idx[32], pair_idx[32];
    for (int i = 0; i < 16; ++i) {
      lo_idx[2 * i] = i, lo_idx[2 * i + 1] = 32 + i, hi_idx[2 * i] = 16 + i, hi_idx[2 * i + 1] = 48 + i;
      pair_idx[2 * i] = i, pair_idx[2 * i + 1] = 16 + i;
    }
    const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx), pair_perm = _mm512_load_si512(pair_idx);
    for (int64_t job = begin; job < end; ++job) {
      int64_t b, t0, n;
      jobs.at(job, b, t0, n);
      paged_rows_from(tp + b * max_blocks, t0, n, BS, 1, 0, rows);  // this chunk's
      const int64_t n2 = (n + 1) / 2;
      for (int64_t t2 = 0; t2 < n2; ++t2) {  // the chunk's values as pairs of tokens
        const bf16* va = kp + rows[2 * t2] * D;
        const bool pair = 2 * t2 + 1 < n;
        const bf16* vb = pair ? kp + rows[2 * t2 + 1] * D : nullptr;
        for (int64_t d = 0; d < DV; d += 32) {
          const __mmask32 m = DV - d >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << (DV - d)) - 1);
          const __m512i a = _mm512_maskz_loadu_epi16(m, va + d);
          const __m512i c = pair ? _mm512_maskz_loadu_epi16(m, vb + d) : _mm512_setzero_si512();
          const __m512i x0 = _mm512_permutex2var_epi16(a, lo, c), x1 = _mm512_permutex2var_epi16(a, hi, c);
          // d .. d + 15 are d block d / 16, d + 16 .. the next one
          _mm512_storeu_si512(&vp2[((d / DB) * T2 + t2) * DB], x0);
          if (d + 16 < DV) _mm512_storeu_si512(&vp2[((d / DB + 1) * T2 + t2) * DB], x1);
        }
      }
      for (int64_t g = 0; g < HG; ++g) {
        const float* st = stats + ((jobs.first[b] * HG + g) * 2) * LANES;
        const __m512 m = _mm512_loadu_ps(st), inv = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_loadu_ps(st + LANES));
        const float* s = scores + (job * HG + g) * CT * LANES;
        for (int64_t t2 = 0; t2 < n2; ++t2) {
          const __m512 p0 = _mm512_mul_ps(exp512(_mm512_sub_ps(_mm512_load_ps(s + 2 * t2 * LANES), m)), inv);
          const __m512 p1 = 2 * t2 + 1 < n ? _mm512_mul_ps(exp512(_mm512_sub_ps(_mm512_load_ps(s + (2 * t2 + 1) * LANES), m)), inv)
                                           : _mm512_setzero_ps();
          // (p0[h], p1[h]) as one int32 lane: cvtne2ps puts p1 in the upper 16 bf16, p0 in the lower
          const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
          _mm512_storeu_si512(&pp[t2 * LANES], _mm512_permutexvar_epi16(pair_perm, both));
        }
        float* o = part + (job * HG + g) * DV * LANES;
        for (int64_t db = 0; db < NDB; ++db) {
          __m512 acc[DB];
          for (int j = 0; j < DB; ++j) acc[j] = _mm512_setzero_ps();
          const int32_t* v = &vp2[db * T2 * DB];
          for (int64_t t2 = 0; t2 < n2; ++t2) {
            const __m512bh pv = (__m512bh)_mm512_loadu_si512(&pp[t2 * LANES]);
#pragma GCC unroll 16
            for (int j = 0; j < DB; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], pv, (__m512bh)_mm512_set1_epi32(v[t2 * DB + j]));
          }
          for (int j = 0; j < DB; ++j) _mm512_store_ps(o + (db * DB + j) * LANES, acc[j]);
        }
      }
    }
  });

  // reduce: out[b][h][d] = bf16(sum over the sequence's chunks)
  reduce_parts<bf16>(jobs, B, H, HG, DV, part, op);
}

torch::Tensor paged_decode_attention_shared_quant(torch::Tensor q, torch::Tensor cache, torch::Tensor scales,
                                                  torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                                  int64_t value_dim, bool fp8) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(q.device().is_cpu() && (dtype == at::kFloat || dtype == at::kBFloat16),
              "decode_attention_shared_quant: float32 or bfloat16 CPU q");
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 4 && cache.size(2) == 1 && cache.element_size() == 1 && cache.is_contiguous(),
              "decode_attention_shared_quant: q (B, H, D) and one contiguous KV head of 1-byte codes expected");
  const int64_t D = q.size(2), BS = cache.size(1);
  TORCH_CHECK(cache.size(3) == D && D % 16 == 0, "decode_attention_shared_quant: the cache's width must be q's (16k)");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 4 &&
                  scales.size(0) == cache.size(0) && scales.size(1) == BS && scales.size(2) == 1,
              "decode_attention_shared_quant: contiguous fp16 scales (blocks, block_size, 1, groups) expected");
  const int64_t NGR = scales.size(3);
  TORCH_CHECK(NGR >= 1 && D % NGR == 0 && (D / NGR) % 16 == 0,
              "decode_attention_shared_quant: scale groups of 16k dims expected");
  TORCH_CHECK(value_dim > 0 && value_dim <= D && value_dim % DB == 0,
              "decode_attention_shared_quant: value_dim must be a multiple of 16, at most the head size");
  auto tables = block_tables.to(at::kLong).contiguous();
  auto lens = context_lens.to(at::kLong).contiguous();
  const auto* kp = static_cast<const uint8_t*>(cache.data_ptr());
  const auto* ksp = scales.data_ptr<at::Half>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const float s = static_cast<float>(scale);
  auto qc = q.contiguous();
  const int64_t B = q.size(0), H = q.size(1);
  auto out = torch::empty({B, H, value_dim}, q.options());
  if (dtype == at::kFloat)
    attend_shared_quant<float>(qc.data_ptr<float>(), B, H, D, kp, ksp, tp, lp, tables.size(1), BS, NGR, value_dim, s,
                               fp8, out.data_ptr<float>());
  else
    attend_shared_quant<bf16>(qc.data_ptr<bf16>(), B, H, D, kp, ksp, tp, lp, tables.size(1), BS, NGR, value_dim, s, fp8,
                              out.data_ptr<bf16>());
  return out;
}

void paged_decode_attention_shared_quant_into(const bf16* q, int64_t B, int64_t H, int64_t D, const uint8_t* cache,
                                              const at::Half* scales, int64_t groups, int64_t BS,
                                              const int64_t* block_tables, int64_t max_blocks,
                                              const int64_t* context_lens, double scale, int64_t value_dim, bool fp8,
                                              bf16* out) {
  attend_shared_quant<bf16>(q, B, H, D, cache, scales, block_tables, context_lens, max_blocks, BS, groups, value_dim,
                            static_cast<float>(scale), fp8, out);
}

// MLA's absorption around that attention: y[d][h] = x[d][h] @ w[h] for each head h, x (D, H, K)
// and w (H, K, N) bf16 -> y (D, H, N) bf16 (W_uk into the query, W_uv^T out of the latent).
// What torch.bmm computes (bf16 products summed in fp32, one bf16 rounding) up to the order
// of the sums, one call and no transposed copies; each head's w is read once for all rows
// (a decode step is a few rows: the weights' bytes are its cost).
torch::Tensor head_matmul_bf16(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 && x.device().is_cpu() &&
                  w.device().is_cpu(),
              "head_matmul: bf16 tensors on the CPU expected");
  TORCH_CHECK(x.dim() == 3 && w.dim() == 3 && x.size(1) == w.size(0) && x.size(2) == w.size(1),
              "head_matmul: x (D, H, K) and w (H, K, N) expected");
  const int64_t D = x.size(0), H = x.size(1), K = x.size(2), N = w.size(2);
  TORCH_CHECK(N % 16 == 0, "head_matmul: N must be a multiple of 16");
  auto xc = x.stride(2) == 1 ? x : x.contiguous();  // rows and heads may be strided (MLA's q slices)
  auto wc = w.contiguous();
  auto y = torch::empty({D, H, N}, x.options());
  head_matmul_bf16_into(xc.data_ptr<bf16>(), xc.stride(0), xc.stride(1), D, H, K, wc.data_ptr<bf16>(), N,
                        y.data_ptr<bf16>());
  return y;
}

void head_matmul_bf16_into(const bf16* xp, int64_t sxr, int64_t sxh, int64_t D, int64_t H, int64_t K, const bf16* wp,
                           int64_t N, bf16* yp) {
  constexpr int64_t NV = 4, RB = 4;  // outputs a pass: 4 vectors of 16 for 4 rows (16 accumulators)
  const int64_t NBLK = (N / 16 + NV - 1) / NV;
  at::parallel_for(0, H * NBLK, 1, [&](int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job) {
      const int64_t h = job / NBLK, n0 = (job % NBLK) * NV * 16, nv = std::min<int64_t>(NV, (N - n0) / 16);
      for (int64_t d0 = 0; d0 < D; d0 += RB) {
        const int64_t rb = std::min<int64_t>(RB, D - d0);
        __m512 acc[RB][NV];
        for (int i = 0; i < RB; ++i)
          for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; ++k) {
          const bf16* wrow = wp + (h * K + k) * N + n0;
          __m512 wv[NV];
          for (int j = 0; j < NV; ++j)
            wv[j] = j < nv ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                 _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wrow + 16 * j))), 16))
                           : _mm512_setzero_ps();
          for (int i = 0; i < RB; ++i) {
            if (i >= rb) break;
            const __m512 xv = _mm512_set1_ps(static_cast<float>(xp[(d0 + i) * sxr + h * sxh + k]));
            for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
          }
        }
        for (int64_t i = 0; i < rb; ++i)
          for (int64_t j = 0; j < nv; ++j)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(yp + ((d0 + i) * H + h) * N + n0 + 16 * j),
                                (__m256i)_mm512_cvtneps_pbh(acc[i][j]));
      }
    }
  });
}
