// The pool row of each token of a sequence, for the paged decode kernels:
//
//   token t  ->  slot = block_table[t / BS] * BS + t % BS  ->  row = slot * Hkv + h
//
// computed once per (sequence, KV head) by walking the block table (no division per token:
// a 64-bit divide per token and read path cost more than the arithmetic of a head).
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu_vendor.h"

// How far ahead of the token it reads a decode kernel fetches a token's K and V rows (and an
// int8 / fp8 cache's scales). A KV head's rows lie a pool row apart within a block and blocks
// anywhere in the pool, so the hardware prefetcher hardly helps; the fetch has to cover the
// memory's latency by itself. 16 tokens (one chunk, which these kernels fetched before) left
// them waiting: batch 16 at 4,096 tokens, TinyLlama's heads, 2-core AMD EPYC (Zen 5), both
// versions alternated in one process, 11-21 rounds: 64 tokens ran bf16 1.12-1.17x and int8
// 1.28-1.37x faster; 32 tokens less, 96 and 128 no better than 64.
//
// On AMD CPUs of family 25 and older (kv_fetch_into_l2) the rows that far ahead go into L2
// (prefetcht1), not L1: a job's 64 tokens of K rows (16
// KiB at 4 int8 heads of 64, 32 KiB in bf16) with the scores' and PV's own lines overran the
// 32 KiB L1, and the rows were read again from farther away (the loads of row_columns held a
// third of the int8 scores' samples, perf). The loads then hit L2 (14 cycles) and the core's
// own fetch covers that. 2-core AMD EPYC Zen 4, 8 layers' pools alternated in one process, 7
// rounds (benchmarks/decode_attention.py's pools): K's rows and PV's V rows into L2 against
// L1, 16 x 4,096 tokens bf16 1.44x, int8 1.33x; 1 x 4,096 bf16 1.55x, int8 1.41x; 16 x 1,024
// bf16 1.38x, int8 1.06x; 1 x 512 and 4 x 1,024 level (0.94-1.02x, within the rounds' noise).
// A near fetch into L1 (16 or 32 tokens ahead) on top of it was no faster. The Xeon measured K's
// fetch into L2 at 0.87-1.09x in stop 76's kernel (README, "A job reads its KV heads
// together") and Zen 5 never: both keep L1 until measured with these kernels. The kernels
// take the hint as a template argument (kv_hint), chosen once a call.
constexpr int64_t KV_PREFETCH_TOKENS = 64;

// Asked once a process: cpuid traps to the hypervisor in a VM (17 us a check on this project's
// 2-core EPYC), and each attention call asks
inline bool kv_fetch_into_l2() {
  static const bool l2 = ridge_shared::cpu_is_amd() && ridge_shared::cpu_family() < 0x1A;
  return l2;
}

template <bool L2>
constexpr _mm_hint kv_hint = L2 ? _MM_HINT_T1 : _MM_HINT_T0;

// A thread's buffer of n T for a decode kernel's call (scores, probabilities, rows), kept from
// call to call: grown when a call needs more, never shrunk, never zeroed (a call writes every
// element before it reads it). A std::vector made afresh each call zeroed its elements first:
// about 0.5 MB at 4,096 tokens, 6% of the AVX2 int8 kernel's samples (2-core Xeon). Declare it
// thread_local; what it holds is about what the longest call needed.
template <class T>
struct Scratch {
  std::unique_ptr<T[]> p;
  int64_t n = 0;
  T* get(int64_t want) {
    if (n < want) p.reset(new T[want]), n = want;  // default-initialized: no zeroing
    return p.get();
  }
};

// Tokens t0 .. t0 + n of a sequence (a chunk of its context): rows[i] for token t0 + i. A
// block's rows a run of stores through a local pointer, which the compiler vectorizes (through
// rows[i] it reloaded the vector's data pointer at each store: 4,096 tokens a job, a few percent
// of the int8 decode attention's samples at 16 x 4,096 tokens, 2-core AMD EPYC Zen 4).
inline void paged_rows_from(const int64_t* table, int64_t t0, int64_t n, int64_t BS, int64_t Hkv, int64_t h,
                            std::vector<int64_t>& rows) {
  rows.resize(n);
  int64_t* out = rows.data();
  for (int64_t i = 0, b = t0 / BS, o = t0 % BS; i < n; ++b, o = 0) {
    const int64_t first = (table[b] * BS + o) * Hkv + h, run = std::min<int64_t>(BS - o, n - i);
    for (int64_t k = 0; k < run; ++k) out[i + k] = first + k * Hkv;
    i += run;
  }
}

inline void paged_rows(const int64_t* table, int64_t L, int64_t BS, int64_t Hkv, int64_t h,
                       std::vector<int64_t>& rows) {
  paged_rows_from(table, 0, L, BS, Hkv, h, rows);
}

// One prefetch of the line at p, as _mm_prefetch(p, HINT), but an asm statement the compiler
// keeps. GCC 12 at -O3 deleted whole loops of _mm_prefetch (tree DCE: a prefetch is not a side
// effect) where they were reached through decode_attention_quant.cpp's generic lambdas: its
// fetch of the scales a chunk ahead had compiled to nothing since it was written, and its rows'
// fetch moved into such a lambda ran the int8 attention 1.45x slower (16 x 4,096 tokens, 2-core
// AMD EPYC Zen 4). With the scales' fetch running (in one process alternating both, 40 rounds):
// shuffled pools 16 x 4,096 tokens 1.10x, 4 x 1,024 level; ordered pools 0.99x.
template <_mm_hint HINT>
inline void prefetch_line(const void* p) {
  const char& m = *static_cast<const char*>(p);
  if constexpr (HINT == _MM_HINT_T0)
    asm volatile("prefetcht0 %0" : : "m"(m));
  else if constexpr (HINT == _MM_HINT_T1)
    asm volatile("prefetcht1 %0" : : "m"(m));
  else if constexpr (HINT == _MM_HINT_T2)
    asm volatile("prefetcht2 %0" : : "m"(m));
  else
    asm volatile("prefetchnta %0" : : "m"(m));
}

// Fetch the pool rows of tokens begin .. end (rows[t] rows of row_bytes into base, and the
// heads - 1 rows after each: a job's KV heads side by side), every line of each. A kernel calls
// it for a KV head's first KV_PREFETCH_TOKENS tokens as it starts the head, where its loops'
// fetch ahead has not begun: K's rows for the scores, V's (into L2) for the pass after them.
// Measured on 2 Zen 5 cores (2026-11-28), Q4_K_M's TinyLlama file at batch 1, both versions
// alternated in one process, 8 rounds each, the plan's attention time (whole steps within the
// runs' noise, 0.98-1.01x): 160 tokens bf16 1.05x and 1.10x (two runs), int8 1.10x; 1,100
// tokens bf16 1.00x and 1.02x, int8 1.05x.
template <_mm_hint HINT>
inline void prefetch_rows(const void* base, const int64_t* rows, int64_t begin, int64_t end, int64_t row_bytes,
                          int64_t heads = 1) {
  const char* b = static_cast<const char*>(base);
  for (int64_t t = begin; t < end; ++t)
    for (int64_t c = 0; c < heads * row_bytes; c += 64) prefetch_line<HINT>(b + rows[t] * row_bytes + c);
}

// prefetch_rows for the chunk of tokens begin .. end that a decode kernel fetches ahead (blocks
// of BS tokens, Hkv KV heads). Where it is 16 tokens of one block (BS a multiple of 16, begin of
// 16 too) their rows are rows[begin] + i Hkv, and the loop steps a pointer by a constant stride
// where the general one reads each token's row and multiplies. In the int8 decode attention's
// scores' loop (K's and V's chunk ahead), 2-core AMD EPYC Zen 4, ordered pools, in one process
// alternating both, 40 rounds: 16 x 4,096 tokens 1.03x; with qk_int8's query words and
// paged_rows_from's run stores, 16 x 4,096 1.05x, 1 x 4,096 1.08x, 4 x 1,024 1.06x. The bf16
// kernel's K fetch level (0.996x).
template <_mm_hint HINT>
inline void prefetch_chunk_rows(const void* base, const int64_t* rows, int64_t begin, int64_t end, int64_t row_bytes,
                                int64_t heads, int64_t BS, int64_t Hkv) {
  if (end - begin != 16 || BS % 16 != 0 || begin % 16 != 0) return prefetch_rows<HINT>(base, rows, begin, end, row_bytes, heads);
  const char* p = static_cast<const char*>(base) + rows[begin] * row_bytes;
  const int64_t stride = Hkv * row_bytes, run = heads * row_bytes;
  for (int i = 0; i < 16; ++i, p += stride)
    for (int64_t c = 0; c < run; c += 64) prefetch_line<HINT>(p + c);
}

// Fetch every line of the bytes [begin, end), each once
template <_mm_hint HINT>
inline void prefetch_stretch(const void* begin, const void* end) {
  const char* e = static_cast<const char*>(end);
  for (const char* p = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(begin) & ~uintptr_t{63}); p < e; p += 64)
    prefetch_line<HINT>(p);
}

// How many jobs a sequence's KV heads are cut into (a divisor of Hkv; each job takes Hkv / that
// many heads). A token's rows of all KV heads lie side by side in the pool (token_bytes of K
// and V together), so a job of one head reads one row of every Hkv; where a sequence's context
// (the batch's mean, all heads, K and V) is past a bound (kv_grouped_bound; times the jobs a sequence
// is cut into), the L2 cache no longer holds the lines the hardware fetched beside each row
// (the other heads') until those heads' jobs come, and they were read from memory again. There
// a job takes as many heads as still give the busiest thread the least work (threads take
// equal counts of jobs: at batch 1 on 2 threads, half the heads each) and reads each token's
// rows of its heads as one run (the int8 kernel without its fetch of V in the scores' pass;
// fp8, compute-bound, keeps one head a job). benchmarks/decode_attention.py, 2-core Xeon, 8
// layers' pools, grouped against one head a job on the same pools: bf16 TinyLlama's heads (32
// on 4, 64 dims) 16 x 4,096 tokens 1.32x, 16 x 2,048 1.17x, 1 x 4,096 1.08x; Llama-3-8B's (32
// on 8, 128 dims) 8 x 1,024 1.34x; int8 1.09-1.29x there; shorter contexts 0.89-1.0x grouped,
// and keep one head. The AVX2 kernels (avx2_ops.cpp) take the same bound: bf16 1.02-1.20x past
// it, int8 0.95-1.12x (bound by their arithmetic there). The bound is the process's setting
// (either extension's set_kv_grouped_bytes: 0 groups every call, a huge one none), so that the
// benchmark compares them on the same pools; which heads a job takes never changes a result.
//
// With K's and V's rows fetched ahead into L2 (KV_PREFETCH_TOKENS), the AVX-512 kernels on Zen
// 4 read one head a job faster nearly everywhere: 2-core AMD EPYC Zen 4, 2026-12-04,
// benchmarks/decode_attention.py, 9 rounds, grouped (the 1 MiB bound) against one head a job:
// TinyLlama's heads 16 x 4,096 tokens bf16 0.98x, int8 0.93x; 16 x 2,048 0.94x, 0.92x; Llama-3-8B's
// 8 x 1,024 0.97x, 0.78x, 1 x 4,096 0.85x, 0.89x; Qwen's (28 on 4, 128 dims) 4 x 2,048 0.75x,
// 0.91x; only batch 1 of TinyLlama's heads at 2,048-4,096 tokens gained (int8 1.03-1.07x, bf16
// 0.95-1.04x). So the AVX-512 kernels' own bound is never on AMD CPUs of family 25 and older
// (kv_grouped_default); the Xeon and Zen 5, where grouping was measured with the rows fetched
// into L1 and not since, and the AVX2 kernels keep 1 MiB.
constexpr int64_t KV_GROUPED_BYTES = int64_t{1} << 20;
constexpr int64_t KV_GROUPED_NEVER = int64_t{1} << 62;
// The process's setting: -1 (each kernel set its own bound), or a bound every kernel takes
// (set_kv_grouped_bytes). Read by each call; written only between calls.
inline int64_t g_kv_grouped_bytes = -1;

// The AVX-512 kernels' own bound on this CPU (see above): never where they fetch the rows into L2
inline int64_t kv_grouped_default() { return kv_fetch_into_l2() ? KV_GROUPED_NEVER : KV_GROUPED_BYTES; }

// The bound a kernel set whose own is own_bound takes now
inline int64_t kv_grouped_bound(int64_t own_bound) { return g_kv_grouped_bytes >= 0 ? g_kv_grouped_bytes : own_bound; }

// The setting's bindings, for each extension's module (own_bound: its kernels' own). An inline
// variable is one object in the process (GCC makes it a unique global): where both extensions
// are loaded, a bound set through either holds for both, and None gives each its own back.
template <class Module>
void def_kv_grouped_bytes(Module& m, int64_t own_bound) {
  m.def("kv_grouped_bytes", [own_bound] { return kv_grouped_bound(own_bound); },
        "the mean context (bytes of K and V, all heads) past which a decode attention job takes several KV heads");
  m.def("kv_grouped_default", [own_bound] { return own_bound; }, "this extension's own bound on this CPU");
  m.def("set_kv_grouped_bytes", [](std::optional<int64_t> n) {
    TORCH_CHECK(!n || *n >= 0, "kv_grouped_bytes: a byte count >= 0, or None");
    g_kv_grouped_bytes = n ? *n : -1;
  }, "change it for every kernel set (between kernel calls; 0: always, a huge one: never; None: each its own); "
     "never changes a result");
}

inline int64_t kv_head_jobs(int64_t B, int64_t Hkv, const int64_t* lens, int64_t token_bytes, int64_t bound) {
  if (B == 0) return Hkv;
  int64_t tokens = 0;
  for (int64_t b = 0; b < B; ++b) tokens += lens[b];
  const int64_t threads = at::get_num_threads();
  int64_t split = 1;
  for (int64_t s = 2; s <= Hkv; ++s)  // the busiest thread's sequences' worth: ceil(B s / threads) / s
    if (Hkv % s == 0 && (B * s + threads - 1) / threads * split < (B * split + threads - 1) / threads * s) split = s;
  // a job of 1 / split of the heads reads runs split times shorter: it pays past a context
  // split times longer (batch 1 on 2 threads, half the heads a job: 1,900 tokens 0.97x, 3,000 1.05x)
  return tokens * token_bytes / B / split > bound ? split : Hkv;
}

// Tokens a run of the decode kernels' PV pass where a job has several KV heads: the run's rows
// of the job's heads stay in L1 while each head (and each 32 or 64 of its dims) sums over
// them, its accumulators in registers over the run and in memory between runs
constexpr int64_t PV_TOKENS = 32;
// The same for a cache of 1-byte codes (decode_attention_quant.cpp: even, its PV takes tokens in
// pairs): its rows are half as long, and a run's fixed costs (each cut's accumulators loaded and
// stored, its pointers set up) were a fifth of its PV's samples at 32. 2-core AMD EPYC Zen 4, 8
// layers' pools alternated in one process, 7 rounds: 64 tokens against 32, with the weights laid
// out by chunks (pair_word), int8 16 x 4,096 tokens 1.08x, 1 x 4,096 1.20x, 4 x 1,024 1.08x
// (the layout alone 1.04x, 1.10x, 0.99x); 128 no faster than 64.
constexpr int64_t PV_CODE_TOKENS = 64;

// fn(std::integral_constant<int, n>) for n in [1, 8]: the query heads a KV head's kernels take at
// once (avx2_ops.cpp's scores and PV, decode_attention_quant.cpp's softmax)
template <class Fn>
inline void with_heads(int64_t n, Fn&& fn) {
  switch (n) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    case 4: fn(std::integral_constant<int, 4>{}); break;
    case 5: fn(std::integral_constant<int, 5>{}); break;
    case 6: fn(std::integral_constant<int, 6>{}); break;
    case 7: fn(std::integral_constant<int, 7>{}); break;
    default: fn(std::integral_constant<int, 8>{}); break;
  }
}

// The PV pass's cuts of a KV head's G query heads and D dims (a multiple of 16): fn(heads,
// dims16, g0, d0) once a cut, its head count and its count of 16 dims as constants
// (std::integral_constant), so that each cut's accumulators stay in registers. 8 heads x 32
// dims where G is a multiple of 8 (each V value widened or dequantized once for 8 heads: 4
// heads x 64 dims widened each twice and ran 1.14x slower in bf16 for TinyLlama's 8 heads a
// group at 4,096 tokens, 2-core Xeon; int8 1.09x over 22 layers), else 4 heads x up to 64 dims.
// A head's sums take the same products in the same order either way.
template <class Fn>
inline void pv_cuts(int64_t G, int64_t D, Fn&& fn) {
  using std::integral_constant;
  if (G % 8 == 0) {
    for (int64_t g0 = 0; g0 < G; g0 += 8)
      for (int64_t d0 = 0; d0 < D; d0 += 32) {
        if (D - d0 >= 32)
          fn(integral_constant<int, 8>{}, integral_constant<int, 2>{}, g0, d0);
        else
          fn(integral_constant<int, 8>{}, integral_constant<int, 1>{}, g0, d0);
      }
    return;
  }
  const auto dims = [&](auto heads, int64_t g0, int64_t d0) {
    switch (std::min<int64_t>(4, (D - d0) / 16)) {
      case 1: return fn(heads, integral_constant<int, 1>{}, g0, d0);
      case 2: return fn(heads, integral_constant<int, 2>{}, g0, d0);
      case 3: return fn(heads, integral_constant<int, 3>{}, g0, d0);
      default: return fn(heads, integral_constant<int, 4>{}, g0, d0);
    }
  };
  for (int64_t g0 = 0; g0 < G; g0 += 4)
    for (int64_t d0 = 0; d0 < D; d0 += 64) switch (std::min<int64_t>(4, G - g0)) {
        case 1: dims(integral_constant<int, 1>{}, g0, d0); break;
        case 2: dims(integral_constant<int, 2>{}, g0, d0); break;
        case 3: dims(integral_constant<int, 3>{}, g0, d0); break;
        default: dims(integral_constant<int, 4>{}, g0, d0);
      }
}
