// The small ops of a decode step for CPUs with AVX2 but without AVX-512 (Avx2Kernels), float32
// or bfloat16: RMSNorm (with the residual add), SiLU-and-multiply, rotate-half RoPE in place,
// decode attention straight from the paged KV cache, and an MoE's routing and weighted sum.
// Each is one call where torch's path runs several ops (and attention a gathered copy of the
// context, two batched matmuls, a mask and a softmax). Measured on a 2-core Zen 3 EPYC, the
// random TinyLlama-1.1B's Q4_K_M file at batch 1: these ops took ~30 ms of a 91 ms decode step
// through torch.
//
// Roundings follow torch's path: in bf16 every product and sum torch rounds is rounded here
// (as decode_ops.cpp does for the AVX-512 kernels), so the two agree up to the order of fp32
// sums; in float32 the same ops in the same order, sums excepted.
//
//   token t of sequence b  ->  block_tables[b][t / BS], slot t % BS
//   k_cache[block][slot][kv_head][:]   (no gathered copy of the context)
//
// Attention's work is split over (sequence, KV head), or past a long context over a sequence's
// runs of KV heads (attend): the G = Hq / Hkv query heads of a group share each K/V row read.
// Scores go 8 K rows at a time (their values made once, each head's 8 dots summed across lanes
// together) and V a run of 32 rows at a time (its lines stay in L1 across the head's D / 8
// chunks): 1.04-1.2x (bf16) and 1.17-1.3x (int8) the kernel's speed row by row at 4,096
// tokens, 32 heads on 4, head 64, Zen 3 (2026-11-29, 3 rounds). An int8
// cache's scores are integer dot products against an int8 query (score_heads_int8: the
// AVX-512 kernel's formula, not torch's path), and its V scales are folded into the
// probabilities: 1.17-1.34x the float path over the same codes (2 Zen 3 cores, 2026-12-02,
// 512-4,096 tokens at batch 1 and 16, alternated in one process), 1.18-1.31x bf16 attention
// where the context comes from memory.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "avx2_kernels.h"
#include "avx2_simd.h"
#include "kv_query.h"
#include "paged_rows.h"
#include "plan_shared.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using ridge_avx2::hsum;
using ridge_avx2::load8;

using bf16 = at::BFloat16;

// fp32 -> the top 16 bits of its bf16 rounding (to nearest even; a NaN stays a quiet NaN),
// as c10::BFloat16 rounds
inline __m256i bf16_bits(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
}

// fp32 rounded to bf16 precision, staying fp32 (torch's bf16 ops round every result)
inline __m256 round8(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16)); }

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(bf16* p, __m256 v) {
  const __m256i b = bf16_bits(v);  // each lane <= 0xffff: the unsigned pack is exact
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

template <typename T>
constexpr bool kBf16 = std::is_same_v<T, bf16>;

// round where torch's op in T rounds (bf16), not in float32
template <typename T>
inline __m256 round_as(__m256 v) {
  return kBf16<T> ? round8(v) : v;
}
template <typename T>
inline float round_as(float v) {
  return kBf16<T> ? static_cast<float>(bf16(v)) : v;
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x for 8 lanes: Cephes' expf polynomial on x - n ln2, times 2^n built in the exponent bits
// (rel. error ~1e-7). Below ln(FLT_MIN) it is 0, not a subnormal (simd_math.h's exp512 says
// why: a multiply-add reading a subnormal takes a microcode assist); above 88 it is e^88.
inline __m256 exp256(__m256 x) {
  const __m256 normal = _mm256_cmp_ps(x, _mm256_set1_ps(-87.33654475f), _CMP_GE_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.33654475f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500E-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(two_n)), normal);
}

// softmax of one row of scores in place (fp32), probabilities rounded where torch's are (bf16)
template <typename T>
void softmax_row(float* s, int64_t L) {
  __m256 mx8 = _mm256_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 8 <= L; t += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(s + t));
  float mx = hmax(mx8);
  for (; t < L; ++t) mx = std::max(mx, s[t]);
  __m256 sum8 = _mm256_setzero_ps();
  for (t = 0; t + 8 <= L; t += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(mx)));
    _mm256_storeu_ps(s + t, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  float total = hsum(sum8);
  for (; t < L; ++t) total += (s[t] = std::exp(s[t] - mx));
  const float inv = 1.f / total;
  for (t = 0; t + 8 <= L; t += 8) _mm256_storeu_ps(s + t, round_as<T>(_mm256_mul_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(inv))));
  for (; t < L; ++t) s[t] = round_as<T>(s[t] * inv);
}

// y = w * T(x * rsqrt(mean(x^2) + eps)), rounded to T (Hugging Face's RMSNorm)
template <typename T>
void rms_row(const T* x, const T* w, T* y, int64_t n, float eps) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load8(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float ss = hsum(acc);
  for (; i < n; ++i) ss += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  const __m256 inv8 = _mm256_set1_ps(inv);
  for (i = 0; i + 8 <= n; i += 8) store8(y + i, _mm256_mul_ps(load8(w + i), round_as<T>(_mm256_mul_ps(load8(x + i), inv8))));
  for (; i < n; ++i) y[i] = static_cast<T>(static_cast<float>(w[i]) * round_as<T>(static_cast<float>(x[i]) * inv));
}

template <typename T>
void add_row(T* res, const T* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(res + i, _mm256_add_ps(load8(res + i), load8(x + i)));
  for (; i < n; ++i) res[i] = static_cast<T>(static_cast<float>(res[i]) + static_cast<float>(x[i]));
}

void check_input(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16), name,
              ": float32 or bfloat16 CPU tensor expected");
}

template <class Fn>
void with_dtype(at::ScalarType dtype, Fn&& fn) {
  if (dtype == at::kFloat)
    fn(float{});
  else
    fn(bf16{});
}

}  // namespace

namespace ridge_avx2 {

template <class T>
void rms_norm_into(const T* x, const T* w, T* y, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) rms_row(x + r * n, w, y + r * n, n, eps);
  });
}

template <class T>
void add_rms_norm_into(const T* x, T* residual, const T* w, T* y, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      add_row(residual + r * n, x + r * n, n);
      rms_row(residual + r * n, w, y + r * n, n, eps);
    }
  });
}

// silu(gate) * up: silu in fp32 and rounded to T, times up, rounded again (torch's F.silu(gate) * up)
template <class T>
void silu_mul_into(const T* gate_up, int64_t rows, int64_t I, T* y) {
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* gate = gate_up + r * 2 * I;
      const T* up = gate + I;
      T* out = y + r * I;
      int64_t i = 0;
      for (; i + 8 <= I; i += 8) {
        const __m256 gv = load8(gate + i);
        const __m256 act = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
        store8(out + i, _mm256_mul_ps(round_as<T>(act), load8(up + i)));
      }
      for (; i < I; ++i) {
        const float gv = gate[i];
        out[i] = static_cast<T>(round_as<T>(gv / (1.f + std::exp(-gv))) * static_cast<float>(up[i]));
      }
    }
  });
}

// Rotate-half RoPE in place: cos/sin fp32 tables (positions, D), rounded to T first (torch's
// tables in x's dtype). Each product and the sum rounded as torch's ops round them.
template <class T>
void rope_into(T* x, int64_t rows, int64_t H, int64_t D, int64_t row_stride, const int64_t* pp, const float* cp,
               const float* sp) {
  const int64_t half = D / 2;
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    std::vector<float> cr(D), sr(D);
    for (int64_t t = b; t < e; ++t) {
      for (int64_t i = 0; i < D; i += 8) {
        _mm256_storeu_ps(cr.data() + i, round_as<T>(_mm256_loadu_ps(cp + pp[t] * D + i)));
        _mm256_storeu_ps(sr.data() + i, round_as<T>(_mm256_loadu_ps(sp + pp[t] * D + i)));
      }
      for (int64_t h = 0; h < H; ++h) {
        T* v = x + t * row_stride + h * D;
        for (int64_t i = 0; i < half; i += 8) {
          const __m256 x1 = load8(v + i), x2 = load8(v + half + i);
          const __m256 c1 = _mm256_loadu_ps(cr.data() + i), s1 = _mm256_loadu_ps(sr.data() + i);
          const __m256 c2 = _mm256_loadu_ps(cr.data() + half + i), s2 = _mm256_loadu_ps(sr.data() + half + i);
          // torch: x * cos + cat(-x2, x1) * sin
          const __m256 y1 = _mm256_add_ps(round_as<T>(_mm256_mul_ps(x1, c1)),
                                          round_as<T>(_mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), x2), s1)));
          const __m256 y2 = _mm256_add_ps(round_as<T>(_mm256_mul_ps(x2, c2)), round_as<T>(_mm256_mul_ps(x1, s2)));
          store8(v + i, y1);
          store8(v + half + i, y2);
        }
      }
    }
  });
}

}  // namespace ridge_avx2

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_input(x, "rms_norm");
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.is_contiguous() && w.numel() == x.size(-1),
              "rms_norm: a contiguous weight of x's dtype and last size expected");
  const int64_t n = x.size(-1);
  auto xc = x.contiguous();
  auto y = torch::empty_like(xc);
  with_dtype(x.scalar_type(), [&](auto t) {
    using T = decltype(t);
    ridge_avx2::rms_norm_into(xc.data_ptr<T>(), w.data_ptr<T>(), y.data_ptr<T>(), xc.numel() / n, n,
                              static_cast<float>(eps));
  });
  return y;
}

torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  check_input(x, "add_rms_norm");
  TORCH_CHECK(residual.scalar_type() == x.scalar_type() && residual.is_contiguous() && x.sizes() == residual.sizes(),
              "add_rms_norm: a contiguous residual of x's dtype and shape expected");
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.is_contiguous() && w.numel() == x.size(-1),
              "add_rms_norm: a contiguous weight of x's dtype and last size expected");
  const int64_t n = x.size(-1);
  auto xc = x.contiguous();
  auto y = torch::empty_like(residual);
  with_dtype(x.scalar_type(), [&](auto t) {
    using T = decltype(t);
    ridge_avx2::add_rms_norm_into(xc.data_ptr<T>(), residual.data_ptr<T>(), w.data_ptr<T>(), y.data_ptr<T>(),
                                  xc.numel() / n, n, static_cast<float>(eps));
  });
  return y;
}

// silu(gate) * up for (..., 2I) -> (..., I)
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_input(gate_up, "silu_mul");
  auto g = gate_up.contiguous();
  const int64_t I = g.size(-1) / 2, rows = g.numel() / std::max<int64_t>(1, 2 * I);
  auto shape = g.sizes().vec();
  shape.back() = I;
  auto y = torch::empty(shape, g.options());
  with_dtype(g.scalar_type(), [&](auto t) {
    using T = decltype(t);
    ridge_avx2::silu_mul_into(g.data_ptr<T>(), rows, I, y.data_ptr<T>());
  });
  return y;
}

// Rotate-half RoPE in place: x (T, H, D), unit stride in D and heads D apart (rows may be
// strided: a view into qkv); cos/sin fp32 tables (positions, D), rounded to T first (torch's
// tables in x's dtype). Each product and the sum rounded as torch's ops round them.
void rope_(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin) {
  check_input(x, "rope");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) && x.size(2) % 16 == 0,
              "rope: (T, H, D) rows with D a multiple of 16 expected");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.size(-1) == x.size(2),
              "rope: float32 (positions, D) cos and sin tables expected");
  auto pos = positions.to(at::kLong).contiguous();
  const int64_t T_ = x.size(0), H = x.size(1), D = x.size(2), row_stride = x.stride(0);
  const int64_t* pp = pos.data_ptr<int64_t>();
  TORCH_CHECK(pos.numel() == T_, "rope: one position a row expected");
  ridge_shared::check_positions("rope", T_, pp, cos.size(0));
  with_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    ridge_avx2::rope_into(x.data_ptr<T>(), T_, H, D, row_stride, pp, cos.data_ptr<float>(), sin.data_ptr<float>());
  });
}

// RoPE and the KV write in one call: qkv (T, (Hq + 2 Hkv) D), unit stride in its rows, has its
// q and k heads rotated in place (rope_), then each token's k and v heads copied into the
// pools (blocks, BS, Hkv, D), of qkv's dtype, at its flat slot (index_copy_'s writes, without
// its dispatch: two of them cost 70 us a layer, Zen 3).
void rope_write_kv_(torch::Tensor qkv, int64_t num_heads, int64_t num_kv_heads, torch::Tensor positions,
                    torch::Tensor cos, torch::Tensor sin, torch::Tensor k_pool, torch::Tensor v_pool,
                    torch::Tensor slots) {
  check_input(qkv, "rope_write_kv");
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes() && k_pool.is_contiguous() &&
                  v_pool.is_contiguous() && k_pool.scalar_type() == qkv.scalar_type() &&
                  v_pool.scalar_type() == qkv.scalar_type(),
              "rope_write_kv: contiguous (blocks, BS, Hkv, D) pools of qkv's dtype expected");
  const int64_t T_ = qkv.size(0), D = k_pool.size(3), Hq = num_heads, Hkv = num_kv_heads;
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (Hq + 2 * Hkv) * D && k_pool.size(2) == Hkv,
              "rope_write_kv: qkv (T, (Hq + 2 Hkv) D) with the pools' head size expected");
  auto sl = slots.to(at::kLong).contiguous();
  TORCH_CHECK(sl.numel() == T_, "rope_write_kv: one slot a token expected");
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t capacity = k_pool.size(0) * k_pool.size(1);
  for (int64_t t = 0; t < T_; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < capacity, "rope_write_kv: slot ", sp[t], " is outside the pool");
  rope_(qkv.narrow(1, 0, (Hq + Hkv) * D).view({T_, Hq + Hkv, D}), positions, cos, sin);
  const int64_t row = Hkv * D * static_cast<int64_t>(qkv.element_size());  // bytes of a token's k (or v)
  const auto* src = static_cast<const uint8_t*>(qkv.data_ptr());
  auto *kp = static_cast<uint8_t*>(k_pool.data_ptr()), *vp = static_cast<uint8_t*>(v_pool.data_ptr());
  const int64_t stride = qkv.stride(0) * static_cast<int64_t>(qkv.element_size()), k_at = Hq * D * qkv.element_size();
  for (int64_t t = 0; t < T_; ++t) {
    std::memcpy(kp + sp[t] * row, src + t * stride + k_at, row);
    std::memcpy(vp + sp[t] * row, src + t * stride + k_at + row, row);
  }
}

namespace {

// A KV head's rows of the context, 8 values at a time: rows[t] then load(row, d); fetch(t0, t1,
// D) asks for rows [t0, t1) into L1 (all of each row's lines)
template <typename T>
struct PlainRows {  // a cache in T
  static constexpr bool INT8_QUERY = false;
  static constexpr int64_t G = 1;  // no scales
  std::vector<const T*> rows;
  void like(const PlainRows&) {}  // nothing but the rows
  void resize(int64_t L) {  // grown only (a thread's rows are kept from call to call: attend)
    if (static_cast<int64_t>(rows.size()) < L) rows.resize(L);
  }
  void fetch(int64_t t0, int64_t t1, int64_t D) const {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t c = 0; c < D * static_cast<int64_t>(sizeof(T)); c += 64)
        _mm_prefetch(reinterpret_cast<const char*>(rows[t]) + c, _MM_HINT_T0);
  }
  static __m256 load(const T* r, int64_t d) { return load8(r + d); }
};

// A cache of codes, int8 or e4m3, under one fp16 scale per group of dims: kv/cache.py's
// dequantize (codes times the scale in float32, rounded to T), 8 values at a time. That is how
// score_heads and weigh_values read an e4m3 cache; an int8 cache's rows go to
// score_heads_int8 and weigh_values_int8 instead (the AVX-512 kernel's formula).
template <typename T, bool FP8>
struct CodeRows {
  static constexpr bool INT8_QUERY = !FP8;
  struct Row {
    const uint8_t* codes;
    const float* scales;  // the row's group scales in float32 (an e4m3 row's times 256)
  };
  std::vector<Row> rows;
  std::vector<float> scales;  // L rows of G
  int64_t G = 1, shift = 63;  // dim d's group: d >> shift (groups of 32, or one)
  void like(const CodeRows& proto) { G = proto.G, shift = proto.shift; }  // the cache's groups
  void resize(int64_t L) {  // grown only (a thread's rows are kept from call to call: attend)
    if (static_cast<int64_t>(rows.size()) < L) rows.resize(L);
    if (static_cast<int64_t>(scales.size()) < L * G) scales.resize(L * G);
  }
  void fetch(int64_t t0, int64_t t1, int64_t D) const {  // the codes (the scales are read at set)
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t c = 0; c < D; c += 64) _mm_prefetch(reinterpret_cast<const char*>(rows[t].codes) + c, _MM_HINT_T0);
  }
  // row t's codes and its G fp16 scales
  void set(int64_t t, const uint8_t* codes, const at::Half* sc) {
    float* f = scales.data() + t * G;
    if (G == 2) {  // one conversion for both (heads of 64: two scalar ones were a hot spot of int8 attention)
      uint32_t w;
      std::memcpy(&w, sc, 4);
      const __m128 x = _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(w))), _mm_set1_ps(FP8 ? 256.f : 1.f));
      _mm_storel_pi(reinterpret_cast<__m64*>(f), x);
    } else {
      for (int64_t g = 0; g < G; ++g) f[g] = static_cast<float>(sc[g]) * (FP8 ? 256.f : 1.f);
    }
    rows[t] = {codes, f};
  }
  __m256 load(const Row& r, int64_t d) const {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(r.codes + d));
    __m256 v;
    if constexpr (FP8) {  // e4m3 -> the fp16 of its value / 256 (exact, subnormals too), then fp32
      const __m128i w = _mm_cvtepu8_epi16(b);
      const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7f)), 7),
                                     _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8));
      v = _mm256_cvtph_ps(h);
    } else {
      v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    }
    return round_as<T>(_mm256_mul_ps(v, _mm256_set1_ps(r.scales[d >> shift])));
  }
};

// v's first n lanes (1-8) to p
inline void store_lanes(float* p, __m256 v, int64_t n) {
  if (n == 8) {
    _mm256_storeu_ps(p, v);
  } else {
    alignas(32) float tail[8];
    _mm256_store_ps(tail, v);
    std::memcpy(p, tail, n * sizeof(float));
  }
}

// The 8 vectors' sums across lanes, as one vector (lane i: a[i]'s sum)
inline __m256 sums8(const __m256 a[8]) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Query heads [0, G) of a KV head (qf: their float32 rows, D apart) against its K rows
// [t_begin, t_end) of L, 8 rows at a time: the rows' values made once into kb (8 D floats; rows
// past t_end zero), then each head's 8 dots as 8 fmadd chains over D, summed across lanes
// together, rounded to T and times scale, into s[j L + t]. Rows KV_PREFETCH_TOKENS ahead are
// fetched as it goes (see weigh_values; the caller fetches the first window). A score depends
// on its head and token only: a run of tokens gives the same bits as the whole context.
template <typename T, class Rows>
void score_heads(const float* qf, int64_t G, const Rows& kr, int64_t t_begin, int64_t t_end, int64_t L, int64_t D,
                 float scale, float* s, float* kb) {
  const __m256 scale8 = _mm256_set1_ps(scale);
  const auto* rows = kr.rows.data();  // read once: the stores below may alias a vector's pointer
  for (int64_t t0 = t_begin; t0 < t_end; t0 += 8) {
    const int64_t n = std::min<int64_t>(8, t_end - t0);
    kr.fetch(std::min(L, t0 + KV_PREFETCH_TOKENS), std::min(L, t0 + KV_PREFETCH_TOKENS + 8), D);
    for (int64_t i = 0; i < 8; ++i) {
      if (i < n) {
        const auto row = rows[t0 + i];
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(kb + i * D + d, kr.load(row, d));
      } else {
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(kb + i * D + d, _mm256_setzero_ps());
      }
    }
    for (int64_t j = 0; j < G; ++j) {
      __m256 a[8];
      for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 q = _mm256_loadu_ps(qf + j * D + d);
        for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(q, _mm256_loadu_ps(kb + i * D + d), a[i]);
      }
      store_lanes(s + j * L + t0, _mm256_mul_ps(round_as<T>(sums8(a)), scale8), n);
    }
  }
}

// 8 dwords' 8 x 8 transpose: c[j] lane i = r[i] lane j
inline void transpose8(const __m256i r[8], __m256i c[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    c[j] = _mm256_permute2x128_si256(u[j], u[j + 4], 0x20);
    c[j + 4] = _mm256_permute2x128_si256(u[j], u[j + 4], 0x31);
  }
}

// One head's score of 8 tokens over the group of quads [p0, p1) (an even count): two chains
template <int QG>
inline __m256i int8_group_dots(const __m256i* col, const int32_t* qsgn, const int32_t* qabs, int64_t p0, int64_t p1) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
  const auto dot = [&](int64_t p) {
    return _mm256_madd_epi16(
        _mm256_maddubs_epi16(_mm256_set1_epi32(qabs[p]), _mm256_sign_epi8(col[p], _mm256_set1_epi32(qsgn[p]))), ones);
  };
  if constexpr (QG > 0) {
#pragma GCC unroll 8
    for (int64_t i = 0; i < QG; i += 2) a0 = _mm256_add_epi32(a0, dot(p0 + i)), a1 = _mm256_add_epi32(a1, dot(p0 + i + 1));
  } else {
    for (int64_t p = p0; p < p1; p += 2) a0 = _mm256_add_epi32(a0, dot(p)), a1 = _mm256_add_epi32(a1, dot(p + 1));
  }
  return _mm256_add_epi32(a0, a1);
}

// A thread's buffers for score_heads_int8, kept across its jobs: the job's query heads in
// int8 (int8_query) and one chunk's columns, scales and padded rows
struct Int8Scores {
  std::vector<int8_t> qq;
  std::vector<int32_t> qsum, qabs, qsgn;
  std::vector<float> qscale, ks;
  std::vector<__m256i> col;
  std::vector<uint8_t> pad;
};

// Scores over an int8 K with the query in int8 too, the AVX-512 kernel's formula
// (decode_attention_quant.cpp; kv_query.h's quantize_query): each group of GS query values
// quantized to int8 (scale amax / 127), so that a token's score is
//
//   q.k_t = sum_groups (sq_g sk_t,g) sum_d q_d k_t,d      (integer sums: exact)
//
// int8_query quantizes a job's H query heads (qf: their float32 rows, D apart) once, the
// attention scale folded into their group scales; score_heads_int8 then scores heads [h0, h0 +
// G) of them against K rows [t_begin, t_end) of L, 8 tokens at a time, their codes transposed
// (col[p] lane i: token i's dims 4p .. 4p + 3), so each query quad multiplies 8 tokens at once
// with no sums across lanes: vpmaddubsw takes the query's |codes| (unsigned) and K's codes with
// the query's signs (vpsignb), then vpmaddwd adds the pairs into int32. No saturation: a pair is
// at most 2 x 127 x 127, as the cache's codes lie in [-127, 127] (kv/cache.py, kv_write.h).
// Scores per (head, token) into s[j L + t].
inline void int8_query(const float* qf, int64_t H, int64_t D, int64_t GS, float scale, Int8Scores& buf) {
  const int64_t NGR = D / GS, Q = D / 4;
  buf.qq.resize(H * D), buf.qabs.resize(H * Q), buf.qsgn.resize(H * Q);
  buf.qsum.resize(H * NGR), buf.qscale.resize(H * NGR);
  int8_t* qq = buf.qq.data();
  for (int64_t j = 0; j < H; ++j)
    quantize_query(qf + j * D, D, GS, scale, qq + j * D, buf.qsum.data() + j * NGR, buf.qscale.data() + j * NGR);
  for (int64_t i = 0; i < H * Q; ++i) {
    uint8_t a[4];
    for (int b = 0; b < 4; ++b) a[b] = static_cast<uint8_t>(std::abs(qq[4 * i + b]));
    std::memcpy(&buf.qsgn[i], &qq[4 * i], 4), std::memcpy(&buf.qabs[i], a, 4);
  }
}

template <typename T, int QG>
void score_heads_int8(int64_t h0, int64_t G, const CodeRows<T, false>& kr, int64_t t_begin, int64_t t_end, int64_t L,
                      int64_t D, float* s, Int8Scores& buf) {
  const int64_t NGR = kr.G, GS = D / NGR, Q = D / 4, DP = (D + 31) / 32 * 32;
  buf.ks.resize(8 * NGR), buf.col.resize(DP / 4);
  const int32_t *qabs = buf.qabs.data() + h0 * Q, *qsgn = buf.qsgn.data() + h0 * Q;
  const float* qscale = buf.qscale.data() + h0 * NGR;
  float* ks = buf.ks.data();
  __m256i* col = buf.col.data();
  const bool padded = D % 32 != 0;
  // rows whose D is not a multiple of 32, zero-padded (only their first D bytes are ever written)
  if (padded && buf.pad.size() != static_cast<size_t>(8 * DP)) buf.pad.assign(8 * DP, 0);
  uint8_t* pad = buf.pad.data();
  const auto* rows = kr.rows.data();  // read once: the stores below may alias a vector's pointer
  const float* kscale = kr.scales.data();
  for (int64_t t0 = t_begin; t0 < t_end; t0 += 8) {
    const int64_t n = std::min<int64_t>(8, t_end - t0);
    kr.fetch(std::min(L, t0 + KV_PREFETCH_TOKENS), std::min(L, t0 + KV_PREFETCH_TOKENS + 8), D);
    const uint8_t* src[8];
    for (int64_t i = 0; i < 8; ++i) {
      const int64_t t = t0 + std::min(i, n - 1);  // tail lanes repeat a token (not stored)
      const uint8_t* codes = rows[t].codes;
      if (padded) std::memcpy(pad + i * DP, codes, D), codes = pad + i * DP;
      src[i] = codes;
      for (int64_t gi = 0; gi < NGR; ++gi) ks[gi * 8 + i] = kscale[t * NGR + gi];
    }
    for (int64_t c = 0; c < DP; c += 32) {
      __m256i r[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src[i] + c));
      transpose8(r, col + c / 4);
    }
    for (int64_t j = 0; j < G; ++j) {
      __m256 sacc = _mm256_setzero_ps();
      for (int64_t gi = 0; gi < NGR; ++gi) {
        const __m256i acc = int8_group_dots<QG>(col, qsgn + j * Q, qabs + j * Q, gi * (GS / 4), (gi + 1) * (GS / 4));
        sacc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc),
                               _mm256_mul_ps(_mm256_loadu_ps(&ks[gi * 8]), _mm256_set1_ps(qscale[j * NGR + gi])), sacc);
      }
      store_lanes(s + j * L + t0, sacc, n);
    }
  }
}

// Rows of V a pass of weigh_values takes: their lines stay in L1 across its D / 8 chunks
constexpr int64_t VALUE_ROWS = 32;

// Query heads [0, N) of a KV head: probabilities p[t N + j] times the V rows [t_begin, t_end)
// of L, added into acc (N D float32, j's at j D), each head's 8 dims an fmadd chain over t in
// order (the same bits however the context is cut into calls). The rows go a run of VALUE_ROWS
// at a time, its D / 8 chunks in turn (each chain carried over in acc); the N chains share each
// load of a V row. Each run fetches the rows KV_PREFETCH_TOKENS ahead of it (paged_rows.h: a KV
// head's rows lie a pool row apart within a block and blocks anywhere, so the hardware
// prefetcher hardly helps; the caller fetches the first window). Measured on 2 Zen 3 cores
// (2026-12-02), TinyLlama's heads, 22 layers' caches in turn, with and without the fetches
// (here and in score_heads) alternated in one process: one sequence of 4,096 tokens 1.54x
// (bf16) and 1.53x (int8), of 256 tokens 1.50x and 1.35x; 16 of 1,024 tokens (4 layers) 1.33x
// and 1.26x. (Fetching 32 tokens ahead gave the same.)
template <int N, class Rows>
void weigh_values(const float* p, const Rows& vr, int64_t t_begin, int64_t t_end, int64_t L, int64_t D, float* acc) {
  const auto* rows = vr.rows.data();  // read once: the stores below may alias a vector's pointer
  for (int64_t t0 = t_begin; t0 < t_end; t0 += VALUE_ROWS) {
    const int64_t t1 = std::min(t_end, t0 + VALUE_ROWS);
    vr.fetch(std::min(L, t0 + KV_PREFETCH_TOKENS), std::min(L, t1 + KV_PREFETCH_TOKENS), D);
    for (int64_t d = 0; d < D; d += 8) {
      __m256 o[N];
      for (int j = 0; j < N; ++j) o[j] = _mm256_loadu_ps(acc + j * D + d);
      for (int64_t t = t0; t < t1; ++t) {
        const __m256 v = vr.load(rows[t], d);
        for (int j = 0; j < N; ++j) o[j] = _mm256_fmadd_ps(_mm256_set1_ps(p[t * N + j]), v, o[j]);
      }
      for (int j = 0; j < N; ++j) _mm256_storeu_ps(acc + j * D + d, o[j]);
    }
  }
}

// weigh_values over an int8 V with each token's V scales folded into the probabilities:
// ps[(t NGR + g) N + j] = p_j,t times token t's scale of group g (GS dims), so a row's codes
// go to float and straight into the heads' chains (sum_t (p s) c: the AVX-512 kernel's
// sum_t p (c s) to a rounding). The same loops as weigh_values, written out: one loop taking
// the row's values and weights as lambdas ran bf16 attention 0.90x (2 Zen 3 cores, 4,096
// tokens, alternated in one process).
template <int N, class Rows>
void weigh_values_int8(const float* ps, const Rows& vr, int64_t t_begin, int64_t t_end, int64_t L, int64_t D,
                       int64_t GS, float* acc) {
  const int64_t NGR = D / GS;
  const auto* rows = vr.rows.data();  // read once: the stores below may alias a vector's pointer
  for (int64_t t0 = t_begin; t0 < t_end; t0 += VALUE_ROWS) {
    const int64_t t1 = std::min(t_end, t0 + VALUE_ROWS);
    vr.fetch(std::min(L, t0 + KV_PREFETCH_TOKENS), std::min(L, t1 + KV_PREFETCH_TOKENS), D);
    for (int64_t d = 0; d < D; d += 8) {
      const float* pg = ps + (d / GS) * N;
      __m256 o[N];
      for (int j = 0; j < N; ++j) o[j] = _mm256_loadu_ps(acc + j * D + d);
      for (int64_t t = t0; t < t1; ++t) {
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rows[t].codes + d));
        const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
        const float* pt = pg + t * NGR * N;
        for (int j = 0; j < N; ++j) o[j] = _mm256_fmadd_ps(_mm256_set1_ps(pt[j]), v, o[j]);
      }
      for (int j = 0; j < N; ++j) _mm256_storeu_ps(acc + j * D + d, o[j]);
    }
  }
}

}  // namespace

namespace {

// q (B, Hq, D) against pools of (blocks, BS, Hkv, D) rows, checked: q contiguous, the tables
// and lengths as int64, every block a context reads inside the pool
struct AttentionArgs {
  torch::Tensor q, tables, lens;
  int64_t B, Hq, D, BS, Hkv, max_blocks;
};

AttentionArgs attention_args(const torch::Tensor& q, const torch::Tensor& pool, const torch::Tensor& block_tables,
                             const torch::Tensor& context_lens) {
  TORCH_CHECK(q.dim() == 3 && pool.dim() == 4, "decode_attention: q (B, Hq, D) and caches (blocks, BS, Hkv, D) expected");
  AttentionArgs a{q.contiguous(), block_tables.to(at::kLong).contiguous(), context_lens.to(at::kLong).contiguous(),
                  q.size(0), q.size(1), q.size(2), pool.size(1), pool.size(2), 0};
  TORCH_CHECK(pool.size(3) == a.D && a.Hq % a.Hkv == 0 && a.D % 8 == 0,
              "decode_attention: head sizes do not match the cache");
  TORCH_CHECK(a.tables.dim() == 2 && a.tables.size(0) == a.B && a.lens.numel() == a.B,
              "decode_attention: a block table and length a sequence");
  a.max_blocks = a.tables.size(1);
  const int64_t *tp = a.tables.data_ptr<int64_t>(), *lp = a.lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < a.B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= a.max_blocks * a.BS, "decode_attention: context length ", lp[b],
                " does not fit its table");
    for (int64_t i = 0; i < (lp[b] + a.BS - 1) / a.BS; ++i)
      TORCH_CHECK(tp[b * a.max_blocks + i] >= 0 && tp[b * a.max_blocks + i] < pool.size(0),
                  "decode_attention: block id outside the pool");
  }
  return a;
}

}  // namespace

// One query per sequence over its paged K/V: q (B, Hq, D), caches (blocks, BS, Hkv, D) in q's
// dtype, D a multiple of 8 -> (B, Hq, D). Scores q . k (rounded to T, as torch's matmul output),
// times scale, a softmax per head (probabilities rounded to T), then the probabilities times V.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  check_input(q, "decode_attention");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype, "decode_attention: cache dtype differs from q");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "decode_attention: contiguous caches of one shape expected");
  const AttentionArgs a = attention_args(q, k_cache, block_tables, context_lens);
  auto out = torch::empty_like(a.q);
  with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    ridge_avx2::decode_attention_into(a.q.data_ptr<T>(), a.Hq * a.D, a.B, a.Hq, a.D, k_cache.data_ptr<T>(),
                                      v_cache.data_ptr<T>(), a.BS, a.Hkv, a.tables.data_ptr<int64_t>(), a.max_blocks,
                                      a.lens.data_ptr<int64_t>(), static_cast<float>(scale), out.data_ptr<T>());
  });
  return out;
}

// The same over an int8 or e4m3 cache (kv/cache.py): codes (blocks, BS, Hkv, D) and fp16 scales
// (blocks, BS, Hkv, groups), one a group of D / groups dims (32, or the whole head). Each K and
// V value is dequantize's (code times scale in float32, rounded to q's dtype), made in
// registers as a row is read: no dequantized copy of the context.
torch::Tensor paged_decode_attention_quant(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                           torch::Tensor k_scale, torch::Tensor v_scale, torch::Tensor block_tables,
                                           torch::Tensor context_lens, double scale, bool fp8) {
  check_input(q, "decode_attention");
  TORCH_CHECK(k_cache.element_size() == 1 && v_cache.element_size() == 1 && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "decode_attention: contiguous 1-byte caches of one shape expected");
  const AttentionArgs a = attention_args(q, k_cache, block_tables, context_lens);
  TORCH_CHECK(k_scale.scalar_type() == at::kHalf && v_scale.scalar_type() == at::kHalf && k_scale.is_contiguous() &&
                  v_scale.is_contiguous() && k_scale.dim() == 4 && k_scale.sizes() == v_scale.sizes() &&
                  k_scale.size(0) == k_cache.size(0) && k_scale.size(1) == a.BS && k_scale.size(2) == a.Hkv,
              "decode_attention: contiguous fp16 (blocks, BS, Hkv, groups) scales expected");
  const int64_t groups = k_scale.size(3);
  TORCH_CHECK(groups == 1 || (a.D % groups == 0 && a.D / groups % 8 == 0 && (a.D / groups & (a.D / groups - 1)) == 0),
              "decode_attention: groups of ", a.D, " / ", groups, " dims (one group, or a power of two of 8 or more)");
  auto out = torch::empty_like(a.q);
  with_dtype(q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    ridge_avx2::decode_attention_quant_into(
        a.q.data_ptr<T>(), a.Hq * a.D, a.B, a.Hq, a.D, static_cast<const uint8_t*>(k_cache.data_ptr()),
        static_cast<const uint8_t*>(v_cache.data_ptr()), k_scale.data_ptr<at::Half>(), v_scale.data_ptr<at::Half>(),
        groups, fp8, a.BS, a.Hkv, a.tables.data_ptr<int64_t>(), a.max_blocks, a.lens.data_ptr<int64_t>(),
        static_cast<float>(scale), out.data_ptr<T>());
  });
  return out;
}

namespace {

// How many runs of query heads attend splits each KV head's G = Hq / Hkv heads into: 1, or
// where the (sequence, KV head) jobs are fewer than the threads, enough runs of 8 or more heads
// to give each thread one
int64_t head_parts(int64_t B, int64_t Hq, int64_t Hkv) {
  const int64_t jobs = B * Hkv, threads = at::get_num_threads();
  return jobs >= threads ? 1 : std::max<int64_t>(1, std::min((threads + jobs - 1) / jobs, Hq / Hkv / 8));
}

// One query per sequence over its context, for rows of any kind (Rows: PlainRows, CodeRows):
// fill(kr, vr, b, h, L) points kr and vr at sequence b's L rows of KV head h. A job is a
// sequence and a run of HJ = Hkv / split of its KV heads (split from kv_head_jobs, paged_rows.h:
// past a long mean context a job reads each token's rows of its heads, which lie side by side
// in the pool, as one run of memory); the query heads of a KV head share each row's loads. A
// job of one head scores its whole context, then weighs V over it; a job of several goes in
// runs of PV_TOKENS tokens, each run's rows of all its heads read before the next run's, in
// both passes. Where the (sequence, KV head) jobs are fewer than the threads (one sequence over
// MLA's one latent, or a few over one or two KV heads), a KV head's G = Hq / Hkv query heads are
// split into runs of 8 or more, one job each: each reads the KV head's rows. A head's arithmetic
// depends neither on the heads beside it nor on how its tokens are cut into runs, so the outputs
// are the same bits however the heads are split (torch's GEMMs took the few-job steps before,
// Avx2Kernels.decode_attention).
template <class T, class Rows, class Fill>
void attend(const T* qp, int64_t q_stride, int64_t B, int64_t Hq, int64_t D, int64_t Hkv, int64_t split,
            const int64_t* lp, float scale, T* op, const Rows& proto, Fill&& fill) {
  const int64_t G = Hq / Hkv, HJ = Hkv / split, parts = HJ == 1 ? head_parts(B, Hq, Hkv) : 1;
  at::parallel_for(0, B * split * parts, 1, [&](int64_t begin, int64_t end) {
    // the thread's buffers, kept from call to call (paged_rows.h's Scratch): the rows of its
    // jobs' heads, the query in float32, scores, probabilities and sums
    thread_local std::vector<Rows> krs, vrs;
    thread_local Scratch<float> qf_buf, score_buf, kb_buf, acc_buf, pt_buf;
    thread_local Int8Scores int8_buf;
    if (static_cast<int64_t>(krs.size()) < HJ) krs.resize(HJ), vrs.resize(HJ);
    for (int64_t j = 0; j < HJ; ++j) krs[j].like(proto), vrs[j].like(proto);
    float *qf = qf_buf.get(HJ * G * D), *kb = kb_buf.get(8 * D), *acc = acc_buf.get(HJ * G * D);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t part = job % parts, b = job / parts / split, h0 = job / parts % split * HJ, L = lp[b];
      const int64_t g0 = part * G / parts, GP = (part + 1) * G / parts - g0;  // the job's query heads of a KV head
      const int64_t HG = HJ * GP;  // all of them: consecutive heads of q and of the output (GP = G where HJ > 1)
      const T* qb = qp + b * q_stride + (h0 * G + g0) * D;
      for (int64_t i = 0; i < HG * D; i += 8) _mm256_storeu_ps(qf + i, load8(qb + i));
      for (int64_t j = 0; j < HJ; ++j) krs[j].resize(L), vrs[j].resize(L), fill(krs[j], vrs[j], b, h0 + j, L);
      float* scores = score_buf.get(HG * L);
      const int64_t run = HJ == 1 ? L : PV_TOKENS, first = std::min(L, KV_PREFETCH_TOKENS);
      for (int64_t j = 0; j < HJ; ++j) krs[j].fetch(0, first, D);  // the window before the loops' fetch
      if constexpr (Rows::INT8_QUERY) {  // the AVX-512 kernel's formula: fp32 probabilities
        int8_query(qf, HG, D, D / proto.G, scale, int8_buf);
        for (int64_t t0 = 0; t0 < L; t0 += run)
          for (int64_t j = 0; j < HJ; ++j) {
            float* s = scores + j * GP * L;
            if (D / proto.G == 32)  // groups of 32 (every head of a multiple of 32 dims): 8 quads unrolled
              score_heads_int8<T, 8>(j * GP, GP, krs[j], t0, std::min(L, t0 + run), L, D, s, int8_buf);
            else
              score_heads_int8<T, 0>(j * GP, GP, krs[j], t0, std::min(L, t0 + run), L, D, s, int8_buf);
          }
        for (int64_t g = 0; g < HG; ++g) softmax_row<float>(scores + g * L, L);
      } else {
        for (int64_t t0 = 0; t0 < L; t0 += run)
          for (int64_t j = 0; j < HJ; ++j)
            score_heads<T>(qf + j * GP * D, GP, krs[j], t0, std::min(L, t0 + run), L, D, scale,
                           scores + j * GP * L, kb);
        for (int64_t g = 0; g < HG; ++g) softmax_row<T>(scores + g * L, L);
      }
      // Each cut of up to 8 of a KV head's query heads: its probabilities token-major (a token's N
      // in one line, not N lines L floats apart), at pt + cut's first head L NGR
      const int64_t NGR = Rows::INT8_QUERY ? proto.G : 1;  // int8: V's group scales folded in
      float* pt = pt_buf.get(HG * L * NGR);
      const auto cuts = [&](auto&& fn) {  // fn(N, j, first head of the cut among the job's)
        for (int64_t j = 0; j < HJ; ++j)
          for (int64_t c = 0; c < GP; c += 8)
            with_heads(std::min<int64_t>(8, GP - c), [&](auto n) { fn(n, j, j * GP + c); });
      };
      cuts([&](auto n, int64_t j, int64_t c) {
        constexpr int N = decltype(n)::value;
        float* pc = pt + c * L * NGR;
        [[maybe_unused]] const float* vscale = nullptr;  // int8: V's scales, [token][group]
        if constexpr (Rows::INT8_QUERY) vscale = vrs[j].scales.data();
        const auto put = [&](int64_t t, const __m256 p) {  // token t's N probabilities, 8 lanes
          for (int64_t g = 0; g < NGR; ++g) {
            __m256 heads = p;
            alignas(32) float row[8];
            if constexpr (Rows::INT8_QUERY) heads = _mm256_mul_ps(heads, _mm256_set1_ps(vscale[t * NGR + g]));
            _mm256_store_ps(row, heads);
            std::memcpy(&pc[(t * NGR + g) * N], row, N * sizeof(float));
          }
        };
        int64_t t = 0;
        if constexpr (N == 8)  // 8 x 8 blocks transposed in registers
          for (; t + 8 <= L; t += 8) {
            __m256i r[8], col[8];
            for (int i = 0; i < 8; ++i) r[i] = _mm256_castps_si256(_mm256_loadu_ps(&scores[(c + i) * L + t]));
            transpose8(r, col);
            for (int i = 0; i < 8; ++i) put(t + i, _mm256_castsi256_ps(col[i]));
          }
        for (; t < L; ++t) {
          alignas(32) float heads[8] = {};
          for (int i = 0; i < N; ++i) heads[i] = scores[(c + i) * L + t];
          put(t, _mm256_load_ps(heads));
        }
      });
      std::fill(acc, acc + HG * D, 0.f);
      for (int64_t j = 0; j < HJ; ++j) vrs[j].fetch(0, first, D);
      for (int64_t t0 = 0; t0 < L; t0 += run)
        cuts([&](auto n, int64_t j, int64_t c) {
          constexpr int N = decltype(n)::value;
          const int64_t t1 = std::min(L, t0 + run);
          if constexpr (Rows::INT8_QUERY)
            weigh_values_int8<N>(pt + c * L * NGR, vrs[j], t0, t1, L, D, D / NGR, acc + c * D);
          else
            weigh_values<N>(pt + c * L * NGR, vrs[j], t0, t1, L, D, acc + c * D);
        });
      T* ob = op + (b * Hq + h0 * G + g0) * D;
      for (int64_t i = 0; i < HG * D; i += 8) store8(ob + i, _mm256_loadu_ps(acc + i));
    }
  });
}

}  // namespace

namespace ridge_avx2 {

int64_t decode_attention_jobs(int64_t B, int64_t Hq, int64_t Hkv) { return B * Hkv * head_parts(B, Hq, Hkv); }

template <class T>
void decode_attention_into(const T* qp, int64_t q_stride, int64_t B, int64_t Hq, int64_t D, const T* kp, const T* vp,
                           int64_t BS, int64_t Hkv, const int64_t* tp, int64_t max_blocks, const int64_t* lp,
                           float scale, T* op) {
  const int64_t split = kv_head_jobs(B, Hkv, lp, Hkv * 2 * D * static_cast<int64_t>(sizeof(T)), kv_grouped_bound(KV_GROUPED_BYTES));
  attend<T>(qp, q_stride, B, Hq, D, Hkv, split, lp, scale, op, PlainRows<T>{},
            [&](PlainRows<T>& kr, PlainRows<T>& vr, int64_t b, int64_t h, int64_t L) {
              const int64_t* table = tp + b * max_blocks;
              for (int64_t t = 0; t < L; ++t) {
                const int64_t at = ((table[t / BS] * BS + t % BS) * Hkv + h) * D;
                kr.rows[t] = kp + at, vr.rows[t] = vp + at;
              }
            });
}

template <class T>
void decode_attention_quant_into(const T* qp, int64_t q_stride, int64_t B, int64_t Hq, int64_t D, const uint8_t* kp,
                                 const uint8_t* vp, const at::Half* ks, const at::Half* vs, int64_t groups, bool fp8,
                                 int64_t BS, int64_t Hkv, const int64_t* tp, int64_t max_blocks, const int64_t* lp,
                                 float scale, T* op) {
  const auto run = [&](auto kind) {
    using Rows = CodeRows<T, decltype(kind)::value>;
    Rows proto;
    proto.G = groups;
    proto.shift = groups == 1 ? 63 : __builtin_ctzll(static_cast<uint64_t>(D / groups));
    // an e4m3 cache keeps one KV head a job, as the AVX-512 kernel's does (decode_attention_quant.cpp)
    const int64_t split = Rows::INT8_QUERY ? kv_head_jobs(B, Hkv, lp, Hkv * 2 * (D + 2 * groups), kv_grouped_bound(KV_GROUPED_BYTES)) : Hkv;
    attend<T>(qp, q_stride, B, Hq, D, Hkv, split, lp, scale, op, proto,
              [&](Rows& kr, Rows& vr, int64_t b, int64_t h, int64_t L) {
      const int64_t* table = tp + b * max_blocks;
      for (int64_t t = 0; t < L; ++t) {
        const int64_t row = (table[t / BS] * BS + t % BS) * Hkv + h;
        kr.set(t, kp + row * D, ks + row * groups);
        vr.set(t, vp + row * D, vs + row * groups);
      }
    });
  };
  if (fp8)
    run(std::true_type{});
  else
    run(std::false_type{});
}

#define RIDGE_AVX2_OPS(T)                                                                                          \
  template void rms_norm_into<T>(const T*, const T*, T*, int64_t, int64_t, float);                                \
  template void add_rms_norm_into<T>(const T*, T*, const T*, T*, int64_t, int64_t, float);                        \
  template void silu_mul_into<T>(const T*, int64_t, int64_t, T*);                                                 \
  template void rope_into<T>(T*, int64_t, int64_t, int64_t, int64_t, const int64_t*, const float*, const float*); \
  template void decode_attention_into<T>(const T*, int64_t, int64_t, int64_t, int64_t, const T*, const T*, int64_t, \
                                         int64_t, const int64_t*, int64_t, const int64_t*, float, T*);            \
  template void decode_attention_quant_into<T>(const T*, int64_t, int64_t, int64_t, int64_t, const uint8_t*,       \
                                               const uint8_t*, const at::Half*, const at::Half*, int64_t, bool,    \
                                               int64_t, int64_t, const int64_t*, int64_t, const int64_t*, float, T*);
RIDGE_AVX2_OPS(float)
RIDGE_AVX2_OPS(at::BFloat16)
#undef RIDGE_AVX2_OPS

}  // namespace ridge_avx2

// ---- MoE routing ---------------------------------------------------------------------------

namespace ridge_avx2 {

// Top-k routing of T tokens over E experts, as Router.forward routes (the AVX-512 kernels'
// route_topk_into, decode_ops.cpp, on 8 lanes): logits x . router_e in fp32 (x widened from
// bf16; four 8-lane sums over k in steps of 32, then added and summed across lanes), then the
// choice plan_shared.h makes; ridge_shared::route_topk_with shares the pairs out over the
// threads. A token's ids and weights never depend on the other tokens of its batch.
void route_topk_into(const at::BFloat16* x, int64_t T, int64_t K, ridge_shared::RouterRows router, int64_t E, int64_t top_k,
                     bool softmax, bool norm_topk, double norm_eps, double scaling, int64_t n_group,
                     int64_t topk_group, const float* bias, int64_t* ids, at::BFloat16* weights) {
  ridge_shared::route_topk_with(
      x, T, K, router, E, top_k, softmax, norm_topk, norm_eps, scaling, n_group, topk_group, bias, ids, weights,
      [](const at::BFloat16* xr, const auto* w, int64_t K) {
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        int64_t k = 0;
        for (; k + 32 <= K; k += 32)
          for (int j = 0; j < 4; ++j) acc[j] = _mm256_fmadd_ps(load8(xr + k + 8 * j), load8(w + k + 8 * j), acc[j]);
        for (; k + 8 <= K; k += 8) acc[0] = _mm256_fmadd_ps(load8(xr + k), load8(w + k), acc[0]);
        float sum = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
        for (; k < K; ++k) sum += static_cast<float>(xr[k]) * static_cast<float>(w[k]);
        return sum;
      });
}

// SparseMoE.forward's weighted sum: out[t] = sum over j of bf16(ys[unsort[t k + j]] * w[t k + j]),
// in fp32 from 0 in order j = 0 .. k-1, rounded to bf16 once (the bf16 multiply, the gather
// and sum(dim=1, dtype=float32) of its Python path). ys (T k, H) sorted by expert, H a multiple of 8.
void moe_combine_into(const at::BFloat16* ys, const at::BFloat16* w, const int64_t* unsort, int64_t T, int64_t k,
                      int64_t H, at::BFloat16* out) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; h += 8) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t j = 0; j < k; ++j) {
        const __m256 y = load8(ys + unsort[t * k + j] * H + h);
        acc = _mm256_add_ps(acc, round8(_mm256_mul_ps(y, _mm256_set1_ps(static_cast<float>(w[t * k + j])))));
      }
      store8(out + t * H + h, acc);
    }
}

// y[t] = bf16(g[t] * y[t]) for T rows of H (a multiple of 8): a gate per row, as a bf16 multiply
void scale_rows_into(at::BFloat16* y, const at::BFloat16* g, int64_t T, int64_t H) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; h += 8)
      store8(y + t * H + h, _mm256_mul_ps(load8(y + t * H + h), _mm256_set1_ps(static_cast<float>(g[t]))));
}

// out += y on n values (a multiple of 8), each sum rounded to bf16 (a bf16 add_)
void add_into(at::BFloat16* out, const at::BFloat16* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) store8(out + i, _mm256_add_ps(load8(out + i), load8(y + i)));
}

// Each row's index of its largest value, the first of equal maxima (a row with a NaN: its first
// NaN), as torch's argmax of the float32 values: 8 lanes keep their first maximum, then the
// lanes' best value and, among equal ones, the lowest index.
template <class T>
void argmax_rows_into(const T* logits, int64_t rows, int64_t V, int64_t* out) {
  at::parallel_for(0, rows, 4, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* row = logits + r * V;
      int64_t best = 0;
      float best_v = static_cast<float>(row[0]);
      bool nan = std::isnan(best_v);
      int64_t i = 1;
      if (V >= 16) {
        __m256 vmax = load8(row);
        __m256i vidx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), cur = vidx;
        __m256 unord = _mm256_cmp_ps(vmax, vmax, _CMP_UNORD_Q);
        for (i = 8; i + 8 <= V; i += 8) {
          cur = _mm256_add_epi32(cur, _mm256_set1_epi32(8));
          const __m256 v = load8(row + i);
          unord = _mm256_or_ps(unord, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
          const __m256 gt = _mm256_cmp_ps(v, vmax, _CMP_GT_OQ);
          vmax = _mm256_blendv_ps(vmax, v, gt);
          vidx = _mm256_blendv_epi8(vidx, cur, _mm256_castps_si256(gt));
        }
        nan = _mm256_movemask_ps(unord) != 0;
        alignas(32) float mv[8];
        alignas(32) int32_t mi[8];
        _mm256_store_ps(mv, vmax);
        _mm256_store_si256(reinterpret_cast<__m256i*>(mi), vidx);
        best = mi[0], best_v = mv[0];
        for (int l = 1; l < 8; ++l)
          if (mv[l] > best_v || (mv[l] == best_v && mi[l] < best)) best = mi[l], best_v = mv[l];
      }
      for (; i < V; ++i) {
        const float v = static_cast<float>(row[i]);
        nan = nan || std::isnan(v);
        if (v > best_v) best = i, best_v = v;
      }
      if (nan)  // torch's argmax takes a NaN as the largest value: the row's first NaN
        for (int64_t j = 0; j < V; ++j)
          if (std::isnan(static_cast<float>(row[j]))) {
            best = j;
            break;
          }
      out[r] = best;
    }
  });
}
template void argmax_rows_into<float>(const float*, int64_t, int64_t, int64_t*);
template void argmax_rows_into<at::BFloat16>(const at::BFloat16*, int64_t, int64_t, int64_t*);

}  // namespace ridge_avx2

// (rows, V) float32 or bf16 logits -> (rows,) int64: argmax_rows_into
torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.device().is_cpu() &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "argmax_rows: (rows, V) float32 or bfloat16 CPU logits with V >= 1");
  auto x = logits.contiguous();
  auto out = torch::empty({x.size(0)}, x.options().dtype(at::kLong));
  with_dtype(x.scalar_type(), [&](auto t) {
    using T = decltype(t);
    ridge_avx2::argmax_rows_into(x.data_ptr<T>(), x.size(0), x.size(1), out.data_ptr<int64_t>());
  });
  return out;
}

// (T, k) expert ids and bf16 weights for bf16 x (T, K) and a float32 router (E, K)
std::vector<torch::Tensor> route_topk(torch::Tensor x, torch::Tensor router, int64_t top_k, bool softmax, bool norm_topk,
                                      double norm_eps, double scaling, int64_t n_group, int64_t topk_group,
                                      c10::optional<torch::Tensor> bias) {
  return ridge_shared::route_topk_tensors(x, router, top_k, softmax, norm_topk, norm_eps, scaling, n_group, topk_group,
                                         bias, ridge_avx2::route_topk_into);
}

// Structured output: the tokens a row's grammar does not allow get -inf, in place (the AVX-512
// kernels' apply_token_bitmask_, decode_ops.cpp, on 8 lanes). Bit j of word w of a row's mask
// allows token 32 w + j (llguidance's and xgrammar's layout); tokens past the mask's words are
// disallowed. Each word's lanes take -inf by a blend of 8 (fp32) or 16 (16-bit) values; a word
// of all ones is skipped, and the row's last, partial word goes value by value.
void apply_token_bitmask_(torch::Tensor logits, torch::Tensor bitmask) {
  TORCH_CHECK(logits.dim() == 2 && bitmask.dim() == 2 && logits.size(0) == bitmask.size(0),
              "apply_token_bitmask_: logits (rows, V) and bitmask (rows, words)");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt, "apply_token_bitmask_: the bitmask is int32");
  TORCH_CHECK(logits.is_contiguous() && bitmask.is_contiguous() && logits.device().is_cpu() && bitmask.device().is_cpu(),
              "apply_token_bitmask_: contiguous CPU tensors");
  const auto dtype = logits.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "apply_token_bitmask_: float32, bfloat16 or float16 logits");
  const int64_t rows = logits.size(0), V = logits.size(1), words = bitmask.size(1);
  const uint32_t* mp = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const bool f32 = dtype == at::kFloat;
  const uint16_t ninf16 = dtype == at::kBFloat16 ? 0xFF80 : 0xFC00;  // -inf in bf16, fp16
  char* lp = static_cast<char*>(logits.data_ptr());
  const int64_t row_bytes = V * logits.element_size();
  const __m256i bit32 = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i bit16 = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                          static_cast<short>(0x8000));
  const __m256 ninf32 = _mm256_set1_ps(-INFINITY);
  at::parallel_for(0, rows, 4, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      char* row = lp + r * row_bytes;
      const uint32_t* m = mp + r * words;
      for (int64_t base = 0, w = 0; base < V; base += 32, ++w) {
        const uint32_t off = w < words ? ~m[w] : 0xFFFFFFFFu;  // the tokens to disallow
        if (!off) continue;
        if (V - base < 32) {  // the row's last word: value by value, nothing past the row
          for (int64_t j = 0; j < V - base; ++j) {
            if (!(off >> j & 1u)) continue;
            if (f32)
              reinterpret_cast<float*>(row)[base + j] = -INFINITY;
            else
              reinterpret_cast<uint16_t*>(row)[base + j] = ninf16;
          }
          continue;
        }
        if (f32) {
          float* p = reinterpret_cast<float*>(row) + base;
          for (int g = 0; g < 4; ++g) {
            const __m256i bits = _mm256_and_si256(_mm256_set1_epi32(static_cast<int>((off >> (8 * g)) & 0xFFu)), bit32);
            const __m256 lanes = _mm256_castsi256_ps(_mm256_cmpeq_epi32(bits, bit32));
            _mm256_storeu_ps(p + 8 * g, _mm256_blendv_ps(_mm256_loadu_ps(p + 8 * g), ninf32, lanes));
          }
        } else {
          uint16_t* p = reinterpret_cast<uint16_t*>(row) + base;
          for (int g = 0; g < 2; ++g) {
            const __m256i bits = _mm256_and_si256(_mm256_set1_epi16(static_cast<short>((off >> (16 * g)) & 0xFFFFu)), bit16);
            const __m256i lanes = _mm256_cmpeq_epi16(bits, bit16);
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * g));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 16 * g),
                                _mm256_blendv_epi8(v, _mm256_set1_epi16(static_cast<short>(ninf16)), lanes));
          }
        }
      }
    }
  });
}
