// Paged attention for bfloat16 on CPUs with AVX512-BF16 (`vdpbf16ps`: pairs of bfloat16 products summed
// into float32 lanes). Products of bfloat16 are exact in float32 and sums are float32, as in torch's
// flash attention for bfloat16, which also rounds the softmax numerators to bfloat16 before multiplying
// by V and divides by their float32 sum at the end.
//
// - `paged_prefill_attention_bf16_`: chunks (many queries per request, causal within the chunk, after any
//   cached context). One task per (request, KV head): its keys are gathered once into a pair-transposed
//   tile, so a query row's scores for 16 positions come from D/2 vector instructions with no horizontal
//   sums, and the values into position-pair rows for the same reason.
// - `paged_decode_attention_bf16`: single-token queries straight from the cache, one task per request, in
//   16-position tiles, each load from memory paired with a prefetch of the next tile's same lines into L1
//   and of the tile after it into L2.
//
// `has_avx512_bf16()` says whether these were compiled; without them the Python side uses torch.
#include "csrc_aten.h"
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "csrc_simd.h"

bool has_avx512_bf16() {
#ifdef KVRELAY_AVX512_BF16
  return true;
#else
  return false;
#endif
}

#ifdef KVRELAY_AVX512_BF16
namespace {

using kvrelay_simd::exp512;

constexpr int64_t kRows = 4;  // query rows that share each K/V load

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh>(x); }

struct Paged {
  const uint16_t* k;
  const uint16_t* v;
  const int64_t* tables;
  int64_t table_width, block_size, kv_heads, dim;
  // Element offset of position `p`'s row (all KV heads) in either cache, for the request whose table is `t`.
  int64_t offset(const int64_t* t, int64_t p) const { return (t[p / block_size] * block_size + p % block_size) * kv_heads * dim; }
  // The K (or V) row of KV head `h` at position `p`.
  const uint16_t* row(const uint16_t* cache, const int64_t* t, int64_t p, int64_t h) const {
    return cache + offset(t, p) + h * dim;
  }
};

// Softmax numerators for `n` scores in place (float, unnormalised, relative to the row max); returns
// their sum. Positions at or beyond `limit` get 0.
inline float exp_row(float* s, int64_t limit, int64_t n) {
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  int64_t p = 0;
  for (; p + 16 <= limit; p += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + p));
  float m = _mm512_reduce_max_ps(vmax);
  for (; p < limit; ++p) m = std::max(m, s[p]);
  const __m512 vm = _mm512_set1_ps(m);
  __m512 vsum = _mm512_setzero_ps();
  for (p = 0; p < n; p += 16) {
    const __mmask16 valid = p + 16 <= limit ? 0xffff : (p >= limit ? 0 : static_cast<__mmask16>((1u << (limit - p)) - 1));
    const __m512 e = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(_mm512_loadu_ps(s + p), vm)));
    _mm512_storeu_ps(s + p, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  return _mm512_reduce_add_ps(vsum);
}

// out[j] = dword j of each of rows r[0..15] (a 16 x 16 transpose of 32-bit words): 64 shuffles.
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // u[4i + j], 128-bit lane L: word 4L + j of rows 4i .. 4i + 3
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // a 4 x 4 transpose of 128-bit lanes within each of the four sets {r[j], r[4 + j], r[8 + j], r[12 + j]}
  for (int j = 0; j < 4; ++j) {
    const __m512i x0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44), x1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xee);
    const __m512i y0 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44), y1 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xee);
    t[j] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    t[4 + j] = _mm512_shuffle_i32x4(x0, y0, 0xdd);
    t[8 + j] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    t[12 + j] = _mm512_shuffle_i32x4(x1, y1, 0xdd);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// Unpack order: `_mm512_unpacklo/hi_epi16(a, b)` of 32 bfloat16 put, in 128-bit lane k, the pairs of
// d = 8k + {0..3} in lo and d = 8k + {4..7} in hi. `_mm512_permutex2var_*(lo, unpack_first(), hi)` gathers
// d = 0..15 in order, `unpack_second()` d = 16..31.
inline __m512i unpack_first() { return _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23); }
inline __m512i unpack_second() { return _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31); }

// Pairs (a[d], b[d]) of 32 bfloat16, for d = 0..15 and 16..31.
inline void pair_rows(__m512i a, __m512i b, __m512i& first, __m512i& second) {
  const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
  first = _mm512_permutex2var_epi32(lo, unpack_first(), hi);
  second = _mm512_permutex2var_epi32(lo, unpack_second(), hi);
}

// acc[i][c] = sum over k < count of pairs(rows[i][k]) . tile[k * stride + 16c .. +16], c < T: NR rows times T
// 16-lane tiles, NR * T sums in registers, each tile load shared by the NR rows, the pairs summed in order k.
template <int NR, int T>
inline void pair_dots(__m512 (&acc)[NR][2], const uint32_t* const* rows, const uint32_t* tile, int64_t stride,
                      int64_t count) {
  __m512 a[NR][T];
  for (int i = 0; i < NR; ++i)
    for (int c = 0; c < T; ++c) a[i][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < count; ++k) {
    __m512bh t[T];
    for (int c = 0; c < T; ++c) t[c] = as_bh(_mm512_loadu_si512(tile + k * stride + 16 * c));
    for (int i = 0; i < NR; ++i) {
      const __m512bh w = as_bh(_mm512_set1_epi32(static_cast<int>(rows[i][k])));
      for (int c = 0; c < T; ++c) a[i][c] = _mm512_dpbf16_ps(a[i][c], w, t[c]);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int c = 0; c < T; ++c) acc[i][c] = a[i][c];
}

void prefill_task(const Paged& pg, const uint16_t* q, int64_t q_token_stride, uint16_t* out, int64_t out_token_stride,
                  int64_t q_start, int64_t q_len, int64_t ctx, int64_t kv_head, int64_t group, const int64_t* table,
                  float scale, std::vector<uint32_t>& kt, std::vector<uint32_t>& vp, std::vector<float>& scores,
                  std::vector<uint32_t>& probs) {
  const int64_t D = pg.dim, half = D / 2, DC = D / 32;
  const int64_t n = (ctx + 31) / 32 * 32;  // positions padded to whole pairs of 16-wide tiles
  kt.resize(half * n);
  vp.resize(n / 2 * D);
  // kt[d2][p] = (K[p][2*d2], K[p][2*d2+1]): 16 positions' 32-dim chunks transposed at a time; positions past
  // ctx read as zeros (their scores are masked; their V pairs are zeros, so no product is a NaN).
  for (int64_t p0 = 0; p0 < n; p0 += 16)
    for (int64_t c = 0; c < DC; ++c) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = p0 + i < ctx ? _mm512_loadu_si512(pg.row(pg.k, table, p0 + i, kv_head) + 32 * c) : _mm512_setzero_si512();
      transpose16(r);
      for (int k = 0; k < 16; ++k) _mm512_storeu_si512(kt.data() + (16 * c + k) * n + p0, r[k]);
    }
  // vp[p2][d] = (V[2*p2][d], V[2*p2+1][d])
  for (int64_t p = 0; p < n; p += 2) {
    const uint16_t* v0 = p < ctx ? pg.row(pg.v, table, p, kv_head) : nullptr;
    const uint16_t* v1 = p + 1 < ctx ? pg.row(pg.v, table, p + 1, kv_head) : nullptr;
    for (int64_t c = 0; c < DC; ++c) {
      const __m512i a = v0 ? _mm512_loadu_si512(v0 + 32 * c) : _mm512_setzero_si512();
      const __m512i b = v1 ? _mm512_loadu_si512(v1 + 32 * c) : _mm512_setzero_si512();
      __m512i first, second;
      pair_rows(a, b, first, second);
      _mm512_storeu_si512(vp.data() + p / 2 * D + 32 * c, first);
      _mm512_storeu_si512(vp.data() + p / 2 * D + 32 * c + 16, second);
    }
  }
  const int64_t rows = q_len * group;  // row r: query token r / group, head kv_head * group + r % group
  scores.resize(kRows * n);
  probs.resize(kRows * n / 2);
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int64_t nr = std::min(kRows, rows - r0);
    const uint32_t* qrow[kRows];
    int64_t limit[kRows];
    int64_t max_limit = 0;
    for (int64_t i = 0; i < kRows; ++i) {
      const int64_t r = r0 + std::min(i, nr - 1);
      const int64_t tok = q_start + r / group, h = kv_head * group + r % group;
      qrow[i] = reinterpret_cast<const uint32_t*>(q + tok * q_token_stride + h * D);
      limit[i] = ctx - q_len + r / group + 1;
      max_limit = std::max(max_limit, limit[i]);
    }
    const int64_t np = (max_limit + 15) / 16 * 16;  // at most n
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t p = 0; p < np; p += 32) {  // 32 positions at a time, the last 16 alone
      __m512 acc[kRows][2];
      const int tiles = p + 32 <= np ? 2 : 1;
      if (tiles == 2) pair_dots<kRows, 2>(acc, qrow, kt.data() + p, n, half);
      else pair_dots<kRows, 1>(acc, qrow, kt.data() + p, n, half);
      for (int64_t i = 0; i < kRows; ++i)
        for (int c = 0; c < tiles; ++c) _mm512_storeu_ps(scores.data() + i * n + p + 16 * c, _mm512_mul_ps(acc[i][c], vscale));
    }
    float inv_sum[kRows];
    const uint32_t* prow[kRows];
    const int64_t npairs = np / 2;
    for (int64_t i = 0; i < kRows; ++i) {
      float* s = scores.data() + i * n;
      inv_sum[i] = 1.f / exp_row(s, limit[i], np);
      // in memory order a pair's word holds position 2k in its low half: 16 numerators to 16 bfloat16 at a
      // time, rounded to nearest even (they are zero or normal: exp512 clamps its input above -87.3)
      uint32_t* pr = probs.data() + i * (n / 2);
      prow[i] = pr;
      for (int64_t p = 0; p < np; p += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + p / 2), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(s + p))));
    }
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      __m512 acc[kRows][2];
      pair_dots<kRows, 2>(acc, prow, vp.data() + d0, D, npairs);
      for (int64_t i = 0; i < nr; ++i) {
        const int64_t r = r0 + i;
        uint16_t* o = out + (q_start + r / group) * out_token_stride + (kv_head * group + r % group) * D + d0;
        const __m512 inv = _mm512_set1_ps(inv_sum[i]);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_mul_ps(acc[i][0], inv))));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_mul_ps(acc[i][1], inv))));
      }
    }
  }
}

}  // namespace

// out/q: [tokens, heads, head_dim] (rows dense); requests' query tokens start at q_starts.
void paged_prefill_attention_bf16_(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                   torch::Tensor block_tables, torch::Tensor q_starts, torch::Tensor q_lens,
                                   torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "bfloat16 only");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && out.stride(2) == 1 && out.stride(1) == out.size(2),
              "q and out must have dense [heads, head_dim] rows");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  const int64_t D = q.size(2), H = q.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(D % 32 == 0, "head_dim must be a multiple of 32");
  block_tables = block_tables.to(torch::kInt64).contiguous();
  q_starts = q_starts.to(torch::kInt64).contiguous();
  q_lens = q_lens.to(torch::kInt64).contiguous();
  context_lens = context_lens.to(torch::kInt64).contiguous();
  const Paged pg{reinterpret_cast<const uint16_t*>(k_cache.data_ptr()), reinterpret_cast<const uint16_t*>(v_cache.data_ptr()),
                 block_tables.data_ptr<int64_t>(), block_tables.size(1), k_cache.size(1), KVH, D};
  const int64_t R = q_starts.size(0), G = H / KVH;
  const int64_t* qs = q_starts.data_ptr<int64_t>();
  const int64_t* ql = q_lens.data_ptr<int64_t>();
  const int64_t* cl = context_lens.data_ptr<int64_t>();
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t q_stride = q.stride(0), o_stride = out.stride(0);
  // tasks handed out one at a time, as `decode_all` does: chunks differ in length, and a thread another
  // process preempts leaves its share to the others
  std::atomic<int64_t> next{0};
  const int64_t tasks = R * KVH, workers = std::min<int64_t>(at::get_num_threads(), tasks);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<uint32_t> kt, vp, probs;
    std::vector<float> scores;
    for (int64_t task; (task = next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      const int64_t r = task / KVH, h = task % KVH;
      prefill_task(pg, qp, q_stride, op, o_stride, qs[r], ql[r], cl[r], h, G, pg.tables + r * pg.table_width,
                   static_cast<float>(scale), kt, vp, scores, probs);
    }
  });
}

namespace {

// How many tiles ahead of its loads the decode kernel also prefetches into L2 (`_MM_HINT_T1`), besides the
// next tile into L1: the misses then start a tile earlier and more of them are in flight. On a 2-core Xeon
// (AMX host, 30 layers out of cache) the kernel read 17.1-17.4 GB/s against 16.4-16.9 without, and a steady
// decode step of 200 / 64 rows took 112.5-116.3 / 44.3-45.3 ms against 116.0-120.8 / 46.6-46.9; 3 and 4
// tiles ahead, or `_MM_HINT_T2`, did no better (docs/benchmarks.md).
constexpr int64_t kL2TilesAhead = 2;
// Of that far tile, only the first line of every kL2TriggerRows-th row: a trigger for the core's L2
// streamer, which then fetches the rows' other lines itself. A software prefetch holds one of the core's
// few L1 fill buffers until its line arrives and the streamer's requests do not, so (we take it) every far
// line prefetched took a buffer from the loads and the next tile's prefetches. On the AMX host, 200
// requests of ~250 positions over 30 layers: 57-59 ms against 65-66 with the pool's blocks shuffled, 56
// against 58 in runs of 4 blocks, the same 54 ms with each request's blocks in one run; a trigger every 4
// or 16 rows did about as well (docs/results/amx-20261203c). The GEMV's weight streams, contiguous, were
// 8-14% slower with such triggers, so it keeps prefetching every line.
constexpr int64_t kL2TriggerRows = 8;

// Every line of the rows at `rows[0]` and `rows[1]` (element offsets) of `cache`, `bytes` a row.
template <_mm_hint Hint>
inline void prefetch_row_pair(const uint16_t* cache, const int64_t* rows, int64_t bytes) {
  const char* r0 = reinterpret_cast<const char*>(cache + rows[0]);
  const char* r1 = reinterpret_cast<const char*>(cache + rows[1]);
  for (int64_t b = 0; b < bytes; b += 64) {
    _mm_prefetch(r0 + b, Hint);
    _mm_prefetch(r1 + b, Hint);
  }
}

struct DecodeScratch {
  std::vector<int64_t> rows;     // element offset of each position's K/V row (all KV heads)
  std::vector<float> scores;     // [heads, positions padded to 16]
  std::vector<__m512i> kt;       // one tile's K rows of one KV head, transposed to pairs of dimensions
  std::vector<int64_t> heads;    // the rows' heads e, grouped by KV head
  std::vector<uint32_t> probs;   // [heads, position pairs]: bfloat16 softmax numerators, two to a word
  std::vector<float> inv_sum;    // [heads]
  std::vector<__m512> acc;       // [heads, 2 * DC]: P.V sums in unpack order (see below)
  std::vector<__m512i> vpairs;   // [8 position pairs, KV heads, DC, lo/hi]
};

// Scores of NR query rows (head rows `es[i]` of `q`, D = 32 * DC) against one 16-position tile whose K rows
// are transposed into pairs of dimensions (`kt`, D / 2 vectors): lane i of row e's sum is position i's dot
// product (even and odd pairs summed apart, then added), scaled, into scores[e * n].
template <int NR, int DC>
inline void score_rows(const uint16_t* q, const int64_t* es, const __m512i* kt, float* scores, int64_t n, __m512 scale) {
  const uint32_t* qr[NR];
  for (int i = 0; i < NR; ++i) qr[i] = reinterpret_cast<const uint32_t*>(q + es[i] * DC * 32);
  __m512 a[NR][2];  // even and odd pairs in two chains, so that 2 * NR sums are in flight
  for (int i = 0; i < NR; ++i) a[i][0] = a[i][1] = _mm512_setzero_ps();
  for (int k = 0; k < DC * 16; k += 2)
    for (int h = 0; h < 2; ++h) {
      const __m512bh tk = as_bh(kt[k + h]);
      for (int i = 0; i < NR; ++i)
        a[i][h] = _mm512_dpbf16_ps(a[i][h], as_bh(_mm512_set1_epi32(static_cast<int>(qr[i][k + h]))), tk);
    }
  for (int i = 0; i < NR; ++i) _mm512_storeu_ps(scores + es[i] * n, _mm512_mul_ps(_mm512_add_ps(a[i][0], a[i][1]), scale));
}

// P.V for NB heads over one tile: acc[b * 2 * DC + c] += the sum over position pairs p2 < count of head b's
// numerator pair (ph[b * npairs + p2]) times V pairs v[p2 * stride + c], the pairs in order.
template <int NB, int DC>
inline void pv_block(__m512* acc, const uint32_t* ph, int64_t npairs, const __m512i* v, int64_t stride, int64_t count) {
  __m512 a[NB][2 * DC];
  for (int b = 0; b < NB; ++b)
    for (int c = 0; c < 2 * DC; ++c) a[b][c] = acc[b * 2 * DC + c];
  for (int64_t p2 = 0; p2 < count; ++p2) {
    const __m512i* vp = v + p2 * stride;
    for (int b = 0; b < NB; ++b) {
      const __m512bh w = as_bh(_mm512_set1_epi32(static_cast<int>(ph[b * npairs + p2])));
      for (int c = 0; c < 2 * DC; ++c) a[b][c] = _mm512_dpbf16_ps(a[b][c], w, as_bh(vp[c]));
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int c = 0; c < 2 * DC; ++c) acc[b * 2 * DC + c] = a[b][c];
}

// `pv_block` for as many of `heads` (consecutive) as fit in registers: returns how many it took.
template <int DC>
inline int64_t pv_heads(int64_t heads, __m512* acc, const uint32_t* ph, int64_t npairs, const __m512i* v, int64_t stride,
                        int64_t count) {
  if constexpr (DC <= 2) {
    if (heads >= 4) return pv_block<4, DC>(acc, ph, npairs, v, stride, count), 4;
    if (heads == 3) return pv_block<3, DC>(acc, ph, npairs, v, stride, count), 3;
  }
  if constexpr (DC <= 4) {
    if (heads >= 2) return pv_block<2, DC>(acc, ph, npairs, v, stride, count), 2;
  }
  pv_block<1, DC>(acc, ph, npairs, v, stride, count);
  return 1;
}

// One request's queries: DC = head_dim / 32; `m` consecutive rows whose contexts are ctx, ctx + 1, ...
// (a decode row and its drafts: `decode_groups`), all of them over `table` (the last row's), so they share
// every K and V load. Row r's head h is "head" e = r * H + h below, and it sees the first ctx + r positions;
// each row's numbers are those it gets alone, bit for bit (positions past its context get zero numerators,
// whose products add zeros). Positions go in tiles of 16. Pass 1 transposes a tile's K rows of one KV head
// into pairs of dimensions (`transpose16`) and scores every row of that KV head against them (`score_rows`:
// no horizontal sums, each load shared by four rows, so a request and its drafts, m * G rows a KV head, cost
// little more than their dot products). Pass 2 interleaves a tile's V
// rows by position pairs (`unpacklo/hi_epi16`), so each head's sums stay in registers and take two
// positions per `vdpbf16ps`; the numerators are rounded to bfloat16 for it, as the chunk kernel does.
// Each load from memory is paired with a prefetch of the same lines one tile ahead (the last K tile's
// go to the first V tile), so the prefetches keep the pace of the loads, and with a few into L2
// `kL2TilesAhead` tiles ahead (kL2TriggerRows), which start the far tile's misses earlier. Out of cache a
// core here is limited by the misses it keeps in flight, and its arithmetic does not overlap them, so
// arithmetic saved is time saved: the rows' offsets are computed block by block, with no division per
// position. Against prefetches spread over the heads' arithmetic, this took a 30-layer sweep of 200
// requests on a 2-core Xeon from 70-73 to 64-67 ms (docs/results/amx-20261202c).
template <int DC>
void decode_request(const Paged& pg, const uint16_t* q, uint16_t* out, int64_t first_ctx, int64_t m, const int64_t* table,
                    int64_t H, float scale, DecodeScratch& s) {
  constexpr int64_t D = DC * 32;
  const int64_t KVH = pg.kv_heads, G = H / KVH, row_bytes = KVH * D * 2, E = m * H;
  const int64_t ctx = first_ctx + m - 1;  // the last row's: every position any row sees
  const int64_t tiles = (ctx + 15) / 16, n = tiles * 16, npairs = n / 2;
  s.rows.resize(n);
  const int64_t row_len = KVH * D;
  for (int64_t p = 0, b = 0; p < ctx; ++b) {  // block by block: no division per position
    const int64_t first_row = table[b] * pg.block_size * row_len;
    for (int64_t i = 0; i < pg.block_size && p < ctx; ++i, ++p) s.rows[p] = first_row + i * row_len;
  }
  for (int64_t p = ctx; p < n; ++p) s.rows[p] = s.rows[ctx - 1];  // past ctx: a valid row, masked
  s.scores.resize(E * n);
  s.kt.resize(DC * 16);
  // the rows of each KV head: e = r * H + h for the m rows r and its G query heads h
  s.heads.resize(E);
  for (int64_t j = 0, i = 0; j < KVH; ++j)
    for (int64_t r = 0; r < m; ++r)
      for (int64_t g = 0; g < G; ++g) s.heads[i++] = r * H + j * G + g;
  const int64_t per_kv = m * G;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t* rows = s.rows.data() + t * 16;
    const bool last = t + 1 == tiles;  // then the tile to fetch is the first V tile
    const uint16_t* next_cache = last ? pg.v : pg.k;
    const int64_t* next_rows = last ? s.rows.data() : rows + 16;
    // kL2TilesAhead tiles ahead, into L2: a K tile, or from the last K tiles the first V tiles
    const bool far_k = t + kL2TilesAhead < tiles;
    const int64_t far_tile = far_k ? t + kL2TilesAhead : t + kL2TilesAhead - tiles;
    const bool far_ok = far_tile < tiles;
    const uint16_t* far_cache = far_k ? pg.k : pg.v;
    const int64_t* far_rows = s.rows.data() + (far_ok ? far_tile : 0) * 16;
    for (int64_t j = 0; j < KVH; ++j) {
      // the tile's K rows of KV head j, transposed to pairs of dimensions (kt[d2] lane i: position i's
      // dimensions 2 * d2, 2 * d2 + 1), each load paired with a prefetch of the next tile's same lines
      for (int c = 0; c < DC; ++c) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i) {
          _mm_prefetch(reinterpret_cast<const char*>(next_cache + next_rows[i] + j * D + 32 * c), _MM_HINT_T0);
          if (far_ok && j == 0 && c == 0 && i % kL2TriggerRows == 0)
            _mm_prefetch(reinterpret_cast<const char*>(far_cache + far_rows[i]), _MM_HINT_T1);
          r[i] = _mm512_loadu_si512(pg.k + rows[i] + j * D + 32 * c);
        }
        transpose16(r);
        for (int k = 0; k < 16; ++k) s.kt[16 * c + k] = r[k];
      }
      // every row of the KV head against the tile, up to four at a time sharing each kt load
      const int64_t* es = s.heads.data() + j * per_kv;
      for (int64_t i = 0; i < per_kv; i += 4) {
        switch (std::min<int64_t>(4, per_kv - i)) {
          case 1: score_rows<1, DC>(q, es + i, s.kt.data(), s.scores.data() + t * 16, n, vscale); break;
          case 2: score_rows<2, DC>(q, es + i, s.kt.data(), s.scores.data() + t * 16, n, vscale); break;
          case 3: score_rows<3, DC>(q, es + i, s.kt.data(), s.scores.data() + t * 16, n, vscale); break;
          default: score_rows<4, DC>(q, es + i, s.kt.data(), s.scores.data() + t * 16, n, vscale); break;
        }
      }
    }
  }
  s.probs.resize(E * npairs);
  s.inv_sum.resize(E);
  for (int64_t e = 0; e < E; ++e) {
    float* sh = s.scores.data() + e * n;
    s.inv_sum[e] = 1.f / exp_row(sh, first_ctx + e / H, n);  // zero past the row's context
    // In memory order a pair's word holds position 2k in its low half: 16 numerators to 16 bfloat16 at a
    // time, rounded to nearest even (they are zero or normal: exp512 clamps its input above -87.3).
    auto* ph = reinterpret_cast<__m256i*>(s.probs.data() + e * npairs);
    for (int64_t p = 0; p < n; p += 16) _mm256_storeu_si256(ph + p / 16, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(sh + p))));
  }
  s.acc.assign(E * 2 * DC, _mm512_setzero_ps());
  s.vpairs.resize(8 * KVH * DC * 2);
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t* rows = s.rows.data() + t * 16;
    const int64_t count = std::min<int64_t>(16, ctx - t * 16), pairs = (count + 1) / 2;
    for (int64_t p2 = 0; p2 < pairs; ++p2) {
      // the same two rows of the next tile; a trigger in the far tile
      if (t + 1 < tiles) prefetch_row_pair<_MM_HINT_T0>(pg.v, rows + 16 + 2 * p2, row_bytes);
      if (t + kL2TilesAhead < tiles && 2 * p2 % kL2TriggerRows == 0)
        _mm_prefetch(reinterpret_cast<const char*>(pg.v + rows[16 * kL2TilesAhead + 2 * p2]), _MM_HINT_T1);
      const uint16_t* r0 = pg.v + rows[2 * p2];
      const uint16_t* r1 = 2 * p2 + 1 < count ? pg.v + rows[2 * p2 + 1] : nullptr;  // an odd tail pairs with zeros
      for (int64_t j = 0; j < KVH; ++j)
        for (int c = 0; c < DC; ++c) {
          const __m512i a = _mm512_loadu_si512(r0 + j * D + 32 * c);
          const __m512i b = r1 ? _mm512_loadu_si512(r1 + j * D + 32 * c) : _mm512_setzero_si512();
          __m512i* dst = s.vpairs.data() + ((p2 * KVH + j) * DC + c) * 2;
          dst[0] = _mm512_unpacklo_epi16(a, b);
          dst[1] = _mm512_unpackhi_epi16(a, b);
        }
    }
    // heads of one row and one KV head share its V pairs and their context: NB of them at a time, 2 * DC
    // sums each in registers (each head's sums as it gets them alone)
    for (int64_t r = 0; r < m; ++r) {
      // a row whose context ends before this tile adds nothing here (its numerators are zero)
      const int64_t row_pairs = std::min<int64_t>(pairs, (first_ctx + r - t * 16 + 1) / 2);
      for (int64_t j = 0; j < KVH; ++j)
        for (int64_t g = 0; g < G;) {
          const int64_t e = r * H + j * G + g;
          g += pv_heads<DC>(G - g, s.acc.data() + e * 2 * DC, s.probs.data() + e * npairs + t * 8, npairs,
                            s.vpairs.data() + j * DC * 2, KVH * DC * 2, row_pairs);
        }
    }
  }
  // the sums are in unpack order (chunk c's lo and hi: d = 32c + 8k + {0..3} and {4..7} in lane k)
  const __m512i first = unpack_first(), second = unpack_second();
  for (int64_t e = 0; e < E; ++e) {
    const __m512 inv = _mm512_set1_ps(s.inv_sum[e]);
    const __m512* acc = s.acc.data() + e * 2 * DC;
    for (int c = 0; c < DC; ++c) {
      uint16_t* o = out + e * D + 32 * c;
      const __m512 lo = _mm512_mul_ps(_mm512_permutex2var_ps(acc[2 * c], first, acc[2 * c + 1]), inv);
      const __m512 hi = _mm512_mul_ps(_mm512_permutex2var_ps(acc[2 * c], second, acc[2 * c + 1]), inv);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(lo)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(hi)));
    }
  }
}

// At most this many rows in one group: a decode row and up to 15 drafts.
constexpr int64_t kMaxGroupRows = 16;

// The first row of each group of consecutive rows that attend over the same blocks at contexts ctx, ctx + 1,
// ... (a speculating request's last token and its drafts), then the number of rows. Rows are grouped by what
// they read, not by whose they are, so grouping never changes a row's result: each row's table equals the
// one before over all the longer context's blocks, so the group's last table equals every row's own over
// all that row reads, and the group reads that one.
// Fewer groups than threads would leave a thread idle (one stream and its drafts: 1.65 ms against 1.3 for
// 30 layers of 5 rows on two threads), so then every row is its own group.
std::vector<int64_t> decode_groups(const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                                   int64_t block_size) {
  const int64_t B = context_lens.size(0), W = block_tables.size(1);
  const int64_t* cl = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  std::vector<int64_t> starts;
  starts.reserve(B + 1);
  for (int64_t b = 0; b < B; ++b) {
    // the blocks the longer context covers, all of which a table row of width W must hold
    const int64_t blocks = std::min<int64_t>(W, (cl[b] + block_size - 1) / block_size);
    const bool joins = b > 0 && b - starts.back() < kMaxGroupRows && cl[b] == cl[b - 1] + 1 &&
                       std::memcmp(tables + b * W, tables + (b - 1) * W, blocks * sizeof(int64_t)) == 0;
    if (!joins) starts.push_back(b);
  }
  if (static_cast<int64_t>(starts.size()) < std::min<int64_t>(at::get_num_threads(), B)) {
    starts.resize(B);
    for (int64_t b = 0; b < B; ++b) starts[b] = b;
  }
  starts.push_back(B);
  return starts;
}

// Requests are handed out one at a time from a shared counter, not a fixed share per thread: when another
// process preempts one thread (a server's HTTP path, Ray's own), the others take its remaining requests
// instead of waiting for it at the end. With a process spinning 2 ms in every 10 beside it, a 30-layer sweep
// of 200 requests on a 2-core Xeon took 72 ms instead of 77 (67.8 ms either way without it).
template <int DC>
void decode_all(const Paged& pg, const uint16_t* q, uint16_t* out, const int64_t* context_lens,
                const std::vector<int64_t>& groups, int64_t H, float scale) {
  const int64_t B = static_cast<int64_t>(groups.size()) - 1;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), B);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    DecodeScratch scratch;
    for (int64_t g; (g = next.fetch_add(1, std::memory_order_relaxed)) < B;) {
      const int64_t b = groups[g], last = groups[g + 1] - 1;
      // the last row's table: it agrees with each earlier row's over all that row reads (`decode_groups`)
      decode_request<DC>(pg, q + b * H * DC * 32, out + b * H * DC * 32, context_lens[b], last - b + 1,
                         pg.tables + last * pg.table_width, H, scale, scratch);
    }
  });
}

}  // namespace

// q: [requests, heads, head_dim] -> out of the same shape; head_dim a multiple of 32, at most 256.
torch::Tensor paged_decode_attention_bf16(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                          torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16, "bfloat16 only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  q = q.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(2);
  TORCH_CHECK(D % 32 == 0 && D <= 256, "head_dim must be a multiple of 32, at most 256");
  TORCH_CHECK(H % KVH == 0, "query heads must be a multiple of KV heads");
  block_tables = block_tables.to(torch::kInt64).contiguous();
  context_lens = context_lens.to(torch::kInt64).contiguous();
  const int64_t* cl = context_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(cl[b] >= 1, "every decode needs at least one cached position");
  const std::vector<int64_t> groups = decode_groups(block_tables, context_lens, k_cache.size(1));
  auto out = torch::empty_like(q);
  const Paged pg{reinterpret_cast<const uint16_t*>(k_cache.data_ptr()), reinterpret_cast<const uint16_t*>(v_cache.data_ptr()),
                 block_tables.data_ptr<int64_t>(), block_tables.size(1), k_cache.size(1), KVH, D};
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const float fscale = static_cast<float>(scale);
  switch (D / 32) {
    case 1: decode_all<1>(pg, qp, op, cl, groups, H, fscale); break;
    case 2: decode_all<2>(pg, qp, op, cl, groups, H, fscale); break;
    case 3: decode_all<3>(pg, qp, op, cl, groups, H, fscale); break;
    case 4: decode_all<4>(pg, qp, op, cl, groups, H, fscale); break;
    case 5: decode_all<5>(pg, qp, op, cl, groups, H, fscale); break;
    case 6: decode_all<6>(pg, qp, op, cl, groups, H, fscale); break;
    case 7: decode_all<7>(pg, qp, op, cl, groups, H, fscale); break;
    default: decode_all<8>(pg, qp, op, cl, groups, H, fscale); break;
  }
  return out;
}

#else

void paged_prefill_attention_bf16_(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                                   torch::Tensor, torch::Tensor, double) {
  TORCH_CHECK(false, "built without AVX512-BF16");
}

torch::Tensor paged_decode_attention_bf16(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, double) {
  TORCH_CHECK(false, "built without AVX512-BF16");
}

#endif
