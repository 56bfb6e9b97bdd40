// y = x @ W^T for a 4-bit weight and bfloat16 activations, on x86 CPUs with
// AVX512-BF16: the weight is expanded to bfloat16 in registers only, so each
// call reads 4 bits per weight and every expanded weight serves a tile of
// rows (torch's packed INT4 matmul expands it again for every row). The rows
// go in chunks whose inputs stay in L2, each chunk through every output tile;
// threads split the (chunk, tile) pairs.
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

// The weight tensors' shapes against n_out outputs and k inputs; returns
// the number of groups.
int64_t check_weight(const char* op, const at::Tensor& weight,
                     const at::Tensor& scales, const at::Tensor& offsets,
                     int64_t n_out, int64_t k) {
  TORCH_CHECK(weight.dim() == 3 && weight.size(2) == 32 &&
                  weight.scalar_type() == at::kShort && weight.is_contiguous(),
              op, ": weight must be int16 [blocks, steps, 32]");
  const int64_t blocks = weight.size(0), steps = weight.size(1);
  TORCH_CHECK(steps * kStep == k, op, ": weight holds ", steps * kStep,
              " input channels, x has ", k);
  TORCH_CHECK(blocks % kBlocksPerTile == 0 && n_out <= blocks * kBlock,
              op, ": ", blocks, " weight blocks cannot hold ", n_out, " outputs");
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == blocks &&
                  scales.size(2) == kBlock && scales.scalar_type() == at::kFloat &&
                  scales.is_contiguous(),
              op, ": scales must be float32 [blocks, groups, 16]");
  const int64_t groups = scales.size(1);
  TORCH_CHECK(groups > 0 && steps % groups == 0,
              op, ": ", groups, " groups do not divide ", k, " inputs");
  TORCH_CHECK(offsets.numel() == 0 || (offsets.sizes() == scales.sizes() &&
                                       offsets.scalar_type() == at::kFloat &&
                                       offsets.is_contiguous()),
              op, ": offsets must be empty or shaped like scales");
  return groups;
}

// Output block b of the weight as the reference dequantizes it,
// dense[n, k] = bfloat16(q * scale - zero * scale) (both products exact in
// float32: an 8-bit scale times a 4-bit integer), n < n_out.
O3_AVX512_BF16 void dequantize_block(const uint16_t* weight, const float* scales,
                                     const float* offsets, int64_t b,
                                     int64_t steps, int64_t groups, int64_t n_first,
                                     int64_t n_end, uint16_t* dense) {
  const int64_t k = steps * kStep, steps_per_group = steps / groups;
  const __m512i low = _mm512_set1_epi16(0x000F);
  // Lane w of an expanded nibble belongs to channel w / 2.
  const __m512i first = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  for (int64_t g = 0; g < groups; ++g) {
    const __m512 scale = _mm512_loadu_ps(scales + (b * groups + g) * kBlock);
    // zero * scale: 8 * scale, plus offset = (zero - 8) * scale if asymmetric.
    __m512 zero = _mm512_mul_ps(scale, _mm512_set1_ps(8.0f));
    if (offsets != nullptr)
      zero = _mm512_add_ps(zero, _mm512_loadu_ps(offsets + (b * groups + g) * kBlock));
    const __m512 scale_lo = _mm512_permutexvar_ps(first, scale);
    const __m512 scale_hi = _mm512_permutexvar_ps(second, scale);
    const __m512 zero_lo = _mm512_permutexvar_ps(first, zero);
    const __m512 zero_hi = _mm512_permutexvar_ps(second, zero);
    for (int64_t s = g * steps_per_group; s < (g + 1) * steps_per_group; ++s) {
      const __m512i words = _mm512_loadu_si512(weight + (b * steps + s) * 32);
      // pairs[j]: 32-bit word c = channel c's inputs 2 j and 2 j + 1 of this step.
      __m512i pairs[4];
      for (int j = 0; j < 4; ++j) {
        const __m512i q = _mm512_and_si512(_mm512_srli_epi16(words, 4 * j), low);
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(q)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(q, 1)));
        pairs[j] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmsub_ps(hi, scale_hi, zero_hi),
                                                 _mm512_fmsub_ps(lo, scale_lo, zero_lo));
      }
      // Transpose 4 x 16 words so that each 128-bit lane holds one channel's
      // 8 inputs: lane l of rows[i] is channel 4 l + i.
      const __m512i t0 = _mm512_unpacklo_epi32(pairs[0], pairs[1]);
      const __m512i t1 = _mm512_unpackhi_epi32(pairs[0], pairs[1]);
      const __m512i t2 = _mm512_unpacklo_epi32(pairs[2], pairs[3]);
      const __m512i t3 = _mm512_unpackhi_epi32(pairs[2], pairs[3]);
      alignas(64) uint16_t rows[4][32];
      _mm512_store_si512(rows[0], _mm512_unpacklo_epi64(t0, t2));
      _mm512_store_si512(rows[1], _mm512_unpackhi_epi64(t0, t2));
      _mm512_store_si512(rows[2], _mm512_unpacklo_epi64(t1, t3));
      _mm512_store_si512(rows[3], _mm512_unpackhi_epi64(t1, t3));
      for (int c = 0; c < kBlock; ++c) {
        const int64_t n = b * kBlock + c;
        if (n >= n_end) break;
        std::memcpy(dense + (n - n_first) * k + s * kStep, &rows[c % 4][(c / 4) * kStep],
                    16);
      }
    }
  }
}

// Output channels [n_first, n_end) (n_first a multiple of 16) into dense.
void dequantize_into(const at::Tensor& weight, const at::Tensor& scales,
                     const at::Tensor& offsets, int64_t n_first, int64_t n_end,
                     at::Tensor& dense) {
  const int64_t steps = weight.size(1), groups = scales.size(1);
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  const float* sp = scales.data_ptr<float>();
  const float* op = offsets.numel() > 0 ? offsets.data_ptr<float>() : nullptr;
  auto* dp = reinterpret_cast<uint16_t*>(dense.data_ptr());
  // A block is 16 x k values; a few blocks per thread at least.
  at::parallel_for(n_first / kBlock, (n_end + kBlock - 1) / kBlock,
                   std::max<int64_t>(1, 16384 / (steps * kStep)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t b = begin; b < end; ++b)
                       dequantize_block(wp, sp, op, b, steps, groups, n_first, n_end, dp);
                   });
}

at::Tensor int4_dequantize(const at::Tensor& weight, const at::Tensor& scales,
                           const at::Tensor& offsets, int64_t n_out) {
  const int64_t k = weight.dim() == 3 ? weight.size(1) * kStep : 0;
  check_weight("int4_dequantize", weight, scales, offsets, n_out, k);
  at::Tensor dense = at::empty({n_out, k}, weight.options().dtype(at::kBFloat16));
  dequantize_into(weight, scales, offsets, 0, n_out, dense);
  return dense;
}

at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& weight,
                     const at::Tensor& scales, const at::Tensor& offsets,
                     int64_t n_out, int64_t dense_min_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "int4_gemm: x must be a contiguous 2-D bfloat16 tensor");
  const int64_t rows = x.size(0), k = x.size(1);
  const int64_t groups = check_weight("int4_gemm", weight, scales, offsets, n_out, k);
  const int64_t blocks = weight.size(0), steps = weight.size(1);
  const bool has_offsets = offsets.numel() > 0;

  if (dense_min_rows > 0 && rows >= dense_min_rows) {
    // Dequantized once per call into a buffer this thread keeps (the
    // largest weight it has run so far; layers run one after another), then
    // torch's 16-bit GEMM. Tried and dropped: chunks of output channels that
    // stay in L2, one GEMM each (the calls' overhead made it slower).
    thread_local at::Tensor buffer;
    if (!buffer.defined() || buffer.numel() < n_out * k)
      buffer = at::empty({n_out * k}, x.options());
    at::Tensor dense = buffer.narrow(0, 0, n_out * k).view({n_out, k});
    dequantize_into(weight, scales, offsets, 0, n_out, dense);
    return at::linear(x, dense);
  }

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
  const int64_t chunks = (rows + chunk - 1) / chunk;
  // Work items (row chunk, output tile), chunk-major, split evenly between
  // threads: a thread reads each tile's weight once per chunk it runs, as
  // many bytes as splitting the tiles alone would, and an odd number of
  // tiles (e.g. 9 for 576 outputs) no longer leaves a thread idle for one.
  at::parallel_for(0, chunks * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t c0 = item / tiles * chunk, t = item % tiles;
      const int64_t c1 = std::min(rows, c0 + chunk);
      for (int64_t m0 = c0; m0 < c1; m0 += kMaxRowsPerTile) {
        const int64_t tile_rows = std::min(kMaxRowsPerTile, c1 - m0);
        if (has_offsets)
          gemm_rows<true>(tile_rows, xp, k / 2, m0, wp, sp, op, xs, steps, groups,
                          t * kBlocksPerTile, yp, n_out);
        else
          gemm_rows<false>(tile_rows, xp, k / 2, m0, wp, sp, op, xs, steps, groups,
                           t * kBlocksPerTile, yp, n_out);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(o3_cpu, m) {
  m.def("int4_gemm(Tensor x, Tensor weight, Tensor scales, Tensor offsets, int n_out, "
        "int dense_min_rows) -> Tensor");
  m.impl("int4_gemm", c10::DispatchKey::CPU, TORCH_FN(int4_gemm));
  m.def("int4_dequantize(Tensor weight, Tensor scales, Tensor offsets, int n_out) -> Tensor");
  m.impl("int4_dequantize", c10::DispatchKey::CPU, TORCH_FN(int4_dequantize));
}
