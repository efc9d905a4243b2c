// Paged decode attention over an int8 or fp8 (e4m3) KV cache: codes and per-(token, KV head)
// fp16 scales read straight from the pool (kv/cache.py), dequantized in registers.
//
//   token t of sequence b  ->  slot = block_tables[b][t / BS] * BS + t % BS
//   k_cache[slot][h][:] codes (D bytes), k_scale[slot][h] (fp16)
//
// Scores over an int8 K use integer dot products: each query head is quantized to int8
// (scale amax / 127, as llama.cpp quantizes Q against a q8_0 cache), and vpdpbusd adds four
// products of 16 tokens at once (the unsigned side is K's code + 128, taken back out with
// the query's code sum):
//
//   q.k_t = sq * sk_t * (sum_d (k_d + 128) q_d  -  128 sum_d q_d)
//
// An fp8 K is dequantized row by row. V of either kind: p_t * sv_t weights the row's codes,
// accumulated in fp32 registers. Work is split over (sequence, KV head) as in decode_ops.cpp.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "paged_rows.h"

namespace ridge {
void softmax_row(float* scores, int64_t L, bool round_to_bf16);
}

namespace {

using bf16 = at::BFloat16;

// 16 fp8 e4m3 codes -> 16 fp32 values / 256: e4m3's bits placed in an fp16 (sign to bit 15,
// exponent and mantissa to bits 7-13) read as the same number divided by 2^8, subnormals too.
inline __m512 fp8x16(const uint8_t* p) {
  const __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i mag = _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7F)), 7);
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x80)), 8);
  return _mm512_cvtph_ps(_mm256_or_si256(mag, sign));
}

inline __m512 int8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

inline float half_to_float(const at::Half* p) { return _cvtsh_ss(*reinterpret_cast<const uint16_t*>(p)); }

// Scores of up to 8 query heads against 16 tokens of an int8 K (see the header).
template <int NG>
inline void qk_int8_chunk(const int32_t* k32, __m512i base, const int32_t* qq, const float* qscale,
                          const int32_t* qsum, int64_t DQ, const float* kscale16, float* scores, int64_t L,
                          int64_t n) {
  __m512i acc[NG];
  for (int g = 0; g < NG; ++g) acc[g] = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi32(static_cast<int32_t>(0x80808080u));
  for (int64_t p = 0; p < DQ; ++p) {
    const __m512i kv = _mm512_xor_si512(_mm512_i32gather_epi32(_mm512_add_epi32(base, _mm512_set1_epi32(p)), k32, 4), flip);
    for (int g = 0; g < NG; ++g) acc[g] = _mm512_dpbusd_epi32(acc[g], kv, _mm512_set1_epi32(qq[g * DQ + p]));
  }
  const __m512 ks = _mm512_load_ps(kscale16);
  for (int g = 0; g < NG; ++g) {
    const __m512i centered = _mm512_sub_epi32(acc[g], _mm512_set1_epi32(128 * qsum[g]));
    const __m512 s = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(centered), ks), _mm512_set1_ps(qscale[g]));
    alignas(64) float buf[16];
    _mm512_store_ps(buf, s);
    std::memcpy(scores + g * L, buf, n * sizeof(float));
  }
}

// 16 rows of 16 int32 -> 16 columns (c[j] lane i = r[i] lane j), in 4 shuffle stages.
inline void transpose16(const __m512i r[16], __m512i c[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // u[4i + m], 128-bit lane L: rows 4i .. 4i+3 at column 4L + m
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int m = 0; m < 4; ++m) {
    const __m512i x = _mm512_shuffle_i32x4(u[m], u[4 + m], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512i y = _mm512_shuffle_i32x4(u[m], u[4 + m], _MM_SHUFFLE(3, 1, 3, 1));
    const __m512i x2 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512i y2 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], _MM_SHUFFLE(3, 1, 3, 1));
    c[m] = _mm512_shuffle_i32x4(x, x2, _MM_SHUFFLE(2, 0, 2, 0));
    c[8 + m] = _mm512_shuffle_i32x4(x, x2, _MM_SHUFFLE(3, 1, 3, 1));
    c[4 + m] = _mm512_shuffle_i32x4(y, y2, _MM_SHUFFLE(2, 0, 2, 0));
    c[12 + m] = _mm512_shuffle_i32x4(y, y2, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// The same scores as qk_int8_chunk for head sizes of 64k: the 16 tokens' rows are loaded
// whole (a 64-byte row chunk is one load) and transposed in registers, no gathers (slow
// here: gathers cost far more than the rows they read).
template <int NG>
inline void qk_int8_rows(const uint8_t* kp, const int64_t* rows16, const int32_t* qq, const float* qscale,
                         const int32_t* qsum, int64_t D, const float* kscale16, float* scores, int64_t L, int64_t n) {
  const int64_t DQ = D / 4;
  __m512i acc[NG];
  for (int g = 0; g < NG; ++g) acc[g] = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi32(static_cast<int32_t>(0x80808080u));
  for (int64_t c0 = 0; c0 < D; c0 += 64) {
    __m512i r[16], col[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(kp + rows16[i] * D + c0);
    transpose16(r, col);
    for (int j = 0; j < 16; ++j) {
      const __m512i kv = _mm512_xor_si512(col[j], flip);
      const int64_t p = c0 / 4 + j;
      for (int g = 0; g < NG; ++g) acc[g] = _mm512_dpbusd_epi32(acc[g], kv, _mm512_set1_epi32(qq[g * DQ + p]));
    }
  }
  const __m512 ks = _mm512_load_ps(kscale16);
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
  for (int g = 0; g < NG; ++g) {
    const __m512i centered = _mm512_sub_epi32(acc[g], _mm512_set1_epi32(128 * qsum[g]));
    const __m512 s = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(centered), ks), _mm512_set1_ps(qscale[g]));
    _mm512_mask_storeu_ps(scores + g * L, valid, s);
  }
}

// out[g][d0 : d0 + 16 dn] += sum_t w[g][t] * v_t[d0 : ...], w = p * sv (fp32 registers)
template <int NG, int DN, bool FP8>
inline void pv_chunk(const uint8_t* vp, const int64_t* rows, int64_t D, int64_t d0, const float* weights, int64_t L,
                     float* out) {
  __m512 acc[NG][DN];
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < DN; ++j) acc[g][j] = _mm512_setzero_ps();
  for (int64_t t = 0; t < L; ++t) {
    const uint8_t* row = vp + rows[t] * D + d0;
    // blocks are scattered over the pool: fetch a block ahead, the hardware prefetcher cannot
    if (t + 16 < L) _mm_prefetch(reinterpret_cast<const char*>(vp + rows[t + 16] * D + d0), _MM_HINT_T0);
    __m512 v[DN];
    for (int j = 0; j < DN; ++j) v[j] = FP8 ? fp8x16(row + 16 * j) : int8x16(row + 16 * j);
    for (int g = 0; g < NG; ++g) {
      const __m512 w = _mm512_set1_ps(weights[g * L + t]);
      for (int j = 0; j < DN; ++j) acc[g][j] = _mm512_fmadd_ps(w, v[j], acc[g][j]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < DN; ++j) _mm512_storeu_ps(out + g * D + 16 * j, acc[g][j]);
}

template <int NG, bool FP8>
inline void pv_any_dn(int64_t dn, const uint8_t* vp, const int64_t* rows, int64_t D, int64_t d0, const float* w,
                      int64_t L, float* out) {
  switch (dn) {
    case 1: return pv_chunk<NG, 1, FP8>(vp, rows, D, d0, w, L, out);
    case 2: return pv_chunk<NG, 2, FP8>(vp, rows, D, d0, w, L, out);
    case 3: return pv_chunk<NG, 3, FP8>(vp, rows, D, d0, w, L, out);
    default: return pv_chunk<NG, 4, FP8>(vp, rows, D, d0, w, L, out);
  }
}

template <bool FP8>
void pv(int64_t G, const uint8_t* vp, const int64_t* rows, int64_t D, const float* weights, int64_t L, float* out) {
  for (int64_t g0 = 0; g0 < G; g0 += 4)
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      const int64_t dn = std::min<int64_t>(4, (D - d0) / 16);
      const float* w = weights + g0 * L;
      float* o = out + g0 * D + d0;
      switch (std::min<int64_t>(4, G - g0)) {
        case 1: pv_any_dn<1, FP8>(dn, vp, rows, D, d0, w, L, o); break;
        case 2: pv_any_dn<2, FP8>(dn, vp, rows, D, d0, w, L, o); break;
        case 3: pv_any_dn<3, FP8>(dn, vp, rows, D, d0, w, L, o); break;
        default: pv_any_dn<4, FP8>(dn, vp, rows, D, d0, w, L, o);
      }
    }
}

template <typename T, bool FP8>
void attend(const T* qp, const uint8_t* kp, const uint8_t* vp, const at::Half* ksp, const at::Half* vsp,
            const int64_t* tp, const int64_t* lp, T* op, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t BS,
            int64_t max_blocks, float scale) {
  const int64_t G = Hq / Hkv, DQ = D / 4;
  const float code_unit = FP8 ? 256.f : 1.f;  // fp8x16 yields value / 256
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), qscale(G), scores, weights, vscale, acc(G * D);
    std::vector<int32_t> qq(G * DQ), qsum(G);
    std::vector<int64_t> rows;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / Hkv, h = job % Hkv, L = lp[b];
      paged_rows(tp + b * max_blocks, L, BS, Hkv, h, rows);
      for (int64_t i = 0; i < G * D; ++i) qf[i] = static_cast<float>(qp[(b * Hq + h * G) * D + i]);
      scores.assign(G * L, 0.f);
      if constexpr (!FP8) {
        // each query head to int8 codes, 4 per int32
        for (int64_t g = 0; g < G; ++g) {
          float amax = 0.f;
          for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(qf[g * D + d]));
          const float s = amax / 127.f, inv = amax > 0 ? 127.f / amax : 0.f;
          int32_t total = 0;
          auto* codes = reinterpret_cast<int8_t*>(qq.data() + g * DQ);
          for (int64_t d = 0; d < D; ++d) {
            const int32_t c = static_cast<int32_t>(std::nearbyint(qf[g * D + d] * inv));
            codes[d] = static_cast<int8_t>(c);
            total += c;
          }
          qscale[g] = s * scale;
          qsum[g] = total;
        }
        const int32_t* k32 = reinterpret_cast<const int32_t*>(kp);
        for (int64_t t0 = 0; t0 < L; t0 += 16) {
          const int64_t n = std::min<int64_t>(16, L - t0);
          alignas(64) int32_t base[16];
          alignas(64) int64_t rows16[16];
          alignas(64) float ks[16];
          for (int64_t i = 0; i < 16; ++i) {
            const int64_t row = rows[t0 + std::min<int64_t>(i, n - 1)];  // tail lanes repeat a valid token
            rows16[i] = row;
            base[i] = static_cast<int32_t>(row * DQ);
            ks[i] = half_to_float(ksp + row);
          }
          const __m512i vbase = _mm512_load_si512(base);
          for (int64_t i = t0 + 16; i < std::min<int64_t>(L, t0 + 32); ++i)  // the next chunk's rows
            for (int64_t c = 0; c < D; c += 64) _mm_prefetch(reinterpret_cast<const char*>(kp + rows[i] * D + c), _MM_HINT_T0);
          for (int64_t g0 = 0; g0 < G; g0 += 8) {
            const int32_t* q = qq.data() + g0 * DQ;
            float* s = &scores[g0 * L + t0];
            const int64_t ng = std::min<int64_t>(8, G - g0);
            if (D % 64 == 0) {
              switch (ng) {
                case 1: qk_int8_rows<1>(kp, rows16, q, &qscale[g0], &qsum[g0], D, ks, s, L, n); break;
                case 2: qk_int8_rows<2>(kp, rows16, q, &qscale[g0], &qsum[g0], D, ks, s, L, n); break;
                case 3: qk_int8_rows<3>(kp, rows16, q, &qscale[g0], &qsum[g0], D, ks, s, L, n); break;
                case 4: qk_int8_rows<4>(kp, rows16, q, &qscale[g0], &qsum[g0], D, ks, s, L, n); break;
                case 5: qk_int8_rows<5>(kp, rows16, q, &qscale[g0], &qsum[g0], D, ks, s, L, n); break;
                case 6: qk_int8_rows<6>(kp, rows16, q, &qscale[g0], &qsum[g0], D, ks, s, L, n); break;
                case 7: qk_int8_rows<7>(kp, rows16, q, &qscale[g0], &qsum[g0], D, ks, s, L, n); break;
                default: qk_int8_rows<8>(kp, rows16, q, &qscale[g0], &qsum[g0], D, ks, s, L, n);
              }
              continue;
            }
            switch (ng) {
              case 1: qk_int8_chunk<1>(k32, vbase, q, &qscale[g0], &qsum[g0], DQ, ks, s, L, n); break;
              case 2: qk_int8_chunk<2>(k32, vbase, q, &qscale[g0], &qsum[g0], DQ, ks, s, L, n); break;
              case 3: qk_int8_chunk<3>(k32, vbase, q, &qscale[g0], &qsum[g0], DQ, ks, s, L, n); break;
              case 4: qk_int8_chunk<4>(k32, vbase, q, &qscale[g0], &qsum[g0], DQ, ks, s, L, n); break;
              case 5: qk_int8_chunk<5>(k32, vbase, q, &qscale[g0], &qsum[g0], DQ, ks, s, L, n); break;
              case 6: qk_int8_chunk<6>(k32, vbase, q, &qscale[g0], &qsum[g0], DQ, ks, s, L, n); break;
              case 7: qk_int8_chunk<7>(k32, vbase, q, &qscale[g0], &qsum[g0], DQ, ks, s, L, n); break;
              default: qk_int8_chunk<8>(k32, vbase, q, &qscale[g0], &qsum[g0], DQ, ks, s, L, n);
            }
          }
        }
      } else {
        for (int64_t t = 0; t < L; ++t) {
          const int64_t row = rows[t];
          const float ks = half_to_float(ksp + row) * code_unit * scale;
          const uint8_t* krow = kp + row * D;
          for (int64_t g = 0; g < G; ++g) {
            __m512 dot = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d += 16)
              dot = _mm512_fmadd_ps(fp8x16(krow + d), _mm512_loadu_ps(&qf[g * D + d]), dot);
            scores[g * L + t] = _mm512_reduce_add_ps(dot) * ks;
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) ridge::softmax_row(&scores[g * L], L, false);
      // weights = p * (V's scale), so the value rows are used as stored codes
      vscale.resize(L);
      for (int64_t t = 0; t < L; ++t) vscale[t] = half_to_float(vsp + rows[t]) * code_unit;
      weights.resize(G * L);
      for (int64_t g = 0; g < G; ++g)  // row by row: the (t, g) order strides L floats a step
        for (int64_t t = 0; t < L; ++t) weights[g * L + t] = scores[g * L + t] * vscale[t];
      pv<FP8>(G, vp, rows.data(), D, weights.data(), L, acc.data());
      for (int64_t i = 0; i < G * D; ++i) op[(b * Hq + h * G) * D + i] = static_cast<T>(acc[i]);
    }
  });
}

}  // namespace

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
      attend<float, true>(qc.data_ptr<float>(), kp, vp, ksp, vsp, tp, lp, out.data_ptr<float>(), B, Hq, Hkv, D, BS, mb, s);
    else
      attend<float, false>(qc.data_ptr<float>(), kp, vp, ksp, vsp, tp, lp, out.data_ptr<float>(), B, Hq, Hkv, D, BS, mb, s);
  } else {
    if (fp8)
      attend<bf16, true>(qc.data_ptr<bf16>(), kp, vp, ksp, vsp, tp, lp, out.data_ptr<bf16>(), B, Hq, Hkv, D, BS, mb, s);
    else
      attend<bf16, false>(qc.data_ptr<bf16>(), kp, vp, ksp, vsp, tp, lp, out.data_ptr<bf16>(), B, Hq, Hkv, D, BS, mb, s);
  }
  return out;
}
