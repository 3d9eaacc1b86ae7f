// Read ceiling of the decode attention's access pattern: sequential vs scattered blocks, 2 threads, 30 layers' pools on
// huge pages. g++ -O3 -march=native -fopenmp -DWORK=N read_ceiling.cpp; ./a.out REQUESTS BLOCKS_PER_REQUEST BLOCK_BYTES
// pf: 0 plain loads, 1/2 + next block prefetched T0/T1, 3-5 the K pass's order (+T0/T1), 6/7 plain loads with WORK
// dependent FMAs per 128 B between them (+T0)
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
  if (pf >= 3 && pf < 6) {  // the K pass's order: per KV head, 16 rows of 384 B, its 128 B
    for (int j = 0; j < 3; ++j) for (int i = 0; i < 16; ++i) {
      const char* r = p + i * 384 + j * 128;
      if (pf == 4 && next) { _mm_prefetch(next + i * 384 + j * 128, _MM_HINT_T0); _mm_prefetch(next + i * 384 + j * 128 + 64, _MM_HINT_T0); }
      if (pf == 5 && next) { _mm_prefetch(next + i * 384 + j * 128, _MM_HINT_T1); _mm_prefetch(next + i * 384 + j * 128 + 64, _MM_HINT_T1); }
      a = _mm512_add_epi32(a, _mm512_load_si512(r)); b = _mm512_add_epi32(b, _mm512_load_si512(r + 64)); }
    return _mm512_add_epi32(a, b);
  }
  if (pf >= 6) {  // plain loads with arithmetic between them: WORK dependent FMAs per 128 B
    __m512 x = _mm512_set1_ps(1.0001f), y = _mm512_set1_ps(0.5f);
    for (size_t o = 0; o < bytes; o += 128) {
      __m512 l = _mm512_castsi512_ps(_mm512_load_si512(p + o)), l2 = _mm512_castsi512_ps(_mm512_load_si512(p + o + 64));
      if (pf == 7 && next) { _mm_prefetch(next + o, _MM_HINT_T0); _mm_prefetch(next + o + 64, _MM_HINT_T0); }
      y = _mm512_fmadd_ps(l, x, y); y = _mm512_fmadd_ps(l2, x, y);
      for (int w = 0; w < WORK; ++w) { y = _mm512_fmadd_ps(y, x, l); asm volatile("" : "+v"(y)); }
    }
    return _mm512_castps_si512(y);
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
  for (int pf = 0; pf < 8; ++pf) for (int rep = 0; rep < 3; ++rep) {
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
