// ridge's CPU kernels as the bindings and the decode plan call them (one extension, several
// sources: each function is defined in the source named beside its group).
#pragma once
#include <torch/extension.h>

#include <vector>

// linear_bf16.cpp, linear_quant.cpp
torch::Tensor pack_vnni(torch::Tensor w);
torch::Tensor unpack_vnni(torch::Tensor packed, int64_t N, int64_t K);
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias);
bool linear_bf16_uses_amx(int64_t K);
bool amx_int8_ready();  // AMX-INT8 tiles usable (linear_quant runs 2+ rows on them)
torch::Tensor linear_bf16_grouped(torch::Tensor x, torch::Tensor packed, int64_t N, std::vector<int64_t> counts);
torch::Tensor linear_quant_grouped(torch::Tensor x, torch::Tensor packed, int64_t fmt, int64_t N,
                                   std::vector<int64_t> counts);
torch::Tensor pack_quant(torch::Tensor blocks, int64_t fmt, int64_t N, int64_t K);
torch::Tensor unpack_quant(torch::Tensor packed, int64_t fmt, int64_t N, int64_t K);
torch::Tensor linear_quant(torch::Tensor x, torch::Tensor packed, int64_t fmt, int64_t N,
                           c10::optional<torch::Tensor> bias);
torch::Tensor head_matmul_quant(torch::Tensor x, torch::Tensor packed, int64_t fmt, int64_t N);
// decode_ops.cpp, decode_attention_quant.cpp
torch::Tensor rms_norm_bf16(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor add_rms_norm_bf16(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps);
void rope_bf16_(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_mul_bf16(torch::Tensor gate_up);
torch::Tensor paged_decode_attention_bf16(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                          torch::Tensor block_tables, torch::Tensor context_lens, double scale);
torch::Tensor paged_decode_attention_quant(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                           torch::Tensor k_scale, torch::Tensor v_scale, torch::Tensor block_tables,
                                           torch::Tensor context_lens, double scale, bool fp8);
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale);
// decode_attention_shared.cpp
torch::Tensor paged_decode_attention_shared(torch::Tensor q, torch::Tensor cache, torch::Tensor block_tables,
                                            torch::Tensor context_lens, double scale, int64_t value_dim);
torch::Tensor paged_decode_attention_shared_quant(torch::Tensor q, torch::Tensor cache, torch::Tensor scales,
                                                  torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                                  int64_t value_dim, bool fp8);
torch::Tensor head_matmul_bf16(torch::Tensor x, torch::Tensor w);
void apply_token_bitmask_(torch::Tensor logits, torch::Tensor bitmask);
// decode_layers.cpp
void write_kv_quant_(torch::Tensor pool, torch::Tensor scales, torch::Tensor x, torch::Tensor slots, bool fp8);
void bind_decode_plan(pybind11::module& m);
