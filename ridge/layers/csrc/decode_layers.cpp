// Every decoder layer of a bf16 decode step in one call (CPU).
//
// A decode step of a 1B model at 4 bits is ~20 ms of weight reads and, run op by op from
// Python, ~1.5 ms of everything else: ten calls a layer, each a few microseconds of
// interpreter and dispatch around a kernel that takes one. A plan built once at load holds
// each layer's packed weights, norms and KV pools; run() walks the layers calling the very
// kernels the Python forward calls (linear_*, rms_norm_bf16, rope_bf16_, the paged decode
// attention, silu_mul_bf16), on the same views and in the same order, the MoE's router through
// the same ATen ops and its sort and combine in loops that round where those ops round, so
// its results are the Python path's, bit for bit
// (tests/models/test_decode_plan.py). DeepSeek's layers too: latent attention absorbed as
// layers/mla.py runs it (with 16+ heads, the shared-KV decode kernels), group-limited and
// noaux_tc routers through the same ATen ops as Router.forward. What the plan does not cover
// (tensor parallelism, a prefill) stays in Python.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

#include "kernels.h"
#include "kv_write.h"
#include "plan_shared.h"
#include "step_parts.h"

namespace {

using ridge_shared::PartTimer;
using Timer = ridge_shared::AddTime;  // the seconds in the linear kernels
using ridge_shared::timed;

// One packed weight: fmt < 0 is bf16 (linear_bf16), else a linear_quant format code.
struct Packed {
  torch::Tensor weight;
  int64_t fmt;
  int64_t n;
};

// A linear layer: one packed weight, or parts side by side (a layer whose shards keep
// different formats) with the layer's bias added after them, as ShardedLinearMethod.join.
struct Lin {
  std::vector<Packed> parts;
  c10::optional<torch::Tensor> bias;
  torch::Tensor bias_f;  // the bias as float32 (what the kernels add before rounding), for into()

  static torch::Tensor call(const Packed& p, const torch::Tensor& x, const c10::optional<torch::Tensor>& bias) {
    return p.fmt < 0 ? linear_bf16(x, p.weight, p.n, bias) : linear_quant(x, p.weight, p.fmt, p.n, bias);
  }

  // one packed part (with or without a bias), or block-format parts without one: what into()
  // runs on raw rows
  bool plain() const {
    if (parts.size() == 1) return true;
    if (bias.has_value()) return false;
    for (const auto& p : parts)
      if (p.fmt < 0) return false;
    return true;
  }

  int64_t width() const {
    int64_t n = 0;
    for (const auto& p : parts) n += p.n;
    return n;
  }

  // y (M, width()) = x (M, K) through the parts side by side (as run's cat): each part writes
  // its columns of y; a layer that is not plain goes through run() on tensors (its join)
  void into(const at::BFloat16* x, int64_t M, int64_t K, at::BFloat16* y) const {
    if (!plain()) {
      const auto opts = torch::TensorOptions().dtype(at::kBFloat16);
      at::from_blob(y, {M, width()}, opts).copy_(run(at::from_blob(const_cast<at::BFloat16*>(x), {M, K}, opts)));
      return;
    }
    const float* b = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;  // one part only (plain)
    if (parts.size() == 1 && parts[0].fmt < 0)
      return linear_bf16_into(x, M, K, parts[0].weight.data_ptr<at::BFloat16>(), parts[0].n, b, y);
    const int64_t ldy = width();
    int64_t col = 0;
    for (const auto& p : parts) {
      linear_quant_into(x, M, K, p.weight.data_ptr<uint8_t>(), p.fmt, p.n, b, y + col, ldy);
      col += p.n;
    }
  }

  torch::Tensor run(const torch::Tensor& x) const {
    if (parts.size() == 1) return call(parts[0], x, bias);
    std::vector<torch::Tensor> ys;
    for (const auto& p : parts) ys.push_back(call(p, x, c10::nullopt));
    auto y = at::cat(ys, -1);
    return bias.has_value() ? y + bias->to(y.scalar_type()) : y;
  }
};

// its outputs a head (N)
static int64_t head_width(const Packed& w) { return w.fmt < 0 ? w.weight.size(2) : w.n; }

// ops.head_matmul on raw rows: x[d][h] (K values) at x + d * sxr + h * sxh through each head's
// matrix, dense bf16 or in a block format -> y (D, H, N) contiguous
static void head_matmul_into(const Packed& w, const at::BFloat16* x, int64_t sxr, int64_t sxh, int64_t D, int64_t H, int64_t K,
                      at::BFloat16* y) {
  if (w.fmt < 0)
    head_matmul_bf16_into(x, sxr, sxh, D, H, K, w.weight.data_ptr<at::BFloat16>(), w.weight.size(2), y);
  else
    head_matmul_quant_into(x, sxr, sxh, D, H, K, w.weight.data_ptr<uint8_t>(), w.fmt, w.n, y);
}

// (weight, format code, rows) as kernels.plan_linear / plan_experts / plan_heads give it
Packed make_packed(const std::tuple<torch::Tensor, int64_t, int64_t>& p) {
  return {std::get<0>(p), std::get<1>(p), std::get<2>(p)};
}

Lin make_lin(const std::vector<std::tuple<torch::Tensor, int64_t, int64_t>>& parts, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(!parts.empty(), "decode plan: a linear layer without weights");
  Lin lin;
  for (const auto& part : parts) lin.parts.push_back(make_packed(part));
  lin.bias = std::move(bias);
  if (lin.bias.has_value() && lin.bias->defined()) lin.bias_f = lin.bias->to(at::kFloat).contiguous();
  return lin;
}

struct Moe {
  torch::Tensor router;  // (E, K) float32 or bf16 (plan_shared.h RouterRows)
  int64_t top_k = 0;
  int64_t n_group = 1, topk_group = 1;  // group-limited routing (DeepSeek; 1, 1: greedy)
  c10::optional<torch::Tensor> bias;  // noaux_tc's e_score_correction_bias (float32)
  bool softmax = true;
  bool norm_topk = false;
  double norm_eps = 0.0;
  double scaling = 1.0;
  Packed gate_up, down;  // stacked experts, rows per expert in n
  bool shared = false;
  Lin shared_gate_up, shared_down;
  c10::optional<torch::Tensor> shared_gate;  // (1, K): sigmoid-gated shared expert (Qwen2-MoE)

  // x's rows sorted by expert (counts[e] of them for expert e, K wide) through expert e's n
  // rows of the stacked weight, into y (n wide)
  static void grouped_into(const Packed& p, const at::BFloat16* x, int64_t K, const std::vector<int64_t>& counts,
                           at::BFloat16* y) {
    if (p.fmt >= 0) return linear_quant_grouped_into(x, counts, K, p.weight.data_ptr<uint8_t>(), p.fmt, p.n, y);
    linear_bf16_grouped_into(x, counts, K, p.weight.data_ptr<at::BFloat16>(), p.n, y);
  }
};

struct Layer {
  torch::Tensor in_norm, post_norm;
  double eps = 0.0;
  Lin qkv, o;
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  double scale = 0.0;  // the attention's score scale
  c10::optional<torch::Tensor> q_norm, k_norm;
  double qk_eps = 0.0;
  torch::Tensor k_pool, v_pool;
  c10::optional<torch::Tensor> k_scale, v_scale;  // an int8 / fp8 pool's scales
  bool fp8 = false;
  // the feed-forward: a dense MLP, or an MoE
  Lin gate_up, down;
  c10::optional<Moe> moe;
  // DeepSeek's latent attention (DeepseekAttention.forward, decode absorbed): qkv holds
  // fused_qkv_a_proj, o o_proj, k_pool the latent pool (also the values)
  bool mla = false;
  int64_t q_width = 0, nope = 0, rope = 0, rank = 0;
  c10::optional<torch::Tensor> q_a_norm;
  c10::optional<Lin> q_b;
  torch::Tensor kv_a_norm;
  Packed w_uk, w_uv_t;  // head_matmul's per-head matrices: fmt < 0 dense bf16 (H, K, N), else packed blocks
  double latent_eps = 0.0;
  bool interleave = false;
};

// write_kv for a bf16 pool: row t of x (T, H, D; rows may be strided, a view into qkv) into
// slot slots[t] of the pool (blocks, block_size, H, D). A copy, as index_copy_, without its
// dispatch (two calls a layer).
// rows t of src (row values each, x_stride apart) into slots[t] of a bf16 pool of num_slots
void write_rows_into(at::BFloat16* dst, int64_t row, int64_t num_slots, const at::BFloat16* src, int64_t x_stride,
                     const int64_t* slots, int64_t T) {
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "decode plan: slot ", slots[t], " out of the pool");
    std::memcpy(dst + slots[t] * row, src + t * x_stride, row * sizeof(at::BFloat16));
  }
}

void write_rows(const torch::Tensor& pool, const torch::Tensor& x, const int64_t* slots, int64_t T) {
  const int64_t row = pool.size(2) * pool.size(3), num_slots = pool.size(0) * pool.size(1);
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2) && x.size(1) * x.size(2) == row,
              "decode plan: K/V rows do not match the pool");
  write_rows_into(pool.data_ptr<at::BFloat16>(), row, num_slots, x.data_ptr<at::BFloat16>(), x.stride(0), slots, T);
}

}  // namespace

void write_kv_quant_(torch::Tensor pool, torch::Tensor scales, torch::Tensor x, torch::Tensor slots, bool fp8) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "write_kv_quant_: (T, H, D) bf16 rows expected");
  TORCH_CHECK(pool.element_size() == 1 && pool.is_contiguous() && pool.dim() == 4 && pool.size(2) == x.size(1) &&
                  pool.size(3) == x.size(2),
              "write_kv_quant_: a contiguous 1-byte (blocks, block_size, H, D) pool expected");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 4 &&
                  scales.size(0) == pool.size(0) && scales.size(1) == pool.size(1) && scales.size(2) == pool.size(2),
              "write_kv_quant_: contiguous fp16 (blocks, block_size, H, groups) scales expected");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == x.size(0),
              "write_kv_quant_: one int64 slot per row");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), G = scales.size(3), gs = D / G;
  TORCH_CHECK(G * gs == D, "write_kv_quant_: groups must divide the head");
  const int64_t num_slots = pool.size(0) * pool.size(1);
  write_kv_quant_into(static_cast<uint8_t*>(pool.data_ptr()), scales.data_ptr<at::Half>(), num_slots, H, D, G,
                      x.data_ptr<at::BFloat16>(), x.stride(0), slots.data_ptr<int64_t>(), T, fp8);
}

class DecodePlan {
 public:
  void add_layer(torch::Tensor in_norm, torch::Tensor post_norm, double eps,
                 std::vector<std::tuple<torch::Tensor, int64_t, int64_t>> qkv, c10::optional<torch::Tensor> qkv_bias,
                 std::vector<std::tuple<torch::Tensor, int64_t, int64_t>> o, c10::optional<torch::Tensor> o_bias,
                 int64_t heads, int64_t kv_heads, int64_t head_dim, double scale, c10::optional<torch::Tensor> q_norm,
                 c10::optional<torch::Tensor> k_norm, double qk_eps, torch::Tensor k_pool, torch::Tensor v_pool,
                 c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale, bool fp8) {
    const bool quantized = k_scale.has_value();
    TORCH_CHECK((quantized ? k_pool.element_size() == 1 && v_scale.has_value() : k_pool.scalar_type() == at::kBFloat16) &&
                    k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.dim() == 4 &&
                    k_pool.size(2) == kv_heads && k_pool.size(3) == head_dim,
                "decode plan: bf16 or 1-byte (blocks, block_size, kv_heads, head_dim) pools expected");
    Layer l = attention_layer(in_norm, post_norm, eps, make_lin(qkv, qkv_bias), make_lin(o, o_bias), heads, kv_heads,
                              head_dim, scale, k_pool, v_pool, k_scale, v_scale, fp8);
    l.q_norm = q_norm;
    l.k_norm = k_norm;
    l.qk_eps = qk_eps;
    layers_.push_back(std::move(l));
    rows_state_ = -1;
  }

  // A DeepSeek layer's latent attention (the norms and the feed-forward as add_layer's).
  void add_mla_layer(torch::Tensor in_norm, torch::Tensor post_norm, double eps,
                     std::vector<std::tuple<torch::Tensor, int64_t, int64_t>> qkv_a, int64_t q_width,
                     c10::optional<torch::Tensor> q_a_norm, std::vector<std::tuple<torch::Tensor, int64_t, int64_t>> q_b,
                     torch::Tensor kv_a_norm, double latent_eps,
                     std::vector<std::tuple<torch::Tensor, int64_t, int64_t>> o, int64_t heads, int64_t nope,
                     int64_t rope, int64_t rank, bool interleave, std::tuple<torch::Tensor, int64_t, int64_t> w_uk,
                     std::tuple<torch::Tensor, int64_t, int64_t> w_uv_t, double scale,
                     torch::Tensor pool, c10::optional<torch::Tensor> scales, bool fp8) {
    TORCH_CHECK(pool.is_contiguous() && pool.dim() == 4 && pool.size(2) == 1 && pool.size(3) == rank + rope &&
                    (scales.has_value() ? pool.element_size() == 1 : pool.scalar_type() == at::kBFloat16),
                "decode plan: one contiguous latent pool (blocks, block_size, 1, rank + rope) expected");
    TORCH_CHECK(q_a_norm.has_value() == !q_b.empty(), "decode plan: q_a_layernorm and q_b_proj go together");
    Layer l = attention_layer(in_norm, post_norm, eps, make_lin(qkv_a, c10::nullopt), make_lin(o, c10::nullopt), heads,
                              1, rank + rope, scale, pool, pool, scales, scales, fp8);
    l.mla = true;
    l.q_width = q_width;
    l.nope = nope;
    l.rope = rope;
    l.rank = rank;
    l.q_a_norm = q_a_norm;
    if (!q_b.empty()) l.q_b = make_lin(q_b, c10::nullopt);
    l.kv_a_norm = kv_a_norm;
    l.latent_eps = latent_eps;
    l.interleave = interleave;
    l.w_uk = make_packed(w_uk);
    l.w_uv_t = make_packed(w_uv_t);
    layers_.push_back(std::move(l));
    rows_state_ = -1;
  }

  void set_mlp(std::vector<std::tuple<torch::Tensor, int64_t, int64_t>> gate_up, c10::optional<torch::Tensor> gate_up_bias,
               std::vector<std::tuple<torch::Tensor, int64_t, int64_t>> down, c10::optional<torch::Tensor> down_bias) {
    TORCH_CHECK(!layers_.empty(), "decode plan: set_mlp before add_layer");
    layers_.back().gate_up = make_lin(gate_up, gate_up_bias);
    layers_.back().down = make_lin(down, down_bias);
    rows_state_ = -1;
  }

  // the router as Router.route_args gives it, then the stacked experts
  void set_moe(torch::Tensor router, int64_t top_k, bool softmax, bool norm_topk, double norm_eps, double scaling,
               int64_t n_group, int64_t topk_group, c10::optional<torch::Tensor> bias,
               std::tuple<torch::Tensor, int64_t, int64_t> gate_up, std::tuple<torch::Tensor, int64_t, int64_t> down) {
    TORCH_CHECK(!layers_.empty(), "decode plan: set_moe before add_layer");
    TORCH_CHECK((router.scalar_type() == at::kFloat || router.scalar_type() == at::kBFloat16) && router.is_contiguous() &&
                    router.dim() == 2 && router.size(1) == layers_.back().post_norm.numel(),
                "decode plan: a contiguous float32 or bf16 (experts, hidden) router expected");
    Moe m;
    m.router = router;
    m.top_k = top_k;
    m.softmax = softmax;
    m.norm_topk = norm_topk;
    m.norm_eps = norm_eps;
    m.scaling = scaling;
    m.n_group = n_group;
    m.topk_group = topk_group;
    TORCH_CHECK(n_group >= 1 && router.size(0) % n_group == 0 && topk_group >= 1 && topk_group <= n_group,
                "decode plan: experts must split into groups");
    TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                                      bias->numel() == router.size(0)),
                "decode plan: a float32 router bias of one value an expert expected");
    m.bias = bias;
    m.gate_up = make_packed(gate_up);
    m.down = make_packed(down);
    layers_.back().moe = std::move(m);
    rows_state_ = -1;
  }

  void set_shared_expert(std::vector<std::tuple<torch::Tensor, int64_t, int64_t>> gate_up,
                         std::vector<std::tuple<torch::Tensor, int64_t, int64_t>> down,
                         c10::optional<torch::Tensor> gate) {
    TORCH_CHECK(!layers_.empty() && layers_.back().moe.has_value(), "decode plan: set_shared_expert before set_moe");
    Moe& m = *layers_.back().moe;
    m.shared = true;
    m.shared_gate_up = make_lin(gate_up, c10::nullopt);
    m.shared_down = make_lin(down, c10::nullopt);
    m.shared_gate = gate;
  }

  // LlamaForCausalLM.compute_logits' final norm and lm_head, and the embedding table the next
  // pass's rows come from: what run_greedy adds to run
  void set_head(torch::Tensor norm, double eps, std::vector<std::tuple<torch::Tensor, int64_t, int64_t>> lm_head,
                c10::optional<torch::Tensor> bias, torch::Tensor embed) {
    TORCH_CHECK(norm.scalar_type() == at::kBFloat16 && norm.is_contiguous() && embed.scalar_type() == at::kBFloat16 &&
                    embed.is_contiguous() && embed.dim() == 2 && embed.size(1) == norm.numel(),
                "decode plan: a bf16 final norm and a contiguous bf16 (vocab, hidden) embedding expected");
    head_norm_ = norm;
    head_eps_ = eps;
    head_ = make_lin(lm_head, bias);
    embed_ = embed;
  }

  bool has_head() const { return embed_.defined(); }

  // `steps` greedy decode passes over the same rows: each pass is run() on h, then the final
  // norm, the lm_head and argmax_rows (what compute_logits and the sampler's greedy argmax
  // call, on the same rows: the same tokens), and the next pass's h is the embedding's rows
  // of those tokens, one position on (its slot from the row's block table, one more
  // token to attend). positions, slots and context_lens are advanced in place; the block
  // tables must hold every pass's position. Returns (T, steps) tokens, the seconds in the
  // linear kernels (the lm_head's too) and the last pass's experts per layer.
  std::tuple<torch::Tensor, double, std::vector<int64_t>> run_greedy(torch::Tensor h, torch::Tensor slots,
                                                                       torch::Tensor block_tables,
                                                                       torch::Tensor context_lens,
                                                                       torch::Tensor positions, torch::Tensor cos,
                                                                       torch::Tensor sin, int64_t steps) {
    using bf16 = at::BFloat16;
    TORCH_CHECK(has_head() && !layers_.empty() && steps >= 1, "decode plan: run_greedy needs set_head and layers");
    TORCH_CHECK(h.scalar_type() == at::kBFloat16 && h.is_contiguous() && h.dim() == 2 && h.size(1) == embed_.size(1),
                "decode plan: (T, hidden) bf16 h");
    const int64_t T = h.size(0), hidden = h.size(1), V = head_.width(), vocab = embed_.size(0);
    const int64_t BS = layers_[0].k_pool.size(1), width = block_tables.size(1);
    auto tokens = torch::empty({T, steps}, torch::TensorOptions().dtype(at::kLong));
    auto x = torch::empty({T, hidden}, h.options());
    auto logits = torch::empty({T, V}, h.options());
    int64_t* tp = tokens.data_ptr<int64_t>();
    double matmul_s = 0.0;
    std::vector<int64_t> touched;
    for (int64_t s = 0; s < steps; ++s) {
      if (s) {  // run() checked the tensors' kinds and shapes on the pass before
        PartTimer pt(ridge_shared::PART_SAMPLING);
        ridge_shared::next_greedy_pass(h.data_ptr<bf16>(), T, hidden, embed_.data_ptr<bf16>(), vocab, tp + s - 1, steps,
                                      positions.data_ptr<int64_t>(), slots.data_ptr<int64_t>(),
                                      context_lens.data_ptr<int64_t>(), block_tables.data_ptr<int64_t>(), width, BS);
      }
      auto [mm, used] = run(h, slots, block_tables, context_lens, positions, cos, sin);
      matmul_s += mm;
      touched = std::move(used);
      {
        PartTimer pt(ridge_shared::PART_NORMS);
        rms_norm_into(h.data_ptr<bf16>(), head_norm_.data_ptr<bf16>(), x.data_ptr<bf16>(), T, hidden, head_eps_);
      }
      {
        Timer t(matmul_s);
        head_.into(x.data_ptr<bf16>(), T, hidden, logits.data_ptr<bf16>());
      }
      PartTimer pt(ridge_shared::PART_SAMPLING);
      const auto best = argmax_rows(logits);
      const int64_t* bp = best.data_ptr<int64_t>();
      for (int64_t t = 0; t < T; ++t) tp[t * steps + s] = bp[t];
    }
    return {tokens, matmul_s, touched};
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  bool runs_on_rows() { return rows_path(); }

  // h: (T, hidden) bf16, the residual stream, updated in place. Returns the seconds spent in
  // the linear kernels and, per layer, the distinct experts its MoE ran (-1: a dense layer).
  std::tuple<double, std::vector<int64_t>> run(torch::Tensor h, torch::Tensor slots, torch::Tensor block_tables,
                                                torch::Tensor context_lens, torch::Tensor positions, torch::Tensor cos,
                                                torch::Tensor sin) {
    TORCH_CHECK(h.scalar_type() == at::kBFloat16 && h.is_contiguous() && h.dim() == 2, "decode plan: (T, hidden) bf16 h");
    const int64_t T = h.size(0), hidden = h.size(1);
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == T,
                "decode plan: one int64 slot per token");
    TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == T,
                "decode plan: one int64 position per token");
    TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && block_tables.dim() == 2 &&
                    block_tables.size(0) == T && context_lens.scalar_type() == at::kLong &&
                    context_lens.is_contiguous() && context_lens.numel() == T,
                "decode plan: (T, blocks) int64 block tables and T int64 context lengths");
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                    sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes(),
                "decode plan: float32 (positions, dim) rotary tables");
    ridge_shared::check_step("decode plan", T, positions.data_ptr<int64_t>(), cos.size(0), slots.data_ptr<int64_t>(),
                             context_lens.data_ptr<int64_t>(), block_tables.data_ptr<int64_t>(), block_tables.size(1),
                             layers_);
    if (rows_path()) return run_rows(h, slots, block_tables, context_lens, positions, cos, sin);
    double matmul_s = 0.0;
    std::vector<int64_t> touched;
    touched.reserve(layers_.size());
    const int64_t* sp = slots.data_ptr<int64_t>();
    torch::Tensor ffn_out;  // the last layer's feed-forward output, not yet in h
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      // attention (LlamaAttention.forward); the previous layer's residual add fused into its
      // norm (add_rms_norm_bf16 adds as h.add_ rounds: one bf16 rounding of the fp32 sum)
      auto x = timed(ridge_shared::PART_NORMS, [&] {
        return i == 0 ? rms_norm_bf16(h, l.in_norm, l.eps) : add_rms_norm_bf16(ffn_out, h, l.in_norm, l.eps);
      });
      if (l.mla) {  // run_mla_rows, into a tensor (its buffers sized for x's rows)
        ensure_rows(T, hidden);
        auto attn_out = at::empty_like(x);
        run_mla_rows(l, x.data_ptr<at::BFloat16>(), T, hidden, sp, block_tables.data_ptr<int64_t>(),
                     block_tables.size(1), context_lens.data_ptr<int64_t>(), positions.data_ptr<int64_t>(),
                     cos.data_ptr<float>(), sin.data_ptr<float>(), attn_out.data_ptr<at::BFloat16>(), matmul_s);
        auto y = timed(ridge_shared::PART_NORMS, [&] { return add_rms_norm_bf16(attn_out, h, l.post_norm, l.eps); });
        ffn_out = run_ffn(l, y, matmul_s, touched);
        continue;
      }
      torch::Tensor qkv;
      {
        Timer t(matmul_s);
        qkv = l.qkv.run(x);
      }
      const int64_t q_size = l.heads * l.head_dim, kv_size = l.kv_heads * l.head_dim;
      auto v = qkv.slice(1, q_size + kv_size).view({T, l.kv_heads, l.head_dim});
      torch::Tensor q, k;
      std::optional<PartTimer> rope_kv;
      if (l.q_norm.has_value()) {
        {
          PartTimer pt(ridge_shared::PART_NORMS);
          q = rms_norm_bf16(qkv.slice(1, 0, q_size).view({T, l.heads, l.head_dim}), *l.q_norm, l.qk_eps);
          k = rms_norm_bf16(qkv.slice(1, q_size, q_size + kv_size).view({T, l.kv_heads, l.head_dim}), *l.k_norm,
                            l.qk_eps);
        }
        rope_kv.emplace(ridge_shared::PART_ROPE_KV);
        rope_bf16_(q, positions, cos, sin);
        rope_bf16_(k, positions, cos, sin);
      } else {
        rope_kv.emplace(ridge_shared::PART_ROPE_KV);
        auto qk = qkv.slice(1, 0, q_size + kv_size).view({T, -1, l.head_dim});
        rope_bf16_(qk, positions, cos, sin);
        q = qk.slice(1, 0, l.heads);
        k = qk.slice(1, l.heads);
      }
      // write_kv, then the decode kernel over the pools
      torch::Tensor attn;
      if (l.k_scale.has_value()) {
        write_kv_quant_(l.k_pool, *l.k_scale, k, slots, l.fp8);
        write_kv_quant_(l.v_pool, *l.v_scale, v, slots, l.fp8);
        rope_kv.reset();
        PartTimer pt(ridge_shared::PART_ATTENTION);
        attn = paged_decode_attention_quant(q, l.k_pool, l.v_pool, *l.k_scale, *l.v_scale, block_tables, context_lens,
                                            l.scale, l.fp8);
      } else {
        write_rows(l.k_pool, k, sp, T);
        write_rows(l.v_pool, v, sp, T);
        rope_kv.reset();
        PartTimer pt(ridge_shared::PART_ATTENTION);
        attn = paged_decode_attention_bf16(q, l.k_pool, l.v_pool, block_tables, context_lens, l.scale);
      }
      torch::Tensor attn_out;
      {
        Timer t(matmul_s);
        attn_out = l.o.run(attn.flatten(1));
      }
      auto y = timed(ridge_shared::PART_NORMS, [&] { return add_rms_norm_bf16(attn_out, h, l.post_norm, l.eps); });
      ffn_out = run_ffn(l, y, matmul_s, touched);
    }
    PartTimer pt(ridge_shared::PART_NORMS);  // (the residual adds are timed with the norms)
    if (ffn_out.defined()) h.add_(ffn_out);
    return {matmul_s, touched};
  }

  // The step above on raw rows where every layer allows it (rows_path): the same kernels in
  // the same order through their *_into entry points, into buffers the plan keeps, so nothing
  // between two matmuls allocates or goes through ATen's dispatcher. A matmul streams megabytes
  // of weights, which pushes that code out of the caches: on the 2-core Xeon the first tensor
  // op after a (2048 x 5632) Q4_K matmul took 13-28 us instead of 2-3, four times a layer.
  std::tuple<double, std::vector<int64_t>> run_rows(const torch::Tensor& h, const torch::Tensor& slots,
                                                     const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                                                     const torch::Tensor& positions, const torch::Tensor& cos,
                                                     const torch::Tensor& sin) {
    using bf16 = at::BFloat16;
    const int64_t T = h.size(0), hidden = h.size(1);  // the inputs as run() checked them
    ensure_rows(T, hidden);
    bf16* hp = h.data_ptr<bf16>();
    bf16* x = ws_x_.data_ptr<bf16>();
    bf16 *o = ws_o_.data_ptr<bf16>(), *gu = ws_gu_.data_ptr<bf16>(), *act = ws_act_.data_ptr<bf16>();
    bf16* ffn = ws_ffn_.data_ptr<bf16>();
    const int64_t* sp = slots.data_ptr<int64_t>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* tables = block_tables.data_ptr<int64_t>();
    const int64_t* lens = context_lens.data_ptr<int64_t>();
    const float* cp = cos.data_ptr<float>();
    const float* snp = sin.data_ptr<float>();
    double matmul_s = 0.0;
    std::vector<int64_t> touched(layers_.size(), -1);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      const bf16* in_norm = l.in_norm.data_ptr<bf16>();
      {
        PartTimer pt(ridge_shared::PART_NORMS);
        if (i == 0)
          rms_norm_into(hp, in_norm, x, T, hidden, l.eps);
        else
          add_rms_norm_into(ffn, hp, in_norm, x, T, hidden, l.eps);
      }
      if (l.mla)
        run_mla_rows(l, x, T, hidden, sp, tables, block_tables.size(1), lens, pos, cp, snp, o, matmul_s);
      else
        run_attention_rows(l, x, T, hidden, sp, tables, block_tables.size(1), lens, pos, cp, snp, o, matmul_s);
      {
        PartTimer pt(ridge_shared::PART_NORMS);
        add_rms_norm_into(o, hp, l.post_norm.data_ptr<bf16>(), x, T, hidden, l.eps);
      }
      if (l.moe.has_value()) {
        run_moe_rows(*l.moe, x, T, hidden, ffn, matmul_s, touched[i]);
        continue;
      }
      const int64_t I = l.gate_up.width() / 2;
      {
        Timer t(matmul_s);
        l.gate_up.into(x, T, hidden, gu);
      }
      {
        PartTimer pt(ridge_shared::PART_ACTIVATION);
        silu_mul_into(gu, T, I, act);
      }
      {
        Timer t(matmul_s);
        l.down.into(act, T, I, ffn);
      }
    }
    PartTimer pt(ridge_shared::PART_NORMS);  // (the residual adds are timed with the norms)
    add_rows_into(hp, ffn, T * hidden);  // the last layer's feed-forward into h (h.add_'s rounding)
    return {matmul_s, touched};
  }

 private:
  // A Llama attention on raw rows: x (T, hidden) -> out (T, hidden) through o_proj
  void run_attention_rows(const Layer& l, const at::BFloat16* x, int64_t T, int64_t hidden, const int64_t* sp,
                          const int64_t* tables, int64_t max_blocks, const int64_t* lens, const int64_t* pos,
                          const float* cp, const float* snp, at::BFloat16* o, double& matmul_s) {
    using bf16 = at::BFloat16;
    bf16 *qkv = ws_qkv_.data_ptr<bf16>(), *attn = ws_attn_.data_ptr<bf16>();
    const int64_t D = l.head_dim, q_size = l.heads * D, kv_size = l.kv_heads * D, qkv_n = q_size + 2 * kv_size;
    {
      Timer t(matmul_s);
      l.qkv.into(x, T, hidden, qkv);
    }
    if (l.q_norm.has_value()) {  // each head's q and k normed in place (rms_row reads a row before writing it)
      PartTimer pt(ridge_shared::PART_NORMS);
      const bf16* qn = l.q_norm->data_ptr<bf16>();
      const bf16* kn = l.k_norm->data_ptr<bf16>();
      for (int64_t t = 0; t < T; ++t) {
        bf16* row = qkv + t * qkv_n;
        rms_norm_into(row, qn, row, l.heads, D, l.qk_eps);
        rms_norm_into(row + q_size, kn, row + q_size, l.kv_heads, D, l.qk_eps);
      }
    }
    const int64_t num_slots = l.k_pool.size(0) * l.k_pool.size(1), BS = l.k_pool.size(1);
    const bool quant = l.k_scale.has_value();  // an int8 / fp8 pool: write_kv_quant_, the quant kernel
    const int64_t groups = quant ? l.k_scale->size(-1) : 0;
    {
      PartTimer pt(ridge_shared::PART_ROPE_KV);
      rope_into(qkv, T, l.heads + l.kv_heads, D, qkv_n, pos, cp, snp);
      if (quant) {
        write_kv_quant_into(static_cast<uint8_t*>(l.k_pool.data_ptr()), l.k_scale->data_ptr<at::Half>(), num_slots,
                            l.kv_heads, D, groups, qkv + q_size, qkv_n, sp, T, l.fp8);
        write_kv_quant_into(static_cast<uint8_t*>(l.v_pool.data_ptr()), l.v_scale->data_ptr<at::Half>(), num_slots,
                            l.kv_heads, D, groups, qkv + q_size + kv_size, qkv_n, sp, T, l.fp8);
      } else {
        write_rows_into(l.k_pool.data_ptr<bf16>(), kv_size, num_slots, qkv + q_size, qkv_n, sp, T);
        write_rows_into(l.v_pool.data_ptr<bf16>(), kv_size, num_slots, qkv + q_size + kv_size, qkv_n, sp, T);
      }
    }
    {
      PartTimer pt(ridge_shared::PART_ATTENTION);
      if (quant)
        paged_decode_attention_quant_into(qkv, qkv_n, T, l.heads, D, static_cast<const uint8_t*>(l.k_pool.data_ptr()),
                                          static_cast<const uint8_t*>(l.v_pool.data_ptr()),
                                          l.k_scale->data_ptr<at::Half>(), l.v_scale->data_ptr<at::Half>(), BS,
                                          l.kv_heads, groups, tables, max_blocks, lens, l.scale, l.fp8, attn);
      else
        paged_decode_attention_bf16_into(qkv, qkv_n, T, l.heads, D, l.k_pool.data_ptr<bf16>(),
                                         l.v_pool.data_ptr<bf16>(), BS, l.kv_heads, tables, max_blocks, lens, l.scale,
                                         attn);
    }
    Timer t(matmul_s);
    l.o.into(attn, T, q_size, o);
  }

  // DeepseekAttention.forward and layers/mla.py's absorbed decode, op for op, on raw rows (run
  // and run_rows both take it): x (T, hidden) -> out (T, hidden) through o_proj
  void run_mla_rows(const Layer& l, const at::BFloat16* x, int64_t T, int64_t hidden, const int64_t* sp,
                    const int64_t* tables, int64_t max_blocks, const int64_t* lens, const int64_t* pos, const float* cp,
                    const float* snp, at::BFloat16* out, double& matmul_s) {
    using bf16 = at::BFloat16;
    const int64_t H = l.heads, QH = l.nope + l.rope, E = l.rank + l.rope, yw = l.qkv.width();
    bf16 *y = ws_qkv_.data_ptr<bf16>(), *entry = ws_mla_entry_.data_ptr<bf16>();
    bf16 *query = ws_mla_query_.data_ptr<bf16>(), *lat = ws_mla_latent_.data_ptr<bf16>();
    bf16* attn = ws_attn_.data_ptr<bf16>();
    {
      Timer t(matmul_s);
      l.qkv.into(x, T, hidden, y);  // (T, q | latent | rotary key)
    }
    const bf16* q = y;  // (T, H, nope + rope) rows qs apart
    int64_t qs = yw;
    if (l.q_b.has_value()) {
      bf16 *qa = ws_mla_qa_.data_ptr<bf16>(), *qb = ws_mla_q_.data_ptr<bf16>();
      const bf16* w = l.q_a_norm->data_ptr<bf16>();
      {
        PartTimer pt(ridge_shared::PART_NORMS);
        for (int64_t t = 0; t < T; ++t) rms_norm_into(y + t * yw, w, qa + t * l.q_width, 1, l.q_width, l.latent_eps);
      }
      {
        Timer t(matmul_s);
        l.q_b->into(qa, T, l.q_width, qb);
      }
      q = qb;
      qs = l.q_b->width();
    }
    // the cache entry (the normed latent, the rotary key) and each head's rotary query after
    // its latent query's place, both rotated (the latent's norm timed with the rotations)
    std::optional<PartTimer> rope_kv(std::in_place, ridge_shared::PART_ROPE_KV);
    const bf16* kv_norm = l.kv_a_norm.data_ptr<bf16>();
    for (int64_t t = 0; t < T; ++t) {
      const bf16* kv_a = y + t * yw + l.q_width;
      rms_norm_into(kv_a, kv_norm, entry + t * E, 1, l.rank, l.latent_eps);
      ridge_shared::place_rope(kv_a + l.rank, entry + t * E + l.rank, l.rope, l.interleave);
      for (int64_t h = 0; h < H; ++h)
        ridge_shared::place_rope(q + t * qs + h * QH + l.nope, query + (t * H + h) * E + l.rank, l.rope, l.interleave);
    }
    rope_into(query + l.rank, T, H, l.rope, H * E, pos, cp, snp, E);
    rope_into(entry + l.rank, T, 1, l.rope, E, pos, cp, snp);
    const int64_t num_slots = l.k_pool.size(0) * l.k_pool.size(1), BS = l.k_pool.size(1);
    const int64_t groups = l.k_scale.has_value() ? l.k_scale->size(-1) : 0;
    if (l.k_scale.has_value())
      write_kv_quant_into(static_cast<uint8_t*>(l.k_pool.data_ptr()), l.k_scale->data_ptr<at::Half>(), num_slots, 1, E,
                          groups, entry, E, sp, T, l.fp8);
    else
      write_rows_into(l.k_pool.data_ptr<bf16>(), E, num_slots, entry, E, sp, T);
    rope_kv.reset();
    {
      Timer t(matmul_s);
      head_matmul_into(l.w_uk, q, qs, QH, T, H, l.nope, lat);  // the latent queries (T, H, rank)
    }
    std::optional<PartTimer> attention(std::in_place, ridge_shared::PART_ATTENTION);
    for (int64_t r = 0; r < T * H; ++r) std::memcpy(query + r * E, lat + r * l.rank, l.rank * sizeof(bf16));
    if (l.k_scale.has_value())
      paged_decode_attention_shared_quant_into(query, T, H, E, static_cast<const uint8_t*>(l.k_pool.data_ptr()),
                                               l.k_scale->data_ptr<at::Half>(), groups, BS, tables, max_blocks, lens,
                                               l.scale, l.rank, l.fp8, lat);
    else
      paged_decode_attention_shared_into(query, T, H, E, l.k_pool.data_ptr<bf16>(), BS, tables, max_blocks, lens, l.scale,
                                         l.rank, lat);
    attention.reset();
    Timer t(matmul_s);
    head_matmul_into(l.w_uv_t, lat, H * l.rank, l.rank, T, H, l.rank, attn);  // (T, H, v)
    l.o.into(attn, T, H * head_width(l.w_uv_t), out);
  }

  // an int8 / fp8 pool's scales as paged_decode_attention_quant takes them (or a bf16 pool)
  static bool quant_pools_fit(const Layer& l) {
    if (!l.k_scale.has_value()) return true;
    const int64_t D = l.head_dim, groups = l.k_scale->size(-1);
    return l.k_scale->dim() == 4 && l.v_scale->size(-1) == groups && groups <= 64 && D % groups == 0 &&
           (D / groups) % 16 == 0 && l.k_pool.numel() / 4 < (int64_t{1} << 31);
  }

  // Every layer a Llama attention over bf16, int8 or fp8 pools (head_dim a multiple of 16 up
  // to 256; q/k norms and biases allowed) or a latent attention, and a dense MLP or an MoE:
  // run_rows covers it
  bool rows_path() {
    if (rows_state_ < 0) {
      rows_state_ = !layers_.empty();
      for (const Layer& l : layers_) {
        const bool attention_fits = l.mla ? mla_fits(l)
                                          : l.head_dim % 16 == 0 && l.head_dim <= 256 &&
                                                l.qkv.width() == (l.heads + 2 * l.kv_heads) * l.head_dim &&
                                                quant_pools_fit(l);
        const bool ffn_fits = l.moe.has_value() ? moe_fits(*l.moe, l.in_norm.numel())
                                                : l.gate_up.width() % 2 == 0;
        if (!attention_fits || !ffn_fits) rows_state_ = 0;
      }
    }
    return rows_state_ == 1;
  }

  // a latent attention run_mla_rows takes: per-head matrices of whole vectors, and a latent
  // pool whose scale groups the shared-KV kernels read (what those kernels require anyway)
  static bool mla_fits(const Layer& l) {
    const int64_t E = l.rank + l.rope;
    const auto dense_fits = [](const Packed& w) { return w.fmt >= 0 || (w.weight.dim() == 3 && w.weight.is_contiguous()); };
    bool fits = l.rope % 2 == 0 && l.rank % 16 == 0 && head_width(l.w_uk) == l.rank && head_width(l.w_uv_t) % 16 == 0 &&
                dense_fits(l.w_uk) && dense_fits(l.w_uv_t) && l.qkv.width() == l.q_width + E &&
                (!l.q_b.has_value() || l.q_b->width() == l.heads * (l.nope + l.rope)) &&
                (l.q_b.has_value() || l.q_width == l.heads * (l.nope + l.rope));
    if (l.k_scale.has_value()) {
      const int64_t groups = l.k_scale->size(-1);
      fits = fits && l.k_scale->dim() == 4 && groups >= 1 && E % groups == 0 && (E / groups) % 16 == 0;
    }
    return fits;
  }

  // an MoE run_moe_rows takes: its output a multiple of 16 wide (combine_into)
  static bool moe_fits(const Moe& m, int64_t hidden) {
    return hidden % 16 == 0 && m.down.n == hidden && m.gate_up.n % 2 == 0 &&
           (!m.shared || m.shared_gate_up.width() % 2 == 0);
  }

  // run_rows's buffers: rows for at least T tokens (grown, never shrunk), widths the largest any
  // layer needs (an MoE's: T top_k rows, one per token and choice)
  void ensure_rows(int64_t T, int64_t hidden) {
    if (T <= ws_rows_ && hidden == ws_hidden_) return;
    int64_t qkv_n = 0, attn_n = 0, gu_n = 0, top_k = 0, moe_gu_n = 0, qa_n = 0, q_n = 0, entry_n = 0, latent_n = 0;
    for (const Layer& l : layers_) {
      qkv_n = std::max(qkv_n, l.qkv.width());
      attn_n = std::max(attn_n, l.heads * l.head_dim);
      if (l.mla) {
        attn_n = std::max(attn_n, l.heads * head_width(l.w_uv_t));
        if (l.q_b.has_value()) qa_n = std::max(qa_n, l.q_width), q_n = std::max(q_n, l.q_b->width());
        entry_n = std::max(entry_n, l.rank + l.rope);
        latent_n = std::max(latent_n, l.heads * l.rank);
      }
      gu_n = std::max(gu_n, l.gate_up.width());
      if (l.moe.has_value()) {
        top_k = std::max(top_k, l.moe->top_k);
        moe_gu_n = std::max(moe_gu_n, l.moe->gate_up.n);
        if (l.moe->shared) gu_n = std::max(gu_n, l.moe->shared_gate_up.width());
      }
    }
    const auto opts = torch::TensorOptions().dtype(at::kBFloat16);
    ws_x_ = torch::empty({T, hidden}, opts);
    ws_qkv_ = torch::empty({T, qkv_n}, opts);
    ws_attn_ = torch::empty({T, attn_n}, opts);
    ws_o_ = torch::empty({T, hidden}, opts);
    ws_gu_ = torch::empty({T, gu_n}, opts);
    ws_act_ = torch::empty({T, gu_n / 2}, opts);
    ws_ffn_ = torch::empty({T, hidden}, opts);
    ws_moe_x_ = torch::empty({T * top_k, hidden}, opts);
    ws_moe_gu_ = torch::empty({T * top_k, moe_gu_n}, opts);
    ws_moe_act_ = torch::empty({T * top_k, moe_gu_n / 2}, opts);
    ws_moe_ys_ = torch::empty({T * top_k, hidden}, opts);
    ws_mla_qa_ = torch::empty({T, qa_n}, opts);
    ws_mla_q_ = torch::empty({T, q_n}, opts);
    ws_mla_entry_ = torch::empty({T, entry_n}, opts);
    ws_mla_query_ = torch::empty({T, attn_n}, opts);  // (T, H, rank + rope): attn_n covers it (head_dim = rank + rope)
    ws_mla_latent_ = torch::empty({T, latent_n}, opts);
    ws_rows_ = T;
    ws_hidden_ = hidden;
  }

  int rows_state_ = -1;  // rows_path(): -1 not yet asked (layers may still be added), then 0 or 1
  int64_t ws_rows_ = 0, ws_hidden_ = 0;
  torch::Tensor ws_x_, ws_qkv_, ws_attn_, ws_o_, ws_gu_, ws_act_, ws_ffn_;
  torch::Tensor ws_moe_x_, ws_moe_gu_, ws_moe_act_, ws_moe_ys_;  // an MoE's rows, sorted by expert
  torch::Tensor ws_mla_qa_, ws_mla_q_, ws_mla_entry_, ws_mla_query_, ws_mla_latent_;  // a latent attention's
  std::vector<int64_t> moe_ids_, moe_counts_, moe_order_, moe_unsort_;  // routing's and sort_by_expert's, kept
  std::vector<at::BFloat16> moe_weights_;

  // What every layer's attention holds: its norms, projections in and out, heads and pools
  static Layer attention_layer(torch::Tensor in_norm, torch::Tensor post_norm, double eps, Lin in, Lin out,
                               int64_t heads, int64_t kv_heads, int64_t head_dim, double scale, torch::Tensor k_pool,
                               torch::Tensor v_pool,
                               c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale, bool fp8) {
    Layer l;
    l.in_norm = std::move(in_norm);
    l.post_norm = std::move(post_norm);
    l.eps = eps;
    l.qkv = std::move(in);
    l.o = std::move(out);
    l.heads = heads;
    l.kv_heads = kv_heads;
    l.head_dim = head_dim;
    l.scale = scale;
    l.k_pool = std::move(k_pool);
    l.v_pool = std::move(v_pool);
    l.k_scale = std::move(k_scale);
    l.v_scale = std::move(v_scale);
    l.fp8 = fp8;
    return l;
  }

  // The feed-forward of a layer (LlamaMLP.forward or SparseMoE.forward) on y
  torch::Tensor run_ffn(const Layer& l, const torch::Tensor& y, double& matmul_s, std::vector<int64_t>& touched) {
    if (l.moe.has_value()) {  // run_moe_rows, into a tensor (its buffers sized for y's rows)
      const auto x = y.contiguous();
      const int64_t T = x.size(0), H = x.size(1);
      ensure_rows(T, H);
      auto out = at::empty({T, H}, x.options());
      int64_t used = 0;
      run_moe_rows(*l.moe, x.data_ptr<at::BFloat16>(), T, H, out.data_ptr<at::BFloat16>(), matmul_s, used);
      touched.push_back(used);
      return out;
    }
    torch::Tensor out;
    {
      Timer t(matmul_s);
      out = l.gate_up.run(y);
    }
    auto act = timed(ridge_shared::PART_ACTIVATION, [&] { return silu_mul_bf16(out); });
    {
      Timer t(matmul_s);
      out = l.down.run(act);
    }
    touched.push_back(-1);
    return out;
  }

  // SparseMoE.forward on raw rows: x (T, H) -> out (T, H). Routing by route_topk_into (greedy or
  // group-limited, as CpuKernels.route_topk), the rest into the plan's buffers (ensure_rows for T
  // rows), the same kernels and roundings as the Python forward, in its order
  void run_moe_rows(const Moe& m, const at::BFloat16* x, int64_t T, int64_t H, at::BFloat16* out, double& matmul_s,
                    int64_t& used) {
    using bf16 = at::BFloat16;
    TORCH_CHECK(H % 16 == 0, "decode plan: the MoE's output width must be a multiple of 16");
    const int64_t E = m.router.size(0), k = m.top_k, pairs = T * k, I = m.gate_up.n / 2;
    moe_ids_.resize(pairs);
    moe_weights_.resize(pairs);
    std::optional<PartTimer> routing(std::in_place, ridge_shared::PART_ROUTING);
    route_topk_into(x, T, H, ridge_shared::RouterRows::of(m.router), E, k, m.softmax, m.norm_topk, m.norm_eps, m.scaling, m.n_group,
                    m.topk_group, m.bias.has_value() ? m.bias->data_ptr<float>() : nullptr, moe_ids_.data(),
                    moe_weights_.data());
    const bf16* weights = moe_weights_.data();
    used = ridge_shared::sort_by_expert(moe_ids_.data(), pairs, E, moe_counts_, moe_order_, moe_unsort_);
    bf16 *rows = ws_moe_x_.data_ptr<bf16>(), *gu = ws_moe_gu_.data_ptr<bf16>();
    bf16 *act = ws_moe_act_.data_ptr<bf16>(), *ys = ws_moe_ys_.data_ptr<bf16>();
    for (int64_t j = 0; j < pairs; ++j) std::memcpy(rows + j * H, x + (moe_order_[j] / k) * H, H * sizeof(bf16));
    routing.reset();
    {
      Timer t(matmul_s);
      Moe::grouped_into(m.gate_up, rows, H, moe_counts_, gu);
    }
    {
      PartTimer pt(ridge_shared::PART_ACTIVATION);
      silu_mul_into(gu, pairs, I, act);
    }
    {
      Timer t(matmul_s);
      Moe::grouped_into(m.down, act, I, moe_counts_, ys);
    }
    {
      PartTimer pt(ridge_shared::PART_COMBINE);
      combine_into(ys, weights, moe_unsort_, T, k, H, out);
    }
    if (!m.shared) return;
    const int64_t SI = m.shared_gate_up.width() / 2;  // the shared expert into the step's MLP buffers
    bf16 *sgu = ws_gu_.data_ptr<bf16>(), *sact = ws_act_.data_ptr<bf16>(), *sy = ws_o_.data_ptr<bf16>();
    {
      Timer t(matmul_s);
      m.shared_gate_up.into(x, T, H, sgu);
    }
    {
      PartTimer pt(ridge_shared::PART_ACTIVATION);
      silu_mul_into(sgu, T, SI, sact);
    }
    {
      Timer t(matmul_s);
      m.shared_down.into(sact, T, SI, sy);
    }
    PartTimer pt(ridge_shared::PART_COMBINE);
    if (m.shared_gate.has_value()) {  // sigmoid(x gate^T) * y: a bf16 product, rounded once
      const auto xt = at::from_blob(const_cast<bf16*>(x), {T, H}, torch::TensorOptions().dtype(at::kBFloat16));
      const auto gate = at::sigmoid(at::linear(xt, *m.shared_gate)).contiguous();
      const bf16* g = gate.data_ptr<bf16>();
      for (int64_t t = 0; t < T; ++t)
        for (int64_t c = 0; c < H; ++c)
          sy[t * H + c] = bf16(static_cast<float>(g[t]) * static_cast<float>(sy[t * H + c]));
    }
    add_rows_into(out, sy, T * H);  // out.add_(y)
  }

  // Each token's k expert outputs, weighted and summed: out[t] = sum over j of
  // bf16(ys[unsort[t k + j]] * w[t k + j]), in fp32 from 0 in order j = 0 .. k-1, rounded to
  // bf16 once -- what SparseMoE.forward's multiply (a bf16 op), gather and
  // sum(dim=1, dtype=float32) compute, without their six dispatches. ys (T k, H), H a multiple of 16.
  static void combine_into(const at::BFloat16* ys, const at::BFloat16* w, const std::vector<int64_t>& unsort,
                           int64_t T, int64_t k, int64_t H, at::BFloat16* out) {
    const auto* yp = reinterpret_cast<const uint16_t*>(ys);
    auto* op = reinterpret_cast<uint16_t*>(out);
    auto widen = [](__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); };
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t h = 0; h < H; h += 16) {
          __m512 acc = _mm512_setzero_ps();
          for (int64_t j = 0; j < k; ++j) {
            const __m512 y = widen(_mm256_loadu_si256((const __m256i*)(yp + unsort[t * k + j] * H + h)));
            const __m512 prod = _mm512_mul_ps(y, _mm512_set1_ps(static_cast<float>(w[t * k + j])));
            acc = _mm512_add_ps(acc, widen((__m256i)_mm512_cvtneps_pbh(prod)));
          }
          _mm256_storeu_si256((__m256i*)(op + t * H + h), (__m256i)_mm512_cvtneps_pbh(acc));
        }
      }
    });
  }

  std::vector<Layer> layers_;
  torch::Tensor head_norm_, embed_;  // set_head: the final norm, the embedding table
  double head_eps_ = 0.0;
  Lin head_;  // the lm_head
};

void bind_decode_plan(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<DecodePlan>(m, "DecodePlan", py::module_local(), "every decoder layer of a bf16 decode step in one call")
      .def(py::init<>())
      .def("add_layer", &DecodePlan::add_layer)
      .def("add_mla_layer", &DecodePlan::add_mla_layer)
      .def("set_mlp", &DecodePlan::set_mlp)
      .def("set_moe", &DecodePlan::set_moe)
      .def("set_shared_expert", &DecodePlan::set_shared_expert)
      .def("num_layers", &DecodePlan::num_layers)
      .def("runs_on_rows", &DecodePlan::runs_on_rows, "whether run() takes run_rows (every layer a plain Llama or latent attention; dense MLPs or MoEs)")
      .def("run", &DecodePlan::run, py::call_guard<py::gil_scoped_release>())
      .def("set_head", &DecodePlan::set_head)
      .def("has_head", &DecodePlan::has_head)
      .def("run_greedy", &DecodePlan::run_greedy, py::call_guard<py::gil_scoped_release>(),
           "steps greedy decode passes: run(), the final norm, the lm_head and argmax, the next rows embedded");
  m.def("write_kv_quant_", &write_kv_quant_, py::call_guard<py::gil_scoped_release>(),
        "an int8 / fp8 pool's write_kv: rows quantized per group (kv/cache.py's arithmetic) into their slots");
}
