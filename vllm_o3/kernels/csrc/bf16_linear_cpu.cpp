// 16-bit linears, y = x W^T + b in bfloat16, on x86 CPUs where torch has no
// fast bfloat16 GEMM: without AVX-512, oneDNN has no bfloat16 matmul, so
// vLLM's CPU linears fall back to torch's, a plain loop that runs several
// times slower than torch's float32 GEMM and whose throughput barely rises
// with rows (docs/bench_bf16_linear.md). O3's attention, head and 16-bit FFN
// run this instead (`cpu_bf16_linear.py`), on AVX2 with FMA:
//
// - below kFloatGemmMinRows rows (decode): dot products of the weight's rows
//   as they sit ([N, K] bfloat16, no copy, so no extra memory) with x widened
//   to float32 once; tiles of 1 row x 8 channels to 4 rows x 3 in
//   registers, which at one row read the weight at about the memory's speed;
// - from it (prefill): the weight widened to float32 a block of channels at
//   a time and torch's float32 GEMM on each block.
//
// Both sum in float32 and round each output to bfloat16 once (with the bias
// added in float32), as torch's bfloat16 linear does, in another order.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "isa.h"

namespace {

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include "vec16_avx2.h"

inline __m256 load_bf16x8(const uint16_t* p) {
  return bf16x8_to_float(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline float sum8(__m256 v) { return Vec16{v, _mm256_setzero_ps()}.sum(); }

inline float bf16_value(uint16_t bits) {
  return c10::BFloat16(bits, c10::BFloat16::from_bits());
}

// Dot products of ROWS rows of x (float32, row stride `x_stride`, zero past
// k up to a multiple of 8) with OUTS rows of w (bfloat16, row stride k):
// out[r * out_stride + o], with bias[o] added when given, rounded once.
template <int ROWS, int OUTS>
void dot_tile(const float* x, int64_t x_stride, const uint16_t* w, int64_t k,
              const uint16_t* bias, uint16_t* out, int64_t out_stride) {
  __m256 acc[ROWS][OUTS];
  for (auto& row : acc)
    for (auto& a : row) a = _mm256_setzero_ps();
  const int64_t whole = k & ~int64_t{7};
  for (int64_t c = 0; c < whole; c += 8) {
    __m256 wv[OUTS];
    // The next tile's rows, a cache line of each at a time: rows of a few
    // hundred inputs are too short for the hardware's stream prefetch (past
    // the weight's end a prefetch reads nothing).
    if (c % 32 == 0)
      for (int o = 0; o < OUTS; ++o)
        _mm_prefetch(reinterpret_cast<const char*>(w + (OUTS + o) * k + c), _MM_HINT_T0);
    for (int o = 0; o < OUTS; ++o) wv[o] = load_bf16x8(w + o * k + c);
    for (int r = 0; r < ROWS; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * x_stride + c);
      for (int o = 0; o < OUTS; ++o) acc[r][o] = _mm256_fmadd_ps(wv[o], xv, acc[r][o]);
    }
  }
  if (whole < k) {  // the last k % 8 inputs, the rest of the vector zero
    for (int o = 0; o < OUTS; ++o) {
      uint16_t part[8] = {};
      std::memcpy(part, w + o * k + whole, (k - whole) * sizeof(uint16_t));
      const __m256 wv = load_bf16x8(part);
      for (int r = 0; r < ROWS; ++r)
        acc[r][o] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * x_stride + whole), acc[r][o]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    for (int o = 0; o < OUTS; ++o) {
      float y = sum8(acc[r][o]);
      if (bias != nullptr) y += bf16_value(bias[o]);
      out[r * out_stride + o] = c10::BFloat16(y).x;
    }
  }
}

// Channels per tile for a tile of ROWS rows: 12 accumulators or fewer (8 at
// one row, which is memory-bound), with the weights and x in the rest of
// the 16 registers.
template <int ROWS>
constexpr int kTileOuts = ROWS == 1 ? 8 : 12 / ROWS;

// ROWS rows for `outs` consecutive channels from w's row 0: tiles of
// kTileOuts channels, then the channels past the last whole tile one at a
// time.
template <int ROWS>
void dot_rows(const float* x, int64_t x_stride, const uint16_t* w, int64_t k, int64_t outs,
              const uint16_t* bias, uint16_t* out, int64_t out_stride) {
  constexpr int kOuts = kTileOuts<ROWS>;
  int64_t o = 0;
  for (; o + kOuts <= outs; o += kOuts)
    dot_tile<ROWS, kOuts>(x, x_stride, w + o * k, k, bias ? bias + o : nullptr, out + o,
                          out_stride);
  for (; o < outs; ++o)
    dot_tile<ROWS, 1>(x, x_stride, w + o * k, k, bias ? bias + o : nullptr, out + o,
                      out_stride);
}

// `rows` rows of x for `outs` channels: tiles of 4 rows, the rest in one.
void dot_block(int64_t rows, const float* x, int64_t x_stride, const uint16_t* w, int64_t k,
               int64_t outs, const uint16_t* bias, uint16_t* out, int64_t out_stride) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4)
    dot_rows<4>(x + r * x_stride, x_stride, w, k, outs, bias, out + r * out_stride, out_stride);
  const float* xr = x + r * x_stride;
  uint16_t* yr = out + r * out_stride;
  switch (rows - r) {
    case 3: dot_rows<3>(xr, x_stride, w, k, outs, bias, yr, out_stride); break;
    case 2: dot_rows<2>(xr, x_stride, w, k, outs, bias, yr, out_stride); break;
    case 1: dot_rows<1>(xr, x_stride, w, k, outs, bias, yr, out_stride); break;
    default: break;
  }
}

// n bfloat16 values to float32, and `pad` zeros after them.
void widen(const uint16_t* in, int64_t n, int64_t pad, float* out) {
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) _mm256_storeu_ps(out + c, load_bf16x8(in + c));
  for (; c < n; ++c) out[c] = bf16_value(in[c]);
  std::fill(out + n, out + n + pad, 0.0f);
}

// n float32 values (+ bias) rounded to bfloat16.
void narrow(const float* in, const uint16_t* bias, int64_t n, uint16_t* out) {
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {
    Vec16 v = Vec16::load(in + c);
    if (bias != nullptr) v = v + Vec16::load_bf16(bias + c);
    v.store_bf16(out + c, 16);
  }
  for (; c < n; ++c) {
    float y = in[c];
    if (bias != nullptr) y += bf16_value(bias[c]);
    out[c] = c10::BFloat16(y).x;
  }
}
}  // namespace avx2
#pragma GCC pop_options

// From this many rows the float32 GEMM on a widened weight beats the tiles
// (an ad hoc sweep on the 1b preset's shapes: even at 128 rows, mixed at
// 256, the GEMM 5-25 % faster at 512).
constexpr int64_t kFloatGemmMinRows = 256;
// Channels of one unit of work of the tiles (a multiple of every tile's).
constexpr int64_t kChannelBlock = 24;
// Channels widened per float32 GEMM: a few MB of float32 weight.
constexpr int64_t kGemmChannels = 256;
// Below this many multiply-adds a thread's share is not worth waking threads.
constexpr int64_t kMinWorkPerThread = 256 * 1024;

const uint16_t* bits(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr());
}

at::Tensor tiled_linear(const at::Tensor& x, const at::Tensor& weight, const uint16_t* bias) {
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0);
  const int64_t x_stride = (k + 7) / 8 * 8;
  at::Tensor wide = at::empty({rows, x_stride}, x.options().dtype(at::kFloat));
  at::Tensor y = at::empty({rows, n}, x.options());
  float* xf = wide.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    avx2::widen(bits(x) + r * k, k, x_stride - k, xf + r * x_stride);
  const uint16_t* w = bits(weight);
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t blocks = (n + kChannelBlock - 1) / kChannelBlock;
  const int64_t block_work = std::max<int64_t>(1, rows * k * kChannelBlock);
  at::parallel_for(0, blocks, std::max<int64_t>(1, kMinWorkPerThread / block_work),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t b = begin; b < end; ++b) {
                       const int64_t o = b * kChannelBlock;
                       avx2::dot_block(rows, xf, x_stride, w + o * k, k,
                                       std::min(kChannelBlock, n - o), bias ? bias + o : nullptr,
                                       yp + o, n);
                     }
                   });
  return y;
}

at::Tensor float_gemm_linear(const at::Tensor& x, const at::Tensor& weight,
                             const uint16_t* bias) {
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0);
  const at::Tensor xf = x.to(at::kFloat);
  const int64_t channels = std::min(kGemmChannels, n);
  at::Tensor wf = at::empty({channels, k}, xf.options());
  at::Tensor yf = at::empty({rows, channels}, xf.options());
  at::Tensor y = at::empty({rows, n}, x.options());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  float* wp = wf.data_ptr<float>();
  const float* bp = yf.data_ptr<float>();
  const int64_t widen_grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, k));
  for (int64_t o = 0; o < n; o += channels) {
    const int64_t c = std::min(channels, n - o);
    const uint16_t* w = bits(weight) + o * k;
    at::parallel_for(0, c, widen_grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) avx2::widen(w + i * k, k, 0, wp + i * k);
    });
    at::Tensor block = yf.narrow(1, 0, c);
    at::mm_out(block, xf, wf.narrow(0, 0, c).t());
    at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / c), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        avx2::narrow(bp + r * channels, bias ? bias + o : nullptr, c, yp + r * n + o);
    });
  }
  return y;
}

// F.linear's contract, all bfloat16: x [..., K], weight [N, K], bias [N] or
// None -> [..., N]; so that it is a linear's `cpu_linear` as it is.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(o3_cpu::active_isa() != o3_cpu::Isa::kNone,
              "bf16_linear: this CPU has no AVX2 with FMA");
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kBFloat16,
              "bf16_linear: x must be a bfloat16 tensor [..., K]");
  const int64_t k = x.size(-1), n = weight.size(0);
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 &&
                  weight.is_contiguous() && weight.size(1) == k,
              "bf16_linear: weight must be a contiguous bfloat16 [N, ", k, "]");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kBFloat16 &&
                                    bias->is_contiguous() && bias->dim() == 1 &&
                                    bias->size(0) == n),
              "bf16_linear: bias must be a contiguous bfloat16 [", n, "]");
  const int64_t lead = c10::multiply_integers(x.sizes().begin(), x.sizes().end() - 1);
  const at::Tensor rows = x.reshape({lead, k}).contiguous();
  const uint16_t* bp = bias.has_value() ? bits(*bias) : nullptr;
  const at::Tensor y = rows.size(0) >= kFloatGemmMinRows ? float_gemm_linear(rows, weight, bp)
                                                         : tiled_linear(rows, weight, bp);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  return y.view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(o3_cpu, m) {
  m.def("bf16_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("bf16_linear", c10::DispatchKey::CPU, TORCH_FN(bf16_linear));
}
