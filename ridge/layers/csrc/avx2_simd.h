// What the AVX2 extension's sources share (avx2_blocks.cpp, avx2_dense.cpp, avx2_ops.cpp): where
// the block formats' matmul fetches its weights ahead, 8 floats loaded from float32 or bf16, a
// vector's horizontal sum in one fixed order, and how both matmuls split y = x @ W^T over threads
// and tiles.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

namespace ridge_avx2 {

// Where the block-format matmuls (avx2_blocks.cpp) fetch their weights ahead of their loads:
// into L1 (prefetcht0, L1_AHEAD bytes on, as each kernel measured best on the 2-core Zen 3 EPYC)
// or, on Intel, into L2 (prefetcht2, L2_FETCH_AHEAD on). An L1 fetch of a line still in memory
// holds one of the core's few L1 fill buffers until the line comes. On the 2-core Xeon with AMX
// running these kernels (22 TinyLlama layers' weights, both ways alternated in one process, at
// its slow level), one row of x: Q4_K 1.65x, IQ4_XS 1.56x, Q3_K 1.48x, Q5_K 1.34x, Q8_0 1.25x,
// Q2_K 1.03x, Q4_0 0.96x; 4 rows 0.97-1.18x; whole batch-1 steps Q4_K_M 1.55x, Q8_0 1.25x (at
// its fast level both ways read the same). Q6_K's one-row kernel keeps L1 (prefetch_ahead_l1),
// as do the dense bf16 kernel (0.93-0.97x with L2) and the AMD machines, measured with L1
// fetches only; there the rows-of-8 kernels' calls of 1-3 rows of x fetch each line once
// (avx2_blocks.cpp's fetch_w: 1.08-1.18x the K-quant files' batch-1 steps on the Zen 3).
// set_fetch_into_l2 in the bindings switches it (benchmarks, tests: where a line is fetched
// never changes a result).
extern bool g_fetch_into_l2;  // avx2_blocks.cpp: !cpu_is_amd() at load
constexpr int64_t L2_FETCH_AHEAD = 16384;

template <int64_t L1_AHEAD>
inline void fetch_ahead(const char* line) {
  // both fetches, the one not wanted of the line itself (in L1 by its load right after): no
  // branch, so the compiler spreads the fetches among the loads (as a branch's block, they ran
  // back to back: Q6_K's one-row kernel 0.65x on the Xeon)
  const bool l2 = g_fetch_into_l2;
  _mm_prefetch(l2 ? line + L2_FETCH_AHEAD : line, _MM_HINT_T2);
  _mm_prefetch(l2 ? line : line + L1_AHEAD, _MM_HINT_T0);
}

constexpr int MAX_ROWS = 4;  // rows of x one pass over a row of W takes
constexpr int64_t ROW_CHUNK = 16;  // rows of W a thread takes at a time (their bytes stay in L2 across x's rows)

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {  // exact: bf16 is the top half of an fp32
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y (M, N) float32 = x @ W^T, tiled: each thread takes runs of ROW_CHUNK rows of W, and each
// row n of a run meets x's rows MAX_ROWS at a time. make_dot() is called once per thread (it
// holds the thread's scratch); what it returns is called as dot(std::integral_constant<int, R>,
// n, m0, out) and fills out[0, R) with rows [m0, m0 + R) of x against row n of W. Each output
// is one thread's, computed whatever the rows beside it.
template <class MakeDot>
void tiled_gemm(int64_t M, int64_t N, float* y, MakeDot&& make_dot) {
  at::parallel_for(0, N, ROW_CHUNK, [&](int64_t begin, int64_t end) {
    auto dot = make_dot();
    float out[MAX_ROWS];
    for (int64_t n0 = begin; n0 < end; n0 += ROW_CHUNK) {
      const int64_t n1 = std::min(end, n0 + ROW_CHUNK);
      for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
        const int rows = static_cast<int>(std::min<int64_t>(MAX_ROWS, M - m0));
        for (int64_t n = n0; n < n1; ++n) {
          switch (rows) {
            case 1: dot(std::integral_constant<int, 1>{}, n, m0, out); break;
            case 2: dot(std::integral_constant<int, 2>{}, n, m0, out); break;
            case 3: dot(std::integral_constant<int, 3>{}, n, m0, out); break;
            default: dot(std::integral_constant<int, 4>{}, n, m0, out); break;
          }
          for (int r = 0; r < rows; ++r) y[(m0 + r) * N + n] = out[r];
        }
      }
    }
  });
}
static_assert(MAX_ROWS == 4, "tiled_gemm's switch names each tile height");

// Items [0, n) over this process's threads, each thread taking the next item as it finishes
// one rather than a fixed share: for the matmuls of many rows of x (prefill: the block formats'
// calls of TAKE_FROM_ROWS rows or more, the dense bf16 tiles), whose items (a block of W's rows
// against every row of x) are long. With fixed halves one core idled at each call's end
// whenever the other ran slower (the 2-vCPU Zen 3 EPYC, 2026-12-03, 512-token prefills, both
// ways alternated: IQ4_XS 1.08x (1.05-1.16, 6 rounds), Q8_0 1.10x (1.00-1.21, 5), bf16 1.05x
// (1.02-1.19, 3)). Decode calls keep fixed shares, each thread streaming its contiguous part
// of W (runs of 4 or 16 blocks of 8 rows taken so: batch-1 decode of the Q4_K_M file 0.91x and
// 0.95x). make_state() is called once per thread (its scratch), then run(state, i) for each
// item it takes; which thread runs an item never changes its outputs.
constexpr int64_t TAKE_FROM_ROWS = 16;
template <class MakeState, class Run>
void parallel_take(int64_t n, MakeState&& make_state, Run&& run) {
  std::atomic<int64_t> next{0};
  const auto take = [&] { return next.fetch_add(1, std::memory_order_relaxed); };
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    auto state = make_state();
    for (int64_t i = take(); i < n; i = take()) run(state, i);
  });
}

// A matmul's float32 sums (M, N) plus bias (N floats, or null) rounded once to T into y, its
// rows ldy apart (a layer's columns inside a wider output)
template <class T>
void store_sums(const float* sums, int64_t M, int64_t N, const float* bias, T* y, int64_t ldy) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) y[m * ldy + n] = static_cast<T>(bias ? sums[m * N + n] + bias[n] : sums[m * N + n]);
}

}  // namespace ridge_avx2
