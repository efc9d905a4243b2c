// A dense bf16 layer on a few rows (decode) for CPUs with AVX2 but without AVX-512 BF16
// (Avx2Kernels): y = x @ W^T (+ bias), W (N, K) bf16 as the checkpoint holds it, x float32
// or bf16, y in x's dtype rounded once from float32.
//
// Why: without AVX-512 BF16 torch's bf16 matmul is a slow path. On the 2-core Zen 3 EPYC
// (2026-11-29, 8 matrices of 5632 x 2048) it streamed W at 9.4 GB/s on one row and cost
// 1.9x one row's time on 2 rows, 4.1x on 8, 11.5x on 23: a decode step of 8 sequences took
// 4 times one sequence's. Here W is read once a call whatever the rows (up to MAX_ROWS at a
// time: ridge_avx2::tiled_gemm, as the block formats tile), widened to float32 in registers
// (bf16 is the top half of an fp32: a shift), and
// multiplied by every row of x in float32 FMAs.
//
// Each output is one row of x against one row of W, computed by one thread in the same order
// whatever the batch: two accumulators over alternate 8-wide chunks of k, the tail in the
// first, then ((a0 + a1) summed across lanes) (+ bias). A row's output does not depend on the
// rows beside it.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "avx2_kernels.h"
#include "avx2_simd.h"

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

// y (M, N) float32 = x (M, K) float32 @ W^T
void gemm(const float* x, int64_t M, int64_t K, const bf16* w, int64_t N, float* y) {
  ridge_avx2::tiled_gemm(M, N, y, [&] {
    return [=](auto rows, int64_t n, int64_t m0, float* out) {
      dot_row<decltype(rows)::value>(w + n * K, x + m0 * K, K, out);
    };
  });
}

}  // namespace

namespace ridge_avx2 {

template <class T>
void linear_bf16_into(const T* x, int64_t M, int64_t K, const bf16* w, int64_t N, const float* bias, T* y,
                      int64_t ldy) {
  if (M == 0 || N == 0) return;
  thread_local std::vector<float> xs, ys;  // x widened, and y's sums (the caller's thread)
  const float* xf = nullptr;
  if constexpr (std::is_same_v<T, float>) {
    xf = x;
  } else {
    xs.resize(M * K);
    for (int64_t i = 0; i < M * K; ++i) xs[i] = static_cast<float>(x[i]);
    xf = xs.data();
  }
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
