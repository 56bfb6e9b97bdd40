// The INT4 GEMM's tile on AVX2 with FMA (x86 CPUs without AVX512-BF16): the
// counterpart of `gemm_tile` in int4_gemm_cpu.cpp, on the same weight layout,
// included there inside namespace `avx2` and its target region, after
// `vec16_avx2.h` (for `Vec16`). With 16 registers, not 32, a tile is half a
// block (8 outputs) by up to 4 rows; there being no bfloat16 dot product,
// the 4-bit values are converted to float32 and multiplied with float32
// inputs, and per group the tile takes the zero point off with the group
// sums of x, as the AVX-512 path does. Calls of many rows dequantize the
// whole weight into float32 once instead (`dequantize_block`) for torch's
// float32 GEMM.

constexpr int kInt4TileRows = 4;

// The 4-bit values q of nibble j of the 8 channels' pairs in `words`, as
// they sit: the pair's low word (input 2 j) masked in place is
// q * 2^(4 j), its high word (input 2 j + 1) q * 2^(16 + 4 j), both exact
// in float32 after the integer conversion (the last nibble, whose place is
// the sign bit, is shifted down instead: q * 2^0). One AND (or shift) and
// one conversion a value, where shifting each nibble to a common place
// first took one operation more; what multiplies them carries the inverse
// power of two instead (`kInputScale`).
inline void masked_nibbles(__m256i words, int j, __m256& first, __m256& second) {
  first = _mm256_cvtepi32_ps(_mm256_and_si256(words, _mm256_set1_epi32(0xF << (4 * j))));
  second = _mm256_cvtepi32_ps(
      j == 3 ? _mm256_srli_epi32(words, 28)
             : _mm256_and_si256(words, _mm256_set1_epi32(0xF << (16 + 4 * j))));
}

// The power of two by which input 2 j + i of each step is multiplied
// (inputs, widened once per call, and the scales of `dequantize_block`), so
// that its product with `masked_nibbles`' value is exact: inputs or scales
// below 2^-102 in magnitude, far below any activation or weight, would lose
// bits as float32 subnormals.
constexpr float kInputScale[kStep] = {1.0f,    0x1p-16f, 0x1p-4f,  0x1p-20f,
                                      0x1p-8f, 0x1p-24f, 0x1p-12f, 1.0f};

// The group's scales, and minus its zero points times them, for the 8
// output channels of block b from `half` * 8.
inline void group_params(const float* scales, const float* offsets, int64_t b, int64_t groups,
                         int64_t g, int half, __m256& scale, __m256& minus_shift) {
  const int64_t at = (b * groups + g) * kBlock + half * 8;
  scale = _mm256_loadu_ps(scales + at);
  minus_shift = _mm256_mul_ps(scale, _mm256_set1_ps(-8.0f));  // zero 8
  if (offsets != nullptr)  // (zero - 8) * scale
    minus_shift = _mm256_sub_ps(minus_shift, _mm256_loadu_ps(offsets + at));
}

inline __m256i load_half_step(const uint16_t* weight, int64_t b, int64_t steps, int64_t s,
                              int half) {
  const uint16_t* words = weight + (b * steps + s) * 32;
  if (half == 0)
    _mm_prefetch(reinterpret_cast<const char*>(words + kPrefetchSteps * 32), _MM_HINT_T0);
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + half * 16));
}

// y[m, c] for ROWS rows of scaled float32 x (row stride k; `x_sums`: the
// rows' group sums of the unscaled x, row stride `groups`) and the 8 output
// channels of block b from `half` * 8, rounded to bfloat16 once. Per group
// the tile sums q * x on the 4-bit values as they are, and adds
// scale * sum(q x) - zero * scale * sum(x): the weight is never dequantized,
// which leaves per 4-bit value an AND and a conversion, shared by the rows,
// and an FMA a row. Half a block at a time keeps the tile in 16 registers: a
// group accumulator per row, per input of a pair and (at 1 or 2 rows) per j
// modulo kSplit, so that 6 to 8 FMA chains hide the FMA latency.
template <int ROWS>
void int4_tile(const float* x, const float* x_sums, int64_t k, const uint16_t* weight,
               const float* scales, const float* offsets, int64_t steps, int64_t groups,
               int64_t b, int half, uint16_t* y, int64_t n_out) {
  const int64_t n = b * kBlock + half * 8;
  if (n >= n_out) return;  // padding
  constexpr int kSplit = ROWS <= 2 ? 4 / ROWS : 1;
  const int64_t steps_per_group = steps / groups;
  __m256 total[ROWS];
  for (auto& t : total) t = _mm256_setzero_ps();
  // A pointer a row, moved a step at a time: indexed from x alone, the
  // compiler kept an address for each row and input of a step, more than the
  // registers hold.
  const float* xs[ROWS];
  for (int m = 0; m < ROWS; ++m) xs[m] = x + m * k;
  for (int64_t g = 0; g < groups; ++g) {
    __m256 part[ROWS][kSplit][2];
    for (auto& row : part)
      for (auto& split : row)
        for (auto& a : split) a = _mm256_setzero_ps();
    for (int64_t s = g * steps_per_group; s < (g + 1) * steps_per_group; ++s) {
      const __m256i w = load_half_step(weight, b, steps, s, half);
      // Unrolled early, for GCC's scalar replacement of the accumulators: by
      // itself it unrolled these loops too late at one row, and kept that
      // tile's accumulators in memory, stored every step (1.4x the time).
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        __m256 pair[2];
        masked_nibbles(w, j, pair[0], pair[1]);
#pragma GCC unroll 2
        for (int i = 0; i < 2; ++i) {
          for (int m = 0; m < ROWS; ++m) {
            __m256& a = part[m][j % kSplit][i];
            a = _mm256_fmadd_ps(pair[i], _mm256_broadcast_ss(xs[m] + 2 * j + i), a);
          }
        }
      }
      for (auto& row : xs) row += kStep;
    }
    __m256 scale, minus_shift;
    group_params(scales, offsets, b, groups, g, half, scale, minus_shift);
    for (int m = 0; m < ROWS; ++m) {
      __m256 sum = _mm256_add_ps(part[m][0][0], part[m][0][1]);
      for (int split = 1; split < kSplit; ++split)
        sum = _mm256_add_ps(sum, _mm256_add_ps(part[m][split][0], part[m][split][1]));
      total[m] = _mm256_fmadd_ps(sum, scale, total[m]);
      total[m] = _mm256_fmadd_ps(minus_shift, _mm256_broadcast_ss(x_sums + m * groups + g),
                                 total[m]);
    }
  }
  for (int m = 0; m < ROWS; ++m) {
    // Vec16's bfloat16 rounding and partial store, on 8 lanes.
    Vec16{total[m], _mm256_setzero_ps()}.store_bf16(y + m * n_out + n,
                                                    std::min<int64_t>(8, n_out - n));
  }
}

// Output block b for 1 to kInt4TileRows rows, a half at a time.
void int4_tile_of(int rows, const float* x, const float* x_sums, int64_t k,
                  const uint16_t* weight, const float* scales, const float* offsets,
                  int64_t steps, int64_t groups, int64_t b, uint16_t* y, int64_t n_out) {
  for (int h = 0; h < 2; ++h) {
    const auto run = [&](auto tile) {
      tile(x, x_sums, k, weight, scales, offsets, steps, groups, b, h, y, n_out);
    };
    switch (rows) {
      case 1: run(int4_tile<1>); break;
      case 2: run(int4_tile<2>); break;
      case 3: run(int4_tile<3>); break;
      default: run(int4_tile<4>); break;
    }
  }
}

// Output block b of the weight dequantized, q * scale - zero * scale as
// the reference's float32 weight (exact), into rows of float32 dense
// [n_out, k].
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
      __m256 step_scales[kStep];
      for (int i = 0; i < kStep; ++i)
        step_scales[i] = _mm256_mul_ps(scale, _mm256_set1_ps(kInputScale[i]));
      for (int64_t s = g * steps_per_group; s < (g + 1) * steps_per_group; ++s) {
        const __m256i w = load_half_step(weight, b, steps, s, half);
        alignas(32) float values[kStep][8];  // [input][channel]
        for (int j = 0; j < 4; ++j) {
          __m256 pair[2];
          masked_nibbles(w, j, pair[0], pair[1]);
          for (int i = 0; i < 2; ++i)
            _mm256_store_ps(values[2 * j + i],
                            _mm256_fmadd_ps(pair[i], step_scales[2 * j + i], minus_shift));
        }
        for (int64_t c = 0; c < channels; ++c)
          for (int64_t i = 0; i < kStep; ++i) dense[(c0 + c) * k + s * kStep + i] = values[i][c];
      }
    }
  }
}

// x's bfloat16 rows [begin, end) widened to float32 and scaled for the
// tiles (`kInputScale`): exact; and their group sums, unscaled.
void widen_rows(const uint16_t* x, int64_t k, int64_t groups, int64_t begin, int64_t end,
                float* out, float* sums) {
  const __m256 scale = _mm256_loadu_ps(kInputScale);
  const int64_t size = k / groups;  // a multiple of kStep
  for (int64_t r = begin; r < end; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      __m256 sum = _mm256_setzero_ps();
      for (int64_t i = r * k + g * size; i < r * k + (g + 1) * size; i += kStep) {
        const __m256 wide =
            bf16x8_to_float(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i)));
        sum = _mm256_add_ps(sum, wide);
        _mm256_storeu_ps(out + i, _mm256_mul_ps(wide, scale));
      }
      sums[r * groups + g] = Vec16{sum, _mm256_setzero_ps()}.sum();
    }
  }
}
