// What the AVX512-BF16 kernels of this directory share: the target attribute
// their functions are compiled for (the rest of the library stays portable:
// `cpu_features.cpp` asks the CPU before any of them runs), the bfloat16
// to float32 widening and SiLU.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#define O3_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// 16 bfloat16 values to float32: exact, the bits move to the high half.
O3_AVX512_BF16 inline __m512 bf16x16_to_float(__m256i half) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

O3_AVX512_BF16 inline __m512 bf16x16_to_float(const uint16_t* p) {
  return bf16x16_to_float(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The first values of 16 (those set in `keep`) to float32, the rest 0.
O3_AVX512_BF16 inline __m512 bf16x16_to_float(const uint16_t* p, __mmask16 keep) {
  return bf16x16_to_float(_mm256_maskz_loadu_epi16(keep, p));
}

inline float bf16_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

// exp(x) to about 2 ulp (Cephes' expf): x = n ln2 + r, |r| <= ln2 / 2.
O3_AVX512_BF16 inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

O3_AVX512_BF16 inline __m512 silu_ps(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.0f);
  return _mm512_div_ps(x, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}
