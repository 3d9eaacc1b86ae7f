#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <vector>
// The GEMV's 4x4 tile loop (K=576: 18 steps) over weight rows of a buffer of `kb` KB, 4 streams, 4 x-row tiles per
// row group (M=16), sums kept (no tail): vdpbf16ps per ns with weights from L1/L2/L3/DRAM.
int main(int argc, char** argv) {
  const long kb = atol(argv[1]);
  const int pf = argc > 2 ? atoi(argv[2]) : 0;  // 0: no prefetch, 1: every tile, 2: first tile only
  const int K = 576, rows = kb * 1024 / (K * 2), len = rows / 4;
  std::vector<uint16_t> w((size_t)rows * K), x(16 * K);
  for (size_t i = 0; i < w.size(); ++i) w[i] = 0x3f80 + (i & 7);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 0x3f80 + (i & 3);
  __m512 tot = _mm512_setzero_ps();
  long ops = 0;
  auto t0 = std::chrono::steady_clock::now();
  for (int pass = 0; pass < 2000000 / rows + 1; ++pass) {
    for (int i = 0; i < len; ++i) {
      const uint16_t* r0 = w.data() + (size_t)(0 * len + i) * K;
      const uint16_t* r1 = w.data() + (size_t)(1 * len + i) * K;
      const uint16_t* r2 = w.data() + (size_t)(2 * len + i) * K;
      const uint16_t* r3 = w.data() + (size_t)(3 * len + i) * K;
      for (int m0 = 0; m0 < 16; m0 += 4) {
        __m512 a[16];
        for (int j = 0; j < 16; ++j) a[j] = _mm512_setzero_ps();
        for (int k = 0; k < K; k += 32) {
          if (pf == 1 || (pf == 2 && m0 == 0)) {
            _mm_prefetch(reinterpret_cast<const char*>(r0 + k) + 4096, _MM_HINT_T1);
            _mm_prefetch(reinterpret_cast<const char*>(r1 + k) + 4096, _MM_HINT_T1);
            _mm_prefetch(reinterpret_cast<const char*>(r2 + k) + 4096, _MM_HINT_T1);
            _mm_prefetch(reinterpret_cast<const char*>(r3 + k) + 4096, _MM_HINT_T1);
          }
          const __m512i w0 = _mm512_loadu_si512(r0 + k), w1 = _mm512_loadu_si512(r1 + k), w2 = _mm512_loadu_si512(r2 + k), w3 = _mm512_loadu_si512(r3 + k);
#pragma GCC unroll 4
          for (int m = 0; m < 4; ++m) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x.data() + (m0 + m) * K + k);
            a[m * 4 + 0] = _mm512_dpbf16_ps(a[m * 4 + 0], xv, (__m512bh)w0);
            a[m * 4 + 1] = _mm512_dpbf16_ps(a[m * 4 + 1], xv, (__m512bh)w1);
            a[m * 4 + 2] = _mm512_dpbf16_ps(a[m * 4 + 2], xv, (__m512bh)w2);
            a[m * 4 + 3] = _mm512_dpbf16_ps(a[m * 4 + 3], xv, (__m512bh)w3);
          }
        }
        for (int j = 0; j < 16; ++j) tot = _mm512_add_ps(tot, a[j]);
        ops += 16 * (K / 32);
      }
    }
  }
  auto t1 = std::chrono::steady_clock::now();
  const double ns = std::chrono::duration<double, std::nano>(t1 - t0).count();
  printf("prefetch %d %6ld KB of weights: %.2f vdpbf16ps/ns (%.0f GFLOP/s)  [%g]\n", pf, kb, ops / ns, ops * 64 / ns, _mm512_reduce_add_ps(tot));
}
