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
// either kind: two tokens' codes a vdpbf16ps (every code is exact in bf16), weighted by
// bf16(e_t times the token's scale of the group), e_t = exp(score_t - max), accumulated in fp32
// registers (pv_pairs_chunk) and divided by sum_t e_t at the end. Work is split over (sequence,
// run of KV heads) as in decode_ops.cpp.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "kv_codes.h"
#include "paged_rows.h"
#include "simd_math.h"

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

// The 16 words of scale_words (NGR 2) where the rows are 16 consecutive tokens of one block
// (of a head hh of Hkv, 1, 2 or 4: the words lie Hkv apart, the 16 tokens' words of all heads
// in 16 Hkv words from the block's first): loads of those words and one or two vpermt2d, no
// gather. 2-core AMD EPYC Zen 4, 8 layers' pools alternated in one process, 7 rounds, int8
// attention: 16 x 4,096 tokens 1.03x, 1 x 4,096 1.10x, 4 x 1,024 1.06x.
inline __m512i block_scale_words(const at::Half* sp, int64_t row0, int64_t Hkv, int64_t hh) {
  const int32_t* b = reinterpret_cast<const int32_t*>(sp) + (row0 - hh);  // the block's tokens' first word
  if (Hkv == 1) return _mm512_loadu_si512(b);
  const __m512i idx = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                          _mm512_set1_epi32(static_cast<int32_t>(Hkv))),
                                       _mm512_set1_epi32(static_cast<int32_t>(hh)));
  const __m512i lo = _mm512_permutex2var_epi32(_mm512_loadu_si512(b), idx, _mm512_loadu_si512(b + 16));
  if (Hkv == 2) return lo;
  const __m512i hi = _mm512_permutex2var_epi32(_mm512_loadu_si512(b + 32), _mm512_sub_epi32(idx, _mm512_set1_epi32(32)),
                                               _mm512_loadu_si512(b + 48));
  return _mm512_mask_blend_epi32(0xFF00, lo, hi);  // tokens 0-7 from the first 32 words, 8-15 from the rest
}

// The fp16 scales of 16 tokens (pool rows rows16, NGR scales a row) as fp32, group-major:
// ks[gi * 16 + i] is token i's scale of group gi. 2 or 4 a row: scale_words, split into groups
// by vpmovdw / vpmovqw; any other NGR one by one. The conversions are exact either way.
// Hkv > 0: the rows are 16 consecutive tokens of one block, of the head hh of Hkv (a token's
// head index), and where NGR is 2 and Hkv at most 4 block_scale_words reads them.
inline void token_scales16(const at::Half* sp, const int64_t* rows16, int64_t NGR, float* ks, int64_t Hkv = 0,
                           int64_t hh = 0) {
  __m512i w[2];
  if (NGR == 2) {
    if (Hkv == 1 || Hkv == 2 || Hkv == 4)
      w[0] = block_scale_words(sp, rows16[0], Hkv, hh);
    else
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

// Scores of NG query heads (fp32 queries qf[g][D]) against 16 tokens of an fp8 K: per group
// of GS dims sum_d q[d] k_t[d] (two chains a head, even and odd dims), times the tokens' K
// scales of the group; then times 256 (fp8x16's unit) and the attention scale.
template <int NG>
inline void qk_fp8(const float* col, const float* qf, int64_t D, int64_t GS, const float* ks, __m512 unit_scale,
                   float* scores, int64_t L, int64_t n, __m512* mx) {
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
  for (int g = 0; g < NG; ++g) {
    const __m512 v = _mm512_mul_ps(sacc[g], unit_scale);
    _mm512_mask_storeu_ps(scores + g * L, valid, v);
    mx[g] = _mm512_mask_max_ps(mx[g], valid, mx[g], v);
  }
}

// Scores of NG query heads against 16 tokens of an int8 K (see the header): per group of GS
// dims, each head's int8 query sums over the group in int32 (started at -128 times its code
// sum, which takes the + 128 back out), scaled by the query's and the tokens' K scales of the
// group. QG: the group's quads of dims (GS / 4) where known when compiled (0: read from GS).
// Groups of 32 (every head size a multiple of 32) with 8 heads a pass: the group's loop
// unrolled and the query codes an embedded broadcast (dpbusd_x), each K column loaded once
// for 8 heads instead of twice for 4: the same integers and float ops, 1.03x for the whole
// attention with K in cache (2-core AMD EPYC, Zen 5). WORDS: the query's codes by quads of dims,
// then heads (query_words: word p NG + g is head g's dims 4p .. 4p + 3), so that each
// vpdpbusd's broadcast is a constant offset from one pointer; head by head (qw + g D / 4 + p)
// the compiler stepped a register by D before each (see prefetch_chunk_rows for what it
// measured). qw: the heads' codes as 4-byte words, head by head or (WORDS) as query_words lays them.
template <int NG, int QG = 0, bool WORDS = false>
inline void qk_int8(const __m512i* col, const int32_t* qw, const int32_t* qsum, const float* qf, int64_t D, int64_t GS,
                    const float* ks, float* scores, int64_t L, int64_t n, __m512* mx) {
  const int64_t NGR = D / GS, quads = QG > 0 ? QG : GS / 4;
  __m512 sacc[NG];
  for (int g = 0; g < NG; ++g) sacc[g] = _mm512_setzero_ps();
  for (int64_t gi = 0; gi < NGR; ++gi) {
    __m512i acc[NG];
    for (int g = 0; g < NG; ++g) acc[g] = _mm512_set1_epi32(qsum[g * NGR + gi]);
#pragma GCC unroll 8
    for (int64_t p = gi * quads; p < (gi + 1) * quads; ++p) {
      const __m512i kv = _mm512_load_si512(col + p);
      for (int g = 0; g < NG; ++g) acc[g] = dpbusd_x(acc[g], kv, WORDS ? qw + p * NG + g : qw + g * D / 4 + p);
    }
    const __m512 k_scale = _mm512_load_ps(ks + gi * 16);
    for (int g = 0; g < NG; ++g)
      sacc[g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[g]), _mm512_mul_ps(k_scale, _mm512_set1_ps(qf[g * NGR + gi])), sacc[g]);
  }
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
  for (int g = 0; g < NG; ++g) {
    _mm512_mask_storeu_ps(scores + g * L, valid, sacc[g]);
    mx[g] = _mm512_mask_max_ps(mx[g], valid, mx[g], sacc[g]);
  }
}

// NG heads' int8 query codes (qq, D a head) as qk_int8's WORDS takes them: out[p NG + g] = head
// g's word p (its dims 4p .. 4p + 3)
template <int NG>
inline void query_words(const int8_t* qq, int64_t D, int32_t* out) {
  const int32_t* w = reinterpret_cast<const int32_t*>(qq);
  for (int64_t p = 0; p < D / 4; ++p)
    for (int g = 0; g < NG; ++g) out[p * NG + g] = w[g * D / 4 + p];
}

// The weights of V's codes (softmax_pairs, pv_pairs_chunk) lie by groups of V's dims, then by
// chunks of 16 tokens, then by heads: the word of head g, group gi and token pair t / 2 (t even)
//   w[gi * wgroup + (t / 16) * 8 G + 8 g + (t % 16) / 2]
// so a token pair's weights of a cut's heads are 32 bytes apart, constant offsets from one
// pointer (a row of L / 2 words a head kept 8 pointers and their arithmetic in the PV's loop).
inline int64_t pair_word(int64_t t, int64_t G) { return t / 16 * 8 * G + t % 16 / 2; }

// NG query heads' scores over tokens 0 .. L (head g's s[g * L + t], their largest the largest
// lane of mx16[g]) -> their weights of V's codes, for each group gi of V's dims bf16 pairs:
// w[gi * wgroup + pair_word(t, G) + 8 g] (w: the first head's word) holds bf16(e_t v_t) in its
// low half and bf16(e_t+1 v_t+1) in its high one, e_t = exp(s_t - max) and v_t the token's V
// scale of the group (vs[gi * LS + t], from the scores' loop); zeros from L to the end of its 16
// tokens. sums[g] = head g's sum_t e_t, which the PV's sums are divided by once at the end: one
// pass over the scores, no normalizing pass. A chunk of 16 tokens at a time for all NG heads,
// so that its V scales are read once and a chunk's weight lines are written whole (against a
// head at a time, in one process alternating both, 60 rounds: 1.03x at 16 x 4,096 tokens and
// 4 x 2,048, 2-core AMD EPYC Zen 4).
template <int NG>
inline void softmax_pairs(const float* s, int64_t L, const __m512* mx16, const float* vs, int64_t LS, int64_t NGR,
                          int64_t G, uint32_t* w, int64_t wgroup, float* sums) {
  float mx[NG];
  __m512 sum[NG], e[NG];
  for (int g = 0; g < NG; ++g) mx[g] = _mm512_reduce_max_ps(mx16[g]), sum[g] = _mm512_setzero_ps();
  for (int64_t t = 0; t < L; t += 16) {
    const __mmask16 m = L - t >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (L - t)) - 1);
    for (int g = 0; g < NG; ++g) {
      e[g] = exp512_nonpos(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + g * L + t), _mm512_set1_ps(mx[g])), m);
      sum[g] = _mm512_add_ps(sum[g], e[g]);
    }
    for (int64_t gi = 0; gi < NGR; ++gi) {
      const __m512 v = _mm512_loadu_ps(vs + gi * LS + t);
      uint32_t* wt = w + gi * wgroup + pair_word(t, G);
      for (int g = 0; g < NG; ++g)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(wt + 8 * g), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_mul_ps(e[g], v))));
    }
  }
  for (int g = 0; g < NG; ++g) sums[g] = _mm512_reduce_add_ps(sum[g]);
}

// An e4m3 code's value / 256 (as fp8x16 gives it) in bf16, of its 7 bits below the sign, as two
// 128-byte tables, the low bytes and the high ones, for vpermi2b: built from fp8x16 itself, so
// the bf16 are exactly the top halves of its fp32. order: fp8_pairs32's byte permute (in each 16
// bytes k, a's and b's codes of dims 4k .. 4k + 3 in turns, then of dims 16 + 4k .. 16 + 4k + 3:
// vpunpck{l,h}bw read a 16-byte lane's halves). Built once a process.
struct Fp8Tables {
  __m512i lo[2], hi[2], order;
};

inline const Fp8Tables& fp8_tables() {
  static const Fp8Tables tables = [] {
    alignas(64) uint8_t lo[128], hi[128], idx[64];
    for (int m = 0; m < 128; m += 16) {
      alignas(16) uint8_t codes[16];
      alignas(64) uint32_t f[16];
      for (int i = 0; i < 16; ++i) codes[i] = static_cast<uint8_t>(m + i);
      _mm512_store_si512(f, _mm512_castps_si512(fp8x16(codes)));
      for (int i = 0; i < 16; ++i) lo[m + i] = static_cast<uint8_t>(f[i] >> 16), hi[m + i] = static_cast<uint8_t>(f[i] >> 24);
    }
    for (int k = 0; k < 4; ++k)
      for (int m = 0; m < 4; ++m) {
        idx[16 * k + 2 * m] = static_cast<uint8_t>(4 * k + m);
        idx[16 * k + 2 * m + 1] = static_cast<uint8_t>(64 + 4 * k + m);
        idx[16 * k + 8 + 2 * m] = static_cast<uint8_t>(16 + 4 * k + m);
        idx[16 * k + 8 + 2 * m + 1] = static_cast<uint8_t>(64 + 16 + 4 * k + m);
      }
    Fp8Tables t;
    for (int k = 0; k < 2; ++k) t.lo[k] = _mm512_load_si512(lo + 64 * k), t.hi[k] = _mm512_load_si512(hi + 64 * k);
    t.order = _mm512_load_si512(idx);
    return t;
  }();
  return tables;
}

// Two tokens' fp8 codes of 32 dims (a, b: 32 bytes each) -> v[0], v[1]: lane d of v[j] holds
// a's value / 256 at dim 16 j + d in bf16 (low half) and b's (high half), as pv_pairs_chunk
// takes them. A byte permute pairs the tokens' codes (tab.order), two table lookups
// give each code's bf16 bytes, the sign bit is or-ed into the high byte, two unpacks make the
// words: 6 ops where four fp8x16 (7 each) and two merges took 32. 2-core AMD EPYC Zen 4, fp8
// attention over 16 x 4,096 tokens, alternated with the build before, 3 rounds: 1.10-1.12x.
// (The same lookup for int8 codes, on their magnitudes, ran 0.95-1.03x against int8x16's two
// ops: Zen 4's vpermi2b costs more than vpmovsxbd and vcvtdq2ps.)
inline void fp8_pairs32(const uint8_t* a, const uint8_t* b, const Fp8Tables& tab, __m512bh v[2]) {
  const __m512i y = _mm512_permutex2var_epi8(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))), tab.order,
                                             _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b))));
  const __m512i lo = _mm512_permutex2var_epi8(tab.lo[0], y, tab.lo[1]);  // (vpermi2b reads an index's bits 0-6)
  const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(tab.hi[0], y, tab.hi[1]), y,
                                               _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // | the sign
  v[0] = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi8(lo, hi));
  v[1] = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi8(lo, hi));
}

// out[g][d0 : d0 + 16 DN] += sum_t w_g,t code_t[d0 : ...] over tokens [t0, t1) (t0 even), two
// tokens a vdpbf16ps: lane d of a pair vector holds token t's code at d (low bf16) and token
// t + 1's (high), and the heads' weight pairs (softmax_pairs) are broadcast. An int8 code has at
// most 8 significant bits, an fp8 e4m3 one 4: the top half of the fp32 int8x16 / fp8x16 give
// is the code's exact bf16 (fp8: looked up, fp8_pairs32). w: the cut's first head's word of
// group 0 (pair_word; the next group wgroup on; ONE: the cut's dims lie in one group, one weight
// a head). Against the fp32 loop it replaced (each row's codes times its scales, then an FMA
// per head and 16 dims), half the multiply-adds: 2-core AMD EPYC Zen 4, TinyLlama's heads (32
// on 4, 64 dims), 8 layers' pools alternated in one process, 7 rounds: 16 x 4,096 tokens 1.15x
// for the whole int8 attention, 1 x 4,096 1.12x, 1 x 512 1.09x, 16 x 1,024 1.02x; Llama-3-8B's
// heads 8 x 1,024 1.07x. Its outputs move by the weights' bf16 rounding: against an fp64
// attention over the same dequantized cache, 5% more error than before (0.0061 against 0.0058,
// relative; the query's int8 codes make the rest). PAIRED: blocks of an even count of tokens,
// so that tokens t and t + 1 (t even) lie in one block, the second's row pair_stride bytes after
// the first's: one row looked up a pair, for the pair and for its fetch ahead (int8, ordered
// pools, in one process alternating both, 40 rounds: 16 x 4,096 tokens 1.02-1.03x, 1 x 4,096
// 1.02x; shuffled and fp8 level, 2-core AMD EPYC Zen 4).
template <int NG, int DN, bool ONE, bool FP8, bool L2, bool PAIRED>
inline void pv_pairs_chunk(const uint8_t* vp, const int64_t* rows, int64_t t0, int64_t t1, int64_t L, int64_t D,
                           int64_t d0, const uint32_t* w, int64_t wgroup, int64_t G, int64_t GS, float* out,
                           int64_t pair_stride) {
  __m512 acc[NG][DN];
  const uint32_t* wj[DN];
  for (int j = 0; j < DN; ++j) wj[j] = w + (d0 + 16 * j) / GS * wgroup;
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < DN; ++j) acc[g][j] = _mm512_loadu_ps(out + g * D + 16 * j);
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  [[maybe_unused]] const Fp8Tables* tab = nullptr;
  if constexpr (FP8) tab = &fp8_tables();
  auto weights = [&](int j, int g, int64_t at) {
    return reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int32_t>(wj[j][at + 8 * g])));
  };
  for (int64_t t = t0; t < t1; t += 2) {
    const int64_t u = t + 1 < t1 ? t + 1 : t;  // an odd run's last pair: its second weight is 0
    const uint8_t* r0 = vp + rows[t] * D + d0;
    // (an odd run's last pair reads its one token twice: the row past it may hold any bytes, an
    // fp8 NaN among them, which a weight of 0 would not cancel)
    const uint8_t* r1 = PAIRED ? (u > t ? r0 + pair_stride : r0) : vp + rows[u] * D + d0;
    // blocks are scattered over the pool: fetch ahead (into L2 or L1: paged_rows.h), the
    // hardware prefetcher cannot
    if (t + 1 + KV_PREFETCH_TOKENS < L) {
      const char* f0 = reinterpret_cast<const char*>(vp + rows[t + KV_PREFETCH_TOKENS] * D + d0);
      _mm_prefetch(f0, kv_hint<L2>);
      _mm_prefetch(PAIRED ? f0 + pair_stride : reinterpret_cast<const char*>(vp + rows[t + 1 + KV_PREFETCH_TOKENS] * D + d0),
                   kv_hint<L2>);
    }
    __m512bh v[DN];
    int j0 = 0;
    if constexpr (FP8)  // two vectors at a time where it can
      for (; j0 + 1 < DN; j0 += 2) fp8_pairs32(r0 + 16 * j0, r1 + 16 * j0, *tab, v + j0);
    for (int j = j0; j < DN; ++j) {
      const __m512i f0 = _mm512_castps_si512(FP8 ? fp8x16(r0 + 16 * j) : int8x16(r0 + 16 * j));
      const __m512i f1 = _mm512_castps_si512(FP8 ? fp8x16(r1 + 16 * j) : int8x16(r1 + 16 * j));
      // f1's top half and f0's moved down (0xE4: where the third operand's bits are set, the first's, else the second's)
      v[j] = reinterpret_cast<__m512bh>(_mm512_ternarylogic_epi32(f1, _mm512_srli_epi32(f0, 16), high, 0xE4));
    }
    const int64_t at = pair_word(t, G);
    for (int g = 0; g < NG; ++g) {
      const __m512bh w0 = weights(0, g, at);
      for (int j = 0; j < DN; ++j) acc[g][j] = _mm512_dpbf16_ps(acc[g][j], v[j], ONE || j == 0 ? w0 : weights(j, g, at));
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < DN; ++j) _mm512_storeu_ps(out + g * D + 16 * j, acc[g][j]);
}

// out[g] += the PV sums over tokens [t0, t1) of a KV head's G query heads, a cut of heads and
// dims at a time (pv_cuts); w: the KV head's weight words (a group's wgroup apart); pair_stride:
// the bytes from a token's row to the next token's in its block where blocks hold an even count
// of tokens (pv_pairs_chunk's PAIRED), else 0
template <bool FP8, bool L2>
void pv_pairs(int64_t G, const uint8_t* vp, const int64_t* rows, int64_t t0, int64_t t1, int64_t L, int64_t D,
              const uint32_t* w, int64_t wgroup, int64_t GS, float* out, int64_t pair_stride) {
  pv_cuts(G, D, [&](auto heads, auto dims16, int64_t g0, int64_t d0) {
    constexpr int NG = decltype(heads)::value, DN = decltype(dims16)::value;
    const uint32_t* wg = w + 8 * g0;
    float* og = out + g0 * D + d0;
    auto run = [&](auto one, auto paired) {
      pv_pairs_chunk<NG, DN, one(), FP8, L2, paired()>(vp, rows, t0, t1, L, D, d0, wg, wgroup, G, GS, og, pair_stride);
    };
    const bool one = d0 / GS == (d0 + 16 * DN - 1) / GS;
    using yes = std::true_type;
    using no = std::false_type;
    if (pair_stride)
      one ? run(yes{}, yes{}) : run(no{}, yes{});
    else
      one ? run(yes{}, no{}) : run(no{}, no{});
  });
}

template <typename T, bool FP8, bool L2>
void attend_fetching(const T* qp, const uint8_t* kp, const uint8_t* vp, const at::Half* ksp, const at::Half* vsp,
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
  const int64_t split = FP8 ? Hkv : kv_head_jobs(B, Hkv, lp, Hkv * 2 * (D + 2 * NGR), kv_grouped_bound(kv_grouped_default()));
  const int64_t HJ = Hkv / split, HG = HJ * G;
  at::parallel_for(0, B * split, 1, [&](int64_t begin, int64_t end) {
    // the thread's buffers, kept from call to call (paged_rows.h's Scratch; every element is
    // written before it is read): the query in float, its int8 codes, their sums and scales,
    // K's columns, the scores, V's scales, the sums
    thread_local Scratch<float> qf_buf, qscale_buf, score_buf, vscale_buf, acc_buf, inv_buf;
    thread_local Scratch<int8_t> qq_buf;
    thread_local Scratch<int32_t> qsum_buf, qwords_buf;
    thread_local Scratch<uint32_t> wpair_buf;  // V's weights, bf16 pairs (softmax_pairs)
    thread_local Scratch<__m512> smax_buf;  // each head's largest score, of the tokens a lane holds
    thread_local Scratch<__m512i> col_buf;
    thread_local Scratch<__m512> colv_buf;  // fp8: [d][16 tokens] fp32
    float* qf = qf_buf.get(HG * D);
    float* qscale = qscale_buf.get(HG * NGR);
    float* acc = acc_buf.get(HG * D);
    __m512* smax = smax_buf.get(HG);
    float* inv = inv_buf.get(HG);  // each head's 1 / its sum of exp (softmax_pairs)
    int8_t* qq = qq_buf.get(HG * D);
    int32_t* qsum = qsum_buf.get(HG * NGR);
    int32_t* qwords = qwords_buf.get(HG * D / 4);  // the codes as qk_int8's WORDS takes them (8 heads a pass)
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
      const int64_t LS = (L + 15) / 16 * 16, LP = LS / 2;
      float* vs = vscale_buf.get(HJ * NGR * LS);
      for (int64_t g = 0; g < HG; ++g) smax[g] = _mm512_set1_ps(-INFINITY);
      const bool eight = !FP8 && GS == 32 && G % 8 == 0;  // int8 scores 8 heads a pass (see qk_int8)
      if constexpr (!FP8)
        for (int64_t g = 0; g < HG; ++g) quantize_query(qf + g * D, D, GS, scale, qq + g * D, qsum + g * NGR, qscale + g * NGR);
      if (eight)  // each 8 heads' codes by quads of dims (qk_int8's WORDS)
        for (int64_t g0 = 0; g0 < HG; g0 += 8) query_words<8>(qq + g0 * D, D, qwords + g0 * D / 4);
      const __m512 unit_scale = _mm512_set1_ps(code_unit * scale);
      for (int64_t t0 = 0; t0 < L; t0 += 16) {
        const int64_t n = std::min<int64_t>(16, L - t0);
        alignas(64) int64_t rows16[16];
        alignas(64) float ks[16 * 64];  // [group][token], up to 64 groups
        for (int64_t i = 0; i < 16; ++i) rows16[i] = rows[t0 + std::min<int64_t>(i, n - 1)];  // tail lanes repeat a valid token
        const bool in_block = n == 16 && BS % 16 == 0;  // the chunk's tokens: 16 consecutive of one block
        // the rows (into L2 or L1: paged_rows.h) and scales of the chunk KV_PREFETCH_TOKENS ahead (the scales' gather waited on
        // memory: fetching them a chunk ahead measured 1.13x for int8 over 22 layers at 4,096
        // tokens, Xeon), and V's into L2 for the pass after the scores (int8, 2 Zen 5 cores,
        // alternated as prefetch_rows says, with its first window: 160 tokens 1.12x, 1,100
        // 1.08x, 1,900 1.035x; the bf16 kernel measured 0.95x with it at 1,900 and does not)
        const int64_t ahead_end = std::min<int64_t>(L, t0 + KV_PREFETCH_TOKENS + 16);
        const int64_t ahead = std::min<int64_t>(ahead_end, t0 + KV_PREFETCH_TOKENS);
        // (a chunk of 16 in one block: its scales lie in one stretch, each line fetched once; a
        // fetch a token was 4 of every line at 4 KV heads, and the fetch loops a fifth of the
        // scores' samples with one head a job. 2-core Zen 4, 8 layers' pools alternated in one
        // process, 7 rounds: 16 x 4,096 tokens 1.035x, 1 x 4,096 1.12x, 4 x 1,024 1.15x. Until
        // paged_rows.h's prefetch_line the compiler deleted these lambdas' fetch loops: what
        // that measured was the loops gone; the scales' fetch running against none, shuffled
        // pools 16 x 4,096 1.10x, 4 x 1,024 level, ordered 0.99x. Within a block the rows
        // are fetched by a stride, prefetch_chunk_rows.)
        const bool ahead_in_block = ahead_end - ahead == 16 && BS % 16 == 0;
        auto fetch_scales = [&](const at::Half* sp, auto hint) {
          if (ahead_in_block)
            prefetch_stretch<hint()>(sp + rows[ahead] * NGR, sp + (rows[ahead_end - 1] + HJ) * NGR);
          else
            prefetch_rows<hint()>(sp, rows.data(), ahead, ahead_end, 2 * NGR, HJ);
        };
        prefetch_chunk_rows<kv_hint<L2>>(kp, rows.data(), ahead, ahead_end, D, HJ, BS, Hkv);
        fetch_scales(ksp, std::integral_constant<_mm_hint, _MM_HINT_T0>{});
        if (HJ == 1) prefetch_chunk_rows<_MM_HINT_T1>(vp, rows.data(), ahead, ahead_end, D, HJ, BS, Hkv);
        fetch_scales(vsp, std::integral_constant<_mm_hint, _MM_HINT_T0>{});  // (read in this loop, below)
        for (int64_t j = 0; j < HJ; ++j) {
          token_scales16(ksp + j * NGR, rows16, NGR, ks, in_block ? Hkv : 0, h0 + j);
          // V's scales of the chunk too, for the softmax pass: group-major, vs[gi * LS + t], times the
          // codes' unit (lanes past L: a valid token's). Their own pass over the tokens afterwards
          // cost 1.03-1.04x (in one process alternating both, 60 rounds, 2-core AMD EPYC Zen 4).
          alignas(64) float vk[16 * 64];
          token_scales16(vsp + j * NGR, rows16, NGR, vk, in_block ? Hkv : 0, h0 + j);
          for (int64_t gi = 0; gi < NGR; ++gi)
            _mm512_storeu_ps(vs + (j * NGR + gi) * LS + t0,
                             FP8 ? _mm512_mul_ps(_mm512_load_ps(vk + gi * 16), _mm512_set1_ps(code_unit)) : _mm512_load_ps(vk + gi * 16));
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
                case 1: qk_fp8<1>(colf, q, D, GS, ks, unit_scale, s, L, n, smax + j * G + g0); break;
                case 2: qk_fp8<2>(colf, q, D, GS, ks, unit_scale, s, L, n, smax + j * G + g0); break;
                case 3: qk_fp8<3>(colf, q, D, GS, ks, unit_scale, s, L, n, smax + j * G + g0); break;
                default: qk_fp8<4>(colf, q, D, GS, ks, unit_scale, s, L, n, smax + j * G + g0);
              }
            } else {
              const int32_t* q = reinterpret_cast<const int32_t*>(qq + (j * G + g0) * D);
              const int32_t* qs = qsum + (j * G + g0) * NGR;
              const float* qfs = qscale + (j * G + g0) * NGR;
              if (eight)
                qk_int8<8, 8, true>(col, qwords + (j * G + g0) * D / 4, qs, qfs, D, GS, ks, s, L, n, smax + j * G + g0);
              else
                switch (std::min<int64_t>(4, G - g0)) {
                  case 1: qk_int8<1>(col, q, qs, qfs, D, GS, ks, s, L, n, smax + j * G + g0); break;
                  case 2: qk_int8<2>(col, q, qs, qfs, D, GS, ks, s, L, n, smax + j * G + g0); break;
                  case 3: qk_int8<3>(col, q, qs, qfs, D, GS, ks, s, L, n, smax + j * G + g0); break;
                  default: qk_int8<4>(col, q, qs, qfs, D, GS, ks, s, L, n, smax + j * G + g0);
                }
            }
          }
        }
      }
      // the softmax's exponentials times V's scales, bf16 pairs (softmax_pairs), each head's sum of them
      uint32_t* wp = wpair_buf.get(HJ * NGR * G * LP);
      for (int64_t j = 0; j < HJ; ++j)
        for (int64_t g0 = 0; g0 < G; g0 += 8) {
          const int64_t h = j * G + g0;
          with_heads(std::min<int64_t>(8, G - g0), [&](auto ng) {
            softmax_pairs<decltype(ng)::value>(&scores[h * L], L, smax + h, vs + j * NGR * LS, LS, NGR, G,
                                               wp + j * NGR * G * LP + 8 * g0, G * LP, inv + h);
          });
        }
      for (int64_t h = 0; h < HG; ++h) inv[h] = inv[h] > 0.f ? 1.f / inv[h] : 0.f;  // each head's sum -> 1 / it (no tokens: zeros)
      std::fill(acc, acc + HG * D, 0.f);
      // a job of several heads in runs of PV_CODE_TOKENS (paged_rows.h's PV_TOKENS, for rows of 1-byte codes)
      const int64_t run = HJ == 1 ? L : PV_CODE_TOKENS;
      for (int64_t t0 = 0; t0 < L; t0 += run) {
        const int64_t t1 = std::min<int64_t>(L, t0 + run);
        for (int64_t j = 0; j < HJ; ++j)
          pv_pairs<FP8, L2>(G, vp + j * D, rows.data(), t0, t1, L, D, wp + j * NGR * G * LP, G * LP, GS, acc + j * G * D,
                            BS % 2 == 0 ? Hkv * D : 0);
      }
      for (int64_t g = 0; g < HG; ++g)
        for (int64_t d = 0; d < D; ++d) op[(b * Hq + h0 * G + g) * D + d] = static_cast<T>(acc[g * D + d] * inv[g]);
    }
  });
}

// attend_fetching with K's and V's rows fetched into L2 or L1 as this CPU takes them (paged_rows.h)
template <typename T, bool FP8, typename... Args>
void attend(Args... args) {
  if (kv_fetch_into_l2())
    attend_fetching<T, FP8, true>(args...);
  else
    attend_fetching<T, FP8, false>(args...);
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
