// The AVX2 extension's kernels as its bindings and its decode plan call them (one extension,
// several sources: each function is defined in the source named beside its group). The
// tensor entry points check their inputs and call the raw-row ones (*_into), which trust them:
// the decode plan (avx2_plan.cpp) checks once when it is built and once a step.
#pragma once
#include <torch/extension.h>

#include "plan_shared.h"

#include <cstdint>

// avx2_blocks.cpp: y = x @ W^T (+ bias) for a GGUF block format's rows, or blocks of 8 rows
torch::Tensor linear_blocks(torch::Tensor x, torch::Tensor blocks, int64_t ggml_type, c10::optional<torch::Tensor> bias);
torch::Tensor linear_blocks_packed(torch::Tensor x, torch::Tensor blocks, int64_t ggml_type,
                                   c10::optional<torch::Tensor> bias);
bool supports_format(int64_t ggml_type);
// avx2_dense.cpp: a dense bf16 layer on a few rows
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias);
// avx2_ops.cpp: a decode step's other ops
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
void rope_(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin);
void rope_write_kv_(torch::Tensor qkv, int64_t num_heads, int64_t num_kv_heads, torch::Tensor positions,
                    torch::Tensor cos, torch::Tensor sin, torch::Tensor k_pool, torch::Tensor v_pool,
                    torch::Tensor slots);
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale);
torch::Tensor paged_decode_attention_quant(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                           torch::Tensor k_scale, torch::Tensor v_scale, torch::Tensor block_tables,
                                           torch::Tensor context_lens, double scale, bool fp8);
torch::Tensor argmax_rows(torch::Tensor logits);
void apply_token_bitmask_(torch::Tensor logits, torch::Tensor bitmask);
std::vector<torch::Tensor> route_topk(torch::Tensor x, torch::Tensor router, int64_t top_k, bool softmax, bool norm_topk,
                                      double norm_eps, double scaling, int64_t n_group, int64_t topk_group,
                                      c10::optional<torch::Tensor> bias);

namespace ridge_avx2 {

// T: float or at::BFloat16 (each is instantiated for both). Rows are contiguous unless a
// stride is given; y's rows ldy apart (a layer's columns inside a wider output).

// avx2_blocks.cpp: rows x (M, K) through a block format's N rows (packed: blocks of 8 rows),
// the float32 sums plus bias (N floats, or null) rounded once to T
template <class T>
void linear_blocks_into(const T* x, int64_t M, int64_t K, const uint8_t* w, int64_t ggml_type, bool packed, int64_t N,
                        const float* bias, T* y, int64_t ldy);
// the bytes a row of K weights takes in a block format (-1: not a format the kernels take, or
// K not whole blocks)
int64_t block_row_bytes(int64_t ggml_type, int64_t K);
// avx2_dense.cpp: the same for a dense bf16 weight (N, K)
template <class T>
void linear_bf16_into(const T* x, int64_t M, int64_t K, const at::BFloat16* w, int64_t N, const float* bias, T* y,
                      int64_t ldy);
// avx2_ops.cpp
template <class T>
void rms_norm_into(const T* x, const T* w, T* y, int64_t rows, int64_t n, float eps);
template <class T>  // residual += x, then y = RMSNorm(residual)
void add_rms_norm_into(const T* x, T* residual, const T* w, T* y, int64_t rows, int64_t n, float eps);
template <class T>  // (rows, 2I) -> (rows, I)
void silu_mul_into(const T* gate_up, int64_t rows, int64_t I, T* y);
template <class T>  // x (rows, H, D) in place, rows row_stride apart; positions checked by the caller
void rope_into(T* x, int64_t rows, int64_t H, int64_t D, int64_t row_stride, const int64_t* positions, const float* cos,
               const float* sin);
template <class T>  // q (B, Hq, D), rows q_stride apart -> out (B, Hq, D); tables and lengths checked by the caller
void decode_attention_into(const T* q, int64_t q_stride, int64_t B, int64_t Hq, int64_t D, const T* k_cache,
                           const T* v_cache, int64_t BS, int64_t Hkv, const int64_t* tables, int64_t max_blocks,
                           const int64_t* lens, float scale, T* out);
// the jobs decode_attention_into splits B sequences of Hq query heads over Hkv KV heads into (a
// (sequence, KV head) each, its query heads in runs of 8 or more where those are fewer than
// the threads): Avx2Kernels.decode_attention and the decode plan give way to torch's GEMMs
// below the threads where many query heads share a KV head
int64_t decode_attention_jobs(int64_t B, int64_t Hq, int64_t Hkv);
template <class T>  // the same over int8 / e4m3 codes (k, v) and their fp16 scales, `groups` a row
void decode_attention_quant_into(const T* q, int64_t q_stride, int64_t B, int64_t Hq, int64_t D, const uint8_t* k_codes,
                                 const uint8_t* v_codes, const at::Half* k_scales, const at::Half* v_scales,
                                 int64_t groups, bool fp8, int64_t BS, int64_t Hkv, const int64_t* tables,
                                 int64_t max_blocks, const int64_t* lens, float scale, T* out);

// avx2_ops.cpp: an MoE's top-k routing (Router.forward) of bf16 rows against a float32 or bf16
// router (E, K); bias: E floats or null
void route_topk_into(const at::BFloat16* x, int64_t T, int64_t K, ridge_shared::RouterRows router, int64_t E, int64_t top_k,
                     bool softmax, bool norm_topk, double norm_eps, double scaling, int64_t n_group,
                     int64_t topk_group, const float* bias, int64_t* ids, at::BFloat16* weights);
// avx2_ops.cpp: the rest of an MoE's bf16 arithmetic, H and n multiples of 8: the weighted sum
// of each token's k expert outputs (ys sorted by expert, unsort: (token, choice) -> its row),
// a gate per row (y = g y), and out += y
void moe_combine_into(const at::BFloat16* ys, const at::BFloat16* w, const int64_t* unsort, int64_t T, int64_t k,
                      int64_t H, at::BFloat16* out);
void scale_rows_into(at::BFloat16* y, const at::BFloat16* g, int64_t T, int64_t H);
void add_into(at::BFloat16* out, const at::BFloat16* y, int64_t n);
// avx2_ops.cpp: each row's index of its largest value (the first of equal maxima; the first NaN)
template <class T>
void argmax_rows_into(const T* logits, int64_t rows, int64_t V, int64_t* out);

}  // namespace ridge_avx2
