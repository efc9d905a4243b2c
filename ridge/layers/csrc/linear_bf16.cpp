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

#include "amx.h"
#include "linear_call.h"
#include <cpuid.h>
#include <immintrin.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
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
inline void tile_block(const int32_t* xt, int64_t KP, const bf16* wp, const char* pf_end, float* out) {
  __m512 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  // the process's policy (linear_call.h): no far fetch is an end no line lies before
  const char* far_end = g_prefetch.bf16_far ? pf_end : reinterpret_cast<const char*>(wp);
  for (int64_t kp = 0; kp < KP; ++kp) {
    const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void*)(wp + kp * 32));
    const char* ahead = (const char*)(wp + kp * 32) + L2_PREFETCH_AHEAD;  // far ahead, into L2
    if (ahead < far_end) _mm_prefetch(ahead, _MM_HINT_T2);
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
// Software prefetch into L1 only for tiles of 8+ rows, whose FMAs would otherwise hold the loads
// back (without it 16 rows ran 30-40% slower); for 1-4 rows the hardware prefetcher does better
// alone (measured 5-13% faster at 1-2 rows on the AMD machine, more in its high bandwidth
// level, before any L2 prefetch); whether it also fetches far ahead into L2 is the process's
// policy (bf16_far, linear_call.h).
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
inline void run_tile(const Tile& t, const int32_t* xt, int64_t KP, const bf16* block, const char* pf_end, int64_t b,
                     int64_t N, const float* bias, bf16* y) {
  alignas(64) float buf[MR * 16];
  tile_block<MR>(xt + t.offset, KP, block, pf_end, buf);
  const int64_t n0 = b * 16, n_end = std::min<int64_t>(N, n0 + 16);
  for (int64_t i = 0; i < t.rows; ++i) {
    bf16* yrow = y + (t.row0 + i) * N;
    for (int64_t n = n0; n < n_end; ++n) yrow[n] = bf16(buf[i * 16 + n - n0] + (bias ? bias[n] : 0.f));
  }
}

// M rows of x as the streaming kernel reads them: their tiles and pair-major rows
struct StreamRows {
  std::vector<Tile> tiles;
  std::vector<int32_t> xt;

  StreamRows(const bf16* x, int64_t M, int64_t K) {
    const int64_t KP = (K + 1) / 2;
    tiles = plan_tiles(M, KP);
    xt.assign(tiles.back().offset + KP * tiles.back().mr, 0);
    for (const Tile& t : tiles)
      for (int64_t i = 0; i < t.rows; ++i) {
        const uint16_t* row = reinterpret_cast<const uint16_t*>(x + (t.row0 + i) * K);
        int32_t* dst = xt.data() + t.offset + i;
        for (int64_t kp = 0; kp < KP; ++kp) {  // odd K: the last pair is (x[K-1], 0), as is the packed W
          const uint32_t lo = row[2 * kp], hi = 2 * kp + 1 < K ? row[2 * kp + 1] : 0;
          dst[kp * t.mr] = static_cast<int32_t>(lo | (hi << 16));
        }
      }
  }

  // every tile over block b (its 16 outputs of y's N)
  void run_block(const bf16* block, const char* pf_end, int64_t b, int64_t KP, int64_t N, const float* bias,
                 bf16* y) const {
    for (const Tile& t : tiles) {
      switch (t.mr) {
        case 1: run_tile<1>(t, xt.data(), KP, block, pf_end, b, N, bias, y); break;
        case 2: run_tile<2>(t, xt.data(), KP, block, pf_end, b, N, bias, y); break;
        case 4: run_tile<4>(t, xt.data(), KP, block, pf_end, b, N, bias, y); break;
        case 8: run_tile<8>(t, xt.data(), KP, block, pf_end, b, N, bias, y); break;
        case 12: run_tile<12>(t, xt.data(), KP, block, pf_end, b, N, bias, y); break;
        default: run_tile<16>(t, xt.data(), KP, block, pf_end, b, N, bias, y);
      }
    }
  }
};

// Threads take contiguous runs of blocks, so each reads one contiguous stream of W (the
// pattern DRAM and the hardware prefetcher serve best); every tile of x passes over a block
// while it is in cache, so W is read from memory once whatever M is.
void gemm(const bf16* x, int64_t M, int64_t K, const bf16* wp, int64_t N, const float* bias, bf16* y) {
  const int64_t blocks = (N + 15) / 16, KP = (K + 1) / 2;
  const StreamRows rows(x, M, K);
  at::parallel_for(0, blocks, 1, [&](int64_t b_begin, int64_t b_end) {
    const char* pf_end = reinterpret_cast<const char*>(wp + b_end * KP * 32);  // this thread's run of W ends
    for (int64_t b = b_begin; b < b_end; ++b) rows.run_block(wp + b * KP * 32, pf_end, b, KP, N, bias, y);
  });
}

// Stacked experts on the streaming kernel in one pass of the threads: expert experts[i]'s
// rows (counts of them from row first[i] of x and y) through its N rows of the stacked W.
// Threads take contiguous runs of all the experts' blocks together (one fork and join, not
// one per expert), and each tile computes what gemm computes for that expert's rows alone.
void gemm_experts(const bf16* x, const std::vector<int64_t>& experts, const std::vector<int64_t>& first,
                  const std::vector<int64_t>& counts, int64_t K, const bf16* wp, int64_t N, bf16* y) {
  const int64_t blocks = N / 16, KP = (K + 1) / 2, expert_elems = blocks * KP * 32;
  const int64_t n = static_cast<int64_t>(experts.size());
  std::vector<StreamRows> rows;
  rows.reserve(n);
  for (int64_t i = 0; i < n; ++i) rows.emplace_back(x + first[i] * K, counts[i], K);
  at::parallel_for(0, n * blocks, 1, [&](int64_t j_begin, int64_t j_end) {
    for (int64_t j = j_begin; j < j_end; ++j) {
      const int64_t i = j / blocks, b = j % blocks;
      const bf16* w = wp + experts[i] * expert_elems;
      // this thread's run of this expert's blocks ends (the next expert's W lies elsewhere)
      const char* pf_end = reinterpret_cast<const char*>(w + std::min(blocks, j_end - i * blocks) * KP * 32);
      rows[i].run_block(w + b * KP * 32, pf_end, b, KP, N, nullptr, y + first[i] * N);
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

// ---- AMX (Intel's tile matrix unit: Sapphire Rapids and later) ---------------------------
//
// The packed layout is already AMX's B-tile layout: 16 consecutive k-pairs of a block,
//
//   B tile (16 rows x 64 bytes) = P[nb][kp0 .. kp0 + 15][16][2]   (stride 64 bytes)
//
// and x rows are A tiles as they lie (16 rows x 32 bf16, stride 2 K). One tdpbf16ps adds a
// 32-k slice of up to 16 rows x 16 outputs into a C tile (16 x 16 fp32), at 16x the FMA rate
// of vdpbf16ps: with it a step of 2-32 rows still costs about one read of W (the AVX-512
// kernel turns compute-bound at ~4 rows on 2 cores here: 5 rows cost 1.45x one row, 32 rows
// 5x; on AMX 1.1x and 1.8x). One row stays on the AVX-512 kernel, which streams W ~10%
// faster (measured, interleaved). Each C row sums its k slices in order whatever M is or
// which tile the row sits in, so every M >= 2 (decode and prefill) gives a row the same bits;
// a row computed alone (M = 1, AVX-512) differs from it in rounding.
constexpr int ARCH_REQ_XCOMP_PERM = 0x1023;
constexpr int64_t AMX_PREFETCH = 128;  // k values ahead (4 KiB of a block's stream)
constexpr int XFEATURE_XTILEDATA = 18;

// C tiles 0-1 (two blocks of 16 outputs), A tile 2 (x rows), B tiles 3-4 (the two blocks).
inline void configure_tiles(int rows) {
  TileConfig cfg;
  for (int t : {0, 1, 2}) cfg.rows[t] = static_cast<uint8_t>(rows), cfg.colsb[t] = 64;
  for (int t : {3, 4}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  load_tile_config(cfg);
}

// rows [0, mt) of x (stride K) times blocks wb0 (and wb1 if given) into buf0 / buf1 (16 x 16).
inline void amx_rows_blocks(const bf16* x, int64_t K, const bf16* wb0, const bf16* wb1, float* buf0, float* buf1) {
  _tile_zero(0);
  if (wb1) _tile_zero(1);
  for (int64_t k = 0; k < K; k += 32) {
    if (k + AMX_PREFETCH < K)  // the B slices AMX_PREFETCH k ahead (16 lines each) into L2
      for (int line = 0; line < 16; ++line) {
        _mm_prefetch((const char*)(wb0 + (k + AMX_PREFETCH) * 16) + 64 * line, _MM_HINT_T1);
        if (wb1) _mm_prefetch((const char*)(wb1 + (k + AMX_PREFETCH) * 16) + 64 * line, _MM_HINT_T1);
      }
    _tile_loadd(2, x + k, K * sizeof(bf16));
    _tile_loadd(3, wb0 + k * 16, 64);
    _tile_dpbf16ps(0, 2, 3);
    if (wb1) {
      _tile_loadd(4, wb1 + k * 16, 64);
      _tile_dpbf16ps(1, 2, 4);
    }
  }
  _tile_stored(0, buf0, 64);
  if (wb1) _tile_stored(1, buf1, 64);
}

inline void store_rows(const float* buf, int64_t rows, int64_t row0, int64_t b, int64_t N, const float* bias, bf16* y) {
  const int64_t n0 = b * 16, n_end = std::min<int64_t>(N, n0 + 16);
  for (int64_t i = 0; i < rows; ++i) {
    bf16* yrow = y + (row0 + i) * N;
    for (int64_t n = n0; n < n_end; ++n) yrow[n] = bf16(buf[i * 16 + n - n0] + (bias ? bias[n] : 0.f));
  }
}

// Threads take contiguous runs of blocks (one stream of W each). Blocks are taken in panels
// that stay in L2 while every 16-row tile of x passes over them: for decode a panel is read
// once from memory; for prefill x is re-read per panel (from cache), W still once.
void gemm_amx(const bf16* x, int64_t M, int64_t K, const bf16* wp, int64_t N, const float* bias, bf16* y) {
  constexpr int64_t PANEL = 16;  // blocks: 16 x 16 outputs x K bf16 (1 MiB at K = 2048)
  const int64_t blocks = (N + 15) / 16, KP = K / 2;
  at::parallel_for(0, blocks, PANEL, [&](int64_t b_begin, int64_t b_end) {
    alignas(64) float buf[2][256];
    int configured = -1;
    for (int64_t p0 = b_begin; p0 < b_end; p0 += PANEL) {
      const int64_t p1 = std::min<int64_t>(b_end, p0 + PANEL);
      for (int64_t r0 = 0; r0 < M; r0 += 16) {
        const int mt = static_cast<int>(std::min<int64_t>(16, M - r0));
        if (mt != configured) configure_tiles(mt), configured = mt;
        for (int64_t b = p0; b < p1; b += 2) {
          const bool two = b + 1 < p1;
          amx_rows_blocks(x + r0 * K, K, wp + b * KP * 32, two ? wp + (b + 1) * KP * 32 : nullptr, buf[0], buf[1]);
          store_rows(buf[0], mt, r0, b, N, bias, y);
          if (two) store_rows(buf[1], mt, r0, b + 1, N, bias, y);
        }
      }
    }
    if (configured >= 0) _tile_release();
  });
}

// The CPU's AMX features (CPUID leaf 7, EDX bit 22 BF16, 24 TILE, 25 INT8) where the OS grants
// tile state (Linux hands it to a process that asks) and RIDGE_AMX=0 does not turn them off;
// none otherwise. Decided once per process.
unsigned amx_features() {
  static const unsigned features = [] {
    const char* env = std::getenv("RIDGE_AMX");
    if (env && std::strcmp(env, "0") == 0) return 0u;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24))) return 0u;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? d : 0u;
  }();
  return features;
}

bool amx_ready() { return amx_features() & (1u << 22); }

}  // namespace

bool amx_int8_ready() { return amx_features() & (1u << 25); }

bool linear_bf16_uses_amx(int64_t K) { return K % 32 == 0 && amx_ready(); }  // for M >= 2

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

// M rows of x (row-major, K wide) times the N rows of packed W: the path the row count asks for.
static void linear_bf16_rows(const bf16* x, int64_t M, int64_t K, const bf16* wp, int64_t N, const float* bias,
                             bf16* y) {
  if (M <= 0) return;
  if (M > 1 && linear_bf16_uses_amx(K)) {
    gemm_amx(x, M, K, wp, N, bias, y);
    return;
  }
  if (M <= SMALL_M) {
    gemm(x, M, K, wp, N, bias, y);
    return;
  }
  const int64_t padded = (M + 7) / 8 * 8;  // whole tiles of 8 rows (zeros; their outputs are dropped)
  if (padded != M) {
    std::vector<bf16> xp(padded * K, bf16(0.f));
    std::memcpy(xp.data(), x, M * K * sizeof(bf16));
    gemm_large_m<8, 3>(xp.data(), M, K, wp, N, bias, y);
  } else {
    gemm_large_m<8, 3>(x, M, K, wp, N, bias, y);
  }
}

torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "linear_bf16: bfloat16 only");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "linear_bf16: CPU tensors only");
  LinearCall call(x, N, bias);
  const int64_t M = call.M, K = call.K;
  TORCH_CHECK(packed.dim() == 4 && packed.size(0) == (N + 15) / 16 && packed.size(1) == (K + 1) / 2,
              "linear_bf16: packed weight does not match (N, K)");
  linear_bf16_rows(call.x2.data_ptr<bf16>(), M, K, packed.data_ptr<bf16>(), N, call.bias, call.y.data_ptr<bf16>());
  return call.result();
}

void linear_bf16_into(const bf16* x, int64_t M, int64_t K, const bf16* packed, int64_t N, const float* bias, bf16* y) {
  if (M > 0) linear_bf16_rows(x, M, K, packed, N, bias, y);
}

// Experts whose rows the streaming kernel takes (decode-sized, and one row on an AMX CPU) go
// in one gemm_experts pass; the others (prefill-sized, or AMX's 2+ rows) one call each.
void linear_bf16_grouped_into(const bf16* x, const std::vector<int64_t>& counts, int64_t K, const bf16* packed,
                              int64_t N, bf16* y) {
  const int64_t expert_elems = (N / 16) * ((K + 1) / 2) * 32;
  std::vector<int64_t> streamed, first, rows;
  int64_t row = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    const int64_t c = counts[e];
    if (c > 0 && c <= SMALL_M && !(c > 1 && linear_bf16_uses_amx(K))) {
      streamed.push_back(static_cast<int64_t>(e)), first.push_back(row), rows.push_back(c);
    } else if (c > 0) {
      linear_bf16_rows(x + row * K, c, K, packed + e * expert_elems, N, nullptr, y + row * N);
    }
    row += c;
  }
  if (!streamed.empty()) gemm_experts(x, streamed, first, rows, K, packed, N, y);
}

// Stacked experts (ExpertLinear): x's rows sorted by expert, counts[e] rows for expert e; each
// run of rows times expert e's N rows of the stacked packed weight, which are its blocks
// [e N/16, (e+1) N/16): one call per projection per layer, an expert with no rows never read.
torch::Tensor linear_bf16_grouped(torch::Tensor x, torch::Tensor packed, int64_t N, std::vector<int64_t> counts) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "linear_bf16_grouped: bf16");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && x.dim() == 2, "linear_bf16_grouped: (R, K) on CPU");
  TORCH_CHECK(N % 16 == 0, "linear_bf16_grouped: rows per expert must be a multiple of 16");
  auto x2 = x.contiguous();
  const int64_t R = x2.size(0), K = x2.size(1), E = static_cast<int64_t>(counts.size());
  TORCH_CHECK(packed.dim() == 4 && packed.size(0) == E * N / 16 && packed.size(1) == (K + 1) / 2,
              "linear_bf16_grouped: packed weight does not match (E * N, K)");
  auto y = torch::empty({R, N}, x2.options());
  int64_t row = 0;
  for (const int64_t c : counts) {
    TORCH_CHECK(c >= 0 && row + c <= R, "linear_bf16_grouped: counts do not add up to x's rows");
    row += c;
  }
  TORCH_CHECK(row == R, "linear_bf16_grouped: counts do not add up to x's rows");
  linear_bf16_grouped_into(x2.data_ptr<bf16>(), counts, K, packed.data_ptr<bf16>(), N, y.data_ptr<bf16>());
  return y;
}
