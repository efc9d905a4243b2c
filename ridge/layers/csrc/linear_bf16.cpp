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
// each block of 16 rows is one contiguous stream. A tile keeps MR rows of x x NB blocks
// (MR x NB x 16 outputs) in registers; threads take contiguous groups of blocks.
//
// Accumulation is fp32; the result is rounded once to bf16 (as F.linear does).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

using bf16 = at::BFloat16;
constexpr int64_t PREFETCH_PAIRS = 64;  // k-pairs ahead (4 KiB per block stream) into L1

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

// Small M (decode): one block at a time, so each thread reads one contiguous stream of W
// (blocks are stored one after another) -- the pattern DRAM and the hardware prefetcher
// serve best. Four accumulators per row over consecutive k-pairs keep the FMAs independent.
template <int MR>
inline void stream_block(const bf16* x, int64_t ldx, int64_t K, const bf16* wp, int64_t KP, float* out, int64_t ldo) {
  constexpr int U = 4;
  __m512 acc[MR][U];
  for (int i = 0; i < MR; ++i)
    for (int u = 0; u < U; ++u) acc[i][u] = _mm512_setzero_ps();
  const int64_t full_pairs = K / 2;
  int64_t kp = 0;
  for (; kp + U <= full_pairs; kp += U) {
    __m512bh wv[U];
    for (int u = 0; u < U; ++u) wv[u] = (__m512bh)_mm512_loadu_si512((const void*)(wp + (kp + u) * 32));
    _mm_prefetch((const char*)(wp + (kp + PREFETCH_PAIRS) * 32), _MM_HINT_T0);
    _mm_prefetch((const char*)(wp + (kp + PREFETCH_PAIRS + 2) * 32), _MM_HINT_T0);
    for (int i = 0; i < MR; ++i)
      for (int u = 0; u < U; ++u) {
        const int32_t pair = *reinterpret_cast<const int32_t*>(x + i * ldx + 2 * (kp + u));
        acc[i][u] = _mm512_dpbf16_ps(acc[i][u], (__m512bh)_mm512_set1_epi32(pair), wv[u]);
      }
  }
  for (; kp < KP; ++kp) {  // the last few pairs (and a half pair when K is odd)
    const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void*)(wp + kp * 32));
    for (int i = 0; i < MR; ++i) {
      const int32_t pair = kp < full_pairs ? *reinterpret_cast<const int32_t*>(x + i * ldx + 2 * kp)
                                           : *reinterpret_cast<const uint16_t*>(x + i * ldx + 2 * kp);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], (__m512bh)_mm512_set1_epi32(pair), wv);
    }
  }
  for (int i = 0; i < MR; ++i)
    _mm512_storeu_ps(out + i * ldo,
                     _mm512_add_ps(_mm512_add_ps(acc[i][0], acc[i][1]), _mm512_add_ps(acc[i][2], acc[i][3])));
}

template <int MR>
void gemv(const bf16* x, int64_t M, int64_t K, const bf16* wp, int64_t N, const float* bias, bf16* y) {
  const int64_t blocks = (N + 15) / 16, KP = (K + 1) / 2;
  at::parallel_for(0, blocks, 1, [&](int64_t b_begin, int64_t b_end) {
    alignas(64) float buf[MR * 16];
    for (int64_t b = b_begin; b < b_end; ++b) {
      stream_block<MR>(x, K, K, wp + b * KP * 32, KP, buf, 16);
      const int64_t n0 = b * 16, n_end = std::min<int64_t>(N, n0 + 16);
      for (int64_t i = 0; i < M; ++i)
        for (int64_t n = n0; n < n_end; ++n) y[i * N + n] = bf16(buf[i * 16 + n - n0] + (bias ? bias[n] : 0.f));
    }
  });
}

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
void gemm(const bf16* x, int64_t M, int64_t K, const bf16* wp, int64_t N, const float* bias, bf16* y) {
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
static torch::Tensor huge_page_zeros(at::IntArrayRef shape, const at::TensorOptions& options) {
  constexpr size_t kHuge = 2u << 20;
  int64_t numel = 1;
  for (auto d : shape) numel *= d;
  const size_t bytes = static_cast<size_t>(numel) * 2;
  if (bytes < kHuge) return torch::zeros(shape, options);
  const size_t rounded = (bytes + kHuge - 1) / kHuge * kHuge;
  void* ptr = nullptr;
  if (posix_memalign(&ptr, kHuge, rounded) != 0) return torch::zeros(shape, options);
  madvise(ptr, rounded, MADV_HUGEPAGE);  // before the first touch, so faults take huge pages
  auto* bytes_ptr = static_cast<char*>(ptr);
  at::parallel_for(0, static_cast<int64_t>(rounded / kHuge), 1, [&](int64_t b, int64_t e) {
    std::memset(bytes_ptr + b * kHuge, 0, (e - b) * kHuge);
  });
  return torch::from_blob(ptr, shape, [](void* p) { std::free(p); }, options);
}

torch::Tensor pack_vnni(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.device().is_cpu(), "pack_vnni: (N, K) bf16 CPU");
  const int64_t N = w.size(0), K = w.size(1), NB = (N + 15) / 16, KP = (K + 1) / 2;
  auto out = huge_page_zeros({NB, KP, 16, 2}, w.options());
  auto wc = w.contiguous();
  const bf16* src = wc.data_ptr<bf16>();
  bf16* dst = out.data_ptr<bf16>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t k = 0; k < K; ++k) dst[(((n / 16) * KP + k / 2) * 16 + n % 16) * 2 + k % 2] = src[n * K + k];
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
  const int64_t K = x.size(-1);
  TORCH_CHECK(packed.dim() == 4 && packed.size(0) == (N + 15) / 16 && packed.size(1) == (K + 1) / 2,
              "linear_bf16: packed weight does not match (N, K)");
  auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor bias_f;
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    bias_f = bias->to(at::kFloat).contiguous();
    bias_ptr = bias_f.data_ptr<float>();
  }
  // Rows of x in tiles of MR: pad to a whole number of tiles (zeros; their outputs are dropped).
  // One row runs as two (a zero row): measured faster here, the 2-row loop keeps more loads
  // in flight per cycle than the 1-row one.
  const int64_t MR = M <= 2 ? 2 : (M <= 4 ? 4 : 8);
  const int64_t padded = (M + MR - 1) / MR * MR;
  if (padded != M) x2 = torch::cat({x2, torch::zeros({padded - M, K}, x2.options())});
  const bf16* xp = x2.data_ptr<bf16>();
  const bf16* wp = packed.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  if (MR == 2) gemv<2>(xp, M, K, wp, N, bias_ptr, yp);
  else if (MR == 4) gemm<4, 6>(xp, M, K, wp, N, bias_ptr, yp);  // streaming 4 rows is FMA-bound
  else gemm<8, 3>(xp, M, K, wp, N, bias_ptr, yp);
  return y.view(out_shape);
}
