// The small ops of a bf16 decode step, fused, for AVX-512 CPUs.
//
// In a decode step the weights stream at memory bandwidth and everything else is overhead:
// dozens of tiny torch ops per layer, each paying dispatch, allocation and (after the
// weights swept the caches) cold misses. These kernels do the same arithmetic in one call
// each, and round where Hugging Face's bf16 path rounds, so results match the torch path
// up to the order of fp32 sums.
//
// paged_decode_attention reads K/V straight from the block pool:
//
//   token t of sequence b  ->  block_tables[b][t / BS], slot t % BS
//   k_cache[block][slot][kv_head][:]   (no gathered copy of the context)
//
// Work is split over (sequence, kv head); the G = Hq / Hkv query heads of a group share
// each K/V row read.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "paged_rows.h"
#include "plan_shared.h"
#include "simd_math.h"

namespace {

using bf16 = at::BFloat16;

inline float round_bf16(float v) { return static_cast<float>(bf16(v)); }

// 16 bf16 -> 16 fp32 (exact: bf16 is the top half of an fp32)
inline __m512 load16(const bf16* p) {
  __m256i raw = _mm256_loadu_si256((const __m256i*)p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// 16 fp32 -> 16 bf16, round to nearest even (as c10::BFloat16 rounds)
inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
inline void store16(bf16* p, __m512 v) { _mm256_storeu_si256((__m256i*)p, to_bf16(v)); }
// softmax of one row of scores in place (fp32; exp 16 lanes at a time), probabilities
// rounded to bf16 when the torch path computes them in bf16
void softmax_row(float* s, int64_t L, bool round_to_bf16) {
  __m512 mx16 = _mm512_set1_ps(-INFINITY);
  int64_t m = 0;
  for (; m + 16 <= L; m += 16) mx16 = _mm512_max_ps(mx16, _mm512_loadu_ps(s + m));
  float mx = _mm512_reduce_max_ps(mx16);
  for (; m < L; ++m) mx = std::max(mx, s[m]);
  __m512 sum = _mm512_setzero_ps();
  int64_t t = 0;
  for (; t + 16 <= L; t += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + t), _mm512_set1_ps(mx)));
    _mm512_storeu_ps(s + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  float total = _mm512_reduce_add_ps(sum);
  for (; t < L; ++t) {
    s[t] = std::exp(s[t] - mx);
    total += s[t];
  }
  const float inv = 1.f / total;
  const __m512 inv_v = _mm512_set1_ps(inv);
  int64_t u = 0;
  for (; u + 16 <= L; u += 16) {
    const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(s + u), inv_v);
    _mm512_storeu_ps(s + u, round_to_bf16 ? round16(v) : v);
  }
  for (; u < L; ++u) s[u] = round_to_bf16 ? round_bf16(s[u] * inv) : s[u] * inv;
}

void check_bf16_cpu(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16, name, ": bfloat16 CPU tensor expected");
}

// y[row] = bf16(w * bf16(x * rsqrt(mean(x^2) + eps))), as Hugging Face rounds in bf16.
void rms_row(const bf16* x, const bf16* w, bf16* y, int64_t n, float eps) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = load16(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  float ss = _mm512_reduce_add_ps(acc);
  for (int64_t j = i; j < n; ++j) ss += static_cast<float>(x[j]) * static_cast<float>(x[j]);
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  const __m512 inv_v = _mm512_set1_ps(inv);
  for (i = 0; i + 16 <= n; i += 16)
    store16(y + i, _mm512_mul_ps(load16(w + i), round16(_mm512_mul_ps(load16(x + i), inv_v))));
  for (; i < n; ++i) y[i] = bf16(static_cast<float>(w[i]) * round_bf16(static_cast<float>(x[i]) * inv));
}

// res = bf16(res + x), row-wise
void add_row(bf16* res, const bf16* x, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store16(res + i, _mm512_add_ps(load16(res + i), load16(x + i)));
  for (; i < n; ++i) res[i] = bf16(static_cast<float>(res[i]) + static_cast<float>(x[i]));
}


// scores[g][t0 .. t0+n) for GN query heads of a group from the chunk's K columns: one
// vdpbf16ps a pair of dims adds two products to all 16 tokens' scores (no horizontal sums;
// products of bf16 are exact in fp32, as in torch's matmul)
template <int GN>
inline void qk_chunk(const __m512i* col, const int32_t* qpairs, int64_t DP, float* scores, int64_t L, int64_t n,
                     float scale) {
  __m512 acc[GN];
  for (int g = 0; g < GN; ++g) acc[g] = _mm512_setzero_ps();
  for (int64_t p = 0; p < DP; ++p) {
    const __m512bh kv = (__m512bh)_mm512_load_si512(col + p);
    for (int g = 0; g < GN; ++g) acc[g] = _mm512_dpbf16_ps(acc[g], kv, (__m512bh)_mm512_set1_epi32(qpairs[g * DP + p]));
  }
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
  for (int g = 0; g < GN; ++g)  // torch: bf16 matmul output, then * scale in fp32
    _mm512_mask_storeu_ps(scores + g * L, valid, _mm512_mul_ps(round16(acc[g]), _mm512_set1_ps(scale)));
}

// acc[g][d0 .. d0 + 16 DN) += p[g][t] v_t over tokens [t0, t1) for GN heads (probs[g L + t]),
// in token order: the accumulators stay in registers over the run, and a head's sums are the
// same fp32 ops in the same order however its tokens are cut into runs
template <int GN, int DN, bool L2>
inline void pv_block(const bf16* vp, const int64_t* rows, int64_t t0, int64_t t1, int64_t L, int64_t D, int64_t d0,
                     const float* probs, float* acc_io) {
  __m512 acc[GN][DN];
  for (int g = 0; g < GN; ++g)
    for (int j = 0; j < DN; ++j) acc[g][j] = _mm512_loadu_ps(acc_io + g * D + 16 * j);
  for (int64_t t = t0; t < t1; ++t) {
    const bf16* vrow = vp + rows[t] * D + d0;
    // blocks are scattered over the pool: fetch ahead (into L2 or L1: paged_rows.h), the
    // hardware prefetcher cannot
    if (t + KV_PREFETCH_TOKENS < L) _mm_prefetch((const char*)(vp + rows[t + KV_PREFETCH_TOKENS] * D + d0), kv_hint<L2>);
    __m512 vv[DN];
    for (int j = 0; j < DN; ++j) vv[j] = load16(vrow + 16 * j);
    for (int g = 0; g < GN; ++g) {
      const __m512 pg = _mm512_set1_ps(probs[g * L + t]);
      for (int j = 0; j < DN; ++j) acc[g][j] = _mm512_fmadd_ps(pg, vv[j], acc[g][j]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int j = 0; j < DN; ++j) _mm512_storeu_ps(acc_io + g * D + 16 * j, acc[g][j]);
}

}  // namespace

void rms_norm_into(const bf16* x, const bf16* w, bf16* y, int64_t rows, int64_t n, double eps) {
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) rms_row(x + r * n, w, y + r * n, n, (float)eps);
  });
}

void add_rms_norm_into(const bf16* x, bf16* residual, const bf16* w, bf16* y, int64_t rows, int64_t n, double eps) {
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      add_row(residual + r * n, x + r * n, n);
      rms_row(residual + r * n, w, y + r * n, n, (float)eps);
    }
  });
}

void add_rows_into(bf16* residual, const bf16* x, int64_t n) { add_row(residual, x, n); }

torch::Tensor rms_norm_bf16(torch::Tensor x, torch::Tensor w, double eps) {
  check_bf16_cpu(x, "rms_norm");
  check_bf16_cpu(w, "rms_norm weight");
  const int64_t n = x.size(-1);
  auto xc = x.contiguous();
  auto y = torch::empty_like(xc);
  rms_norm_into(xc.data_ptr<bf16>(), w.data_ptr<bf16>(), y.data_ptr<bf16>(), xc.numel() / n, n, eps);
  return y;
}

torch::Tensor add_rms_norm_bf16(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  check_bf16_cpu(x, "add_rms_norm");
  check_bf16_cpu(residual, "add_rms_norm residual");
  TORCH_CHECK(residual.is_contiguous() && x.sizes() == residual.sizes(), "add_rms_norm: shapes differ");
  const int64_t n = x.size(-1);
  auto xc = x.contiguous();
  auto y = torch::empty_like(residual);
  add_rms_norm_into(xc.data_ptr<bf16>(), residual.data_ptr<bf16>(), w.data_ptr<bf16>(), y.data_ptr<bf16>(),
                    xc.numel() / n, n, eps);
  return y;
}

// x: (T, H, D) with unit stride in D and H (rows may be strided: a view into qkv).
// cos/sin: fp32 tables (max_positions, D); rotate-half layout, bf16 roundings as torch's.
void rope_into(bf16* xp, int64_t T, int64_t H, int64_t D, int64_t row_stride, const int64_t* pp, const float* cp,
               const float* sp, int64_t head_stride) {
  const int64_t half = D / 2, hs = head_stride > 0 ? head_stride : D;
  // 16 lanes at a time (a mask for the last of a half that is not a multiple of 16): the same
  // roundings as torch's bf16 ops, one pair of lanes each, so the results are the scalar loop's
  auto lanes = [](int64_t n) { return static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1); };
  auto load = [](const bf16* p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
  };
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    std::vector<float> cr(D), sr(D);  // this position's cos and sin, rounded to bf16 (as torch's bf16 tables)
    for (int64_t t = b; t < e; ++t) {
      const float* c = cp + pp[t] * D;
      const float* s = sp + pp[t] * D;
      for (int64_t i = 0; i < D; i += 16) {
        const __mmask16 m = lanes(D - i);
        _mm512_mask_storeu_ps(cr.data() + i, m, round16(_mm512_maskz_loadu_ps(m, c + i)));
        _mm512_mask_storeu_ps(sr.data() + i, m, round16(_mm512_maskz_loadu_ps(m, s + i)));
      }
      for (int64_t h = 0; h < H; ++h) {
        bf16* v = xp + t * row_stride + h * hs;
        for (int64_t i = 0; i < half; i += 16) {
          const __mmask16 m = lanes(half - i);
          const __m512 x1 = load(v + i, m), x2 = load(v + half + i, m);
          const __m512 c1 = _mm512_maskz_loadu_ps(m, cr.data() + i), s1 = _mm512_maskz_loadu_ps(m, sr.data() + i);
          const __m512 c2 = _mm512_maskz_loadu_ps(m, cr.data() + half + i), s2 = _mm512_maskz_loadu_ps(m, sr.data() + half + i);
          // torch: x * cos + cat(-x2, x1) * sin, each product and the sum rounded to bf16
          const __m512 y1 = _mm512_add_ps(round16(_mm512_mul_ps(x1, c1)), round16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), s1)));
          const __m512 y2 = _mm512_add_ps(round16(_mm512_mul_ps(x2, c2)), round16(_mm512_mul_ps(x1, s2)));
          _mm256_mask_storeu_epi16(v + i, m, to_bf16(y1));
          _mm256_mask_storeu_epi16(v + half + i, m, to_bf16(y2));
        }
      }
    }
  });
}

void rope_bf16_(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin) {
  check_bf16_cpu(x, "rope");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "rope: (T, H, D) rows expected");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) == x.size(2),
              "rope: float32 (positions, D) cos and sin tables expected");
  auto pos = positions.to(at::kLong).contiguous();
  TORCH_CHECK(pos.numel() == x.size(0), "rope: one position a row expected");
  ridge_shared::check_positions("rope", x.size(0), pos.data_ptr<int64_t>(), cos.size(0));
  rope_into(x.data_ptr<bf16>(), x.size(0), x.size(1), x.size(2), x.stride(0), pos.data_ptr<int64_t>(),
            cos.data_ptr<float>(), sin.data_ptr<float>(), x.size(2));
}

void silu_mul_into(const bf16* gp, int64_t rows, int64_t I, bf16* yp) {
  // silu in fp32, rounded to bf16, times up, rounded again: torch's F.silu(gate) * up in bf16
  at::parallel_for(0, rows * I, 16384, [&](int64_t b, int64_t e) {
    for (int64_t idx = b; idx < e;) {
      const int64_t r = idx / I, i = idx % I;
      const int64_t len = std::min<int64_t>({16, I - i, e - idx});
      const bf16* gate = gp + r * 2 * I + i;
      const bf16* up = gate + I;
      bf16* out = yp + r * I + i;
      if (len == 16) {
        const __m512 gv = load16(gate);
        const __m512 act = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
        store16(out, _mm512_mul_ps(round16(act), load16(up)));
      } else {
        for (int64_t j = 0; j < len; ++j) {
          const float gvs = gate[j];
          out[j] = bf16(round_bf16(gvs / (1.f + std::exp(-gvs))) * static_cast<float>(up[j]));
        }
      }
      idx += len;
    }
  });
}

torch::Tensor silu_mul_bf16(torch::Tensor gate_up) {
  check_bf16_cpu(gate_up, "silu_mul");
  auto g = gate_up.contiguous();
  const int64_t I = g.size(-1) / 2;
  auto out_shape = g.sizes().vec();
  out_shape.back() = I;
  auto y = torch::empty(out_shape, g.options());
  silu_mul_into(g.data_ptr<bf16>(), g.numel() / (2 * I), I, y.data_ptr<bf16>());
  return y;
}

// Top-k routing of T tokens over E experts, as Router.forward routes: logits x . router_e in
// fp32 (x widened from bf16; four 16-lane sums over k in steps of 64, then added and summed
// across lanes), then the choice that plan_shared.h makes (softmax or sigmoid, groups, the
// top_k best first, their weights); ridge_shared::route_topk_with shares the pairs out over
// the threads. A token's ids and weights never depend on the other tokens of its batch.
void route_topk_into(const bf16* x, int64_t T, int64_t K, ridge_shared::RouterRows router, int64_t E, int64_t top_k, bool softmax,
                     bool norm_topk, double norm_eps, double scaling, int64_t n_group, int64_t topk_group,
                     const float* bias, int64_t* ids, bf16* weights) {
  ridge_shared::route_topk_with(
      x, T, K, router, E, top_k, softmax, norm_topk, norm_eps, scaling, n_group, topk_group, bias, ids, weights,
      [](const bf16* xr, const auto* w, int64_t K) {
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        int64_t k = 0;
        for (; k + 64 <= K; k += 64)
          for (int j = 0; j < 4; ++j) acc[j] = _mm512_fmadd_ps(load16(xr + k + 16 * j), load16(w + k + 16 * j), acc[j]);
        for (; k + 16 <= K; k += 16) acc[0] = _mm512_fmadd_ps(load16(xr + k), load16(w + k), acc[0]);
        float sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
        for (; k < K; ++k) sum += static_cast<float>(xr[k]) * static_cast<float>(w[k]);
        return sum;
      });
}

std::vector<torch::Tensor> route_topk(torch::Tensor x, torch::Tensor router, int64_t top_k, bool softmax, bool norm_topk,
                                      double norm_eps, double scaling, int64_t n_group, int64_t topk_group,
                                      c10::optional<torch::Tensor> bias) {
  return ridge_shared::route_topk_tensors(x, router, top_k, softmax, norm_topk, norm_eps, scaling, n_group, topk_group,
                                         bias, route_topk_into);
}

namespace {

// paged_decode_attention_bf16_into with K's and V's rows fetched into L2 (L2) or L1 (paged_rows.h)
template <bool L2>
void bf16_attention(const bf16* qp, int64_t q_stride, int64_t B, int64_t Hq, int64_t D, const bf16* kp, const bf16* vp,
                    int64_t BS, int64_t Hkv, const int64_t* tp, int64_t max_blocks, const int64_t* lp, double scale,
                    bf16* op) {
  const int64_t G = Hq / Hkv;
  const float fscale = static_cast<float>(scale);
  // Scores, 16 tokens at a time: lane i of a column holds token i's (k[2p], k[2p+1]) pair
  // (row_columns), so one vdpbf16ps with a broadcast (q[2p], q[2p+1]) adds two products to
  // all 16 scores (qk_chunk).
  //
  //   token t  ->  slot = table[t / BS] * BS + t % BS  ->  its K row at k_cache + (slot * Hkv + h) * D
  //
  // A job is a sequence and a run of HJ of its KV heads, which lie side by side in the pool: a
  // job reads each token's rows of its heads as one run of HJ D values (a block of BS tokens,
  // one stretch of memory), where a job of one head read D of every Hkv D (kv_head_jobs).
  const int64_t DP = D / 2;
  const int64_t split = kv_head_jobs(B, Hkv, lp, Hkv * D * 2 * static_cast<int64_t>(sizeof(bf16)), kv_grouped_bound(kv_grouped_default()));
  const int64_t HJ = Hkv / split;
  at::parallel_for(0, B * split, 1, [&](int64_t begin, int64_t end) {
    // the thread's buffers, kept from call to call (paged_rows.h's Scratch; every element is
    // written before it is read): the query's pairs, K's columns, the scores, the sums
    thread_local Scratch<int32_t> qpairs_buf;
    thread_local Scratch<__m512i> col_buf;
    thread_local Scratch<float> score_buf, acc_buf;
    int32_t* qpairs = qpairs_buf.get(HJ * G * DP);
    __m512i* col = col_buf.get(DP);
    float* acc = acc_buf.get(HJ * G * D);
    std::vector<int64_t> rows;  // token t's pool row of the job's first head
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / split, h0 = job % split * HJ;
      const int64_t L = lp[b];
      paged_rows(tp + b * max_blocks, L, BS, Hkv, h0, rows);
      std::memcpy(qpairs, qp + b * q_stride + h0 * G * D, HJ * G * D * sizeof(bf16));
      float* scores = score_buf.get(HJ * G * L);  // every score is written below
      const int64_t first = std::min<int64_t>(L, KV_PREFETCH_TOKENS);  // the window before the loops' fetch
      prefetch_rows<_MM_HINT_T0>(kp, rows.data(), 0, first, 2 * D, HJ);
      prefetch_rows<_MM_HINT_T1>(vp, rows.data(), 0, first, 2 * D, HJ);
      for (int64_t t0 = 0; t0 < L; t0 += 16) {
        const int64_t n = std::min<int64_t>(16, L - t0);
        // the rows of the chunk KV_PREFETCH_TOKENS ahead, into L2 or L1 (paged_rows.h)
        const int64_t ahead_end = std::min<int64_t>(L, t0 + KV_PREFETCH_TOKENS + 16);
        const int64_t ahead = std::min<int64_t>(ahead_end, t0 + KV_PREFETCH_TOKENS);
        prefetch_chunk_rows<kv_hint<L2>>(kp, rows.data(), ahead, ahead_end, 2 * D, HJ, BS, Hkv);
        for (int64_t j = 0; j < HJ; ++j) {
          alignas(64) int64_t rows16[16];
          for (int64_t i = 0; i < 16; ++i)  // tail lanes repeat a valid token
            rows16[i] = rows[t0 + std::min<int64_t>(i, n - 1)] + j;
          // col[p] lane i holds token i's (k[2p], k[2p+1]) (row_columns; a gather per pair, as this
          // kernel read before, measured 1.03-1.07x slower for the whole attention, 2-core Xeon)
          row_columns(reinterpret_cast<const uint8_t*>(kp), rows16, 2 * D, _mm512_setzero_si512(), col);
          for (int64_t g0 = 0; g0 < G; g0 += 8) {
            const int32_t* qg = qpairs + (j * G + g0) * DP;
            float* sg = &scores[(j * G + g0) * L + t0];
            switch (std::min<int64_t>(8, G - g0)) {
              case 1: qk_chunk<1>(col, qg, DP, sg, L, n, fscale); break;
              case 2: qk_chunk<2>(col, qg, DP, sg, L, n, fscale); break;
              case 3: qk_chunk<3>(col, qg, DP, sg, L, n, fscale); break;
              case 4: qk_chunk<4>(col, qg, DP, sg, L, n, fscale); break;
              case 5: qk_chunk<5>(col, qg, DP, sg, L, n, fscale); break;
              case 6: qk_chunk<6>(col, qg, DP, sg, L, n, fscale); break;
              case 7: qk_chunk<7>(col, qg, DP, sg, L, n, fscale); break;
              default: qk_chunk<8>(col, qg, DP, sg, L, n, fscale);
            }
          }
        }
      }
      // softmax per query head (fp32), probabilities rounded to bf16
      for (int64_t g = 0; g < HJ * G; ++g) softmax_row(&scores[g * L], L, true);
      // out[g] = sum_t p[g][t] * v_t, fp32 accumulation, one bf16 rounding. A job of several
      // heads in runs of PV_TOKENS tokens (their rows of the job's heads in L1 for all of them),
      // one of one head in one run; each cut of a head's query heads and dims (pv_cuts) keeps
      // its accumulators in registers over a run.
      std::fill(acc, acc + HJ * G * D, 0.f);
      const int64_t run = HJ == 1 ? L : PV_TOKENS;
      for (int64_t t0 = 0; t0 < L; t0 += run) {
        const int64_t t1 = std::min<int64_t>(L, t0 + run);
        for (int64_t j = 0; j < HJ; ++j) {
          const bf16* vj = vp + j * D;  // head h0 + j's row of a token: rows[t] + j
          const float* pj = &scores[j * G * L];
          float* aj = &acc[j * G * D];
          pv_cuts(G, D, [&](auto heads, auto dims16, int64_t g0, int64_t d0) {
            constexpr int GN = decltype(heads)::value, DN = decltype(dims16)::value;
            pv_block<GN, DN, L2>(vj, rows.data(), t0, t1, L, D, d0, pj + g0 * L, aj + g0 * D + d0);
          });
        }
      }
      bf16* out = op + (b * Hq + h0 * G) * D;  // the job's HJ G heads are consecutive
      for (int64_t i = 0; i + 16 <= HJ * G * D; i += 16) store16(out + i, _mm512_loadu_ps(&acc[i]));
    }
  });
}

}  // namespace

void paged_decode_attention_bf16_into(const bf16* qp, int64_t q_stride, int64_t B, int64_t Hq, int64_t D,
                                      const bf16* kp, const bf16* vp, int64_t BS, int64_t Hkv, const int64_t* tp,
                                      int64_t max_blocks, const int64_t* lp, double scale, bf16* op) {
  if (kv_fetch_into_l2())
    bf16_attention<true>(qp, q_stride, B, Hq, D, kp, vp, BS, Hkv, tp, max_blocks, lp, scale, op);
  else
    bf16_attention<false>(qp, q_stride, B, Hq, D, kp, vp, BS, Hkv, tp, max_blocks, lp, scale, op);
}

torch::Tensor paged_decode_attention_bf16(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                          torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  check_bf16_cpu(q, "decode_attention q");
  check_bf16_cpu(k_cache, "decode_attention k_cache");
  check_bf16_cpu(v_cache, "decode_attention v_cache");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "decode_attention: contiguous caches expected");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(D % 16 == 0 && D <= 256 && k_cache.size(3) == D, "decode_attention: head_dim must be a multiple of 16, <= 256");
  auto qc = q.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = torch::empty_like(qc);
  paged_decode_attention_bf16_into(qc.data_ptr<bf16>(), Hq * D, B, Hq, D, k_cache.data_ptr<bf16>(), v_cache.data_ptr<bf16>(),
                                   BS, Hkv, tables.data_ptr<int64_t>(), tables.size(1), lens.data_ptr<int64_t>(), scale,
                                   out.data_ptr<bf16>());
  return out;
}


// Any head size, float32 or bfloat16 (the AVX-512 kernel above takes multiples of 16 in
// bf16): plain loops the compiler vectorizes, same order of operations and roundings.
template <typename T>
void paged_decode_attention_any(const T* qp, const T* kp, const T* vp, const int64_t* tp, const int64_t* lp, T* op,
                                int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t BS, int64_t max_blocks,
                                float scale) {
  constexpr bool kRound = std::is_same_v<T, bf16>;  // torch rounds bf16 matmul outputs and probabilities
  const int64_t G = Hq / Hkv;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), scores, acc(G * D);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / Hkv, h = job % Hkv, L = lp[b];
      const int64_t* table = tp + b * max_blocks;
      for (int64_t i = 0; i < G * D; ++i) qf[i] = static_cast<float>(qp[(b * Hq + h * G) * D + i]);
      scores.assign(G * L, 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const T* krow = kp + ((table[t / BS] * BS + t % BS) * Hkv + h) * D;
        for (int64_t g = 0; g < G; ++g) {
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qf[g * D + d] * static_cast<float>(krow[d]);
          scores[g * L + t] = (kRound ? round_bf16(dot) : dot) * scale;
        }
      }
      for (int64_t g = 0; g < G; ++g) softmax_row(&scores[g * L], L, kRound);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const T* vrow = vp + ((table[t / BS] * BS + t % BS) * Hkv + h) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + t];
          for (int64_t d = 0; d < D; ++d) acc[g * D + d] += p * static_cast<float>(vrow[d]);
        }
      }
      for (int64_t i = 0; i < G * D; ++i) op[(b * Hq + h * G) * D + i] = static_cast<T>(acc[i]);
    }
  });
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(q.device().is_cpu() && (dtype == at::kFloat || dtype == at::kBFloat16), "decode_attention: float32 or bfloat16 CPU q");
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype, "decode_attention: cache dtype differs from q");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "decode_attention: contiguous caches expected");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), BS = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && Hq % Hkv == 0, "decode_attention: head sizes do not match the cache");
  auto qc = q.contiguous();
  auto tables = block_tables.to(at::kLong).contiguous();
  auto lens = context_lens.to(at::kLong).contiguous();
  auto out = torch::empty_like(qc);
  if (dtype == at::kFloat)
    paged_decode_attention_any<float>(qc.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                                      tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<float>(), B, Hq,
                                      Hkv, D, BS, tables.size(1), static_cast<float>(scale));
  else
    paged_decode_attention_any<bf16>(qc.data_ptr<bf16>(), k_cache.data_ptr<bf16>(), v_cache.data_ptr<bf16>(),
                                     tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<bf16>(), B, Hq,
                                     Hkv, D, BS, tables.size(1), static_cast<float>(scale));
  return out;
}

// Structured output: the tokens a row's grammar does not allow get -inf, in place. Bit j of
// word w of a row's mask allows token 32 w + j (llguidance's and xgrammar's layout); tokens
// past the mask's words are disallowed. Each word is one or two masked stores of -inf (no
// branch per token: grammar masks are as random as bits get); a word of all ones is skipped.
void apply_token_bitmask_(torch::Tensor logits, torch::Tensor bitmask) {
  TORCH_CHECK(logits.dim() == 2 && bitmask.dim() == 2 && logits.size(0) == bitmask.size(0),
              "apply_token_bitmask_: logits (rows, V) and bitmask (rows, words)");
  TORCH_CHECK(bitmask.scalar_type() == torch::kInt32, "apply_token_bitmask_: the bitmask is int32");
  TORCH_CHECK(logits.is_contiguous() && bitmask.is_contiguous() && logits.device().is_cpu() && bitmask.device().is_cpu(),
              "apply_token_bitmask_: contiguous CPU tensors");
  const auto dtype = logits.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16 || dtype == torch::kFloat16,
              "apply_token_bitmask_: float32, bfloat16 or float16 logits");
  const int64_t rows = logits.size(0), V = logits.size(1), words = bitmask.size(1);
  const uint32_t* mp = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const bool f32 = dtype == torch::kFloat32;
  char* lp = static_cast<char*>(logits.data_ptr());
  const int64_t row_bytes = V * logits.element_size();
  // -inf: fp32 0xFF800000, bf16 0xFF80, fp16 0xFC00
  const __m512 ninf32 = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(0xFF800000u)));
  const __m512i ninf16 = _mm512_set1_epi16(static_cast<short>(dtype == torch::kBFloat16 ? 0xFF80 : 0xFC00));
  at::parallel_for(0, rows, 4, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      char* row = lp + r * row_bytes;
      const uint32_t* m = mp + r * words;
      for (int64_t base = 0, w = 0; base < V; base += 32, ++w) {
        uint32_t off = w < words ? ~m[w] : 0xFFFFFFFFu;  // the tokens to disallow
        if (V - base < 32) off &= (1u << (V - base)) - 1u;  // no store past the row
        if (!off) continue;
        if (f32) {
          float* p = reinterpret_cast<float*>(row) + base;
          _mm512_mask_storeu_ps(p, static_cast<__mmask16>(off & 0xFFFFu), ninf32);
          _mm512_mask_storeu_ps(p + 16, static_cast<__mmask16>(off >> 16), ninf32);
        } else {
          _mm512_mask_storeu_epi16(reinterpret_cast<int16_t*>(row) + base, static_cast<__mmask32>(off), ninf16);
        }
      }
    }
  });
}

// Greedy sampling: each row's index of its largest logit, as torch.argmax picks it (the first
// of equal maxima; a row with a NaN gives its first NaN). One pass of 16-lane compares that
// keep each lane's best value and where it was (strictly greater moves it, so a lane keeps its
// first maximum), then the lowest index among the lanes that hold the row's maximum. torch's
// CPU argmax of a 32k-token row took 75-100 us (2-core Xeon; 410 us for 8 rows), this one a
// few: it ran once per decode step.
torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.device().is_cpu(),
              "argmax_rows: (rows, V) CPU logits with V >= 1");
  const auto dtype = logits.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "argmax_rows: float32 or bfloat16 logits");
  auto x = logits.contiguous();
  const int64_t rows = x.size(0), V = x.size(1);
  auto out = torch::empty({rows}, x.options().dtype(torch::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const bool f32 = dtype == torch::kFloat32;
  const void* base = x.data_ptr();
  auto value = [&](int64_t r, int64_t i) {
    return f32 ? static_cast<const float*>(base)[r * V + i] : static_cast<float>(static_cast<const bf16*>(base)[r * V + i]);
  };
  at::parallel_for(0, rows, 4, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      int64_t best = 0;
      float best_v = value(r, 0);
      int64_t i = 0;
      if (V >= 16) {
        auto load = [&](int64_t at) {
          return f32 ? _mm512_loadu_ps(static_cast<const float*>(base) + r * V + at)
                     : load16(static_cast<const bf16*>(base) + r * V + at);
        };
        __m512 vmax = load(0);
        __m512i vidx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i cur = vidx;
        __mmask16 nan = _mm512_cmp_ps_mask(vmax, vmax, _CMP_UNORD_Q);
        const __m512i step = _mm512_set1_epi32(16);
        for (i = 16; i + 16 <= V; i += 16) {
          cur = _mm512_add_epi32(cur, step);
          const __m512 v = load(i);
          nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
          const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
          vmax = _mm512_mask_mov_ps(vmax, gt, v);
          vidx = _mm512_mask_mov_epi32(vidx, gt, cur);
        }
        if (nan) {  // torch's argmax takes a NaN as the largest value: the row's first NaN
          for (int64_t j = 0; j < V; ++j)
            if (std::isnan(value(r, j))) {
              best = j;
              break;
            }
          op[r] = best;
          continue;
        }
        best_v = _mm512_reduce_max_ps(vmax);
        const __mmask16 at_max = _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(best_v), _CMP_EQ_OQ);
        best = _mm512_mask_reduce_min_epi32(at_max, vidx);
      }
      for (; i < V; ++i) {  // the tail (or a row shorter than a vector), after every lane's index
        const float v = value(r, i);
        if (std::isnan(v)) {
          if (!std::isnan(best_v)) best = i, best_v = v;
          // an earlier NaN stays (a row of fewer than 16 values may start with one)
        } else if (!std::isnan(best_v) && v > best_v) {
          best = i, best_v = v;
        }
      }
      op[r] = best;
    }
  });
  return out;
}
