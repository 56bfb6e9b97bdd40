// The innermost loops of the routed FFN's CPU kernels and of the norm,
// written once against `Vec16` (16 float32 lanes) and compiled once per ISA
// by `isa_tiles.h`, which includes this file inside each ISA's namespace and
// target region (hence no include guard). The drivers (threads, shapes,
// checks) are `routed_light_cpu.cpp`, `silu_and_mul_cpu.cpp` and
// `rms_norm_cpu.cpp`.

constexpr int64_t kLanes = 16;  // output channels per block of the pair layout

// exp(x) to about 2 ulp (Cephes' expf): x = n ln2 + r, |r| <= ln2 / 2.
inline Vec16 exp(Vec16 x) {
  x = x.clamp(-87.3f, 88.3f);
  const Vec16 n = (x * Vec16::broadcast(1.44269504088896341f)).round();
  Vec16 r = fnmadd(n, Vec16::broadcast(0.693359375f), x);
  r = fnmadd(n, Vec16::broadcast(-2.12194440e-4f), r);
  Vec16 p = Vec16::broadcast(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                        5.0000001201e-1f})
    p = fmadd(p, r, Vec16::broadcast(c));
  p = fmadd(p, r * r, r + Vec16::broadcast(1.0f));
  return p.times_pow2(n);
}

inline Vec16 silu(Vec16 x) { return x / (Vec16::broadcast(1.0f) + exp(Vec16::zero() - x)); }

// Router scores of ROWS consecutive rows, each weight load shared by the
// rows (one row at a time reads W1 whole from L2 per row, which bounded the
// router at prefill sizes). Each row's sums run in the same order whatever
// ROWS is, and whatever the ISA's chunk of hidden units, so a token's score
// does not depend on the batch it came in or on the ISA.
// w1t: [hidden, r_pad] (W1 transposed, hidden units padded to 64 with zero
// weights, biases and w2 entries, which add nothing).
template <int ROWS>
void router_scores_tile(const uint16_t* u, int64_t hidden, const float* w1t, const float* b1,
                        const float* w2, float b2, int64_t r_pad, float* scores) {
  constexpr int64_t kChunk = kRouterChunkBlocks * kLanes;
  Vec16 logit[ROWS];
  for (auto& l : logit) l = Vec16::zero();
  for (int64_t c0 = 0; c0 < r_pad; c0 += kChunk) {
    Vec16 acc[ROWS][kRouterChunkBlocks];
    for (int m = 0; m < ROWS; ++m)
      for (auto& a : acc[m]) a = Vec16::zero();
    for (int64_t k = 0; k < hidden; k += kLanes) {
      alignas(64) float x[ROWS][kLanes];
      for (int m = 0; m < ROWS; ++m) Vec16::load_bf16(u + m * hidden + k).store(x[m]);
      for (int64_t kk = 0; kk < kLanes; ++kk) {
        const float* w = w1t + (k + kk) * r_pad + c0;
        Vec16 wv[kRouterChunkBlocks];
        for (int b = 0; b < kRouterChunkBlocks; ++b) wv[b] = Vec16::load(w + b * kLanes);
        for (int m = 0; m < ROWS; ++m) {
          const Vec16 xs = Vec16::broadcast(x[m][kk]);
          for (int b = 0; b < kRouterChunkBlocks; ++b) acc[m][b] = fmadd(xs, wv[b], acc[m][b]);
        }
      }
    }
    for (int m = 0; m < ROWS; ++m) {
      for (int b = 0; b < kRouterChunkBlocks; ++b) {
        const int64_t c = c0 + b * kLanes;
        const Vec16 h = silu(acc[m][b] + Vec16::load(b1 + c));
        logit[m] = fmadd(h, Vec16::load(w2 + c), logit[m]);
      }
    }
  }
  for (int m = 0; m < ROWS; ++m)
    scores[m] = 1.0f / (1.0f + std::exp(-(logit[m].sum() + b2)));
}

// Scores of `rows` (1 to 4) consecutive rows.
void router_tile(int rows, const uint16_t* u, int64_t hidden, const float* w1t,
                 const float* b1, const float* w2, float b2, int64_t r_pad, float* scores) {
  switch (rows) {
    case 1: router_scores_tile<1>(u, hidden, w1t, b1, w2, b2, r_pad, scores); break;
    case 2: router_scores_tile<2>(u, hidden, w1t, b1, w2, b2, r_pad, scores); break;
    case 3: router_scores_tile<3>(u, hidden, w1t, b1, w2, b2, r_pad, scores); break;
    default: router_scores_tile<4>(u, hidden, w1t, b1, w2, b2, r_pad, scores); break;
  }
}

// y[m] = x[m] @ W^T over output blocks [b0, b0 + BLOCKS) for ROWS rows given
// by pointers (inputs as bfloat16 pairs), W in pair layout with `pairs`
// pairs; outputs rounded to bfloat16 once.
template <int ROWS, int BLOCKS>
void pair_gemm_tile(const uint32_t* const* x, const uint16_t* w, int64_t pairs, int64_t b0,
                    uint16_t* const* y, int64_t n_out) {
  Vec16 acc[ROWS][BLOCKS];
  for (int m = 0; m < ROWS; ++m)
    for (auto& a : acc[m]) a = Vec16::zero();
  for (int64_t p = 0; p < pairs; ++p) {
    Pairs wb[BLOCKS];
    for (int b = 0; b < BLOCKS; ++b) wb[b] = Pairs::load(w + ((b0 + b) * pairs + p) * 2 * kLanes);
    for (int m = 0; m < ROWS; ++m)
      for (int b = 0; b < BLOCKS; ++b) acc[m][b] = acc[m][b].plus_pair_products(wb[b], x[m][p]);
  }
  for (int m = 0; m < ROWS; ++m) {
    for (int b = 0; b < BLOCKS; ++b) {
      const int64_t n = (b0 + b) * kLanes;
      if (n >= n_out) break;
      acc[m][b].store_bf16(y[m] + n, n_out - n);
    }
  }
}

template <int ROWS>
void pair_gemm_rows(int blocks, const uint32_t* const* x, const uint16_t* w, int64_t pairs,
                    int64_t b0, uint16_t* const* y, int64_t n_out) {
  switch (blocks) {
    case 1: pair_gemm_tile<ROWS, 1>(x, w, pairs, b0, y, n_out); break;
    case 2: pair_gemm_tile<ROWS, 2>(x, w, pairs, b0, y, n_out); break;
    case 3: pair_gemm_tile<ROWS, 3>(x, w, pairs, b0, y, n_out); break;
    default: pair_gemm_tile<ROWS, 4>(x, w, pairs, b0, y, n_out); break;
  }
}

// One tile of 1 to 4 rows and 1 to 4 output blocks (the driver takes tiles
// of kPairTileRows x kPairTileBlocks: what the ISA's registers hold).
void pair_gemm_tile_of(int rows, int blocks, const uint32_t* const* x, const uint16_t* w,
                       int64_t pairs, int64_t b0, uint16_t* const* y, int64_t n_out) {
  switch (rows) {
    case 1: pair_gemm_rows<1>(blocks, x, w, pairs, b0, y, n_out); break;
    case 2: pair_gemm_rows<2>(blocks, x, w, pairs, b0, y, n_out); break;
    case 3: pair_gemm_rows<3>(blocks, x, w, pairs, b0, y, n_out); break;
    default: pair_gemm_rows<4>(blocks, x, w, pairs, b0, y, n_out); break;
  }
}

// out[c] = silu(gate[c]) * up[c] for c < n, in float32, rounded once.
void silu_and_mul_row(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t n) {
  for (int64_t c = 0; c < n; c += kLanes) {
    const Vec16 y = silu(Vec16::load_bf16(gate + c, n - c)) * Vec16::load_bf16(up + c, n - c);
    y.store_bf16(out + c, n - c);
  }
}

// One row of n values: out = bf16(bf16(s * rsqrt(mean(s^2) + eps)) * weight)
// with s = x (+ residual), in float32, as vLLM's native norm computes it;
// with a residual, residual_out = bf16(s). `s` (n rounded up to 16 float32
// values) holds the sum between the two passes, so out may alias x and
// residual_out residual (the in-place fused norm).
void rms_norm_row(const uint16_t* x, const uint16_t* residual, const uint16_t* weight,
                  float eps, int64_t n, float* s, uint16_t* residual_out, uint16_t* out) {
  Vec16 squares = Vec16::zero();
  for (int64_t c = 0; c < n; c += kLanes) {
    Vec16 v = Vec16::load_bf16(x + c, n - c);  // lanes past n are 0
    if (residual != nullptr) {
      v = v + Vec16::load_bf16(residual + c, n - c);
      v.store_bf16(residual_out + c, n - c);
    }
    v.store(s + c);
    squares = fmadd(v, v, squares);
  }
  const Vec16 scale = Vec16::broadcast(1.0f / std::sqrt(squares.sum() / n + eps));
  for (int64_t c = 0; c < n; c += kLanes) {
    // Rounded to bfloat16 before the weight, as the native norm does.
    const Vec16 normed = (Vec16::load(s + c) * scale).rounded_to_bf16();
    (normed * Vec16::load_bf16(weight + c, n - c)).store_bf16(out + c, n - c);
  }
}
