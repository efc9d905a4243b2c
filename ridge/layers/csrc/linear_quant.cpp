// y = x @ w^T (+ bias) for weights in llama.cpp's block formats (Q8_0, Q4_0, Q4_1, IQ4_NL, IQ4_XS, Q4_K,
// Q5_K, Q6_K, Q3_K, Q2_K), with
// integer dot products (AVX-512 VNNI, vpdpbusd): x is quantized per row to int8 in blocks
// of 32 (as llama.cpp quantizes activations to Q8_0; for the K-quants per super-block of
// 256, as its Q8_K), so one instruction does 64 multiply-adds (twice vdpbf16ps) and W is read
// in its own 2.6-8.5 bits per weight.
//
// Packing (once, at load) regroups a GGUF tensor's blocks into blocks of 16 output rows so
// that one 64-byte load holds 4 consecutive k of 16 rows, what vpdpbusd takes:
//
//   for each block of 16 rows nb:  [ G weight chunks ][ G x 16 fp16 d ]( [ G x 16 fp16 m ] Q4_1 )
//   weight chunk of group g (32 k):
//     int8   [ 8 quads j ][ 16 rows r ][ 4 k t ]  u8 = q + 128       at k = 32g + 4j + t
//     int4   [ 4 quads j ][ 16 rows r ][ 4 k t ]  low nibble  k = 32g + 4j + t
//                                                 high nibble k = 32g + 16 + 4j + t
//
// (a GGUF Q4 block's byte i already holds elements i and i + 16: the nibble bytes move as
// they are). A block of 16 rows is contiguous, its weight chunks 64-byte aligned, and it
// holds exactly the GGUF bytes of its 16 rows: the kernel reads what the file holds, no more.
//
// vpdpbusd multiplies unsigned by signed bytes: W is the unsigned side (codes 0..15, or the
// int8 code + 128) and x the signed one; the offset comes back out with the x block's sum:
//   sum_k (q_k - off) x_k = sum_k q_k x_k - off * sum_k x_k         (off = 128, 8 or 0)
//   Q4_1: sum_k (q_k d + m) x_k = d sum_k q_k x_k + m sum_k x_k
//   Q4_K: sum_k (d sc q_k - dmin m) x_k per group of 32, d sc and dmin m from 6-bit codes
//   Q5_K: the same with 5-bit codes, each code's fifth bit from a plane of one bit per weight
//   IQ4_NL: a code is an index into a 16-value int8 table (non-linear steps); one vpshufb per
//   64 codes looks them up as table + 128 (unsigned), and off = 128 takes the 128 back out;
//   IQ4_XS: the same codes, each group scaled by its super-block's d times a 6-bit code - 32
//   Q6_K: 6-bit codes (off = 32), each half group (16 k) scaled by its own int8 times d
//   Q3_K: 3-bit codes (off = 4), each half group scaled by d times a 6-bit code - 32
//   Q2_K: 2-bit codes, each half group's d sc q - dmin m with 4-bit sc and m: the minimum
//   multiplies the half's sum of x
//   (with x = dx * xq per block of x: every sum above is an integer times dx; where x's
//   block is a super-block, Q3_K's and Q2_K's half sums times their integer scales add up as
//   integers over it)
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "amx.h"
#include "block_runs.h"
#include "kernels.h"
#include "linear_call.h"
#include "simd_math.h"
#include "step_parts.h"

namespace {

enum Format : int64_t { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, IQ4_NL = 3, Q4_K = 4, IQ4_XS = 5, Q6_K = 6, Q5_K = 7, Q3_K = 8, Q2_K = 9 };

constexpr bool is_super_block(int64_t fmt) { return fmt >= Q4_K; }  // K-quants and IQ4_XS: super-blocks of 256
constexpr bool scale_per_16(int64_t fmt) { return fmt == Q6_K || fmt == Q3_K || fmt == Q2_K; }  // not per 32
// x quantized per super-block of 256 (one scale a row and super-block, as llama.cpp's Q8_K
// for the K-quants), not per 32: a super-block's integer sums then add up, each group's (or
// half group's) times its integer scale, and leave the integers once per super-block instead
// of a float op chain per group and row. A half group's sum of 16 products that fits int16
// (Q2_K, Q3_K) is paired with its neighbour and scaled by one vpdpwssd; Q5_K's group sums and
// Q6_K's half sums (16 x 63 x 127) pass int16 and take a vpmulld. Against x per 32 and a float
// scale per group, 2-core AMD EPYC Zen 4, 22 layers' weights from memory, alternated: Q6_K
// (with its new planes, pack_q6_k) 1.9-2.0x at 8 rows, 0.97-1.16x at one row; Q5_K 1.10-1.36x
// at 8 rows, 0.92-1.22x at one row. Q4_K keeps x per 32: taken per 256 (1.05-1.13x at 8 rows)
// it moved the KL divergence of Q4_K_M's file from 1.02x llama.cpp's to 1.06x (README, stop 91).
constexpr bool x_per_superblock(int64_t fmt) {
  return fmt == Q5_K || fmt == Q6_K || fmt == Q3_K || fmt == Q2_K;
}

// IQ4_NL's table (llama.cpp's kvalues_iq4nl) plus 128: the unsigned bytes vpdpbusd multiplies
alignas(16) constexpr uint8_t IQ4_NL_TABLE[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};

constexpr int64_t QK = 32;     // weights per block
constexpr int64_t ROWS = 16;   // output rows per packed block
constexpr int64_t SLAB = 128;  // rows of x per pass over W for prefill (x slab stays in L2)
// Software prefetch: each tile fetches its weights L2_PREFETCH_AHEAD bytes ahead into L2 (one-row
// tiles as far as the policy's quant_far_kib says), and
// L1_PREFETCH_GROUPS groups ahead into L1 where the process's policy says (linear_call.h; each
// CPU's and what it measured in prefetch.cpp).
// Tiles of at least this many rows (12 or 16) take AMX-INT8 where the CPU has it (see amx_chunk_dots)
constexpr int64_t AMX_INT8_MIN_MR = 12;

struct Layout {
  int64_t type_size, wbytes, chunk, off;  // chunk: bytes per group of 32 k in a block of 16 rows
  bool nibbles, has_min;
};

constexpr Layout layout_of(int64_t fmt) {
  switch (fmt) {
    case Q8_0: return {34, 512, 512 + 32, 128, false, false};
    case Q4_0: return {18, 256, 256 + 32, 8, true, false};
    case Q4_1: return {20, 256, 256 + 64, 0, true, true};
    case IQ4_NL: return {18, 256, 256 + 32, 128, true, false};
    // per 256 k (a super-block): 144 bytes in the file, 16 x 144 in a block of 16 rows
    case Q4_K: return {144, 256, 256 + 32, 0, true, true};
    case Q5_K: return {176, 320, 320 + 32, 0, true, true};  // Q4_K's + a 64-byte bit plane per group
    case IQ4_XS: return {136, 256, 256 + 16, 128, true, false};  // per 256 k: 136 bytes
    case Q6_K: return {210, 384, 384 + 36, 32, true, false};  // per 256 k: 210 bytes
    case Q3_K: return {110, 192, 192 + 28, 4, false, false};  // per 256 k: 110 bytes (3 bit planes per group)
    case Q2_K: return {84, 128, 128 + 40, 0, false, true};    // per 256 k: 84 bytes (2 bit planes per group)
  }
  TORCH_CHECK(false, "unknown block format ", fmt);
}

// x of one tile, quantized and laid out as the kernel reads it (group-major, then row):
//   q[(g * 8 + j) * MR + i]  4 int8 of row i at k = 32g + 4j .. +3, as one int32
//   d[g * MR + i]            row i's scale of group g
//   s[g * MR + i]            d * sum_k q (the block's x as quantized), for Q4_1
struct XTile {
  int64_t row0, rows, mr;
  int32_t* q;
  float* d;
  float* s;
  int32_t* qs;  // -off * sum of codes (symmetric formats)
  int32_t* qsa;  // -off * sum of the first 16 codes (Q6_K, Q3_K: a scale per 16 k)
  int32_t* hs;  // the sums of the first and last 16 codes as int16 (low, high) (Q2_K: a minimum per 16 k)
  int8_t* xa;  // AMX only: the codes row-major, xa[(g * mr + i) * 32 + k] (an A tile per group)
};

template <typename T>
inline __m512 load16(const T* p);
template <>
inline __m512 load16<float>(const float* p) {
  return _mm512_loadu_ps(p);
}
template <>
inline __m512 load16<at::BFloat16>(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Lane j of the result: op over the 16 lanes of v[j], for 16 vectors at once (45 shuffles and
// ops, where reducing each alone takes ~8)
template <typename Op>
inline __m512i reduce16(const __m512i* v, Op op) {
  __m512i a[8], b[4], c[2];
  for (int k = 0; k < 8; ++k)  // each 128-bit lane: v[2k]'s partials at 0 and 2, v[2k+1]'s at 1 and 3
    a[k] = op(_mm512_unpacklo_epi32(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_epi32(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k)  // each 128-bit lane: one partial of v[4k .. 4k+3], in order
    b[k] = op(_mm512_unpacklo_epi64(a[2 * k], a[2 * k + 1]), _mm512_unpackhi_epi64(a[2 * k], a[2 * k + 1]));
  for (int k = 0; k < 2; ++k)  // 128-bit lanes: v[8k .. 8k+3] twice, then v[8k+4 .. 8k+7] twice
    c[k] = op(_mm512_shuffle_i32x4(b[2 * k], b[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
              _mm512_shuffle_i32x4(b[2 * k], b[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return op(_mm512_shuffle_i32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_i32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// One row of x -> int8 codes per block of ``span`` groups of 32 (1, or 8: a super-block), scale
// amax / 127, round to nearest. Each group's entries hold its block's scale.
//
// 16 groups at a time: their maxima and code sums leave the vectors together (reduce16), not
// one horizontal reduction each (three a group), and a one-row tile's codes are stored as they
// lie. 2 Zen 5 cores, Q4_K_M's decode steps: 0.44 us a call against 0.74 (the same bits).
template <typename T>
void quantize_row(const T* x, int64_t G, int64_t span, int64_t off, const XTile& t, int64_t i) {
  const auto max_op = [](__m512i p, __m512i q) {
    return _mm512_castps_si512(_mm512_max_ps(_mm512_castsi512_ps(p), _mm512_castsi512_ps(q)));
  };
  const auto add_op = [](__m512i p, __m512i q) { return _mm512_add_epi32(p, q); };
  const int64_t mr = t.mr;
  for (int64_t g0 = 0; g0 < G; g0 += 16) {
    const int64_t n = std::min<int64_t>(16, G - g0);  // groups g0 .. g0 + n; the rest of the 16 are zeros
    __m512i m[16];  // |x| of each group, 16 lanes (the larger of its two halves)
    for (int64_t j = 0; j < 16; ++j)
      m[j] = j < n ? _mm512_castps_si512(_mm512_max_ps(_mm512_abs_ps(load16(x + (g0 + j) * QK)),
                                                       _mm512_abs_ps(load16(x + (g0 + j) * QK + 16))))
                   : _mm512_setzero_si512();
    alignas(64) float amax[16];
    if (span == 1) {
      _mm512_store_si512(amax, reduce16(m, max_op));
    } else {  // one scale per span groups (g0 is a multiple of span: G and 16 are)
      for (int64_t s0 = 0; s0 < 16; s0 += span) {
        __m512 mm = _mm512_castsi512_ps(m[s0]);
        for (int64_t j = 1; j < span; ++j) mm = _mm512_max_ps(mm, _mm512_castsi512_ps(m[s0 + j]));
        const float v = _mm512_reduce_max_ps(mm);
        for (int64_t j = 0; j < span; ++j) amax[s0 + j] = v;
      }
    }
    const __m512 av = _mm512_load_ps(amax);
    alignas(64) float d[16], id[16];
    _mm512_store_ps(d, _mm512_div_ps(av, _mm512_set1_ps(127.f)));
    _mm512_store_ps(id, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(av, _mm512_setzero_ps(), _CMP_GT_OQ),
                                            _mm512_set1_ps(127.f), av));  // 0 where the block is all zeros
    __m512i first[16], both[16];  // the codes of k 0-15, and of all 32, to be summed
    for (int64_t j = 0; j < 16; ++j) {
      if (j >= n) {
        first[j] = both[j] = _mm512_setzero_si512();
        continue;
      }
      const int64_t g = g0 + j;
      const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x + g * QK), _mm512_set1_ps(id[j])));
      const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x + g * QK + 16), _mm512_set1_ps(id[j])));
      const __m128i ca = _mm512_cvtsepi32_epi8(qa), cb = _mm512_cvtsepi32_epi8(qb);
      if (mr == 1) {  // a group's 8 quads lie in 32 consecutive bytes
        _mm_storeu_si128(reinterpret_cast<__m128i*>(t.q + g * 8), ca);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(t.q + g * 8 + 4), cb);
      } else {
        alignas(16) int8_t codes[32];
        _mm_store_si128(reinterpret_cast<__m128i*>(codes), ca);
        _mm_store_si128(reinterpret_cast<__m128i*>(codes + 16), cb);
        for (int64_t q = 0; q < 8; ++q) std::memcpy(&t.q[(g * 8 + q) * mr + i], codes + 4 * q, 4);
      }
      if (t.xa) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(t.xa + (g * mr + i) * QK), ca);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(t.xa + (g * mr + i) * QK + 16), cb);
      }
      first[j] = qa, both[j] = _mm512_add_epi32(qa, qb);
    }
    alignas(64) int32_t first_sum[16], code_sum[16];
    _mm512_store_si512(first_sum, reduce16(first, add_op));
    _mm512_store_si512(code_sum, reduce16(both, add_op));
    for (int64_t j = 0; j < n; ++j) {
      const int64_t r = (g0 + j) * mr + i;
      t.d[r] = d[j];
      t.qs[r] = static_cast<int32_t>(-off * code_sum[j]);
      t.qsa[r] = static_cast<int32_t>(-off * first_sum[j]);
      t.hs[r] = static_cast<int32_t>(static_cast<uint16_t>(first_sum[j]) |
                                     (static_cast<uint32_t>(static_cast<uint16_t>(code_sum[j] - first_sum[j])) << 16));
      // Q4_1's minimum multiplies the sum of the *quantized* x (as llama.cpp's Q8_1 does): the
      // error is then sum_k w_k e_k, not sum_k q_k d e_k, whose terms all share one sign
      t.s[r] = d[j] * static_cast<float>(code_sum[j]);
    }
  }
}

// A GF(2) affine matrix (vgf2p8affineqb) moving ``count`` bits of each byte from bit ``in`` up
// to bit ``out`` up (zeros elsewhere): the matrix's byte 7 - o selects the input bits of output bit o.
constexpr uint64_t bit_move(int in, int out, int count) {
  uint64_t a = 0;
  for (int i = 0; i < count; ++i) a |= uint64_t{1} << (8 * (7 - (out + i)) + (in + i));
  return a;
}

struct NoFetch {
  __attribute__((always_inline)) void operator()() const {}
};

// A group's weights unpacked into w; after each of its 64-byte loads, loaded() (the group's
// fetches, one at a time: GroupFetches). SHIFT: the codes' bits are moved by shifts and masks
// instead of GFNI's affine byte transform. vgf2p8affineqb issues on the two pipes that run
// vpdpbusd (2-core AMD EPYC Zen 4, 2026-12-05, a loop of 12 independent vpdpbusd: 12.0 cycles;
// with 4 vgf2p8affineqb 16.7, with 4 vpsrlw, vpandd or vpshufb 12.3), so where the dot products
// bind, at 4 or more rows of x, shifts and masks (more ops, on the other pipes); at 1-2 rows,
// where the ops' count matters more, GFNI. On the 2-core Intel Xeon with AMX the shifts lost at
// 4-8 rows (they share port 0 with vpdpbusd there): which tiles take them is the process's
// policy (quant_shift_rows, linear_call.h; tile_block_policy). The same bytes either way.
template <int FMT, bool SHIFT = false, class Loaded = NoFetch>
__attribute__((always_inline)) inline void load_weights(const uint8_t* chunk, __m512i w[8], Loaded&& loaded = {}) {
  auto load = [&](const uint8_t* p) __attribute__((always_inline)) {
    const __m512i v = _mm512_loadu_si512(p);
    loaded();
    return v;
  };
  if constexpr (FMT == Q8_0) {
    for (int j = 0; j < 8; ++j) w[j] = load(chunk + 64 * j);
  } else if constexpr (FMT == Q5_K) {  // Q4_K's nibbles; bit q of plane byte p: quad q's fifth bit at p
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i plane = load(chunk + 256);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i v = load(chunk + 64 * j);
      const __m512i five = _mm512_set1_epi8(0x10);  // SHIFT: bits j and j + 4 of a plane byte to its bit 4
      const __m512i top_j = SHIFT ? _mm512_and_si512(_mm512_slli_epi16(plane, 4 - j), five)
                                  : _mm512_gf2p8affine_epi64_epi8(plane, _mm512_set1_epi64(static_cast<long long>(bit_move(j, 4, 1))), 0);
      const __m512i top_j4 =
          SHIFT ? _mm512_and_si512(_mm512_srli_epi16(plane, j), five)
                : _mm512_gf2p8affine_epi64_epi8(plane, _mm512_set1_epi64(static_cast<long long>(bit_move(j + 4, 4, 1))), 0);
      w[j] = _mm512_ternarylogic_epi32(v, top_j, low, 0xEC);                           // (v & 0x0F) | top
      w[j + 4] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), top_j4, low, 0xEC);  // (v >> 4 & 0x0F) | top
    }
  } else if constexpr (FMT == Q6_K) {  // six planes: quads 0-5's codes in bits 0-5 (see pack_q6_k), quads
    // 6 and 7 in the planes' bits 6-7, two bits from each of three planes: one GFNI op moves a
    // plane's two to their place (zeros elsewhere), one vpternlog joins three
    const __m512i code = _mm512_set1_epi8(0x3F);
    __m512i p[6];
    for (int j = 0; j < 6; ++j) p[j] = load(chunk + 64 * j);
    for (int j = 0; j < 6; ++j) w[j] = _mm512_and_si512(p[j], code);
    auto top = [](__m512i v, int out) __attribute__((always_inline)) {
      if constexpr (SHIFT) return _mm512_and_si512(_mm512_srli_epi16(v, 6 - out), _mm512_set1_epi8(static_cast<char>(3 << out)));
      return _mm512_gf2p8affine_epi64_epi8(v, _mm512_set1_epi64(static_cast<long long>(bit_move(6, out, 2))), 0);
    };
    w[6] = _mm512_ternarylogic_epi32(top(p[0], 0), top(p[1], 2), top(p[4], 4), 0xFE);  // a | b | c
    w[7] = _mm512_ternarylogic_epi32(top(p[2], 0), top(p[3], 2), top(p[5], 4), 0xFE);
  } else if constexpr (FMT == Q3_K) {  // 3-bit codes in three planes (see q3_k_place): one GFNI op
    // takes a quad's code out of its plane byte, two for quads 6 and 7, whose top bits lie apart
    const __m512i p0 = load(chunk), p1 = load(chunk + 64), p2 = load(chunk + 128);
    if constexpr (SHIFT) {  // code = plane byte >> at & 7; quads 6, 7: bits 6-7 | a bit of p2 at bit 2 (A | B & C)
      const __m512i b3 = _mm512_set1_epi8(7), b2 = _mm512_set1_epi8(3), b4 = _mm512_set1_epi8(4);
      const __m512i p[3] = {p0, p1, p2};
      for (int j = 0; j < 6; ++j) w[j] = _mm512_and_si512(j & 1 ? _mm512_srli_epi16(p[j >> 1], 3) : p[j >> 1], b3);
      w[6] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(p0, 6), b2), _mm512_srli_epi16(p2, 4), b4, 0xF8);
      w[7] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(p1, 6), b2), _mm512_srli_epi16(p2, 5), b4, 0xF8);
      return;
    }
    auto take = [](__m512i v, uint64_t a) { return _mm512_gf2p8affine_epi64_epi8(v, _mm512_set1_epi64(static_cast<long long>(a)), 0); };
    w[0] = take(p0, bit_move(0, 0, 3));
    w[1] = take(p0, bit_move(3, 0, 3));
    w[2] = take(p1, bit_move(0, 0, 3));
    w[3] = take(p1, bit_move(3, 0, 3));
    w[4] = take(p2, bit_move(0, 0, 3));
    w[5] = take(p2, bit_move(3, 0, 3));
    w[6] = _mm512_or_si512(take(p0, bit_move(6, 0, 2)), take(p2, bit_move(6, 2, 1)));
    w[7] = _mm512_or_si512(take(p1, bit_move(6, 0, 2)), take(p2, bit_move(7, 2, 1)));
  } else if constexpr (FMT == Q2_K) {  // 2-bit codes: plane P holds quads 4P .. 4P + 3 in bits 0-1 .. 6-7
    const __m512i planes[2] = {load(chunk), load(chunk + 64)};
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j)
      w[j] = SHIFT ? _mm512_and_si512(_mm512_srli_epi16(planes[j >> 2], 2 * (j & 3)), _mm512_set1_epi8(3))
                   : _mm512_gf2p8affine_epi64_epi8(planes[j >> 2], _mm512_set1_epi64(static_cast<long long>(bit_move(2 * (j & 3), 0, 2))), 0);
  } else {  // nibbles: the low ones masked, the high ones moved down by one GFNI op (or shift + mask)
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i high_nibble = _mm512_set1_epi64(static_cast<long long>(bit_move(4, 0, 4)));
    for (int j = 0; j < 4; ++j) {
      const __m512i v = load(chunk + 64 * j);
      w[j] = _mm512_and_si512(v, low);
      w[j + 4] = SHIFT ? _mm512_and_si512(_mm512_srli_epi16(v, 4), low) : _mm512_gf2p8affine_epi64_epi8(v, high_nibble, 0);
    }
    if constexpr (FMT == IQ4_NL || FMT == IQ4_XS) {  // codes -> table values (+ 128), 16 bytes per 128-bit lane
      const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_NL_TABLE)));
      for (int j = 0; j < 8; ++j) w[j] = _mm512_shuffle_epi8(table, w[j]);
    }
  }
}

// One block of 16 outputs for the MR rows of a tile: fp32 results into out[MR][16].
// Q4_K: a super-block's 6-bit codes for its 8 groups x 16 rows, unpacked into bytes with a
// few 512-bit byte ops (see pack_k_quant for their 192 bytes), and its fp16 d and dmin.
struct Q4KScales {
  alignas(64) uint8_t sc[128];  // [group][row]
  alignas(64) uint8_t m[128];
  __m512 d, dmin;
};

// 192 bytes of 6-bit codes (see pack_k_quant) -> out.sc, out.m
inline void unpack_codes6(const uint8_t* codes, Q4KScales& out) {
  const __m512i nib = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(3), twelve = _mm512_set1_epi8(12);
  const __m512i hv = _mm512_loadu_si512(codes + 128);
  const __m512i high[2] = {_mm512_and_si512(hv, nib), _mm512_and_si512(_mm512_srli_epi16(hv, 4), nib)};
  for (int half = 0; half < 2; ++half) {
    const __m512i low = _mm512_loadu_si512(codes + 64 * half);  // sc's low 4 bits | m's << 4
    const __m512i sc = _mm512_or_si512(_mm512_and_si512(low, nib), _mm512_slli_epi16(_mm512_and_si512(high[half], two), 4));
    const __m512i m = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(low, 4), nib),
                                      _mm512_slli_epi16(_mm512_and_si512(high[half], twelve), 2));
    _mm512_store_si512(out.sc + 64 * half, sc);
    _mm512_store_si512(out.m + 64 * half, m);
  }
}

__attribute__((always_inline)) inline void q4_k_superblock(const uint8_t* scales, int64_t G, int64_t s, Q4KScales& out) {
  const uint8_t* dd = scales + s * 64;
  unpack_codes6(scales + (G >> 3) * 64 + s * 192, out);
  out.d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dd)));
  out.dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dd + 32)));
}

// Q3_K: a super-block's 16 6-bit scale codes per row, in Q4_K's arrangement (group j's first
// half in sc, its second in m), and its fp16 d
inline void q3_k_superblock(const uint8_t* scales, int64_t G, int64_t s, Q4KScales& out) {
  unpack_codes6(scales + (G >> 3) * 32 + s * 192, out);
  out.d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + s * 32)));
}

// IQ4_XS: a super-block's 6-bit scale codes for its 8 groups x 16 rows as signed bytes (code
// - 32), and its fp16 d (see pack_iq4_xs for their 128 bytes).
inline void iq4_xs_superblock(const uint8_t* scales, int64_t G, int64_t s, Q4KScales& out) {
  const uint8_t* dd = scales + s * 32;
  const uint8_t* codes = scales + (G >> 3) * 32 + s * 96;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m256i three = _mm256_set1_epi8(3);
  const __m512i lv = _mm512_loadu_si512(codes);  // low 4 bits: code b (low nibble), b + 64 (high)
  const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64));  // 2 bits: b, b+32, b+64, b+96
  auto two_bits = [&](int shift) { return _mm256_and_si256(_mm256_srli_epi16(hv, shift), three); };
  const __m512i high[2] = {
      _mm512_inserti64x4(_mm512_castsi256_si512(two_bits(0)), two_bits(2), 1),
      _mm512_inserti64x4(_mm512_castsi256_si512(two_bits(4)), two_bits(6), 1),
  };
  const __m512i low[2] = {_mm512_and_si512(lv, nib), _mm512_and_si512(_mm512_srli_epi16(lv, 4), nib)};
  for (int half = 0; half < 2; ++half) {
    const __m512i code = _mm512_or_si512(low[half], _mm512_slli_epi16(high[half], 4));
    _mm512_store_si512(out.sc + 64 * half, _mm512_sub_epi8(code, _mm512_set1_epi8(32)));
  }
  out.d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dd)));
}

// ---- AMX-INT8 (Intel's tile unit: Sapphire Rapids and later) ------------------------------
//
// A weight chunk's 8 quads of 64 bytes ([16 rows][4 k] each) are AMX's B-tile rows for 32 k x
// 16 outputs as they lie, and the x codes of a group row-major (XTile::xa) an A tile of MR
// rows x 32 bytes: one tdpbsud (signed x, unsigned W) gives all MR rows' integer dot products
// of a group, what the VNNI loop builds with 8 vpdpbusd per row. The integers are exact
// either way, and the scales are applied to them by the same float ops in the same order, so
// the AMX path gives the VNNI path's results bit for bit (a row's output does not depend on
// which path or batch computed it).
//
// The scales per 32 k make every group's integers leave the tile before they are scaled (a
// tile store, ~4.4 ns here whatever its rows, about what 30 vpdpbusd cost), and the scaling
// per row is the VNNI loop's own: tiles pay only where a tile's rows are many. A tile op
// waits for the one before it (weights unpacked, stored, loaded, multiplied, the result
// stored and read back), so products come in chunks of 4 groups (C tiles 0-3; A tiles 4 and 5,
// B tiles 6 and 7 in turn) and the next chunk's are issued before this chunk's are scaled.
// Measured on a 2-core Intel Xeon with AMX (2026-11-25, benchmarks/quant_rows.py): 16-128 rows
// 1.28-1.39x the VNNI loop; 8 rows (zero-padded A tiles of two groups tried too) 0.96-1.04x;
// formats with a scale per 16 k (Q6_K, Q3_K, Q2_K: two stores a group) 0.6-0.9x. Those keep
// the VNNI loop (AMX_INT8_MIN_MR, amx_format).
constexpr int64_t AMX_CHUNK = 4;  // groups per chunk of products

constexpr bool amx_format(int64_t fmt) { return !scale_per_16(fmt); }

inline void configure_int8_tiles(int64_t rows) {
  TileConfig cfg;
  for (int t = 0; t < 4; ++t) cfg.rows[t] = static_cast<uint8_t>(rows), cfg.colsb[t] = 64;
  for (int t : {4, 5}) cfg.rows[t] = static_cast<uint8_t>(rows), cfg.colsb[t] = QK;
  for (int t : {6, 7}) cfg.rows[t] = 8, cfg.colsb[t] = 64;
  load_tile_config(cfg);
}

// Product d (0-3) of a chunk: x codes (stride 32) times a weight chunk (stride 64) into C tile
// d. (The intrinsics take tile numbers as literals; d is a constant once the caller unrolls.)
inline void amx_dot(int d, const int8_t* x, const uint8_t* w) {
  switch (d) {
    case 0: _tile_loadd(4, x, QK); _tile_loadd(6, w, 64); _tile_zero(0); _tile_dpbsud(0, 4, 6); break;
    case 1: _tile_loadd(5, x, QK); _tile_loadd(7, w, 64); _tile_zero(1); _tile_dpbsud(1, 5, 7); break;
    case 2: _tile_loadd(4, x, QK); _tile_loadd(6, w, 64); _tile_zero(2); _tile_dpbsud(2, 4, 6); break;
    default: _tile_loadd(5, x, QK); _tile_loadd(7, w, 64); _tile_zero(3); _tile_dpbsud(3, 5, 7);
  }
}

inline void amx_store(int d, int32_t* c) {
  switch (d) {
    case 0: _tile_stored(0, c, 64); break;
    case 1: _tile_stored(1, c, 64); break;
    case 2: _tile_stored(2, c, 64); break;
    default: _tile_stored(3, c, 64);
  }
}

// The chunk of groups from g0 (4, fewer at the end of K): group g0 + d's integer products for
// the tile's MR rows, row i at c + 256 d + 16 i.
template <int FMT, int64_t WB, int64_t MR>
inline void amx_chunk_dots(const uint8_t* block, const int8_t* xa, int64_t g0, int64_t G, int32_t* c) {
  const int64_t n = std::min<int64_t>(AMX_CHUNK, G - g0);
  alignas(64) uint8_t wbuf[AMX_CHUNK][512];
  const uint8_t* w[AMX_CHUNK];
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* chunk = block + (g0 + j) * WB;
    if constexpr (FMT == Q8_0) {
      w[j] = chunk;  // Q8_0's chunk is its B tile as it lies
    } else {
      __m512i q[8];
      load_weights<FMT>(chunk, q);
      for (int r = 0; r < 8; ++r) _mm512_store_si512(wbuf[j] + 64 * r, q[r]);
      w[j] = wbuf[j];
    }
  }
  memory_barrier();  // the tile loads read wbuf and the x codes (see amx.h)
#pragma GCC unroll 4
  for (int d = 0; d < AMX_CHUNK; ++d)
    if (d < n) amx_dot(d, xa + (g0 + d) * MR * QK, w[d]);
#pragma GCC unroll 4
  for (int d = 0; d < AMX_CHUNK; ++d)
    if (d < n) amx_store(d, c + d * 256);
}

// A group's fetches as quant_interleave issues them (linear_call.h): far_count lines from far
// (into L2, or prefetchnta) and near_count from near, near_step apart (into L1), the i-th of
// each right after the group's i-th weight load, the rest after its last. On the 2-core Xeon
// a loop of loads alone over 600 MB streamed 39 GB/s with one fetch after each load and 31
// with the same fetches in a run before each 4-8 loads, the form the loop had; the kernels
// gained 1.04-1.16x at 1-2 rows (prefetch.cpp). Every call is inlined: one left as a call
// made GCC keep the weights' vectors on the stack across it (0.7-0.98x).
struct GroupFetches {
  const char* far = nullptr;
  const char* near = nullptr;
  int64_t far_count = 0, near_count = 0, near_step = 64, at = 0;
  bool nta = false;
  __attribute__((always_inline)) void one(int64_t i) const {
    if (i < far_count) {
      if (nta)
        _mm_prefetch(far + 64 * i, _MM_HINT_NTA);
      else
        _mm_prefetch(far + 64 * i, _MM_HINT_T2);
    }
    if (i < near_count) _mm_prefetch(near + near_step * i, _MM_HINT_T0);
  }
  __attribute__((always_inline)) void next() { one(at++); }
  __attribute__((always_inline)) void rest() {
    for (const int64_t n = std::max(far_count, near_count); at < n; ++at) one(at);
  }
};

// dpbusd_x (simd_math.h) is used where a group's x codes are read per half group (Q6_K, Q3_K,
// Q2_K); the plain loop below measured 0.93-0.98x with it at 8 rows (int4) and keeps the
// intrinsics.

// SET1 (Q3_K tiles of q3_k_set1_rows to 8 rows, the process's policy: linear_call.h): each x
// is broadcast by its own vpbroadcastd, not by vpdpbusd's embedded broadcast (dpbusd_x). The
// same integers either way. 2 Zen 5 cores, 2026-11-28, benchmarks/prefetch.py over 22 layers'
// weights, 7 and 9 rounds alternated: Q3_K at 8 rows 1.077x and 1.082x (1.06-1.11), at 1-4 rows
// 0.99-1.01x, at 16 rows 0.96-0.97x; Q2_K gained at 4 rows (1.04-1.06x) but lost at 8 and 16
// (0.78-0.88x), so it keeps the embedded form. The 2-core Xeon measured the embedded form
// 1.10-1.16x faster at 8 rows (simd_math.h): its table and Zen 4's never take this.
template <int FMT, int MR, bool AMX, bool SET1, bool SHIFT, bool FAR_SCALES>
inline void tile_block(const uint8_t* block, int64_t G, const XTile& t, const uint8_t* pf_end, float* out) {
  constexpr int64_t WB = layout_of(FMT).wbytes, CHUNK = layout_of(FMT).chunk;  // a group's codes; its share of the block
  constexpr bool KQ = FMT == Q4_K || FMT == Q5_K;  // Q4_K's super-block scales and minimums
  constexpr bool MIN = FMT == Q4_1 || KQ;
  constexpr bool X256 = x_per_superblock(FMT);
  const int64_t S = G >> 3;  // super-blocks (K-quants)
  [[maybe_unused]] __m512 dk, dmink;  // Q6_K's d, Q2_K's d and dmin for the 16 rows
  __m512 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  [[maybe_unused]] __m512i isum[X256 ? MR : 1];  // X256: the super-block's integer sums
  [[maybe_unused]] alignas(64) int32_t mins[X256 ? 8 * 16 : 1];  // Q2_K, Q5_K: its groups' minimums, int16 pairs
  if constexpr (X256)
    for (int i = 0; i < MR; ++i) isum[i] = _mm512_setzero_si512();
  const uint8_t* scales = block + G * WB;
  [[maybe_unused]] Q4KScales sb;
  static_assert(!AMX || amx_format(FMT));
  [[maybe_unused]] alignas(64) int32_t cbuf[2][AMX_CHUNK * 256];  // AMX: this chunk's products, the next one's
  if constexpr (AMX) amx_chunk_dots<FMT, WB, MR>(block, t.xa, 0, G, cbuf[0]);
  constexpr int64_t near = L1_PREFETCH_GROUPS * WB;  // bytes ahead
  const bool near_on = MR >= (FMT == Q8_0 ? g_prefetch.int8_near_rows : g_prefetch.quant_near_rows);  // linear_call.h
  const bool near_every = near_on && g_prefetch.quant_near_every, near_first = near_on && !near_every;
  const bool far_nta = g_prefetch.quant_far_nta;
  const bool interleave = !AMX && g_prefetch.quant_interleave;
  constexpr bool far_scales = FAR_SCALES;  // the far fetch: the next block's scales only (quant_far_scales)
  // The far fetch line by line (quant_far_lines): each line of the window once, as the loop
  // reaches the bytes far_ahead before it, where the fixed CHUNK's lines a group fetch some lines
  // twice (a chunk is not whole lines). Only where it measured faster (prefetch.cpp): Q8_0
  // tiles, and one-row tiles of Q4_0, Q4_K, Q5_K and Q6_K; IQ4_XS, Q2_K and the 4-bit formats'
  // 2-8 row tiles lost with it.
  constexpr bool LINE_WALK = FMT == Q8_0 || (MR == 1 && (FMT == Q4_0 || FMT == Q4_K || FMT == Q5_K || FMT == Q6_K));
  const bool far_lines = LINE_WALK && g_prefetch.quant_far_lines;
  // how far ahead: one-row tiles as the policy says (Zen 5: 24 KiB, prefetch.cpp), others L2_PREFETCH_AHEAD
  const int64_t far_ahead = MR == 1 ? g_prefetch.quant_far_kib * 1024 : L2_PREFETCH_AHEAD;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* chunk = block + g * WB;
    if ((g & 7) == 0) {
      if constexpr (KQ) q4_k_superblock(scales, G, g >> 3, sb);
      if constexpr (FMT == IQ4_XS) iq4_xs_superblock(scales, G, g >> 3, sb);
      if constexpr (FMT == Q3_K) q3_k_superblock(scales, G, g >> 3, sb);
      if constexpr (FMT == Q6_K)
        dk = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + (g >> 3) * 32)));
      if constexpr (FMT == Q2_K) {
        dk = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + (g >> 3) * 64)));
        dmink = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + (g >> 3) * 64 + 32)));
      }
    }
    // far ahead, into L2, within this thread's run of W. The window walks the block's bytes,
    // codes and scales alike, CHUNK a group, so it covers every line once. (It walked the codes
    // alone, WB a group, which left each block's scales' length of lines past it unfetched: a
    // hole of 6-14% of the bytes that the loop then waited on; on 2 Zen 5 cores, one row over
    // 22 layers, 9 rounds alternated: int4 1.12x, Q4_K 1.10x, Q5_K 1.11x, Q3_K 1.14x, Q2_K
    // 1.16x, IQ4_XS 1.08x, Q6_K 1.04x, int8 1.01x.)
    GroupFetches fetches;
    // (The runs below could be GroupFetches' too; built that way, a 2-core Xeon's Q2_K one row
    // read 0.88x and 8 rows of int8 0.95x under the AMD and Intel tables without interleaving,
    // the two builds alternated in one process: the runs stay as they were.)
    if constexpr (far_scales) {  // the next block's scales, G groups' share each; the codes to the hardware
      const uint8_t* next_scales = block + G * CHUNK + G * WB;
      const int64_t lines = (G * (CHUNK - WB) + 63) / 64;
      for (int64_t l = g * lines / G; l < (g + 1) * lines / G && next_scales + 64 * l < pf_end; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(next_scales + 64 * l), _MM_HINT_T2);
    }
    if (interleave) {  // the same lines as below, issued one at a time between the group's loads
      if constexpr (!far_scales) {
        const uint8_t* far = block + far_ahead;
        const int64_t from = far_lines ? (g * CHUNK + 63) & ~int64_t{63} : g * CHUNK;
        const int64_t to = far_lines ? (g + 1) * CHUNK : g * CHUNK + (CHUNK + 63) / 64 * 64;
        const int64_t before_end = far + from < pf_end ? (pf_end - (far + from) + 63) / 64 : 0;
        fetches.far = reinterpret_cast<const char*>(far + from);
        fetches.far_count = from < to ? std::min<int64_t>((to - from + 63) / 64, before_end) : 0;
      }
      fetches.near = reinterpret_cast<const char*>(chunk + near);
      fetches.near_step = near_every ? 64 : 256;
      fetches.near_count = near_on ? (WB + fetches.near_step - 1) / fetches.near_step : 0;
      fetches.nta = far_nta;
    } else if constexpr (far_scales) {  // (fetched above)
    } else if (far_lines) {  // the lines that start in this group's bytes, far_ahead on (a block is 64-byte aligned)
      const uint8_t* far = block + far_ahead;
      for (int64_t at = (g * CHUNK + 63) & ~int64_t{63}; at < (g + 1) * CHUNK && far + at < pf_end; at += 64) {
        if (far_nta)  // the policy's hint (prefetch.cpp says where each was measured best)
          _mm_prefetch(reinterpret_cast<const char*>(far + at), _MM_HINT_NTA);
        else
          _mm_prefetch(reinterpret_cast<const char*>(far + at), _MM_HINT_T2);
      }
    } else if (const uint8_t* far = block + g * CHUNK + far_ahead; far < pf_end) {
      if (far_nta)
        for (int64_t line = 0; line < CHUNK; line += 64) _mm_prefetch(reinterpret_cast<const char*>(far + line), _MM_HINT_NTA);
      else
        for (int64_t line = 0; line < CHUNK; line += 64) _mm_prefetch(reinterpret_cast<const char*>(far + line), _MM_HINT_T2);
    }
    if (interleave) {  // (the near lines go with the far ones, between the loads)
    } else if (near_every) {  // near, into L1: every line of the group
      for (int64_t line = 0; line < WB; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(chunk + near + line), _MM_HINT_T0);
    } else if (near_first) {  // or its first line and the one 256 bytes on
      for (int64_t line = 0; line < WB; line += 256)
        _mm_prefetch(reinterpret_cast<const char*>(chunk + near + line), _MM_HINT_T0);
    }
    // the scales are a short second stream per block (2 KiB at K = 2048): the hardware
    // prefetcher hardly starts on it, so it is fetched ahead here (their misses stalled M = 1)
    if constexpr (KQ || FMT == Q3_K) {  // the next super-block's d (, dmin) and codes
      constexpr int64_t DD = KQ ? 64 : 32;
      if ((g & 7) == 2) {
        const uint8_t* next = scales + S * DD + ((g >> 3) + 1) * 192;
        _mm_prefetch(reinterpret_cast<const char*>(scales + ((g >> 3) + 1) * DD), _MM_HINT_T0);
        for (int line = 0; line < 3; ++line) _mm_prefetch(reinterpret_cast<const char*>(next + 64 * line), _MM_HINT_T0);
      }
    } else if constexpr (FMT == Q6_K || FMT == Q2_K) {  // per group 32 bytes of scales after the super-blocks' d
      constexpr int64_t DD = FMT == Q6_K ? 32 : 64;
      _mm_prefetch(reinterpret_cast<const char*>(scales + S * DD + (g + 4) * 32), _MM_HINT_T0);
      if ((g & 7) == 2) _mm_prefetch(reinterpret_cast<const char*>(scales + ((g >> 3) + 1) * DD), _MM_HINT_T0);
    } else if constexpr (FMT == IQ4_XS) {
      if ((g & 7) == 2) {
        const uint8_t* next = scales + S * 32 + ((g >> 3) + 1) * 96;
        _mm_prefetch(reinterpret_cast<const char*>(scales + ((g >> 3) + 1) * 32), _MM_HINT_T0);
        for (int line = 0; line < 2; ++line) _mm_prefetch(reinterpret_cast<const char*>(next + 64 * line), _MM_HINT_T0);
      }
    } else {
      _mm_prefetch(reinterpret_cast<const char*>(scales + (g + 4) * 32), _MM_HINT_T0);
    }
    if constexpr (FMT == Q4_1) _mm_prefetch(reinterpret_cast<const char*>(scales + (G + g + 4) * 32), _MM_HINT_T0);
    if (g + 8 == G) {  // the next block's first scales (a thread walks its blocks in order)
      const uint8_t* next_scales = block + G * CHUNK + G * WB;
      for (int line = 0; line < 4; ++line) _mm_prefetch(reinterpret_cast<const char*>(next_scales + 64 * line), _MM_HINT_T0);
    }
    __m512i w[8];
    [[maybe_unused]] const int32_t* dots = nullptr;  // AMX: this group's row i at dots + 16 i
    if constexpr (AMX) {
      const int64_t k = g / AMX_CHUNK, j = g % AMX_CHUNK;
      if (j == 0 && g + AMX_CHUNK < G)  // the next chunk's tile work, before this one is scaled
        amx_chunk_dots<FMT, WB, MR>(block, t.xa, g + AMX_CHUNK, G, cbuf[(k + 1) & 1]);
      dots = cbuf[k & 1] + j * 256;
    } else if (interleave) {
      load_weights<FMT, SHIFT>(chunk, w, [&]() __attribute__((always_inline)) { fetches.next(); });
      fetches.rest();
    } else {
      load_weights<FMT, SHIFT>(chunk, w);
    }
    if constexpr (X256) {  // Q5_K, Q6_K, Q3_K, Q2_K: integer sums over the super-block (see x_per_superblock)
      // sc01: the 16 rows' scales of k 0-15 (low int16) and 16-31 (high)
      [[maybe_unused]] __m512i sc01;
      [[maybe_unused]] __m512i sc0, sc1;  // Q6_K: the halves' int8 scales (Q5_K: sc0 the group's), an int32 lane a row
      if constexpr (FMT == Q5_K) {  // 6-bit scale and minimum a group; the minimums as (m, m) int16 pairs
        const int64_t j = (g & 7) * 16;
        sc0 = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(sb.sc + j)));
        const __m512i m = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(sb.m + j)));
        _mm512_store_si512(mins + 16 * (g & 7), _mm512_or_si512(m, _mm512_slli_epi32(m, 16)));
      } else if constexpr (FMT == Q6_K) {
        const uint8_t* sc = scales + S * 32 + g * 32;
        sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
        sc1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 16)));
      } else if constexpr (FMT == Q2_K) {  // a byte per row and half: 4-bit scale | 4-bit minimum << 4
        const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + S * 64 + g * 32)));
        sc01 = _mm512_and_si512(b, _mm512_set1_epi16(15));
        _mm512_store_si512(mins + 16 * (g & 7), _mm512_srli_epi16(b, 4));
      } else {  // Q3_K: 6-bit codes - 32 (sb.sc: k 0-15's, sb.m: k 16-31's)
        const int64_t j = (g & 7) * 16;
        const __m128i lo = _mm_load_si128(reinterpret_cast<const __m128i*>(sb.sc + j));
        const __m128i hi = _mm_load_si128(reinterpret_cast<const __m128i*>(sb.m + j));
        const __m256i both = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
        sc01 = _mm512_sub_epi16(_mm512_cvtepu8_epi16(both), _mm512_set1_epi16(32));
      }
      const int32_t* xq = t.q + g * 8 * MR;
      constexpr int RB = MR >= 4 ? 4 : MR;  // 2 chains a row (the halves), RB rows interleaved
#pragma GCC unroll 4  // isum indexed by constants (see the super-block's end)
      for (int i0 = 0; i0 < MR; i0 += RB) {
        __m512i s0[RB], s1[RB];
        for (int i = 0; i < RB; ++i) {
          if constexpr (FMT == Q3_K || FMT == Q6_K) {  // the offset (-off times the half's sum of x) starts each half's sum
            const int32_t qsa = t.qsa[g * MR + i0 + i];
            s0[i] = _mm512_set1_epi32(qsa), s1[i] = _mm512_set1_epi32(t.qs[g * MR + i0 + i] - qsa);
          } else if constexpr (AMX) {  // Q5_K's tile products (the same integers)
            s0[i] = _mm512_load_si512(dots + 16 * (i0 + i)), s1[i] = _mm512_setzero_si512();
          } else {
            s0[i] = s1[i] = _mm512_setzero_si512();
          }
        }
        for (int j = 0; j < 4 && !AMX; ++j)
          for (int i = 0; i < RB; ++i) {
            if constexpr (SET1) {
              s0[i] = _mm512_dpbusd_epi32(s0[i], w[j], _mm512_set1_epi32(xq[j * MR + i0 + i]));
              s1[i] = _mm512_dpbusd_epi32(s1[i], w[j + 4], _mm512_set1_epi32(xq[(j + 4) * MR + i0 + i]));
            } else {
              s0[i] = dpbusd_x(s0[i], w[j], xq + j * MR + i0 + i);
              s1[i] = dpbusd_x(s1[i], w[j + 4], xq + (j + 4) * MR + i0 + i);
            }
          }
        if constexpr (FMT == Q5_K) {  // a group's sum passes int16 (32 x 31 x 127): times its scale in int32
          for (int i = 0; i < RB; ++i)
            isum[i0 + i] = _mm512_add_epi32(isum[i0 + i], _mm512_mullo_epi32(_mm512_add_epi32(s0[i], s1[i]), sc0));
        } else if constexpr (FMT == Q6_K) {  // a half's sum passes int16: times its scale in int32
          for (int i = 0; i < RB; ++i)
            isum[i0 + i] = _mm512_add_epi32(
                isum[i0 + i], _mm512_add_epi32(_mm512_mullo_epi32(s0[i], sc0), _mm512_mullo_epi32(s1[i], sc1)));
        } else {
          for (int i = 0; i < RB; ++i)  // each half's sum fits int16: pair them, times their scales
            isum[i0 + i] = _mm512_dpwssd_epi32(
                isum[i0 + i], _mm512_mask_blend_epi16(0xAAAAAAAA, s0[i], _mm512_slli_epi32(s1[i], 16)), sc01);
        }
      }
      if ((g & 7) == 7) {  // the super-block's end: its sums leave the integers, once
        const __m512 d = FMT == Q2_K || FMT == Q6_K ? dk : sb.d;
        [[maybe_unused]] const __m512 dmin = FMT == Q2_K ? dmink : sb.dmin;
        // unrolled, so that isum and acc are indexed by constants and stay in registers:
        // this loop with Q2_K's inner one was left rolled, and both arrays went through the
        // stack every group (2 Zen 5 cores, 22 layers alternated in one process, 16 passes:
        // Q2_K 1.043x at 4 rows, 1.064x at 8, 1.03x at 16; Q3_K 1.00-1.02x; one row 1.00x)
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) {
          __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(isum[i]), d);
          if constexpr (FMT == Q2_K || FMT == Q5_K) {  // - dmin times each (half) group's minimum times its sum of x
            __m512i imin = _mm512_setzero_si512();
            for (int j = 0; j < 8; ++j)
              imin = _mm512_dpwssd_epi32(imin, _mm512_set1_epi32(t.hs[(g - 7 + j) * MR + i]), _mm512_load_si512(mins + 16 * j));
            v = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(imin), dmin, v);
          }
          acc[i] = _mm512_fmadd_ps(v, _mm512_set1_ps(t.d[g * MR + i]), acc[i]);
          isum[i] = _mm512_setzero_si512();
        }
      }
      continue;
    }
    // dw: the 16 rows' weight scale; mw: minimum
    __m512 dw, mw;
    if constexpr (KQ) {
      const int64_t j = (g & 7) * 16;
      dw = _mm512_mul_ps(sb.d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(sb.sc + j)))));
      mw = _mm512_mul_ps(sb.dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(sb.m + j)))));
    } else if constexpr (FMT == IQ4_XS) {
      const int64_t j = (g & 7) * 16;
      dw = _mm512_mul_ps(sb.d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(sb.sc + j)))));
    } else {
      dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + g * 32)));
    }
    if constexpr (FMT == Q4_1)
      mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + (G + g) * 32)));
    const int32_t* xq = t.q + g * 8 * MR;
    // A row's 8 vpdpbusd of a group are one or two chains of dependent ops (latency 5), and
    // two ports (Intel; one on Zen 4) need ~10 (~5) chains in flight to stay busy. The
    // out-of-order window does not reach the next row's chain while one row's wait, so the
    // chains of a few rows are interleaved in program order, 8 chains (8 rows x 1; 4 x 2 at
    // 4, 12 and 16 rows, where 8 rows' sums and the accumulators would not fit the registers).
    // Measured on a 2-core Xeon (VNNI, a TinyLlama layer): 8 rows 1.03-1.18x faster than row
    // by row, 4-64 rows 1.01-1.09x. Integer sums do not depend on their order, and each row's
    // float ops are the same ones in the same order: so are the results.
    if constexpr (AMX) {  // the sums come from the tile (this loop as it was: 0.88-0.94x as the one below in int4)
      for (int i = 0; i < MR; ++i) {
        __m512i s = MIN ? _mm512_setzero_si512() : _mm512_set1_epi32(t.qs[g * MR + i]);
        s = _mm512_add_epi32(s, _mm512_load_si512(dots + 16 * i));
        const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(t.d[g * MR + i]));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[i]);
        if constexpr (FMT == Q4_1) acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(t.s[g * MR + i]), acc[i]);
        if constexpr (KQ) acc[i] = _mm512_fnmadd_ps(mw, _mm512_set1_ps(t.s[g * MR + i]), acc[i]);
      }
      continue;
    }
    // RB rows at a time, CH chains a row
    constexpr int RB = MR <= 2 ? MR : MR == 8 ? 8 : 4;
    constexpr int CH = RB == 8 ? 1 : 2;
    for (int i0 = 0; i0 < MR; i0 += RB) {
      __m512i s[RB][CH];
      for (int i = 0; i < RB; ++i) {
        // the offset's correction (-off * sum of x codes) starts the sum: no extra op
        s[i][0] = MIN ? _mm512_setzero_si512() : _mm512_set1_epi32(t.qs[g * MR + i0 + i]);
        for (int c = 1; c < CH; ++c) s[i][c] = _mm512_setzero_si512();
      }
      for (int j = 0; j < 8; j += CH)
        for (int c = 0; c < CH; ++c)
          for (int i = 0; i < RB; ++i)
            s[i][c] = _mm512_dpbusd_epi32(s[i][c], w[j + c], _mm512_set1_epi32(xq[(j + c) * MR + i0 + i]));
      for (int i = 0; i < RB; ++i) {
        const int64_t r = g * MR + i0 + i;
        const __m512i sum = CH == 2 ? _mm512_add_epi32(s[i][0], s[i][CH - 1]) : s[i][0];
        const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(t.d[r]));
        acc[i0 + i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[i0 + i]);
        if constexpr (FMT == Q4_1) acc[i0 + i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(t.s[r]), acc[i0 + i]);
        if constexpr (KQ) acc[i0 + i] = _mm512_fnmadd_ps(mw, _mm512_set1_ps(t.s[r]), acc[i0 + i]);  // w = d sc q - dmin m
      }
    }
  }
  for (int i = 0; i < MR; ++i) _mm512_storeu_ps(out + i * 16, acc[i]);
}

// tile_block in the forms the process's policy picks for this tile (linear_call.h), read per
// call: Q3_K's x broadcast by its own vpbroadcastd (SET1, q3_k_set1_rows up to 8 rows), the
// codes unpacked by shifts and masks (SHIFT, quant_shift_rows; VNNI tiles of 4+ rows: one row
// with shifts read 0.87-0.93x on Zen 4, load_weights), the far fetch of the next block's scales
// alone (FAR_SCALES, quant_far_scales; VNNI tiles). Only the forms a tile can take are built,
// and each is its own loop: the far-scales test as a branch in the one loop cost the default
// form 2-14% at one row in L2 on a 2-core Xeon (int4, Q6_K, int8, Q4_K, against a build with
// that test a constant false; 3 builds alternated in one process), and as a form of its own
// nothing (within 4% of the constant's build).
constexpr bool set1_form(int fmt, int mr, bool amx) { return fmt == Q3_K && !amx && mr <= 8; }  // both broadcasts
constexpr bool shift_form(int mr, bool amx) { return !amx && mr >= 4; }

template <int FMT, int MR, bool AMX, bool FAR_SCALES>
inline void tile_block_forms(bool set1, bool shift, const uint8_t* block, int64_t G, const XTile& t,
                             const uint8_t* pf_end, float* out) {
  constexpr bool set1_loop = set1_form(FMT, MR, AMX), shift_loop = shift_form(MR, AMX);
  if (set1 && shift) return tile_block<FMT, MR, AMX, set1_loop, shift_loop, FAR_SCALES>(block, G, t, pf_end, out);
  if (set1) return tile_block<FMT, MR, AMX, set1_loop, false, FAR_SCALES>(block, G, t, pf_end, out);
  if (shift) return tile_block<FMT, MR, AMX, false, shift_loop, FAR_SCALES>(block, G, t, pf_end, out);
  tile_block<FMT, MR, AMX, false, false, FAR_SCALES>(block, G, t, pf_end, out);
}

template <int FMT, int MR, bool AMX>
inline void tile_block_policy(const uint8_t* block, int64_t G, const XTile& t, const uint8_t* pf_end, float* out) {
  const bool set1 = set1_form(FMT, MR, AMX) && MR >= g_prefetch.q3_k_set1_rows;
  const bool shift = shift_form(MR, AMX) && MR >= g_prefetch.quant_shift_rows;
  if constexpr (!AMX)
    if (g_prefetch.quant_far_scales) return tile_block_forms<FMT, MR, AMX, true>(set1, shift, block, G, t, pf_end, out);
  tile_block_forms<FMT, MR, AMX, false>(set1, shift, block, G, t, pf_end, out);
}

// y's rows are ldy apart (N, or H N for one head's outputs among H heads')
template <int FMT, int MR, bool AMX, typename T>
inline void run_tile(const XTile& t, const uint8_t* block, const uint8_t* pf_end, int64_t G, int64_t nb, int64_t N,
                     int64_t ldy, const float* bias, T* y) {
  alignas(64) float buf[MR * 16];
  tile_block_policy<FMT, MR, AMX>(block, G, t, pf_end, buf);
  const int64_t n0 = nb * ROWS, n_end = std::min<int64_t>(N, n0 + ROWS);
  for (int64_t i = 0; i < t.rows; ++i) {
    T* yrow = y + (t.row0 + i) * ldy;
    for (int64_t n = n0; n < n_end; ++n) yrow[n] = T(buf[i * 16 + n - n0] + (bias ? bias[n] : 0.f));
  }
}

template <int FMT, typename T>
void dispatch_tile(const XTile& t, const uint8_t* block, const uint8_t* pf_end, int64_t G, int64_t nb, int64_t N,
                   int64_t ldy, const float* bias, T* y) {
  if constexpr (amx_format(FMT)) {
    if (t.xa) {  // a tile of AMX_INT8_MIN_MR+ rows on an AMX-INT8 CPU (heads_slab)
      if (t.mr == 12) return run_tile<FMT, 12, true>(t, block, pf_end, G, nb, N, ldy, bias, y);
      return run_tile<FMT, 16, true>(t, block, pf_end, G, nb, N, ldy, bias, y);
    }
  }
  switch (t.mr) {
    case 1: return run_tile<FMT, 1, false>(t, block, pf_end, G, nb, N, ldy, bias, y);
    case 2: return run_tile<FMT, 2, false>(t, block, pf_end, G, nb, N, ldy, bias, y);
    case 4: return run_tile<FMT, 4, false>(t, block, pf_end, G, nb, N, ldy, bias, y);
    case 8: return run_tile<FMT, 8, false>(t, block, pf_end, G, nb, N, ldy, bias, y);
    case 12: return run_tile<FMT, 12, false>(t, block, pf_end, G, nb, N, ldy, bias, y);
    default: return run_tile<FMT, 16, false>(t, block, pf_end, G, nb, N, ldy, bias, y);
  }
}

// One product of a segments_slab call: rows [0, M) of x (row r at x + r * sxr; at most SLAB
// rows) times a W of the call's shape (N x K, packed) into y (row r at y + r * ldy)
template <typename T>
struct Segment {
  const T* x;
  int64_t sxr, M;
  const uint8_t* w;
  T* y;
};

// A segments_slab call's quantized x and its bookkeeping. Each thread that calls keeps one
// and reuses it (vectors that only grow), where every call allocated ten: after a step's
// weights have passed through the caches, malloc's own lines are cold, and those allocations
// took 0.3 of a decode call's 1 us before its threads start (2 Zen 5 cores, Q4_K_M's decode
// steps; 0.17 us reused). A call never runs inside another on one thread.
struct SlabBuffers {
  std::vector<XTile> tiles;
  std::vector<int64_t> first, seg_of;
  std::vector<std::pair<int64_t, int64_t>> rows;
  std::vector<int32_t> q, qs, qsa, hs;
  std::vector<float> d, s;
  std::vector<int8_t> xa;
  std::vector<double> busy;  // each thread's seconds on blocks in the last region (step_parts.h)
};

// The calling thread's buffers: one set whatever the format and x's type (a thread_local in
// segments_slab would be one per instantiation)
SlabBuffers& slab_buffers() {
  static thread_local SlabBuffers buffers;
  return buffers;
}

// Several products of one shape in one pass of the threads: MLA's heads (each its x columns
// and matrix), an MoE's experts (each its rows of x and its matrix), or one plain matmul. Each
// segment's rows are quantized into tiles of up to 16 rows, then every block of a segment's W
// passes that segment's tiles while it is in cache. Threads take contiguous runs of all the
// segments' blocks together, so a small matrix does not leave a thread idle, and the call
// costs one fork and join of the threads whatever the number of segments (an MoE's experts
// each paid one before: at batch 1 a (1536 x 2048) int4 expert is ~60 us of weights).
template <int FMT, typename T>
void segments_slab(const std::vector<Segment<T>>& segs, int64_t K, int64_t N, const float* bias, int64_t ldy) {
  const double entered = ridge_shared::clock_s();
  const Layout L = layout_of(FMT);
  const int64_t G = K / QK, NB = (N + ROWS - 1) / ROWS, block_bytes = G * L.chunk;
  const int64_t S = static_cast<int64_t>(segs.size());
  // segment s's tiles are tiles[first[s] .. first[s + 1]); each row's (tile, row in tile) in quantize order
  SlabBuffers& B = slab_buffers();  // this thread's, from its last call
  std::vector<XTile>& tiles = B.tiles;
  std::vector<int64_t>& first = B.first;
  std::vector<std::pair<int64_t, int64_t>>& rows = B.rows;
  tiles.clear(), rows.clear(), first.assign(S + 1, 0);
  int64_t cells = 0, amx_rows = 0;
  for (int64_t s = 0; s < S; ++s) {
    first[s] = static_cast<int64_t>(tiles.size());
    for (int64_t r0 = 0; r0 < segs[s].M; r0 += 16) {
      const int64_t n = std::min<int64_t>(16, segs[s].M - r0);
      const int64_t mr = n <= 2 ? n : n <= 4 ? 4 : n <= 8 ? 8 : n <= 12 ? 12 : 16;
      for (int64_t i = 0; i < n; ++i) rows.emplace_back(static_cast<int64_t>(tiles.size()), i);
      tiles.push_back({r0, n, mr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr});
      cells += mr;
      if (mr >= AMX_INT8_MIN_MR) amx_rows += mr;
    }
  }
  first[S] = static_cast<int64_t>(tiles.size());
  // zeros: a tile's padding rows (mr past its rows) multiply as zeros
  B.q.assign(cells * G * 8, 0), B.qs.assign(cells * G, 0), B.qsa.assign(cells * G, 0), B.hs.assign(cells * G, 0);
  B.d.assign(cells * G, 0.f), B.s.assign(cells * G, 0.f);
  // AMX: tiles of AMX_INT8_MIN_MR+ rows get their codes row-major too (XTile::xa)
  const bool amx = amx_format(FMT) && amx_rows > 0 && amx_int8_ready();
  B.xa.assign(amx ? amx_rows * G * QK : 0, 0);
  int64_t at = 0, at_amx = 0;
  for (XTile& t : tiles) {
    t.q = B.q.data() + at * G * 8;
    t.d = B.d.data() + at * G;
    t.s = B.s.data() + at * G;
    t.qs = B.qs.data() + at * G;
    t.qsa = B.qsa.data() + at * G;
    t.hs = B.hs.data() + at * G;
    if (amx && t.mr >= AMX_INT8_MIN_MR) t.xa = B.xa.data() + at_amx * G * QK, at_amx += t.mr;
    at += t.mr;
  }
  std::vector<int64_t>& seg_of = B.seg_of;
  seg_of.resize(tiles.size());
  for (int64_t s = 0; s < S; ++s)
    for (int64_t i = first[s]; i < first[s + 1]; ++i) seg_of[i] = s;
  at::parallel_for(0, static_cast<int64_t>(rows.size()), 16, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const auto [ti, i] = rows[j];
      const XTile& t = tiles[ti];
      const Segment<T>& sg = segs[seg_of[ti]];
      quantize_row<T>(sg.x + (t.row0 + i) * sg.sxr, G, x_per_superblock(FMT) ? 8 : 1, L.off, t, i);
    }
  });
  // The end of the bytes of W a thread reads in one stream from block j on (its last block
  // j_end - 1): the far prefetch stops there (tile_block). Segments whose Ws lie end to end
  // (heads of one stacked weight) are one stream. Under quant_alternate, a stream to the
  // call's last block goes on past_end bytes (below).
  const bool alternate = g_prefetch.quant_alternate;
  const int64_t past_end = alternate ? std::max<int64_t>(L2_PREFETCH_AHEAD, g_prefetch.quant_far_kib * 1024) : 0;
  auto stream_end = [&](int64_t j, int64_t j_end) {
    int64_t s = j / NB;
    const int64_t last = (j_end - 1) / NB;
    while (s < last && segs[s + 1].w == segs[s].w + NB * block_bytes) ++s;
    if (s < last) return segs[s].w + NB * block_bytes;
    return segs[s].w + ((j_end - 1) % NB + 1) * block_bytes + (j_end == S * NB ? past_end : 0);
  };
  // the blocks over the threads: a contiguous run each, the slower one's tail taken by the
  // other (block_runs.h); under quant_alternate (linear_call.h) in reverse order every other
  // call, and the run to the call's last block fetches on past it (above; a fetch of any
  // address is harmless)
  const int64_t slots = std::min<int64_t>(at::get_num_threads(), S * NB);
  static std::atomic<uint64_t> calls{0};
  BlockRuns runs(S * NB, slots, alternate && (calls.fetch_add(1, std::memory_order_relaxed) & 1));
  B.busy.assign(slots, 0.0);
  const double region = ridge_shared::clock_s();
  ridge_shared::g_step_parts[ridge_shared::PART_MATMUL_SETUP] += region - entered;
  at::parallel_for(0, slots, 1, [&](int64_t t_begin, int64_t t_end) {
    const double started = ridge_shared::clock_s();
    int64_t configured = 0;  // AMX tiles are configured per thread, for the tile's rows
    const uint8_t* pf_end = nullptr;
    int64_t j, run_end, prev = -2;
    for (int64_t slot = t_begin; slot < t_end; ++slot)
      while (runs.next(slot, j, run_end)) {
        const int64_t s = j / NB, nb = j % NB;
        const Segment<T>& sg = segs[s];
        const uint8_t* block = sg.w + nb * block_bytes;
        if (j != prev + 1 || nb == 0) pf_end = stream_end(j, run_end);
        prev = j;
        for (int64_t i = first[s]; i < first[s + 1]; ++i) {
          const XTile& t = tiles[i];
          if (t.xa && t.mr != configured) configure_int8_tiles(t.mr), configured = t.mr;
          dispatch_tile<FMT, T>(t, block, pf_end, G, nb, N, ldy, bias, sg.y);
        }
      }
    if (configured) _tile_release();
    B.busy[t_begin] = ridge_shared::clock_s() - started;
  });
  // the region's time less the mean busy time of the threads that ran (one, where the region
  // ran inline): late starts, the wait for the slower thread, the join
  double busy = 0.0;
  int64_t ran = 0;
  for (const double b : B.busy) busy += b, ran += b > 0.0;
  ridge_shared::g_step_parts[ridge_shared::PART_MATMUL_WAIT] +=
      ridge_shared::clock_s() - region - busy / std::max<int64_t>(ran, 1);
}

// segments_slab for the format code fmt (every segment at most SLAB rows)
template <typename T>
void segments_call(int64_t fmt, const std::vector<Segment<T>>& segs, int64_t K, int64_t N, const float* bias,
                   int64_t ldy) {
  if (segs.empty()) return;
  switch (fmt) {
    case Q8_0: return segments_slab<Q8_0, T>(segs, K, N, bias, ldy);
    case Q4_0: return segments_slab<Q4_0, T>(segs, K, N, bias, ldy);
    case IQ4_NL: return segments_slab<IQ4_NL, T>(segs, K, N, bias, ldy);
    case Q4_K: return segments_slab<Q4_K, T>(segs, K, N, bias, ldy);
    case Q5_K: return segments_slab<Q5_K, T>(segs, K, N, bias, ldy);
    case IQ4_XS: return segments_slab<IQ4_XS, T>(segs, K, N, bias, ldy);
    case Q6_K: return segments_slab<Q6_K, T>(segs, K, N, bias, ldy);
    case Q3_K: return segments_slab<Q3_K, T>(segs, K, N, bias, ldy);
    case Q2_K: return segments_slab<Q2_K, T>(segs, K, N, bias, ldy);
    default: return segments_slab<Q4_1, T>(segs, K, N, bias, ldy);
  }
}

// H products of one shape (H = 1: a plain matmul): head h multiplies rows [0, M) of its x (row
// r at x + r * sxr + h * sxh) by its W (the packed blocks [h N/16, (h+1) N/16) of wp) into
// y + h * N, y's rows ldy apart (H N where the heads' outputs fill them; more where y is a
// column slice of a wider output); x's rows in slabs of SLAB, one segments_slab each
template <typename T>
void gemm_heads(int64_t fmt, const T* x, int64_t sxr, int64_t sxh, int64_t M, int64_t H, int64_t K, const uint8_t* wp,
                int64_t N, const float* bias, T* y, int64_t ldy) {
  const int64_t head_bytes = (N + ROWS - 1) / ROWS * (K / QK) * layout_of(fmt).chunk;
  for (int64_t r0 = 0; r0 < M; r0 += SLAB) {
    const int64_t rows = std::min<int64_t>(SLAB, M - r0);
    std::vector<Segment<T>> segs;
    for (int64_t h = 0; h < H; ++h) segs.push_back({x + r0 * sxr + h * sxh, sxr, rows, wp + h * head_bytes, y + r0 * ldy + h * N});
    segments_call<T>(fmt, segs, K, N, bias, ldy);
  }
}

template <typename T>
void gemm(int64_t fmt, const T* x, int64_t M, int64_t K, const uint8_t* wp, int64_t N, const float* bias, T* y,
          int64_t ldy = -1) {
  gemm_heads<T>(fmt, x, K, 0, M, 1, K, wp, N, bias, y, ldy < 0 ? N : ldy);
}

// Stacked experts: x's rows sorted by expert (counts[e] of them for expert e), each run of rows
// through expert e's N rows of the stacked weight (its packed blocks [e N/16, (e+1) N/16)) into
// the same rows of y (N wide); an expert with no rows is never read. All the experts' rows, in
// slabs of SLAB per expert, go in one segments_slab call.
template <typename T>
void gemm_grouped(int64_t fmt, const T* x, const std::vector<int64_t>& counts, int64_t K, const uint8_t* wp, int64_t N,
                  T* y) {
  const int64_t expert_bytes = N / ROWS * (K / QK) * layout_of(fmt).chunk;
  std::vector<Segment<T>> segs;
  int64_t row = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    for (int64_t r0 = 0; r0 < counts[e]; r0 += SLAB)
      segs.push_back({x + (row + r0) * K, K, std::min<int64_t>(SLAB, counts[e] - r0), wp + e * expert_bytes,
                      y + (row + r0) * N});
    row += counts[e];
  }
  segments_call<T>(fmt, segs, K, N, nullptr, N);
}

}  // namespace

// Q4_K super-blocks (N, K/256 * 144 bytes) -> blocks of 16 rows, the same bytes regrouped
// (Q5_K's 176: each weight chunk followed by its 64-byte plane of fifth bits):
//
//   [ G weight chunks, as Q4_0's ][ K/256 x (16 fp16 d, 16 fp16 dmin) ][ K/256 x 192 bytes ]
//   192 bytes of a super-block, its 8 groups x 16 rows of 6-bit codes (scale sc, minimum m):
//   byte 16 j + r holds group j row r's low 4 bits of sc (low nibble) and of m (high nibble);
//   byte 128 + b holds the top 2 bits of sc and of m (sc's in bits 0-1, m's in 2-3) of code
//   b in its low nibble and of code b + 64 in its high nibble (code = 16 j + r)
//
// A file's 64 weights of a 32-byte run hold sub-block 2c in their low nibbles and 2c + 1 in
// their high ones; each becomes a group of 32 whose byte i holds elements i and i + 16.
constexpr int64_t QK_K = 256;

inline void q4_k_scale_min(const uint8_t* q, int j, uint8_t& sc, uint8_t& m) {  // llama.cpp's get_scale_min_k4
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Code c (16 j + r: group j, row r) of a super-block's 128 pairs of 6-bit codes, in the 192
// bytes of pack_k_quant's arrangement (which unpack_codes6 reads)
inline void put_codes6(uint8_t* codes, int64_t c, uint8_t sc, uint8_t m) {
  codes[c] = static_cast<uint8_t>((sc & 15) | ((m & 15) << 4));
  codes[128 + (c & 63)] |= static_cast<uint8_t>(((sc >> 4) | ((m >> 4) << 2)) << (c >= 64 ? 4 : 0));
}

inline void get_codes6(const uint8_t* codes, int64_t c, uint8_t& sc, uint8_t& m) {
  const uint8_t high = (codes[128 + (c & 63)] >> (c >= 64 ? 4 : 0)) & 15;
  sc = (codes[c] & 15) | ((high & 3) << 4);
  m = (codes[c] >> 4) | ((high >> 2) << 4);
}

// The walk every super-block format's (un)packing shares (sb_bytes and chunk: its layout_of).
// Packing checks the file's (N, K/256 * sb_bytes) bytes, allocates (N/16, K/32, chunk) zeroed
// (rows past N add nothing), and calls
// fill(block, r, s, sb) for each real row r of each block of 16 rows and each super-block s;
// unpacking calls read(block, r, s, sb) to rebuild the file's bytes sb from a block.
template <typename Fill>
torch::Tensor pack_superblocks(torch::Tensor blocks, int64_t N, int64_t K, int64_t fmt, const char* name, Fill fill) {
  const int64_t sb_bytes = layout_of(fmt).type_size, chunk = layout_of(fmt).chunk;
  TORCH_CHECK(K % QK_K == 0, "pack_quant: ", name, " needs K a multiple of 256");
  const int64_t G = K / QK, S = K / QK_K, NB = (N + ROWS - 1) / ROWS, row_bytes = S * sb_bytes;
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.device().is_cpu() && blocks.dim() == 2 &&
                  blocks.size(0) == N && blocks.size(1) == row_bytes,
              "pack_quant: ", name, " blocks must be (N, K/256 * ", sb_bytes, ") uint8 on the CPU");
  auto src_t = blocks.contiguous();
  const uint8_t* src = src_t.data_ptr<uint8_t>();
  auto out = huge_page_empty({NB, G, chunk}, blocks.options());
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, NB, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      uint8_t* block = dst + nb * G * chunk;
      std::memset(block, 0, G * chunk);
      for (int64_t r = 0; r < ROWS && nb * ROWS + r < N; ++r)
        for (int64_t s = 0; s < S; ++s) fill(block, r, s, src + (nb * ROWS + r) * row_bytes + s * sb_bytes);
    }
  });
  return out;
}

template <typename Read>
torch::Tensor unpack_superblocks(torch::Tensor packed, int64_t N, int64_t K, int64_t fmt, Read read) {
  const int64_t sb_bytes = layout_of(fmt).type_size, chunk = layout_of(fmt).chunk;
  const int64_t G = K / QK, S = K / QK_K, row_bytes = S * sb_bytes;
  auto out = torch::zeros({N, row_bytes}, packed.options());
  const uint8_t* src = packed.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t s = 0; s < S; ++s) read(src + (n / ROWS) * G * chunk, n % ROWS, s, dst + n * row_bytes + s * sb_bytes);
  return out;
}

// Q4_K and Q5_K (super-blocks of 144 / 176 bytes; nibbles at qs_at; Q5_K's fifth bits at 16, qh_at >= 0)
// into blocks of chunk bytes per group: [ nibbles as Q4_0's, 256 | Q5_K's bit plane, 64 ]
// per group, then the scales as above. Bit plane byte p = 4 r + t holds in bit q the fifth
// bit of row r's element 4 q + t (quad q's byte p).
torch::Tensor pack_k_quant(torch::Tensor blocks, int64_t N, int64_t K, int64_t fmt, int64_t qs_at, int64_t qh_at,
                           const char* name) {
  const int64_t G = K / QK, S = K / QK_K, wb = layout_of(fmt).wbytes;
  return pack_superblocks(blocks, N, K, fmt, name, [&](uint8_t* block, int64_t r, int64_t s, const uint8_t* sb) {
    uint8_t* dd = block + G * wb;
    uint8_t* sbc = dd + S * 64 + s * 192;
    std::memcpy(dd + s * 64 + 2 * r, sb, 2);
    std::memcpy(dd + s * 64 + 32 + 2 * r, sb + 2, 2);
    for (int j = 0; j < 8; ++j) {
      uint8_t sc, m;
      q4_k_scale_min(sb + 4, j, sc, m);
      put_codes6(sbc, 16 * j + r, sc, m);
      const uint8_t* qs = sb + qs_at + 32 * (j / 2);
      const int shift = 4 * (j & 1);
      uint8_t* chunk = block + (s * 8 + j) * wb;
      for (int64_t jq = 0; jq < 4; ++jq)
        for (int64_t t = 0; t < 4; ++t) {
          const int64_t p = 4 * jq + t;
          const uint8_t lo = (qs[p] >> shift) & 15, hi = (qs[p + 16] >> shift) & 15;
          chunk[(jq * ROWS + r) * 4 + t] = static_cast<uint8_t>(lo | (hi << 4));
        }
      if (qh_at >= 0)
        for (int64_t e = 0; e < 32; ++e)
          chunk[256 + 4 * r + e % 4] |= static_cast<uint8_t>(((sb[qh_at + e] >> j) & 1) << (e / 4));
    }
  });
}

torch::Tensor unpack_k_quant(torch::Tensor packed, int64_t N, int64_t K, int64_t fmt, int64_t qs_at, int64_t qh_at) {
  const int64_t G = K / QK, S = K / QK_K, wb = layout_of(fmt).wbytes;
  return unpack_superblocks(packed, N, K, fmt, [&](const uint8_t* block, int64_t r, int64_t s, uint8_t* sb) {
    const uint8_t* dd = block + G * wb;
    const uint8_t* sbc = dd + S * 64 + s * 192;
    std::memcpy(sb, dd + s * 64 + 2 * r, 2);
    std::memcpy(sb + 2, dd + s * 64 + 32 + 2 * r, 2);
    uint8_t sc[8], m[8];
    for (int j = 0; j < 8; ++j) {
      get_codes6(sbc, 16 * j + r, sc[j], m[j]);
      const uint8_t* chunk = block + (s * 8 + j) * wb;
      uint8_t* qs = sb + qs_at + 32 * (j / 2);
      const int shift = 4 * (j & 1);
      for (int64_t jq = 0; jq < 4; ++jq)
        for (int64_t t = 0; t < 4; ++t) {
          const int64_t p = 4 * jq + t;
          const uint8_t v = chunk[(jq * ROWS + r) * 4 + t];
          qs[p] |= static_cast<uint8_t>((v & 15) << shift);
          qs[p + 16] |= static_cast<uint8_t>((v >> 4) << shift);
        }
      if (qh_at >= 0)
        for (int64_t e = 0; e < 32; ++e)
          sb[qh_at + e] |= static_cast<uint8_t>(((chunk[256 + 4 * r + e % 4] >> (e / 4)) & 1) << j);
    }
    uint8_t* q = sb + 4;  // the inverse of q4_k_scale_min
    for (int j = 0; j < 4; ++j) {
      q[j] = static_cast<uint8_t>(sc[j] | ((sc[j + 4] >> 4) << 6));
      q[j + 4] = static_cast<uint8_t>(m[j] | ((m[j + 4] >> 4) << 6));
      q[j + 8] = static_cast<uint8_t>((sc[j + 4] & 15) | ((m[j + 4] & 15) << 4));
    }
  });
}

// IQ4_XS super-blocks (N, K/256 * 136 bytes: fp16 d, 2 bytes of scales' top bits, 4 of their
// low bits, 128 of codes) -> blocks of 16 rows, the same bytes regrouped:
//
//   [ G weight chunks, as IQ4_NL's ][ K/256 x 16 fp16 d ][ K/256 x 96 bytes ]
//   96 bytes of a super-block, its 8 groups x 16 rows of 6-bit scale codes (code c = 16 j + r):
//   byte b < 64 holds the low 4 bits of code b (low nibble) and of code b + 64 (high nibble);
//   byte 64 + b holds the top 2 bits of codes b, b + 32, b + 64, b + 96 (bits 0-1, 2-3, 4-5, 6-7)
//
// A file's sub-block j holds its 32 codes in 16 bytes as IQ4_NL's block does (byte i: elements
// i and i + 16): they move as they are.
torch::Tensor pack_iq4_xs(torch::Tensor blocks, int64_t N, int64_t K) {
  const int64_t G = K / QK, S = K / QK_K;
  return pack_superblocks(blocks, N, K, IQ4_XS, "IQ4_XS", [&](uint8_t* block, int64_t r, int64_t s, const uint8_t* sb) {
    uint8_t* dd = block + G * 256;
    uint8_t* sbc = dd + S * 32 + s * 96;
    std::memcpy(dd + s * 32 + 2 * r, sb, 2);
    const uint16_t scales_h = static_cast<uint16_t>(sb[2] | (sb[3] << 8));
    for (int j = 0; j < 8; ++j) {
      const int64_t c = 16 * j + r;
      const uint8_t low = (sb[4 + j / 2] >> (4 * (j & 1))) & 15, high = (scales_h >> (2 * j)) & 3;
      sbc[c & 63] |= static_cast<uint8_t>(low << (c >= 64 ? 4 : 0));
      sbc[64 + (c & 31)] |= static_cast<uint8_t>(high << (2 * (c >> 5)));
      const uint8_t* qs = sb + 8 + 16 * j;
      uint8_t* chunk = block + (s * 8 + j) * 256;
      for (int64_t jq = 0; jq < 4; ++jq)
        for (int64_t t = 0; t < 4; ++t) chunk[(jq * ROWS + r) * 4 + t] = qs[4 * jq + t];
    }
  });
}

torch::Tensor unpack_iq4_xs(torch::Tensor packed, int64_t N, int64_t K) {
  const int64_t G = K / QK, S = K / QK_K;
  return unpack_superblocks(packed, N, K, IQ4_XS, [&](const uint8_t* block, int64_t r, int64_t s, uint8_t* sb) {
    const uint8_t* dd = block + G * 256;
    const uint8_t* sbc = dd + S * 32 + s * 96;
    std::memcpy(sb, dd + s * 32 + 2 * r, 2);
    uint16_t scales_h = 0;
    for (int j = 0; j < 8; ++j) {
      const int64_t c = 16 * j + r;
      const uint8_t low = (sbc[c & 63] >> (c >= 64 ? 4 : 0)) & 15;
      const uint8_t high = (sbc[64 + (c & 31)] >> (2 * (c >> 5))) & 3;
      sb[4 + j / 2] |= static_cast<uint8_t>(low << (4 * (j & 1)));
      scales_h |= static_cast<uint16_t>(high << (2 * j));
      const uint8_t* chunk = block + (s * 8 + j) * 256;
      for (int64_t jq = 0; jq < 4; ++jq)
        for (int64_t t = 0; t < 4; ++t) sb[8 + 16 * j + 4 * jq + t] = chunk[(jq * ROWS + r) * 4 + t];
    }
    sb[2] = static_cast<uint8_t>(scales_h & 0xFF);
    sb[3] = static_cast<uint8_t>(scales_h >> 8);
  });
}

// Q6_K super-blocks (N, K/256 * 210 bytes: 128 of low 4 bits, 64 of top 2 bits, 16 int8
// scales, fp16 d) -> blocks of 16 rows, the same bytes regrouped:
//
//   [ G x 384 bytes: six planes of 64 ][ K/256 x 16 fp16 d ]
//   [ G x 32 bytes: the 16 rows' int8 scale of k 0-15, then of k 16-31 ]
//
// Byte p of plane P (row p / 4, k 4 quad + p % 4) holds quad P's code in bits 0-5 (P < 6);
// bits 6-7 of planes 0, 1 and 4 hold quad 6's code's bits 0-1, 2-3 and 4-5, those of planes 2,
// 3 and 5 quad 7's: a code is one mask (quads 0-5) or three GFNI ops and a join (6, 7), where
// the low nibbles and top bits apart took 20 ops a group for 8 quads (14 now).
// A file's half h of a super-block holds element 32 q + l (quarter q) in the low (q < 2) or
// high nibble of ql[64 h + l + 32 (q & 1)] and bits 2 q of qh[32 h + l].
inline uint8_t q6_k_code(const uint8_t* sb, int64_t e) {  // element e (0-255) of a super-block, 0-63
  const int64_t h = e / 128, q = (e % 128) / 32, l = e % 32;
  const uint8_t lo = (sb[64 * h + l + 32 * (q & 1)] >> (q < 2 ? 0 : 4)) & 15;
  const uint8_t hi = (sb[128 + 32 * h + l] >> (2 * q)) & 3;
  return static_cast<uint8_t>(lo | (hi << 4));
}

// Where quad 6's (7's) code's bits 2 i .. 2 i + 1 lie: bits 6-7 of this plane
constexpr int64_t Q6_K_SPLIT_PLANE[2][3] = {{0, 1, 4}, {2, 3, 5}};

inline void q6_k_put(uint8_t* chunk, int64_t quad, int64_t r, int64_t t, uint8_t code) {
  const int64_t p = r * 4 + t;
  if (quad < 6) {
    chunk[64 * quad + p] |= code;
    return;
  }
  for (int i = 0; i < 3; ++i) chunk[64 * Q6_K_SPLIT_PLANE[quad - 6][i] + p] |= static_cast<uint8_t>(((code >> (2 * i)) & 3) << 6);
}

inline uint8_t q6_k_get(const uint8_t* chunk, int64_t quad, int64_t r, int64_t t) {
  const int64_t p = r * 4 + t;
  if (quad < 6) return chunk[64 * quad + p] & 63;
  uint8_t code = 0;
  for (int i = 0; i < 3; ++i) code |= static_cast<uint8_t>((chunk[64 * Q6_K_SPLIT_PLANE[quad - 6][i] + p] >> 6) << (2 * i));
  return code;
}

torch::Tensor pack_q6_k(torch::Tensor blocks, int64_t N, int64_t K) {
  const int64_t G = K / QK, S = K / QK_K;
  return pack_superblocks(blocks, N, K, Q6_K, "Q6_K", [&](uint8_t* block, int64_t r, int64_t s, const uint8_t* sb) {
    uint8_t* dd = block + G * 384;
    uint8_t* scl = dd + S * 32;
    std::memcpy(dd + s * 32 + 2 * r, sb + 208, 2);
    for (int j = 0; j < 8; ++j) {
      const int64_t g = s * 8 + j;
      scl[g * 32 + r] = sb[192 + 2 * j];
      scl[g * 32 + 16 + r] = sb[192 + 2 * j + 1];
      uint8_t* chunk = block + g * 384;
      for (int64_t quad = 0; quad < 8; ++quad)
        for (int64_t t = 0; t < 4; ++t) q6_k_put(chunk, quad, r, t, q6_k_code(sb, 32 * j + 4 * quad + t));
    }
  });
}

torch::Tensor unpack_q6_k(torch::Tensor packed, int64_t N, int64_t K) {
  const int64_t G = K / QK, S = K / QK_K;
  return unpack_superblocks(packed, N, K, Q6_K, [&](const uint8_t* block, int64_t r, int64_t s, uint8_t* sb) {
    const uint8_t* dd = block + G * 384;
    const uint8_t* scl = dd + S * 32;
    std::memcpy(sb + 208, dd + s * 32 + 2 * r, 2);
    for (int j = 0; j < 8; ++j) {
      const int64_t g = s * 8 + j;
      sb[192 + 2 * j] = scl[g * 32 + r];
      sb[192 + 2 * j + 1] = scl[g * 32 + 16 + r];
      const uint8_t* chunk = block + g * 384;
      for (int64_t quad = 0; quad < 8; ++quad)
        for (int64_t t = 0; t < 4; ++t) {
          const uint8_t code = q6_k_get(chunk, quad, r, t);
          const int64_t e = 32 * j + 4 * quad + t, h = e / 128, q = (e % 128) / 32, l = e % 32;
          sb[64 * h + l + 32 * (q & 1)] |= static_cast<uint8_t>((code & 15) << (q < 2 ? 0 : 4));
          sb[128 + 32 * h + l] |= static_cast<uint8_t>((code >> 4) << (2 * q));
        }
    }
  });
}

// Q3_K super-blocks (N, K/256 * 110 bytes: 32 of high bits, 64 of low 2 bits, 12 of 6-bit
// scales, fp16 d) -> blocks of 16 rows, the same bytes regrouped:
//
//   [ G x 192 bytes: three planes of 64 ][ K/256 x 16 fp16 d ][ K/256 x 192 bytes of codes ]
//
// Planes: byte p (row p / 4, k 4 quad + p % 4) of plane P holds quad 2P's code in bits 0-2 and
// 2P + 1's in bits 3-5 (P < 3); quads 6 and 7 keep their low 2 bits in bits 6-7 of planes 0
// and 1, their top bit in bits 6 and 7 of plane 2. A code is q + 4, q in -4..3 (the file's low
// 2 bits, plus 4 where its high bit is set). The codes: sub-block 2 j's scale code where
// pack_k_quant has group j's sc, sub-block 2 j + 1's where it has m.
// A file's element e (sub-block j = e / 32, l = e % 32) has its low bits at 2 (j % 4) of
// qs[32 (j / 4) + l] and its high bit at bit j of hmask[l].
inline void q3_k_place(uint8_t* chunk, int64_t quad, int64_t p, uint8_t code) {
  if (quad < 6) {
    chunk[64 * (quad / 2) + p] |= static_cast<uint8_t>(code << (3 * (quad & 1)));
  } else {
    chunk[64 * (quad - 6) + p] |= static_cast<uint8_t>((code & 3) << 6);
    chunk[128 + p] |= static_cast<uint8_t>((code >> 2) << quad);
  }
}

inline uint8_t q3_k_take(const uint8_t* chunk, int64_t quad, int64_t p) {
  if (quad < 6) return (chunk[64 * (quad / 2) + p] >> (3 * (quad & 1))) & 7;
  return static_cast<uint8_t>(((chunk[64 * (quad - 6) + p] >> 6) & 3) | (((chunk[128 + p] >> quad) & 1) << 2));
}

inline uint8_t q3_k_scale(const uint8_t* sc, int i) {  // scale code i (0-15) of the file's 12 bytes
  return static_cast<uint8_t>(((sc[i % 8] >> (4 * (i / 8))) & 15) | (((sc[8 + i % 4] >> (2 * (i / 4))) & 3) << 4));
}

torch::Tensor pack_q3_k(torch::Tensor blocks, int64_t N, int64_t K) {
  const int64_t G = K / QK, S = K / QK_K;
  return pack_superblocks(blocks, N, K, Q3_K, "Q3_K", [&](uint8_t* block, int64_t r, int64_t s, const uint8_t* sb) {
    uint8_t* dd = block + G * 192;
    std::memcpy(dd + s * 32 + 2 * r, sb + 108, 2);
    for (int j = 0; j < 8; ++j) {
      put_codes6(dd + S * 32 + s * 192, 16 * j + r, q3_k_scale(sb + 96, 2 * j), q3_k_scale(sb + 96, 2 * j + 1));
      uint8_t* chunk = block + (s * 8 + j) * 192;
      for (int64_t l = 0; l < 32; ++l) {
        const uint8_t low = (sb[32 + 32 * (j / 4) + l] >> (2 * (j % 4))) & 3, high = (sb[l] >> j) & 1;
        q3_k_place(chunk, l / 4, 4 * r + l % 4, static_cast<uint8_t>(low | (high << 2)));
      }
    }
  });
}

torch::Tensor unpack_q3_k(torch::Tensor packed, int64_t N, int64_t K) {
  const int64_t G = K / QK, S = K / QK_K;
  return unpack_superblocks(packed, N, K, Q3_K, [&](const uint8_t* block, int64_t r, int64_t s, uint8_t* sb) {
    const uint8_t* dd = block + G * 192;
    std::memcpy(sb + 108, dd + s * 32 + 2 * r, 2);
    for (int j = 0; j < 8; ++j) {
      uint8_t codes[2];
      get_codes6(dd + S * 32 + s * 192, 16 * j + r, codes[0], codes[1]);
      for (int h = 0; h < 2; ++h) {
        const int i = 2 * j + h;
        sb[96 + i % 8] |= static_cast<uint8_t>((codes[h] & 15) << (4 * (i / 8)));
        sb[104 + i % 4] |= static_cast<uint8_t>((codes[h] >> 4) << (2 * (i / 4)));
      }
      const uint8_t* chunk = block + (s * 8 + j) * 192;
      for (int64_t l = 0; l < 32; ++l) {
        const uint8_t code = q3_k_take(chunk, l / 4, 4 * r + l % 4);
        sb[32 + 32 * (j / 4) + l] |= static_cast<uint8_t>((code & 3) << (2 * (j % 4)));
        sb[l] |= static_cast<uint8_t>((code >> 2) << j);
      }
    }
  });
}

// Q2_K super-blocks (N, K/256 * 84 bytes: 16 bytes of 4-bit scale | 4-bit minimum << 4, 64 of
// 2-bit codes, fp16 d, fp16 dmin) -> blocks of 16 rows, the same bytes regrouped:
//
//   [ G x 128 bytes: two planes of 64 ][ K/256 x (16 fp16 d, 16 fp16 dmin) ]
//   [ G x 32 bytes: per row, its scale byte of k 0-15 and of k 16-31 (one int16 each, unpacked) ]
//
// Byte p of plane P holds quad 4 P + i's code in bits 2 i .. 2 i + 1 at position p (row p / 4,
// k 4 quad + p % 4). A file's element e (sub-block j = e / 32, l = e % 32) is bits 2 (j % 4) of
// qs[32 (j / 4) + l], as Q3_K's low bits.
torch::Tensor pack_q2_k(torch::Tensor blocks, int64_t N, int64_t K) {
  const int64_t G = K / QK, S = K / QK_K;
  return pack_superblocks(blocks, N, K, Q2_K, "Q2_K", [&](uint8_t* block, int64_t r, int64_t s, const uint8_t* sb) {
    uint8_t* dd = block + G * 128;
    std::memcpy(dd + s * 64 + 2 * r, sb + 80, 2);
    std::memcpy(dd + s * 64 + 32 + 2 * r, sb + 82, 2);
    for (int j = 0; j < 8; ++j) {
      const int64_t g = s * 8 + j;
      dd[S * 64 + g * 32 + 2 * r] = sb[2 * j];
      dd[S * 64 + g * 32 + 2 * r + 1] = sb[2 * j + 1];
      uint8_t* chunk = block + g * 128;
      for (int64_t l = 0; l < 32; ++l) {
        const uint8_t code = (sb[16 + 32 * (j / 4) + l] >> (2 * (j % 4))) & 3;
        const int64_t quad = l / 4;
        chunk[64 * (quad / 4) + 4 * r + l % 4] |= static_cast<uint8_t>(code << (2 * (quad % 4)));
      }
    }
  });
}

torch::Tensor unpack_q2_k(torch::Tensor packed, int64_t N, int64_t K) {
  const int64_t G = K / QK, S = K / QK_K;
  return unpack_superblocks(packed, N, K, Q2_K, [&](const uint8_t* block, int64_t r, int64_t s, uint8_t* sb) {
    const uint8_t* dd = block + G * 128;
    std::memcpy(sb + 80, dd + s * 64 + 2 * r, 2);
    std::memcpy(sb + 82, dd + s * 64 + 32 + 2 * r, 2);
    for (int j = 0; j < 8; ++j) {
      const int64_t g = s * 8 + j;
      sb[2 * j] = dd[S * 64 + g * 32 + 2 * r];
      sb[2 * j + 1] = dd[S * 64 + g * 32 + 2 * r + 1];
      const uint8_t* chunk = block + g * 128;
      for (int64_t l = 0; l < 32; ++l) {
        const int64_t quad = l / 4;
        const uint8_t code = (chunk[64 * (quad / 4) + 4 * r + l % 4] >> (2 * (quad % 4))) & 3;
        sb[16 + 32 * (j / 4) + l] |= static_cast<uint8_t>(code << (2 * (j % 4)));
      }
    }
  });
}

torch::Tensor pack_quant(torch::Tensor blocks, int64_t fmt, int64_t N, int64_t K) {
  if (fmt == Q4_K) return pack_k_quant(blocks, N, K, Q4_K, 16, -1, "Q4_K");
  if (fmt == Q5_K) return pack_k_quant(blocks, N, K, Q5_K, 48, 16, "Q5_K");
  if (fmt == IQ4_XS) return pack_iq4_xs(blocks, N, K);
  if (fmt == Q6_K) return pack_q6_k(blocks, N, K);
  if (fmt == Q3_K) return pack_q3_k(blocks, N, K);
  if (fmt == Q2_K) return pack_q2_k(blocks, N, K);
  const Layout L = layout_of(fmt);
  TORCH_CHECK(K % QK == 0, "pack_quant: K must be a multiple of 32");
  const int64_t G = K / QK, NB = (N + ROWS - 1) / ROWS;
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.device().is_cpu() && blocks.dim() == 2 &&
                  blocks.size(0) == N && blocks.size(1) == G * L.type_size,
              "pack_quant: blocks must be (N, K/32 * type_size) uint8 on the CPU");
  auto src_t = blocks.contiguous();
  const uint8_t* src = src_t.data_ptr<uint8_t>();
  auto out = huge_page_empty({NB, G, L.chunk}, blocks.options());
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t row_bytes = G * L.type_size, head = L.has_min ? 4 : 2;
  at::parallel_for(0, NB, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      uint8_t* block = dst + nb * G * L.chunk;
      std::memset(block, 0, G * L.chunk);  // rows past N: zero scales, so they add nothing
      for (int64_t r = 0; r < ROWS && nb * ROWS + r < N; ++r) {
        const uint8_t* row = src + (nb * ROWS + r) * row_bytes;
        for (int64_t g = 0; g < G; ++g) {
          const uint8_t* b = row + g * L.type_size;
          uint8_t* chunk = block + g * L.wbytes;
          const int64_t quads = L.nibbles ? 4 : 8;
          for (int64_t j = 0; j < quads; ++j)
            for (int64_t t = 0; t < 4; ++t) {
              const uint8_t v = b[head + 4 * j + t];
              chunk[(j * ROWS + r) * 4 + t] = L.nibbles ? v : static_cast<uint8_t>(v ^ 0x80);
            }
          std::memcpy(block + G * L.wbytes + g * 32 + 2 * r, b, 2);
          if (L.has_min) std::memcpy(block + G * L.wbytes + (G + g) * 32 + 2 * r, b + 2, 2);
        }
      }
    }
  });
  return out;
}

torch::Tensor unpack_quant(torch::Tensor packed, int64_t fmt, int64_t N, int64_t K) {
  if (fmt == Q4_K) return unpack_k_quant(packed, N, K, Q4_K, 16, -1);
  if (fmt == Q5_K) return unpack_k_quant(packed, N, K, Q5_K, 48, 16);
  if (fmt == IQ4_XS) return unpack_iq4_xs(packed, N, K);
  if (fmt == Q6_K) return unpack_q6_k(packed, N, K);
  if (fmt == Q3_K) return unpack_q3_k(packed, N, K);
  if (fmt == Q2_K) return unpack_q2_k(packed, N, K);
  const Layout L = layout_of(fmt);
  const int64_t G = K / QK, row_bytes = G * L.type_size, head = L.has_min ? 4 : 2;
  auto out = torch::empty({N, row_bytes}, packed.options());
  const uint8_t* src = packed.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t nb = n / ROWS, r = n % ROWS;
    const uint8_t* block = src + nb * G * L.chunk;
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* chunk = block + g * L.wbytes;
      uint8_t* b = dst + n * row_bytes + g * L.type_size;
      const int64_t quads = L.nibbles ? 4 : 8;
      for (int64_t j = 0; j < quads; ++j)
        for (int64_t t = 0; t < 4; ++t) {
          const uint8_t v = chunk[(j * ROWS + r) * 4 + t];
          b[head + 4 * j + t] = L.nibbles ? v : static_cast<uint8_t>(v ^ 0x80);
        }
      std::memcpy(b, block + G * L.wbytes + g * 32 + 2 * r, 2);
      if (L.has_min) std::memcpy(b + 2, block + G * L.wbytes + (G + g) * 32 + 2 * r, 2);
    }
  }
  return out;
}

torch::Tensor linear_quant(torch::Tensor x, torch::Tensor packed, int64_t fmt, int64_t N,
                           c10::optional<torch::Tensor> bias) {
  const Layout L = layout_of(fmt);
  const int64_t K = x.size(-1);
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "linear_quant: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "linear_quant: bf16 or f32 x");
  TORCH_CHECK(!is_super_block(fmt) || K % 256 == 0, "linear_quant: K-quants need K a multiple of 256");
  TORCH_CHECK(K % QK == 0 && packed.dim() == 3 && packed.size(0) == (N + ROWS - 1) / ROWS &&
                  packed.size(1) == K / QK && packed.size(2) == L.chunk,
              "linear_quant: packed weight does not match (N, K)");
  LinearCall call(x, N, bias);
  const int64_t M = call.M;
  if (M > 0) {
    const uint8_t* wp = packed.data_ptr<uint8_t>();
    if (x.scalar_type() == at::kFloat)
      gemm<float>(fmt, call.x2.data_ptr<float>(), M, K, wp, N, call.bias, call.y.data_ptr<float>());
    else
      gemm<at::BFloat16>(fmt, call.x2.data_ptr<at::BFloat16>(), M, K, wp, N, call.bias,
                         call.y.data_ptr<at::BFloat16>());
  }
  return call.result();
}

void linear_quant_into(const at::BFloat16* x, int64_t M, int64_t K, const uint8_t* packed, int64_t fmt, int64_t N,
                       const float* bias, at::BFloat16* y, int64_t ldy) {
  if (M > 0) gemm<at::BFloat16>(fmt, x, M, K, packed, N, bias, y, ldy);
}

void linear_quant_grouped_into(const at::BFloat16* x, const std::vector<int64_t>& counts, int64_t K,
                               const uint8_t* packed, int64_t fmt, int64_t N, at::BFloat16* y) {
  gemm_grouped<at::BFloat16>(fmt, x, counts, K, packed, N, y);
}

// Stacked experts in a block format: as linear_bf16_grouped (expert e's rows of the stacked
// weight are its packed blocks [e N/16, (e+1) N/16)).
torch::Tensor linear_quant_grouped(torch::Tensor x, torch::Tensor packed, int64_t fmt, int64_t N,
                                   std::vector<int64_t> counts) {
  const Layout L = layout_of(fmt);
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && x.dim() == 2, "linear_quant_grouped: (R, K) on CPU");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "linear_quant_grouped: bf16 or f32 x");
  TORCH_CHECK(N % ROWS == 0, "linear_quant_grouped: rows per expert must be a multiple of 16");
  auto x2 = x.contiguous();
  const int64_t R = x2.size(0), K = x2.size(1), E = static_cast<int64_t>(counts.size());
  TORCH_CHECK(!is_super_block(fmt) || K % 256 == 0, "linear_quant_grouped: K-quants need K a multiple of 256");
  TORCH_CHECK(K % QK == 0 && packed.dim() == 3 && packed.size(0) == E * N / ROWS && packed.size(1) == K / QK &&
                  packed.size(2) == L.chunk,
              "linear_quant_grouped: packed weight does not match (E * N, K)");
  auto y = torch::empty({R, N}, x2.options());
  int64_t row = 0;
  for (const int64_t c : counts) {
    TORCH_CHECK(c >= 0 && row + c <= R, "linear_quant_grouped: counts do not add up to x's rows");
    row += c;
  }
  TORCH_CHECK(row == R, "linear_quant_grouped: counts do not add up to x's rows");
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  if (x2.scalar_type() == at::kFloat)
    gemm_grouped<float>(fmt, x2.data_ptr<float>(), counts, K, wp, N, y.data_ptr<float>());
  else
    gemm_grouped<at::BFloat16>(fmt, x2.data_ptr<at::BFloat16>(), counts, K, wp, N, y.data_ptr<at::BFloat16>());
  return y;
}

// MLA's absorbed per-head matrices in a block format: x (D, H, K) (rows and heads may be
// strided; K contiguous) through head h's N x K matrix, the stacked weight's packed blocks
// [h N/16, (h+1) N/16) -> (D, H, N). One call for all the heads: each head's matrix is read
// once for the step's rows, and the heads' blocks are shared out over the threads together.
// The same arithmetic as linear_quant per head (a row's output is its linear_quant output).
void head_matmul_quant_into(const at::BFloat16* x, int64_t sxr, int64_t sxh, int64_t D, int64_t H, int64_t K,
                            const uint8_t* packed, int64_t fmt, int64_t N, at::BFloat16* y) {
  if (D > 0 && H > 0) gemm_heads<at::BFloat16>(fmt, x, sxr, sxh, D, H, K, packed, N, nullptr, y, H * N);
}

torch::Tensor head_matmul_quant(torch::Tensor x, torch::Tensor packed, int64_t fmt, int64_t N) {
  const Layout L = layout_of(fmt);
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && x.dim() == 3, "head_matmul_quant: (D, H, K) on CPU");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "head_matmul_quant: bf16 or f32 x");
  TORCH_CHECK(x.stride(2) == 1, "head_matmul_quant: x's last dimension must be contiguous");
  TORCH_CHECK(N % ROWS == 0, "head_matmul_quant: rows per head must be a multiple of 16");
  const int64_t D = x.size(0), H = x.size(1), K = x.size(2);
  TORCH_CHECK(!is_super_block(fmt) || K % 256 == 0, "head_matmul_quant: K-quants need K a multiple of 256");
  TORCH_CHECK(K % QK == 0 && packed.dim() == 3 && packed.size(0) == H * N / ROWS && packed.size(1) == K / QK &&
                  packed.size(2) == L.chunk,
              "head_matmul_quant: packed weight does not match (H * N, K)");
  auto y = torch::empty({D, H, N}, x.options());
  if (D == 0 || H == 0) return y;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  if (x.scalar_type() == at::kFloat)
    gemm_heads<float>(fmt, x.data_ptr<float>(), x.stride(0), x.stride(1), D, H, K, wp, N, nullptr,
                      y.data_ptr<float>(), H * N);
  else
    gemm_heads<at::BFloat16>(fmt, x.data_ptr<at::BFloat16>(), x.stride(0), x.stride(1), D, H, K, wp, N, nullptr,
                             y.data_ptr<at::BFloat16>(), H * N);
  return y;
}
