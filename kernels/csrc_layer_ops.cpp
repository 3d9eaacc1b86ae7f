// Fused element-wise layer ops for the CPU: RMSNorm (optionally with the residual add before it), RoPE
// in place, and SiLU-and-multiply. Each reads and writes its tensors once, where the torch expressions
// they replace take three to six passes and as many temporaries.
//
// They round exactly where Hugging Face's torch code rounds (float32 math, one rounding to the model's
// dtype after each torch op). The residual add and RoPE match the torch path bit for bit. RMSNorm's sum
// of squares is added in another order and SiLU's exp is our own, so their float32 results can differ
// in the last bit, which flips a bfloat16 rounding for about one value in 10^5.
#include "csrc_aten.h"
#include "csrc_simd.h"
#include <cmath>
#include <algorithm>
#include <cstring>
#include <vector>

namespace {

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) { return kvrelay_simd::bf16_to_float(x.x); }
inline float to_f(c10::Half x) { return static_cast<float>(x); }
inline float to_f(double x) { return static_cast<float>(x); }  // float64 models compute in float32 here

template <typename T> inline T from_f(float f);
template <> inline float from_f<float>(float f) { return f; }
template <> inline c10::BFloat16 from_f<c10::BFloat16>(float f) {
  c10::BFloat16 out;
  out.x = kvrelay_simd::float_to_bf16(f);
  return out;
}
template <> inline c10::Half from_f<c10::Half>(float f) { return c10::Half(f); }
template <> inline double from_f<double>(float f) { return f; }

// What a torch op on tensors of dtype T returns: the float result rounded to T.
template <typename T> inline float round_t(float f) { return to_f(from_f<T>(f)); }

// out = weight * (x * rsqrt(mean(x^2) + eps)).to(T), with x optionally first updated in place to
// x + residual (rounded to T, as `x = x + residual` would be).
template <typename T>
void rms_norm_generic(T* x, const T* residual, const T* weight, T* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * n;
      float lanes[16] = {0.f};
      if (residual != nullptr) {
        const T* rr = residual + r * n;
        for (int64_t i = 0; i < n; ++i) xr[i] = from_f<T>(to_f(xr[i]) + to_f(rr[i]));
      }
      int64_t i = 0;
      for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; ++j) {
          const float v = to_f(xr[i + j]);
          lanes[j] += v * v;
        }
      float sum = 0.f;
      for (int j = 0; j < 16; ++j) sum += lanes[j];
      for (; i < n; ++i) sum += to_f(xr[i]) * to_f(xr[i]);
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
      T* o = out + r * n;
      for (int64_t k = 0; k < n; ++k) o[k] = from_f<T>(to_f(weight[k]) * round_t<T>(to_f(xr[k]) * inv));
    }
  });
}

// x: [tokens, heads, head_dim] (any token stride), rotated in place by the cos/sin rows of each token's
// position (tables [max_positions, head_dim], both halves equal): x1*cos - x2*sin, x2*cos + x1*sin.
template <typename T>
void rope_generic(T* x, int64_t tokens, int64_t heads, int64_t dim, int64_t token_stride, const T* cos_t,
                  const T* sin_t, const int64_t* positions) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> c(half), s(half), x1(half), x2(half);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < half; ++i) {
        c[i] = to_f(cos_t[positions[t] * dim + i]);
        s[i] = to_f(sin_t[positions[t] * dim + i]);
      }
      for (int64_t h = 0; h < heads; ++h) {
        T* __restrict a = x + t * token_stride + h * dim;
        for (int64_t i = 0; i < half; ++i) {
          x1[i] = to_f(a[i]);
          x2[i] = to_f(a[half + i]);
        }
        for (int64_t i = 0; i < half; ++i) {
          a[i] = from_f<T>(round_t<T>(x1[i] * c[i]) - round_t<T>(x2[i] * s[i]));
          a[half + i] = from_f<T>(round_t<T>(x2[i] * c[i]) + round_t<T>(x1[i] * s[i]));
        }
      }
    }
  });
}

template <typename T>
void rms_norm_kernel(T* x, const T* residual, const T* weight, T* out, int64_t rows, int64_t n, float eps) {
  rms_norm_generic(x, residual, weight, out, rows, n, eps);
}

template <typename T>
void rope_kernel(T* x, int64_t tokens, int64_t heads, int64_t dim, int64_t token_stride, const T* cos_t, const T* sin_t,
                 const int64_t* positions) {
  rope_generic(x, tokens, heads, dim, token_stride, cos_t, sin_t, positions);
}

// gate_up: [rows, 2 * n] -> out: [rows, n] = silu(gate).to(T) * up.
template <typename T>
void silu_and_mul_kernel(const T* gate_up, T* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* __restrict g = gate_up + r * 2 * n;
      const T* __restrict u = g + n;
      T* __restrict o = out + r * n;
      for (int64_t i = 0; i < n; ++i) {
        const float gi = to_f(g[i]);
        o[i] = from_f<T>(round_t<T>(gi / (1.f + kvrelay_simd::exp_approx(-gi))) * to_f(u[i]));
      }
    }
  });
}

#ifdef KVRELAY_AVX512_BF16
using kvrelay_simd::load_bf16x16;
using kvrelay_simd::round_bf16x16;
using kvrelay_simd::store_bf16x16;

// The same arithmetic 16 lanes at a time; the hardware conversion rounds to nearest even like from_f.
template <>
void silu_and_mul_kernel<c10::BFloat16>(const c10::BFloat16* gate_up, c10::BFloat16* out, int64_t rows, int64_t n) {
  if (n % 16 != 0) {  // the generic loop handles ragged widths
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t i = 0; i < n; ++i) {
          const float gi = to_f(gate_up[r * 2 * n + i]);
          out[r * n + i] = from_f<c10::BFloat16>(round_t<c10::BFloat16>(gi / (1.f + kvrelay_simd::exp_approx(-gi))) * to_f(gate_up[r * 2 * n + n + i]));
        }
    });
    return;
  }
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const c10::BFloat16* g = gate_up + r * 2 * n;
      const c10::BFloat16* u = g + n;
      c10::BFloat16* o = out + r * n;
      for (int64_t i = 0; i < n; i += 16) {
        const __m512 gi = load_bf16x16(g + i);
        const __m512 e = kvrelay_simd::exp512(_mm512_sub_ps(_mm512_setzero_ps(), gi));
        const __m512 silu = round_bf16x16(_mm512_div_ps(gi, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
        store_bf16x16(o + i, _mm512_mul_ps(silu, load_bf16x16(u + i)));
      }
    }
  });
}

// bfloat16 RMSNorm and RoPE 16 lanes at a time, with the generic loops' arithmetic and roundings (the
// hardware conversion rounds to nearest even like from_f; only a NaN's payload may differ). The generic
// loops do not vectorize (the scalar bfloat16 conversions); on a 2-core Xeon these took SmolLM2's add+RMSNorm
// (width 576) from 0.33 to 0.18 ms at 2,048 rows and from 0.033 to 0.018 at 200, and its RoPE (12 heads of
// 64) from 0.30 to 0.15 and from 0.030 to 0.015 (docs/benchmarks.md). RMSNorm's sum of squares is added in
// a fixed order (opaque to -ffast-math) that differs from the generic loop's compiled one: 5-20 outputs in
// 10^6 differ from it by a rounding step, and against torch's order 3 in 10^6 differ where it had 5.
constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// Lane 0 of the result = the sum of x's 16 lanes, halves added to halves. The rounding-mode forms are
// opaque to the compiler, so -ffast-math cannot reorder these sums (nor those below).
inline float sum_lanes(__m512 x) {
  x = _mm512_add_round_ps(x, _mm512_shuffle_f32x4(x, x, 0x4e), kRound);
  x = _mm512_add_round_ps(x, _mm512_shuffle_f32x4(x, x, 0xb1), kRound);
  x = _mm512_add_round_ps(x, _mm512_permute_ps(x, 0x4e), kRound);
  x = _mm512_add_round_ps(x, _mm512_permute_ps(x, 0xb1), kRound);
  return _mm512_cvtss_f32(x);
}

// 1 / sqrt(sum / n + eps), each operation rounded once.
inline float inv_rms(float sum, int64_t n, float eps) {
  const __m128 mean = _mm_div_round_ss(_mm_set_ss(sum), _mm_set_ss(static_cast<float>(n)), kRound);
  const __m128 root = _mm_sqrt_round_ss(mean, _mm_add_round_ss(mean, _mm_set_ss(eps), kRound), kRound);
  return _mm_cvtss_f32(_mm_div_round_ss(_mm_set_ss(1.f), root, kRound));
}

template <>
void rms_norm_kernel<c10::BFloat16>(c10::BFloat16* x, const c10::BFloat16* residual, const c10::BFloat16* weight,
                                    c10::BFloat16* out, int64_t rows, int64_t n, float eps) {
  if (n % 16 != 0) return rms_norm_generic(x, residual, weight, out, rows, n, eps);  // ragged widths
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      c10::BFloat16* xr = x + r * n;
      __m512 acc = _mm512_setzero_ps();  // the sum of squares, 16 lanes
      if (residual != nullptr) {
        const c10::BFloat16* rr = residual + r * n;
        for (int64_t i = 0; i < n; i += 16) {
          const __m512 v = round_bf16x16(_mm512_add_ps(load_bf16x16(xr + i), load_bf16x16(rr + i)));
          store_bf16x16(xr + i, v);
          acc = _mm512_fmadd_round_ps(v, v, acc, kRound);
        }
      } else {
        for (int64_t i = 0; i < n; i += 16) {
          const __m512 v = load_bf16x16(xr + i);
          acc = _mm512_fmadd_round_ps(v, v, acc, kRound);
        }
      }
      const __m512 vinv = _mm512_set1_ps(inv_rms(sum_lanes(acc), n, eps));
      c10::BFloat16* o = out + r * n;
      for (int64_t k = 0; k < n; k += 16)
        store_bf16x16(o + k, _mm512_mul_ps(load_bf16x16(weight + k), round_bf16x16(_mm512_mul_ps(load_bf16x16(xr + k), vinv))));
    }
  });
}

template <>
void rope_kernel<c10::BFloat16>(c10::BFloat16* x, int64_t tokens, int64_t heads, int64_t dim, int64_t token_stride,
                                const c10::BFloat16* cos_t, const c10::BFloat16* sin_t, const int64_t* positions) {
  const int64_t half = dim / 2;
  if (half % 16 != 0) return rope_generic(x, tokens, heads, dim, token_stride, cos_t, sin_t, positions);
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const c10::BFloat16* ct = cos_t + positions[t] * dim;
      const c10::BFloat16* st = sin_t + positions[t] * dim;
      for (int64_t i = 0; i < half; i += 16) {
        const __m512 c = load_bf16x16(ct + i), s = load_bf16x16(st + i);
        for (int64_t h = 0; h < heads; ++h) {
          c10::BFloat16* a = x + t * token_stride + h * dim;
          const __m512 x1 = load_bf16x16(a + i), x2 = load_bf16x16(a + half + i);
          store_bf16x16(a + i, _mm512_sub_ps(round_bf16x16(_mm512_mul_ps(x1, c)), round_bf16x16(_mm512_mul_ps(x2, s))));
          store_bf16x16(a + half + i, _mm512_add_ps(round_bf16x16(_mm512_mul_ps(x2, c)), round_bf16x16(_mm512_mul_ps(x1, s))));
        }
      }
    }
  });
}
#endif

// Whether (value b, index ib) comes before (a, ia) as a row's maximum: NaN above every number, then the
// larger value, then the smaller index (the first maximum, as torch.max(dim=-1) picks it).
inline bool ahead(float b, int64_t ib, float a, int64_t ia) {
  const bool nb = std::isnan(b), na = std::isnan(a);
  if (nb || na) return nb && (!na || ib < ia);
  return b > a || (b == a && ib < ia);
}

// The index of the first maximum of n bfloat16 (n >= 1).
int64_t argmax_row_bf16(const uint16_t* x, int64_t n) {
  float best = kvrelay_simd::bf16_to_float(x[0]);
  int64_t best_i = 0, i = 1;
#ifdef KVRELAY_AVX512_BF16
  if (n >= 64) {
    // Four chains of 16 lanes, each over every fourth group of 16 (a lane keeps its first maximum: only a
    // larger value, or a first NaN, replaces it), then merged lane by lane and across lanes by `ahead`.
    constexpr int kChains = 4;
      const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 vmax[kChains];
    __m512i vidx[kChains];
    for (int c = 0; c < kChains; ++c) {
      vmax[c] = load_bf16x16(x + 16 * c);
      vidx[c] = _mm512_add_epi32(lanes, _mm512_set1_epi32(16 * c));
    }
    __m512i first = vidx[0];  // the indices of the first chain's current group
    const __m512i step = _mm512_set1_epi32(16 * kChains);
    for (i = 16 * kChains; i + 16 * kChains <= n; i += 16 * kChains) {
      first = _mm512_add_epi32(first, step);
      for (int c = 0; c < kChains; ++c) {
        const __m512 v = load_bf16x16(x + i + 16 * c);
        // v > max, or v NaN, while max is not yet NaN
        const __mmask16 take = _mm512_cmp_ps_mask(v, vmax[c], _CMP_NLE_UQ) & _mm512_cmp_ps_mask(vmax[c], vmax[c], _CMP_ORD_Q);
        vmax[c] = _mm512_mask_mov_ps(vmax[c], take, v);
        vidx[c] = _mm512_mask_mov_epi32(vidx[c], take, _mm512_add_epi32(first, _mm512_set1_epi32(16 * c)));
      }
    }
    alignas(64) float m[kChains][16];
    alignas(64) int32_t ix[kChains][16];
    for (int c = 0; c < kChains; ++c) {
      _mm512_store_ps(m[c], vmax[c]);
      _mm512_store_si512(ix[c], vidx[c]);
    }
    best = m[0][0];
    best_i = ix[0][0];
    for (int c = 0; c < kChains; ++c)
      for (int l = 0; l < 16; ++l)
        if (ahead(m[c][l], ix[c][l], best, best_i)) best = m[c][l], best_i = ix[c][l];
  }
#endif
  for (; i < n; ++i) {  // what the vector loop left (or all of it), every index past the ones above
    const float v = kvrelay_simd::bf16_to_float(x[i]);
    if (ahead(v, i, best, best_i)) best = v, best_i = i;
  }
  return best_i;
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), name, " must be a contiguous [rows, features] tensor");
}

}  // namespace

// key/value: [tokens, kv_heads, head_dim] with each token's heads contiguous (views of the fused qkv
// output are); copied to their slots of the [blocks, block_size, kv_heads, head_dim] caches.
void write_kv_(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor key, torch::Tensor value, torch::Tensor slots) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == v_cache.scalar_type(), "dtype mismatch");
  const int64_t row = k_cache.size(2) * k_cache.size(3);
  for (const auto& t : {key, value})
    TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2) && t.size(1) * t.size(2) == row,
                "key/value must be [tokens, kv_heads, head_dim] with contiguous heads");
  slots = slots.to(torch::kInt64).contiguous();
  TORCH_CHECK(slots.numel() == key.size(0) && value.size(0) == key.size(0), "one slot per token");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t bytes = row * k_cache.element_size();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  const int64_t ks = key.stride(0) * key.element_size(), vs = value.stride(0) * value.element_size();
  for (int64_t t = 0; t < key.size(0); ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot ", sp[t], " outside the cache");
    std::memcpy(kc + sp[t] * bytes, kp + t * ks, bytes);
    std::memcpy(vc + sp[t] * bytes, vp + t * vs, bytes);
  }
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(1), "weight must match x");
  auto out = torch::empty_like(x);
  weight = weight.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_kernel<scalar_t>(x.data_ptr<scalar_t>(), nullptr, weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                              x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

// x += residual (in place), then returns rms_norm(x).
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(), "residual must match x");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(1), "weight must match x");
  auto out = torch::empty_like(x);
  weight = weight.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    rms_norm_kernel<scalar_t>(x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                              out.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

void rope_(torch::Tensor x, torch::Tensor cos_table, torch::Tensor sin_table, torch::Tensor positions) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "x must be [tokens, heads, head_dim] with dense rows");
  TORCH_CHECK(cos_table.is_contiguous() && sin_table.is_contiguous() && cos_table.size(1) == x.size(2),
              "cos/sin tables must be contiguous [positions, head_dim]");
  TORCH_CHECK(cos_table.scalar_type() == x.scalar_type() && sin_table.scalar_type() == x.scalar_type(), "table dtype must match x");
  positions = positions.to(torch::kInt64).contiguous();
  TORCH_CHECK(positions.numel() == x.size(0), "one position per token");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope_", [&] {
    rope_kernel<scalar_t>(x.data_ptr<scalar_t>(), x.size(0), x.size(1), x.size(2), x.stride(0), cos_table.data_ptr<scalar_t>(),
                          sin_table.data_ptr<scalar_t>(), positions.data_ptr<int64_t>());
  });
}

torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even number of features");
  auto out = torch::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_kernel<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), gate_up.size(0), gate_up.size(1) / 2);
  });
  return out;
}

// logits: [rows, n] bfloat16 with dense rows -> int64 [rows]: each row's first maximum, a NaN counting above
// every number, as torch.max(dim=-1).indices gives it (the sampler's greedy rows).
torch::Tensor argmax_bf16(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kBFloat16 && logits.stride(1) == 1,
              "logits must be [rows, n] bfloat16 with dense rows");
  TORCH_CHECK(logits.size(1) > 0 && logits.size(1) < (int64_t{1} << 31), "rows must have 1 to 2^31 - 1 entries");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  auto out = torch::empty({rows}, logits.options().dtype(torch::kInt64));
  const auto* x = reinterpret_cast<const uint16_t*>(logits.data_ptr());
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = argmax_row_bf16(x + r * stride, n);
  });
  return out;
}
