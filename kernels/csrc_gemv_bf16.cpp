// bfloat16 matrix-vector products for decode: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for a few rows M, on
// CPUs with AVX512-BF16. At one to a few rows a linear layer is a stream of its weights from memory; this
// kernel reads the row-major weights once, in order, with `vdpbf16ps` (pairs of bfloat16 products summed
// into float32 lanes), float32 accumulation and one rounding to bfloat16 per output (the bias added first,
// in float32). Threads split N in contiguous ranges, so each streams its own part of W.
//
// `linear_bf16` is what the layer ops call: the GEMV where it applies (at most `max_rows` rows, bfloat16,
// contiguous rows, CPU), else `at::linear`; deciding here costs one call from Python instead of a dozen
// attribute reads. `gemv_bf16` raises when built without AVX512-BF16 (`has_avx512_bf16()` says so), and
// `linear_bf16` then always takes `at::linear`.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>

#include "csrc_simd.h"

#ifdef KVRELAY_AVX512_BF16
namespace {

using kvrelay_simd::float_to_bf16;

// Measured on a 2-core Zen 4 guest at one row: two weight rows side by side stream 10-25% faster than
// four, and prefetching 16 rows ahead into L2 ~50% faster than the hardware prefetcher alone (into L1:
// ~10%). The row-major weights then stream at the host's read bandwidth; no repacking is needed.
constexpr int64_t kRowsPerTile = 2;   // weight rows read side by side, each with its own accumulators
constexpr int64_t kMaxXRows = 4;      // x rows that share each weight load; more rows re-read the tile from L1
constexpr int64_t kPrefetchRows = 16; // how far ahead the weights are prefetched

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

// y[m, r] for m < MB, r < NR: the dot products of MB rows of x with NR consecutive rows of W. The last
// K % 32 elements are loaded masked (the zeros add nothing).
template <int MB, int NR>
inline void tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, const uint16_t* bias,
                 uint16_t* y, int64_t ldy, const uint16_t* w_end) {
  __m512 acc[MB][NR];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
  const int64_t full = K / 32 * 32;
  const char* ahead = reinterpret_cast<const char*>(w + kPrefetchRows * K);
  const bool prefetch = reinterpret_cast<const uint16_t*>(ahead) < w_end;
  int64_t k = 0;
  for (; k < full; k += 32) {
    __m512i wv[NR];
    for (int r = 0; r < NR; ++r) {
      wv[r] = _mm512_loadu_si512(w + r * K + k);
      if (prefetch) _mm_prefetch(ahead + 2 * (r * K + k), _MM_HINT_T1);
    }
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = as_bh(_mm512_loadu_si512(x + m * ldx + k));
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, as_bh(wv[r]));
    }
  }
  if (k < K) {
    const __mmask32 mask = static_cast<__mmask32>((1ull << (K - k)) - 1);
    __m512i wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = _mm512_maskz_loadu_epi16(mask, w + r * K + k);
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = as_bh(_mm512_maskz_loadu_epi16(mask, x + m * ldx + k));
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, as_bh(wv[r]));
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < NR; ++r) {
      float s = _mm512_reduce_add_ps(acc[m][r]);
      if (bias != nullptr) s += kvrelay_simd::bf16_to_float(bias[r]);
      y[m * ldy + r] = float_to_bf16(s);
    }
}

template <int NR>
inline void tile_rows(int64_t mb, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, const uint16_t* bias,
                      uint16_t* y, int64_t ldy, const uint16_t* w_end) {
  switch (mb) {
    case 1: tile<1, NR>(x, ldx, w, K, bias, y, ldy, w_end); break;
    case 2: tile<2, NR>(x, ldx, w, K, bias, y, ldy, w_end); break;
    case 3: tile<3, NR>(x, ldx, w, K, bias, y, ldy, w_end); break;
    default: tile<4, NR>(x, ldx, w, K, bias, y, ldy, w_end); break;
  }
}

}  // namespace

torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "gemv_bf16 takes x [M, K] and W [N, K], got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "gemv_bf16 takes bfloat16 x and W");
  TORCH_CHECK(x.stride(1) == 1 && w.is_contiguous(), "gemv_bf16 needs x's rows and W contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const uint16_t* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N,
                "gemv_bf16's bias must be a contiguous bfloat16 vector of W's ", N, " rows");
    bp = reinterpret_cast<const uint16_t*>(bias->data_ptr());
  }
  auto y = torch::empty({M, N}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (M == 0 || N == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t ldx = x.stride(0), tiles = (N + kRowsPerTile - 1) / kRowsPerTile;
  const uint16_t* w_end = wp + N * K;
  // Parallel only past ~64 KiB of weights per thread: below that, waking threads costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (kRowsPerTile * K * 2));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    // The tiles prefetch 16 rows ahead of themselves: fetch this range's first rows up front (1-5% faster).
    const int64_t first = begin * kRowsPerTile, last = std::min({end * kRowsPerTile, N, first + kPrefetchRows});
    for (const uint16_t* p = wp + first * K; p < wp + last * K; p += 32)
      _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kRowsPerTile, nr = std::min(kRowsPerTile, N - n0);
      const uint16_t* wt = wp + n0 * K;
      const uint16_t* bt = bp == nullptr ? nullptr : bp + n0;
      for (int64_t m0 = 0; m0 < M; m0 += kMaxXRows) {
        const int64_t mb = std::min(kMaxXRows, M - m0);
        const uint16_t* xm = xp + m0 * ldx;
        uint16_t* ym = yp + m0 * N + n0;
        if (nr == kRowsPerTile) {
          tile_rows<kRowsPerTile>(mb, xm, ldx, wt, K, bt, ym, N, w_end);
        } else {
          for (int64_t r = 0; r < nr; ++r)
            tile_rows<1>(mb, xm, ldx, wt + r * K, K, bt == nullptr ? nullptr : bt + r, ym + r, N, w_end);
        }
      }
    }
  });
  return y;
}

torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t max_rows) {
  const bool bias_ok = !bias.has_value() || !bias->defined() ||
                       (bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->dim() == 1);
  if (x.dim() == 2 && x.size(0) <= max_rows && x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 &&
      x.device().is_cpu() && w.device().is_cpu() && x.stride(1) == 1 && w.dim() == 2 && w.is_contiguous() && bias_ok)
    return gemv_bf16(x, w, bias);
  return at::linear(x, w, bias);
}

#else

torch::Tensor gemv_bf16(torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "built without AVX512-BF16");
}

torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t) {
  return at::linear(x, w, bias);
}

#endif
