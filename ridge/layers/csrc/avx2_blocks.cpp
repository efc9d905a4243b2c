// The block formats' matmul for CPUs with AVX2 but without AVX-512 BF16/VNNI (AMD Zen 2 and 3,
// Intel's client cores up to Raptor Lake, ...): y = x @ W^T (+ bias), W in any of llama.cpp's
// block formats (ridge/quantization/formats.py), read as the GGUF bytes the layer holds: no
// repacking, no conversion to a wider format. One extension of its own (ridge_cpu_avx2), built
// with AVX2/FMA/F16C only; the AVX-512 kernels (linear_quant.cpp) are the other extension.
//
// How a call runs:
// - x is quantized to int8 once per call, per 32 k (llama.cpp's Q8_0 activations: scale
//   amax / 127), keeping per 16 k the sum of its codes.
// - Each group of 32 weights is unpacked into 32 byte codes in one register: unsigned (0-63)
//   for the formats with an offset or a minimum, signed for Q8_0 and the IQ4 codebook's values
//   (those multiply through vpsignb, since vpmaddubsw takes one unsigned operand).
// - vpmaddubsw with an x row's codes, then vpmaddwd with the group's integer sub-scales (one
//   per 16 weights: lanes 0-3 of the result hold weights 0-15), into float lanes times the
//   block's fp16 factor and the x group's scale.
// - An offset (Q4_0's 8, Q6_K's 32, Q3_K's 4) and a minimum (Q4_1, Q4_K, Q5_K, Q2_K) come out
//   of the sums of x's codes: one scalar a group and row. (The sums of x itself would take the
//   minimum exactly but leave the codes' products, all of one sign, with the activations'
//   error: on a 2-layer model 0.5 nats off float32's log-probabilities, against 0.03 so.)
// - A group is unpacked once for up to 4 rows of x. Every output (row of x, row of W) is
//   computed by one thread, in the same order whatever the batch: a row's output does not
//   depend on the rows beside it. It is a sum of its blocks' sums as a tree (tree_sum), so a
//   layer split by tensor parallelism sums to the unsplit layer's outputs exactly.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t QK = 32;  // weights per group (a block, or a K-quant's sub-block)
constexpr int MAX_ROWS = 4;  // rows of x a group is unpacked for at once
constexpr int64_t ROW_CHUNK = 16;  // rows of W a thread takes at a time (their bytes stay in L2 across x's rows)

// llama.cpp's kvalues_iq4nl (formats.py IQ4_NL_VALUES)
alignas(16) constexpr int8_t IQ4_NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                  1,    13,   25,  38,  53,  69,  89,  113};

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 16 bytes of nibbles -> 32 codes: byte j's low nibble is element j, its high one element j + 16
inline __m256i nibbles16(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}

// bits `bit` of 32 bytes -> `value` where set, 0 where not
inline __m256i bit_as(__m256i bytes, int bit, int value) {
  const __m256i mask = _mm256_set1_epi8(static_cast<char>(1 << bit));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, mask), mask), _mm256_set1_epi8(value));
}

// 2-bit fields at bit 2j of 32 bytes, as bytes 0-3
inline __m256i two_bits(__m256i bytes, int j) {
  return _mm256_and_si256(_mm256_srli_epi16(bytes, 2 * j), _mm256_set1_epi8(3));
}

// int16 sub-scales: a for weights 0-15, b for 16-31
inline __m256i scales16(int a, int b) {
  return _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(b)), _mm_set1_epi16(static_cast<int16_t>(a)));
}

// One unpacked group, handed to the dot product: the weight w_l = d * s_h * (code_l - offset)
// - dmin * m_h, h = l / 16 (s_h the integer sub-scale in `scales`; offset and m_h 0 where the
// format has none).
struct Group {
  __m256i codes;
  __m256i scales;
  float d;
  int32_t offset_a, offset_b;  // offset * s_h, the part of the codes' sum to take back
  int32_t min_a, min_b;        // m_h
  float dmin;
};

// Each format: its block's weights and bytes, whether its codes are signed, whether it has an
// offset, a minimum, a minimum per 16 weights (else per 32: MIN16), and
// groups(block, sink) calling sink(j, Group) for the block's groups j in order.
struct Q8_0 {
  static constexpr int64_t BLOCK = 32, BYTES = 34;
  static constexpr bool SIGNED = true, OFFSET = false, MIN = false, MIN16 = false;
  template <class Sink>
  static void groups(const uint8_t* p, Sink&& sink) {
    sink(0, Group{load32(p + 2), scales16(1, 1), f16(p), 0, 0, 0, 0, 0.f});
  }
};

struct Q4_0 {
  static constexpr int64_t BLOCK = 32, BYTES = 18;
  static constexpr bool SIGNED = false, OFFSET = true, MIN = false, MIN16 = false;
  template <class Sink>
  static void groups(const uint8_t* p, Sink&& sink) {
    sink(0, Group{nibbles16(p + 2), scales16(1, 1), f16(p), 8, 8, 0, 0, 0.f});
  }
};

struct Q4_1 {
  static constexpr int64_t BLOCK = 32, BYTES = 20;
  static constexpr bool SIGNED = false, OFFSET = false, MIN = true, MIN16 = false;
  template <class Sink>
  static void groups(const uint8_t* p, Sink&& sink) {
    // w = d q + m: a minimum of -1 times m
    sink(0, Group{nibbles16(p + 4), scales16(1, 1), f16(p), 0, 0, -1, -1, f16(p + 2)});
  }
};

struct IQ4_NL {
  static constexpr int64_t BLOCK = 32, BYTES = 18;
  static constexpr bool SIGNED = true, OFFSET = false, MIN = false, MIN16 = false;
  template <class Sink>
  static void groups(const uint8_t* p, Sink&& sink) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_NL_VALUES)));
    sink(0, Group{_mm256_shuffle_epi8(table, nibbles16(p + 2)), scales16(1, 1), f16(p), 0, 0, 0, 0, 0.f});
  }
};

// Q4_K's and Q5_K's 12 bytes of 6-bit (scale, min) pairs for the 8 sub-blocks
inline __attribute__((always_inline)) void k_scales(const uint8_t* q, int sc[8], int m[8]) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = q[j] & 63;
    m[j] = q[j + 4] & 63;
    sc[j + 4] = (q[j + 8] & 15) | ((q[j] >> 6) << 4);
    m[j + 4] = (q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4);
  }
}

struct Q4_K {
  static constexpr int64_t BLOCK = 256, BYTES = 144;
  static constexpr bool SIGNED = false, OFFSET = false, MIN = true, MIN16 = false;
  template <class Sink>
  static void groups(const uint8_t* p, Sink&& sink) {
    const float d = f16(p), dmin = f16(p + 2);
    int sc[8], m[8];
    k_scales(p + 4, sc, m);
    const __m256i low = _mm256_set1_epi8(15);
    for (int c = 0; c < 4; ++c) {  // run c of 32 bytes: sub-block 2c low, 2c + 1 high
      const __m256i v = load32(p + 16 + 32 * c);
      const int j = 2 * c;
      sink(j, Group{_mm256_and_si256(v, low), scales16(sc[j], sc[j]), d, 0, 0, m[j], m[j], dmin});
      sink(j + 1, Group{_mm256_and_si256(_mm256_srli_epi16(v, 4), low), scales16(sc[j + 1], sc[j + 1]), d, 0, 0,
                        m[j + 1], m[j + 1], dmin});
    }
  }
};

struct Q5_K {
  static constexpr int64_t BLOCK = 256, BYTES = 176;
  static constexpr bool SIGNED = false, OFFSET = false, MIN = true, MIN16 = false;
  template <class Sink>
  static void groups(const uint8_t* p, Sink&& sink) {
    const float d = f16(p), dmin = f16(p + 2);
    int sc[8], m[8];
    k_scales(p + 4, sc, m);
    const __m256i qh = load32(p + 16), low = _mm256_set1_epi8(15);
    for (int c = 0; c < 4; ++c) {  // Q4_K's nibbles; bit j of qh[l] adds 16 to sub-block j's element l
      const __m256i v = load32(p + 48 + 32 * c);
      const int j = 2 * c;
      sink(j, Group{_mm256_or_si256(_mm256_and_si256(v, low), bit_as(qh, j, 16)), scales16(sc[j], sc[j]), d, 0, 0,
                    m[j], m[j], dmin});
      sink(j + 1, Group{_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), bit_as(qh, j + 1, 16)),
                        scales16(sc[j + 1], sc[j + 1]), d, 0, 0, m[j + 1], m[j + 1], dmin});
    }
  }
};

struct IQ4_XS {
  static constexpr int64_t BLOCK = 256, BYTES = 136;
  static constexpr bool SIGNED = true, OFFSET = false, MIN = false, MIN16 = false;
  template <class Sink>
  static void groups(const uint8_t* p, Sink&& sink) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_NL_VALUES)));
    const float d = f16(p);
    const int high = p[2] | (p[3] << 8);
    for (int j = 0; j < 8; ++j) {
      const int s = (((p[4 + j / 2] >> (4 * (j % 2))) & 15) | (((high >> (2 * j)) & 3) << 4)) - 32;
      sink(j, Group{_mm256_shuffle_epi8(table, nibbles16(p + 8 + 16 * j)), scales16(s, s), d, 0, 0, 0, 0, 0.f});
    }
  }
};

struct Q6_K {
  static constexpr int64_t BLOCK = 256, BYTES = 210;
  static constexpr bool SIGNED = false, OFFSET = true, MIN = false, MIN16 = false;
  template <class Sink>
  static void groups(const uint8_t* p, Sink&& sink) {
    const float d = f16(p + 208);
    const int8_t* scale = reinterpret_cast<const int8_t*>(p + 192);
    const __m256i low = _mm256_set1_epi8(15);
    for (int h = 0; h < 2; ++h) {  // each half: 64 bytes of low nibbles, 32 of top 2-bit pairs, 8 scales
      const __m256i a = load32(p + 64 * h), b = load32(p + 64 * h + 32), top = load32(p + 128 + 32 * h);
      const __m256i nib[4] = {_mm256_and_si256(a, low), _mm256_and_si256(b, low),
                              _mm256_and_si256(_mm256_srli_epi16(a, 4), low),
                              _mm256_and_si256(_mm256_srli_epi16(b, 4), low)};
      const int8_t* s = scale + 8 * h;
      for (int i = 0; i < 4; ++i) {
        const __m256i codes = _mm256_or_si256(nib[i], _mm256_slli_epi16(two_bits(top, i), 4));
        sink(4 * h + i, Group{codes, scales16(s[2 * i], s[2 * i + 1]), d, 32 * s[2 * i], 32 * s[2 * i + 1], 0, 0, 0.f});
      }
    }
  }
};

struct Q3_K {
  static constexpr int64_t BLOCK = 256, BYTES = 110;
  static constexpr bool SIGNED = false, OFFSET = true, MIN = false, MIN16 = false;
  template <class Sink>
  static void groups(const uint8_t* p, Sink&& sink) {
    const float d = f16(p + 108);
    const uint8_t* sc = p + 96;
    int s[16];
    for (int i = 0; i < 16; ++i)
      s[i] = (((sc[i % 8] >> (4 * (i / 8))) & 15) | (((sc[8 + i % 4] >> (2 * (i / 4))) & 3) << 4)) - 32;
    const __m256i hmask = load32(p);
    for (int n = 0; n < 2; ++n) {  // 32 bytes of 2-bit codes per 4 sub-blocks; hmask's bit g: the code's 4
      const __m256i q = load32(p + 32 + 32 * n);
      for (int j = 0; j < 4; ++j) {
        const int g = 4 * n + j;
        const __m256i codes = _mm256_or_si256(two_bits(q, j), bit_as(hmask, g, 4));  // q + 4, 0-7
        sink(g, Group{codes, scales16(s[2 * g], s[2 * g + 1]), d, 4 * s[2 * g], 4 * s[2 * g + 1], 0, 0, 0.f});
      }
    }
  }
};

struct Q2_K {
  static constexpr int64_t BLOCK = 256, BYTES = 84;
  static constexpr bool SIGNED = false, OFFSET = false, MIN = true, MIN16 = true;
  template <class Sink>
  static void groups(const uint8_t* p, Sink&& sink) {
    const float d = f16(p + 80), dmin = f16(p + 82);
    const uint8_t* sc = p;  // per 16 weights: scale in the low nibble, min in the high one
    for (int n = 0; n < 2; ++n) {
      const __m256i q = load32(p + 16 + 32 * n);
      for (int j = 0; j < 4; ++j) {
        const int g = 4 * n + j, a = sc[2 * g], b = sc[2 * g + 1];
        sink(g, Group{two_bits(q, j), scales16(a & 15, b & 15), d, 0, 0, a >> 4, b >> 4, dmin});
      }
    }
  }
};

// x quantized for a call: per row K int8 codes, a scale per 32, the sum of the codes per 16 and
// per 32. Each array has 8 groups' room past its end: a run of 8 blocks at a row's end reads
// them (with zero weight codes).
struct QuantizedX {
  static constexpr int64_t PAD = 8;
  int64_t M = 0, K = 0, G = 0;  // G: groups of 32 a row
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> qsum16, qsum32;

  const int8_t* codes(int64_t m) const { return q.data() + m * K; }
  const float* scales(int64_t m) const { return scale.data() + m * G; }
  const int32_t* qsums16(int64_t m) const { return qsum16.data() + m * 2 * G; }
  const int32_t* qsums32(int64_t m) const { return qsum32.data() + m * G; }
};

inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const at::BFloat16* x) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int32_t hsum(__m128i v) {
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(v);
}

template <class T>
void quantize_x(const T* x, int64_t M, int64_t K, QuantizedX& out) {
  out.M = M, out.K = K, out.G = K / QK;
  const int64_t pad = QuantizedX::PAD;
  out.q.assign(M * K + pad * QK, 0), out.scale.assign(M * K / QK + pad, 0.f);
  out.qsum16.assign(M * K / 16 + 2 * pad, 0), out.qsum32.assign(M * K / QK + pad, 0);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  at::parallel_for(0, M * (K / QK), 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {  // group i of the M x K/32
      const int64_t m = i / (K / QK), g = i % (K / QK);
      const T* src = x + m * K + g * QK;
      __m256 v[4];
      __m256 amax = _mm256_setzero_ps();
      for (int k = 0; k < 4; ++k) v[k] = load8(src + 8 * k), amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[k]));
      __m128 a = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      a = _mm_max_ps(a, _mm_movehl_ps(a, a));
      a = _mm_max_ss(a, _mm_movehdup_ps(a));
      const float d = _mm_cvtss_f32(a) / 127.f, id = d > 0.f ? 1.f / d : 0.f;
      __m256i q[4];
      for (int k = 0; k < 4; ++k)
        q[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[k], _mm256_set1_ps(id)),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      // int32 x 32 -> int8 x 32 in order (packs interleave the 128-bit lanes: permute them back)
      const __m256i w16a = _mm256_packs_epi32(q[0], q[1]), w16b = _mm256_packs_epi32(q[2], q[3]);
      const __m256i b8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16a, w16b),
                                                     _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q.data() + m * K + g * QK), b8);
      out.scale[i] = d;
      for (int h = 0; h < 2; ++h) {
        const __m256i s = _mm256_add_epi32(q[2 * h], q[2 * h + 1]);
        out.qsum16[2 * i + h] = hsum(_mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1)));
      }
      out.qsum32[i] = out.qsum16[2 * i] + out.qsum16[2 * i + 1];
    }
  });
}

// The sums of 8 vectors' lanes (integers: in any order), as one vector
inline __m256i sums_of_8(const __m256i v[8]) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// The 8 lanes' sum of products of int32 vectors a and b per 16 k (a group's two halves, 8
// groups) -> one int32 a group
inline __m256i group_sums(const int32_t* a, const int32_t* b) {
  const __m256i lo = _mm256_mullo_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(a)),
                                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
  const __m256i hi = _mm256_mullo_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(a + 8)),
                                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 8)));
  return _mm256_permute4x64_epi64(_mm256_hadd_epi32(lo, hi), 0xD8);  // groups 0-7 in order
}

// One super-block's sum for rows [m0, m0 + R) of x (block b of a K-quant row at w): c[r * nb]
// each. Its 8 groups' integer sums (sub-scales applied) go into one vector, less the offsets'
// parts, times d and each x group's scale; less the minimums' parts; then across the lanes in
// a fixed order.
template <class F, int R>
void super_block_sums(const uint8_t* w, int64_t b, int64_t nb, const QuantizedX& x, int64_t m0, float* c) {
  __m256i codes[8], scales[8];
  alignas(32) int32_t offsets[16], mins[16];
  float d = 0.f, dmin = 0.f;
  F::groups(w + b * F::BYTES, [&](int j, const Group& grp) {
    codes[j] = grp.codes, scales[j] = grp.scales, d = grp.d, dmin = grp.dmin;
    if (F::OFFSET) offsets[2 * j] = grp.offset_a, offsets[2 * j + 1] = grp.offset_b;
    if (F::MIN && F::MIN16) mins[2 * j] = grp.min_a, mins[2 * j + 1] = grp.min_b;
    if (F::MIN && !F::MIN16) mins[j] = grp.min_a;  // one a group: times x's sums per 32
  });
  __m256i u[8];
  for (int j = 0; j < 8; ++j) u[j] = F::SIGNED ? _mm256_sign_epi8(codes[j], codes[j]) : codes[j];
  for (int r = 0; r < R; ++r) {
    const int8_t* xq = x.codes(m0 + r) + b * F::BLOCK;
    __m256i dots[8];
    for (int j = 0; j < 8; ++j) {
      __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + QK * j));
      if (F::SIGNED) xv = _mm256_sign_epi8(xv, codes[j]);
      dots[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(u[j], xv), scales[j]);
    }
    __m256i dot = sums_of_8(dots);
    const int32_t* qs = x.qsums16(m0 + r) + 16 * b;
    if (F::OFFSET) dot = _mm256_sub_epi32(dot, group_sums(offsets, qs));
    const __m256 dx = _mm256_loadu_ps(x.scales(m0 + r) + 8 * b);
    __m256 sums = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(d), dx), _mm256_cvtepi32_ps(dot));
    if (F::MIN) {  // with x's codes, as the products: the weights' own (q d - min) times x's codes
      const __m256i m = F::MIN16 ? group_sums(mins, qs)
                                 : _mm256_mullo_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(mins)),
                                                      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                                          x.qsums32(m0 + r) + 8 * b)));
      sums = _mm256_sub_ps(sums, _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(dmin), dx), _mm256_cvtepi32_ps(m)));
    }
    c[r * nb] = hsum(sums);
  }
}

// Blocks [b0, b0 + 8) of a row of 32-weight blocks (fewer at the row's end: n): each block's
// sum for rows [m0, m0 + R) of x into c[r * nb + b], and the 8's pairwise sum (the tree's
// subtree of 8) into c8[r * nb8 + b0 / 8]. A block's codes are unpacked once for all rows.
// (FULL: n is 8, the loops' bounds known to the compiler.)
template <class F, int R, bool FULL>
void block_sums_8(const uint8_t* w, int64_t b0, int n, int64_t nb, const QuantizedX& x, int64_t m0, float* c,
                  float* c8, int64_t nb8) {
  if (FULL) n = 8;
  __m256i codes[8];
  alignas(32) float d[8] = {}, mins[8] = {};
  alignas(32) int32_t offsets[8] = {};
  for (int i = 0; i < 8; ++i) {
    codes[i] = _mm256_setzero_si256();
    if (FULL || i < n)
      F::groups(w + (b0 + i) * F::BYTES, [&](int, const Group& grp) {
        codes[i] = grp.codes, d[i] = grp.d;
        if (F::MIN) mins[i] = grp.dmin * grp.min_a;
        if (F::OFFSET) offsets[i] = grp.offset_a;
      });
  }
  const __m256 dv = _mm256_load_ps(d), minv = _mm256_load_ps(mins);
  const __m256i offv = _mm256_load_si256(reinterpret_cast<const __m256i*>(offsets));
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r) {
    const int8_t* xq = x.codes(m0 + r) + b0 * QK;  // blocks past the row's end: zero codes above
    __m256i dots[8];
    for (int i = 0; i < 8; ++i) {
      const __m256i u = F::SIGNED ? _mm256_sign_epi8(codes[i], codes[i]) : codes[i];
      __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + QK * i));
      if (F::SIGNED) xv = _mm256_sign_epi8(xv, codes[i]);
      dots[i] = _mm256_madd_epi16(_mm256_maddubs_epi16(u, xv), ones);
    }
    __m256i dot = sums_of_8(dots);
    const __m256 dx = _mm256_loadu_ps(x.scales(m0 + r) + b0);
    const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.qsums32(m0 + r) + b0));
    if (F::OFFSET) dot = _mm256_sub_epi32(dot, _mm256_mullo_epi32(offv, qs));
    __m256 sums = _mm256_mul_ps(_mm256_mul_ps(dv, dx), _mm256_cvtepi32_ps(dot));
    if (F::MIN) sums = _mm256_sub_ps(sums, _mm256_mul_ps(_mm256_mul_ps(dx, minv), _mm256_cvtepi32_ps(qs)));
    if (FULL) {
      _mm256_storeu_ps(c + r * nb + b0, sums);
    } else {
      alignas(32) float out[8];
      _mm256_store_ps(out, sums);
      for (int i = 0; i < n; ++i) c[r * nb + b0 + i] = out[i];
    }
    if (FULL) {  // ((c0 + c1) + (c2 + c3)) + ((c4 + c5) + (c6 + c7))
      const __m256 pairs = _mm256_hadd_ps(sums, sums), quads = _mm256_hadd_ps(pairs, pairs);
      c8[r * nb8 + b0 / 8] = _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(quads), _mm256_extractf128_ps(quads, 1)));
    }
  }
}

// The sum of blocks [b, b + n) of one row's block sums c (c8: its aligned runs of 8, summed),
// as a tree: an even count is the sum of its two halves' sums; an odd one adds in order. A
// row-parallel layer split in 2 (or 4, ...) at block boundaries then adds the same float sums
// as the unsplit layer: tensor parallelism's all-reduce gives the single process's outputs bit
// for bit, where a sum in another order would not (and the next layer's int8 activations would
// round some of them the other way).
float tree_sum(const float* c, const float* c8, int64_t b, int64_t n) {
  if (n == 8 && c8 != nullptr && b % 8 == 0) return c8[b / 8];
  if (n == 2) return c[b] + c[b + 1];
  if (n == 4) return (c[b] + c[b + 1]) + (c[b + 2] + c[b + 3]);
  if (n % 2) {
    float s = c[b];
    for (int64_t i = 1; i < n; ++i) s += c[b + i];
    return s;
  }
  return tree_sum(c, c8, b, n / 2) + tree_sum(c, c8, b + n / 2, n / 2);
}

// Rows [m0, m0 + R) of x against one row of W (its blocks at w): y[r] for each. buf: 
// scratch of R * (nb + nb / 8 + 1) floats.
template <class F, int R>
void dot_row(const uint8_t* w, int64_t nb, const QuantizedX& x, int64_t m0, float* buf, float* y) {
  float* c = buf;
  const int64_t nb8 = nb / 8 + 1;
  float* c8 = buf + R * nb;
  if constexpr (F::BLOCK == QK) {
    for (int64_t b0 = 0; b0 < nb; b0 += 8)
      if (nb - b0 >= 8)
        block_sums_8<F, R, true>(w, b0, 8, nb, x, m0, c, c8, nb8);
      else
        block_sums_8<F, R, false>(w, b0, static_cast<int>(nb - b0), nb, x, m0, c, c8, nb8);
  } else {
    for (int64_t b = 0; b < nb; ++b) super_block_sums<F, R>(w, b, nb, x, m0, c + b);
  }
  for (int r = 0; r < R; ++r) y[r] = tree_sum(c + r * nb, F::BLOCK == QK ? c8 + r * nb8 : nullptr, 0, nb);
}

template <class F>
void gemm(const QuantizedX& x, const uint8_t* blocks, int64_t row_bytes, int64_t N, float* y) {
  const int64_t M = x.M, nb = x.K / F::BLOCK;
  at::parallel_for(0, N, ROW_CHUNK, [&](int64_t begin, int64_t end) {
    float out[MAX_ROWS];
    std::vector<float> buf(MAX_ROWS * (nb + nb / 8 + 1));
    for (int64_t n0 = begin; n0 < end; n0 += ROW_CHUNK) {
      const int64_t n1 = std::min(end, n0 + ROW_CHUNK);
      for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
        const int64_t rows = std::min<int64_t>(MAX_ROWS, M - m0);
        for (int64_t n = n0; n < n1; ++n) {
          const uint8_t* w = blocks + n * row_bytes;
          switch (rows) {
            case 1: dot_row<F, 1>(w, nb, x, m0, buf.data(), out); break;
            case 2: dot_row<F, 2>(w, nb, x, m0, buf.data(), out); break;
            case 3: dot_row<F, 3>(w, nb, x, m0, buf.data(), out); break;
            default: dot_row<F, 4>(w, nb, x, m0, buf.data(), out); break;
          }
          for (int64_t r = 0; r < rows; ++r) y[(m0 + r) * N + n] = out[r];
        }
      }
    }
  });
}

// GGUF's tensor type ids (formats.py's ggml_type): the one table this file keeps
template <class Fn>
bool with_format(int64_t ggml_type, Fn&& fn) {
  switch (ggml_type) {
    case 8: fn(Q8_0{}); return true;
    case 2: fn(Q4_0{}); return true;
    case 3: fn(Q4_1{}); return true;
    case 20: fn(IQ4_NL{}); return true;
    case 12: fn(Q4_K{}); return true;
    case 13: fn(Q5_K{}); return true;
    case 23: fn(IQ4_XS{}); return true;
    case 14: fn(Q6_K{}); return true;
    case 11: fn(Q3_K{}); return true;
    case 10: fn(Q2_K{}); return true;
    default: return false;
  }
}

}  // namespace

bool supports_format(int64_t ggml_type) {
  return with_format(ggml_type, [](auto) {});
}

// x (..., K) float32 or bf16; blocks (N, K / BLOCK * BYTES) uint8, GGUF's bytes of W's rows
torch::Tensor linear_blocks(torch::Tensor x, torch::Tensor blocks, int64_t ggml_type, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu(), "linear_blocks: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "linear_blocks: bf16 or f32 x");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte, "linear_blocks: blocks must be (N, bytes) uint8");
  const int64_t K = x.size(-1), N = blocks.size(0);
  torch::Tensor y;
  const bool known = with_format(ggml_type, [&](auto fmt) {
    using F = decltype(fmt);
    TORCH_CHECK(K % F::BLOCK == 0, "linear_blocks: K = ", K, " is not a multiple of the format's block, ", F::BLOCK);
    const int64_t row_bytes = K / F::BLOCK * F::BYTES;
    TORCH_CHECK(blocks.size(1) == row_bytes, "linear_blocks: blocks of ", blocks.size(1), " bytes a row, K = ", K,
                " needs ", row_bytes);
    const torch::Tensor x2 = x.reshape({-1, K}).contiguous();
    const int64_t M = x2.size(0);
    QuantizedX qx;
    if (x2.scalar_type() == at::kFloat)
      quantize_x(x2.data_ptr<float>(), M, K, qx);
    else
      quantize_x(x2.data_ptr<at::BFloat16>(), M, K, qx);
    const torch::Tensor w = blocks.contiguous();
    y = torch::empty({M, N}, x.options().dtype(at::kFloat));
    if (M > 0) gemm<F>(qx, w.data_ptr<uint8_t>(), row_bytes, N, y.data_ptr<float>());
  });
  TORCH_CHECK(known, "linear_blocks: GGUF type ", ggml_type, " has no AVX2 kernel");
  if (bias) y.add_(bias->to(at::kFloat));
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return y.to(x.scalar_type()).view(shape);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("linear_blocks", &linear_blocks, py::call_guard<py::gil_scoped_release>(),
        "y = x @ W.T (+ bias), W as GGUF blocks of the given GGUF type (AVX2)");
  m.def("supports_format", &supports_format, "whether linear_blocks takes this GGUF type");
}
