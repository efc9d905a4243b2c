// The block formats' matmul for CPUs with AVX2 but without AVX-512 BF16/VNNI (AMD Zen 2 and 3,
// Intel's client cores up to Raptor Lake, ...): y = x @ W^T (+ bias), W in any of llama.cpp's
// block formats (ridge/quantization/formats.py), read as the GGUF bytes the layer holds, as
// loaded or moved at load into blocks of 8 rows: no conversion to a wider format. One extension
// of its own (ridge_cpu_avx2), built with AVX2/FMA/F16C only; the AVX-512 kernels
// (linear_quant.cpp) are the other extension.
//
// How a call runs:
// - x is quantized to int8 once per call, per 32 k (llama.cpp's Q8_0 activations: scale
//   amax / 127), keeping per 16 k the sum of its codes.
// - Each group of 32 weights is unpacked into 32 byte codes in one register: unsigned (0-63)
//   for the formats with an offset or a minimum, signed for Q8_0 and the IQ4 codebook's values
//   (those multiply through vpsignb, since vpmaddubsw takes one unsigned operand).
// - Every format can be repacked, at its size, into blocks of 8 rows
//   (repack_rows, ik_llama.cpp's _R8 idea): W's rows sit in a vector's 8 int32 lanes, so a
//   block's products need no horizontal sums and each lane's tree over the blocks is
//   tree_sum's, vertically (see "Rows of 8" below). linear_blocks takes GGUF's layout, as
//   loaded; linear_blocks_packed the rows of 8, with the same outputs bit for bit. Which
//   layers ridge packs at load is kernels.py's AVX2_PACKED_FORMATS (every format but Q6_K, which
//   read from memory for one row runs slower in rows of 8; Q8_0 since stop 81, which measured
//   it faster once weights lay in 2 MiB pages); a call of PACK_FROM_ROWS rows of x or more (a
//   decode step of 8 sequences or more, a prefill) on GGUF's layout packs each block of 8 rows
//   as it goes.
// - vpmaddubsw with an x row's codes, then vpmaddwd with the group's integer sub-scales (one
//   per 16 weights: lanes 0-3 of the result hold weights 0-15), into float lanes times the
//   block's fp16 factor and the x group's scale.
// - An offset (Q4_0's 8, Q6_K's 32, Q3_K's 4) and a minimum (Q4_1, Q4_K, Q5_K, Q2_K) come out
//   of the sums of x's codes: one scalar a group and row. (The sums of x itself would take the
//   minimum exactly but leave the codes' products, all of one sign, with the activations'
//   error: on a 2-layer model 0.5 nats off float32's log-probabilities, against 0.03 so.)
// - A group is unpacked once for up to 4 rows of x; in calls of 16 rows or more (prefill; 8
//   for the formats with bit planes: expand_from_rows) a block of 8 rows of any format but Q8_0
//   is unpacked once for all of them (expand_codes).
//   Every output (row of x, row of W) is computed by one thread (whichever takes its block of
//   rows), in the same order whatever the batch: a row's output does not depend on the rows
//   beside it. It is a sum of its blocks' sums as a tree (tree_sum), so a layer split by tensor
//   parallelism sums to the unsplit layer's outputs exactly.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "avx2_kernels.h"
#include "avx2_simd.h"
#include "cpu_vendor.h"
#include "paged_rows.h"
#include "step_parts.h"
#include "weight_arena.h"

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using ridge_avx2::hsum;
using ridge_avx2::load8;
using ridge_avx2::MAX_ROWS;  // rows of x a group is unpacked for at once

constexpr int64_t QK = 32;  // weights per group (a block, or a K-quant's sub-block)
// How far ahead of the block it reads a thread prefetches W (its rows are contiguous): the
// kernel alone, 8 matrices of 5632 x 2048 from memory, 2 threads, on the 2-core Zen 3 EPYC
// (2026-11-29, 3 rounds): Q4_K 11.1 -> 14.0 GB/s at 4 KiB ahead, 14.8 at 8; Q6_K 13.8 -> 18.0 /
// 18.2; Q8_0 13.1 -> 16.9 at 4 KiB; Q4_0 9.2 -> 10.0 (compute-bound). Without it a thread
// computes and then waits for memory, in turn. These are the L1 distances, AMD's; on Intel W is
// fetched into L2 instead (avx2_simd.h's fetch_ahead, which says what the Xeon measured).
constexpr int64_t PREFETCH_SUPER_BLOCKS = 8192, PREFETCH_BLOCKS = 4096;
// Rows of x from which a call on GGUF's layout packs W's blocks of 8 rows as it goes (packing
// reads each block once per call, then computes in rows of 8): the kernel alone, 8 matrices of
// 5632 x 2048 from memory, 2 threads, Zen 3 EPYC (2026-11-29, median of 5-7 paired rounds),
// speed packing / not: Q8_0 0.60 at 1 row, 0.75 at 4, 1.13 at 16, 1.27 at 32, 1.36 at 128;
// Q6_K 0.52, 0.57, 0.93, 1.02, 1.01. Since Q8_0 is packed at load this is Q6_K's alone, and
// since its blocks of 8 rows are decoded once a call (expand_codes) it packs from 8 rows: 22
// TinyLlama layers from memory, 2 threads, Zen 3, one process, 5 alternated rounds (2026-12-04),
// speed from 8 rows / from 32: 1.05x at 8 rows (1.24x in a run of 3), 1.28x at 12; 1.44x at 16
// and 1.63x at 24 (3 rounds).
constexpr int64_t PACK_FROM_ROWS = 8;
// A super-block of 8 rows' codes decoded, a byte a weight (expand_codes): block b's code vector
// of group grp and chunk t at expanded_at(b, grp, t)
constexpr int64_t EXPANDED_BYTES = 8 * 256;
constexpr int64_t expanded_at(int64_t b, int grp, int t) { return EXPANDED_BYTES * b + 32 * (8 * grp + t); }

// Fetch the BYTES at p + AHEAD into L1, or on Intel the BYTES L2_FETCH_AHEAD on into L2
// (avx2_simd.h), a line at a time (a prefetch past the matrix's end does not fault)
template <int64_t AHEAD, int64_t BYTES>
inline void prefetch_ahead(const uint8_t* p) {
  for (int64_t o = 0; o < BYTES; o += 64) ridge_avx2::fetch_ahead<AHEAD>(reinterpret_cast<const char*>(p + o));
}
// ... into L1 on every CPU (Q6_K's one-row kernel on GGUF's layout: on the Xeon 0.91x as fast with
// L2 fetches, its file's batch-1 steps 0.92x, where every other kernel gained or held)
template <int64_t AHEAD, int64_t BYTES>
inline void prefetch_ahead_l1(const uint8_t* p) {
  for (int64_t o = 0; o < BYTES; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + AHEAD + o), _MM_HINT_T0);
}
// A rows-of-8 kernel's fetches of W: ONE, one L1 fetch a line (prefetch_ahead_l1), which a call
// of ONE_FETCH_ROWS rows of x or fewer takes on AMD (where fetch_ahead's second fetch, of the
// line itself, is not wanted); else prefetch_ahead's two. 22 TinyLlama layers from memory, 2
// threads, the Zen 3 EPYC, both ways alternated in one process (5 rounds, 2026-12-04), one row
// of x: Q6_K 1.39x, Q5_K 1.30x, Q4_K 1.24x, Q2_K 1.18x, IQ4_NL 1.14x, IQ4_XS 1.10x, Q8_0 1.10x,
// Q3_K 1.07x, Q4_0 0.97x; 2 rows: Q4_K 1.43x, Q5_K and Q6_K 1.28x, IQ4_NL 1.11x, the others
// 0.95-1.03x; 3 rows: Q4_K and Q5_K 1.24x, Q4_0 1.08x, Q3_K 1.06x, the others 0.96-1.01x; 4
// rows: Q3_K 0.77x, Q2_K 0.88x (the compiler places the kernel's other loads differently), the
// others 1.02-1.28x. The files' decode steps, both ways toggled step by step in one process (48
// pairs at batch 1, 28 at 2-4): batch 1 Q5_K_M 1.18x, Q3_K_M 1.16x, Q4_K_M 1.16x, IQ4_XS 1.13x,
// Q2_K 1.08x, Q4_0 1.02x, Q8_0 0.97-1.02x; batch 2 Q4_K_M 1.17x, Q3_K_M and Q2_K 0.99x; batch 3
// Q5_K_M 1.13x, Q4_K_M 1.10x, Q3_K_M 1.06x, IQ4_XS, Q4_0 and Q8_0 1.02-1.03x, Q2_K 1.01x; batch
// 4 Q3_K_M 0.81x, Q2_K 0.85x, Q4_K_M 1.02x. (The super-block kernels' one fetch a line is
// spread over a block's groups since: fetch_slice.)
constexpr int ONE_FETCH_ROWS = 3;
template <bool ONE, int64_t AHEAD, int64_t BYTES>
inline void fetch_w(const uint8_t* p) {
  if constexpr (ONE)
    prefetch_ahead_l1<AHEAD, BYTES>(p);
  else
    prefetch_ahead<AHEAD, BYTES>(p);
}

// A rows-of-8 super-block kernel's fetches of W at ONE (every super-block format's): group j
// of a block's 8 fetches slice j of the block's bytes (a GGUF block's size, 84-210 bytes), where
// the whole block's 11-27 lines went in one burst as it began. 22 TinyLlama layers from memory,
// 2 threads, the Zen 3 EPYC, both ways alternated in one process (7-9 rounds, 2026-12-04), at
// 1 / 2 / 3 rows of x: Q5_K 1.12x / 1.24x / 1.21x, Q3_K 1.15x / 1.15x / 1.09x, IQ4_XS 1.11x /
// 1.03x / 1.04x, Q4_K 1.00x / 1.03x / 1.08x, Q2_K 1.00x / 1.03x / 1.08x. The files' decode steps,
// both ways toggled step by step in one process (33-43 pairs): batch 1 Q2_K 1.15x, Q3_K_M 1.08x,
// Q5_K_M 1.06x, IQ4_XS 1.05x, Q4_K_M 1.04x; batch 2 Q5_K_M 1.12x, Q4_K_M 1.01x; batch 3 Q5_K_M
// 1.24x. (Q6_K keeps GGUF's layout: in rows of 8 with these fetches it still read 0.86x that
// layout at one row and 0.82x at 2, 1.08-1.09x at 3-4, alternated the same way.)
template <int64_t SLICE>
inline void fetch_slice(const uint8_t* p, int j) {
  prefetch_ahead_l1<PREFETCH_SUPER_BLOCKS, SLICE>(p + j * SLICE);
}

// The next block of 8 rows of a thread's share (its `bytes` at p, either layout) in a decode call
// that decodes each block once (expand_codes: 8-15 rows of x for Q5_K, Q6_K and Q3_K), which the
// thread fetches into L1 while it decodes the block before, a slice a super-block (fetch_decoding),
// instead of fetching ahead of the block it decodes. The products of a decoded block fetch
// nothing, so W's next bytes were asked for only as its decoding began, and a call that packs
// as it goes (Q6_K) reads a block of rows first: its packing's loads waited on memory with no
// work beside them (29-32% of such a call's time in a perf sample). None (p null) where the next
// block is not the thread's (its share's last; calls of TAKE_FROM_ROWS rows or more, whose
// blocks go to whichever thread is free) and on Intel (fetch_into_l2: not measured there). 22
// TinyLlama layers from memory, 2 threads, the Zen 3 EPYC, alternated in one process (7-9
// rounds, 2026-12-04): Q6_K 1.14x at 8 rows, 1.08x at 12; Q5_K 1.06x at 8 and 10 rows (1.03x in
// a run of 7), Q3_K 1.02-1.03x. The files' decode steps at batch 8, both ways alternated step by
// step in one process (26 pairs): Q6_K 1.15x (and 1.11x, 1.14x at batch 12 in an earlier form),
// Q5_K_M 1.03x, Q3_K_M 1.02x.
struct NextBlock {
  const uint8_t* p = nullptr;
  int64_t bytes = 0;
};
// What decoding block b of nb (its BYTES at p) fetches: slice b of the next block's lines, or
// without one the BYTES AHEAD of p (prefetch_ahead)
template <int64_t AHEAD, int64_t BYTES>
inline void fetch_decoding(const uint8_t* p, const NextBlock& next, int64_t b, int64_t nb) {
  if (!next.p) return prefetch_ahead<AHEAD, BYTES>(p);
  const uintptr_t at = reinterpret_cast<uintptr_t>(next.p);
  const uintptr_t end = at + next.bytes * (b + 1) / nb;
  // (prefetch_line, paged_rows.h: as _mm_prefetch, GCC deleted this loop from many of the
  // kernels that inline it, 2,198 fetches in the compiled file against 2,897. Kept everywhere,
  // 22 layers on the 2-core Zen 4 against the build without: 1 and 8 rows of x 0.96-1.05x for
  // every format, within the rounds' noise; not measured on the Zen 3 since)
  for (uintptr_t line = (at + next.bytes * b / nb) & ~uintptr_t(63); line < end; line += 64)
    prefetch_line<_MM_HINT_T0>(reinterpret_cast<const char*>(line));
}

// llama.cpp's kvalues_iq4nl (formats.py IQ4_NL_VALUES)
alignas(16) constexpr int8_t IQ4_NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                  1,    13,   25,  38,  53,  69,  89,  113};

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 8 fp16 (16 bytes at p) as floats
inline __m256 halves8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

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

// The 32-weight formats: a block is one group. Each one's codes(block) unpacks its 32 codes;
// D_AT is where a block's fp16 factor d sits, M_AT its fp16 minimum m (MIN: w = d q + m),
// HEADER the bytes of fp16 factors (from FACTORS_AT: 0, before the codes, in all but Q6_K), and
// OFFSET_SHIFT gives Q4_0's offset, 8 (w = d (q - 8)). NIBBLES: codes 0-15, unsigned (see widen).
struct Q8_0 {
  static constexpr int64_t BLOCK = 32, BYTES = 34, D_AT = 0, M_AT = 0;
  static constexpr bool SIGNED = true, OFFSET = false, MIN = false, NIBBLES = false;
  static constexpr int OFFSET_SHIFT = 0;
  static constexpr int64_t HEADER = 2, FACTORS_AT = 0;
  static __m256i codes(const uint8_t* p) { return load32(p + 2); }
};

struct Q4_0 {
  static constexpr int64_t BLOCK = 32, BYTES = 18, D_AT = 0, M_AT = 0;
  static constexpr bool SIGNED = false, OFFSET = true, MIN = false, NIBBLES = true;
  static constexpr int OFFSET_SHIFT = 3;
  static constexpr int64_t HEADER = 2, FACTORS_AT = 0;
  static __m256i codes(const uint8_t* p) { return nibbles16(p + 2); }
};

struct Q4_1 {
  static constexpr int64_t BLOCK = 32, BYTES = 20, D_AT = 0, M_AT = 2;
  static constexpr bool SIGNED = false, OFFSET = false, MIN = true, NIBBLES = true;
  static constexpr int OFFSET_SHIFT = 0;
  static constexpr int64_t HEADER = 4, FACTORS_AT = 0;
  static __m256i codes(const uint8_t* p) { return nibbles16(p + 4); }
};

struct IQ4_NL {
  static constexpr int64_t BLOCK = 32, BYTES = 18, D_AT = 0, M_AT = 0;
  static constexpr bool SIGNED = true, OFFSET = false, MIN = false, NIBBLES = false;
  static constexpr int OFFSET_SHIFT = 0;
  static __m256i codes(const uint8_t* p) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_NL_VALUES)));
    return _mm256_shuffle_epi8(table, nibbles16(p + 2));
  }
  static constexpr int64_t HEADER = 2, FACTORS_AT = 0;
};

// The super-block formats (256 weights: the K-quants and IQ4_XS). Each one's
// block(p, header, sink) decodes a super-block's header (its factors, 16 per-16 minimums and
// offsets as int16 vectors) and calls sink(j, codes, scales) for its 8 groups j in order: the
// group's 32 codes and its sub-scales as int16 (lanes 0-7 for weights 0-15, 8-15 for 16-31).
// The weight w_l = d * s_h * (code_l - offset) - dmin * m_h, h = l / 16 of the super-block.
struct Header {
  float d, dmin;
  __m256i mins;     // m_h, 16 int16 (0 where the format has none)
  __m256i offsets;  // offset * s_h, 16 int16 (0 where the format has none)
};

// pshufb masks picking int16 lane a of a 128-bit half for the low half and lane b for the
// high one: SAME_MASKS[j] (a = b = j: a scale per 32 weights), PAIR_MASKS[i] (a = 2i, b =
// 2i + 1: a scale per 16). Constants, so each pick is one vpshufb with a memory operand.
struct PickMasks {
  alignas(32) uint8_t same[8][32];
  alignas(32) uint8_t pair[4][32];
  constexpr PickMasks() : same(), pair() {
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < 32; ++l) {
        same[j][l] = static_cast<uint8_t>(2 * j + (l & 1));
        if (j < 4) pair[j][l] = static_cast<uint8_t>(2 * (2 * j + (l >= 16)) + (l & 1));
      }
  }
};
constexpr PickMasks PICK{};

// [src[j] x 8 | src[j] x 8] and [src[2i] x 8 | src[2i + 1] x 8] from the int16 lanes 0-7 of
// src (both 128-bit halves alike)
inline __attribute__((always_inline)) __m256i pick_same(__m256i src, int j) {
  return _mm256_shuffle_epi8(src, _mm256_load_si256(reinterpret_cast<const __m256i*>(PICK.same[j])));
}
inline __attribute__((always_inline)) __m256i pick_pair(__m256i src, int i) {
  return _mm256_shuffle_epi8(src, _mm256_load_si256(reinterpret_cast<const __m256i*>(PICK.pair[i])));
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Q4_K's and Q5_K's 12 bytes of 6-bit (scale, min) pairs for the 8 groups -> bytes 0-7 the
// scales, 8-15 the minimums
inline __m128i k_scales(const uint8_t* q) {
  const uint32_t u0 = load_u32(q), u1 = load_u32(q + 4), u2 = load_u32(q + 8);
  const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
  return _mm_setr_epi32(static_cast<int>(u0 & low6), static_cast<int>((u2 & low4) | (((u0 >> 6) & low2) << 4)),
                        static_cast<int>(u1 & low6),
                        static_cast<int>(((u2 >> 4) & low4) | (((u1 >> 6) & low2) << 4)));
}

// Q4_K/Q5_K header: the 8 scales as int16 in both halves (for pick_same), the minimums per 16
inline __m256i k_header(const uint8_t* p, Header& h) {
  h.d = f16(p), h.dmin = f16(p + 2);
  const __m128i sm = k_scales(p + 4);
  h.mins = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(sm, sm));  // each group's minimum for its 2 halves
  h.offsets = _mm256_setzero_si256();
  return _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
}

struct Q4_K {
  static constexpr int64_t BLOCK = 256, BYTES = 144;
  static constexpr bool SIGNED = false, OFFSET = false, MIN = true;
  static constexpr int64_t HEADER = 4, FACTORS_AT = 0;  // d, dmin
  template <class Sink>
  static void block(const uint8_t* p, Header& h, Sink&& sink) {
    const __m256i sc = k_header(p, h), low = _mm256_set1_epi8(15);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {  // run c of 32 bytes: group 2c in the low nibbles, 2c + 1 in the high
      const __m256i v = load32(p + 16 + 32 * c);
      sink(2 * c, _mm256_and_si256(v, low), pick_same(sc, 2 * c));
      sink(2 * c + 1, _mm256_and_si256(_mm256_srli_epi16(v, 4), low), pick_same(sc, 2 * c + 1));
    }
  }
};

struct Q5_K {
  static constexpr int64_t BLOCK = 256, BYTES = 176;
  static constexpr bool SIGNED = false, OFFSET = false, MIN = true;
  static constexpr int64_t HEADER = 4, FACTORS_AT = 0;  // d, dmin
  template <class Sink>
  static void block(const uint8_t* p, Header& h, Sink&& sink) {
    const __m256i sc = k_header(p, h), qh = load32(p + 16), low = _mm256_set1_epi8(15);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {  // Q4_K's nibbles; bit j of qh[l] adds 16 to group j's element l
      const __m256i v = load32(p + 48 + 32 * c);
      const int j = 2 * c;
      sink(j, _mm256_or_si256(_mm256_and_si256(v, low), bit_as(qh, j, 16)), pick_same(sc, j));
      sink(j + 1, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), bit_as(qh, j + 1, 16)),
           pick_same(sc, j + 1));
    }
  }
};

struct IQ4_XS {
  static constexpr int64_t BLOCK = 256, BYTES = 136;
  static constexpr bool SIGNED = true, OFFSET = false, MIN = false;
  static constexpr int64_t HEADER = 4, FACTORS_AT = 0;  // d and scales_h, as 2-byte fields
  template <class Sink>
  static void block(const uint8_t* p, Header& h, Sink&& sink) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_NL_VALUES)));
    h.d = f16(p), h.dmin = 0.f, h.mins = h.offsets = _mm256_setzero_si256();
    // group j's scale: 4 bits (nibble j of bytes 4-7) and 2 (bits 2j of bytes 2-3), less 32
    const __m128i l = _mm_cvtsi32_si128(static_cast<int>(load_u32(p + 4))), m4 = _mm_set1_epi8(15);
    const __m128i lo = _mm_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_and_si128(l, m4), _mm_and_si128(_mm_srli_epi16(l, 4), m4)));
    const __m256i hv = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(p[2] | (p[3] << 8)),
                                                          _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                        _mm256_set1_epi32(3));
    const __m128i hi = _mm_packs_epi32(_mm256_castsi256_si128(hv), _mm256_extracti128_si256(hv, 1));
    const __m256i sc = _mm256_broadcastsi128_si256(
        _mm_sub_epi16(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), _mm_set1_epi16(32)));
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) sink(j, _mm256_shuffle_epi8(table, nibbles16(p + 8 + 16 * j)), pick_same(sc, j));
  }
};

struct Q6_K {
  static constexpr int64_t BLOCK = 256, BYTES = 210;
  static constexpr bool SIGNED = false, OFFSET = true, MIN = false;
  static constexpr int64_t HEADER = 2, FACTORS_AT = 208;  // d, at the block's end
  template <class Sink>
  static void block(const uint8_t* p, Header& h, Sink&& sink) {
    h.d = f16(p + 208), h.dmin = 0.f, h.mins = _mm256_setzero_si256();
    const __m256i s = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192)));
    h.offsets = _mm256_slli_epi16(s, 5);  // the codes' offset, 32
    const __m256i low = _mm256_set1_epi8(15), high = _mm256_set1_epi8(0x30);
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {  // each: 64 bytes of low nibbles, 32 of top 2-bit pairs, 8 scales
      const __m256i sc = half ? _mm256_permute2x128_si256(s, s, 0x11) : _mm256_permute2x128_si256(s, s, 0x00);
      const __m256i a = load32(p + 64 * half), b = load32(p + 64 * half + 32), top = load32(p + 128 + 32 * half);
      const __m256i nib[4] = {_mm256_and_si256(a, low), _mm256_and_si256(b, low),
                              _mm256_and_si256(_mm256_srli_epi16(a, 4), low),
                              _mm256_and_si256(_mm256_srli_epi16(b, 4), low)};
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {  // bits 2i of top moved to bits 4-5, then masked: 1-2 ops, not 3-4
        const __m256i t = i < 2 ? _mm256_slli_epi16(top, 4 - 2 * i) : i == 2 ? top : _mm256_srli_epi16(top, 2);
        sink(4 * half + i, _mm256_or_si256(nib[i], _mm256_and_si256(t, high)), pick_pair(sc, i));
      }
    }
  }
};

struct Q3_K {
  static constexpr int64_t BLOCK = 256, BYTES = 110;
  static constexpr bool SIGNED = false, OFFSET = true, MIN = false;
  static constexpr int64_t HEADER = 2, FACTORS_AT = 108;  // d, at the block's end
  template <class Sink>
  static void block(const uint8_t* p, Header& h, Sink&& sink) {
    h.d = f16(p + 108), h.dmin = 0.f, h.mins = _mm256_setzero_si256();
    // scale i: 4 bits (byte i % 8 of bytes 96-103, its low nibble for i < 8) and 2 (byte
    // 104 + i % 4, bits 2 (i / 4)), less 32
    const __m128i l = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 96)), m4 = _mm_set1_epi8(15);
    const __m128i lo = _mm_unpacklo_epi64(_mm_and_si128(l, m4), _mm_and_si128(_mm_srli_epi16(l, 4), m4));
    const __m128i hi = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(static_cast<int>(load_u32(p + 104))),
                                                    _mm_setr_epi32(0, 2, 4, 6)),
                                     _mm_set1_epi8(3));
    const __m256i s = _mm256_cvtepi8_epi16(_mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), _mm_set1_epi8(32)));
    h.offsets = _mm256_slli_epi16(s, 2);  // the codes' offset, 4
    const __m256i hmask = load32(p);
#pragma GCC unroll 2
    for (int n = 0; n < 2; ++n) {  // 32 bytes of 2-bit codes per 4 groups; hmask's bit g: the code's 4
      const __m256i sc = n ? _mm256_permute2x128_si256(s, s, 0x11) : _mm256_permute2x128_si256(s, s, 0x00);
      const __m256i q = load32(p + 32 + 32 * n);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const int g = 4 * n + j;
        sink(g, _mm256_or_si256(two_bits(q, j), bit_as(hmask, g, 4)), pick_pair(sc, j));  // q + 4, 0-7
      }
    }
  }
};

struct Q2_K {
  static constexpr int64_t BLOCK = 256, BYTES = 84;
  static constexpr bool SIGNED = false, OFFSET = false, MIN = true;
  static constexpr int64_t HEADER = 4, FACTORS_AT = 80;  // d, dmin, at the block's end
  template <class Sink>
  static void block(const uint8_t* p, Header& h, Sink&& sink) {
    h.d = f16(p + 80), h.dmin = f16(p + 82), h.offsets = _mm256_setzero_si256();
    // per 16 weights: the scale in a byte's low nibble, the minimum in its high one
    const __m128i sm = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), m4 = _mm_set1_epi8(15);
    const __m256i s = _mm256_cvtepu8_epi16(_mm_and_si128(sm, m4));
    h.mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sm, 4), m4));
#pragma GCC unroll 2
    for (int n = 0; n < 2; ++n) {
      const __m256i sc = n ? _mm256_permute2x128_si256(s, s, 0x11) : _mm256_permute2x128_si256(s, s, 0x00);
      const __m256i q = load32(p + 16 + 32 * n);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) sink(4 * n + j, two_bits(q, j), pick_pair(sc, j));
    }
  }
};

// x quantized for a call: per row K int8 codes and a scale per QX k (32 for the 32-weight
// formats, as llama.cpp's Q8_0; 256 for the super-block formats, as its Q8_K), the sums of the
// codes per 16 (int16) and per 32 (int32). Each array has 8 groups' room past its end: a run
// of 8 blocks at a row's end reads them (with zero weight codes).
struct QuantizedX {
  static constexpr int64_t PAD = 8;
  int64_t M = 0, K = 0, G = 0, QX = QK;  // G: scales a row
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int16_t> qsum16;
  std::vector<int32_t> qsum32;

  const int8_t* codes(int64_t m) const { return q.data() + m * K; }
  const float* scales(int64_t m) const { return scale.data() + m * G; }
  const int16_t* qsums16(int64_t m) const { return qsum16.data() + m * (K / 16); }
  const int32_t* qsums32(int64_t m) const { return qsum32.data() + m * (K / QK); }
};

inline int32_t hsum(__m128i v) {
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(v);
}

template <class T>
void quantize_x(const T* x, int64_t M, int64_t K, int64_t QX, QuantizedX& out) {
  out.M = M, out.K = K, out.G = K / QX, out.QX = QX;
  const int64_t pad = QuantizedX::PAD, per = QX / QK;  // groups of 32 a scale
  out.q.assign(M * K + pad * 256, 0), out.scale.assign(M * out.G + pad, 0.f);
  out.qsum16.assign(M * K / 16 + 16 * pad, 0), out.qsum32.assign(M * K / QK + 8 * pad, 0);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  at::parallel_for(0, M * out.G, 256 / per, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {  // scale i of the M x K / QX
      const T* src = x + i * QX;  // rows are contiguous: scale i covers x[i QX, (i + 1) QX)
      __m256 amax = _mm256_setzero_ps();
      for (int64_t k = 0; k < QX; k += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, load8(src + k)));
      __m128 a = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      a = _mm_max_ps(a, _mm_movehl_ps(a, a));
      a = _mm_max_ss(a, _mm_movehdup_ps(a));
      const float d = _mm_cvtss_f32(a) / 127.f, id = d > 0.f ? 1.f / d : 0.f;
      out.scale[i] = d;
      for (int64_t g = i * per; g < (i + 1) * per; ++g) {  // group g of 32 (over all rows)
        __m256i q[4];
        for (int k = 0; k < 4; ++k)
          q[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(load8(x + g * QK + 8 * k), _mm256_set1_ps(id)),
                                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        // int32 x 32 -> int8 x 32 in order (packs interleave the 128-bit lanes: permute them back)
        const __m256i w16a = _mm256_packs_epi32(q[0], q[1]), w16b = _mm256_packs_epi32(q[2], q[3]);
        const __m256i b8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16a, w16b),
                                                       _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q.data() + g * QK), b8);
        int32_t halves[2];
        for (int h = 0; h < 2; ++h) {
          const __m256i s = _mm256_add_epi32(q[2 * h], q[2 * h + 1]);
          halves[h] = hsum(_mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1)));
          out.qsum16[2 * g + h] = static_cast<int16_t>(halves[h]);  // |sum| <= 16 * 127
        }
        out.qsum32[g] = halves[0] + halves[1];
      }
    }
  });
}

// Two quads' pairwise sums a = hadd(hadd(v0, v1), hadd(v2, v3)), b (v4-v7) -> the 8 vectors'
// lane sums as one int32 vector, in order
inline __m256i sums_of_quads(__m256i a, __m256i b) {
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// The sums of 8 vectors' lanes (integers: in any order), as one vector
inline __m256i sums_of_8(const __m256i v[8]) {
  return sums_of_quads(_mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3])),
                       _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7])));
}

// The 32-weight formats' products of a block and a row of x, reduced across lanes 8 blocks at
// a time as a tree of horizontal adds (pairs, quads, then sums_of_quads). Most formats widen
// vpmaddubsw's int16 pair sums to int32 first (vpmaddwd), as their products reach 127 * 127.
// The 4-bit unsigned codes (NIBBLES: Q4_0, Q4_1) keep them in int16 to the last level: a lane
// then sums 16 products of at most 15 * 127 (< 2^15), so vphaddw cannot wrap, and vpmaddwd is
// skipped.
template <class F>
inline __m256i widen(__m256i pair_sums) {
  return F::NIBBLES ? pair_sums : _mm256_madd_epi16(pair_sums, _mm256_set1_epi16(1));
}
template <class F>
inline __m256i hadd(__m256i a, __m256i b) {
  return F::NIBBLES ? _mm256_hadd_epi16(a, b) : _mm256_hadd_epi32(a, b);
}
template <class F>
inline __m256i block_sums(__m256i quad0, __m256i quad1) {
  if (!F::NIBBLES) return sums_of_quads(quad0, quad1);
  const __m256i c = _mm256_hadd_epi16(quad0, quad1);  // per 128-bit half: the 8 blocks' half sums
  return _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(c)),
                          _mm256_cvtepi16_epi32(_mm256_extracti128_si256(c, 1)));
}

// One row of W in a super-block format (its nb blocks at w) against rows [m0, m0 + R) of x:
// each block's sum into c[r * nbp + b]. Per block and row of x, the groups' integer products
// (sub-scales applied) add up in one int32 vector, less the offsets' part (x's code sums per
// 16 times offset * s_h); the minimums' part is a second vector. The vectors of 8 blocks are
// then summed across their lanes at once (sums_of_8) and scaled by the blocks' d, dmin and x's
// scale: c = d dx sum - dmin dx minsum. buf: 2 R nbp vectors and 2 nbp floats of scratch
// (nbp: nb rounded up to 8, the padding zero).
template <class F, int R>
void super_block_row(const uint8_t* w, int64_t nb, int64_t nbp, const QuantizedX& x, int64_t m0, __m256i* dots,
                     __m256i* mins, float* d, float* dmin, float* c) {
  for (int64_t b = 0; b < nb; ++b) {
    if constexpr (std::is_same_v<F, Q6_K>)
      prefetch_ahead_l1<PREFETCH_SUPER_BLOCKS, F::BYTES>(w + b * F::BYTES);
    else
      prefetch_ahead<PREFETCH_SUPER_BLOCKS, F::BYTES>(w + b * F::BYTES);
    Header h;
    __m256i acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
    const int8_t* xq[R];
    for (int r = 0; r < R; ++r) xq[r] = x.codes(m0 + r) + b * 256;
    F::block(w + b * F::BYTES, h, [&](int j, __m256i codes, __m256i scales) __attribute__((always_inline)) {
      const __m256i u = F::SIGNED ? _mm256_sign_epi8(codes, codes) : codes;
      for (int r = 0; r < R; ++r) {
        __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + QK * j));
        if (F::SIGNED) xv = _mm256_sign_epi8(xv, codes);
        acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u, xv), scales));
      }
    });
    d[b] = h.d, dmin[b] = h.dmin;
    for (int r = 0; r < R; ++r) {
      const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.qsums16(m0 + r) + 16 * b));
      dots[r * nbp + b] = F::OFFSET ? _mm256_sub_epi32(acc[r], _mm256_madd_epi16(bs, h.offsets)) : acc[r];
      if (F::MIN) mins[r * nbp + b] = _mm256_madd_epi16(bs, h.mins);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t b0 = 0; b0 < nb; b0 += 8) {
      const __m256 dx = _mm256_loadu_ps(x.scales(m0 + r) + b0);  // past the row's end: zero sums
      __m256 sums = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(d + b0), dx),
                                  _mm256_cvtepi32_ps(sums_of_8(dots + r * nbp + b0)));
      if (F::MIN)
        sums = _mm256_sub_ps(sums, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(dmin + b0), dx),
                                                 _mm256_cvtepi32_ps(sums_of_8(mins + r * nbp + b0))));
      _mm256_storeu_ps(c + r * nbp + b0, sums);
    }
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// The fp16 at byte `at` of 8 consecutive blocks from p (n of them; 0 for the rest), as floats
template <class F, bool FULL>
inline __m256 gather_f16(const uint8_t* p, int64_t at, int n) {
  uint16_t h[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) h[i] = (FULL || i < n) ? load_u16(p + i * F::BYTES + at) : 0;
  return _mm256_cvtph_ps(_mm_setr_epi16(h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]));
}

// Blocks [b0, b0 + 8) of a row of 32-weight blocks (fewer at the row's end: n): each block's
// sum for rows [m0, m0 + R) of x, scaled by its d and x's scale. A block's codes are unpacked
// once for all rows; the 8 blocks' integer products are summed across lanes together (hadd's
// tree, then block_sums). Where the row's tree takes runs of 8 (RUNS: tree_sum's
// runs_of_8), only the 8's pairwise sum (the tree's subtree of 8) is kept, in c8[r * nb8 +
// b0 / 8]; else each block's sum, in c[r * nbp + b]. FULL: n is 8, the loops' bounds known to
// the compiler.
template <class F, int R, bool FULL, bool RUNS>
void block_sums_8(const uint8_t* w, int64_t b0, int n, int64_t nbp, const QuantizedX& x, int64_t m0, float* c,
                  float* c8, int64_t nb8) {
  static_assert(FULL || !RUNS, "a row's partial run of 8 has its sums in c");
  if (FULL) n = 8;
  const uint8_t* p = w + b0 * F::BYTES;
  prefetch_ahead<PREFETCH_BLOCKS, 8 * F::BYTES>(p);
  // Each row's products, reduced as they come (a pair, then a quad of blocks at a time): a
  // row holds at most a quad's sums and a pair's live, not 8 vectors (up to 4 rows: 16
  // registers). Multi-row calls ran 10% faster than with all 8 vectors kept to the end.
  __m256i quad[R][2], pair[R][2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    __m256i codes = _mm256_setzero_si256();
    if (FULL || i < n) codes = F::codes(p + i * F::BYTES);
    const __m256i u = F::SIGNED ? _mm256_sign_epi8(codes, codes) : codes;
    for (int r = 0; r < R; ++r) {  // blocks past the row's end: zero codes above
      __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.codes(m0 + r) + (b0 + i) * QK));
      if (F::SIGNED) xv = _mm256_sign_epi8(xv, codes);
      const __m256i v = widen<F>(_mm256_maddubs_epi16(u, xv));
      if (i % 2 == 0) {
        pair[r][0] = v;
        continue;
      }
      pair[r][1] = hadd<F>(pair[r][0], v);
      quad[r][i / 4] = i % 4 == 1 ? pair[r][1] : hadd<F>(quad[r][i / 4], pair[r][1]);
    }
  }
  const __m256 dv = gather_f16<F, FULL>(p, F::D_AT, n);
  const __m256 mv = F::MIN ? gather_f16<F, FULL>(p, F::M_AT, n) : _mm256_setzero_ps();
  for (int r = 0; r < R; ++r) {
    __m256i dot = block_sums<F>(quad[r][0], quad[r][1]);
    const __m256 dx = _mm256_loadu_ps(x.scales(m0 + r) + b0);
    const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.qsums32(m0 + r) + b0));
    if (F::OFFSET) dot = _mm256_sub_epi32(dot, _mm256_slli_epi32(qs, F::OFFSET_SHIFT));
    __m256 sums = _mm256_mul_ps(_mm256_mul_ps(dv, dx), _mm256_cvtepi32_ps(dot));
    if (F::MIN) sums = _mm256_add_ps(sums, _mm256_mul_ps(_mm256_mul_ps(mv, dx), _mm256_cvtepi32_ps(qs)));
    if constexpr (RUNS) {  // ((c0 + c1) + (c2 + c3)) + ((c4 + c5) + (c6 + c7))
      const __m256 pairs = _mm256_hadd_ps(sums, sums), quads = _mm256_hadd_ps(pairs, pairs);
      c8[r * nb8 + b0 / 8] = _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(quads), _mm256_extractf128_ps(quads, 1)));
    } else if constexpr (FULL) {
      _mm256_storeu_ps(c + r * nbp + b0, sums);
    } else {
      alignas(32) float out[8];
      _mm256_store_ps(out, sums);
      for (int i = 0; i < n; ++i) c[r * nbp + b0 + i] = out[i];
    }
  }
}

// The sum of blocks [b, b + n) of one row's block sums c (c8: its aligned runs of 8, summed),
// as a tree: an even count is the sum of its two halves' sums; an odd one adds in order. A
// row-parallel layer split in 2 (or 4, ...) at block boundaries then adds the same float sums
// as the unsplit layer: tensor parallelism's all-reduce gives the single process's outputs bit
// for bit, where a sum in another order would not (and the next layer's int8 activations would
// round some of them the other way).
//
// Level by level: n = odd * 2^levels has 2^levels leaves, each the in-order sum of `odd` block
// sums (where odd is 1 and b is aligned, c8 holds the lowest 3 levels' sums), then pairs of
// pairs. (The recursion this replaces, halving down to the leaves, took 11% of a Q4_0 decode
// matmul's time on the Zen 3 EPYC.)
// Whether a row of nb blocks sums runs of 8 first: nb a power of 2, at least 8 (its halves
// are then aligned runs too, down to 8)
inline bool takes_runs_of_8(int64_t nb) { return nb >= 8 && (nb & (nb - 1)) == 0; }

// The pairwise levels of n sums s (n a power of 2): ((s0 + s1) + (s2 + s3)) + ... Levels above
// 8 go 16 -> 8 a vector at a time (vhaddps's pairs, put back in order) into buf (s may be buf);
// the last 8 in registers. The loop this replaces summed each level in place in a float array,
// every add waiting on the store before it (forwarded through memory): most of tree_sum's time,
// which took 10% of the Q6_K file's batch-1 decode steps on the Zen 3 EPYC (perf).
inline float pairwise(const float* s, int64_t n, float* buf) {
  for (; n > 8; n /= 2, s = buf)
    for (int64_t i = 0; i < n / 16; ++i) {
      const __m256 h = _mm256_hadd_ps(_mm256_loadu_ps(s + 16 * i), _mm256_loadu_ps(s + 16 * i + 8));
      _mm256_storeu_ps(buf + 8 * i, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(h), 0xd8)));
    }
  switch (n) {
    case 1: return s[0];
    case 2: return s[0] + s[1];
    case 4: return (s[0] + s[1]) + (s[2] + s[3]);
    default: return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  }
}

float tree_sum(const float* c, const float* c8, int64_t b, int64_t n) {
  constexpr int64_t MAX_LEAVES = 64;
  int64_t odd = n, leaves = 1;
  while (odd > 1 && odd % 2 == 0) odd /= 2, leaves *= 2;
  const bool runs_of_8 = odd == 1 && leaves >= 8 && c8 != nullptr && b % 8 == 0;
  if (runs_of_8) leaves /= 8;
  if (leaves > MAX_LEAVES) return tree_sum(c, c8, b, n / 2) + tree_sum(c, c8, b + n / 2, n / 2);
  alignas(32) float s[MAX_LEAVES];
  if (runs_of_8) return pairwise(c8 + b / 8, leaves, s);
  if (odd == 1) return pairwise(c + b, leaves, s);
  for (int64_t i = 0; i < leaves; ++i) {
    const float* leaf = c + b + i * odd;
    float t = leaf[0];
    for (int64_t j = 1; j < odd; ++j) t += leaf[j];
    s[i] = t;
  }
  return pairwise(s, leaves, s);
}

// A thread's scratch for one row of W against up to MAX_ROWS rows of x: block sums (c, and
// c8 their runs of 8 for the 32-weight formats) and the super-block formats' vectors and factors.
struct Scratch {
  int64_t nb, nbp, nb8;  // blocks a row, rounded up to 8, runs of 8 (+ 1)
  std::vector<float> c, c8, d, dmin;
  std::vector<__m256i> dots, mins;

  explicit Scratch(int64_t blocks)
      : nb(blocks), nbp((blocks + 7) / 8 * 8), nb8(blocks / 8 + 1), c(MAX_ROWS * nbp), c8(MAX_ROWS * nb8),
        d(nbp, 0.f), dmin(nbp, 0.f), dots(MAX_ROWS * nbp, _mm256_setzero_si256()),
        mins(MAX_ROWS * nbp, _mm256_setzero_si256()) {}
};

// Rows [m0, m0 + R) of x against one row of W (its blocks at w): y[r] for each.
template <class F, int R>
void dot_row(const uint8_t* w, const QuantizedX& x, int64_t m0, Scratch& s, float* y) {
  const int64_t nb = s.nb;
  if constexpr (F::BLOCK == QK) {
    float *c = s.c.data(), *c8 = s.c8.data();
    if (takes_runs_of_8(nb)) {  // runs of 8 only
      for (int64_t b0 = 0; b0 < nb; b0 += 8) block_sums_8<F, R, true, true>(w, b0, 8, s.nbp, x, m0, c, c8, s.nb8);
      for (int r = 0; r < R; ++r) y[r] = tree_sum(c + r * s.nbp, c8 + r * s.nb8, 0, nb);
      return;
    }
    for (int64_t b0 = 0; b0 < nb; b0 += 8)
      if (nb - b0 >= 8)
        block_sums_8<F, R, true, false>(w, b0, 8, s.nbp, x, m0, c, c8, s.nb8);
      else
        block_sums_8<F, R, false, false>(w, b0, static_cast<int>(nb - b0), s.nbp, x, m0, c, c8, s.nb8);
    for (int r = 0; r < R; ++r) y[r] = tree_sum(c + r * s.nbp, nullptr, 0, nb);
  } else {
    super_block_row<F, R>(w, nb, s.nbp, x, m0, s.dots.data(), s.mins.data(), s.d.data(), s.dmin.data(), s.c.data());
    for (int r = 0; r < R; ++r) y[r] = tree_sum(s.c.data() + r * s.nbp, nullptr, 0, nb);
  }
}

template <class F>
void gemm(const QuantizedX& x, const uint8_t* blocks, int64_t row_bytes, int64_t N, float* y) {
  const int64_t nb = x.K / F::BLOCK;
  ridge_avx2::tiled_gemm(x.M, N, y, [&] {
    return [&x, blocks, row_bytes, scratch = Scratch(nb)](auto rows, int64_t n, int64_t m0, float* out) mutable {
      dot_row<F, decltype(rows)::value>(blocks + n * row_bytes, x, m0, scratch, out);
    };
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

// ---- Rows of 8 ----
// The packed layout: W's rows in blocks of 8 (N a multiple of 8), and in each, block b of the 8
// rows (8 BYTES, as GGUF's 8 blocks) reads
//   its HEADER / 2 fp16 fields, each as 8 (row r at 2r): d[8], then m[8] (Q4_1), dmin[8] (Q4_K,
//   Q5_K, Q2_K) or IQ4_XS's 2-byte high scale bits | the block's other bytes (scales and codes, in
//   GGUF's order) 4 at a time, bytes [4i, 4i + 4) of row r at 32 i + 4 r
// so a 32-byte vector of codes holds 4 code bytes of each of the 8 rows, one row an int32 lane
// (ik_llama.cpp's _R8 types interleave rows the same way; the super-block formats' kernels,
// below, say where their scales and codes land). A Q4_0 / Q4_1 / IQ4_NL vector i
// unpacks into weights [4i, 4i + 4) of each row (its low nibbles) and [16 + 4i, 20 + 4i) (its
// high ones); a Q8_0 vector i holds weights [4i, 4i + 4). vpmaddubsw against x's 4 codes
// broadcast, then vpmaddwd, leaves each row's products in its own lane. The horizontal sums
// this drops made the layout before it (each row's blocks in runs of 8) compute-bound at one
// row on AVX2 (1 thread, in cache, Zen 3 EPYC: Q4_0 17.6 -> 27.2 GFLOP/s at 1 row, 44 -> 72 at
// 4 and more; Q8_0 22 -> 28 / 28 -> 38).
// The same bytes, so the same size; rows slice 8 at a time.
template <class F>
struct Rows8 {
  static constexpr int64_t CODES = F::BYTES - F::HEADER;  // the bytes besides the fp16 factors, 4 at a time
  static constexpr int64_t CHUNKS_FROM = F::FACTORS_AT == 0 ? F::HEADER : 0;  // in GGUF's block
  static constexpr int64_t CODES_AT = 8 * F::HEADER;                          // in a block of 8 rows
  static constexpr int64_t BYTES = 8 * F::BYTES;            // a block of 8 rows
};

// 4 chunks (16 bytes) of each of 8 rows (at src[r]) -> 4 vectors 32 bytes apart at dst: vector i
// holds chunk i of rows 0-7 in its int32 lanes (a 4 x 4 transpose in each 128-bit half: rows
// 0-3 in the low halves, 4-7 in the high ones)
inline void transpose_chunks4(const uint8_t* const src[8], uint8_t* dst) {
  __m256i v[4];
  for (int r = 0; r < 4; ++r)
    v[r] = _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src[r + 4])),
                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(src[r])));
  const __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpacklo_epi32(v[2], v[3]);
  const __m256i t2 = _mm256_unpackhi_epi32(v[0], v[1]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
  const __m256i out[4] = {_mm256_unpacklo_epi64(t0, t1), _mm256_unpackhi_epi64(t0, t1), _mm256_unpacklo_epi64(t2, t3),
                          _mm256_unpackhi_epi64(t2, t3)};
  for (int i = 0; i < 4; ++i) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32 * i), out[i]);
}

// 8 rows of GGUF's layout (row_bytes each, from src) into a block of rows (PACK), or back: each
// 2-byte factor and 4 code bytes move between their offsets in the two layouts (packing moves
// the code bytes 4 chunks of all 8 rows at a time: it runs per call for calls of many rows)
template <class F, bool PACK>
void repack_rows8(const uint8_t* src, uint8_t* dst, int64_t row_bytes) {
  using L = Rows8<F>;
  const auto move = [&](int64_t gguf_at, int64_t rows_at, int64_t bytes) {
    std::memcpy(dst + (PACK ? rows_at : gguf_at), src + (PACK ? gguf_at : rows_at), bytes);
  };
  constexpr int64_t CHUNKS = L::CODES / 4, BY_FOURS = PACK ? CHUNKS / 4 * 4 : 0;
  for (int64_t b = 0; b < row_bytes / F::BYTES; ++b) {
    const int64_t p = b * L::BYTES;
    for (int64_t r = 0; r < 8; ++r) {
      const int64_t g = r * row_bytes + b * F::BYTES;
      for (int64_t f = 0; f < F::HEADER / 2; ++f) move(g + F::FACTORS_AT + 2 * f, p + 16 * f + 2 * r, 2);
      for (int64_t i = BY_FOURS; i < CHUNKS; ++i) move(g + L::CHUNKS_FROM + 4 * i, p + L::CODES_AT + 32 * i + 4 * r, 4);
    }
    for (int64_t i = 0; i < BY_FOURS; i += 4) {
      const uint8_t* rows[8];
      for (int r = 0; r < 8; ++r) rows[r] = src + r * row_bytes + b * F::BYTES + L::CHUNKS_FROM + 4 * i;
      transpose_chunks4(rows, dst + p + L::CODES_AT + 32 * i);
    }
  }
}

// tree_sum lane by lane, as the blocks come: each block of 8 rows' sums for R rows of x (a row
// of W a lane) goes into the tree as soon as the block is done (put), and each row of x's root
// is, lane by lane and bit for bit, tree_sum of its block sums: the GGUF layout's output. The
// block sums are never stored: a leaf (odd blocks, in order) goes onto a stack of levels and
// meets the finished subtrees on its left as a binary counter carries, tree_sum's balanced tree
// built left to right. (Stored, then summed as tree_sum sums, they took a fifth of the rows-of-8
// Q4_0 kernel's time at 4 rows of x; summed as they come, that kernel ran 1.18x at 4 rows and
// 1.22x at 8, 2-core Xeon.)
template <int R>
class TreeSums {
 public:
  explicit TreeSums(int64_t n) : odd_(n), top_(0) {
    while (odd_ > 1 && odd_ % 2 == 0) odd_ /= 2, ++top_;
  }
  // the next block's sums, s[r] row r of x's
  inline __attribute__((always_inline)) void put(const __m256* s) {
    if (++at_ < odd_) {  // a leaf of odd blocks sums them in order
      for (int r = 0; r < R; ++r) leaf_[r] = at_ > 1 ? _mm256_add_ps(leaf_[r], s[r]) : s[r];
      return;
    }
    __m256 v[R];
    for (int r = 0; r < R; ++r) v[r] = odd_ > 1 ? _mm256_add_ps(leaf_[r], s[r]) : s[r];
    int level = 0;  // the leaf is done: it meets the finished subtrees on its left, smallest first
    for (int64_t carry = leaves_++; carry & 1; carry >>= 1, ++level)
      for (int r = 0; r < R; ++r) v[r] = _mm256_add_ps(stack_[level][r], v[r]);
    for (int r = 0; r < R; ++r) stack_[level][r] = v[r];
    at_ = 0;
  }
  __m256 root(int r) const { return stack_[top_][r]; }

 private:
  int64_t odd_, at_ = 0, leaves_ = 0;  // blocks a leaf, blocks of the leaf done, leaves done
  int top_;                           // log2 of the leaves
  __m256 leaf_[R];
  __m256 stack_[64][R];
};

// Rows [m0, m0 + R) of x as the rows-of-8 kernels read them: each row's arrays, looked up once
// a call (the kernels' stores of their block sums may alias QuantizedX's fields, so lookups in
// the loop were redone every block: a multiply and 3-4 loads a row of x and block)
template <int R>
struct XRows {
  const int8_t* codes[R];
  const float* scales[R];
  const int16_t* qsums16[R];
  const int32_t* qsums32[R];
  XRows(const QuantizedX& x, int64_t m0) {
    for (int r = 0; r < R; ++r)
      codes[r] = x.codes(m0 + r), scales[r] = x.scales(m0 + r), qsums16[r] = x.qsums16(m0 + r),
      qsums32[r] = x.qsums32(m0 + r);
  }
};

// v as it is, in a register: a sum can't be reassociated through it. Unrolled chains of integer
// adds are otherwise summed as trees, which keeps all their products live at once, spilled to
// the stack (a third of the rows-of-8 kernels' instructions; 0.6-0.7x their speed, Zen 3)
inline __attribute__((always_inline)) void in_register(__m256i& v) { asm("" : "+x"(v)); }

// An int32 broadcast from memory (one load-and-broadcast: vbroadcastss moves the bits as they are)
inline __m256i broadcast_i32(const int32_t* p) {
  return _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(p)));
}

// A block of 8 rows' codes (from CODES_AT) as 8 vectors: c[j] holds weights [4j, 4j + 4) of each
// row, bytes (Q8_0's and IQ4_NL's signed)
template <class F>
inline __attribute__((always_inline)) void rows8_codes(const uint8_t* p, __m256i c[8]) {
  if constexpr (Rows8<F>::CODES == QK) {
    for (int j = 0; j < 8; ++j) c[j] = load32(p + 32 * j);
  } else {
    const __m256i low = _mm256_set1_epi8(15);
    for (int i = 0; i < 4; ++i) {
      const __m256i v = load32(p + 32 * i);
      c[i] = _mm256_and_si256(v, low), c[i + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
    if constexpr (F::SIGNED) {
      const __m128i values = _mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_NL_VALUES));
      const __m256i table = _mm256_broadcastsi128_si256(values);
      for (int j = 0; j < 8; ++j) c[j] = _mm256_shuffle_epi8(table, c[j]);
    }
  }
}

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// The 32-weight formats: a block of 8 rows of W (at g, nb blocks a row) against the rows of x
// in xr: each block's sums (the same integer products, then the same float ops as
// block_sums_8) into the tree. EXP: the codes loaded from ex (expand_codes), not unpacked.
template <class F, int R, bool EXP, bool ONE>
void rows8_dot(const uint8_t* g, int64_t nb, const XRows<R>& xr, TreeSums<R>& tree, const uint8_t* ex) {
  using L = Rows8<F>;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = g + b * L::BYTES;
    if constexpr (!EXP) fetch_w<ONE, PREFETCH_BLOCKS, L::BYTES>(p);
    __m256i c[8];
    if constexpr (EXP) {
      for (int j = 0; j < 8; ++j) c[j] = load32(ex + 8 * QK * b + 32 * j);
    } else {
      rows8_codes<F>(p + L::CODES_AT, c);
    }
    const __m256 dv = halves8(p);
    const __m256 mv = F::MIN ? halves8(p + 16) : _mm256_setzero_ps();
    __m256 out[R];
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = xr.codes[r] + b * QK;
      __m256i dot;
      if constexpr (F::NIBBLES) {  // int16 lanes sum 16 products of at most 15 * 127: no wrap
        __m256i s = _mm256_maddubs_epi16(c[0], broadcast4(xb));
        for (int j = 1; j < 8; ++j) {
          s = _mm256_add_epi16(s, _mm256_maddubs_epi16(c[j], broadcast4(xb + 4 * j)));
          in_register(s);
        }
        dot = _mm256_madd_epi16(s, ones);
      } else {  // signed codes: |c| times x with c's sign (vpmaddubsw takes one unsigned operand)
        dot = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {
          const __m256i u = _mm256_sign_epi8(c[j], c[j]), xs = _mm256_sign_epi8(broadcast4(xb + 4 * j), c[j]);
          dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(u, xs), ones));
          in_register(dot);
        }
      }
      const __m256 dx = _mm256_broadcast_ss(xr.scales[r] + b);
      const __m256i qs = broadcast_i32(xr.qsums32[r] + b);
      if (F::OFFSET) dot = _mm256_sub_epi32(dot, _mm256_slli_epi32(qs, F::OFFSET_SHIFT));
      __m256 s = _mm256_mul_ps(_mm256_mul_ps(dv, dx), _mm256_cvtepi32_ps(dot));
      if (F::MIN) s = _mm256_add_ps(s, _mm256_mul_ps(_mm256_mul_ps(mv, dx), _mm256_cvtepi32_ps(qs)));
      out[r] = s;
    }
    tree.put(out);
  }
}

// Q4_K and Q5_K in blocks of 8 rows: d[8] | dmin[8] | the 12 scale bytes as 3 chunks of 4 (u0,
// u1, u2 of k_scales) | Q5_K's 32 bytes of high bits as 8 chunks | the 128 code bytes as 32
// chunks, each chunk of the 8 rows a vector. Code vector 8c + t holds bytes [4t, 4t + 4) of
// GGUF's run c: weights 4t.. of group 2c in its low nibbles, of group 2c + 1 in its high ones;
// Q5_K's high-bit vector t holds their fifth bits (bit j for group j). The 8 rows' scales and
// minimums decode in 12 ops for all 8 (each row's u0, u1, u2 a lane); a group's, as int16 pairs
// (s, s) per lane, is one vpshufb. The integer sums and float ops are super_block_row's, so each
// lane is its row's GGUF output.
struct Q4KPicks {  // pick[j]: byte j of each int32 lane, zero-extended, into both its int16 halves
  alignas(32) uint8_t pick[4][32];
  constexpr Q4KPicks() : pick() {
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 32; ++l) pick[j][l] = static_cast<uint8_t>(l % 2 ? 0x80 : 4 * (l % 16 / 4) + j);
  }
};
constexpr Q4KPicks Q4K_PICKS{};

inline __m256i pick_q4k(__m256i v, int j) {
  return _mm256_shuffle_epi8(v, _mm256_load_si256(reinterpret_cast<const __m256i*>(Q4K_PICKS.pick[j])));
}

// The 8 rows' k_scales from their u0, u1, u2 chunks (a row a lane): scales of groups 0-3
// (sc[0]) and 4-7 (sc[1]), minimums alike, each a byte of the lane
inline __attribute__((always_inline)) void k_scales8(const uint8_t* q, __m256i sc[2], __m256i mn[2]) {
  const __m256i low = _mm256_set1_epi8(15), low6 = _mm256_set1_epi8(0x3f), two = _mm256_set1_epi8(3);
  const __m256i u0 = load32(q), u1 = load32(q + 32), u2 = load32(q + 64);
  sc[0] = _mm256_and_si256(u0, low6);
  sc[1] = _mm256_or_si256(_mm256_and_si256(u2, low),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(u0, 6), two), 4));
  mn[0] = _mm256_and_si256(u1, low6);
  mn[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(u2, 4), low),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(u1, 6), two), 4));
}

// Group j's run of 8 code chunks in a Q4_K / Q5_K block of 8 rows (its codes at q: 96 bytes of
// scales, Q5_K's 256 of high bits, then a run for each pair of groups)
template <class F>
inline const uint8_t* k_chunks(const uint8_t* q, int j) {
  return q + 96 + (std::is_same_v<F, Q5_K> ? 256 : 0) + 32 * 8 * (j / 2);
}

// Group j's chunk t of a Q4_K / Q5_K block of 8 rows: cp the group's code chunks (a run of 8,
// low nibbles for j even), hp Q5_K's 8 chunks of high bits (bit j of each byte, moved to bit 4)
template <class F>
inline __attribute__((always_inline)) __m256i k_codes(const uint8_t* cp, const uint8_t* hp, int j, int t) {
  const __m256i low = _mm256_set1_epi8(15), sixteen = _mm256_set1_epi8(16);
  const __m256i v = load32(cp + 32 * t);
  __m256i cv = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(v, 4) : v, low);
  if constexpr (std::is_same_v<F, Q5_K>) {
    const __m256i h = load32(hp + 32 * t);
    cv = _mm256_or_si256(
        cv, _mm256_and_si256(j <= 4 ? _mm256_slli_epi16(h, 4 - j) : _mm256_srli_epi16(h, j - 4), sixteen));
  }
  return cv;
}

// Q4_K and Q5_K: each group's chunks in turn (its own loads: the two groups of a code vector
// at once keep twice the sums live, and the kernel spilled them), each row of x's products
// summed in int16 over T chunks, then vpmaddwd by the group's scale. EXP: the codes come
// decoded from ex (expand_codes), not from the block.
template <class F, int R, bool EXP, bool ONE>
void rows8_dot_k(const uint8_t* g, int64_t nb, const XRows<R>& xr, TreeSums<R>& tree, const uint8_t* ex) {
  using L = Rows8<F>;
  constexpr bool Q5 = std::is_same_v<F, Q5_K>;
  // int16 lanes sum the products of T chunks: at most 2 T 15 * 127 (Q4_K, T = 8) or 2 T 31 *
  // 127 (Q5_K, T = 4) < 2^15
  constexpr int T = Q5 ? 4 : 8;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = g + b * L::BYTES;
    if constexpr (!EXP && !ONE) prefetch_ahead<PREFETCH_SUPER_BLOCKS, L::BYTES>(p);
    const __m256 dv = halves8(p);
    const __m256 dminv = halves8(p + 16);
    const uint8_t* q = p + L::CODES_AT;
    __m256i sc[2], mn[2];
    k_scales8(q, sc, mn);
    const uint8_t* high = q + 96;
    __m256i acc[R], macc[R];
    for (int r = 0; r < R; ++r) acc[r] = macc[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {  // group j: code chunks 8 (j / 2) + t, their low nibbles (j even) or high ones
      if constexpr (!EXP && ONE) fetch_slice<F::BYTES>(p, j);
      const __m256i s = pick_q4k(sc[j / 4], j % 4);
      const uint8_t *cp = EXP ? ex + expanded_at(b, j, 0) : k_chunks<F>(q, j), *hp = high;
      asm volatile("" : "+r"(cp), "+r"(hp));  // chunks loaded anew for each group, not kept live across them
#pragma GCC unroll 2
      for (int t0 = 0; t0 < 8; t0 += T) {
        __m256i part[R];
        for (int t = t0; t < t0 + T; ++t) {
          const __m256i cv = EXP ? load32(cp + 32 * t) : k_codes<F>(cp, hp, j, t);
          for (int r = 0; r < R; ++r) {
            const __m256i pr = _mm256_maddubs_epi16(cv, broadcast4(xr.codes[r] + b * 256 + 32 * j + 4 * t));
            part[r] = t > t0 ? _mm256_add_epi16(part[r], pr) : pr;
            in_register(part[r]);
          }
        }
        for (int r = 0; r < R; ++r) {
          acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(part[r], s));
          in_register(acc[r]);
        }
      }
    }
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {  // the minimums' part: groups 2c and 2c + 1
      const int j = 2 * c;
      const __m256i n0 = pick_q4k(mn[j / 4], j % 4), n1 = pick_q4k(mn[(j + 1) / 4], (j + 1) % 4);
      for (int r = 0; r < R; ++r) {
        const int8_t* qs = reinterpret_cast<const int8_t*>(xr.qsums16[r] + 16 * b + 2 * j);  // per 16 weights
        macc[r] = _mm256_add_epi32(macc[r], _mm256_add_epi32(_mm256_madd_epi16(n0, broadcast4(qs)),
                                                             _mm256_madd_epi16(n1, broadcast4(qs + 4))));
      }
    }
    __m256 out[R];
    for (int r = 0; r < R; ++r) {
      const __m256 dx = _mm256_broadcast_ss(xr.scales[r] + b);
      __m256 s = _mm256_mul_ps(_mm256_mul_ps(dv, dx), _mm256_cvtepi32_ps(acc[r]));
      s = _mm256_sub_ps(s, _mm256_mul_ps(_mm256_mul_ps(dminv, dx), _mm256_cvtepi32_ps(macc[r])));
      out[r] = s;
    }
    tree.put(out);
  }
}

// IQ4_XS in blocks of 8 rows: d[8] | scales_h[8] (its 2-byte field of 2-bit scale parts, taken
// as a second factor) | scales_l as one chunk | the 128 code bytes as 32 chunks: code vector 4j
// + t holds bytes [4t, 4t + 4) of group j's 16, weights 4t.. in their low nibbles and 16 + 4t..
// in their high ones (GGUF's order). The 8 rows' scales of group j come out as int32 lanes,
// then int16 pairs (s, s) for vpmaddwd. The codebook's values are signed (vpsignb, as
// super_block_row), and their products (up to 2 * 127 * 127 a pair) are widened each chunk.
// (A prefill's calls read them expanded instead: expand_iq4_xs, below.)

// Group j's scales of a block of 8 rows (sl its scales_l chunk, sh its scales_h as int32 lanes):
// nibble j of scales_l, bits 2j of scales_h above it, less 32, as int16 pairs (s, s)
inline __attribute__((always_inline)) __m256i iq4_xs_scales(__m256i sl, __m256i sh, int j) {
  const __m256i low4 = _mm256_set1_epi32(15), low2 = _mm256_set1_epi32(3);
  const __m256i s32 =
      _mm256_sub_epi32(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(sl, 4 * j), low4),
                                       _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(sh, 2 * j), low2), 4)),
                       _mm256_set1_epi32(32));
  return _mm256_or_si256(_mm256_and_si256(s32, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(s32, 16));
}

// Code vector 4j + t of an IQ4_XS block of 8 rows (codes at q) as the codebook's values: the low
// nibbles' (cl) and the high ones' (ch)
inline __attribute__((always_inline)) void iq4_xs_values(const uint8_t* q, int j, int t, __m256i& cl, __m256i& ch) {
  const __m256i low = _mm256_set1_epi8(15);
  const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_NL_VALUES)));
  const __m256i v = load32(q + 32 + 32 * (4 * j + t));
  cl = _mm256_shuffle_epi8(table, _mm256_and_si256(v, low));
  ch = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
}

// IQ4_XS's kernel on a block of 8 rows (the layout above)
template <int R, bool ONE>
void rows8_dot_iq4_xs(const uint8_t* g, int64_t nb, const XRows<R>& xr, TreeSums<R>& tree) {
  using L = Rows8<IQ4_XS>;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = g + b * L::BYTES;
    if constexpr (!ONE) prefetch_ahead<PREFETCH_SUPER_BLOCKS, L::BYTES>(p);
    const __m256 dv = halves8(p);
    const __m256i sh = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
    const uint8_t* q = p + L::CODES_AT;
    const __m256i sl = load32(q);
    __m256i acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      if constexpr (ONE) fetch_slice<IQ4_XS::BYTES>(p, j);
      const __m256i s = iq4_xs_scales(sl, sh, j);
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {
        __m256i cl, ch;
        iq4_xs_values(q, j, t, cl, ch);
        const __m256i ul = _mm256_sign_epi8(cl, cl), uh = _mm256_sign_epi8(ch, ch);
        for (int r = 0; r < R; ++r) {
          const int8_t* xb = xr.codes[r] + b * 256 + 32 * j + 4 * t;
          const __m256i pl = _mm256_maddubs_epi16(ul, _mm256_sign_epi8(broadcast4(xb), cl));
          const __m256i ph = _mm256_maddubs_epi16(uh, _mm256_sign_epi8(broadcast4(xb + 16), ch));
          acc[r] = _mm256_add_epi32(acc[r], _mm256_add_epi32(_mm256_madd_epi16(pl, s), _mm256_madd_epi16(ph, s)));
          in_register(acc[r]);
        }
      }
    }
    __m256 out[R];
    for (int r = 0; r < R; ++r) {
      const __m256 dx = _mm256_broadcast_ss(xr.scales[r] + b);
      out[r] = _mm256_mul_ps(_mm256_mul_ps(dv, dx), _mm256_cvtepi32_ps(acc[r]));
    }
    tree.put(out);
  }
}

// IQ4_XS expanded (a prefill's calls): a block of 8 rows' values v (-127..113) taken as u = v +
// 127 = 16 h + l, h and l 0-15, so that its products need no vpsignb: x v = 16 h x + l x - 127
// x, h and l unsigned as the K-quants' nibbles. Each block: its groups' scales as int16 pairs
// three ways, 96 bytes a group (16 s, s, -127 s), then each group's 8 code vectors of h (chunk
// t's low nibbles at t, its high ones at 4 + t), then 8 of l. A group's 8 products of h (each
// int16 lane at most 2 * 15 * 127) sum in int16, as do l's; a vpmaddwd each by 16 s and s, and
// one of x's sums of 16 codes (two a lane, QuantizedX's qsums16) by -127 s: the same integers
// as rows8_dot_iq4_xs's (so the same outputs bit for bit), with 2 vpmaddubsw and 2 int16 adds
// every 32 products of a row of x where that kernel takes a vpsignb, a vpmaddubsw, a vpmaddwd
// and an add. On the Zen 3, 2 threads, 512 rows of x, alternated in one process: 1.15x
// rows8_dot_iq4_xs decoding each block for every 4 rows of x (median of 6 rounds) with the
// values and their magnitudes expanded (vpsignb of x kept), then 1.06x that with h and l (6
// rounds); 512-token prefills of the IQ4_XS file 1.11x (10 rounds) and 1.08x (8), the same
// tokens.
constexpr int64_t IQ4_XS_EXPANDED_BYTES = 8 * 96 + 8 * 2 * 256;

inline void expand_iq4_xs(const uint8_t* g, int64_t nb, uint8_t* ex, const NextBlock& next) {
  using L = Rows8<IQ4_XS>;
  const __m256i low = _mm256_set1_epi8(15), off = _mm256_set1_epi8(127), m127 = _mm256_set1_epi16(-127);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = g + b * L::BYTES;
    fetch_decoding<PREFETCH_SUPER_BLOCKS, L::BYTES>(p, next, b, nb);
    const __m256i sh = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
    const uint8_t* q = p + L::CODES_AT;
    const __m256i sl = load32(q);
    uint8_t* e = ex + IQ4_XS_EXPANDED_BYTES * b;
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m256i sp = iq4_xs_scales(sl, sh, j);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(e + 96 * j), _mm256_slli_epi16(sp, 4));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(e + 96 * j + 32), sp);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(e + 96 * j + 64), _mm256_mullo_epi16(sp, m127));
      uint8_t* c = e + 768 + 512 * j;
      for (int t = 0; t < 4; ++t) {
        __m256i cl, ch;
        iq4_xs_values(q, j, t, cl, ch);
        const __m256i ul = _mm256_add_epi8(cl, off), uh = _mm256_add_epi8(ch, off);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + 32 * t), _mm256_and_si256(_mm256_srli_epi16(ul, 4), low));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + 32 * (4 + t)), _mm256_and_si256(_mm256_srli_epi16(uh, 4), low));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + 256 + 32 * t), _mm256_and_si256(ul, low));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + 256 + 32 * (4 + t)), _mm256_and_si256(uh, low));
      }
    }
  }
}

// IQ4_XS's kernel on a block of 8 rows expanded (expand_iq4_xs)
template <int R>
void rows8_dot_iq4_xs_expanded(const uint8_t* g, int64_t nb, const XRows<R>& xr, TreeSums<R>& tree, const uint8_t* ex) {
  using L = Rows8<IQ4_XS>;
  for (int64_t b = 0; b < nb; ++b) {
    const __m256 dv = halves8(g + b * L::BYTES);
    const uint8_t* e = ex + IQ4_XS_EXPANDED_BYTES * b;
    __m256i acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int j = 0; j < 8; ++j) {
      const uint8_t* c = e + 768 + 512 * j;
      __m256i hs[R], ls[R];
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        const __m256i hv = load32(c + 32 * t), lv = load32(c + 256 + 32 * t);
        const int64_t xo = 32 * j + (t < 4 ? 4 * t : 16 + 4 * (t - 4));
        for (int r = 0; r < R; ++r) {
          const __m256i xv = broadcast4(xr.codes[r] + b * 256 + xo);
          const __m256i ph = _mm256_maddubs_epi16(hv, xv), pl = _mm256_maddubs_epi16(lv, xv);
          hs[r] = t ? _mm256_add_epi16(hs[r], ph) : ph;
          ls[r] = t ? _mm256_add_epi16(ls[r], pl) : pl;
          in_register(hs[r]);
          in_register(ls[r]);
        }
      }
      const __m256i s16 = load32(e + 96 * j), s1 = load32(e + 96 * j + 32), so = load32(e + 96 * j + 64);
      for (int r = 0; r < R; ++r) {
        const __m256i xs = broadcast_i32(reinterpret_cast<const int32_t*>(xr.qsums16[r] + 16 * b + 2 * j));
        acc[r] = _mm256_add_epi32(acc[r], _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(hs[r], s16),
                                                                            _mm256_madd_epi16(ls[r], s1)),
                                                           _mm256_madd_epi16(xs, so)));
      }
    }
    __m256 out[R];
    for (int r = 0; r < R; ++r) {
      const __m256 dx = _mm256_broadcast_ss(xr.scales[r] + b);
      out[r] = _mm256_mul_ps(_mm256_mul_ps(dv, dx), _mm256_cvtepi32_ps(acc[r]));
    }
    tree.put(out);
  }
}

// Q6_K in blocks of 8 rows: d[8] | GGUF's first 208 bytes of each row 4 at a time (ql: chunks
// 0-31, qh: 32-47, the 16 int8 scales: 48-51). Group 4h + i's weights [4t, 4t + 4) take their
// low 4 bits from ql chunk 16h + t (i = 0, 2) or 16h + 8 + t (i = 1, 3), low nibbles for i < 2,
// and their top 2 from bits 2i of qh chunk 32 + 8h + t. Its codes (0-63) times x reach 2 * 63 *
// 127 a vpmaddubsw lane, so pairs of them sum in int16, then vpmaddwd by the scale of their 16
// weights. The offset, 32, comes out of x's code sums as in super_block_row.
struct Q6KPicks {  // pick[j]: byte j of each int32 lane, sign-extended (the high byte, then >> 8), as
                   // both int16 halves (same) or bytes j, j + 1 as the two halves (pair, j even)
  alignas(32) uint8_t same[4][32];
  alignas(32) uint8_t pair[2][32];
  constexpr Q6KPicks() : same(), pair() {
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 32; ++l) {
        const int lane = 4 * (l % 16 / 4);
        same[j][l] = static_cast<uint8_t>(l % 2 ? lane + j : 0x80);
        if (j < 2) pair[j][l] = static_cast<uint8_t>(l % 2 ? lane + 2 * j + (l % 4 / 2) : 0x80);
      }
  }
};
constexpr Q6KPicks Q6K_PICKS{};

inline __m256i pick_i8(__m256i v, const uint8_t* mask) {
  return _mm256_srai_epi16(_mm256_shuffle_epi8(v, _mm256_load_si256(reinterpret_cast<const __m256i*>(mask))), 8);
}

// acc[r] += sum_i v_i qsum16_i over the 4 sub-blocks i = 4k.. 4k + 3 of block b: v_i the
// 8 rows' int8 (or 0-127) byte i % 4 of each lane of v, qsum16 row r's sums of x's codes per 16
// (an offset's or a minimum's part of the K-quants' sums)
template <int R>
inline __attribute__((always_inline)) void add_x_sums(__m256i v, const XRows<R>& xr, int64_t b, int k, __m256i* acc) {
  const __m256i pa = pick_i8(v, Q6K_PICKS.pair[0]), pb = pick_i8(v, Q6K_PICKS.pair[1]);
  for (int r = 0; r < R; ++r) {
    const int8_t* qs = reinterpret_cast<const int8_t*>(xr.qsums16[r] + 16 * b + 4 * k);
    acc[r] = _mm256_add_epi32(acc[r], _mm256_add_epi32(_mm256_madd_epi16(pa, broadcast4(qs)),
                                                       _mm256_madd_epi16(pb, broadcast4(qs + 4))));
  }
}

// Block b's sums of an offset format (Q6_K's 32, Q3_K's 4 = 1 << SHIFT): each row of x's
// integer products less the offset times its code sums (off, from add_x_sums), times d and
// x's scale, into the tree
template <int SHIFT, int R>
inline __attribute__((always_inline)) void put_offset_sums(const __m256i* acc, const __m256i* off, __m256 dv,
                                                           const XRows<R>& xr, int64_t b, TreeSums<R>& tree) {
  __m256 out[R];
  for (int r = 0; r < R; ++r) {
    const __m256 dx = _mm256_broadcast_ss(xr.scales[r] + b);
    const __m256i dot = _mm256_sub_epi32(acc[r], _mm256_slli_epi32(off[r], SHIFT));
    out[r] = _mm256_mul_ps(_mm256_mul_ps(dv, dx), _mm256_cvtepi32_ps(dot));
  }
  tree.put(out);
}

// Group grp of block b for codes of at most 3 bits (Q3_K, Q2_K): codes(t) its chunk t (weights
// 4t.. 4t + 3 of the 8 rows), each row of x's products summed in int16 over the 4 chunks of a
// sub-block (at most 4 x 2 x 7 x 127), then vpmaddwd by its scale into acc[r]. The 8 rows' scales
// of sub-blocks 2 grp and 2 grp + 1 are bytes 2 (grp % 2) and 2 (grp % 2) + 1 of each lane of sv.
template <int R, class Codes>
inline __attribute__((always_inline)) void add_group_3bit(int grp, __m256i sv, Codes&& codes, const XRows<R>& xr,
                                                          int64_t b, __m256i* acc) {
  const __m256i s0 = pick_i8(sv, Q6K_PICKS.same[2 * (grp % 2)]), s1 = pick_i8(sv, Q6K_PICKS.same[2 * (grp % 2) + 1]);
  __m256i part[R];
#pragma GCC unroll 8
  for (int t = 0; t < 8; ++t) {
    const __m256i c = codes(t);
    for (int r = 0; r < R; ++r) {
      const __m256i pr = _mm256_maddubs_epi16(c, broadcast4(xr.codes[r] + b * 256 + 32 * grp + 4 * t));
      part[r] = t % 4 ? _mm256_add_epi16(part[r], pr) : pr;
      in_register(part[r]);
      if (t % 4 == 3) {
        acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(part[r], t < 4 ? s0 : s1));
        in_register(acc[r]);
      }
    }
  }
}

// Group grp = 4h + i's chunk t of a Q6_K block of 8 rows (its codes at q): codes 0-63
inline __attribute__((always_inline)) __m256i q6k_codes(const uint8_t* q, int grp, int t) {
  const __m256i low = _mm256_set1_epi8(15), top = _mm256_set1_epi8(0x30);
  const int h = grp / 4, i = grp % 4;
  __m256i lo4 = load32(q + 32 * (16 * h + 8 * (i % 2) + t));
  if (i >= 2) lo4 = _mm256_srli_epi16(lo4, 4);
  const __m256i qh = load32(q + 32 * (32 + 8 * h + t));
  const __m256i hi2 = i < 2 ? _mm256_slli_epi16(qh, 4 - 2 * i) : _mm256_srli_epi16(qh, 2 * i - 4);
  return _mm256_or_si256(_mm256_and_si256(lo4, low), _mm256_and_si256(hi2, top));
}

template <int R, bool EXP, bool ONE>
void rows8_dot_q6_k(const uint8_t* g, int64_t nb, const XRows<R>& xr, TreeSums<R>& tree, const uint8_t* ex) {
  using L = Rows8<Q6_K>;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = g + b * L::BYTES;
    if constexpr (!EXP && !ONE) prefetch_ahead<PREFETCH_SUPER_BLOCKS, L::BYTES>(p);
    const __m256 dv = halves8(p);
    const uint8_t* q = p + L::CODES_AT;
    __m256i acc[R], off[R];
    for (int r = 0; r < R; ++r) acc[r] = off[r] = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h)
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const int grp = 4 * h + i;
        if constexpr (!EXP && ONE) fetch_slice<Q6_K::BYTES>(p, grp);
        const __m256i scales = load32(q + 32 * (48 + grp / 2));  // bytes 4 (grp % 2) + 0, 1: this group's 2 scales
        const __m256i s0 = pick_i8(scales, Q6K_PICKS.same[2 * (grp % 2)]);
        const __m256i s1 = pick_i8(scales, Q6K_PICKS.same[2 * (grp % 2) + 1]);
        __m256i part[R];
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t) {
          const __m256i codes = EXP ? load32(ex + expanded_at(b, grp, t)) : q6k_codes(q, grp, t);
          for (int r = 0; r < R; ++r) {
            const __m256i pr = _mm256_maddubs_epi16(codes, broadcast4(xr.codes[r] + b * 256 + 32 * grp + 4 * t));
            if (t % 2 == 0) {
              part[r] = pr;
              continue;
            }
            const __m256i pair = _mm256_add_epi16(part[r], pr);  // |.| <= 2 * 2 * 63 * 127
            acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(pair, t < 4 ? s0 : s1));
            in_register(acc[r]);
          }
        }
      }
#pragma GCC unroll 2
    for (int c = 0; c < 4; ++c) add_x_sums<R>(load32(q + 32 * (48 + c)), xr, b, c, off);  // the offset: 32 sum_k s_k qsum16_k
    put_offset_sums<5, R>(acc, off, dv, xr, b, tree);
  }
}

// Q3_K in blocks of 8 rows: d[8] | GGUF's first 108 bytes of each row 4 at a time (hmask:
// chunks 0-7, qs: 8-23, the 12 scale bytes: 24-26). Group g = 4n + j's weights [4t, 4t + 4)
// take their low 2 bits from bits 2j of qs chunk 8 + 8n + t and their third (the code's 4) from
// bit g of hmask chunk t: codes 0-7, as super_block_row's. The 16 6-bit scales decode for the 8
// rows at once into 4 vectors of bytes (scale i: byte i % 4 of sv[i / 4], less 32), each a
// vpshufb away from int16 pairs (s, s). Codes times x reach 2 * 7 * 127 a vpmaddubsw lane, so a
// scale's 4 chunks sum in int16, then vpmaddwd by it (add_group_3bit); the offset, 4, comes out
// of x's code sums (add_x_sums).
// Group grp = 4n + j's chunk t of a Q3_K block of 8 rows (its codes at q): codes 0-7
inline __attribute__((always_inline)) __m256i q3k_codes(const uint8_t* q, int grp, int t) {
  const __m256i three = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
  const int n = grp / 4, j = grp % 4;
  const __m256i lo2 = _mm256_and_si256(_mm256_srli_epi16(load32(q + 32 * (8 + 8 * n + t)), 2 * j), three);
  const __m256i hm = load32(q + 32 * t);
  return _mm256_or_si256(
      lo2, _mm256_and_si256(grp <= 2 ? _mm256_slli_epi16(hm, 2 - grp) : _mm256_srli_epi16(hm, grp - 2), four));
}

template <int R, bool EXP, bool ONE>
void rows8_dot_q3_k(const uint8_t* g, int64_t nb, const XRows<R>& xr, TreeSums<R>& tree, const uint8_t* ex) {
  using L = Rows8<Q3_K>;
  const __m256i three = _mm256_set1_epi8(3), low = _mm256_set1_epi8(15);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = g + b * L::BYTES;
    if constexpr (!EXP && !ONE) prefetch_ahead<PREFETCH_SUPER_BLOCKS, L::BYTES>(p);
    const __m256 dv = halves8(p);
    const uint8_t* q = p + L::CODES_AT;
    // scale i: 4 bits (nibble i / 8 of byte i % 8: chunk 24 + i % 8 / 4) and 2 (bits 2 (i / 4)
    // of byte i % 4 of chunk 26)
    const __m256i a = load32(q + 32 * 24), bb = load32(q + 32 * 25), c = load32(q + 32 * 26);
    const auto high2 = [&](int k) { return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(c, 2 * k), three), 4); };
    const __m256i bias = _mm256_set1_epi8(32);
    const __m256i sv[4] = {
        _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(a, low), high2(0)), bias),
        _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(bb, low), high2(1)), bias),
        _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low), high2(2)), bias),
        _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bb, 4), low), high2(3)), bias)};
    __m256i acc[R], off[R];
    for (int r = 0; r < R; ++r) acc[r] = off[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int grp = 0; grp < 8; ++grp) {
      if constexpr (!EXP && ONE) fetch_slice<Q3_K::BYTES>(p, grp);
      const auto codes = [&](int t) __attribute__((always_inline)) {
        return EXP ? load32(ex + expanded_at(b, grp, t)) : q3k_codes(q, grp, t);
      };
      add_group_3bit<R>(grp, sv[grp / 2], codes, xr, b, acc);
    }
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) add_x_sums<R>(sv[k], xr, b, k, off);  // the offset: 4 sum_i s_i qsum16_i
    put_offset_sums<2, R>(acc, off, dv, xr, b, tree);
  }
}

// Q2_K in blocks of 8 rows: d[8] | dmin[8] | GGUF's first 80 bytes of each row 4 at a time (the
// 16 scale bytes: chunks 0-3, qs: 4-19). Group g = 4n + j's weights [4t, 4t + 4) are bits 2j of
// qs chunk 4 + 8n + t (codes 0-3); scale and minimum i are the low and high nibbles of byte i % 4
// of chunk i / 4. The integer sums and float ops are super_block_row's (add_group_3bit as
// Q3_K's; the minimums' part from x's code sums, add_x_sums).
// Group grp = 4n + j's chunk t of a Q2_K block of 8 rows (its codes at q): codes 0-3
inline __attribute__((always_inline)) __m256i q2k_codes(const uint8_t* q, int grp, int t) {
  const int n = grp / 4, j = grp % 4;
  return _mm256_and_si256(_mm256_srli_epi16(load32(q + 32 * (4 + 8 * n + t)), 2 * j), _mm256_set1_epi8(3));
}

template <int R, bool EXP, bool ONE>
void rows8_dot_q2_k(const uint8_t* g, int64_t nb, const XRows<R>& xr, TreeSums<R>& tree, const uint8_t* ex) {
  using L = Rows8<Q2_K>;
  const __m256i low = _mm256_set1_epi8(15);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = g + b * L::BYTES;
    if constexpr (!EXP && !ONE) prefetch_ahead<PREFETCH_SUPER_BLOCKS, L::BYTES>(p);
    const __m256 dv = halves8(p), dminv = halves8(p + 16);
    const uint8_t* q = p + L::CODES_AT;
    __m256i acc[R], macc[R];
    for (int r = 0; r < R; ++r) acc[r] = macc[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int grp = 0; grp < 8; ++grp) {
      if constexpr (!EXP && ONE) fetch_slice<Q2_K::BYTES>(p, grp);
      const auto codes = [&](int t) __attribute__((always_inline)) {
        return EXP ? load32(ex + expanded_at(b, grp, t)) : q2k_codes(q, grp, t);
      };
      // scales 4 (grp / 2).. 4 (grp / 2) + 3 as bytes
      add_group_3bit<R>(grp, _mm256_and_si256(load32(q + 32 * (grp / 2)), low), codes, xr, b, acc);
    }
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k)  // the minimums' part: sum_i m_i qsum16_i
      add_x_sums<R>(_mm256_and_si256(_mm256_srli_epi16(load32(q + 32 * k), 4), low), xr, b, k, macc);
    __m256 out[R];
    for (int r = 0; r < R; ++r) {
      const __m256 dx = _mm256_broadcast_ss(xr.scales[r] + b);
      __m256 s = _mm256_mul_ps(_mm256_mul_ps(dv, dx), _mm256_cvtepi32_ps(acc[r]));
      s = _mm256_sub_ps(s, _mm256_mul_ps(_mm256_mul_ps(dminv, dx), _mm256_cvtepi32_ps(macc[r])));
      out[r] = s;
    }
    tree.put(out);
  }
}

// The formats whose codes take ops to decode (all but Q8_0's bytes: nibbles, bit planes, IQ4's
// codebook lookups), for a call of expand_from_rows<F> rows of x or more, are decoded once a
// block of 8 rows into expanded_bytes<F> a block (expand_codes), rather than once for each
// MAX_ROWS rows of x. The same integers, so the same outputs bit for bit. The kernel alone,
// 5632 x 2048, 512 rows, 2 threads, Zen 3, decoded once against each pass, alternated in one
// process: IQ4_XS 1.15x (6 rounds), IQ4_NL 1.20x (4), Q4_0 1.04x (6; 0.99-1.14); the K-quants
// since stop 82 (README). From 16 rows (a prefill); from 8 (a decode step of 8 sequences, a
// speculative step's checks) for the formats whose codes come from bit planes, Q5_K, Q6_K and
// Q3_K: 22 TinyLlama layers from memory, 2 threads, Zen 3, one process, 5 alternated rounds
// (2026-12-04), from 8 rows / from 16: Q3_K 1.30x at 8 rows, 1.37x at 12; Q5_K 1.17x, 1.12x;
// and where the nibbles or 2-bit fields take an op or two, not: Q4_K 0.88x, 0.97x; Q2_K 1.03x,
// 1.05x; IQ4_XS 0.88x at 8 (3 rounds).
template <class F>
constexpr bool EXPANDS = !std::is_same_v<F, Q8_0>;
template <class F>
constexpr int64_t expand_from_rows =
    std::is_same_v<F, Q5_K> || std::is_same_v<F, Q6_K> || std::is_same_v<F, Q3_K> ? 8 : 16;
template <class F>
constexpr int64_t expanded_bytes = std::is_same_v<F, IQ4_XS> ? IQ4_XS_EXPANDED_BYTES : 8 * F::BLOCK;  // else a byte a weight

// A K-quant's block of 8 rows decoded (expand_codes)
template <class F>
void expand_k_codes(const uint8_t* g, int64_t nb, uint8_t* ex, const NextBlock& next) {
  using L = Rows8<F>;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* q = g + b * L::BYTES + L::CODES_AT;
    fetch_decoding<PREFETCH_SUPER_BLOCKS, L::BYTES>(q - L::CODES_AT, next, b, nb);
#pragma GCC unroll 8
    for (int grp = 0; grp < 8; ++grp)
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        __m256i v;
        if constexpr (std::is_same_v<F, Q4_K> || std::is_same_v<F, Q5_K>)
          v = k_codes<F>(k_chunks<F>(q, grp), q + 96, grp, t);
        else if constexpr (std::is_same_v<F, Q6_K>)
          v = q6k_codes(q, grp, t);
        else if constexpr (std::is_same_v<F, Q3_K>)
          v = q3k_codes(q, grp, t);
        else
          v = q2k_codes(q, grp, t);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(ex + expanded_at(b, grp, t)), v);
      }
  }
}

// A block of 8 rows' codes (nb blocks from g) decoded into ex: a 32-weight format's block b as
// rows8_codes gives its 8 vectors, at 8 QK b + 32 j; a K-quant's code vector of group grp and
// chunk t (weights [32 grp + 4 t, + 4) of each row) at expanded_at(b, grp, t), a byte a weight;
// IQ4_XS's as expand_iq4_xs lays them
template <class F>
void expand_codes(const uint8_t* g, int64_t nb, uint8_t* ex, const NextBlock& next) {
  using L = Rows8<F>;
  if constexpr (std::is_same_v<F, IQ4_XS>) {
    expand_iq4_xs(g, nb, ex, next);
  } else if constexpr (F::BLOCK == QK) {
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = g + b * L::BYTES;
      fetch_decoding<PREFETCH_BLOCKS, L::BYTES>(p, next, b, nb);
      __m256i c[8];
      rows8_codes<F>(p + L::CODES_AT, c);
      for (int j = 0; j < 8; ++j) _mm256_storeu_si256(reinterpret_cast<__m256i*>(ex + 8 * QK * b + 32 * j), c[j]);
    }
  } else {
    expand_k_codes<F>(g, nb, ex, next);
  }
}

// A block of 8 rows of W (at g, nb blocks a row) against rows [m0, m0 + R) of x: each block's
// sums by the format's kernel into each row of x's tree over the blocks, its root then y[(m0 +
// r) N + l] for the block's rows l. EXP: the block's codes decoded in ex (expand_codes); ONE:
// W fetched ahead one L1 fetch a line (fetch_w).
template <class F, int R, bool EXP, bool ONE>
void rows8_kernel(const uint8_t* g, int64_t nb, const QuantizedX& x, int64_t m0, float* y, int64_t N,
                  const uint8_t* ex) {
  const XRows<R> xr(x, m0);
  TreeSums<R> tree(nb);
  if constexpr (F::BLOCK == QK)
    rows8_dot<F, R, EXP, ONE>(g, nb, xr, tree, ex);
  else if constexpr (std::is_same_v<F, Q4_K> || std::is_same_v<F, Q5_K>)
    rows8_dot_k<F, R, EXP, ONE>(g, nb, xr, tree, ex);
  else if constexpr (std::is_same_v<F, IQ4_XS> && EXP)
    rows8_dot_iq4_xs_expanded<R>(g, nb, xr, tree, ex);
  else if constexpr (std::is_same_v<F, IQ4_XS>)
    rows8_dot_iq4_xs<R, ONE>(g, nb, xr, tree);
  else if constexpr (std::is_same_v<F, Q3_K>)
    rows8_dot_q3_k<R, EXP, ONE>(g, nb, xr, tree, ex);
  else if constexpr (std::is_same_v<F, Q2_K>)
    rows8_dot_q2_k<R, EXP, ONE>(g, nb, xr, tree, ex);
  else
    rows8_dot_q6_k<R, EXP, ONE>(g, nb, xr, tree, ex);
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + (m0 + r) * N, tree.root(r));
}
// rows8_kernel, W fetched once a line (ONE) where a pass of R rows of x reads it from memory on
// AMD (fetch_w), else twice: the choice made here, once a call, so neither kernel branches
template <class F, int R, bool EXP>
void rows8_call(const uint8_t* g, int64_t nb, const QuantizedX& x, int64_t m0, float* y, int64_t N,
                const uint8_t* ex) {
  if constexpr (!EXP && R <= ONE_FETCH_ROWS)
    if (!ridge_avx2::g_fetch_into_l2) return rows8_kernel<F, R, EXP, true>(g, nb, x, m0, y, N, ex);
  rows8_kernel<F, R, EXP, false>(g, nb, x, m0, y, N, ex);
}

// Every row of x against one block of 8 rows of W, MAX_ROWS rows at a time
template <class F, bool EXP>
void rows8_rows(const uint8_t* g, int64_t nb, const QuantizedX& x, float* y, int64_t N, const uint8_t* ex) {
  for (int64_t m0 = 0; m0 < x.M; m0 += MAX_ROWS) switch (std::min<int64_t>(MAX_ROWS, x.M - m0)) {
      case 1: rows8_call<F, 1, EXP>(g, nb, x, m0, y, N, ex); break;
      case 2: rows8_call<F, 2, EXP>(g, nb, x, m0, y, N, ex); break;
      case 3: rows8_call<F, 3, EXP>(g, nb, x, m0, y, N, ex); break;
      default: rows8_call<F, 4, EXP>(g, nb, x, m0, y, N, ex); break;
    }
}

// y = x @ W^T over W's blocks of 8 rows: each thread takes blocks of rows (a fixed share in a
// decode call, the next free block from TAKE_FROM_ROWS rows of x: parallel_take), each meets x's
// rows MAX_ROWS at a time (a block of rows' bytes stay in L1/L2 across them). PACK: w is GGUF's
// layout, and each block of 8 rows is packed into the thread's buffer first, for calls of
// PACK_FROM_ROWS rows of x or more, where the packing's cost is small beside the products. A
// fixed share's blocks that are decoded once fetch the next one as they go (NextBlock).
template <class F, bool PACK>
void gemm_rows8(const QuantizedX& x, const uint8_t* w, int64_t row_bytes, int64_t N, float* y) {
  const int64_t nb = x.K / F::BLOCK, M = x.M;
  bool expand = false;
  if constexpr (EXPANDS<F>) expand = M >= expand_from_rows<F>;
  struct Scratch {  // a thread's: a block of 8 rows packed, its codes expanded
    std::vector<uint8_t> packed, expanded;
  };
  const auto scratch = [&] {
    return Scratch{std::vector<uint8_t>(PACK ? 8 * row_bytes : 0),
                   std::vector<uint8_t>(expand ? nb * expanded_bytes<F> : 0)};
  };
  // block g of 8 rows against every row of x (next: the thread's next one, if fetched)
  const auto block = [&](Scratch& s, int64_t g, const NextBlock& next) {
    const uint8_t* gp = w + g * 8 * row_bytes;
    if constexpr (PACK) {
      repack_rows8<F, true>(gp, s.packed.data(), row_bytes);
      gp = s.packed.data();
    }
    if constexpr (EXPANDS<F>) {
      if (expand) {
        expand_codes<F>(gp, nb, s.expanded.data(), next);
        return rows8_rows<F, true>(gp, nb, x, y + 8 * g, N, s.expanded.data());
      }
    }
    rows8_rows<F, false>(gp, nb, x, y + 8 * g, N, nullptr);
  };
  if (M >= ridge_avx2::TAKE_FROM_ROWS)
    return ridge_avx2::parallel_take(N / 8, scratch, [&](Scratch& s, int64_t g) { block(s, g, NextBlock{}); });
  const bool fetch_next = expand && !ridge_avx2::g_fetch_into_l2;
  at::parallel_for(0, N / 8, 1, [&](int64_t begin, int64_t end) {
    Scratch s = scratch();
    for (int64_t g = begin; g < end; ++g)
      block(s, g, fetch_next && g + 1 < end ? NextBlock{w + (g + 1) * 8 * row_bytes, 8 * row_bytes} : NextBlock{});
  });
}

}  // namespace

// A format's rows: GGUF's (N, row_bytes) into blocks of 8 rows, (N / 8, 8 row_bytes)
// (pack), or back
torch::Tensor repack_rows(torch::Tensor blocks, int64_t ggml_type, bool pack) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.dim() == 2 && blocks.scalar_type() == at::kByte,
              "repack_rows: blocks must be (N, bytes) uint8 on CPU");
  const torch::Tensor in = blocks.contiguous();
  torch::Tensor out;
  const bool known = with_format(ggml_type, [&](auto fmt) {
    using F = decltype(fmt);
    TORCH_CHECK(!pack || in.size(0) % 8 == 0, "repack_rows: ", in.size(0), " rows are not blocks of 8");
    const int64_t groups = pack ? in.size(0) / 8 : in.size(0), row_bytes = pack ? in.size(1) : in.size(1) / 8;
    TORCH_CHECK(row_bytes % F::BYTES == 0 && (pack || in.size(1) % 8 == 0), "repack_rows: rows of ", row_bytes,
                " bytes are not whole blocks of ", F::BYTES);
    // packing makes a layer's weight (in 2 MiB pages); unpacking, a copy to read
    out = pack ? ridge_shared::huge_page_empty({groups, 8 * row_bytes}, in.options())
               : torch::empty({8 * groups, row_bytes}, in.options());
    const uint8_t* src = in.data_ptr<uint8_t>();
    uint8_t* dst = out.data_ptr<uint8_t>();
    at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        pack ? repack_rows8<F, true>(src + i * 8 * row_bytes, dst + i * 8 * row_bytes, row_bytes)
             : repack_rows8<F, false>(src + i * 8 * row_bytes, dst + i * 8 * row_bytes, row_bytes);
    });
  });
  TORCH_CHECK(known, "repack_rows: GGUF type ", ggml_type, " has no AVX2 kernel");
  return out;
}

bool supports_format(int64_t ggml_type) {
  return with_format(ggml_type, [](auto) {});
}

namespace ridge_avx2 {

int64_t block_row_bytes(int64_t ggml_type, int64_t K) {
  int64_t bytes = -1;
  with_format(ggml_type, [&](auto fmt) {
    using F = decltype(fmt);
    if (K % F::BLOCK == 0) bytes = K / F::BLOCK * F::BYTES;
  });
  return bytes;
}

template <class T>
void linear_blocks_into(const T* x, int64_t M, int64_t K, const uint8_t* w, int64_t ggml_type, bool packed, int64_t N,
                        const float* bias, T* y, int64_t ldy) {
  if (M == 0 || N == 0) return;
  thread_local QuantizedX qx;  // the caller's thread: its buffers kept from call to call
  thread_local std::vector<float> ys;
  const bool direct = std::is_same_v<T, float> && ldy == N;  // float rows: the sums land in y itself
  if (!direct) ys.resize(M * N);
  float* out = direct ? reinterpret_cast<float*>(y) : ys.data();
  with_format(ggml_type, [&](auto fmt) {
    using F = decltype(fmt);
    const int64_t row_bytes = K / F::BLOCK * F::BYTES;
    quantize_x(x, M, K, F::BLOCK, qx);
    if (packed) return gemm_rows8<F, false>(qx, w, row_bytes, N, out);
    if (M >= PACK_FROM_ROWS && N % 8 == 0) return gemm_rows8<F, true>(qx, w, row_bytes, N, out);
    gemm<F>(qx, w, row_bytes, N, out);
  });
  if (direct) {
    if (bias)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) out[m * N + n] += bias[n];
    return;
  }
  ridge_avx2::store_sums(out, M, N, bias, y, ldy);
}

template void linear_blocks_into<float>(const float*, int64_t, int64_t, const uint8_t*, int64_t, bool, int64_t,
                                        const float*, float*, int64_t);
template void linear_blocks_into<at::BFloat16>(const at::BFloat16*, int64_t, int64_t, const uint8_t*, int64_t, bool,
                                               int64_t, const float*, at::BFloat16*, int64_t);

}  // namespace ridge_avx2

// x (..., K) float32 or bf16; blocks (N, K / BLOCK * BYTES) uint8, W's rows: GGUF's bytes, or
// (packed) blocks of 8 rows (repack_rows: (N / 8, 8 row_bytes))
torch::Tensor linear_blocks_impl(torch::Tensor x, torch::Tensor blocks, int64_t ggml_type, c10::optional<torch::Tensor> bias,
                                 bool packed) {
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu(), "linear_blocks: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "linear_blocks: bf16 or f32 x");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte, "linear_blocks: blocks must be (N, bytes) uint8");
  const int64_t K = x.size(-1), N = packed ? blocks.size(0) * 8 : blocks.size(0);
  const bool known = with_format(ggml_type, [&](auto fmt) {
    using F = decltype(fmt);
    TORCH_CHECK(K % F::BLOCK == 0, "linear_blocks: K = ", K, " is not a multiple of the format's block, ", F::BLOCK);
    const int64_t row_bytes = K / F::BLOCK * F::BYTES;
    TORCH_CHECK(blocks.size(1) == (packed ? 8 : 1) * row_bytes, "linear_blocks: blocks of ", blocks.size(1),
                packed ? " bytes a block of 8 rows" : " bytes a row", ", K = ", K, " needs ",
                (packed ? 8 : 1) * row_bytes);
  });
  TORCH_CHECK(known, "linear_blocks: GGUF type ", ggml_type, " has no AVX2 kernel");
  if (bias) TORCH_CHECK(bias->numel() == N, "linear_blocks: bias of ", bias->numel(), " for N = ", N);
  const torch::Tensor x2 = x.reshape({-1, K}).contiguous();
  const torch::Tensor w = blocks.contiguous();
  const torch::Tensor b = bias ? bias->to(at::kFloat).contiguous() : torch::Tensor();
  const int64_t M = x2.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  torch::Tensor y = torch::empty(shape, x.options());
  const float* bp = bias ? b.data_ptr<float>() : nullptr;
  if (x2.scalar_type() == at::kFloat)
    ridge_avx2::linear_blocks_into(x2.data_ptr<float>(), M, K, w.data_ptr<uint8_t>(), ggml_type, packed, N, bp,
                                   y.data_ptr<float>(), N);
  else
    ridge_avx2::linear_blocks_into(x2.data_ptr<at::BFloat16>(), M, K, w.data_ptr<uint8_t>(), ggml_type, packed, N, bp,
                                   y.data_ptr<at::BFloat16>(), N);
  return y;
}

torch::Tensor linear_blocks(torch::Tensor x, torch::Tensor blocks, int64_t ggml_type, c10::optional<torch::Tensor> bias) {
  return linear_blocks_impl(x, blocks, ggml_type, bias, false);
}
torch::Tensor linear_blocks_packed(torch::Tensor x, torch::Tensor blocks, int64_t ggml_type, c10::optional<torch::Tensor> bias) {
  return linear_blocks_impl(x, blocks, ggml_type, bias, true);
}

void register_decode_plan(pybind11::module_& m);  // avx2_plan.cpp

namespace ridge_avx2 {
bool g_fetch_into_l2 = !ridge_shared::cpu_is_amd();
}  // namespace ridge_avx2

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("linear_blocks", &linear_blocks, nogil, "y = x @ W.T (+ bias), W as GGUF blocks of the given GGUF type (AVX2)");
  m.def("linear_blocks_packed", &linear_blocks_packed, nogil, "linear_blocks on blocks of 8 rows (repack_rows)");
  m.def("repack_rows", &repack_rows, nogil, "a block format's GGUF rows into blocks of 8 rows (pack), or back");
  m.def("supports_format", &supports_format, "whether linear_blocks takes this GGUF type");
  m.def("fetch_into_l2", [] { return ridge_avx2::g_fetch_into_l2; },
        "whether the block formats' matmul fetches W ahead into L2 (avx2_simd.h)");
  m.def("set_fetch_into_l2", [](bool on) { ridge_avx2::g_fetch_into_l2 = on; },
        "fetch W ahead into L2 (true) or L1 (false), between calls; never changes a result");
  m.def("huge_page_copy", &ridge_shared::huge_page_copy, nogil,
        "a CPU weight's values, contiguous, in 2 MiB pages (weight_arena.h; under 64 KiB, itself)");
  m.def("linear_bf16", &linear_bf16, nogil, "y = x @ W.T (+ bias), W (N, K) bf16, y in x's dtype (AVX2)");
  m.def("rms_norm", &rms_norm, nogil, "RMSNorm, float32 or bfloat16 (rounded as Hugging Face's bf16 path)");
  m.def("add_rms_norm", &add_rms_norm, nogil, "residual += x (in place), then RMSNorm(residual)");
  m.def("silu_mul", &silu_mul, nogil, "silu(gate) * up for (T, 2I) -> (T, I)");
  m.def("rope_", &rope_, nogil, "rotate-half RoPE in place on (T, H, D) rows");
  m.def("rope_write_kv_", &rope_write_kv_, nogil, "rope_ on qkv's q and k heads, then k and v into the pools at slots");
  def_kv_grouped_bytes(m, KV_GROUPED_BYTES);  // the AVX2 kernels' own bound (paged_rows.h)
  ridge_shared::def_step_parts(m);
  m.def("decode_attention_jobs", &ridge_avx2::decode_attention_jobs, nogil,
        "the jobs paged_decode_attention splits (sequences, query heads, KV heads) into on this process's threads");
  m.def("paged_decode_attention", &paged_decode_attention, nogil,
        "one query per sequence over its paged float32 / bfloat16 K/V, no gather");
  m.def("paged_decode_attention_quant", &paged_decode_attention_quant, nogil,
        "paged_decode_attention over an int8 or e4m3 cache and its fp16 group scales, dequantized in registers");
  m.def("apply_token_bitmask_", &apply_token_bitmask_, nogil,
        "structured output: the tokens a row's bitmask does not allow get -inf, in place");
  m.def("argmax_rows", &argmax_rows, nogil, "each row's argmax (the first of equal maxima; a row's first NaN)");
  m.def("route_topk", &route_topk, nogil,
        "an MoE's top-k routing: (T, k) expert ids and bf16 weights, greedy or group-limited (Router.forward)");
  register_decode_plan(m);
}
