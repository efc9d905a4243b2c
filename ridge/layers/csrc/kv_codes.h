// Reading an int8 / fp8 KV cache's codes (kv/cache.py), for the decode kernels that do
// (decode_attention_quant.cpp, decode_attention_shared.cpp): one definition, so both read
// the same values and quantize the query the same way.
#pragma once
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kv_query.h"

// 16 fp8 e4m3 codes -> 16 fp32 values / 256: e4m3's bits placed in an fp16 (sign to bit 15,
// exponent and mantissa to bits 7-13) read as the same number divided by 2^8, subnormals too.
inline __m512 fp8x16(const uint8_t* p) {
  const __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i mag = _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7F)), 7);
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x80)), 8);
  return _mm512_cvtph_ps(_mm256_or_si256(mag, sign));
}

// fp8x16's value unit: its outputs times this are the codes' values
constexpr float FP8_CODE_UNIT = 256.f;

inline __m512 int8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

inline float half_to_float(const at::Half* p) { return _cvtsh_ss(*reinterpret_cast<const uint16_t*>(p)); }
