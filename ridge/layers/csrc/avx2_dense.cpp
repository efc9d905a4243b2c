// A dense bf16 layer for CPUs with AVX2 but without AVX-512 BF16 (Avx2Kernels): y = x @ W^T
// (+ bias), W (N, K) bf16 as the checkpoint holds it, x float32 or bf16, y in x's dtype rounded
// once from float32.
//
// Why: without AVX-512 BF16 torch's bf16 matmul is a slow path. On the 2-core Zen 3 EPYC
// (2026-11-29, 8 matrices of 5632 x 2048) it streamed W at 9.4 GB/s on one row and cost
// 1.9x one row's time on 2 rows, 4.1x on 8, 11.5x on 23: a decode step of 8 sequences took
// 4 times one sequence's. Here W is widened to float32 in registers as it is loaded (bf16 is
// the top half of an fp32: a shift) and multiplied in float32 FMAs:
// - below PREFILL_ROWS rows of x (decode), W is read once a call whatever the rows (up to
//   MAX_ROWS at a time: ridge_avx2::tiled_gemm, as the block formats tile; one row of x meets
//   4 rows of W at a time, dot_4rows). Each output is one
//   row of x against one row of W, computed by one thread in the same order whatever the
//   batch: two accumulators over alternate 8-wide chunks of k, the tail in the first, then
//   ((a0 + a1) summed across lanes) (+ bias).
// - from PREFILL_ROWS rows (prefill), tiles of 4 rows of x and 3 of W (prefill_gemm). Until stop
//   82 prefill ran torch's float32 GEMM on W widened a slice at a time; a third of that time
//   went to widening W and to the GEMM's own copy of it (Zen 3, 128-token prefill of the bf16
//   TinyLlama file: perf, 52% in the GEMM's kernel, 16% in its packing, 11% widening). These
//   tiles, the same file's 128-token prefill in one process, 5 alternated rounds: 1.45x
//   (1.04-1.67); 512 tokens 1.04x (0.98-1.10).
// Either way a row's output does not depend on the rows beside it in a call of the same kind.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "avx2_kernels.h"
#include "avx2_simd.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using ridge_avx2::hsum;
using ridge_avx2::load8;

using bf16 = at::BFloat16;

// How far ahead a thread prefetches W (its rows are contiguous), in bytes. On the 2-core Zen 3
// EPYC (8 matrices of 5632 x 2048 and 2048 x 5632, 3 rounds): one row of x 14.7-16.5 GB/s at
// 0 bytes ahead, 15.4-18.1 at 2 KiB, 18.5-21.2 at 8 KiB (sum() 21-24 in the same rounds); 4 rows
// 10.0-11.0 at 0, 12.4-13.6 at 2 KiB.
constexpr int64_t PREFETCH_AHEAD = 8192;

// Rows [0, R) of x (float32, K a row, stride K) against one row of W: y[r]
template <int R>
inline void dot_row(const bf16* w, const float* x, int64_t K, float* y) {
  __m256 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = _mm256_setzero_ps(), a1[r] = _mm256_setzero_ps();
  const char* bytes = reinterpret_cast<const char*>(w);
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    _mm_prefetch(bytes + 2 * k + PREFETCH_AHEAD, _MM_HINT_T0);
    const __m256 w0 = load8(w + k), w1 = load8(w + k + 8);
    for (int r = 0; r < R; ++r) {
      a0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * K + k), a0[r]);
      a1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * K + k + 8), a1[r]);
    }
  }
  if (k + 8 <= K) {
    const __m256 w0 = load8(w + k);
    for (int r = 0; r < R; ++r) a0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * K + k), a0[r]);
    k += 8;
  }
  for (int r = 0; r < R; ++r) {
    float s = hsum(_mm256_add_ps(a0[r], a1[r]));
    for (int64_t t = k; t < K; ++t) s += static_cast<float>(w[t]) * x[r * K + t];
    y[r] = s;
  }
}

// One row of x against 4 rows of W (K apart) at once, each row's sum dot_row<1>'s bit for bit
// (its two accumulators over alternate chunks, the tail in the first): four streams of W and
// eight independent FMA chains, where one row at a time kept two chains and one stream. Each
// line is fetched once, 4 rows on (the same place in the next 4 rows). 22 TinyLlama layers'
// matrices from memory, 2 threads, the Zen 3 EPYC, alternated in one process (7 rounds,
// 2026-12-04): 1.17-1.21x one row at a time (1.11-1.22x fetching each line twice, 1.01-1.12x
// with no fetches); the bf16 file's batch-1 decode steps alternated step by step (18 triples):
// 1.06x (1.08x fetching twice).
inline void dot_4rows(const bf16* w, const float* x, int64_t K, float* y) {
  __m256 a0[4], a1[4];
  for (int i = 0; i < 4; ++i) a0[i] = _mm256_setzero_ps(), a1[i] = _mm256_setzero_ps();
  const char* bytes = reinterpret_cast<const char*>(w);
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
    for (int i = 0; i < 4; ++i) {
      if (k % 32 == 0) _mm_prefetch(bytes + 2 * (i * K + k) + 8 * K, _MM_HINT_T0);
      a0[i] = _mm256_fmadd_ps(load8(w + i * K + k), x0, a0[i]);
      a1[i] = _mm256_fmadd_ps(load8(w + i * K + k + 8), x1, a1[i]);
    }
  }
  if (k + 8 <= K) {
    const __m256 x0 = _mm256_loadu_ps(x + k);
    for (int i = 0; i < 4; ++i) a0[i] = _mm256_fmadd_ps(load8(w + i * K + k), x0, a0[i]);
    k += 8;
  }
  for (int i = 0; i < 4; ++i) {
    float s = hsum(_mm256_add_ps(a0[i], a1[i]));
    for (int64_t t = k; t < K; ++t) s += static_cast<float>(w[i * K + t]) * x[t];
    y[i] = s;
  }
}

// y (M, N) float32 = x (M, K) float32 @ W^T: one row of x 4 rows of W at a time (dot_4rows),
// more in tiles (tiled_gemm); each thread a contiguous share of W's rows either way
void gemm(const float* x, int64_t M, int64_t K, const bf16* w, int64_t N, float* y) {
  if (M == 1)
    return at::parallel_for(0, N, ridge_avx2::ROW_CHUNK, [&](int64_t begin, int64_t end) {
      int64_t n = begin;
      for (; n + 4 <= end; n += 4) dot_4rows(w + n * K, x, K, y + n);
      for (; n < end; ++n) dot_row<1>(w + n * K, x, K, y + n);
    });
  ridge_avx2::tiled_gemm(M, N, y, [&] {
    return [=](auto rows, int64_t n, int64_t m0, float* out) {
      dot_row<decltype(rows)::value>(w + n * K, x + m0 * K, K, out);
    };
  });
}

// Prefill (PREFILL_ROWS rows of x or more): tiles of TM rows of x against TN rows of W, one
// 8-lane accumulator per (row of x, row of W) over all of K, W widened in registers as it is
// loaded and x read as float32; each thread's W rows in blocks of W_BLOCK_BYTES (they stay in
// L2 while every tile of x meets them). Each output sums its products in one order whatever
// the rows beside it (lane by lane over k, the tail in order, then hsum): the same in any batch
// of PREFILL_ROWS rows or more.
constexpr int TM = 4, TN = 3;  // 12 accumulators, 3 W vectors and an x vector: 16 ymm registers
constexpr int64_t PREFILL_ROWS = 16, W_BLOCK_BYTES = 96 * 1024, X_BLOCK_ROWS = 128;

template <int RM, int RN, class T>
inline void prefill_tile(const float* x, int64_t K, const bf16* w, const float* bias, T* y, int64_t ldy) {
  __m256 acc[RM][RN];
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[RN];
    for (int j = 0; j < RN; ++j) wv[j] = load8(w + j * K + k);
    for (int i = 0; i < RM; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * K + k);
      for (int j = 0; j < RN; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t t = k; t < K; ++t) s += x[i * K + t] * static_cast<float>(w[j * K + t]);
      y[i * ldy + j] = static_cast<T>(bias ? s + bias[j] : s);  // store_sums' rounding
    }
}

template <int RM, class T>
inline void prefill_tiles(const float* x, int64_t K, const bf16* w, int64_t n0, int64_t n1, const float* bias, T* y,
                          int64_t ldy) {
  int64_t n = n0;
  const auto at = [&](int64_t n) { return bias ? bias + n : nullptr; };
  for (; n + TN <= n1; n += TN) prefill_tile<RM, TN>(x, K, w + n * K, at(n), y + n, ldy);
  if (n1 - n == 2) prefill_tile<RM, 2>(x, K, w + n * K, at(n), y + n, ldy);
  if (n1 - n == 1) prefill_tile<RM, 1>(x, K, w + n * K, at(n), y + n, ldy);
}

// y (M, N, rows ldy apart) = x (M, K) float32 @ W^T (+ bias) rounded once to T, for M >=
// PREFILL_ROWS: X_BLOCK_ROWS rows of x at a time (so that the rows a thread's tiles read stay
// in L2/L3; W is read once per block of them), each thread taking the next block of W's rows
// (parallel_take)
template <class T>
void prefill_gemm(const float* x, int64_t M, int64_t K, const bf16* w, int64_t N, const float* bias, T* y,
                  int64_t ldy) {
  const int64_t rows = std::max<int64_t>(TN, W_BLOCK_BYTES / (2 * K) / TN * TN);
  for (int64_t mb = 0; mb < M; mb += X_BLOCK_ROWS) {
    const int64_t mb_end = std::min(M, mb + X_BLOCK_ROWS);
    ridge_avx2::parallel_take((N + rows - 1) / rows, [] { return 0; }, [&](int, int64_t blk) {
      const int64_t n0 = blk * rows, n1 = std::min(N, n0 + rows);
      for (int64_t m0 = mb; m0 < mb_end; m0 += TM) {
        const float* xm = x + m0 * K;
        T* ym = y + m0 * ldy;
        switch (std::min<int64_t>(TM, mb_end - m0)) {
          case 1: prefill_tiles<1>(xm, K, w, n0, n1, bias, ym, ldy); break;
          case 2: prefill_tiles<2>(xm, K, w, n0, n1, bias, ym, ldy); break;
          case 3: prefill_tiles<3>(xm, K, w, n0, n1, bias, ym, ldy); break;
          default: prefill_tiles<4>(xm, K, w, n0, n1, bias, ym, ldy); break;
        }
      }
    });
  }
}
static_assert(TM == 4, "prefill_gemm's switch names each tile height");

}  // namespace

namespace ridge_avx2 {

// x's M * K values as float32: x itself, or widened into buf
template <class T>
const float* as_float(const T* x, int64_t n, std::vector<float>& buf) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    buf.resize(n);
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(x[i]);
    return buf.data();
  }
}

template <class T>
void linear_bf16_into(const T* x, int64_t M, int64_t K, const bf16* w, int64_t N, const float* bias, T* y,
                      int64_t ldy) {
  if (M == 0 || N == 0) return;
  if (M >= PREFILL_ROWS) {  // the tiles round into y; x widened into the call's own buffer (a
                            // prefill's can be large, so not kept as decode's are)
    std::vector<float> xw;
    return prefill_gemm(as_float(x, M * K, xw), M, K, w, N, bias, y, ldy);
  }
  thread_local std::vector<float> xs, ys;  // x widened, and y's sums (the caller's thread)
  const float* xf = as_float(x, M * K, xs);
  ys.resize(M * N);
  gemm(xf, M, K, w, N, ys.data());
  store_sums(ys.data(), M, N, bias, y, ldy);
}

template void linear_bf16_into<float>(const float*, int64_t, int64_t, const bf16*, int64_t, const float*, float*,
                                      int64_t);
template void linear_bf16_into<bf16>(const bf16*, int64_t, int64_t, const bf16*, int64_t, const float*, bf16*, int64_t);

}  // namespace ridge_avx2

// x (..., K) float32 or bf16; weight (N, K) bf16; bias (N) or None
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "linear_bf16: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "linear_bf16: bf16 or f32 x");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "linear_bf16: weight must be (N, K) bf16");
  const int64_t K = x.size(-1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "linear_bf16: weight has ", weight.size(1), " columns, x has K = ", K);
  if (bias) TORCH_CHECK(bias->numel() == N, "linear_bf16: bias of ", bias->numel(), " for N = ", N);
  const torch::Tensor x2 = x.reshape({-1, K}).contiguous();
  const torch::Tensor w = weight.contiguous();
  const torch::Tensor b = bias ? bias->to(at::kFloat).contiguous() : torch::Tensor();
  const int64_t M = x2.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  torch::Tensor y = torch::empty(shape, x.options());
  const float* bp = bias ? b.data_ptr<float>() : nullptr;
  if (x2.scalar_type() == at::kFloat)
    ridge_avx2::linear_bf16_into(x2.data_ptr<float>(), M, K, w.data_ptr<bf16>(), N, bp, y.data_ptr<float>(), N);
  else
    ridge_avx2::linear_bf16_into(x2.data_ptr<bf16>(), M, K, w.data_ptr<bf16>(), N, bp, y.data_ptr<bf16>(), N);
  return y;
}
