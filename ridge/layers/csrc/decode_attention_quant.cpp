// Paged decode attention over an int8 or fp8 (e4m3) KV cache: codes and fp16 scales, one per
// group of 32 dims of a token's head (kv/cache.py), read straight from the pool and
// dequantized in registers.
//
//   token t of sequence b  ->  slot = block_tables[b][t / BS] * BS + t % BS
//   k_cache[slot][h][:] codes (D bytes), k_scale[slot][h][:] (D / 32 fp16)
//
// Scores over an int8 K use integer dot products: each group of 32 query values is quantized
// to int8 (scale amax / 127, as llama.cpp quantizes Q to q8_0 against a q8_0 cache), and
// vpdpbusd adds four products of 16 tokens at once (the unsigned side is K's code + 128,
// taken back out with the query's code sum):
//
//   q.k_t = sum_groups sq_g sk_t,g (sum_d (k_d + 128) q_d  -  128 sum_d q_d)
//
// With one scale per head of 64 for both, the int8 query doubled the KL divergence of the
// cache; per 32 it adds 5% (0.00133 against 0.00127 for a query kept to 15 bits in two int8
// parts, which doubled the integer work: README, "KV cache in int8 or fp8"). An fp8 K: 16
// tokens' rows decoded to fp32 and transposed in registers, so that each dim is a vector of 16
// tokens that every head's fp32 query value multiplies (no reduction per token and head). V of
// either kind: each row's codes times its group scales, weighted
// by p_t, accumulated in fp32 registers. Work is split over
// (sequence, run of KV heads) as in decode_ops.cpp.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kv_codes.h"
#include "paged_rows.h"
#include "simd_math.h"

namespace ridge {
void softmax_row(float* scores, int64_t L, bool round_to_bf16);
}

namespace {

using bf16 = at::BFloat16;

// 16 tokens' fp8 K rows as fp32 columns: col[d] lane i = token i's value at dim d, / 256
inline void k_columns_fp8(const uint8_t* kp, const int64_t* rows16, int64_t D, float* col) {
  for (int64_t c0 = 0; c0 < D; c0 += 16) {
    __m512i r[16], c[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_castps_si512(fp8x16(kp + rows16[i] * D + c0));
    transpose16(r, c);
    for (int j = 0; j < 16; ++j) _mm512_store_si512(col + (c0 + j) * 16, c[j]);
  }
}

// 16 pool rows' fp16 scales where a row has 2 or 4 (one 4- or 8-byte word): one gather of
// the 16 words into w[0], or two of 8 (rows 0-7 in w[0], 8-15 in w[1]); the rows' scales in
// row order either way. A scalar conversion each was ~10% of the int8 kernel at 4,096 tokens.
inline void scale_words(const at::Half* sp, const int64_t* rows16, int64_t NGR, __m512i w[2]) {
  alignas(64) int32_t idx[16];
  for (int i = 0; i < 16; ++i) idx[i] = static_cast<int32_t>(rows16[i]);
  if (NGR == 2) {
    w[0] = _mm512_i32gather_epi32(_mm512_load_si512(idx), sp, 4);
  } else {
    w[0] = _mm512_i32gather_epi64(_mm256_load_si256(reinterpret_cast<const __m256i*>(idx)), sp, 8);
    w[1] = _mm512_i32gather_epi64(_mm256_load_si256(reinterpret_cast<const __m256i*>(idx + 8)), sp, 8);
  }
}

// The fp16 scales of 16 tokens (pool rows rows16, NGR scales a row) as fp32, group-major:
// ks[gi * 16 + i] is token i's scale of group gi. 2 or 4 a row: scale_words, split into groups
// by vpmovdw / vpmovqw; any other NGR one by one. The conversions are exact either way.
inline void token_scales16(const at::Half* sp, const int64_t* rows16, int64_t NGR, float* ks) {
  __m512i w[2];
  if (NGR == 2) {
    scale_words(sp, rows16, NGR, w);
    _mm512_store_ps(ks, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(w[0])));
    _mm512_store_ps(ks + 16, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(w[0], 16))));
  } else if (NGR == 4) {
    scale_words(sp, rows16, NGR, w);
    for (int g = 0; g < 4; ++g) {
      const __m128i a = _mm512_cvtepi64_epi16(_mm512_srli_epi64(w[0], 16 * g));
      const __m128i b = _mm512_cvtepi64_epi16(_mm512_srli_epi64(w[1], 16 * g));
      _mm512_store_ps(ks + 16 * g, _mm512_cvtph_ps(_mm256_set_m128i(b, a)));
    }
  } else {
    for (int i = 0; i < 16; ++i)
      for (int64_t gi = 0; gi < NGR; ++gi) ks[gi * 16 + i] = half_to_float(sp + rows16[i] * NGR + gi);
  }
}

// V's scales of tokens 0 .. L (pool rows ``rows``) as fp32 times ``unit``, token-major
// (vs[t * NGR + gi]): with 2 or 4 a row, scale_words of 16 tokens are already their fp16
// values in vs's order.
inline void token_scales(const at::Half* sp, const int64_t* rows, int64_t L, int64_t NGR, float unit, float* vs) {
  int64_t t = 0;
  const __m512 u = _mm512_set1_ps(unit);
  if (NGR == 2 || NGR == 4) {
    for (; t + 16 <= L; t += 16) {
      __m512i w[2];
      // the scales ahead, each line once (a line holds several tokens': 4 at TinyLlama's 4 KV
      // heads and 2 scales a head): 1.04x for int8 attention (Zen 5, measured as
      // KV_PREFETCH_TOKENS says)
      for (int64_t j = t + KV_PREFETCH_TOKENS, line = -1; j < std::min<int64_t>(L, t + KV_PREFETCH_TOKENS + 16); ++j)
        if (const int64_t l = reinterpret_cast<intptr_t>(sp + rows[j] * NGR) >> 6; l != line)
          _mm_prefetch(reinterpret_cast<const char*>(sp + rows[j] * NGR), _MM_HINT_T0), line = l;
      scale_words(sp, rows + t, NGR, w);
      for (int64_t j = 0; j < NGR / 2; ++j) {
        _mm512_storeu_ps(vs + t * NGR + 32 * j, _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(w[j])), u));
        _mm512_storeu_ps(vs + t * NGR + 32 * j + 16, _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(w[j], 1)), u));
      }
    }
  }
  for (; t < L; ++t)
    for (int64_t gi = 0; gi < NGR; ++gi) vs[t * NGR + gi] = half_to_float(sp + rows[t] * NGR + gi) * unit;
}

// Scores of NG query heads (fp32 queries qf[g][D]) against 16 tokens of an fp8 K: per group
// of GS dims sum_d q[d] k_t[d] (two chains a head, even and odd dims), times the tokens' K
// scales of the group; then times 256 (fp8x16's unit) and the attention scale.
template <int NG>
inline void qk_fp8(const float* col, const float* qf, int64_t D, int64_t GS, const float* ks, __m512 unit_scale,
                   float* scores, int64_t L, int64_t n) {
  const int64_t NGR = D / GS;
  __m512 sacc[NG];
  for (int g = 0; g < NG; ++g) sacc[g] = _mm512_setzero_ps();
  for (int64_t gi = 0; gi < NGR; ++gi) {
    __m512 even[NG], odd[NG];
    for (int g = 0; g < NG; ++g) even[g] = odd[g] = _mm512_setzero_ps();
    for (int64_t d = gi * GS; d < (gi + 1) * GS; d += 2) {
      const __m512 k0 = _mm512_load_ps(col + d * 16), k1 = _mm512_load_ps(col + (d + 1) * 16);
      for (int g = 0; g < NG; ++g) {
        even[g] = _mm512_fmadd_ps(_mm512_set1_ps(qf[g * D + d]), k0, even[g]);
        odd[g] = _mm512_fmadd_ps(_mm512_set1_ps(qf[g * D + d + 1]), k1, odd[g]);
      }
    }
    const __m512 k_scale = _mm512_load_ps(ks + gi * 16);
    for (int g = 0; g < NG; ++g) sacc[g] = _mm512_fmadd_ps(_mm512_add_ps(even[g], odd[g]), k_scale, sacc[g]);
  }
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
  for (int g = 0; g < NG; ++g) _mm512_mask_storeu_ps(scores + g * L, valid, _mm512_mul_ps(sacc[g], unit_scale));
}

// Scores of NG query heads against 16 tokens of an int8 K (see the header): per group of GS
// dims, each head's int8 query sums over the group in int32 (started at -128 times its code
// sum, which takes the + 128 back out), scaled by the query's and the tokens' K scales of the
// group. QG: the group's quads of dims (GS / 4) where known when compiled (0: read from GS).
// Groups of 32 (every head size a multiple of 32) with 8 heads a pass: the group's loop
// unrolled and the query codes an embedded broadcast (dpbusd_x), each K column loaded once
// for 8 heads instead of twice for 4: the same integers and float ops, 1.03x for the whole
// attention with K in cache (2-core AMD EPYC, Zen 5).
template <int NG, int QG = 0>
inline void qk_int8(const __m512i* col, const int8_t* qq, const int32_t* qsum, const float* qf, int64_t D, int64_t GS,
                    const float* ks, float* scores, int64_t L, int64_t n) {
  const int64_t NGR = D / GS, quads = QG > 0 ? QG : GS / 4;
  __m512 sacc[NG];
  for (int g = 0; g < NG; ++g) sacc[g] = _mm512_setzero_ps();
  for (int64_t gi = 0; gi < NGR; ++gi) {
    __m512i acc[NG];
    for (int g = 0; g < NG; ++g) acc[g] = _mm512_set1_epi32(qsum[g * NGR + gi]);
#pragma GCC unroll 8
    for (int64_t p = gi * quads; p < (gi + 1) * quads; ++p) {
      const __m512i kv = _mm512_load_si512(col + p);
      for (int g = 0; g < NG; ++g) acc[g] = dpbusd_x(acc[g], kv, reinterpret_cast<const int32_t*>(qq + g * D + 4 * p));
    }
    const __m512 k_scale = _mm512_load_ps(ks + gi * 16);
    for (int g = 0; g < NG; ++g)
      sacc[g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[g]), _mm512_mul_ps(k_scale, _mm512_set1_ps(qf[g * NGR + gi])), sacc[g]);
  }
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
  for (int g = 0; g < NG; ++g) _mm512_mask_storeu_ps(scores + g * L, valid, sacc[g]);
}

// out[g][d0 : d0 + 16 dn] += sum_t p[g][t] * v_t[d0 : ...] over tokens [t0, t1), v_t the row's
// codes times its scale of each 16 dims' group (fp32 registers over the run, in token order;
// the scaling is shared by the NG heads)
template <int NG, int DN, bool FP8>
inline void pv_chunk(const uint8_t* vp, const int64_t* rows, int64_t t0, int64_t t1, int64_t D, int64_t d0,
                     const float* probs, int64_t L, const float* vscale, int64_t NGR, int64_t GS, float* out) {
  __m512 acc[NG][DN];
  int64_t group[DN];
  for (int j = 0; j < DN; ++j) group[j] = (d0 + 16 * j) / GS;
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < DN; ++j) acc[g][j] = _mm512_loadu_ps(out + g * D + 16 * j);
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* row = vp + rows[t] * D + d0;
    // blocks are scattered over the pool: fetch ahead (into L2, paged_rows.h), the hardware
    // prefetcher cannot
    if (t + KV_PREFETCH_TOKENS < L)
      _mm_prefetch(reinterpret_cast<const char*>(vp + rows[t + KV_PREFETCH_TOKENS] * D + d0), _MM_HINT_T1);
    __m512 v[DN];
    for (int j = 0; j < DN; ++j)
      v[j] = _mm512_mul_ps(FP8 ? fp8x16(row + 16 * j) : int8x16(row + 16 * j), _mm512_set1_ps(vscale[t * NGR + group[j]]));
    for (int g = 0; g < NG; ++g) {
      const __m512 w = _mm512_set1_ps(probs[g * L + t]);
      for (int j = 0; j < DN; ++j) acc[g][j] = _mm512_fmadd_ps(w, v[j], acc[g][j]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < DN; ++j) _mm512_storeu_ps(out + g * D + 16 * j, acc[g][j]);
}

// out[g] += sum over tokens [t0, t1) of p[g][t] v_t for a KV head's G query heads, a cut of
// heads and dims at a time (pv_cuts)
template <bool FP8>
void pv(int64_t G, const uint8_t* vp, const int64_t* rows, int64_t t0, int64_t t1, int64_t D, const float* probs,
        int64_t L, const float* vscale, int64_t NGR, int64_t GS, float* out) {
  pv_cuts(G, D, [&](auto heads, auto dims16, int64_t g0, int64_t d0) {
    constexpr int NG = decltype(heads)::value, DN = decltype(dims16)::value;
    pv_chunk<NG, DN, FP8>(vp, rows, t0, t1, D, d0, probs + g0 * L, L, vscale, NGR, GS, out + g0 * D + d0);
  });
}

template <typename T, bool FP8>
void attend(const T* qp, const uint8_t* kp, const uint8_t* vp, const at::Half* ksp, const at::Half* vsp,
            const int64_t* tp, const int64_t* lp, T* op, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t BS,
            int64_t max_blocks, int64_t NGR, float scale, int64_t q_stride) {
  const int64_t G = Hq / Hkv, GS = D / NGR;
  const float code_unit = FP8 ? FP8_CODE_UNIT : 1.f;
  // A job: a sequence and a run of HJ of its KV heads, whose rows and scales lie side by side
  // in the pool (paged_rows.h, kv_head_jobs): head h0 + j's row of a token is rows[t] + j, so
  // its pool pointers start j rows on. A job of one head fetches V into L2 during the scores'
  // pass, where its rows still lie at the PV pass; a job of several reads V in runs of
  // PV_TOKENS tokens (each run's rows of its heads in L1 for all of them) and fetches only as
  // the PV pass goes (with V's fetch in the scores' pass too: 0.90-1.00x, alternated). An fp8
  // cache keeps one head a job: its scores decode and transpose every K value in float, 6-10
  // GB/s where the rows' order hardly shows (grouped 0.95-1.07x, benchmarks/decode_attention.py).
  const int64_t split = FP8 ? Hkv : kv_head_jobs(B, Hkv, lp, Hkv * 2 * (D + 2 * NGR));
  const int64_t HJ = Hkv / split, HG = HJ * G;
  at::parallel_for(0, B * split, 1, [&](int64_t begin, int64_t end) {
    // the thread's buffers, kept from call to call (paged_rows.h's Scratch; every element is
    // written before it is read): the query in float, its int8 codes, their sums and scales,
    // K's columns, the scores, V's scales, the sums
    thread_local Scratch<float> qf_buf, qscale_buf, score_buf, vscale_buf, acc_buf;
    thread_local Scratch<int8_t> qq_buf;
    thread_local Scratch<int32_t> qsum_buf;
    thread_local Scratch<__m512i> col_buf;
    thread_local Scratch<__m512> colv_buf;  // fp8: [d][16 tokens] fp32
    float* qf = qf_buf.get(HG * D);
    float* qscale = qscale_buf.get(HG * NGR);
    float* acc = acc_buf.get(HG * D);
    int8_t* qq = qq_buf.get(HG * D);
    int32_t* qsum = qsum_buf.get(HG * NGR);
    __m512i* col = col_buf.get(FP8 ? 1 : D / 4);
    float* colf = reinterpret_cast<float*>(colv_buf.get(FP8 ? D : 1));
    std::vector<int64_t> rows;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / split, h0 = job % split * HJ, L = lp[b];
      paged_rows(tp + b * max_blocks, L, BS, Hkv, h0, rows);
      const int64_t first = std::min<int64_t>(L, KV_PREFETCH_TOKENS);  // the window before the loops' fetch
      prefetch_rows<_MM_HINT_T0>(kp, rows.data(), 0, first, D, HJ);
      prefetch_rows<_MM_HINT_T0>(ksp, rows.data(), 0, first, 2 * NGR, HJ);
      prefetch_rows<_MM_HINT_T1>(vp, rows.data(), 0, first, D, HJ);
      prefetch_rows<_MM_HINT_T1>(vsp, rows.data(), 0, first, 2 * NGR, HJ);
      for (int64_t i = 0; i < HG * D; ++i) qf[i] = static_cast<float>(qp[b * q_stride + h0 * G * D + i]);
      float* scores = score_buf.get(HG * L);  // every score is written below
      if constexpr (!FP8)
        for (int64_t g = 0; g < HG; ++g) quantize_query(qf + g * D, D, GS, scale, qq + g * D, qsum + g * NGR, qscale + g * NGR);
      const __m512 unit_scale = _mm512_set1_ps(code_unit * scale);
      const bool eight = !FP8 && GS == 32 && G % 8 == 0;  // int8 scores 8 heads a pass (see qk_int8)
      for (int64_t t0 = 0; t0 < L; t0 += 16) {
        const int64_t n = std::min<int64_t>(16, L - t0);
        alignas(64) int64_t rows16[16];
        alignas(64) float ks[16 * 64];  // [group][token], up to 64 groups
        for (int64_t i = 0; i < 16; ++i) rows16[i] = rows[t0 + std::min<int64_t>(i, n - 1)];  // tail lanes repeat a valid token
        // the rows (into L2: paged_rows.h) and scales of the chunk KV_PREFETCH_TOKENS ahead (the scales' gather waited on
        // memory: fetching them a chunk ahead measured 1.13x for int8 over 22 layers at 4,096
        // tokens, Xeon), and V's into L2 for the pass after the scores (int8, 2 Zen 5 cores,
        // alternated as prefetch_rows says, with its first window: 160 tokens 1.12x, 1,100
        // 1.08x, 1,900 1.035x; the bf16 kernel measured 0.95x with it at 1,900 and does not)
        const int64_t ahead_end = std::min<int64_t>(L, t0 + KV_PREFETCH_TOKENS + 16);
        const int64_t ahead = std::min<int64_t>(ahead_end, t0 + KV_PREFETCH_TOKENS);
        prefetch_rows<_MM_HINT_T1>(kp, rows.data(), ahead, ahead_end, D, HJ);
        prefetch_rows<_MM_HINT_T0>(ksp, rows.data(), ahead, ahead_end, 2 * NGR, HJ);
        if (HJ == 1) {
          prefetch_rows<_MM_HINT_T1>(vp, rows.data(), ahead, ahead_end, D, HJ);
          prefetch_rows<_MM_HINT_T1>(vsp, rows.data(), ahead, ahead_end, 2 * NGR, HJ);
        }
        for (int64_t j = 0; j < HJ; ++j) {
          token_scales16(ksp + j * NGR, rows16, NGR, ks);
          if constexpr (FP8)
            k_columns_fp8(kp + j * D, rows16, D, colf);
          else
            // 16 tokens' codes as vpdpbusd takes them: col[p] lane i holds token i's dims 4p .. 4p + 3, + 128
            row_columns(kp + j * D, rows16, D, _mm512_set1_epi32(static_cast<int32_t>(0x80808080u)), col);
          for (int64_t g0 = 0; g0 < G; g0 += eight ? 8 : 4) {
            float* s = &scores[(j * G + g0) * L + t0];
            if constexpr (FP8) {
              const float* q = qf + (j * G + g0) * D;
              switch (std::min<int64_t>(4, G - g0)) {
                case 1: qk_fp8<1>(colf, q, D, GS, ks, unit_scale, s, L, n); break;
                case 2: qk_fp8<2>(colf, q, D, GS, ks, unit_scale, s, L, n); break;
                case 3: qk_fp8<3>(colf, q, D, GS, ks, unit_scale, s, L, n); break;
                default: qk_fp8<4>(colf, q, D, GS, ks, unit_scale, s, L, n);
              }
            } else {
              const int8_t* q = qq + (j * G + g0) * D;
              const int32_t* qs = qsum + (j * G + g0) * NGR;
              const float* qfs = qscale + (j * G + g0) * NGR;
              if (eight)
                qk_int8<8, 8>(col, q, qs, qfs, D, GS, ks, s, L, n);
              else
                switch (std::min<int64_t>(4, G - g0)) {
                  case 1: qk_int8<1>(col, q, qs, qfs, D, GS, ks, s, L, n); break;
                  case 2: qk_int8<2>(col, q, qs, qfs, D, GS, ks, s, L, n); break;
                  case 3: qk_int8<3>(col, q, qs, qfs, D, GS, ks, s, L, n); break;
                  default: qk_int8<4>(col, q, qs, qfs, D, GS, ks, s, L, n);
                }
            }
          }
        }
      }
      for (int64_t g = 0; g < HG; ++g) ridge::softmax_row(&scores[g * L], L, false);
      // V's scales per (head, token, group), code units folded in
      float* vscale = vscale_buf.get(HJ * L * NGR);
      for (int64_t j = 0; j < HJ; ++j) token_scales(vsp + j * NGR, rows.data(), L, NGR, code_unit, vscale + j * L * NGR);
      std::fill(acc, acc + HG * D, 0.f);
      const int64_t run = HJ == 1 ? L : PV_TOKENS;
      for (int64_t t0 = 0; t0 < L; t0 += run) {
        const int64_t t1 = std::min<int64_t>(L, t0 + run);
        for (int64_t j = 0; j < HJ; ++j)
          pv<FP8>(G, vp + j * D, rows.data(), t0, t1, D, &scores[j * G * L], L, vscale + j * L * NGR, NGR, GS, acc + j * G * D);
      }
      for (int64_t i = 0; i < HG * D; ++i) op[(b * Hq + h0 * G) * D + i] = static_cast<T>(acc[i]);
    }
  });
}

}  // namespace

void paged_decode_attention_quant_into(const at::BFloat16* q, int64_t q_stride, int64_t B, int64_t Hq, int64_t D,
                                       const uint8_t* k_pool, const uint8_t* v_pool, const at::Half* k_scale,
                                       const at::Half* v_scale, int64_t BS, int64_t Hkv, int64_t groups,
                                       const int64_t* block_tables, int64_t max_blocks, const int64_t* context_lens,
                                       double scale, bool fp8, at::BFloat16* out) {
  const float s = static_cast<float>(scale);
  if (fp8)
    attend<bf16, true>(q, k_pool, v_pool, k_scale, v_scale, block_tables, context_lens, out, B, Hq, Hkv, D, BS, max_blocks,
                       groups, s, q_stride);
  else
    attend<bf16, false>(q, k_pool, v_pool, k_scale, v_scale, block_tables, context_lens, out, B, Hq, Hkv, D, BS,
                        max_blocks, groups, s, q_stride);
}

torch::Tensor paged_decode_attention_quant(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                           torch::Tensor k_scale, torch::Tensor v_scale, torch::Tensor block_tables,
                                           torch::Tensor context_lens, double scale, bool fp8) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(q.device().is_cpu() && (dtype == at::kFloat || dtype == at::kBFloat16),
              "decode_attention_quant: float32 or bfloat16 CPU q");
  TORCH_CHECK(k_cache.element_size() == 1 && v_cache.element_size() == 1 && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "decode_attention_quant: contiguous 1-byte caches expected");
  TORCH_CHECK(k_scale.scalar_type() == at::kHalf && v_scale.scalar_type() == at::kHalf && k_scale.is_contiguous() &&
                  v_scale.is_contiguous(),
              "decode_attention_quant: contiguous fp16 scales expected");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), BS = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && Hq % Hkv == 0 && D % 16 == 0,
              "decode_attention_quant: head sizes do not match the cache (head_dim a multiple of 16)");
  const int64_t NGR = k_scale.size(-1);
  TORCH_CHECK(k_scale.dim() == 4 && v_scale.size(-1) == NGR && D % NGR == 0 && (D / NGR) % 16 == 0 && D / NGR <= 2048 && NGR <= 64,
              "decode_attention_quant: scales (blocks, block_size, Hkv, groups) with groups of 16k dims, at most 512");
  TORCH_CHECK(k_cache.numel() / 4 < (int64_t{1} << 31), "decode_attention_quant: cache too large for 32-bit gathers");
  auto qc = q.contiguous();
  auto tables = block_tables.to(at::kLong).contiguous();
  auto lens = context_lens.to(at::kLong).contiguous();
  auto out = torch::empty_like(qc);
  const auto* kp = static_cast<const uint8_t*>(k_cache.data_ptr());
  const auto* vp = static_cast<const uint8_t*>(v_cache.data_ptr());
  const auto* ksp = k_scale.data_ptr<at::Half>();
  const auto* vsp = v_scale.data_ptr<at::Half>();
  const float s = static_cast<float>(scale);
  const int64_t mb = tables.size(1);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  if (dtype == at::kFloat) {
    if (fp8)
      attend<float, true>(qc.data_ptr<float>(), kp, vp, ksp, vsp, tp, lp, out.data_ptr<float>(), B, Hq, Hkv, D, BS, mb, NGR, s, Hq * D);
    else
      attend<float, false>(qc.data_ptr<float>(), kp, vp, ksp, vsp, tp, lp, out.data_ptr<float>(), B, Hq, Hkv, D, BS, mb, NGR, s, Hq * D);
  } else {
    if (fp8)
      attend<bf16, true>(qc.data_ptr<bf16>(), kp, vp, ksp, vsp, tp, lp, out.data_ptr<bf16>(), B, Hq, Hkv, D, BS, mb, NGR, s, Hq * D);
    else
      attend<bf16, false>(qc.data_ptr<bf16>(), kp, vp, ksp, vsp, tp, lp, out.data_ptr<bf16>(), B, Hq, Hkv, D, BS, mb, NGR, s, Hq * D);
  }
  return out;
}
