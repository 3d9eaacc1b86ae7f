// bfloat16 linear layers for decode steps of a few to a few hundred rows on AMX tiles:
// y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W in the GEMV's VNNI layout ([N/16, K/2, 16, 2], `pack_vnni_bf16`).
//
// That layout is already what a tile multiply reads as its second operand: 16 column pairs of one block of
// 16 weight rows are 1 KiB in a row, the 16 x 16 x 2 B tile of `tdpbf16ps`. So each weight is read once,
// front to back, as one stream per thread, while x (a few hundred KiB at most) stays in cache and its tiles
// are loaded straight from its rows. Threads take pairs of weight blocks from a shared counter and sum 32 x
// rows at a time against a pair (2 x 2 tiles of sums); past 32 rows the pair's tiles are read again from
// L1/L2, not from memory. Sums are float32 over k in order, as `tdpbf16ps` adds a pair's two products,
// with one rounding to bfloat16 per output (the bias added in float32 first).
//
// oneDNN runs these shapes on the tiles too, but at 8-64 rows on a 2-core Xeon it read the weights at only
// 11-17 GB/s; this kernel reads them at 20-30 GB/s at 8-16 rows (docs/benchmarks.md). Past ~100 rows both
// are bound by the tiles' arithmetic, ~1.3 TFLOP/s a core here even in cache. `amx_linear_bf16` raises
// where the CPU or the OS has no AMX (`has_amx_linear()` says so).
#include "csrc_aten.h"
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "csrc_simd.h"

#if defined(KVRELAY_AVX512_BF16) && defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define KVRELAY_AMX 1
#endif

#ifdef KVRELAY_AMX
namespace {

#define KVRELAY_AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))

struct TileConfig {  // LDTILECFG's 64 bytes, palette 1
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0..3: sums of 16 x rows against 16 weight rows (16 x 16 float32), C(m, n) in tile 2m + n for up to
// 2 tiles of x rows and 2 blocks of weight rows; 4 and 5: the x tiles (16 rows x 32 columns); 6 and 7: the
// weight tiles (16 column pairs of 16 rows). Each tile loaded serves two multiplies.
constexpr int kMaxTiles = 2;   // x tiles of 16 rows per pass over a block pair; more rows take more passes
constexpr int kMaxBlocks = 2;  // weight blocks of 16 rows per pass
constexpr int64_t kPrefetchAhead = 4096;  // bytes between a chunk's first weight and its first prefetch

TileConfig tile_config() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  return cfg;
}

// Sums of MT tiles of x rows (a[t]: each tile's first row, rows lda bytes apart) against NB weight blocks
// (w[n]: ksteps tiles of 1 KiB each), stored to c: tile C(m, n) at c + (2m + n) * 256 (16 x 16 float32).
// Each k step also prefetches pf_lines lines from pf on.
// GCC's tile intrinsics paste their tile numbers into the assembly, so they are literals here.
template <int MT, int NB>
KVRELAY_AMX_TARGET void block_sums(const uint16_t* const* a, int64_t lda, const uint16_t* const* w, int64_t ksteps,
                                   const char* pf, int64_t pf_lines, float* c) {
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (MT > 1) _tile_zero(2);
  if constexpr (MT > 1 && NB > 1) _tile_zero(3);
  for (int64_t k = 0; k < ksteps; ++k) {
    for (int64_t line = 0; line < pf_lines; ++line) _mm_prefetch(pf + (k * pf_lines + line) * 64, _MM_HINT_T1);
    _tile_loadd(6, w[0] + k * 512, 64);
    if constexpr (NB > 1) _tile_loadd(7, w[1] + k * 512, 64);
    _tile_loadd(4, a[0] + k * 32, lda);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NB > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (MT > 1) {
      _tile_loadd(5, a[1] + k * 32, lda);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NB > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 64);
  if constexpr (NB > 1) _tile_stored(1, c + 256, 64);
  if constexpr (MT > 1) _tile_stored(2, c + 512, 64);
  if constexpr (MT > 1 && NB > 1) _tile_stored(3, c + 768, 64);
}

KVRELAY_AMX_TARGET void load_config(const TileConfig& cfg) { _tile_loadconfig(&cfg); }
KVRELAY_AMX_TARGET void release_tiles() { _tile_release(); }

}  // namespace

bool has_amx_linear() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!(d & (1u << 24)) || !(d & (1u << 22))) return false;  // AMX-TILE, AMX-BF16
    // Linux gives a process the tiles' state only when asked (ARCH_REQ_XCOMP_PERM for XTILEDATA, feature 18);
    // torch asks too, before oneDNN's first AMX kernel.
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return ok;
}

torch::Tensor amx_linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(has_amx_linear(), "amx_linear_bf16 needs a CPU and OS with AMX tiles (amx_bf16)");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 4 && w.size(2) == 16 && w.size(3) == 2 && x.size(1) == 2 * w.size(1),
              "amx_linear_bf16 takes x [M, K] and W packed as [N/16, K/2, 16, 2], got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 && x.device().is_cpu() &&
              w.device().is_cpu() && w.is_contiguous(), "amx_linear_bf16 takes bfloat16 CPU tensors, W contiguous");
  const int64_t K = x.size(1), blocks = w.size(0), N = blocks * 16;
  TORCH_CHECK(K % 32 == 0, "amx_linear_bf16 needs K a multiple of 32, got ", K);
  if (x.stride(1) != 1) x = x.contiguous();  // a tile's rows may be any stride apart, its columns not
  const uint16_t* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N,
                "amx_linear_bf16's bias must be a contiguous bfloat16 vector of W's ", N, " rows");
    bp = reinterpret_cast<const uint16_t*>(bias->data_ptr());
  }
  const int64_t M = x.size(0);
  auto y = torch::empty({M, N}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (M == 0 || N == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t ldx = x.stride(0), lda = ldx * 2, ksteps = K / 32;
  // x's last partial tile of rows, padded with zero rows so the tile never reads past x
  const int64_t full_tiles = M / 16, tiles = (M + 15) / 16;
  std::vector<uint16_t> tail;
  if (tiles > full_tiles) {
    tail.assign(16 * ldx, 0);
    for (int64_t r = full_tiles * 16; r < M; ++r)
      std::memcpy(tail.data() + (r - full_tiles * 16) * ldx, xp + r * ldx, K * 2);
  }
  std::vector<const uint16_t*> a_rows(tiles);
  for (int64_t t = 0; t < tiles; ++t) a_rows[t] = t < full_tiles ? xp + t * 16 * ldx : tail.data();
  const TileConfig cfg = tile_config();
  constexpr int64_t kChunk = kMaxBlocks;  // weight blocks taken from the counter at a time
  const int64_t chunks = (blocks + kChunk - 1) / kChunk;
  const int64_t passes = (tiles + kMaxTiles - 1) / kMaxTiles;
  // Each pass prefetches its share of the weights that follow its chunk's in memory (the next chunk's, usually
  // the thread's next), pf_lines lines a k step, so the first pass over them finds them in L2.
  const int64_t pf_lines = (kChunk * ksteps * 16 + passes * ksteps - 1) / (passes * ksteps);
  // Streaming stores need 64-byte aligned lines: y's rows (N a multiple of 32) and each pair's outputs are.
  const bool stream = N % 32 == 0 && reinterpret_cast<uintptr_t>(yp) % 64 == 0;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), chunks);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    load_config(cfg);
    alignas(64) float c[4 * 256];
    for (int64_t chunk; (chunk = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      const int64_t blk0 = chunk * kChunk, nb = std::min(kChunk, blocks - blk0);
      const uint16_t* wb[2] = {wp + blk0 * ksteps * 512, wp + (blk0 + nb - 1) * ksteps * 512};
      for (int64_t t0 = 0; t0 < tiles; t0 += kMaxTiles) {
        const int64_t mt = std::min<int64_t>(kMaxTiles, tiles - t0);
        const int64_t pass = t0 / kMaxTiles;
        const char* pf = reinterpret_cast<const char*>(wb[0]) + kPrefetchAhead + pass * pf_lines * ksteps * 64;
        const uint16_t* const* at = a_rows.data() + t0;
        if (mt == 1) {
          if (nb == 1) block_sums<1, 1>(at, lda, wb, ksteps, pf, pf_lines, c);
          else block_sums<1, 2>(at, lda, wb, ksteps, pf, pf_lines, c);
        } else {
          if (nb == 1) block_sums<2, 1>(at, lda, wb, ksteps, pf, pf_lines, c);
          else block_sums<2, 2>(at, lda, wb, ksteps, pf, pf_lines, c);
        }
        // Each x row's outputs of the pair are one 64-byte line of y, written at once and past the caches
        // (streaming stores): y's rows are N * 2 bytes apart, so at widths such as 3,072 or 49,152 the lines of
        // one pair's rows share a few cache sets and each store evicted the one before, and a streamed line is
        // not read from memory before it is written. On a 2-core Xeon, 30 layers out of cache: gate_up at 128
        // rows 10.2 against 14.0 ms, qkv 3.2 against 3.9; the LM head at 64 rows 3.5 against 4.2; never
        // slower at 8-200 rows (docs/benchmarks.md).
        const int64_t n0 = blk0 * 16;
        const __m512 b0 = bp == nullptr ? _mm512_setzero_ps() : kvrelay_simd::load_bf16x16(bp + n0);
        const __m512 b1 = bp == nullptr || nb < 2 ? _mm512_setzero_ps() : kvrelay_simd::load_bf16x16(bp + n0 + 16);
        for (int64_t m = 0; m < mt; ++m) {
          const int64_t rows = std::min<int64_t>(16, M - (t0 + m) * 16);
          const float* c0 = c + 2 * m * 256;  // C(m, 0); C(m, 1) follows it
          uint16_t* ym = yp + (t0 + m) * 16 * N + n0;
          for (int64_t r = 0; r < rows; ++r) {  // no bias: no + 0, which would turn -0 into +0
            __m512 lo = _mm512_loadu_ps(c0 + r * 16);
            if (bp != nullptr) lo = _mm512_add_ps(lo, b0);
            if (nb < 2) {
              kvrelay_simd::store_bf16x16(ym + r * N, lo);
              continue;
            }
            __m512 hi = _mm512_loadu_ps(c0 + 256 + r * 16);
            if (bp != nullptr) hi = _mm512_add_ps(hi, b1);
            const __m512i line = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));  // lo in the low half
            if (stream) _mm512_stream_si512(reinterpret_cast<__m512i*>(ym + r * N), line);
            else _mm512_storeu_si512(ym + r * N, line);
          }
        }
      }
    }
    if (stream) _mm_sfence();  // the streamed lines reach memory before the join
    release_tiles();
  });
  return y;
}

#else

bool has_amx_linear() { return false; }

torch::Tensor amx_linear_bf16(torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "amx_linear_bf16: built without AVX512-BF16 on x86-64 Linux");
}

#endif
