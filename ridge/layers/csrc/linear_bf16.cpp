// y = x @ w^T (+ bias) for bfloat16 on AVX-512 BF16 CPUs, tuned for decode (small M).
//
// Decode is a GEMV: every weight byte is read once per step, so the kernel's job is to
// stream W at memory bandwidth. Layout and blocking:
//
//   W: [N, K] row-major (as nn.Linear stores it), split among threads in contiguous
//      blocks of NR rows, so each thread streams one contiguous stretch of memory.
//   x: [M, K], read in tiles of MR rows (it stays in L1/L2).
//   For each NR-row block of W, every MR-row tile of x is multiplied against it while
//   the block is hot in cache; MR x NR fp32 accumulators live in zmm registers and
//   vdpbf16ps does 32 multiply-adds per instruction (pairs of bf16 -> fp32).
//   While computing block b, software prefetch pulls the block PREFETCH_BLOCKS ahead
//   into L2, so loads overlap arithmetic (without it M = 8 drops to ~20 GB/s here).
//
// Accumulation is fp32; the result is rounded once to bf16 (as F.linear does).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int64_t PREFETCH_BLOCKS = 4;

inline __m512bh load_bf16(const at::BFloat16* p, int64_t remaining) {
  if (remaining >= 32) return (__m512bh)_mm512_loadu_si512((const void*)p);
  const __mmask32 mask = (__mmask32)((1ull << remaining) - 1);
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, (const void*)p);
}

// One k-step of 32: acc[i][j] += x[i, k:k+32] . w[j, k:k+32] (masked loads past K).
template <int MR, int NR, bool PREFETCH, bool TAIL>
inline void kstep(__m512 (&acc)[MR][NR], const at::BFloat16* x, int64_t ldx, const at::BFloat16* w,
                  int64_t ldw, const at::BFloat16* ahead, int64_t k, int64_t rem) {
  __m512bh wv[NR];
  for (int j = 0; j < NR; ++j) {
    wv[j] = TAIL ? load_bf16(w + j * ldw + k, rem) : (__m512bh)_mm512_loadu_si512((const void*)(w + j * ldw + k));
    if (PREFETCH) _mm_prefetch((const char*)(ahead + j * ldw + k), _MM_HINT_T1);
  }
  for (int i = 0; i < MR; ++i) {
    const __m512bh xv =
        TAIL ? load_bf16(x + i * ldx + k, rem) : (__m512bh)_mm512_loadu_si512((const void*)(x + i * ldx + k));
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
  }
}

// out[i * ldo + j] = dot(x row i, w row j) for i < MR, j < NR.
template <int MR, int NR, bool PREFETCH>
inline void tile(const at::BFloat16* x, int64_t ldx, const at::BFloat16* w, int64_t ldw, int64_t K,
                 float* out, int64_t ldo) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const at::BFloat16* ahead = w + PREFETCH_BLOCKS * NR * ldw;
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) kstep<MR, NR, PREFETCH, false>(acc, x, ldx, w, ldw, ahead, k, 32);
  if (k < K) kstep<MR, NR, PREFETCH, true>(acc, x, ldx, w, ldw, ahead, k, K - k);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) out[i * ldo + j] = _mm512_reduce_add_ps(acc[i][j]);
}

// All M rows of x against NR rows of w; x tiles of MR rows, the remainder one row at a time.
template <int MR, int NR>
inline void rows_block(const at::BFloat16* x, int64_t M, int64_t K, const at::BFloat16* w, float* out,
                       int64_t ldo) {
  int64_t m = 0;
  bool first = true;  // prefetch the next W blocks only on the first pass over this block
  for (; m + MR <= M; m += MR) {
    if (first) tile<MR, NR, true>(x + m * K, K, w, K, K, out + m * ldo, ldo);
    else tile<MR, NR, false>(x + m * K, K, w, K, K, out + m * ldo, ldo);
    first = false;
  }
  for (; m < M; ++m) {
    if (first) tile<1, NR, true>(x + m * K, K, w, K, K, out + m * ldo, ldo);
    else tile<1, NR, false>(x + m * K, K, w, K, K, out + m * ldo, ldo);
    first = false;
  }
}

template <int MR, int NR>
void gemm(const at::BFloat16* x, int64_t M, int64_t K, const at::BFloat16* w, int64_t N, const float* bias,
          at::BFloat16* y) {
  const int64_t blocks = (N + NR - 1) / NR;
  at::parallel_for(0, blocks, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(M * NR);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * NR;
      const int64_t nr = std::min<int64_t>(NR, N - n0);
      if (nr == NR) {
        rows_block<MR, NR>(x, M, K, w + n0 * K, buf.data(), NR);
      } else {
        for (int64_t j = 0; j < nr; ++j) rows_block<MR, 1>(x, M, K, w + (n0 + j) * K, buf.data() + j, NR);
      }
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < nr; ++j) {
          float v = buf[m * NR + j];
          if (bias) v += bias[n0 + j];
          y[m * N + n0 + j] = at::BFloat16(v);
        }
    }
  });
}

}  // namespace

torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "linear_bf16: bfloat16 only");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "linear_bf16: CPU tensors only");
  TORCH_CHECK(w.dim() == 2 && x.size(-1) == w.size(1), "linear_bf16: shape mismatch");
  const int64_t K = w.size(1), N = w.size(0);
  auto x2 = x.reshape({-1, K}).contiguous();
  auto wc = w.contiguous();
  const int64_t M = x2.size(0);
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor bias_f;
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    bias_f = bias->to(at::kFloat).contiguous();
    bias_ptr = bias_f.data_ptr<float>();
  }
  const auto* xp = x2.data_ptr<at::BFloat16>();
  const auto* wp = wc.data_ptr<at::BFloat16>();
  auto* yp = y.data_ptr<at::BFloat16>();
  if (M == 1) gemm<1, 8>(xp, M, K, wp, N, bias_ptr, yp);
  else if (M == 2) gemm<2, 8>(xp, M, K, wp, N, bias_ptr, yp);
  else if (M == 3) gemm<3, 6>(xp, M, K, wp, N, bias_ptr, yp);
  else gemm<4, 4>(xp, M, K, wp, N, bias_ptr, yp);
  return y.view(out_shape);
}
