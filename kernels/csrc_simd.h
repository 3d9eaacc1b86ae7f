// SIMD helpers shared by the compiled CPU kernels. KVRELAY_AVX512_BF16 is defined when the build
// targets a CPU with AVX-512 and its bfloat16 dot product (the build uses -march=native).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvrelay_simd {

// bfloat16 is the top half of a float32: widening is exact.
inline float bf16_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even, NaN stays NaN, as c10::BFloat16(float) does; branch-free so loops vectorize.
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
}

// exp(x) to about one float32 ulp (Cephes' polynomial; exp512 below is the same, 16 lanes at a time),
// in plain arithmetic so that loops vectorize.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.3f), 88.7f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace kvrelay_simd

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define KVRELAY_AVX512_BF16 1

namespace kvrelay_simd {

// exp to about one float32 ulp (Cephes' polynomial), 16 lanes.
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// 16 bfloat16 -> 16 float32.
inline __m512 load_bf16x16(const void* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(p))), 16));
}

// 16 float32 -> 16 bfloat16, rounded to nearest even (as float_to_bf16).
inline void store_bf16x16(void* p, __m512 x) {
  _mm256_storeu_si256(static_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));
}

// 16 float32 rounded to bfloat16 and back.
inline __m512 round_bf16x16(__m512 x) {
  const __m256i b = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
  return load_bf16x16(&b);
}

}  // namespace kvrelay_simd
#endif
