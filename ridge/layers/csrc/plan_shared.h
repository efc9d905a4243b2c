// What both CPU extensions' routers and decode plans do alike, in one scalar definition each
// compiles (decode_ops.cpp and decode_layers.cpp for AVX-512, avx2_ops.cpp and avx2_plan.cpp for
// AVX2): an MoE router's choice once a token's logits are in, the (token, choice) pairs sorted
// by expert, a greedy run's next pass, and the checks of a step's indices (positions, slots,
// block tables) before a plan or a RoPE kernel reads them. Each computes the logits and runs the
// layers with its own SIMD.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace ridge_shared {

// The arguments Router.route_args gives, checked once before any token is routed
inline void check(int64_t E, int64_t top_k, int64_t n_group, int64_t topk_group, bool biased) {
  TORCH_CHECK(top_k >= 1 && top_k <= E, "route_topk: top_k must be in 1..", E);
  TORCH_CHECK(n_group >= 1 && E % n_group == 0 && topk_group >= 1 && topk_group <= n_group,
              "route_topk: ", E, " experts in ", n_group, " groups, ", topk_group, " of them kept");
  TORCH_CHECK(!biased || n_group == 1 || E / n_group >= 2, "route_topk: a biased group score needs 2+ experts a group");
}

// Indices by their value, best first (ties: the lower index first)
struct BestFirst {
  const std::vector<float>& v;
  bool operator()(int64_t a, int64_t b) const { return v[a] > v[b] || (v[a] == v[b] && a < b); }
};

// One thread's choice of each token's experts from its E logits: softmax (or sigmoid), then the
// top_k by the choice score best first (ties: the lower expert id first), their weights
// renormalized over the k (sum + eps) where asked, times scaling, rounded to bf16. The choice
// score is the score, plus ``bias`` where given (noaux_tc's e_score_correction_bias); with
// n_group > 1 only the topk_group groups with the best group score compete (the best choice
// score, or with a bias the sum of the two best), the others' experts scoring 0 (-inf with a
// bias), as topk_route masks them. The weights are the scores, never the corrected ones.
class Chooser {
 public:
  Chooser(int64_t E, int64_t top_k, bool softmax, bool norm_topk, double norm_eps, double scaling, int64_t n_group,
          int64_t topk_group, const float* bias)
      : E_(E), top_k_(top_k), n_group_(n_group), topk_group_(topk_group), softmax_(softmax), norm_topk_(norm_topk),
        norm_eps_(norm_eps), scaling_(scaling), bias_(bias), scores(E), choice_(E), group_score_(n_group), order_(E),
        groups_(n_group), keep_(n_group) {}

  // scores: the token's E logits, filled by the caller (and turned into its scores here)
  void choose(int64_t* ids, at::BFloat16* weights) {
    if (softmax_) {
      const float m = *std::max_element(scores.begin(), scores.end());
      float total = 0.f;
      for (float& v : scores) total += (v = std::exp(v - m));
      for (float& v : scores) v /= total;
    } else {
      for (float& v : scores) v = 1.f / (1.f + std::exp(-v));
    }
    for (int64_t e = 0; e < E_; ++e) choice_[e] = bias_ ? scores[e] + bias_[e] : scores[e];
    if (n_group_ > 1) {  // only the best topk_group groups' experts compete
      const int64_t per = E_ / n_group_;
      for (int64_t gi = 0; gi < n_group_; ++gi) {
        const float* c = choice_.data() + gi * per;
        float first = -INFINITY, second = -INFINITY;
        for (int64_t j = 0; j < per; ++j) {
          if (c[j] > first)
            second = first, first = c[j];
          else if (c[j] > second)
            second = c[j];
        }
        group_score_[gi] = bias_ ? first + second : first;
        groups_[gi] = gi;
      }
      std::partial_sort(groups_.begin(), groups_.begin() + topk_group_, groups_.end(), BestFirst{group_score_});
      std::fill(keep_.begin(), keep_.end(), 0);
      for (int64_t j = 0; j < topk_group_; ++j) keep_[groups_[j]] = 1;
      for (int64_t e = 0; e < E_; ++e)
        if (!keep_[e / per]) choice_[e] = bias_ ? -INFINITY : 0.f;
    }
    for (int64_t e = 0; e < E_; ++e) order_[e] = e;
    std::partial_sort(order_.begin(), order_.begin() + top_k_, order_.end(), BestFirst{choice_});
    float total = 0.f;
    for (int64_t j = 0; j < top_k_; ++j) total += scores[order_[j]];
    const float denom = norm_topk_ ? total + static_cast<float>(norm_eps_) : 1.f;
    for (int64_t j = 0; j < top_k_; ++j) {
      float w = scores[order_[j]];
      if (norm_topk_) w /= denom;
      if (scaling_ != 1.0) w *= static_cast<float>(scaling_);
      ids[j] = order_[j];
      weights[j] = at::BFloat16(w);
    }
  }

 private:
  int64_t E_, top_k_, n_group_, topk_group_;
  bool softmax_, norm_topk_;
  double norm_eps_, scaling_;
  const float* bias_;

 public:
  std::vector<float> scores;  // the token's logits in, its scores out

 private:
  std::vector<float> choice_, group_score_;
  std::vector<int64_t> order_, groups_;
  std::vector<char> keep_;
};

// An (E, K) router's rows as a kernel reads them: float32, or bf16 (Router.for_kernels stores a
// float32 router whose every value is a bf16 so: half the bytes a step, and the same logits,
// since a bf16 widens to its float32 exactly)
struct RouterRows {
  const void* data;
  bool bf16;

  static RouterRows of(const torch::Tensor& router) {
    return {router.data_ptr(), router.scalar_type() == at::kBFloat16};
  }
  // fn(rows) with rows a const float* or a const at::BFloat16*
  template <class Fn>
  void visit(Fn&& fn) const {
    if (bf16)
      fn(static_cast<const at::BFloat16*>(data));
    else
      fn(static_cast<const float*>(data));
  }
};

// Top-k routing of T tokens (bf16 x, T x K) over E experts (router rows E x K): each
// (token, expert) logit is dot(x_t, router_e, K), the extension's SIMD sum (a generic lambda
// over the rows' element type), then each token's
// choice (Chooser). The logits go over the threads as one run of pairs each, token-major: a
// prompt's tokens are shared out as before, and at decode's one or few tokens the threads
// split the experts' router rows (a whole E x K float32 router, 256 KiB for 32 experts of
// 2,048, 7 MiB for DeepSeek-V3's 256 of 7,168, was read by one thread a layer while the other
// waited). Which thread sums a pair never changes its bits; a token's choice depends on its
// own logits only.
template <class Dot>
void route_topk_with(const at::BFloat16* x, int64_t T, int64_t K, RouterRows router, int64_t E, int64_t top_k,
                     bool softmax, bool norm_topk, double norm_eps, double scaling, int64_t n_group,
                     int64_t topk_group, const float* bias, int64_t* ids, at::BFloat16* weights, Dot dot) {
  check(E, top_k, n_group, topk_group, bias != nullptr);
  std::vector<float> logits(T * E);
  router.visit([&](const auto* rows) {
    at::parallel_for(0, T * E, 4, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) logits[i] = dot(x + i / E * K, rows + i % E * K, K);
    });
  });
  at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
    Chooser chooser(E, top_k, softmax, norm_topk, norm_eps, scaling, n_group, topk_group, bias);
    for (int64_t t = begin; t < end; ++t) {
      std::copy(logits.begin() + t * E, logits.begin() + (t + 1) * E, chooser.scores.begin());
      chooser.choose(ids + t * top_k, weights + t * top_k);
    }
  });
}

// route_topk's tensor entry for either extension: bf16 x (T, K) and a float32 or bf16 router
// (E, K) (and bias, E values) checked, then into(x, T, K, router, E, top_k, ..., ids, weights)
// -> (T, top_k) int64 ids and bf16 weights
template <class Into>
std::vector<torch::Tensor> route_topk_tensors(const torch::Tensor& x, const torch::Tensor& router, int64_t top_k,
                                              bool softmax, bool norm_topk, double norm_eps, double scaling,
                                              int64_t n_group, int64_t topk_group,
                                              const c10::optional<torch::Tensor>& bias, Into into) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && router.dim() == 2 &&
                  (router.scalar_type() == at::kFloat || router.scalar_type() == at::kBFloat16) &&
                  router.device().is_cpu() && router.size(1) == x.size(1),
              "route_topk: (T, K) bf16 x and an (E, K) float32 or bf16 router");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->device().is_cpu() &&
                                    bias->numel() == router.size(0)),
              "route_topk: a float32 bias of one value an expert");
  auto xc = x.contiguous();
  auto rc = router.contiguous();
  torch::Tensor bc;
  if (bias.has_value()) bc = bias->contiguous();
  const int64_t T = xc.size(0);
  auto ids = torch::empty({T, top_k}, xc.options().dtype(at::kLong));
  auto weights = torch::empty({T, top_k}, xc.options());
  into(xc.data_ptr<at::BFloat16>(), T, xc.size(1), RouterRows::of(rc), rc.size(0), top_k, softmax, norm_topk,
       norm_eps, scaling, n_group, topk_group, bc.defined() ? bc.data_ptr<float>() : nullptr, ids.data_ptr<int64_t>(),
       weights.data_ptr<at::BFloat16>());
  return {ids, weights};
}

// The (token, choice) pairs of ids (T x k, row-major) sorted by expert, stably (a counting
// sort: argsort(stable) of the ids), each expert's tokens side by side: counts per expert,
// order[j] = the pair at place j, unsort[pair] = its place. Returns the experts used.
inline int64_t sort_by_expert(const int64_t* idp, int64_t pairs, int64_t E, std::vector<int64_t>& counts,
                              std::vector<int64_t>& order, std::vector<int64_t>& unsort) {
  counts.assign(E, 0);
  order.resize(pairs);
  unsort.resize(pairs);
  for (int64_t i = 0; i < pairs; ++i) {
    TORCH_CHECK(idp[i] >= 0 && idp[i] < E, "decode plan: expert id out of range");
    ++counts[idp[i]];
  }
  std::vector<int64_t> next(E, 0);
  int64_t used = 0;
  for (int64_t e = 0, start = 0; e < E; start += counts[e], ++e) {
    next[e] = start;
    used += counts[e] > 0;
  }
  for (int64_t i = 0; i < pairs; ++i) order[next[idp[i]]++] = i;
  for (int64_t j = 0; j < pairs; ++j) unsort[order[j]] = j;
  return used;
}

// Each of T positions within rotary tables of table_positions rows (`what` names the caller in
// the error): the kernels read a position's row of cos and sin unchecked
inline void check_positions(const char* what, int64_t T, const int64_t* positions, int64_t table_positions) {
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(positions[t] >= 0 && positions[t] < table_positions, what, ": position ", positions[t],
                " is outside the tables");
}

// Every index a decode step reads or writes, checked before it runs (a plan's kernels index
// without checks): each token's position within the rotary tables (positions rows), its slot
// within a pool of `pool` blocks of `block_size`, its context within its block table (width
// ids) and those ids within the pool. `plan` names the caller in the errors.
inline void check_step(const char* plan, int64_t T, const int64_t* positions, int64_t table_positions,
                       const int64_t* slots, const int64_t* context_lens, const int64_t* block_tables, int64_t width,
                       int64_t pool, int64_t block_size) {
  check_positions(plan, T, positions, table_positions);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < pool * block_size, plan, ": slot ", slots[t], " is outside the pool");
    TORCH_CHECK(context_lens[t] >= 1 && context_lens[t] <= width * block_size, plan, ": context length ",
                context_lens[t], " does not fit its table");
    for (int64_t i = 0; i < (context_lens[t] + block_size - 1) / block_size; ++i)
      TORCH_CHECK(block_tables[t * width + i] >= 0 && block_tables[t * width + i] < pool, plan,
                  ": block id outside the pool");
  }
}

// check_step for every layer's pool (layers alike checked once)
template <class Layers>
void check_step(const char* plan, int64_t T, const int64_t* positions, int64_t table_positions, const int64_t* slots,
                const int64_t* context_lens, const int64_t* block_tables, int64_t width, const Layers& layers) {
  int64_t pool = -1, block_size = -1;
  for (const auto& l : layers) {
    if (l.k_pool.size(0) == pool && l.k_pool.size(1) == block_size) continue;
    pool = l.k_pool.size(0), block_size = l.k_pool.size(1);
    check_step(plan, T, positions, table_positions, slots, context_lens, block_tables, width, pool, block_size);
  }
}

// p rotary values from src to dst, de-interleaved where asked ((x0, x1, x2, ..) -> (x0, x2, .., x1, x3, ..),
// what DeepseekAttention's unflatten / transpose / flatten does before the rotation): both
// plans' latent attention
inline void place_rope(const at::BFloat16* src, at::BFloat16* dst, int64_t p, bool interleave) {
  if (!interleave) {
    std::memcpy(dst, src, p * sizeof(at::BFloat16));
    return;
  }
  for (int64_t j = 0; j < p / 2; ++j) dst[j] = src[2 * j], dst[p / 2 + j] = src[2 * j + 1];
}

// A greedy run's next pass (DecodePlan.run_greedy): each row's last token's embedding into h,
// one position on, its slot from the row's block table, one more token to attend. tokens: the
// row's token of the pass before, at tokens[t * stride].
inline void next_greedy_pass(at::BFloat16* h, int64_t T, int64_t hidden, const at::BFloat16* embed, int64_t vocab,
                             const int64_t* tokens, int64_t stride, int64_t* positions, int64_t* slots,
                             int64_t* context_lens, const int64_t* block_tables, int64_t width, int64_t block_size) {
  for (int64_t t = 0; t < T; ++t) {
    const int64_t token = tokens[t * stride], p = ++positions[t];
    TORCH_CHECK(token >= 0 && token < vocab, "decode plan: token ", token, " is past the embedding's ", vocab);
    TORCH_CHECK(p / block_size < width, "decode plan: position ", p, " is past the row's block table");
    std::memcpy(h + t * hidden, embed + token * hidden, hidden * sizeof(at::BFloat16));
    slots[t] = block_tables[t * width + p / block_size] * block_size + p % block_size;
    ++context_lens[t];
  }
}

}  // namespace ridge_shared
