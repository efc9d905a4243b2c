// The pool row of each token of a sequence, for the paged decode kernels:
//
//   token t  ->  slot = block_table[t / BS] * BS + t % BS  ->  row = slot * Hkv + h
//
// computed once per (sequence, KV head) by walking the block table (no division per token:
// a 64-bit divide per token and read path cost more than the arithmetic of a head).
#pragma once
#include <cstdint>
#include <vector>

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
