// y = x @ w^T (+ bias) for bfloat16 on AVX-512 BF16 CPUs, from weights packed once at load.
//
// Decode is a GEMV: every weight byte is read once per step, so the kernel's job is to
// stream W at memory bandwidth, and at batch 8-64 to keep the FMA units busy. The layout
// makes both easy: W is packed (pack_vnni) into blocks of 16 output rows x 2 k-values,
//
//   W [N, K]  ->  P [N/16][K/2][16][2]      P[nb][kp][r][j] = W[16 nb + r][2 kp + j]
//
// so one 64-byte load holds 16 outputs x one k-pair, vdpbf16ps multiplies it with a
// broadcast pair of x and accumulates 16 outputs in one register: no horizontal sums, and
// each block of 16 rows is one contiguous stream. A tile keeps up to 16 rows of x x one
// block (16 outputs each) in registers; threads take contiguous runs of blocks.
//
// Accumulation is fp32; the result is rounded once to bf16 (as F.linear does).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "linear_call.h"
#include <immintrin.h>
#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

using bf16 = at::BFloat16;
constexpr int64_t PREFETCH_PAIRS = 64;  // k-pairs ahead (4 KiB of a block's stream) into L1
constexpr int64_t SMALL_M = 64;  // decode-sized batches stream; larger ones (prefill) tile

// x rows of a tile, pair-major: xt[kp][i] = (x[i][2kp], x[i][2kp+1]) as one int32, so the MR
// broadcasts of a k-pair come from one cache line and x streams through L1 in order.
//
//   x [MR][K]  ->  xt [K/2][MR]
//
// One accumulator per row, summed in k order: every tile size (and the prefill tiles below)
// adds the same products in the same order, so a row's output does not depend on the batch
// it is in (batch invariance; splitting the sum over several accumulators for 1-2 rows was
// measured no faster here).
template <int MR>
inline void tile_block(const int32_t* xt, int64_t KP, const bf16* wp, float* out) {
  __m512 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < KP; ++kp) {
    const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void*)(wp + kp * 32));
    if constexpr (MR >= 8)  // FMA-heavy tiles: loads must be in flight early (see plan_tiles)
      _mm_prefetch((const char*)(wp + (kp + PREFETCH_PAIRS) * 32), _MM_HINT_T0);
    for (int i = 0; i < MR; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(xt[kp * MR + i]), wv);
  }
  for (int i = 0; i < MR; ++i) _mm512_storeu_ps(out + i * 16, acc[i]);
}

// A tile: rows [row0, row0 + rows) of x, padded to MR (4, 8, 12 or 16) zero rows.
struct Tile {
  int64_t row0, rows, mr, offset;  // offset: where its pair-major rows start in the xt buffer
};

// Tiles of 16 rows and one smaller last tile: the fewest zero rows, measured fastest at every M
// from 1 to 64 here.
// Software prefetch only for tiles of 8+ rows, whose FMAs would otherwise hold the loads back
// (without it 16 rows ran 30-40% slower); for 1-4 rows the hardware prefetcher does better
// alone (measured 5-13% faster at 1-2 rows, more in the high bandwidth level).
std::vector<Tile> plan_tiles(int64_t M, int64_t KP) {
  std::vector<Tile> tiles;
  int64_t offset = 0;
  for (int64_t r0 = 0; r0 < M; r0 += 16) {
    const int64_t rows = std::min<int64_t>(16, M - r0);
    const int64_t mr = rows <= 2 ? rows : rows <= 4 ? 4 : rows <= 8 ? 8 : rows <= 12 ? 12 : 16;
    tiles.push_back({r0, rows, mr, offset});
    offset += KP * mr;
  }
  return tiles;
}

template <int MR>
inline void run_tile(const Tile& t, const int32_t* xt, int64_t KP, const bf16* block, int64_t b, int64_t N,
                     const float* bias, bf16* y) {
  alignas(64) float buf[MR * 16];
  tile_block<MR>(xt + t.offset, KP, block, buf);
  const int64_t n0 = b * 16, n_end = std::min<int64_t>(N, n0 + 16);
  for (int64_t i = 0; i < t.rows; ++i) {
    bf16* yrow = y + (t.row0 + i) * N;
    for (int64_t n = n0; n < n_end; ++n) yrow[n] = bf16(buf[i * 16 + n - n0] + (bias ? bias[n] : 0.f));
  }
}

// Threads take contiguous runs of blocks, so each reads one contiguous stream of W (the
// pattern DRAM and the hardware prefetcher serve best); every tile of x passes over a block
// while it is in cache, so W is read from memory once whatever M is.
void gemm(const bf16* x, int64_t M, int64_t K, const bf16* wp, int64_t N, const float* bias, bf16* y) {
  const int64_t blocks = (N + 15) / 16, KP = (K + 1) / 2;
  const std::vector<Tile> tiles = plan_tiles(M, KP);
  std::vector<int32_t> xt(tiles.back().offset + KP * tiles.back().mr, 0);
  for (const Tile& t : tiles)
    for (int64_t i = 0; i < t.rows; ++i) {
      const uint16_t* row = reinterpret_cast<const uint16_t*>(x + (t.row0 + i) * K);
      int32_t* dst = xt.data() + t.offset + i;
      for (int64_t kp = 0; kp < KP; ++kp) {  // odd K: the last pair is (x[K-1], 0), as is the packed W
        const uint32_t lo = row[2 * kp], hi = 2 * kp + 1 < K ? row[2 * kp + 1] : 0;
        dst[kp * t.mr] = static_cast<int32_t>(lo | (hi << 16));
      }
    }
  at::parallel_for(0, blocks, 1, [&](int64_t b_begin, int64_t b_end) {
    for (int64_t b = b_begin; b < b_end; ++b) {
      const bf16* block = wp + b * KP * 32;
      for (const Tile& t : tiles) {
        switch (t.mr) {
          case 1: run_tile<1>(t, xt.data(), KP, block, b, N, bias, y); break;
          case 2: run_tile<2>(t, xt.data(), KP, block, b, N, bias, y); break;
          case 4: run_tile<4>(t, xt.data(), KP, block, b, N, bias, y); break;
          case 8: run_tile<8>(t, xt.data(), KP, block, b, N, bias, y); break;
          case 12: run_tile<12>(t, xt.data(), KP, block, b, N, bias, y); break;
          default: run_tile<16>(t, xt.data(), KP, block, b, N, bias, y);
        }
      }
    }
  });
}

template <int MR, int NB>
inline void tile(const bf16* x, int64_t ldx, int64_t K, const bf16* wp, int64_t KP, float* out, int64_t ldo) {
  __m512 acc[MR][NB];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t full_pairs = K / 2;
  for (int64_t kp = 0; kp < KP; ++kp) {
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) {
      const bf16* block = wp + (j * KP + kp) * 32;
      wv[j] = (__m512bh)_mm512_loadu_si512((const void*)block);
      _mm_prefetch((const char*)(block + PREFETCH_PAIRS * 32), _MM_HINT_T0);
    }
    for (int i = 0; i < MR; ++i) {
      int32_t pair;
      if (kp < full_pairs) {
        pair = *reinterpret_cast<const int32_t*>(x + i * ldx + 2 * kp);
      } else {  // odd K: the last pair is (x[K-1], 0); the packed weight is zero there too
        pair = *reinterpret_cast<const uint16_t*>(x + i * ldx + 2 * kp);
      }
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(out + i * ldo + 16 * j, acc[i][j]);
}

// Prefill (M > 64): tiles of 8 rows x 3 blocks, each group of blocks in cache while every
// tile of x passes (measured 5-15% faster than the streaming tiles at M = 256-1024).
// Blocks [b0, b0 + nb) of all M rows (x padded to a multiple of MR rows).
template <int MR, int NB>
inline void tile_any_nb(int64_t nb, const bf16* x, int64_t ldx, int64_t K, const bf16* wp, int64_t KP, float* out,
                        int64_t ldo) {
  if constexpr (NB > 1) {
    if (nb < NB) return tile_any_nb<MR, NB - 1>(nb, x, ldx, K, wp, KP, out, ldo);
  }
  tile<MR, NB>(x, ldx, K, wp, KP, out, ldo);
}

template <int MR, int NB>
void gemm_large_m(const bf16* x, int64_t M, int64_t K, const bf16* wp, int64_t N, const float* bias, bf16* y) {
  const int64_t blocks = (N + 15) / 16, KP = (K + 1) / 2;
  const int64_t groups = (blocks + NB - 1) / NB;
  const int64_t m_tiles = (M + MR - 1) / MR;
  at::parallel_for(0, groups, 1, [&](int64_t g_begin, int64_t g_end) {
    std::vector<float> buf(MR * NB * 16);
    for (int64_t g = g_begin; g < g_end; ++g) {
      const int64_t b0 = g * NB, nb = std::min<int64_t>(NB, blocks - b0);
      const int64_t n0 = b0 * 16, n_end = std::min<int64_t>(N, (b0 + nb) * 16);
      // The group's weights (nb x 16 rows) stay in cache while every tile of x passes.
      for (int64_t t = 0; t < m_tiles; ++t) {
        tile_any_nb<MR, NB>(nb, x + t * MR * K, K, K, wp + b0 * KP * 32, KP, buf.data(), NB * 16);
        const int64_t rows = std::min<int64_t>(MR, M - t * MR);
        for (int64_t i = 0; i < rows; ++i) {
          bf16* yrow = y + (t * MR + i) * N;
          const float* brow = buf.data() + i * NB * 16;
          for (int64_t n = n0; n < n_end; ++n) yrow[n] = bf16(brow[n - n0] + (bias ? bias[n] : 0.f));
        }
      }
    }
  });
}

}  // namespace

// Packed weights live in 2 MiB pages where the kernel allows it: streaming gigabytes through
// 4 KiB pages costs a TLB miss every 64 cache lines (torch's allocator does not ask for huge
// pages, and transparent huge pages here are "madvise" only).
torch::Tensor huge_page_empty(at::IntArrayRef shape, const at::TensorOptions& options) {
  constexpr size_t kHuge = 2u << 20;
  int64_t numel = 1;
  for (auto d : shape) numel *= d;
  const size_t bytes = static_cast<size_t>(numel) * options.dtype().itemsize();
  if (bytes < kHuge) return torch::empty(shape, options);
  const size_t rounded = (bytes + kHuge - 1) / kHuge * kHuge;
  void* ptr = nullptr;
  if (posix_memalign(&ptr, kHuge, rounded) != 0) return torch::empty(shape, options);
  madvise(ptr, rounded, MADV_HUGEPAGE);  // before the first touch, so faults take huge pages
  return torch::from_blob(ptr, shape, [](void* p) { std::free(p); }, options);
}

torch::Tensor pack_vnni(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.device().is_cpu(), "pack_vnni: (N, K) bf16 CPU");
  const int64_t N = w.size(0), K = w.size(1), NB = (N + 15) / 16, KP = (K + 1) / 2;
  auto out = huge_page_empty({NB, KP, 16, 2}, w.options());
  auto wc = w.contiguous();
  const bf16* src = wc.data_ptr<bf16>();
  bf16* dst = out.data_ptr<bf16>();
  // Block by block, written in order (each thread's pages are first touched by that thread):
  // a k-pair of 16 rows is 16 int32 reads, one per row stream, and one 64-byte write.
  at::parallel_for(0, NB, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      bf16* block = dst + nb * KP * 32;
      const int64_t rows = std::min<int64_t>(16, N - nb * 16);
      if (rows == 16 && K % 2 == 0) {
        // 16 x 16 int32 tiles: one cache line from each row, transposed through a buffer
        // (reading 4 bytes per row per k-pair hit 16 rows 2*K bytes apart: one L1 set, thrashed).
        const int32_t* s32 = reinterpret_cast<const int32_t*>(src + nb * 16 * K);
        int32_t* d32 = reinterpret_cast<int32_t*>(block);
        const int64_t row_pairs = K / 2;
        int32_t tile[16][16];
        int64_t kp = 0;
        for (; kp + 16 <= KP; kp += 16) {
          for (int64_t r = 0; r < 16; ++r) std::memcpy(tile[r], s32 + r * row_pairs + kp, sizeof(tile[r]));
          for (int64_t j = 0; j < 16; ++j)
            for (int64_t r = 0; r < 16; ++r) d32[(kp + j) * 16 + r] = tile[r][j];
        }
        for (; kp < KP; ++kp)
          for (int64_t r = 0; r < 16; ++r) d32[kp * 16 + r] = s32[r * row_pairs + kp];
      } else {  // a ragged edge: zero padding rows and the odd k
        std::memset(block, 0, KP * 32 * sizeof(bf16));
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t k = 0; k < K; ++k) block[((k / 2) * 16 + r) * 2 + k % 2] = src[(nb * 16 + r) * K + k];
      }
    }
  });
  return out;
}

torch::Tensor unpack_vnni(torch::Tensor packed, int64_t N, int64_t K) {
  const int64_t KP = packed.size(1);
  auto out = torch::empty({N, K}, packed.options());
  const bf16* src = packed.data_ptr<bf16>();
  bf16* dst = out.data_ptr<bf16>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) dst[n * K + k] = src[(((n / 16) * KP + k / 2) * 16 + n % 16) * 2 + k % 2];
  return out;
}

torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "linear_bf16: bfloat16 only");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "linear_bf16: CPU tensors only");
  LinearCall call(x, N, bias);
  const int64_t M = call.M, K = call.K;
  TORCH_CHECK(packed.dim() == 4 && packed.size(0) == (N + 15) / 16 && packed.size(1) == (K + 1) / 2,
              "linear_bf16: packed weight does not match (N, K)");
  bf16* y = call.y.data_ptr<bf16>();
  if (M <= SMALL_M) {
    if (M > 0) gemm(call.x2.data_ptr<bf16>(), M, K, packed.data_ptr<bf16>(), N, call.bias, y);
    return call.result();
  }
  auto x2 = call.x2;
  const int64_t padded = (M + 7) / 8 * 8;  // whole tiles of 8 rows (zeros; their outputs are dropped)
  if (padded != M) x2 = torch::cat({x2, torch::zeros({padded - M, K}, x2.options())});
  gemm_large_m<8, 3>(x2.data_ptr<bf16>(), M, K, packed.data_ptr<bf16>(), N, call.bias, y);
  return call.result();
}
