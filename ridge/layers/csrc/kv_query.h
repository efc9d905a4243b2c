// The query of a decode attention over an int8 KV cache quantized to int8 too, for every CPU
// kernel that reads such a cache with integer dot products (AVX-512: decode_attention_quant.cpp,
// decode_attention_shared.cpp, through kv_codes.h; AVX2: avx2_ops.cpp): one definition, so all
// compute the same scores. Plain C++: it builds for any target.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

// The query of one head to int8 per group of GS dims (scale s = amax / 127 of the group), as
// llama.cpp quantizes Q to q8_0 against a q8_0 cache. qsum holds -128 times each group's code
// sum (the start of its dot products against K's codes + 128); qf the group's s times the
// attention scale.
inline void quantize_query(const float* q, int64_t D, int64_t GS, float scale, int8_t* codes, int32_t* qsum, float* qf) {
  for (int64_t gi = 0; gi < D / GS; ++gi) {
    const float* x = q + gi * GS;
    float amax = 0.f;
    for (int64_t d = 0; d < GS; ++d) amax = std::max(amax, std::fabs(x[d]));
    const float inv = amax > 0 ? 127.f / amax : 0.f;
    int32_t sum = 0;
    for (int64_t d = 0; d < GS; ++d) {
      const int32_t c = static_cast<int32_t>(std::nearbyint(x[d] * inv));
      codes[gi * GS + d] = static_cast<int8_t>(c);
      sum += c;
    }
    qsum[gi] = -128 * sum;
    qf[gi] = amax / 127.f * scale;
  }
}
