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
  Vec16 silu() const { return {silu_ps(v)}; }
  float sum() const { return _mm512_reduce_add_ps(v); }
};

inline Vec16 operator+(Vec16 a, Vec16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec16 operator*(Vec16 a, Vec16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec16 fmadd(Vec16 a, Vec16 b, Vec16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
