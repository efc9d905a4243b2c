// Vector math the kernels share (decode_ops.cpp, decode_attention_shared.cpp,
// decode_attention_quant.cpp, linear_quant.cpp): one definition, so their roundings and exp
// agree.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

// acc + w . (the 4 int8 at x, broadcast): vpdpbusd (w unsigned, x signed) with its x operand an
// embedded broadcast from memory, one fused op; GCC emits a separate vpbroadcastd for
// _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(*x)). Measured on a 2-core Xeon (2026-11-27,
// linear_quant.cpp's weights from memory, the same process alternating both builds of the
// loop) 1.06-1.10x faster at one row in Q6_K, 1.10-1.16x at 8 rows in Q6_K, Q3_K and Q2_K;
// the same integers either way.
inline __m512i dpbusd_x(__m512i acc, __m512i w, const int32_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
  return acc;
}

// round 16 fp32 to bf16 precision, staying in fp32 (torch's bf16 ops round every result)
inline __m512 round16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// e^x for 16 lanes: Cephes' expf polynomial on x - n ln2, scaled by 2^n (rel. error ~1e-7).
// Below ln(FLT_MIN) it is 0, not a subnormal: a softmax whose scores span more than 87 gives
// its far tokens subnormal probabilities, and every multiply-add that then reads one takes a
// microcode assist (measured: decode attention over such a context ran 30x slower).
inline __m512 exp512(__m512 x) {
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33654475f), _CMP_GE_OQ);
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-88.3762626647949f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(normal, _mm512_scalef_ps(p, n));
}

// e^x for the 16 lanes of x <= 0 (a softmax's scores minus their maximum) that `lanes` holds, 0
// in the others and below ln(FLT_MIN) (as exp512): exp512's reduction, 1 + r + r^2 P(r) with P
// of degree 3 (least squares on [-ln2/2, ln2/2]; rel. error under 2e-7 evaluated in fp32,
// against exp512's ~1e-7 at two more multiply-adds), and no clamps: x <= 0 needs no upper one,
// and a lane below ln(FLT_MIN), whatever its reduction gives, is zeroed by the final scalef's
// mask. In the int8 decode attention's softmax, against a lower clamp and a masked move after (in
// one process alternating both, 60 rounds, 2-core AMD EPYC Zen 4): 1.02-1.025x.
inline __m512 exp512_nonpos(__m512 x, __mmask16 lanes) {
  const __mmask16 normal = _mm512_mask_cmp_ps_mask(lanes, x, _mm512_set1_ps(-87.33654475f), _CMP_GE_OQ);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.008333842270076275f), r, _mm512_set1_ps(0.04189859703183174f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.1666688621044159f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.49999141693115234f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_scalef_ps(normal, p, n);
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

// 16 rows of row_bytes (a multiple of 4; row i at base + rows16[i] * row_bytes) as columns of
// 4-byte words: col[p] lane i = row i's word p, xor flip. The decode kernels' K chunks, tokens
// in lanes (bf16 dim pairs, or int8 codes + 128 with flip 0x80 a byte). Each row is loaded in
// 64-byte pieces (the last one masked) and transposed in registers: a gather per word cost far
// more than the rows it read.
inline void row_columns(const uint8_t* base, const int64_t* rows16, int64_t row_bytes, __m512i flip, __m512i* col) {
  const int64_t words = row_bytes / 4;
  for (int64_t c0 = 0; c0 < words; c0 += 16) {
    const int64_t w = std::min<int64_t>(16, words - c0);
    const __mmask16 m = static_cast<__mmask16>((1u << w) - 1);
    __m512i r[16], c[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_maskz_loadu_epi32(m, base + rows16[i] * row_bytes + 4 * c0);
    transpose16(r, c);
    // a whole pass's 16 columns stored from registers: through the loop of w, with the bf16
    // kernel's zero flip, GCC copied the columns by `rep movsq` from a stack copy (bf16
    // attention, in one process alternating both, 40-60 rounds: 16 x 4,096 tokens 1.01x, 1 x
    // 4,096 1.025x; int8 level, 2-core AMD EPYC Zen 4)
    if (w == 16)
      for (int j = 0; j < 16; ++j) _mm512_store_si512(col + c0 + j, _mm512_xor_si512(c[j], flip));
    else
      for (int64_t j = 0; j < w; ++j) _mm512_store_si512(col + c0 + j, _mm512_xor_si512(c[j], flip));
  }
}
