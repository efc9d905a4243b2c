// write_kv for an int8 / fp8 pool (kv/cache.py's quantize, then the two index_copy_s), for the
// decode plans of both extensions (decode_layers.cpp, avx2_plan.cpp): scalar code, no vector
// instructions, so one definition compiles into each. Rows t of x (T, H, D; rows x_stride
// apart) into slots[t] of the pool, each group of D / G values as codes under one fp16 scale
// (G groups of a head in the scales' last dimension). The arithmetic is quantize's, op for op:
// amax / qmax rounded to fp16, 1 / scale in fp32 (0 where the scale is 0), codes rounded half
// to even and clamped (int8) or clamped and rounded to e4m3 (fp8).
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

inline void write_kv_quant_into(uint8_t* cp, at::Half* scp, int64_t num_slots, int64_t H, int64_t D, int64_t G,
                                const at::BFloat16* xp, int64_t x_stride, const int64_t* sp, int64_t T, bool fp8) {
  const int64_t gs = D / G;
  const float qmax = fp8 ? 448.0f : 127.0f;
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "write_kv_quant_: slot ", sp[t], " out of the pool");
    for (int64_t h = 0; h < H; ++h) {
      const at::BFloat16* src = xp + t * x_stride + h * D;
      uint8_t* codes = cp + (sp[t] * H + h) * D;
      at::Half* sc = scp + (sp[t] * H + h) * G;
      for (int64_t g = 0; g < G; ++g) {
        float amax = 0.f;
        for (int64_t i = 0; i < gs; ++i) amax = std::max(amax, std::fabs(static_cast<float>(src[g * gs + i])));
        const at::Half scale(amax / qmax);
        const float s = static_cast<float>(scale);
        const float inv = s > 0.f ? 1.0f / s : 0.f;
        sc[g] = scale;
        for (int64_t i = 0; i < gs; ++i) {
          const float v = static_cast<float>(src[g * gs + i]) * inv;
          if (fp8) {
            codes[g * gs + i] = c10::Float8_e4m3fn(std::min(std::max(v, -448.0f), 448.0f)).x;
          } else {
            const float r = std::min(std::max(std::nearbyint(v), -127.0f), 127.0f);
            codes[g * gs + i] = static_cast<uint8_t>(static_cast<int8_t>(r));
          }
        }
      }
    }
  }
}
