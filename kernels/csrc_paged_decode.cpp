// Paged attention for decode tokens (one query per request) on the CPU: reads K/V straight from the
// paged cache through the block table (no gather copy). Scores in float32; softmax over a per-request
// buffer between a K pass and a V pass.
#include "csrc_aten.h"
#include <cmath>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

template <typename T>
inline void load_row(const T* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// bfloat16 is the top half of a float32: widen by shifting, which vectorizes.
template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* __restrict src, float* __restrict dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
}

// Sixteen independent partial sums, so the compiler can vectorize without reassociating.
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float lanes[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) lanes[j] += a[i + j] * b[i + j];
  float s = 0.f;
  for (int j = 0; j < 16; ++j) s += lanes[j];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

template <typename T>
void decode_kernel(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                   const torch::Tensor& block_tables, const torch::Tensor& context_lens, torch::Tensor& out,
                   double scale) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t G = H / KVH, row_len = KVH * D;
  const int64_t MB = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* cl = context_lens.data_ptr<int64_t>();

  // One task per request: a token's K (or V) row for all KV heads is contiguous, so each block is
  // read front to back once per pass.
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(H * D), acc(H * D), row(row_len), scores, inv_sum(H);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t ctx = cl[b];
      load_row(qp + b * H * D, qf.data(), H * D);
      for (auto& x : qf) x *= static_cast<float>(scale);
      scores.resize(H * ctx);
      for (int64_t p = 0; p < ctx; ++p) {
        load_row(kp + (bt[b * MB + p / BS] * BS + p % BS) * row_len, row.data(), row_len);
        for (int64_t hq = 0; hq < H; ++hq)
          scores[hq * ctx + p] = dot(qf.data() + hq * D, row.data() + (hq / G) * D, D);
      }
      for (int64_t hq = 0; hq < H; ++hq) {
        float* sh = scores.data() + hq * ctx;
        float m = -INFINITY;
        for (int64_t p = 0; p < ctx; ++p) m = std::max(m, sh[p]);
        float sum = 0.f;
        for (int64_t p = 0; p < ctx; ++p) { sh[p] = std::exp(sh[p] - m); sum += sh[p]; }
        inv_sum[hq] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = 0; p < ctx; ++p) {
        load_row(vp + (bt[b * MB + p / BS] * BS + p % BS) * row_len, row.data(), row_len);
        for (int64_t hq = 0; hq < H; ++hq) {
          const float w = scores[hq * ctx + p];
          const float* v = row.data() + (hq / G) * D;
          float* a = acc.data() + hq * D;
          for (int64_t d = 0; d < D; ++d) a[d] += w * v[d];
        }
      }
      T* o = op + b * H * D;
      for (int64_t hq = 0; hq < H; ++hq)
        for (int64_t d = 0; d < D; ++d) o[hq * D + d] = static_cast<T>(acc[hq * D + d] * inv_sum[hq]);
    }
  });
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q must be [B, H, D] and the cache [blocks, bs, kvh, D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and cache dtypes differ");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  q = q.contiguous();
  block_tables = block_tables.to(torch::kInt64).contiguous();
  context_lens = context_lens.to(torch::kInt64).contiguous();
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(q, k_cache, v_cache, block_tables, context_lens, out, scale);
  });
  return out;
}
