// What every packed linear kernel does around its GEMM: x viewed as (M, K) rows, y (M, N)
// in x's dtype, the bias as fp32, and the result back in x's leading shape.
#pragma once
#include <torch/extension.h>

#include <vector>

#include "weight_arena.h"

// Packed weights, carved from shared slabs of 2 MiB pages (weight_arena.h)
using ridge_shared::huge_page_empty;

// How far ahead of its loads a streaming kernel (bf16 and every block format) fetches each line
// of its weights into L2 (prefetcht2), and a block-format kernel each group into L1
// (prefetcht0); prefetch.cpp says why and what each machine measured. The distances are
// constants (a distance read at run time cost 2-6% in cache at one row: the offsets left the
// instructions' immediates); whether and for which tiles the kernels fetch is the process's
// policy, read by each call. Its default is the table of the CPU's vendor in prefetch.cpp (what
// was last measured best on that machine); RIDGE_PREFETCH (cpu_kernels.py) or
// set_prefetch_policy between calls change it, so benchmarks/prefetch.py compares the tables on
// the same bytes. Where a line is fetched never changes a result.
constexpr int64_t L2_PREFETCH_AHEAD = 64 * 1024;
constexpr int64_t L1_PREFETCH_GROUPS = 8;  // block formats: groups of 32 k ahead

struct PrefetchPolicy {
  int64_t bf16_far;          // 1: bf16 fetches L2_PREFETCH_AHEAD ahead (block formats always fetch far); 0: not
  int64_t quant_near_rows;   // block formats: tiles of at least this many rows fetch L1_PREFETCH_GROUPS ahead
  int64_t quant_near_every;  // ... 1: every line of that group; 0: its first line and the one 256 bytes on
  int64_t int8_near_rows;    // quant_near_rows for the int8 (Q8_0) kernel, which does the least work a byte
  int64_t quant_far_nta;     // block formats: 1: the far fetch is prefetchnta; 0: prefetcht2
  int64_t quant_far_lines;   // block formats: 1: the far fetch walks its window line by line, each line
                             // once, where linear_quant.cpp's LINE_WALK says; 0: a chunk's lines a group
  int64_t quant_far_kib;     // block formats: how far ahead one-row tiles fetch, in KiB (other tiles
                             // fetch L2_PREFETCH_AHEAD ahead)
  int64_t quant_interleave;  // block formats: 1: a group's far and near fetches go one after each of
                             // its weight loads (VNNI tiles; linear_quant.cpp's GroupFetches); 0: in a
                             // run before the loads
  // Not fetches but the other choices of the loops that the CPUs measured apart, kept in the
  // same per-CPU table: Q3_K tiles of this many rows up to 8 broadcast each x code with its own
  // vpbroadcastd rather than vpdpbusd's embedded broadcast (linear_quant.cpp; 17: never) ...
  int64_t q3_k_set1_rows;
  // ... and block formats' VNNI tiles of this many rows or more unpack the codes' bits by shifts
  // and masks rather than GFNI (linear_quant.cpp's load_weights; tiles of 1-2 rows never do;
  // 17: none)
  int64_t quant_shift_rows;
  // block formats' VNNI tiles: 1: the far fetch takes only the scales of the block after this
  // one (into L2, spread over this block's groups) and leaves the codes, a block's one long
  // stream, to the hardware prefetcher; 0: every line far_ahead on (prefetch.cpp says what each
  // CPU measured; linear_quant.cpp builds the two as separate loops)
  int64_t quant_far_scales;
  // block formats: 1: every other call gives the threads their runs in reverse order, so the
  // thread whose run ended at one call's last block starts the next call at its first block,
  // and its far fetch runs on past that last block by the window. A decode step's matrices lie
  // end to end in the order its calls read them (weight_arena.h), so that thread's stream goes
  // on from call to call instead of starting over; 0: each thread's run at the same place
  // every call
  int64_t quant_alternate;
};
extern PrefetchPolicy g_prefetch;  // read by the kernels; written only between calls

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
