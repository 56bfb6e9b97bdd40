// The INT4 GEMM's tile on AVX2 with FMA (x86 CPUs without AVX512-BF16): the
// counterpart of `gemm_tile` in int4_gemm_cpu.cpp, on the same weight layout,
// included there inside namespace `avx2` and its target region, after
// `vec16_avx2.h` (for `Vec16`). With 16 registers, not 32, a tile is half a
// block (8 outputs) by up to 4 rows; and there being no bfloat16 dot
// product, the weight is dequantized in registers, once per tile, into
// float32 (exact: a 4-bit value times a bfloat16 scale) and multiplied with
// float32 inputs, which leaves no per-group sums of x and no second set of
// accumulators to hold. Calls of many rows dequantize the whole weight into
// float32 once instead (`dequantize_block`) for torch's float32 GEMM.

constexpr int kInt4TileRows = 4;

// 128 + q as float32 for nibble j of each 16-bit word of `words` (8 channels,
// one 32-bit pair each): `first` from the pair's low word (input 2 j),
// `second` from its high word (input 2 j + 1). q lands in the mantissa of
// 128.0f at bit 16, whose place value is 1.
inline void expand_nibbles(__m256i words, int j, __m256& first, __m256& second) {
  const __m256i nibble = _mm256_set1_epi32(0x000F0000);
  const __m256i bias = _mm256_set1_epi32(0x43000000);  // 128.0f
  first = _mm256_castsi256_ps(
      _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi32(words, 16 - 4 * j), nibble), bias));
  second = _mm256_castsi256_ps(
      _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(words, 4 * j), nibble), bias));
}

// Per group, the weight is w = (128 + q) * scale - (128 + zero) * scale:
// both terms and the difference exact in float32, the reference's
// dequantized weight. The group's scales and minus its shifts for the 8
// output channels of block b from `half` * 8.
inline void group_params(const float* scales, const float* offsets, int64_t b, int64_t groups,
                         int64_t g, int half, __m256& scale, __m256& minus_shift) {
  const int64_t at = (b * groups + g) * kBlock + half * 8;
  scale = _mm256_loadu_ps(scales + at);
  minus_shift = _mm256_mul_ps(scale, _mm256_set1_ps(-136.0f));  // zero 8
  if (offsets != nullptr)  // (zero - 8) * scale
    minus_shift = _mm256_sub_ps(minus_shift, _mm256_loadu_ps(offsets + at));
}

// Inputs 2 j and 2 j + 1 of 8 channels, dequantized.
inline void dequantize_nibbles(__m256i words, int j, __m256 scale, __m256 minus_shift,
                               __m256 pair[2]) {
  expand_nibbles(words, j, pair[0], pair[1]);
  for (int i = 0; i < 2; ++i) pair[i] = _mm256_fmadd_ps(pair[i], scale, minus_shift);
}

inline __m256i load_half_step(const uint16_t* weight, int64_t b, int64_t steps, int64_t s,
                              int half) {
  const uint16_t* words = weight + (b * steps + s) * 32;
  if (half == 0)
    _mm_prefetch(reinterpret_cast<const char*>(words + kPrefetchSteps * 32), _MM_HINT_T0);
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + half * 16));
}

// y[m, c] for ROWS rows of float32 x (row stride k) and the 8 output channels
// of block b from `half` * 8, rounded to bfloat16 once. Half a block at a
// time keeps the tile in 16 registers: an accumulator per row, per input of
// a pair and (at 1 or 2 rows) per parity of j, so that 4 to 8 FMA chains
// hide the FMA latency.
template <int ROWS>
void int4_tile(const float* x, int64_t k, const uint16_t* weight, const float* scales,
               const float* offsets, int64_t steps, int64_t groups, int64_t b, int half,
               uint16_t* y, int64_t n_out) {
  const int64_t n = b * kBlock + half * 8;
  if (n >= n_out) return;  // padding
  constexpr int kSplit = ROWS <= 2 ? 2 : 1;
  const int64_t steps_per_group = steps / groups;
  __m256 acc[ROWS][kSplit][2];
  for (auto& row : acc)
    for (auto& split : row)
      for (auto& a : split) a = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 scale, minus_shift;
    group_params(scales, offsets, b, groups, g, half, scale, minus_shift);
    for (int64_t s = g * steps_per_group; s < (g + 1) * steps_per_group; ++s) {
      const __m256i w = load_half_step(weight, b, steps, s, half);
      const float* xs = x + s * kStep;
      for (int j = 0; j < 4; ++j) {
        __m256 pair[2];
        dequantize_nibbles(w, j, scale, minus_shift, pair);
        for (int i = 0; i < 2; ++i) {
          for (int m = 0; m < ROWS; ++m) {
            __m256& a = acc[m][j % kSplit][i];
            a = _mm256_fmadd_ps(pair[i], _mm256_broadcast_ss(xs + m * k + 2 * j + i), a);
          }
        }
      }
    }
  }
  for (int m = 0; m < ROWS; ++m) {
    __m256 sum = _mm256_setzero_ps();
    for (const auto& split : acc[m]) sum = _mm256_add_ps(sum, _mm256_add_ps(split[0], split[1]));
    // Vec16's bfloat16 rounding and partial store, on 8 lanes.
    Vec16{sum, _mm256_setzero_ps()}.store_bf16(y + m * n_out + n, std::min<int64_t>(8, n_out - n));
  }
}

// Output block b for 1 to kInt4TileRows rows, a half at a time.
void int4_tile_of(int rows, const float* x, int64_t k, const uint16_t* weight,
                  const float* scales, const float* offsets, int64_t steps, int64_t groups,
                  int64_t b, uint16_t* y, int64_t n_out) {
  for (int h = 0; h < 2; ++h) {
    switch (rows) {
      case 1: int4_tile<1>(x, k, weight, scales, offsets, steps, groups, b, h, y, n_out); break;
      case 2: int4_tile<2>(x, k, weight, scales, offsets, steps, groups, b, h, y, n_out); break;
      case 3: int4_tile<3>(x, k, weight, scales, offsets, steps, groups, b, h, y, n_out); break;
      default: int4_tile<4>(x, k, weight, scales, offsets, steps, groups, b, h, y, n_out); break;
    }
  }
}

// Output block b of the weight dequantized (as `int4_tile` does in
// registers) into rows of float32 dense [n_out, k].
void dequantize_block(const uint16_t* weight, const float* scales, const float* offsets,
                      int64_t b, int64_t steps, int64_t groups, int64_t n_out, float* dense) {
  const int64_t k = steps * kStep, steps_per_group = steps / groups;
  for (int half = 0; half < 2; ++half) {
    const int64_t c0 = b * kBlock + half * 8;
    if (c0 >= n_out) return;
    const int64_t channels = std::min<int64_t>(8, n_out - c0);
    for (int64_t g = 0; g < groups; ++g) {
      __m256 scale, minus_shift;
      group_params(scales, offsets, b, groups, g, half, scale, minus_shift);
      for (int64_t s = g * steps_per_group; s < (g + 1) * steps_per_group; ++s) {
        const __m256i w = load_half_step(weight, b, steps, s, half);
        alignas(32) float values[kStep][8];  // [input][channel]
        for (int j = 0; j < 4; ++j) {
          __m256 pair[2];
          dequantize_nibbles(w, j, scale, minus_shift, pair);
          _mm256_store_ps(values[2 * j], pair[0]);
          _mm256_store_ps(values[2 * j + 1], pair[1]);
        }
        for (int64_t c = 0; c < channels; ++c)
          for (int64_t i = 0; i < kStep; ++i) dense[(c0 + c) * k + s * kStep + i] = values[i][c];
      }
    }
  }
}

// x's bfloat16 rows [begin, end) widened to float32: exact.
void widen_rows(const uint16_t* x, int64_t k, int64_t begin, int64_t end, float* out) {
  for (int64_t i = begin * k; i < end * k; ++i) {
    const uint32_t bits = static_cast<uint32_t>(x[i]) << 16;
    std::memcpy(out + i, &bits, sizeof(bits));
  }
}
