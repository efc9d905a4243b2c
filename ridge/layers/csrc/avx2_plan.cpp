// Every decoder layer of a bf16 decode step in one call, for CPUs with AVX2 only (Avx2Kernels).
//
// Op by op from Python, a decode step of the 1.1B Llama at 4 bits spent ~5 ms of its ~41 outside
// the matmuls on the 2-core Zen 3 EPYC (Q4_0 file, batch 1): ~9 kernel calls a layer, each tens
// of microseconds of interpreter, dispatch and allocation around a kernel that takes a few. A
// plan built once holds each layer's weights (GGUF rows, blocks of 8 rows, or dense bf16), norms
// and KV pools; run() walks the layers calling the very kernels the Python forward calls
// (avx2_kernels.h's *_into entry points behind linear_blocks, linear_bf16, rms_norm,
// add_rms_norm, rope_write_kv_, paged_decode_attention, silu_mul) in its order, on raw rows in
// buffers it keeps, so its results are the Python path's bit for bit
// (tests/models/test_decode_plan.py).
//
// What it covers: Llama attention (q/k norms too) over bf16, int8 or fp8 pools, DeepSeek's latent
// attention absorbed (DeepseekAttention.forward and layers/mla.py: its per-head matrices in a
// block format or bf16 rows, Avx2Kernels.plan_heads), dense MLPs and MoEs (greedy,
// group-limited or noaux_tc routers through Avx2Kernels.route_topk's kernel; a shared expert,
// gated or not). Anything else is refused when the plan is built (Avx2Kernels.plan_*), and a
// step the Python path would run elsewhere (a Llama attention's GEMM path for fewer jobs than
// threads, decode_attention_jobs) is
// declined when it comes: run() returns None before touching anything, and the caller runs
// the step op by op.
#include <ATen/Parallel.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "avx2_kernels.h"
#include "kv_write.h"
#include "plan_shared.h"
#include "step_parts.h"

namespace {

using bf16 = at::BFloat16;
using ridge_shared::PartTimer;
using Timer = ridge_shared::AddTime;  // the seconds in the linear kernels
using PartSpec = std::tuple<torch::Tensor, int64_t, int64_t>;  // (weight, format code, rows), as plan_linear gives

// One weight of a layer: code -1 a dense bf16 (n, K); else a GGUF type's rows (n, row bytes),
// or blocks of 8 rows (n / 8, 8 row bytes: repack_rows)
struct Part {
  torch::Tensor w;
  int64_t type = -1, n = 0;
  bool packed = false;

  void into(const bf16* x, int64_t M, int64_t K, const float* bias, bf16* y, int64_t ldy) const {
    if (type < 0)
      return ridge_avx2::linear_bf16_into(x, M, K, w.data_ptr<bf16>(), n, bias, y, ldy);
    ridge_avx2::linear_blocks_into(x, M, K, w.data_ptr<uint8_t>(), type, packed, n, bias, y, ldy);
  }
};

// A linear layer: one part with its bias (Avx2Kernels.linear), or parts side by side and then
// the bias added in bf16 (ShardedLinearMethod.join: cat, then y + bias.to(y.dtype))
struct Lin {
  std::vector<Part> parts;
  int64_t k = 0, width = 0;
  torch::Tensor bias_f;  // one part: the bias in float32, added before the rounding; parts: as bf16, after
  bool dense = false;  // a part is dense bf16

  void into(const bf16* x, int64_t M, bf16* y) const {
    const float* b = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
    if (parts.size() == 1) return parts[0].into(x, M, k, b, y, width);
    int64_t col = 0;
    for (const auto& p : parts) {
      p.into(x, M, k, nullptr, y + col, width);
      col += p.n;
    }
    if (b == nullptr) return;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t i = 0; i < width; ++i) y[m * width + i] = static_cast<bf16>(static_cast<float>(y[m * width + i]) + b[i]);
  }
};

Lin make_lin(const std::vector<PartSpec>& specs, const c10::optional<torch::Tensor>& bias, int64_t k) {
  TORCH_CHECK(!specs.empty(), "AVX2 decode plan: a linear layer without weights");
  Lin lin;
  lin.k = k;
  for (const auto& [w, type, n] : specs) {
    Part p{w, type, n, false};
    TORCH_CHECK(w.device().is_cpu() && w.is_contiguous() && w.dim() == 2, "AVX2 decode plan: contiguous 2-D CPU weights");
    if (type < 0) {
      TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.size(0) == n && w.size(1) == k,
                  "AVX2 decode plan: a dense weight (", n, ", ", k, ") in bf16 expected");
      lin.dense = true;
    } else {
      const int64_t row_bytes = ridge_avx2::block_row_bytes(type, k);
      TORCH_CHECK(row_bytes > 0 && w.scalar_type() == at::kByte, "AVX2 decode plan: GGUF type ", type,
                  " has no AVX2 kernel for rows of ", k);
      p.packed = w.size(0) != n;
      TORCH_CHECK(p.packed ? n % 8 == 0 && w.size(0) * 8 == n && w.size(1) == 8 * row_bytes
                           : w.size(1) == row_bytes,
                  "AVX2 decode plan: ", n, " rows of GGUF type ", type, " do not match a weight of ", w.sizes());
    }
    lin.width += n;
    lin.parts.push_back(p);
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == lin.width, "AVX2 decode plan: a bias of ", bias->numel(), " for ", lin.width, " outputs");
    lin.bias_f = lin.parts.size() == 1 ? bias->to(at::kFloat).contiguous()
                                       : bias->to(at::kBFloat16).to(at::kFloat).contiguous();
  }
  return lin;
}

// A stacked-expert projection (E experts of n rows each, K wide): dense bf16 (E n, K), GGUF rows
// (E n, row bytes) or blocks of 8 rows (E n / 8, 8 row bytes), as Avx2Kernels.plan_experts gives it
struct Experts {
  torch::Tensor w;
  int64_t type = -1, n = 0, k = 0, row_bytes = 0;
  bool packed = false;

  // rows sorted by expert (counts[e] of them for expert e) through expert e's n rows into y (n
  // wide): one linear call an expert that has rows, as TorchKernels.grouped_linear calls
  // Avx2Kernels.linear on each expert's slice of x and rows of the weight. spread: the experts
  // over the threads, each call on one (a linear call inside at::parallel_for runs on its
  // caller's thread), for many small calls of like size: MLA's per-head matrices, 2 x heads
  // calls a layer of tens to a few hundred KB each, where a fork and join a call cost
  // DeepSeek-V3-small's int4 steps 1.086x at batch 1 and 1.03-1.06x at 4 (2-core Xeon, AVX2
  // kernels, both alternated in one process; bf16 even). An MoE's experts, spread at batch 1
  // (one row each), ran 0.94x: each is large enough to want both cores. A row's output does
  // not depend on the thread that computes it: the same bits either way.
  void into(const bf16* x, const std::vector<int64_t>& counts, bf16* y, bool spread = false) const {
    const int64_t E = static_cast<int64_t>(counts.size());
    std::vector<int64_t> start(E + 1, 0);
    for (int64_t e = 0; e < E; ++e) start[e + 1] = start[e] + counts[e];
    const auto one = [&](int64_t e) {
      const int64_t c = counts[e], s = start[e];
      if (c == 0) return;
      if (type < 0)
        ridge_avx2::linear_bf16_into(x + s * k, c, k, w.data_ptr<bf16>() + e * n * k, n, nullptr, y + s * n, n);
      else
        ridge_avx2::linear_blocks_into(x + s * k, c, k, w.data_ptr<uint8_t>() + e * n * row_bytes, type, packed, n,
                                       nullptr, y + s * n, n);
    };
    if (!spread) {
      for (int64_t e = 0; e < E; ++e) one(e);
      return;
    }
    at::parallel_for(0, E, 1, [&](int64_t begin, int64_t end) {
      for (int64_t e = begin; e < end; ++e) one(e);
    });
  }
};

Experts make_experts(const PartSpec& spec, int64_t k, int64_t num_experts) {
  const auto& [w, type, n] = spec;
  Experts ex;
  ex.w = w, ex.type = type, ex.n = n, ex.k = k;
  TORCH_CHECK(n > 0 && w.device().is_cpu() && w.is_contiguous() && w.dim() == 2,
              "AVX2 decode plan: contiguous 2-D CPU expert weights");
  if (type < 0) {
    TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.size(0) == num_experts * n && w.size(1) == k,
                "AVX2 decode plan: dense experts (", num_experts, " x ", n, ", ", k, ") in bf16 expected");
    return ex;
  }
  ex.row_bytes = ridge_avx2::block_row_bytes(type, k);
  TORCH_CHECK(ex.row_bytes > 0 && w.scalar_type() == at::kByte, "AVX2 decode plan: GGUF type ", type,
              " has no AVX2 kernel for rows of ", k);
  ex.packed = w.size(1) == 8 * ex.row_bytes;
  TORCH_CHECK(ex.packed ? n % 8 == 0 && w.size(0) * 8 == num_experts * n
                        : w.size(1) == ex.row_bytes && w.size(0) == num_experts * n,
              "AVX2 decode plan: ", num_experts, " experts of ", n, " rows of GGUF type ", type,
              " do not match a weight of ", w.sizes());
  return ex;
}

// A layer's MoE (SparseMoE): the router as Router.route_args gives it, the stacked experts,
// and the shared expert (Qwen2-MoE's under a sigmoid gate; DeepSeek's ungated)
struct Moe {
  torch::Tensor router;  // (E, K) float32 or bf16 (plan_shared.h RouterRows)
  int64_t top_k = 0, n_group = 1, topk_group = 1;
  bool softmax = true, norm_topk = false;
  double norm_eps = 0.0, scaling = 1.0;
  c10::optional<torch::Tensor> bias;  // noaux_tc's correction (E float32)
  Experts gate_up, down;
  bool shared = false;
  Lin shared_gate_up, shared_down;
  c10::optional<torch::Tensor> shared_gate;  // (1, K)
};

struct Layer {
  torch::Tensor in_norm, post_norm;
  float eps = 0.f;
  Lin qkv, o, gate_up, down;  // a latent attention's qkv: fused_qkv_a_proj
  c10::optional<Moe> moe;  // the feed-forward: an MoE, else the dense gate_up / down
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  float scale = 0.f;
  c10::optional<torch::Tensor> q_norm, k_norm;
  float qk_eps = 0.f;
  torch::Tensor k_pool, v_pool;  // bf16, or int8 / e4m3 codes under the scales below
  c10::optional<torch::Tensor> k_scale, v_scale;  // fp16 (blocks, block_size, kv_heads, groups)
  bool fp8 = false;
  // DeepSeek's latent attention (add_mla_layer): one KV head of head_dim rank + rope, k_pool the
  // latent pool (also the values)
  bool mla = false;
  int64_t q_width = 0, nope = 0, rope = 0, rank = 0;
  c10::optional<torch::Tensor> q_a_norm;  // with q_b (q_lora_rank)
  c10::optional<Lin> q_b;
  torch::Tensor kv_a_norm;
  float latent_eps = 0.f;
  bool interleave = false;  // the rotary pairs interleaved (de-interleaved before the rotation)
  Experts w_uk, w_uv;  // per-head matrices, one "expert" a head: W_uk^T (rank rows over nope), W_uv (v over rank)
};


// An int8 / fp8 pool's scales as its decode attention reads them (Avx2Kernels._reads_codes):
// fp16 (blocks, block_size, kv_heads, groups) beside the pool, one group a head or groups of a
// power of two of 8+ dims
void check_scales(const torch::Tensor& sc, const torch::Tensor& pool, int64_t head_dim) {
  const int64_t groups = sc.dim() == 4 ? sc.size(3) : 0, width = groups ? head_dim / groups : 0;
  TORCH_CHECK(sc.scalar_type() == at::kHalf && sc.is_contiguous() && groups > 0 && sc.size(0) == pool.size(0) &&
                  sc.size(1) == pool.size(1) && sc.size(2) == pool.size(2) &&
                  (groups == 1 || (width * groups == head_dim && width >= 8 && (width & (width - 1)) == 0)),
              "AVX2 decode plan: contiguous fp16 (blocks, block_size, kv_heads, groups) scales expected");
}

void check_bf16_vector(const torch::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.numel() == n, "AVX2 decode plan: ", what,
              " must be ", n, " contiguous bf16 values");
}

}  // namespace

class Avx2DecodePlan {
 public:
  // many_heads: the query heads per KV head from which its decode attention gives way to
  // torch's GEMMs when the kernel's jobs are fewer than the threads (MANY_HEADS_PER_KV_HEAD,
  // decode_attention_jobs). A step that would take them is declined.
  explicit Avx2DecodePlan(int64_t many_heads) : many_heads_(many_heads) {}

  // The same arguments as the AVX-512 DecodePlan's add_layer (LlamaAttention.add_to_plan):
  // bf16 pools, or int8 / fp8 ones with fp16 scales (Avx2Kernels.plan_takes_cache: the ones
  // its decode attention reads).
  void add_layer(torch::Tensor in_norm, torch::Tensor post_norm, double eps, std::vector<PartSpec> qkv,
                 c10::optional<torch::Tensor> qkv_bias, std::vector<PartSpec> o, c10::optional<torch::Tensor> o_bias,
                 int64_t heads, int64_t kv_heads, int64_t head_dim, double scale, c10::optional<torch::Tensor> q_norm,
                 c10::optional<torch::Tensor> k_norm, double qk_eps, torch::Tensor k_pool, torch::Tensor v_pool,
                 c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale, bool fp8) {
    const bool quantized = k_scale.has_value();
    TORCH_CHECK((quantized ? k_pool.element_size() == 1 && v_pool.element_size() == 1 && v_scale.has_value()
                           : k_pool.scalar_type() == at::kBFloat16 && v_pool.scalar_type() == at::kBFloat16) &&
                    k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.dim() == 4 &&
                    k_pool.sizes() == v_pool.sizes() && k_pool.size(2) == kv_heads && k_pool.size(3) == head_dim,
                "AVX2 decode plan: contiguous bf16 or 1-byte (blocks, block_size, kv_heads, head_dim) pools expected");
    if (quantized) {
      check_scales(*k_scale, k_pool, head_dim);
      TORCH_CHECK(v_scale->scalar_type() == at::kHalf && v_scale->is_contiguous() && k_scale->sizes() == v_scale->sizes(),
                  "AVX2 decode plan: V's scales must be K's kind and shape");
    }
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim % 16 == 0,
                "AVX2 decode plan: query heads a multiple of the KV heads, head_dim a multiple of 16");
    const int64_t hidden = in_norm.numel();
    TORCH_CHECK(hidden_ == 0 || hidden == hidden_, "AVX2 decode plan: layers of one hidden size");
    hidden_ = hidden;
    check_bf16_vector(in_norm, hidden, "input_layernorm");
    check_bf16_vector(post_norm, hidden, "post_attention_layernorm");
    Layer l;
    l.in_norm = in_norm, l.post_norm = post_norm, l.eps = static_cast<float>(eps);
    l.qkv = make_lin(qkv, qkv_bias, hidden);
    l.o = make_lin(o, o_bias, heads * head_dim);
    TORCH_CHECK(l.qkv.width == (heads + 2 * kv_heads) * head_dim && l.o.width == hidden,
                "AVX2 decode plan: qkv_proj and o_proj do not match the heads");
    l.heads = heads, l.kv_heads = kv_heads, l.head_dim = head_dim, l.scale = static_cast<float>(scale);
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "AVX2 decode plan: q and k norms go together");
    if (q_norm.has_value()) {
      check_bf16_vector(*q_norm, head_dim, "q_norm");
      check_bf16_vector(*k_norm, head_dim, "k_norm");
    }
    l.q_norm = q_norm, l.k_norm = k_norm, l.qk_eps = static_cast<float>(qk_eps);
    l.k_pool = k_pool, l.v_pool = v_pool, l.k_scale = k_scale, l.v_scale = v_scale, l.fp8 = fp8;
    layers_.push_back(std::move(l));
  }

  // The same arguments as the AVX-512 DecodePlan's add_mla_layer (DeepseekAttention.add_to_plan):
  // the per-head matrices as Avx2Kernels.plan_heads gives them (a stacked layer's GGUF rows or
  // blocks of 8 rows, its type, rows a head), a bf16 latent pool or int8 / fp8 codes under fp16
  // scales that its decode attention reads.
  void add_mla_layer(torch::Tensor in_norm, torch::Tensor post_norm, double eps, std::vector<PartSpec> qkv_a,
                     int64_t q_width, c10::optional<torch::Tensor> q_a_norm, std::vector<PartSpec> q_b,
                     torch::Tensor kv_a_norm, double latent_eps, std::vector<PartSpec> o, int64_t heads, int64_t nope,
                     int64_t rope, int64_t rank, bool interleave, PartSpec w_uk, PartSpec w_uv_t, double scale,
                     torch::Tensor pool, c10::optional<torch::Tensor> scales, bool fp8) {
    const int64_t E = rank + rope;
    TORCH_CHECK(pool.is_contiguous() && pool.dim() == 4 && pool.size(2) == 1 && pool.size(3) == E &&
                    (scales.has_value() ? pool.element_size() == 1 : pool.scalar_type() == at::kBFloat16),
                "AVX2 decode plan: one contiguous latent pool (blocks, block_size, 1, rank + rope) expected");
    if (scales.has_value()) check_scales(*scales, pool, E);
    TORCH_CHECK(heads > 0 && nope > 0 && rope % 16 == 0 && rope > 0 && rank % 8 == 0 && rank > 0,
                "AVX2 decode plan: a latent attention's heads, rank (a multiple of 8) and rotary dims (of 16)");
    TORCH_CHECK(q_a_norm.has_value() == !q_b.empty(), "AVX2 decode plan: q_a_layernorm and q_b_proj go together");
    const int64_t hidden = in_norm.numel();
    TORCH_CHECK(hidden_ == 0 || hidden == hidden_, "AVX2 decode plan: layers of one hidden size");
    hidden_ = hidden;
    check_bf16_vector(in_norm, hidden, "input_layernorm");
    check_bf16_vector(post_norm, hidden, "post_attention_layernorm");
    check_bf16_vector(kv_a_norm, rank, "kv_a_layernorm");
    Layer l;
    l.in_norm = in_norm, l.post_norm = post_norm, l.eps = static_cast<float>(eps);
    l.qkv = make_lin(qkv_a, c10::nullopt, hidden);
    TORCH_CHECK(l.qkv.width == q_width + E, "AVX2 decode plan: fused_qkv_a_proj is not q's width plus rank + rope");
    const int64_t qh = heads * (nope + rope);
    if (q_a_norm.has_value()) {
      check_bf16_vector(*q_a_norm, q_width, "q_a_layernorm");
      l.q_b = make_lin(q_b, c10::nullopt, q_width);
      TORCH_CHECK(l.q_b->width == qh, "AVX2 decode plan: q_b_proj does not give the heads' queries");
    } else {
      TORCH_CHECK(q_width == qh, "AVX2 decode plan: q_proj does not give the heads' queries");
    }
    l.w_uk = make_experts(w_uk, nope, heads);
    TORCH_CHECK(l.w_uk.n == rank, "AVX2 decode plan: W_uk^T must give rank values a head");
    l.w_uv = make_experts(w_uv_t, rank, heads);
    l.o = make_lin(o, c10::nullopt, heads * l.w_uv.n);
    TORCH_CHECK(l.o.width == hidden, "AVX2 decode plan: o_proj does not give the hidden size");
    l.heads = heads, l.kv_heads = 1, l.head_dim = E, l.scale = static_cast<float>(scale);
    l.k_pool = pool, l.v_pool = pool, l.k_scale = scales, l.v_scale = scales, l.fp8 = fp8;
    l.mla = true, l.q_width = q_width, l.nope = nope, l.rope = rope, l.rank = rank;
    l.q_a_norm = q_a_norm, l.kv_a_norm = kv_a_norm, l.latent_eps = static_cast<float>(latent_eps);
    l.interleave = interleave;
    layers_.push_back(std::move(l));
  }

  void set_mlp(std::vector<PartSpec> gate_up, c10::optional<torch::Tensor> gate_up_bias, std::vector<PartSpec> down,
               c10::optional<torch::Tensor> down_bias) {
    TORCH_CHECK(!layers_.empty(), "AVX2 decode plan: set_mlp before add_layer");
    Layer& l = layers_.back();
    l.gate_up = make_lin(gate_up, gate_up_bias, hidden_);
    TORCH_CHECK(l.gate_up.width % 2 == 0, "AVX2 decode plan: gate_up_proj has an odd width");
    l.down = make_lin(down, down_bias, l.gate_up.width / 2);
    TORCH_CHECK(l.down.width == hidden_, "AVX2 decode plan: down_proj does not give the hidden size");
  }

  // The same arguments as the AVX-512 DecodePlan's set_moe (_plan_moe): the router and
  // Router.route_args, then the stacked experts (Avx2Kernels.plan_experts)
  void set_moe(torch::Tensor router, int64_t top_k, bool softmax, bool norm_topk, double norm_eps, double scaling,
               int64_t n_group, int64_t topk_group, c10::optional<torch::Tensor> bias, PartSpec gate_up,
               PartSpec down) {
    TORCH_CHECK(!layers_.empty(), "AVX2 decode plan: set_moe before add_layer");
    TORCH_CHECK((router.scalar_type() == at::kFloat || router.scalar_type() == at::kBFloat16) && router.is_contiguous() &&
                    router.dim() == 2 && router.size(1) == hidden_,
                "AVX2 decode plan: a contiguous float32 or bf16 (experts, hidden) router expected");
    const int64_t E = router.size(0);
    TORCH_CHECK(top_k >= 1 && top_k <= E && n_group >= 1 && E % n_group == 0 && topk_group >= 1 &&
                    topk_group <= n_group,
                "AVX2 decode plan: top_k of ", E, " experts in ", n_group, " groups, ", topk_group, " kept");
    TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == E),
                "AVX2 decode plan: a float32 router bias of one value an expert expected");
    TORCH_CHECK(hidden_ % 8 == 0, "AVX2 decode plan: an MoE's hidden size must be a multiple of 8");
    Moe m;
    m.router = router, m.top_k = top_k, m.softmax = softmax, m.norm_topk = norm_topk, m.norm_eps = norm_eps;
    m.scaling = scaling, m.n_group = n_group, m.topk_group = topk_group, m.bias = bias;
    m.gate_up = make_experts(gate_up, hidden_, E);
    TORCH_CHECK(m.gate_up.n % 2 == 0, "AVX2 decode plan: the experts' gate_up_proj has an odd width");
    m.down = make_experts(down, m.gate_up.n / 2, E);
    TORCH_CHECK(m.down.n == hidden_, "AVX2 decode plan: the experts' down_proj does not give the hidden size");
    layers_.back().moe = std::move(m);
  }

  void set_shared_expert(std::vector<PartSpec> gate_up, std::vector<PartSpec> down, c10::optional<torch::Tensor> gate) {
    TORCH_CHECK(!layers_.empty() && layers_.back().moe.has_value(), "AVX2 decode plan: set_shared_expert before set_moe");
    Moe& m = *layers_.back().moe;
    m.shared_gate_up = make_lin(gate_up, c10::nullopt, hidden_);
    TORCH_CHECK(m.shared_gate_up.width % 2 == 0, "AVX2 decode plan: the shared expert's gate_up_proj has an odd width");
    m.shared_down = make_lin(down, c10::nullopt, m.shared_gate_up.width / 2);
    TORCH_CHECK(m.shared_down.width == hidden_, "AVX2 decode plan: the shared expert's down_proj does not give the hidden size");
    TORCH_CHECK(!gate.has_value() || (gate->dim() == 2 && gate->size(0) == 1 && gate->size(1) == hidden_),
                "AVX2 decode plan: a (1, hidden) shared expert gate expected");
    m.shared = true;
    m.shared_gate = gate;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // LlamaForCausalLM.compute_logits' final norm and lm_head (Avx2Kernels.plan_linear), and the
  // embedding table the next pass's rows come from: what run_greedy adds to run
  void set_head(torch::Tensor norm, double eps, std::vector<PartSpec> lm_head, c10::optional<torch::Tensor> bias,
                torch::Tensor embed) {
    TORCH_CHECK(hidden_ > 0, "AVX2 decode plan: set_head after the layers");
    check_bf16_vector(norm, hidden_, "the final norm");
    TORCH_CHECK(embed.scalar_type() == at::kBFloat16 && embed.is_contiguous() && embed.dim() == 2 &&
                    embed.size(1) == hidden_,
                "AVX2 decode plan: a contiguous bf16 (vocab, hidden) embedding expected");
    head_norm_ = norm, head_eps_ = static_cast<float>(eps);
    head_ = make_lin(lm_head, bias, hidden_);
    embed_ = embed;
  }

  bool has_head() const { return embed_.defined(); }

  // `steps` greedy decode passes over the same rows: each pass is run() on h, then the final
  // norm, the lm_head and argmax_rows (what compute_logits and the sampler's greedy argmax
  // compute on the same rows: the same tokens), and the next pass's h is the embedding's rows
  // of those tokens, one position on (its slot from the row's block table, one more token to
  // attend). positions, slots and context_lens advance in place; the block tables must hold
  // every pass's position. Returns (T, steps) tokens, the seconds in the linear kernels (the
  // lm_head's too) and the last pass's experts per layer; None, before anything ran, where
  // the Python path would send these rows elsewhere (run's takes).
  std::optional<std::tuple<torch::Tensor, double, std::vector<int64_t>>> run_greedy(
      torch::Tensor h, torch::Tensor slots, torch::Tensor block_tables, torch::Tensor context_lens,
      torch::Tensor positions, torch::Tensor cos, torch::Tensor sin, int64_t steps) {
    TORCH_CHECK(has_head() && !layers_.empty() && steps >= 1, "AVX2 decode plan: run_greedy needs set_head and layers");
    TORCH_CHECK(h.scalar_type() == at::kBFloat16 && h.is_contiguous() && h.dim() == 2 && h.size(1) == hidden_,
                "AVX2 decode plan: (T, hidden) bf16 h");
    const int64_t T = h.size(0), V = head_.width, vocab = embed_.size(0);
    if (!takes(T, cos.size(1))) return std::nullopt;
    const int64_t BS = layers_[0].k_pool.size(1), width = block_tables.size(1);
    auto tokens = torch::empty({T, steps}, torch::TensorOptions().dtype(at::kLong));
    std::vector<bf16> x(T * hidden_), logits(T * V);
    std::vector<int64_t> best(T);
    int64_t* tp = tokens.data_ptr<int64_t>();
    double matmul_s = 0.0;
    std::vector<int64_t> touched;
    for (int64_t s = 0; s < steps; ++s) {
      if (s) {  // run() checked the tensors' kinds and shapes on the pass before
        PartTimer pt(ridge_shared::PART_SAMPLING);
        ridge_shared::next_greedy_pass(h.data_ptr<bf16>(), T, hidden_, embed_.data_ptr<bf16>(), vocab, tp + s - 1, steps,
                                      positions.data_ptr<int64_t>(), slots.data_ptr<int64_t>(),
                                      context_lens.data_ptr<int64_t>(), block_tables.data_ptr<int64_t>(), width, BS);
      }
      auto ran = run(h, slots, block_tables, context_lens, positions, cos, sin);
      TORCH_CHECK(ran.has_value(), "AVX2 decode plan: a pass declined the rows the first took");  // takes() is T's alone
      matmul_s += std::get<0>(*ran);
      touched = std::move(std::get<1>(*ran));
      {
        PartTimer pt(ridge_shared::PART_NORMS);
        ridge_avx2::rms_norm_into<bf16>(h.data_ptr<bf16>(), head_norm_.data_ptr<bf16>(), x.data(), T, hidden_, head_eps_);
      }
      {
        Timer t(matmul_s);
        head_.into(x.data(), T, logits.data());
      }
      PartTimer pt(ridge_shared::PART_SAMPLING);
      ridge_avx2::argmax_rows_into<bf16>(logits.data(), T, V, best.data());
      for (int64_t t = 0; t < T; ++t) tp[t * steps + s] = best[t];
    }
    return std::make_tuple(tokens, matmul_s, std::move(touched));
  }

  // h: (T, hidden) bf16, the residual stream, updated in place. Returns the seconds spent in
  // the linear kernels and, per layer, the distinct experts its MoE ran (-1: a dense layer), as
  // the AVX-512 plan does; None where the Python path would take another kernel for this step
  // (h untouched).
  std::optional<std::tuple<double, std::vector<int64_t>>> run(torch::Tensor h, torch::Tensor slots,
                                                               torch::Tensor block_tables, torch::Tensor context_lens,
                                                               torch::Tensor positions, torch::Tensor cos,
                                                               torch::Tensor sin) {
    TORCH_CHECK(!layers_.empty(), "AVX2 decode plan: no layers");
    for (const auto& l : layers_)
      TORCH_CHECK(l.moe.has_value() || l.down.width == hidden_, "AVX2 decode plan: a layer without its MLP");
    TORCH_CHECK(h.scalar_type() == at::kBFloat16 && h.is_contiguous() && h.dim() == 2 && h.size(1) == hidden_,
                "AVX2 decode plan: (T, hidden) bf16 h");
    const int64_t T = h.size(0);
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == T,
                "AVX2 decode plan: one int64 slot per token");
    TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == T,
                "AVX2 decode plan: one int64 position per token");
    TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && block_tables.dim() == 2 &&
                    block_tables.size(0) == T && context_lens.scalar_type() == at::kLong &&
                    context_lens.is_contiguous() && context_lens.numel() == T,
                "AVX2 decode plan: (T, blocks) int64 block tables and T int64 context lengths");
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                    sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes(),
                "AVX2 decode plan: float32 (positions, dim) rotary tables");
    if (!takes(T, cos.size(1))) return std::nullopt;
    const int64_t* sp = slots.data_ptr<int64_t>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* tables = block_tables.data_ptr<int64_t>();
    const int64_t* lens = context_lens.data_ptr<int64_t>();
    const int64_t max_blocks = block_tables.size(1);
    ridge_shared::check_step("AVX2 decode plan", T, pos, cos.size(0), sp, lens, tables, max_blocks, layers_);
    ensure_buffers(T);
    bf16* hp = h.data_ptr<bf16>();
    bf16 *x = x_.data(), *o = o_.data(), *gu = gu_.data(), *act = act_.data(), *ffn = ffn_.data();
    const float *cp = cos.data_ptr<float>(), *snp = sin.data_ptr<float>();
    double matmul_s = 0.0;
    std::vector<int64_t> touched(layers_.size(), -1);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      // the previous layer's feed-forward output added into h with this layer's input norm
      {
        PartTimer pt(ridge_shared::PART_NORMS);
        if (i == 0)
          ridge_avx2::rms_norm_into<bf16>(hp, l.in_norm.data_ptr<bf16>(), x, T, hidden_, l.eps);
        else
          ridge_avx2::add_rms_norm_into<bf16>(ffn, hp, l.in_norm.data_ptr<bf16>(), x, T, hidden_, l.eps);
      }
      if (l.mla)
        latent_attention(l, x, T, sp, tables, max_blocks, lens, pos, cp, snp, o, matmul_s);
      else
        attention(l, x, T, sp, tables, max_blocks, lens, pos, cp, snp, o, matmul_s);
      {
        PartTimer pt(ridge_shared::PART_NORMS);
        ridge_avx2::add_rms_norm_into<bf16>(o, hp, l.post_norm.data_ptr<bf16>(), x, T, hidden_, l.eps);
      }
      if (l.moe.has_value()) {
        touched[i] = run_moe(*l.moe, x, T, ffn, matmul_s);
        continue;
      }
      {
        Timer t(matmul_s);
        l.gate_up.into(x, T, gu);
      }
      {
        PartTimer pt(ridge_shared::PART_ACTIVATION);
        ridge_avx2::silu_mul_into<bf16>(gu, T, l.gate_up.width / 2, act);
      }
      Timer t(matmul_s);
      l.down.into(act, T, ffn);
    }
    PartTimer pt(ridge_shared::PART_NORMS);  // (the residual adds are timed with the norms)
    for (int64_t i = 0; i < T * hidden_; ++i)  // the last layer's feed-forward into h (h.add_ rounds once)
      hp[i] = static_cast<bf16>(static_cast<float>(hp[i]) + static_cast<float>(ffn[i]));
    return std::make_tuple(matmul_s, std::move(touched));
  }

 private:
  // whether the Python path runs this step's T rows through the kernels the plan calls
  bool takes(int64_t T, int64_t rotary_dim) const {
    for (const auto& l : layers_) {
      if (rotary_dim != (l.mla ? l.rope : l.head_dim)) return false;  // rope_ takes full-width tables only
      const bool few_jobs = ridge_avx2::decode_attention_jobs(T, l.heads, l.kv_heads) < at::get_num_threads();
      if (!l.mla && l.heads / l.kv_heads >= many_heads_ && few_jobs) return false;  // a latent pool takes the kernel
    }
    return true;
  }

  // LlamaAttention.forward on raw rows: x (T, hidden) -> o (T, hidden) through o_proj
  void attention(const Layer& l, const bf16* x, int64_t T, const int64_t* sp, const int64_t* tables,
                 int64_t max_blocks, const int64_t* lens, const int64_t* pos, const float* cp, const float* snp,
                 bf16* o, double& matmul_s) {
    const int64_t D = l.head_dim, q_size = l.heads * D, kv_size = l.kv_heads * D, qkv_n = q_size + 2 * kv_size;
    bf16 *qkv = qkv_.data(), *attn = attn_.data();
    {
      Timer t(matmul_s);
      l.qkv.into(x, T, qkv);
    }
    if (l.q_norm.has_value()) {  // each head's q and k normed in place (rms_row reads a row before writing it)
      PartTimer pt(ridge_shared::PART_NORMS);
      for (int64_t t = 0; t < T; ++t) {
        bf16* row = qkv + t * qkv_n;
        ridge_avx2::rms_norm_into<bf16>(row, l.q_norm->data_ptr<bf16>(), row, l.heads, D, l.qk_eps);
        ridge_avx2::rms_norm_into<bf16>(row + q_size, l.k_norm->data_ptr<bf16>(), row + q_size, l.kv_heads, D,
                                        l.qk_eps);
      }
    }
    std::optional<PartTimer> rope_kv(std::in_place, ridge_shared::PART_ROPE_KV);
    ridge_avx2::rope_into<bf16>(qkv, T, l.heads + l.kv_heads, D, qkv_n, pos, cp, snp);
    const int64_t BS = l.k_pool.size(1), num_slots = l.k_pool.size(0) * BS;
    if (l.k_scale.has_value()) {  // write_kv's quantize and copies, then the kernel over the codes
      auto *kp = static_cast<uint8_t*>(l.k_pool.data_ptr()), *vp = static_cast<uint8_t*>(l.v_pool.data_ptr());
      at::Half *ks = l.k_scale->data_ptr<at::Half>(), *vs = l.v_scale->data_ptr<at::Half>();
      const int64_t groups = l.k_scale->size(3);
      write_kv_quant_into(kp, ks, num_slots, l.kv_heads, D, groups, qkv + q_size, qkv_n, sp, T, l.fp8);
      write_kv_quant_into(vp, vs, num_slots, l.kv_heads, D, groups, qkv + q_size + kv_size, qkv_n, sp, T, l.fp8);
      rope_kv.reset();
      PartTimer pt(ridge_shared::PART_ATTENTION);
      ridge_avx2::decode_attention_quant_into<bf16>(qkv, qkv_n, T, l.heads, D, kp, vp, ks, vs, groups, l.fp8, BS,
                                                    l.kv_heads, tables, max_blocks, lens, l.scale, attn);
    } else {
      bf16 *kp = l.k_pool.data_ptr<bf16>(), *vp = l.v_pool.data_ptr<bf16>();
      for (int64_t t = 0; t < T; ++t) {  // write_kv / rope_write_kv_'s copies
        std::memcpy(kp + sp[t] * kv_size, qkv + t * qkv_n + q_size, kv_size * sizeof(bf16));
        std::memcpy(vp + sp[t] * kv_size, qkv + t * qkv_n + q_size + kv_size, kv_size * sizeof(bf16));
      }
      rope_kv.reset();
      PartTimer pt(ridge_shared::PART_ATTENTION);
      ridge_avx2::decode_attention_into<bf16>(qkv, qkv_n, T, l.heads, D, kp, vp, BS, l.kv_heads, tables, max_blocks,
                                              lens, l.scale, attn);
    }
    Timer t(matmul_s);
    l.o.into(attn, T, o);
  }

  // DeepseekAttention.forward and layers/mla.py's absorbed decode, op for op, on raw rows: x (T,
  // hidden) -> o (T, hidden) through o_proj. The per-head matrices take x head-major (head h's T
  // rows together), as TorchKernels.head_linear's grouped_linear does.
  void latent_attention(const Layer& l, const bf16* x, int64_t T, const int64_t* sp, const int64_t* tables,
                        int64_t max_blocks, const int64_t* lens, const int64_t* pos, const float* cp,
                        const float* snp, bf16* o, double& matmul_s) {
    const int64_t H = l.heads, QH = l.nope + l.rope, E = l.rank + l.rope, P = l.rope, yw = l.qkv.width;
    const int64_t V = l.w_uv.n;
    bf16 *y = qkv_.data(), *qk_rope = mla_rope_.data(), *entry = mla_entry_.data(), *heads_x = mla_x_.data();
    bf16 *lat = mla_lat_.data(), *query = mla_query_.data(), *attn = attn_.data(), *vals = mla_v_.data();
    {
      Timer t(matmul_s);
      l.qkv.into(x, T, y);  // (T, q | latent | rotary key)
    }
    const bf16* q = y;  // (T, H, nope + rope), rows qs apart
    int64_t qs = yw;
    if (l.q_b.has_value()) {
      bf16 *qa = mla_qa_.data(), *qb = mla_qb_.data();
      {
        PartTimer pt(ridge_shared::PART_NORMS);
        for (int64_t t = 0; t < T; ++t)
          ridge_avx2::rms_norm_into<bf16>(y + t * yw, l.q_a_norm->data_ptr<bf16>(), qa + t * l.q_width, 1, l.q_width,
                                          l.latent_eps);
      }
      {
        Timer t(matmul_s);
        l.q_b->into(qa, T, qb);
      }
      q = qb, qs = l.q_b->width;
    }
    // the latent normed into the cache entry; every head's rotary query and the rotary key in
    // one (T, H + 1, rope) run, de-interleaved where asked, rotated together (as forward's cat)
    // (the latent's norm timed with the rotations)
    std::optional<PartTimer> rope_kv(std::in_place, ridge_shared::PART_ROPE_KV);
    for (int64_t t = 0; t < T; ++t) {
      const bf16* kv_a = y + t * yw + l.q_width;
      ridge_avx2::rms_norm_into<bf16>(kv_a, l.kv_a_norm.data_ptr<bf16>(), entry + t * E, 1, l.rank, l.latent_eps);
      for (int64_t h = 0; h <= H; ++h)
        ridge_shared::place_rope(h < H ? q + t * qs + h * QH + l.nope : kv_a + l.rank, qk_rope + (t * (H + 1) + h) * P,
                                 P, l.interleave);
    }
    ridge_avx2::rope_into<bf16>(qk_rope, T, H + 1, P, (H + 1) * P, pos, cp, snp);
    for (int64_t t = 0; t < T; ++t) std::memcpy(entry + t * E + l.rank, qk_rope + (t * (H + 1) + H) * P, P * sizeof(bf16));
    const int64_t BS = l.k_pool.size(1), num_slots = l.k_pool.size(0) * BS;
    if (l.k_scale.has_value())  // write_slots' quantize
      write_kv_quant_into(static_cast<uint8_t*>(l.k_pool.data_ptr()), l.k_scale->data_ptr<at::Half>(), num_slots, 1,
                          E, l.k_scale->size(3), entry, E, sp, T, l.fp8);
    else
      for (int64_t t = 0; t < T; ++t) std::memcpy(l.k_pool.data_ptr<bf16>() + sp[t] * E, entry + t * E, E * sizeof(bf16));
    rope_kv.reset();
    // each head's latent query: q_nope through W_uk^T, head-major, then beside its rotary query
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t)
        std::memcpy(heads_x + (h * T + t) * l.nope, q + t * qs + h * QH, l.nope * sizeof(bf16));
    const std::vector<int64_t> counts(H, T);
    {
      Timer t(matmul_s);
      l.w_uk.into(heads_x, counts, lat, true);  // (H T, rank)
    }
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) {
        std::memcpy(query + (t * H + h) * E, lat + (h * T + t) * l.rank, l.rank * sizeof(bf16));
        std::memcpy(query + (t * H + h) * E + l.rank, qk_rope + (t * (H + 1) + h) * P, P * sizeof(bf16));
      }
    // multi-query attention over the latents (K: the entry, V: its first rank dims)
    std::optional<PartTimer> attention(std::in_place, ridge_shared::PART_ATTENTION);
    if (l.k_scale.has_value()) {
      const auto* codes = static_cast<const uint8_t*>(l.k_pool.data_ptr());
      const at::Half* sc = l.k_scale->data_ptr<at::Half>();
      ridge_avx2::decode_attention_quant_into<bf16>(query, H * E, T, H, E, codes, codes, sc, sc, l.k_scale->size(3), l.fp8,
                                                    BS, 1, tables, max_blocks, lens, l.scale, attn);
    } else {
      const bf16* pool = l.k_pool.data_ptr<bf16>();
      ridge_avx2::decode_attention_into<bf16>(query, H * E, T, H, E, pool, pool, BS, 1, tables, max_blocks, lens, l.scale,
                                              attn);
    }
    attention.reset();
    // the attended latents (each head's first rank dims) out through W_uv, head-major, then
    // token-major for o_proj
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t)
        std::memcpy(lat + (h * T + t) * l.rank, attn + (t * H + h) * E, l.rank * sizeof(bf16));
    {
      Timer t(matmul_s);
      l.w_uv.into(lat, counts, vals, true);  // (H T, V)
    }
    bf16* heads_v = mla_query_.data();  // the query is spent
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) std::memcpy(heads_v + (t * H + h) * V, vals + (h * T + t) * V, V * sizeof(bf16));
    Timer t(matmul_s);
    l.o.into(heads_v, T, o);
  }

  // SparseMoE.forward on raw rows: x (T, hidden) -> out (T, hidden), with the kernels and the
  // roundings of its Python path on these kernels: Avx2Kernels.route_topk, the (token, choice)
  // pairs sorted by expert (a stable counting sort: argsort(stable)), each expert's rows
  // through its slices (grouped_linear), silu_mul, the weighted outputs summed per token in
  // fp32 and rounded once, the shared expert added. Returns the experts it ran.
  int64_t run_moe(const Moe& m, const bf16* x, int64_t T, bf16* out, double& matmul_s) {
    const int64_t E = m.router.size(0), k = m.top_k, pairs = T * k, I = m.gate_up.n / 2, H = hidden_;
    moe_ids_.resize(pairs), moe_weights_.resize(pairs);
    std::optional<PartTimer> routing(std::in_place, ridge_shared::PART_ROUTING);
    ridge_avx2::route_topk_into(x, T, H, ridge_shared::RouterRows::of(m.router), E, k, m.softmax, m.norm_topk, m.norm_eps,
                                m.scaling, m.n_group, m.topk_group, m.bias.has_value() ? m.bias->data_ptr<float>() : nullptr,
                                moe_ids_.data(), moe_weights_.data());
    const int64_t used = ridge_shared::sort_by_expert(moe_ids_.data(), pairs, E, moe_counts_, moe_order_, moe_unsort_);
    bf16 *rows = moe_x_.data(), *gu = moe_gu_.data(), *act = moe_act_.data(), *ys = moe_ys_.data();
    for (int64_t p = 0; p < pairs; ++p) std::memcpy(rows + p * H, x + (moe_order_[p] / k) * H, H * sizeof(bf16));
    routing.reset();
    {
      Timer t(matmul_s);
      m.gate_up.into(rows, moe_counts_, gu);
    }
    {
      PartTimer pt(ridge_shared::PART_ACTIVATION);
      ridge_avx2::silu_mul_into<bf16>(gu, pairs, I, act);
    }
    {
      Timer t(matmul_s);
      m.down.into(act, moe_counts_, ys);
    }
    {
      PartTimer pt(ridge_shared::PART_COMBINE);
      ridge_avx2::moe_combine_into(ys, moe_weights_.data(), moe_unsort_.data(), T, k, H, out);
    }
    if (!m.shared) return used;
    const int64_t SI = m.shared_gate_up.width / 2;  // the shared expert, through the dense MLP's buffers
    bf16 *sgu = gu_.data(), *sact = act_.data(), *sy = o_.data();
    {
      Timer t(matmul_s);
      m.shared_gate_up.into(x, T, sgu);
    }
    {
      PartTimer pt(ridge_shared::PART_ACTIVATION);
      ridge_avx2::silu_mul_into<bf16>(sgu, T, SI, sact);
    }
    {
      Timer t(matmul_s);
      m.shared_down.into(sact, T, sy);
    }
    PartTimer pt(ridge_shared::PART_COMBINE);
    if (m.shared_gate.has_value()) {  // sigmoid(F.linear(x, gate)) * y: torch's ops, then a bf16 product
      const auto xt = at::from_blob(const_cast<bf16*>(x), {T, H}, torch::TensorOptions().dtype(at::kBFloat16));
      const auto gate = at::sigmoid(at::linear(xt, *m.shared_gate)).contiguous();
      ridge_avx2::scale_rows_into(sy, gate.data_ptr<bf16>(), T, H);
    }
    ridge_avx2::add_into(out, sy, T * H);  // out += y
    return used;
  }

  void ensure_buffers(int64_t T) {
    if (T <= rows_) return;
    int64_t qkv = 0, q = 0, gu = 0, top_k = 0, moe_gu = 0, qa = 0, qb = 0, rope = 0, entry = 0, hx = 0, lat = 0, v = 0;
    for (const auto& l : layers_) {
      qkv = std::max(qkv, l.qkv.width);
      q = std::max(q, l.heads * l.head_dim);
      if (l.mla) {
        qa = std::max(qa, l.q_width), qb = std::max(qb, l.q_b.has_value() ? l.q_b->width : 0);
        rope = std::max(rope, (l.heads + 1) * l.rope), entry = std::max(entry, l.head_dim);
        hx = std::max(hx, l.heads * l.nope), lat = std::max(lat, l.heads * l.rank);
        v = std::max(v, l.heads * l.w_uv.n);
        q = std::max(q, v);  // the query buffer takes the heads' values after the attention
      }
      gu = std::max(gu, l.gate_up.width);
      if (l.moe.has_value()) {
        top_k = std::max(top_k, l.moe->top_k);
        moe_gu = std::max(moe_gu, l.moe->gate_up.n);
        if (l.moe->shared) gu = std::max(gu, l.moe->shared_gate_up.width);
      }
    }
    x_.resize(T * hidden_), o_.resize(T * hidden_), ffn_.resize(T * hidden_);
    qkv_.resize(T * qkv), attn_.resize(T * q), gu_.resize(T * gu), act_.resize(T * gu / 2);
    moe_x_.resize(T * top_k * hidden_), moe_gu_.resize(T * top_k * moe_gu), moe_act_.resize(T * top_k * moe_gu / 2);
    moe_ys_.resize(T * top_k * hidden_);
    mla_qa_.resize(T * qa), mla_qb_.resize(T * qb), mla_rope_.resize(T * rope), mla_entry_.resize(T * entry);
    mla_x_.resize(T * hx), mla_lat_.resize(T * lat), mla_query_.resize(T * q), mla_v_.resize(T * v);
    rows_ = T;
  }

  int64_t many_heads_;
  int64_t hidden_ = 0, rows_ = 0;
  std::vector<Layer> layers_;
  std::vector<bf16> x_, o_, ffn_, qkv_, attn_, gu_, act_;
  torch::Tensor head_norm_, embed_;  // set_head: the final norm, the embedding table
  float head_eps_ = 0.f;
  Lin head_;  // the lm_head
  std::vector<bf16> moe_x_, moe_gu_, moe_act_, moe_ys_, moe_weights_;  // an MoE's rows, sorted by expert
  std::vector<int64_t> moe_ids_, moe_counts_, moe_order_, moe_unsort_;  // its routing and sort
  std::vector<bf16> mla_qa_, mla_qb_, mla_rope_, mla_entry_, mla_x_, mla_lat_, mla_query_, mla_v_;  // a latent attention's
};

void register_decode_plan(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<Avx2DecodePlan>(m, "DecodePlan", py::module_local(), "every decoder layer of a bf16 decode step in one call (AVX2)")
      .def(py::init<int64_t>())
      .def("add_layer", &Avx2DecodePlan::add_layer)
      .def("add_mla_layer", &Avx2DecodePlan::add_mla_layer)
      .def("set_mlp", &Avx2DecodePlan::set_mlp)
      .def("set_moe", &Avx2DecodePlan::set_moe)
      .def("set_shared_expert", &Avx2DecodePlan::set_shared_expert)
      .def("set_head", &Avx2DecodePlan::set_head)
      .def("has_head", &Avx2DecodePlan::has_head)
      .def("run_greedy", &Avx2DecodePlan::run_greedy, py::call_guard<py::gil_scoped_release>(),
           "steps greedy decode passes (run, the final norm, the lm_head, argmax, the next rows embedded), or None")
      .def("num_layers", &Avx2DecodePlan::num_layers)
      .def("run", &Avx2DecodePlan::run, py::call_guard<py::gil_scoped_release>(),
           "(seconds in matmuls, experts run per layer or -1), or None: a step the plan leaves to the Python path");
}
