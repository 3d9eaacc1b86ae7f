#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
// peak vdpbf16ps rate: 16 independent accumulators, register operands only / with 8 zmm loads per 16 / with embedded broadcast
int main(int argc, char** argv) {
  const int sk = argc > 1 ? atoi(argv[1]) : 0;  // skew between rows, elements
  const long iters = 200000000 / 16;
  alignas(64) static uint16_t buf[8 * 32 * 64 + 4096];
  for (int i = 0; i < 8 * 32 * 64 + 4096; ++i) buf[i] = 0x3f80 + (i & 7);
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3f81), c = (__m512bh)_mm512_set1_epi16(0x3f82), d = (__m512bh)_mm512_set1_epi16(0x3f83);
  auto t0 = std::chrono::steady_clock::now();
  for (long it = 0; it < iters; ++it) {
    asm volatile("" : "+v"(a), "+v"(b), "+v"(c), "+v"(d));
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], (i & 1) ? a : b, (i & 2) ? c : d);
  }
  auto t1 = std::chrono::steady_clock::now();
  double ns = std::chrono::duration<double, std::nano>(t1 - t0).count();
  float s = 0; for (int i = 0; i < 16; ++i) s += _mm512_reduce_add_ps(acc[i]);
  printf("registers only: %.3f vdpbf16ps/ns (%.0f GFLOP/s per core)  [%g]\n", iters * 16 / ns, iters * 16 * 64 / ns, s);
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  t0 = std::chrono::steady_clock::now();
  const long n2 = iters / 8;
  for (long it = 0; it < n2; ++it) {
    for (int k = 0; k < 8 * 32 * 64 / 8 / 32 - 0; k += 1) {  // 64 k-steps over 4 w rows + 4 x rows in L1
      const uint16_t* p = buf + (k % 64) * 32;
      __m512i w0 = _mm512_loadu_si512(p), w1 = _mm512_loadu_si512(p + 2048 + sk), w2 = _mm512_loadu_si512(p + 4096 + 2 * sk), w3 = _mm512_loadu_si512(p + 6144 + 3 * sk);
#pragma GCC unroll 4
      for (int m = 0; m < 4; ++m) {
        __m512bh x = (__m512bh)_mm512_loadu_si512(p + 8192 + 4 * sk + m * (2048 + sk));
        acc[m * 4 + 0] = _mm512_dpbf16_ps(acc[m * 4 + 0], x, (__m512bh)w0);
        acc[m * 4 + 1] = _mm512_dpbf16_ps(acc[m * 4 + 1], x, (__m512bh)w1);
        acc[m * 4 + 2] = _mm512_dpbf16_ps(acc[m * 4 + 2], x, (__m512bh)w2);
        acc[m * 4 + 3] = _mm512_dpbf16_ps(acc[m * 4 + 3], x, (__m512bh)w3);
      }
    }
  }
  t1 = std::chrono::steady_clock::now();
  ns = std::chrono::duration<double, std::nano>(t1 - t0).count();
  s = 0; for (int i = 0; i < 16; ++i) s += _mm512_reduce_add_ps(acc[i]);
  long ops = n2 * 64 * 16;
  printf("8 loads per 16: %.3f vdpbf16ps/ns (%.0f GFLOP/s per core)  [%g]\n", ops / ns, ops * 64 / ns, s);
  return 0;
}
