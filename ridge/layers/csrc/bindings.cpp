// Python bindings of ridge's CPU kernels (one extension, several sources).
#include <torch/extension.h>
#include <pybind11/stl.h>

#include "kernels.h"
#include "paged_rows.h"
#include "step_parts.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Each call releases the GIL while it computes (ATen needs none): a server's event loop
  // answers health checks and streams tokens meanwhile.
  namespace py = pybind11;
  m.def("pack_vnni", &pack_vnni, py::call_guard<py::gil_scoped_release>(), "(N, K) bf16 -> (N/16, K/2, 16, 2) blocks for linear_bf16");
  m.def("unpack_vnni", &unpack_vnni, py::call_guard<py::gil_scoped_release>(), "the inverse of pack_vnni");
  m.def("linear_bf16", &linear_bf16, py::call_guard<py::gil_scoped_release>(), "y = x @ W.T (+ bias) with W packed by pack_vnni; bfloat16, AVX-512 BF16");
  m.def("linear_bf16_grouped", &linear_bf16_grouped, py::call_guard<py::gil_scoped_release>(),
        "stacked experts: x rows sorted by expert (counts per expert) times each expert's rows of W");
  m.def("linear_quant_grouped", &linear_quant_grouped, py::call_guard<py::gil_scoped_release>(), "linear_bf16_grouped for Q8_0 / Q4_0 / Q4_1 weights");
  m.def("linear_bf16_uses_amx", &linear_bf16_uses_amx, py::call_guard<py::gil_scoped_release>(), "whether linear_bf16 runs 2+ rows on AMX tiles for this K");
  m.def("amx_int8_ready", &amx_int8_ready, py::call_guard<py::gil_scoped_release>(), "whether linear_quant runs 2+ rows on AMX-INT8 tiles");
  m.def("prefetch_policy", &prefetch_policy, "the streaming kernels' prefetch policy (linear_call.h)");
  m.def("prefetch_preset", &prefetch_preset, "a vendor's policy: amd, intel, or cpu (this CPU's vendor)");
  m.def("set_prefetch_policy", &set_prefetch_policy, "change the keys given (between kernel calls)");
  m.def("prefetch_error", &prefetch_error, "why a preset and values make no policy (\"\" when they do)");
  m.def("pack_quant", &pack_quant, py::call_guard<py::gil_scoped_release>(), "(N, K/32 * type_size) GGUF blocks -> blocks of 16 rows for linear_quant");
  m.def("unpack_quant", &unpack_quant, py::call_guard<py::gil_scoped_release>(), "the inverse of pack_quant");
  m.def("linear_quant", &linear_quant, py::call_guard<py::gil_scoped_release>(),
        "y = x @ W.T (+ bias) with W in Q8_0 / Q4_0 / Q4_1 (fmt 0 / 1 / 2) packed by pack_quant; AVX-512 VNNI");
  m.def("rms_norm_bf16", &rms_norm_bf16, py::call_guard<py::gil_scoped_release>(), "RMSNorm, rounded like Hugging Face's bf16 path");
  m.def("add_rms_norm_bf16", &add_rms_norm_bf16, py::call_guard<py::gil_scoped_release>(), "residual += x (in place), then RMSNorm(residual)");
  m.def("rope_bf16_", &rope_bf16_, py::call_guard<py::gil_scoped_release>(), "rotate-half RoPE in place on (T, H, D) rows");
  m.def("silu_mul_bf16", &silu_mul_bf16, py::call_guard<py::gil_scoped_release>(), "silu(gate) * up for (T, 2I) -> (T, I)");
  m.def("route_topk", &route_topk, py::call_guard<py::gil_scoped_release>(),
        "an MoE's top-k routing, greedy or group-limited (n_group, topk_group, bias): (ids, bf16 weights), best first");
  def_kv_grouped_bytes(m, kv_grouped_default());  // these kernels' own bound on this CPU (paged_rows.h)
  ridge_shared::def_step_parts(m);
  m.def("paged_decode_attention_bf16", &paged_decode_attention_bf16, py::call_guard<py::gil_scoped_release>(),
        "one query per sequence over its paged K/V, no gather");
  m.def("paged_decode_attention_quant", &paged_decode_attention_quant, py::call_guard<py::gil_scoped_release>(),
        "one query per sequence over an int8 / fp8 paged K/V with per-token-head fp16 scales");
  m.def("paged_decode_attention", &paged_decode_attention, py::call_guard<py::gil_scoped_release>(),
        "the same for any head size, float32 or bfloat16 (portable loops)");
  m.def("paged_decode_attention_shared", &paged_decode_attention_shared, py::call_guard<py::gil_scoped_release>(),
        "bf16 decode attention of many heads on one KV head (MLA's latent): heads in lanes, the context split over threads");
  m.def("paged_decode_attention_shared_quant", &paged_decode_attention_shared_quant, py::call_guard<py::gil_scoped_release>(),
        "the same over an int8 / fp8 latent cache (codes and fp16 scales per 32 dims), float32 or bfloat16 q");
  m.def("head_matmul_bf16", &head_matmul_bf16, py::call_guard<py::gil_scoped_release>(),
        "y[d][h] = x[d][h] @ w[h]: x (D, H, K), w (H, K, N) bf16 (MLA's absorbed W_uk and W_uv^T)");
  m.def("head_matmul_quant", &head_matmul_quant, py::call_guard<py::gil_scoped_release>(),
        "the same with head h's N x K matrix in a block format: a stacked (H N, K) weight's packed blocks");
  m.def("apply_token_bitmask_", &apply_token_bitmask_, py::call_guard<py::gil_scoped_release>(),
        "structured output: -inf in place for the tokens a row's int32 bitmask does not allow");
  m.def("argmax_rows", &argmax_rows, py::call_guard<py::gil_scoped_release>(),
        "greedy sampling: each row's index of its largest logit (torch.argmax's: the first of equal maxima, a NaN first)");
  bind_decode_plan(m);
}
