// What every packed linear kernel does around its GEMM: x viewed as (M, K) rows, y (M, N)
// in x's dtype, the bias as fp32, and the result back in x's leading shape.
#pragma once
#include <torch/extension.h>

#include <vector>

// Packed weights in 2 MiB pages where the kernel allows it (linear_bf16.cpp).
torch::Tensor huge_page_empty(at::IntArrayRef shape, const at::TensorOptions& options);

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
