// Sixteen float32 lanes on AVX2 with FMA: two registers, for x86 CPUs
// without AVX512-BF16 (AMD to Zen 3, Intel client cores). Included by
// `isa_tiles.h` inside the namespace and target region of this ISA.
//
// Each operation gives the float32 result of its AVX512-BF16 counterpart
// bit for bit on normal numbers: `sum` adds in _mm512_reduce_add_ps's
// order, and the products of two bfloat16 values are exact in float32, so
// VDPBF16PS's two adds are two FMAs in the order Intel documents (odd
// element first). The tiles are narrower: 16 registers, not 32.

constexpr int kRouterChunkBlocks = 2;
constexpr int kPairTileRows = 4;
constexpr int kPairTileBlocks = 1;

// 8 bfloat16 values to float32: exact, the bits move to the high half.
inline __m256 bf16x8_to_float(__m128i half) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

// float32 to bfloat16 bits in each 32-bit lane's low half, rounded to
// nearest even as VCVTNEPS2BF16 and torch round; NaN stays a quiet NaN.
inline __m256i float_to_bf16_bits(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i quiet_nan = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, quiet_nan, is_nan);
}

// 32 bfloat16 weights of a pair-layout block: channel c's pair in 32-bit
// word c (its first element in the low half).
struct Pairs {
  __m256i lo, hi;
  static Pairs load(const uint16_t* p) {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16))};
  }
};

// acc + w's first elements * x's first + w's second elements * x's second,
// second elements first.
inline __m256 plus_pair_products8(__m256 acc, __m256i w, __m256 x_first, __m256 x_second) {
  const __m256i high_half = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  acc = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(w, high_half)), x_second, acc);
  return _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)), x_first, acc);
}

struct Vec16 {
  __m256 lo, hi;  // lanes 0-7, 8-15

  static Vec16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static Vec16 broadcast(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  static Vec16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static Vec16 load_bf16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {bf16x8_to_float(_mm256_castsi256_si128(h)),
            bf16x8_to_float(_mm256_extracti128_si256(h, 1))};
  }
  // The first n values (all 16 from n = 16), the rest 0.
  static Vec16 load_bf16(const uint16_t* p, int64_t n) {
    if (n >= 16) return load_bf16(p);
    uint16_t part[16] = {};
    std::memcpy(part, p, n * sizeof(uint16_t));
    return load_bf16(part);
  }
  void store(float* p) const {
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
  }
  // The first n lanes (all 16 from n = 16) to bfloat16.
  void store_bf16(uint16_t* p, int64_t n) const {
    // packus interleaves 128-bit halves: (lo 0-3, hi 0-3, lo 4-7, hi 4-7).
    const __m256i packed = _mm256_permute4x64_epi64(
        _mm256_packus_epi32(float_to_bf16_bits(lo), float_to_bf16_bits(hi)), 0xD8);
    if (n >= 16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
      return;
    }
    uint16_t part[16];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(part), packed);
    std::memcpy(p, part, n * sizeof(uint16_t));
  }
  // Lane c + w's pair c . x's pair (x: two bfloat16 values, first in the
  // low half), as VDPBF16PS.
  Vec16 plus_pair_products(Pairs w, uint32_t x) const {
    const __m256 first = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(x << 16)));
    const __m256 second =
        _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(x & 0xFFFF0000u)));
    return {plus_pair_products8(lo, w.lo, first, second),
            plus_pair_products8(hi, w.hi, first, second)};
  }
  // Each lane rounded to bfloat16 (nearest even), kept as float32.
  Vec16 rounded_to_bf16() const {
    return {_mm256_castsi256_ps(_mm256_slli_epi32(float_to_bf16_bits(lo), 16)),
            _mm256_castsi256_ps(_mm256_slli_epi32(float_to_bf16_bits(hi), 16))};
  }
  Vec16 clamp(float low, float high) const {
    const __m256 l = _mm256_set1_ps(low), h = _mm256_set1_ps(high);
    return {_mm256_min_ps(_mm256_max_ps(lo, l), h), _mm256_min_ps(_mm256_max_ps(hi, l), h)};
  }
  Vec16 round() const {
    constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return {_mm256_round_ps(lo, kNearest), _mm256_round_ps(hi, kNearest)};
  }
  // times 2^n for integral n in [-126, 127], from the exponent bits: what
  // VSCALEFPS gives there.
  Vec16 times_pow2(Vec16 n) const {
    const auto pow2 = [](__m256 e) {
      return _mm256_castsi256_ps(
          _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(e), _mm256_set1_epi32(127)), 23));
    };
    return {_mm256_mul_ps(lo, pow2(n.lo)), _mm256_mul_ps(hi, pow2(n.hi))};
  }
  // In _mm512_reduce_add_ps's order: halves, quarters, then pairs.
  float sum() const {
    const __m256 eighths = _mm256_add_ps(lo, hi);
    const __m128 fours =
        _mm_add_ps(_mm256_extractf128_ps(eighths, 1), _mm256_castps256_ps128(eighths));
    const __m128 twos = _mm_add_ps(fours, _mm_shuffle_ps(fours, fours, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(twos) + _mm_cvtss_f32(_mm_shuffle_ps(twos, twos, 1));
  }
};

inline Vec16 operator+(Vec16 a, Vec16 b) {
  return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
}
inline Vec16 operator-(Vec16 a, Vec16 b) {
  return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)};
}
inline Vec16 operator*(Vec16 a, Vec16 b) {
  return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)};
}
inline Vec16 operator/(Vec16 a, Vec16 b) {
  return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)};
}
inline Vec16 fmadd(Vec16 a, Vec16 b, Vec16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline Vec16 fnmadd(Vec16 a, Vec16 b, Vec16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
