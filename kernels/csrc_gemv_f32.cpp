// float32 matrix-vector products for decode: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for 1 to 64 rows M. At a few
// rows a linear layer is a stream of its weights from memory, and `at::linear`'s float32 path did not stream: on
// a 2-core AMD Zen 3 (AVX2) it read SmolLM2-135M's weights at ~15 GB/s at one row and 8 at 2-8, where the
// machine reads 34-39; this reads them at 28-29 at one row, 24 at 2-4, 19 at 8 (docs/benchmarks.md).
//
// Each output is one dot product of K in vector lanes (a chain of FMAs), summed across the lanes at the end,
// then the ragged end of K one element at a time, then the bias: the same order whatever M, the thread count or
// the output's neighbours, and another than `at::linear`'s, so an output differs from its in the last bits. A
// tile runs up to 8 rows over one weight row (their chains side by side), or one row over 8 weight rows. Threads
// split N in contiguous ranges and walk them in blocks of ~128 KiB of W; past 8 rows, each group of 8 runs over
// a block in turn, so W comes from memory once and from cache for the other groups. The vectors are GCC's
// vector extension, as wide as the build's ISA (-march=native: 8 lanes for AVX2, 16 for AVX-512).
#include "csrc_aten.h"
#include <algorithm>
#include <cstdint>
#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

// The build's flags have -ffast-math, under which the compiler may reassociate a sum, or fuse a multiply and an
// add, where it likes: it had fused `acc += x * w` in some tiles and not in others, so an output's last bit
// depended on its tile. This file's own functions are compiled without either: every sum runs in the order
// written, the chains' FMAs are the instruction (`fma` below), and nothing else is fused.
#pragma GCC optimize("no-fast-math", "fp-contract=off")

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
// aligned(4): a load through this type may be unaligned (a row of x or W starts at any float)
typedef float vf __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));

constexpr int64_t kMaxRows = 64, kGroup = 8;

#if defined(__clang__) || __GNUC__ >= 12
#define KVRELAY_SHUFFLE(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
typedef int32_t vi __attribute__((vector_size(kLanes * sizeof(int32_t))));
#define KVRELAY_SHUFFLE(v, ...) __builtin_shuffle(v, vi{__VA_ARGS__})
#endif

// a * b + c, lane by lane: the FMA instruction where the CPU has one, else a product and a sum (unfused here)
inline vf fma(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

// Lanes added in halves: for 8, ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)).
inline float hsum(vf v) {
#if defined(__AVX512F__)
  v += KVRELAY_SHUFFLE(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += KVRELAY_SHUFFLE(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += KVRELAY_SHUFFLE(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += KVRELAY_SHUFFLE(v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
#else
  v += KVRELAY_SHUFFLE(v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += KVRELAY_SHUFFLE(v, 2, 3, 0, 1, 6, 7, 4, 5);
  v += KVRELAY_SHUFFLE(v, 1, 0, 3, 2, 5, 4, 7, 6);
#endif
  return v[0];
}

// Outputs n .. n+R-1 of the M rows: M x R chains.
template <int M, int R>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t K, const float* b, float* y, int64_t N,
                 int64_t n) {
  vf acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = vf{};
  const float* wr = w + n * K;
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    vf wv[R];
    for (int r = 0; r < R; ++r) wv[r] = *reinterpret_cast<const vf*>(wr + r * K + k);
    for (int m = 0; m < M; ++m) {
      const vf xv = *reinterpret_cast<const vf*>(x + m * ldx + k);
      for (int r = 0; r < R; ++r) acc[m][r] = fma(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      float s = hsum(acc[m][r]);
      for (int64_t kk = k; kk < K; ++kk) s += x[m * ldx + kk] * wr[r * K + kk];
      y[m * N + n + r] = b ? s + b[n + r] : s;
    }
}

// Outputs [begin, end) of M rows, one weight row at a time (M chains), or, for one row, R = 8 weight rows at a time
// (8 chains): the fastest tiles measured on a 2-core Zen 3, 30-34 GB/s at one row (docs/benchmarks.md).
template <int M>
void span(const float* x, int64_t ldx, const float* w, int64_t K, const float* b, float* y, int64_t N,
          int64_t begin, int64_t end) {
  int64_t n = begin;
  if constexpr (M == 1)
    for (; n + 8 <= end; n += 8) tile<1, 8>(x, ldx, w, K, b, y, N, n);
  for (; n < end; ++n) tile<M, 1>(x, ldx, w, K, b, y, N, n);
}

void span_rows(int64_t m, const float* x, int64_t ldx, const float* w, int64_t K, const float* b, float* y,
               int64_t N, int64_t begin, int64_t end) {
  switch (m) {
    case 1: span<1>(x, ldx, w, K, b, y, N, begin, end); break;
    case 2: span<2>(x, ldx, w, K, b, y, N, begin, end); break;
    case 3: span<3>(x, ldx, w, K, b, y, N, begin, end); break;
    case 4: span<4>(x, ldx, w, K, b, y, N, begin, end); break;
    case 5: span<5>(x, ldx, w, K, b, y, N, begin, end); break;
    case 6: span<6>(x, ldx, w, K, b, y, N, begin, end); break;
    case 7: span<7>(x, ldx, w, K, b, y, N, begin, end); break;
    default: span<8>(x, ldx, w, K, b, y, N, begin, end); break;
  }
}

bool bias_ok(const c10::optional<torch::Tensor>& bias, int64_t n) {
  return !bias.has_value() || !bias->defined() ||
         (bias->scalar_type() == at::kFloat && bias->device().is_cpu() && bias->dim() == 1 && bias->size(0) == n &&
          bias->is_contiguous());
}

}  // namespace

bool gemv_f32_applies(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                      int64_t max_rows) {
  return x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= std::min(max_rows, kMaxRows) &&
         x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && x.device().is_cpu() &&
         w.device().is_cpu() && (x.stride(1) == 1 || x.size(1) == 1) && w.dim() == 2 && w.is_contiguous() &&
         w.size(1) == x.size(1) && x.size(1) > 0 && bias_ok(bias, w.size(0));
}

torch::Tensor gemv_f32(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(gemv_f32_applies(x, w, bias, kMaxRows), "gemv_f32 takes float32 CPU tensors: x [M, K] with 1 to ",
              kMaxRows, " rows of unit stride, W [N, K] contiguous, bias [N] or none; got x ", x.sizes(), " ",
              x.scalar_type(), ", W ", w.sizes(), " ", w.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), ldx = x.stride(0);
  auto y = torch::empty({M, N}, x.options());
  if (N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = bias.has_value() && bias->defined() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // Threads split N; each walks its range in blocks of ~128 KiB of W and runs every group of up to 8 rows over
  // a block before the next, so W comes from memory once and from cache for the other groups.
  const int64_t block = std::max<int64_t>(8, (128 << 10) / (K * int64_t(sizeof(float))) / 8 * 8);
  at::parallel_for(0, N, std::max<int64_t>(8, 8192 / K), [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; nb += block) {
      const int64_t ne = std::min(nb + block, end);
      for (int64_t m0 = 0; m0 < M; m0 += kGroup)
        span_rows(std::min(kGroup, M - m0), xp + m0 * ldx, ldx, wp, K, bp, yp + m0 * N, N, nb, ne);
    }
  });
  return y;
}
