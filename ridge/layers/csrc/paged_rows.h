// The pool row of each token of a sequence, for the paged decode kernels:
//
//   token t  ->  slot = block_table[t / BS] * BS + t % BS  ->  row = slot * Hkv + h
//
// computed once per (sequence, KV head) by walking the block table (no division per token:
// a 64-bit divide per token and read path cost more than the arithmetic of a head).
#pragma once
#include <cstdint>
#include <vector>

inline void paged_rows(const int64_t* table, int64_t L, int64_t BS, int64_t Hkv, int64_t h,
                       std::vector<int64_t>& rows) {
  rows.resize(L);
  for (int64_t t = 0, b = 0; t < L; ++b) {
    const int64_t slot0 = table[b] * BS;
    for (int64_t o = 0; o < BS && t < L; ++o, ++t) rows[t] = (slot0 + o) * Hkv + h;
  }
}
