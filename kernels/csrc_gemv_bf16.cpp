// bfloat16 matrix-vector products for decode: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for a few rows M, on
// CPUs with AVX512-BF16. At one to a few rows a linear layer is a stream of its weights from memory; this
// kernel reads the row-major weights once, with `vdpbf16ps` (pairs of bfloat16 products summed
// into float32 lanes), float32 accumulation and one rounding to bfloat16 per output (the bias added first,
// in float32). Threads split N in contiguous ranges; each reads its range as four streams side by side.
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

// Measured on a 2-core Zen 4 guest: a thread that reads four far-apart parts of its range in lockstep
// keeps more DRAM pages open than one that reads it in order. A plain read of 256 MB went from 28 to
// 36-38 GB/s in one hour (and was equal in another); the GEMV of every layer of SmolLM2-135M from 24-27
// to 26-32 GB/s at one row, and by 5-37% at 8-24 rows, alternated in one process. Each weight row is
// still summed by one accumulator per x row, in the order of k, so the outputs are bit for bit those of
// reading the rows in order. Prefetching each stream 4 KB ahead into L2 adds ~15% over the hardware
// prefetcher alone; 6 or 8 streams were no faster than 4.
constexpr int64_t kStreams = 4;          // weight rows read side by side, each from its own part of the range
constexpr int64_t kMaxXRows = 4;         // x rows that share each weight load; more rows re-read the tile from L1
constexpr int64_t kPrefetchBytes = 4096; // how far ahead of each row its stream is prefetched

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

// y[m, n[r]] for m < MB, r < S: the dot products of MB rows of x with the weight rows n[0..S). The last
// K % 32 elements are loaded masked (the zeros add nothing).
template <int MB, int S>
inline void tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, const uint16_t* bias, uint16_t* y,
                 int64_t ldy, const int64_t* n, const uint16_t* w_end) {
  __m512 acc[MB][S];
  const uint16_t* row[S];
  bool prefetch[S];
  for (int r = 0; r < S; ++r) {
    row[r] = w + n[r] * K;
    prefetch[r] = reinterpret_cast<const char*>(row[r] + K) + kPrefetchBytes <= reinterpret_cast<const char*>(w_end);
    for (int m = 0; m < MB; ++m) acc[m][r] = _mm512_setzero_ps();
  }
  const int64_t full = K / 32 * 32;
  int64_t k = 0;
  for (; k < full; k += 32) {
    __m512i wv[S];
    for (int r = 0; r < S; ++r) {
      wv[r] = _mm512_loadu_si512(row[r] + k);
      if (prefetch[r]) _mm_prefetch(reinterpret_cast<const char*>(row[r] + k) + kPrefetchBytes, _MM_HINT_T1);
    }
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = as_bh(_mm512_loadu_si512(x + m * ldx + k));
      for (int r = 0; r < S; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, as_bh(wv[r]));
    }
  }
  if (k < K) {
    const __mmask32 mask = static_cast<__mmask32>((1ull << (K - k)) - 1);
    __m512i wv[S];
    for (int r = 0; r < S; ++r) wv[r] = _mm512_maskz_loadu_epi16(mask, row[r] + k);
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = as_bh(_mm512_maskz_loadu_epi16(mask, x + m * ldx + k));
      for (int r = 0; r < S; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, as_bh(wv[r]));
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < S; ++r) {
      float sum = _mm512_reduce_add_ps(acc[m][r]);
      if (bias != nullptr) sum += kvrelay_simd::bf16_to_float(bias[n[r]]);
      y[m * ldy + n[r]] = float_to_bf16(sum);
    }
}

// Every x row (in groups of kMaxXRows) against the weight rows n[0..S).
template <int S>
inline void rows_tile(int64_t M, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, const uint16_t* bias,
                      uint16_t* y, int64_t N, const int64_t* n, const uint16_t* w_end) {
  for (int64_t m0 = 0; m0 < M; m0 += kMaxXRows) {
    const uint16_t* xm = x + m0 * ldx;
    uint16_t* ym = y + m0 * N;
    switch (std::min(kMaxXRows, M - m0)) {
      case 1: tile<1, S>(xm, ldx, w, K, bias, ym, N, n, w_end); break;
      case 2: tile<2, S>(xm, ldx, w, K, bias, ym, N, n, w_end); break;
      case 3: tile<3, S>(xm, ldx, w, K, bias, ym, N, n, w_end); break;
      default: tile<4, S>(xm, ldx, w, K, bias, ym, N, n, w_end); break;
    }
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
  const int64_t ldx = x.stride(0);
  const uint16_t* w_end = wp + N * K;
  // Parallel only past ~64 KiB of weights per thread: below that, waking threads costs more than it saves.
  const int64_t grain = std::max<int64_t>(kStreams, (64 << 10) / (K * 2));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    // This thread's rows in kStreams equal parts read side by side, the few left over one at a time.
    const int64_t len = (end - begin) / kStreams;
    for (int64_t s = 0; s < kStreams; ++s) {  // each stream's first rows, up front (the tiles prefetch ahead)
      const char* first = reinterpret_cast<const char*>(wp + (begin + s * len) * K);
      const char* stop = std::min(first + kPrefetchBytes, reinterpret_cast<const char*>(wp + end * K));
      for (const char* p = first; p < stop; p += 64) _mm_prefetch(p, _MM_HINT_T1);
    }
    int64_t n[kStreams];
    for (int64_t i = 0; i < len; ++i) {
      for (int64_t s = 0; s < kStreams; ++s) n[s] = begin + s * len + i;
      rows_tile<kStreams>(M, xp, ldx, wp, K, bp, yp, N, n, w_end);
    }
    for (int64_t r = begin + kStreams * len; r < end; ++r) rows_tile<1>(M, xp, ldx, wp, K, bp, yp, N, &r, w_end);
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
