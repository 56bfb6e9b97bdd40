// Sixteen float32 lanes on AVX512-BF16: one register. Included by
// `isa_tiles.h` inside the namespace and target region of this ISA; the
// interface is `vec16_avx2.h`'s, which documents it.

constexpr int kRouterChunkBlocks = 4;  // router hidden units per pass / 16
constexpr int kPairTileRows = 4;       // rows sharing each weight load
constexpr int kPairTileBlocks = 4;     // output blocks sharing each input pair

inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

struct Pairs {
  __m512bh w;
  static Pairs load(const uint16_t* p) { return {(__m512bh)_mm512_loadu_si512(p)}; }
};

struct Vec16 {
  __m512 v;

  static Vec16 zero() { return {_mm512_setzero_ps()}; }
  static Vec16 broadcast(float x) { return {_mm512_set1_ps(x)}; }
  static Vec16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec16 load_bf16(const uint16_t* p) { return {bf16x16_to_float(p)}; }
  static Vec16 load_bf16(const uint16_t* p, int64_t n) {
    return {bf16x16_to_float(p, first_lanes(n))};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store_bf16(uint16_t* p, int64_t n) const {
    _mm256_mask_storeu_epi16(p, first_lanes(n), (__m256i)_mm512_cvtneps_pbh(v));
  }
  Vec16 plus_pair_products(Pairs w, uint32_t x) const {
    return {_mm512_dpbf16_ps(v, w.w, (__m512bh)_mm512_set1_epi32(static_cast<int>(x)))};
  }
  Vec16 rounded_to_bf16() const {
    return {bf16x16_to_float((__m256i)_mm512_cvtneps_pbh(v))};
  }
  Vec16 clamp(float lo, float hi) const {
    return {_mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(lo)), _mm512_set1_ps(hi))};
  }
  Vec16 round() const {
    return {_mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
  }
  Vec16 times_pow2(Vec16 n) const { return {_mm512_scalef_ps(v, n.v)}; }
  float sum() const { return _mm512_reduce_add_ps(v); }
};

inline Vec16 operator+(Vec16 a, Vec16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec16 operator-(Vec16 a, Vec16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec16 operator*(Vec16 a, Vec16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec16 operator/(Vec16 a, Vec16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Vec16 fmadd(Vec16 a, Vec16 b, Vec16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec16 fnmadd(Vec16 a, Vec16 b, Vec16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }
