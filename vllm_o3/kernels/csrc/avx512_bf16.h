// What the AVX512-BF16 kernels of this directory share: the target attribute
// their functions are compiled for (the rest of the library stays portable:
// `cpu_features.cpp` asks the CPU before any of them runs) and the bfloat16
// to float32 widening.
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
