// read ceiling: sequential vs scattered 6 KiB blocks, 2 threads
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>
#include <algorithm>
static char* alloc(size_t n) {
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  madvise(p, n, MADV_HUGEPAGE); memset(p, 1, n); return (char*)p;
}
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
__attribute__((noinline)) static __m512i read_block(const char* p, size_t bytes, const char* next, int pf) {
  __m512i a = _mm512_setzero_si512(), b = a;
  if (pf >= 3) {  // the K pass's order: per KV head, 16 rows of 384 B, its 128 B
    for (int j = 0; j < 3; ++j) for (int i = 0; i < 16; ++i) {
      const char* r = p + i * 384 + j * 128;
      if (pf == 4 && next) { _mm_prefetch(next + i * 384 + j * 128, _MM_HINT_T0); _mm_prefetch(next + i * 384 + j * 128 + 64, _MM_HINT_T0); }
      if (pf == 5 && next) { _mm_prefetch(next + i * 384 + j * 128, _MM_HINT_T1); _mm_prefetch(next + i * 384 + j * 128 + 64, _MM_HINT_T1); }
      a = _mm512_add_epi32(a, _mm512_load_si512(r)); b = _mm512_add_epi32(b, _mm512_load_si512(r + 64)); }
    return _mm512_add_epi32(a, b);
  }
  for (size_t o = 0; o < bytes; o += 128) {
    if (pf == 1 && next) { _mm_prefetch(next + o, _MM_HINT_T0); _mm_prefetch(next + o + 64, _MM_HINT_T0); }
    if (pf == 2 && next) { _mm_prefetch(next + o, _MM_HINT_T1); _mm_prefetch(next + o + 64, _MM_HINT_T1); }
    a = _mm512_add_epi32(a, _mm512_load_si512(p + o)); b = _mm512_add_epi32(b, _mm512_load_si512(p + o + 64));
  }
  return _mm512_add_epi32(a, b);
}
int main(int argc, char** argv) {
  const int L = 30, B = atoi(argv[1]), per = atoi(argv[2]); const size_t BS = atoi(argv[3]);  // block bytes
  const size_t pool = (size_t)12000 * 6144 / BS;
  std::vector<char*> ks(L), vs(L);
  for (int l = 0; l < L; ++l) { ks[l] = alloc(pool * BS); vs[l] = alloc(pool * BS); }
  std::mt19937 g(0);
  std::vector<int> perm(pool); for (size_t i = 0; i < pool; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), g);
  std::vector<int> table(B * per); for (int i = 0; i < B * per; ++i) table[i] = perm[i % pool];
  size_t bytes = (size_t)L * B * per * BS * 2;
  for (int pf = 0; pf < 6; ++pf) for (int rep = 0; rep < 3; ++rep) {
    double t = now(); long long sink = 0;
    for (int l = 0; l < L; ++l) {
      std::atomic<int> next{0};
#pragma omp parallel num_threads(2) reduction(+:sink)
      { __m512i acc = _mm512_setzero_si512();
        for (int r; (r = next.fetch_add(1)) < B;) {
          const int* tb = table.data() + r * per;
          for (int kv = 0; kv < 2; ++kv) { char* base = kv ? vs[l] : ks[l];
            for (int i = 0; i < per; ++i) {
              const char* nx = i + 1 < per ? base + (size_t)tb[i + 1] * BS : (kv == 0 ? vs[l] + (size_t)tb[0] * BS : nullptr);
              acc = _mm512_add_epi32(acc, read_block(base + (size_t)tb[i] * BS, BS, nx, pf)); } } }
        sink += _mm512_reduce_add_epi32(acc); }
    }
    t = now() - t;
    printf("pf=%d blocks %zu B: %.2f ms %.1f GB/s (%lld)\n", pf, BS, t * 1e3, bytes / t / 1e9, sink & 1);
  }
  // sequential: same bytes, contiguous
  char* big = alloc(bytes / L * 4); size_t sb = bytes / L * 4;
  for (int rep = 0; rep < 3; ++rep) { double t = now(); long long sink = 0;
#pragma omp parallel num_threads(2) reduction(+:sink)
    { int id = omp_get_thread_num(); size_t h = sb / 2; __m512i a = read_block(big + id * h, h, nullptr, 0); sink += _mm512_reduce_add_epi32(a); }
    t = now() - t; printf("sequential %.1f GB/s\n", sb / t / 1e9); }
}
