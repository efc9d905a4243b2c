// ridge's CPU kernels as the bindings and the decode plan call them (one extension, several
// sources: each function is defined in the source named beside its group).
#pragma once
#include <torch/extension.h>

#include "plan_shared.h"

#include <map>
#include <string>
#include <vector>

// linear_bf16.cpp, linear_quant.cpp
torch::Tensor pack_vnni(torch::Tensor w);
torch::Tensor unpack_vnni(torch::Tensor packed, int64_t N, int64_t K);
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias);
bool linear_bf16_uses_amx(int64_t K);
bool amx_int8_ready();  // AMX-INT8 tiles usable (linear_quant runs 2+ rows on them)
// prefetch.cpp: the streaming kernels' prefetch policy (linear_call.h) as {key: value}
std::map<std::string, int64_t> prefetch_policy();
std::map<std::string, int64_t> prefetch_preset(const std::string& name);  // "amd", "intel", "cpu"
void set_prefetch_policy(const std::map<std::string, int64_t>& values);  // the keys given; between calls
// "" when the preset ("" for none) and values make a policy, else why not (no throw)
std::string prefetch_error(const std::string& preset, const std::map<std::string, int64_t>& values);
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
// an MoE's routing, greedy or group-limited (DeepSeek): (ids (T, k) int64 best first, weights (T, k) bf16);
// route_topk_into on raw rows (bias: E floats or null)
std::vector<torch::Tensor> route_topk(torch::Tensor x, torch::Tensor router, int64_t top_k, bool softmax, bool norm_topk,
                                      double norm_eps, double scaling, int64_t n_group, int64_t topk_group,
                                      c10::optional<torch::Tensor> bias);
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
torch::Tensor argmax_rows(torch::Tensor logits);
// The same kernels on raw rows, writing into y (no allocation, no dispatcher: the decode plan
// calls these between its matmuls, where a weight stream has just pushed libtorch's code out
// of the caches). x (M, K) and y (M, N) contiguous unless said; bf16 = at::BFloat16.
// (bias: N floats added before the rounding, or null; linear_quant_into's y rows ldy apart, a
// column slice of a wider y)
void linear_quant_into(const at::BFloat16* x, int64_t M, int64_t K, const uint8_t* packed, int64_t fmt, int64_t N,
                       const float* bias, at::BFloat16* y, int64_t ldy);
void linear_bf16_into(const at::BFloat16* x, int64_t M, int64_t K, const at::BFloat16* packed, int64_t N,
                      const float* bias, at::BFloat16* y);
// linear_bf16_grouped / linear_quant_grouped on raw rows: x's rows sorted by expert (counts[e] for expert e), each
// run through its expert's N rows of the stacked weight into the same rows of y (N wide)
void linear_quant_grouped_into(const at::BFloat16* x, const std::vector<int64_t>& counts, int64_t K,
                               const uint8_t* packed, int64_t fmt, int64_t N, at::BFloat16* y);
void linear_bf16_grouped_into(const at::BFloat16* x, const std::vector<int64_t>& counts, int64_t K,
                              const at::BFloat16* packed, int64_t N, at::BFloat16* y);
void rms_norm_into(const at::BFloat16* x, const at::BFloat16* w, at::BFloat16* y, int64_t rows, int64_t n, double eps);
void add_rms_norm_into(const at::BFloat16* x, at::BFloat16* residual, const at::BFloat16* w, at::BFloat16* y,
                       int64_t rows, int64_t n, double eps);
void add_rows_into(at::BFloat16* residual, const at::BFloat16* x, int64_t n);  // residual += x, rounded to bf16
// rope on H heads of D a token, head h of token t at x + t * row_stride + h * head_stride (0: D)
void rope_into(at::BFloat16* x, int64_t T, int64_t H, int64_t D, int64_t row_stride, const int64_t* positions,
               const float* cos, const float* sin, int64_t head_stride = 0);
void silu_mul_into(const at::BFloat16* gate_up, int64_t rows, int64_t I, at::BFloat16* y);
void route_topk_into(const at::BFloat16* x, int64_t T, int64_t K, ridge_shared::RouterRows router, int64_t E, int64_t top_k,
                     bool softmax, bool norm_topk, double norm_eps, double scaling, int64_t n_group, int64_t topk_group,
                     const float* bias, int64_t* ids, at::BFloat16* weights);
// q: B rows of Hq x D, q_stride apart; out (B, Hq, D) contiguous; pools (slots / BS, BS, Hkv, D)
void paged_decode_attention_bf16_into(const at::BFloat16* q, int64_t q_stride, int64_t B, int64_t Hq, int64_t D,
                                      const at::BFloat16* k_pool, const at::BFloat16* v_pool, int64_t BS, int64_t Hkv,
                                      const int64_t* block_tables, int64_t max_blocks, const int64_t* context_lens,
                                      double scale, at::BFloat16* out);
// the same over int8 / fp8 pools with fp16 scales per (slot, KV head, group of D / groups)
void paged_decode_attention_quant_into(const at::BFloat16* q, int64_t q_stride, int64_t B, int64_t Hq, int64_t D,
                                       const uint8_t* k_pool, const uint8_t* v_pool, const at::Half* k_scale,
                                       const at::Half* v_scale, int64_t BS, int64_t Hkv, int64_t groups,
                                       const int64_t* block_tables, int64_t max_blocks, const int64_t* context_lens,
                                       double scale, bool fp8, at::BFloat16* out);
// decode_attention_shared.cpp (latent attention): q (B, H, D) contiguous, one KV head (slots / BS, BS, 1, D) shared
// by every query head, whose first value_dim dims are its value; out (B, H, value_dim)
void paged_decode_attention_shared_into(const at::BFloat16* q, int64_t B, int64_t H, int64_t D, const at::BFloat16* cache,
                                        int64_t BS, const int64_t* block_tables, int64_t max_blocks,
                                        const int64_t* context_lens, double scale, int64_t value_dim, at::BFloat16* out);
// the same over an int8 / fp8 cache with fp16 scales per (slot, group of D / groups)
void paged_decode_attention_shared_quant_into(const at::BFloat16* q, int64_t B, int64_t H, int64_t D, const uint8_t* cache,
                                              const at::Half* scales, int64_t groups, int64_t BS,
                                              const int64_t* block_tables, int64_t max_blocks,
                                              const int64_t* context_lens, double scale, int64_t value_dim, bool fp8,
                                              at::BFloat16* out);
// head_matmul: x[d][h] (K values) at x + d * sxr + h * sxh through head h's (K, N) matrix (bf16 (H, K, N), or
// packed blocks of H * N rows) into y (D, H, N) contiguous
void head_matmul_bf16_into(const at::BFloat16* x, int64_t sxr, int64_t sxh, int64_t D, int64_t H, int64_t K,
                           const at::BFloat16* w, int64_t N, at::BFloat16* y);
void head_matmul_quant_into(const at::BFloat16* x, int64_t sxr, int64_t sxh, int64_t D, int64_t H, int64_t K,
                            const uint8_t* packed, int64_t fmt, int64_t N, at::BFloat16* y);
// decode_layers.cpp
void write_kv_quant_(torch::Tensor pool, torch::Tensor scales, torch::Tensor x, torch::Tensor slots, bool fp8);
void bind_decode_plan(pybind11::module& m);
