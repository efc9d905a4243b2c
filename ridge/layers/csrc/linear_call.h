// What every packed linear kernel does around its GEMM: x viewed as (M, K) rows, y (M, N)
// in x's dtype, the bias as fp32, and the result back in x's leading shape.
#pragma once
#include <torch/extension.h>

#include <vector>

// Packed weights in 2 MiB pages where the kernel allows it (linear_bf16.cpp).
torch::Tensor huge_page_empty(at::IntArrayRef shape, const at::TensorOptions& options);

// How far ahead of its loads a streaming kernel (bf16 and every block format) fetches each line
// of its weights into L2 (prefetcht2), every tile size: alone, the hardware prefetcher keeps too
// few lines in flight for a core to stream at what the memory gives, and fewer the more work a
// kernel does per byte. Measured one row, kernel alone: 2 Zen 4 cores, one 11264 x 2048 matmul,
// int4 26.0 -> 30.5 GB/s, Q4_K 23.2 -> 31.1, int8 30.4 either way; 2-core Xeon, random weights
// in TinyLlama-1.1B's four shapes, bf16 1.10-1.12x, Q8_0 1.07-1.14x, and bf16 on the AVX-512
// kernel (no AMX) at 2 and 4 rows 1.19x and 1.34x, 8 rows unchanged. 24, 128 and 192 KiB were no
// better on the Xeon.
constexpr int64_t L2_PREFETCH_AHEAD = 64 * 1024;

struct LinearCall {
  torch::Tensor x2, y, bias_f;
  int64_t M = 0, K = 0;
  std::vector<int64_t> out_shape;
  const float* bias = nullptr;

  LinearCall(const torch::Tensor& x, int64_t N, const c10::optional<torch::Tensor>& bias_opt) {
    K = x.size(-1);
    x2 = x.reshape({-1, K}).contiguous();
    M = x2.size(0);
    out_shape = x.sizes().vec();
    out_shape.back() = N;
    y = torch::empty({M, N}, x.options());
    if (bias_opt.has_value() && bias_opt->defined()) {
      bias_f = bias_opt->to(at::kFloat).contiguous();
      bias = bias_f.data_ptr<float>();
    }
  }

  torch::Tensor result() const { return y.view(out_shape); }
};
