// y = x @ W^T for a 4-bit weight and bfloat16 activations, on x86 CPUs with
// AVX512-BF16: the weight is expanded to bfloat16 in registers only, so each
// call reads 4 bits per weight and every expanded weight serves a tile of
// rows (torch's packed INT4 matmul expands it again for every row). Threads
// split the output channels; each runs its tiles over chunks of rows whose
// inputs stay in L2.
//
// Weight layout (`pack_for_gemm` in cpu_int4_gemm.py): output channels in blocks
// of 16, input channels in steps of 8; each (block, step) is 32 little-endian
// 16-bit words, word w holding in nibble j the value for output channel w / 2
// and input channel 2 j + w % 2. Nibble j of all 32 words is then one operand
// of VDPBF16PS: 16 channels x one pair of inputs.
// The 4-bit values q map to q - 8 (exact in bfloat16); per group,
//   y[m, n] += scale[n, g] * sum_k (q - 8) x[m, k] - offset[n, g] * sum_k x[m, k]
// with offset = (zero - 8) * scale (none for symmetric weights).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "avx512_bf16.h"

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kBlock = 16;         // output channels per VDPBF16PS
constexpr int64_t kBlocksPerTile = 4;  // blocks sharing each broadcast of x
constexpr int64_t kStep = 8;           // input channels per 64-byte word group
constexpr int64_t kMaxRowsPerTile = 4;  // rows sharing each expanded weight
// Rows whose inputs stay in L2 while a thread runs its output tiles over them.
constexpr int64_t kChunkBytes = 384 * 1024;

O3_AVX512_BF16 inline __m512i nibble_table() {
  alignas(64) uint16_t table[32];
  for (int q = 0; q < 32; ++q) {
    float value = static_cast<float>((q & 15) - 8);
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    table[q] = static_cast<uint16_t>(bits >> 16);  // exact: small integers
  }
  return _mm512_load_si512(table);
}

// Rows [m0, m0 + ROWS) x output blocks [b0, b0 + kBlocksPerTile).
template <int ROWS, bool OFFSETS>
O3_AVX512_BF16 void gemm_tile(
    const uint32_t* x, int64_t x_pairs, int64_t m0, const uint16_t* weight,
    const float* scales, const float* offsets, const float* x_sums,
    int64_t steps, int64_t groups, int64_t b0, uint16_t* y, int64_t n_out) {
  const __m512i table = nibble_table();
  const __m512i low = _mm512_set1_epi16(0x000F);
  const int64_t steps_per_group = steps / groups;
  __m512 acc[ROWS][kBlocksPerTile];
  for (int m = 0; m < ROWS; ++m)
    for (int b = 0; b < kBlocksPerTile; ++b) acc[m][b] = _mm512_setzero_ps();

  for (int64_t g = 0; g < groups; ++g) {
    __m512 part[ROWS][kBlocksPerTile];
    for (int m = 0; m < ROWS; ++m)
      for (int b = 0; b < kBlocksPerTile; ++b) part[m][b] = _mm512_setzero_ps();
    for (int64_t s = g * steps_per_group; s < (g + 1) * steps_per_group; ++s) {
      __m512i words[kBlocksPerTile];
      for (int b = 0; b < kBlocksPerTile; ++b)
        words[b] = _mm512_loadu_si512(weight + ((b0 + b) * steps + s) * 32);
      for (int j = 0; j < 4; ++j) {
        __m512bh w[kBlocksPerTile];
        for (int b = 0; b < kBlocksPerTile; ++b)
          w[b] = (__m512bh)_mm512_permutexvar_epi16(
              _mm512_and_si512(_mm512_srli_epi16(words[b], 4 * j), low), table);
        for (int m = 0; m < ROWS; ++m) {
          const __m512bh xs = (__m512bh)_mm512_set1_epi32(
              static_cast<int>(x[(m0 + m) * x_pairs + s * 4 + j]));
          for (int b = 0; b < kBlocksPerTile; ++b)
            part[m][b] = _mm512_dpbf16_ps(part[m][b], w[b], xs);
        }
      }
    }
    for (int b = 0; b < kBlocksPerTile; ++b) {
      const __m512 scale = _mm512_loadu_ps(scales + ((b0 + b) * groups + g) * kBlock);
      for (int m = 0; m < ROWS; ++m)
        acc[m][b] = _mm512_fmadd_ps(part[m][b], scale, acc[m][b]);
      if constexpr (OFFSETS) {
        const __m512 offset =
            _mm512_loadu_ps(offsets + ((b0 + b) * groups + g) * kBlock);
        for (int m = 0; m < ROWS; ++m)
          acc[m][b] = _mm512_fnmadd_ps(
              offset, _mm512_set1_ps(x_sums[(m0 + m) * groups + g]), acc[m][b]);
      }
    }
  }

  for (int m = 0; m < ROWS; ++m) {
    for (int b = 0; b < kBlocksPerTile; ++b) {
      const int64_t n = (b0 + b) * kBlock;
      if (n >= n_out) break;
      const __m256i out = (__m256i)_mm512_cvtneps_pbh(acc[m][b]);
      const __mmask16 keep = n + kBlock <= n_out
                                 ? static_cast<__mmask16>(0xFFFF)
                                 : static_cast<__mmask16>((1u << (n_out - n)) - 1);
      _mm256_mask_storeu_epi16(y + (m0 + m) * n_out + n, keep, out);
    }
  }
}

template <bool OFFSETS>
void gemm_rows(int64_t rows, const uint32_t* x, int64_t x_pairs, int64_t m0,
               const uint16_t* weight, const float* scales,
               const float* offsets, const float* x_sums, int64_t steps,
               int64_t groups, int64_t b0, uint16_t* y, int64_t n_out) {
#define O3_TILE(R)                                                          \
  case R:                                                                   \
    gemm_tile<R, OFFSETS>(x, x_pairs, m0, weight, scales, offsets, x_sums, \
                          steps, groups, b0, y, n_out);                     \
    break;
  switch (rows) {
    O3_TILE(1)
    O3_TILE(2)
    O3_TILE(3)
    O3_TILE(4)
  }
#undef O3_TILE
}

// Per row and group, the sum of the (bfloat16) inputs: what the offsets of
// asymmetric weights multiply. In here rather than as ATen operations, whose
// dispatch cost a sixth of a one-row call.
O3_AVX512_BF16 void group_sums(const uint16_t* x, int64_t rows, int64_t k,
                               int64_t groups, float* sums) {
  const int64_t size = k / groups;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const uint16_t* p = x + r * k + g * size;
      __m512 acc = _mm512_setzero_ps();
      int64_t i = 0;
      for (; i + 16 <= size; i += 16) acc = _mm512_add_ps(acc, bf16x16_to_float(p + i));
      float sum = _mm512_reduce_add_ps(acc);
      for (; i < size; ++i) sum += bf16_to_float(p[i]);
      sums[r * groups + g] = sum;
    }
  }
}

at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& weight,
                     const at::Tensor& scales, const at::Tensor& offsets,
                     int64_t n_out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "int4_gemm: x must be a contiguous 2-D bfloat16 tensor");
  TORCH_CHECK(weight.dim() == 3 && weight.size(2) == 32 &&
                  weight.scalar_type() == at::kShort && weight.is_contiguous(),
              "int4_gemm: weight must be int16 [blocks, steps, 32]");
  const int64_t rows = x.size(0), k = x.size(1);
  const int64_t blocks = weight.size(0), steps = weight.size(1);
  TORCH_CHECK(steps * kStep == k, "int4_gemm: weight holds ", steps * kStep,
              " input channels, x has ", k);
  TORCH_CHECK(blocks % kBlocksPerTile == 0 && n_out <= blocks * kBlock,
              "int4_gemm: ", blocks, " weight blocks cannot hold ", n_out,
              " outputs");
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == blocks &&
                  scales.size(2) == kBlock && scales.scalar_type() == at::kFloat &&
                  scales.is_contiguous(),
              "int4_gemm: scales must be float32 [blocks, groups, 16]");
  const int64_t groups = scales.size(1);
  TORCH_CHECK(groups > 0 && steps % groups == 0,
              "int4_gemm: ", groups, " groups do not divide ", k, " inputs");
  const bool has_offsets = offsets.numel() > 0;
  TORCH_CHECK(!has_offsets || (offsets.sizes() == scales.sizes() &&
                               offsets.scalar_type() == at::kFloat &&
                               offsets.is_contiguous()),
              "int4_gemm: offsets must be empty or shaped like scales");

  at::Tensor y = at::empty({rows, n_out}, x.options());
  if (rows == 0) return y;
  at::Tensor sums;
  if (has_offsets) {
    sums = at::empty({rows, groups}, x.options().dtype(at::kFloat));
    group_sums(reinterpret_cast<const uint16_t*>(x.data_ptr()), rows, k, groups,
               sums.data_ptr<float>());
  }
  const auto* xp = reinterpret_cast<const uint32_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  const float* sp = scales.data_ptr<float>();
  const float* op = has_offsets ? offsets.data_ptr<float>() : nullptr;
  const float* xs = has_offsets ? sums.data_ptr<float>() : nullptr;
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t tiles = blocks / kBlocksPerTile;
  const int64_t chunk = std::max(
      kMaxRowsPerTile,
      kChunkBytes / (k * 2) / kMaxRowsPerTile * kMaxRowsPerTile);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c0 = 0; c0 < rows; c0 += chunk) {
      const int64_t c1 = std::min(rows, c0 + chunk);
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t m0 = c0; m0 < c1; m0 += kMaxRowsPerTile) {
          const int64_t tile_rows = std::min(kMaxRowsPerTile, c1 - m0);
          if (has_offsets)
            gemm_rows<true>(tile_rows, xp, k / 2, m0, wp, sp, op, xs, steps,
                            groups, t * kBlocksPerTile, yp, n_out);
          else
            gemm_rows<false>(tile_rows, xp, k / 2, m0, wp, sp, op, xs, steps,
                             groups, t * kBlocksPerTile, yp, n_out);
        }
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(o3_cpu, m) {
  m.def("int4_gemm(Tensor x, Tensor weight, Tensor scales, Tensor offsets, int n_out) -> Tensor");
  m.impl("int4_gemm", c10::DispatchKey::CPU, TORCH_FN(int4_gemm));
}
