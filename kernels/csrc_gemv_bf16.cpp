// bfloat16 matrix-vector products for decode: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for a few rows M, on
// CPUs with AVX512-BF16. At one to a few rows a linear layer is a stream of its weights from memory; this
// kernel reads the row-major weights once, with `vdpbf16ps` (pairs of bfloat16 products summed
// into float32 lanes), float32 accumulation and one rounding to bfloat16 per output (the bias added first,
// in float32). Threads split N in contiguous ranges; each reads its range as four streams side by side.
//
// `pack_vnni_bf16` gives a weight a second layout, [N/16, K/2, 16, 2]: for each block of 16 output rows, its
// columns in pairs, the pair of each of the 16 rows side by side (64 bytes, one zmm register). `vdpbf16ps` of
// one such load with a broadcast pair of x adds that pair's two products into 16 outputs at once, so a tile
// keeps 8 x rows x 3 blocks of outputs in registers and needs no horizontal sums and no scattered stores at
// the end. Over K = 576 those ends cost the row-major tiles about half their time past 8 rows. Each output
// is still one float32 sum in the order of k: on a Zen 4, 3 outputs in 100,000 differed from F.linear's
// by a rounding at SmolLM2-135M's shapes. `gemv_bf16` takes either layout.
//
// `linear_bf16` is what the layer ops call: the GEMV where it applies (at most `max_rows` rows, bfloat16,
// contiguous rows, CPU), `gemv_f32` (csrc_gemv_f32.cpp) for at most `f32_max_rows` float32 rows, else
// `at::linear`; deciding here costs one call from Python instead of a dozen attribute reads. `gemv_bf16` raises
// when built without AVX512-BF16 (`has_avx512_bf16()` says so), and `linear_bf16` then takes `gemv_f32` or
// `at::linear`.
#include "csrc_aten.h"
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "csrc_simd.h"

bool gemv_f32_applies(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                      int64_t max_rows);
torch::Tensor gemv_f32(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);

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

// The VNNI layout. y[m, 16 blk[s] + j] for m < MB, s < S, j < 16: MB rows of x against S blocks of 16 weight
// rows, each block read as one stream (prefetched 4 KB ahead into L2, as the row-major streams).
template <int MB, int S>
inline void vnni_tile(const uint16_t* x, int64_t ldx, const uint16_t* p, int64_t pairs, const int64_t* blk,
                      const uint16_t* bias, uint16_t* y, int64_t ldy, const uint16_t* p_end) {
  __m512 acc[MB][S];
  const uint16_t* wp[S];
  for (int s = 0; s < S; ++s) {
    wp[s] = p + blk[s] * pairs * 32;
    for (int m = 0; m < MB; ++m) acc[m][s] = _mm512_setzero_ps();
  }
  const char* prefetch_end = reinterpret_cast<const char*>(p_end) - kPrefetchBytes;
  for (int64_t q = 0; q < pairs; ++q) {
    __m512i wv[S];
    for (int s = 0; s < S; ++s) {
      const uint16_t* at = wp[s] + q * 32;
      wv[s] = _mm512_loadu_si512(at);
      if (reinterpret_cast<const char*>(at) < prefetch_end)
        _mm_prefetch(reinterpret_cast<const char*>(at) + kPrefetchBytes, _MM_HINT_T1);
    }
    for (int m = 0; m < MB; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * ldx + 2 * q, sizeof pair);
      const __m512bh xv = as_bh(_mm512_set1_epi32(pair));
      for (int s = 0; s < S; ++s) acc[m][s] = _mm512_dpbf16_ps(acc[m][s], xv, as_bh(wv[s]));
    }
  }
  for (int s = 0; s < S; ++s) {
    const int64_t n0 = blk[s] * 16;
    const __m512 b = bias == nullptr ? _mm512_setzero_ps()
        : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(bias + n0))), 16));
    for (int m = 0; m < MB; ++m)  // round to nearest even, as float_to_bf16
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ldy + n0),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_add_ps(acc[m][s], b))));
  }
}

constexpr int64_t kVnniRows = 8;  // x rows per VNNI tile: 8 x 3 accumulators, 3 weight loads, 1 broadcast

template <int S>
inline void vnni_rows(int64_t M, const uint16_t* x, int64_t ldx, const uint16_t* p, int64_t pairs, const int64_t* blk,
                      const uint16_t* bias, uint16_t* y, int64_t N, const uint16_t* p_end) {
  for (int64_t m0 = 0; m0 < M; m0 += kVnniRows) {
    const uint16_t* xm = x + m0 * ldx;
    uint16_t* ym = y + m0 * N;
    switch (std::min(kVnniRows, M - m0)) {
      case 1: vnni_tile<1, S>(xm, ldx, p, pairs, blk, bias, ym, N, p_end); break;
      case 2: vnni_tile<2, S>(xm, ldx, p, pairs, blk, bias, ym, N, p_end); break;
      case 3: vnni_tile<3, S>(xm, ldx, p, pairs, blk, bias, ym, N, p_end); break;
      case 4: vnni_tile<4, S>(xm, ldx, p, pairs, blk, bias, ym, N, p_end); break;
      case 5: vnni_tile<5, S>(xm, ldx, p, pairs, blk, bias, ym, N, p_end); break;
      case 6: vnni_tile<6, S>(xm, ldx, p, pairs, blk, bias, ym, N, p_end); break;
      case 7: vnni_tile<7, S>(xm, ldx, p, pairs, blk, bias, ym, N, p_end); break;
      default: vnni_tile<8, S>(xm, ldx, p, pairs, blk, bias, ym, N, p_end); break;
    }
  }
}

// Measured on the 2-core Zen 4 guest, every layer of SmolLM2-135M from memory, 2 threads, against the
// row-major tiles: about the same at 1-8 rows, +25-50% at 16, +45-65% at 32 (docs/benchmarks.md).
// Of the tile shapes tried (4x4, 8x3, 12x2, 16x1, 24x1, 6x4, 14x2), 8 rows by 3 streams was the fastest from
// 8 rows up; one stream per thread (16x1, 24x1) was the slowest.
constexpr int64_t kVnniStreams = 3;

torch::Tensor gemv_vnni(const torch::Tensor& x_in, const torch::Tensor& p, const uint16_t* bp) {
  const torch::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t M = x.size(0), blocks = p.size(0), pairs = p.size(1), N = blocks * 16;
  auto y = torch::empty({M, N}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (M == 0 || N == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* pp = reinterpret_cast<const uint16_t*>(p.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t ldx = x.stride(0);
  const uint16_t* p_end = pp + blocks * pairs * 32;
  const int64_t grain = std::max<int64_t>(kVnniStreams, (64 << 10) / (pairs * 64));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    const int64_t len = (end - begin) / kVnniStreams;
    int64_t blk[kVnniStreams];
    for (int64_t i = 0; i < len; ++i) {
      for (int64_t s = 0; s < kVnniStreams; ++s) blk[s] = begin + s * len + i;
      vnni_rows<kVnniStreams>(M, xp, ldx, pp, pairs, blk, bp, yp, N, p_end);
    }
    for (int64_t b = begin + kVnniStreams * len; b < end; ++b) vnni_rows<1>(M, xp, ldx, pp, pairs, &b, bp, yp, N, p_end);
  });
  return y;
}

}  // namespace

bool is_vnni_weight(const torch::Tensor& w) { return w.dim() == 4 && w.size(2) == 16 && w.size(3) == 2; }

int64_t gemv_out_features(const torch::Tensor& w) { return is_vnni_weight(w) ? w.size(0) * 16 : w.size(0); }

torch::Tensor pack_vnni_bf16(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.device().is_cpu(),
              "pack_vnni_bf16 takes a contiguous bfloat16 CPU weight [N, K], got ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 16 == 0 && K % 2 == 0 && N > 0 && K > 0,
              "pack_vnni_bf16 needs N a multiple of 16 and K even, got [", N, ", ", K, "]");
  const int64_t blocks = N / 16, pairs = K / 2;
  auto p = torch::empty({blocks, pairs, 16, 2}, w.options());
  const auto* src = reinterpret_cast<const uint32_t*>(w.data_ptr());  // a row's columns, a pair at a time
  auto* dst = reinterpret_cast<uint32_t*>(p.data_ptr());
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t j = 0; j < 16; ++j) {
        const uint32_t* row = src + (b * 16 + j) * pairs;
        for (int64_t q = 0; q < pairs; ++q) dst[(b * pairs + q) * 16 + j] = row[q];
      }
  });
  return p;
}

torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  const bool vnni = is_vnni_weight(w);
  TORCH_CHECK(x.dim() == 2 && (w.dim() == 2 || vnni) && x.size(1) == (vnni ? 2 * w.size(1) : w.size(1)),
              "gemv_bf16 takes x [M, K] and W [N, K] (or W packed as [N/16, K/2, 16, 2]), got ", x.sizes(),
              " and ", w.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "gemv_bf16 takes bfloat16 x and W");
  TORCH_CHECK((vnni || x.stride(1) == 1) && w.is_contiguous(), "gemv_bf16 needs x's rows and W contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = gemv_out_features(w);
  const uint16_t* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N,
                "gemv_bf16's bias must be a contiguous bfloat16 vector of W's ", N, " rows");
    bp = reinterpret_cast<const uint16_t*>(bias->data_ptr());
  }
  if (vnni) return gemv_vnni(x, w, bp);
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

torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t max_rows,
                          int64_t f32_max_rows) {
  if (gemv_f32_applies(x, w, bias, f32_max_rows)) return gemv_f32(x, w, bias);
  const bool bias_ok = !bias.has_value() || !bias->defined() ||
                       (bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->dim() == 1);
  if (is_vnni_weight(w)) {  // only the GEMV reads this layout
    TORCH_CHECK(x.dim() == 2 && x.size(0) <= max_rows && x.device().is_cpu() && bias_ok,
                "a VNNI-packed weight takes a 2-D CPU x of at most ", max_rows, " rows, got ", x.sizes());
    return gemv_bf16(x, w, bias);
  }
  if (x.dim() == 2 && x.size(0) <= max_rows && x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 &&
      x.device().is_cpu() && w.device().is_cpu() && x.stride(1) == 1 && w.dim() == 2 && w.is_contiguous() && bias_ok)
    return gemv_bf16(x, w, bias);
  return at::linear(x, w, bias);
}

#else

torch::Tensor gemv_bf16(torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "built without AVX512-BF16");
}

torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t,
                          int64_t f32_max_rows) {
  if (gemv_f32_applies(x, w, bias, f32_max_rows)) return gemv_f32(x, w, bias);
  return at::linear(x, w, bias);
}

torch::Tensor pack_vnni_bf16(torch::Tensor) { TORCH_CHECK(false, "built without AVX512-BF16"); }

int64_t gemv_out_features(const torch::Tensor& w) { return w.size(0); }

#endif
