// The pool row of each token of a sequence, for the paged decode kernels:
//
//   token t  ->  slot = block_table[t / BS] * BS + t % BS  ->  row = slot * Hkv + h
//
// computed once per (sequence, KV head) by walking the block table (no division per token:
// a 64-bit divide per token and read path cost more than the arithmetic of a head).
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

// How far ahead of the token it reads a decode kernel fetches a token's K and V rows (and an
// int8 / fp8 cache's scales). A KV head's rows lie a pool row apart within a block and blocks
// anywhere in the pool, so the hardware prefetcher hardly helps; the fetch has to cover the
// memory's latency by itself. 16 tokens (one chunk, which these kernels fetched before) left
// them waiting: batch 16 at 4,096 tokens, TinyLlama's heads, 2-core AMD EPYC (Zen 5), both
// versions alternated in one process, 11-21 rounds: 64 tokens ran bf16 1.12-1.17x and int8
// 1.28-1.37x faster; 32 tokens less, 96 and 128 no better than 64.
constexpr int64_t KV_PREFETCH_TOKENS = 64;

// Tokens t0 .. t0 + n of a sequence (a chunk of its context): rows[i] for token t0 + i.
inline void paged_rows_from(const int64_t* table, int64_t t0, int64_t n, int64_t BS, int64_t Hkv, int64_t h,
                            std::vector<int64_t>& rows) {
  rows.resize(n);
  for (int64_t i = 0, b = t0 / BS, o = t0 % BS; i < n; ++b, o = 0) {
    const int64_t slot0 = table[b] * BS;
    for (; o < BS && i < n; ++o, ++i) rows[i] = (slot0 + o) * Hkv + h;
  }
}

inline void paged_rows(const int64_t* table, int64_t L, int64_t BS, int64_t Hkv, int64_t h,
                       std::vector<int64_t>& rows) {
  paged_rows_from(table, 0, L, BS, Hkv, h, rows);
}

// Fetch the pool rows of tokens begin .. end (rows[t] rows of row_bytes into base), every line
// of each. A kernel calls it for a KV head's first KV_PREFETCH_TOKENS tokens as it starts the
// head, where its loops' fetch ahead has not begun: K's rows for the scores, V's (into L2) for
// the pass after them. Measured on 2 Zen 5 cores (2026-11-28), Q4_K_M's TinyLlama file at
// batch 1, both versions alternated in one process, 8 rounds each, the plan's attention time
// (whole steps within the runs' noise, 0.98-1.01x): 160 tokens bf16 1.05x and 1.10x (two runs),
// int8 1.10x; 1,100 tokens bf16 1.00x and 1.02x, int8 1.05x.
template <_mm_hint HINT>
inline void prefetch_rows(const void* base, const int64_t* rows, int64_t begin, int64_t end, int64_t row_bytes) {
  const char* b = static_cast<const char*>(base);
  for (int64_t t = begin; t < end; ++t)
    for (int64_t c = 0; c < row_bytes; c += 64) _mm_prefetch(b + rows[t] * row_bytes + c, HINT);
}
