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
// The 4-bit values q expand to 128 + q (exact in bfloat16, `expand_nibbles`);
// per group, on this AVX-512 path,
//   y[m, n] += scale[n, g] * sum_k (128 + q) x[m, k] - shift[n, g] * sum_k x[m, k]
// with shift = (zero + 128) * scale (`product_shift`; zero = 8 for symmetric
// weights).
//
// Where the CPU has AMX-BF16 (`amx_ready`), whose 16-bit GEMM (vLLM's, on
// tiles) is many times faster than dot products from a few rows, calls of
// `amx_min_rows` rows or more run on AMX tiles instead, a pair of blocks at a
// time: below kScaledMaxRows rows with the 4-bit values minus 8 on the tiles,
// each group's tile products times scale, less (zero - 8) * scale times the
// group sum of x for asymmetric weights (`amx_scaled_block_pair`), from there
// with the weight dequantized to the reference's bfloat16 values
// (`PairDequantizer`, `amx_chunk_pair`), and from kDenseMinRows (but see
// kDenseMaxValues, kDenseMinRowsUnblocked) as the whole weight dequantized
// and torch's GEMM (docs/bench_int4_linear.md).
//
// On CPUs without AVX512-BF16 but with AVX2 and FMA (or where `use_isa` chose
// AVX2), `int4_gemm_avx2` runs the same layout through the tiles of
// `int4_tile_avx2.h`, and from kAvx2DenseMinRows rows as the weight
// dequantized into float32 and torch's float32 GEMM.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/alignment.h>
#include <torch/library.h>

#include "avx512_bf16.h"
#include "isa.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kBlock = 16;         // output channels per VDPBF16PS
constexpr int64_t kBlocksPerTile = 4;  // blocks sharing each broadcast of x
constexpr int64_t kStep = 8;           // input channels per 64-byte word group
constexpr int64_t kMaxRowsPerTile = 4;  // rows sharing each expanded weight
// Rows whose inputs stay in L2 while a thread runs its output tiles over them.
constexpr int64_t kChunkBytes = 384 * 1024;

// One step of a block's words, prefetching the step kPrefetchSteps ahead in
// the block's stream (past the weight's end too: prefetches never fault).
// Each thread reads two to four such streams, which the hardware prefetchers
// alone left waiting on memory: 1.21-1.27x at 4-16 rows of the 1b shapes,
// 1.00-1.14x at one row (docs/bench_int4_kernel_ab.md).
constexpr int64_t kPrefetchSteps = 16;
O3_AVX512_BF16 inline __m512i load_step(const uint16_t* words) {
  _mm_prefetch(reinterpret_cast<const char*>(words + kPrefetchSteps * 32), _MM_HINT_T0);
  return _mm512_loadu_si512(words);
}

// 128 + q in bfloat16 for the 4-bit q at bits 4 j to 4 j + 3 of each 16-bit
// word: q becomes the low mantissa bits of 128.0, whose last place is 1, in
// one VPTERNLOGD after the shift. In place of the VPERMW lookup of q - 8
// (`nibble_table`) it took 4-9 % off one-row calls of the 1b shapes, less
// and within the noise at 2-3 rows and on the 135m shapes
// (docs/bench_int4_kernel_ab.md); on the AMX tiles, whose 4 to 63 rows all
// pay for the shift's group sums, it did not pay (0.85-1.0x): the lookup stays.
constexpr float kNibbleBias = 128.0f;
O3_AVX512_BF16 inline __m512i expand_nibbles(__m512i words, int j) {
  const __m512i shifted = j == 0 ? words : _mm512_srli_epi16(words, 4 * j);
  // (shifted & 0x000F) | 0x4300
  return _mm512_ternarylogic_epi32(shifted, _mm512_set1_epi16(0x000F),
                                   _mm512_set1_epi16(0x4300), 0xEA);
}

// q - 8 in bfloat16 for a 4-bit q, looked up by VPERMW from a word shifted
// right to the nibble: the lookup reads five bits and the table repeats
// after 16, so the next nibble's low bit needs no masking.
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

// What block `index`'s group sums of x, times this, take off its products of
// 128 + q: (zero + 128) * scale, exact in float32 (an 8-bit integer times a
// bfloat16 scale). `scale` is the block's scales for the group; `offsets`
// (zero - 8) * scale, or nullptr: symmetric.
O3_AVX512_BF16 inline __m512 product_shift(__m512 scale, const float* offsets,
                                           int64_t index) {
  const __m512 shift = _mm512_mul_ps(scale, _mm512_set1_ps(kNibbleBias + 8));
  if (offsets == nullptr) return shift;
  return _mm512_add_ps(shift, _mm512_loadu_ps(offsets + index * kBlock));
}

// Outputs n to n + 15 of a row as bfloat16, those from n_out on left out.
O3_AVX512_BF16 inline void store_block(__m512 values, int64_t n, int64_t n_out,
                                       uint16_t* y_row) {
  const __mmask16 keep = n + kBlock <= n_out
                             ? static_cast<__mmask16>(0xFFFF)
                             : static_cast<__mmask16>((1u << (n_out - n)) - 1);
  _mm256_mask_storeu_epi16(y_row + n, keep, (__m256i)_mm512_cvtneps_pbh(values));
}

// Rows [m0, m0 + ROWS) x output blocks [b0, b0 + kBlocksPerTile).
template <int ROWS>
O3_AVX512_BF16 void gemm_tile(
    const uint32_t* x, int64_t x_pairs, int64_t m0, const uint16_t* weight,
    const float* scales, const float* offsets, const float* x_sums,
    int64_t steps, int64_t groups, int64_t b0, uint16_t* y, int64_t n_out) {
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
        words[b] = load_step(weight + ((b0 + b) * steps + s) * 32);
      for (int j = 0; j < 4; ++j) {
        __m512bh w[kBlocksPerTile];
        for (int b = 0; b < kBlocksPerTile; ++b)
          w[b] = (__m512bh)expand_nibbles(words[b], j);
        for (int m = 0; m < ROWS; ++m) {
          const __m512bh xs = (__m512bh)_mm512_set1_epi32(
              static_cast<int>(x[(m0 + m) * x_pairs + s * 4 + j]));
          for (int b = 0; b < kBlocksPerTile; ++b)
            part[m][b] = _mm512_dpbf16_ps(part[m][b], w[b], xs);
        }
      }
    }
    for (int b = 0; b < kBlocksPerTile; ++b) {
      const int64_t index = (b0 + b) * groups + g;
      const __m512 scale = _mm512_loadu_ps(scales + index * kBlock);
      const __m512 shift = product_shift(scale, offsets, index);
      for (int m = 0; m < ROWS; ++m)
        acc[m][b] = _mm512_fnmadd_ps(shift, _mm512_set1_ps(x_sums[(m0 + m) * groups + g]),
                                     _mm512_fmadd_ps(part[m][b], scale, acc[m][b]));
    }
  }

  for (int m = 0; m < ROWS; ++m) {
    for (int b = 0; b < kBlocksPerTile; ++b) {
      const int64_t n = (b0 + b) * kBlock;
      if (n >= n_out) break;
      store_block(acc[m][b], n, n_out, y + (m0 + m) * n_out);
    }
  }
}

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include "vec16_avx2.h"
#include "int4_tile_avx2.h"
}  // namespace avx2
#pragma GCC pop_options

void gemm_rows(int64_t rows, const uint32_t* x, int64_t x_pairs, int64_t m0,
               const uint16_t* weight, const float* scales, const float* offsets,
               const float* x_sums, int64_t steps, int64_t groups, int64_t b0,
               uint16_t* y, int64_t n_out) {
#define O3_TILE(R)                                                                      \
  case R:                                                                               \
    gemm_tile<R>(x, x_pairs, m0, weight, scales, offsets, x_sums, steps, groups, b0, y, \
                 n_out);                                                                \
    break;
  switch (rows) {
    O3_TILE(1)
    O3_TILE(2)
    O3_TILE(3)
    O3_TILE(4)
  }
#undef O3_TILE
}

// Per row and group, the sum of the (bfloat16) inputs: what `product_shift`
// multiplies. In here rather than as ATen operations, whose
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

// Block b's scales and zero points for group g, spread over the 32 lanes of
// an expanded step (lane w is channel w / 2).
struct LaneParams {
  __m512 scale_lo, scale_hi, zero_lo, zero_hi;
};

O3_AVX512_BF16 inline LaneParams lane_params(const float* scales, const float* offsets,
                                             int64_t index) {
  const __m512i first = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  const __m512 scale = _mm512_loadu_ps(scales + index * kBlock);
  // zero * scale: 8 * scale, plus offset = (zero - 8) * scale if asymmetric.
  __m512 zero = _mm512_mul_ps(scale, _mm512_set1_ps(8.0f));
  if (offsets != nullptr) zero = _mm512_add_ps(zero, _mm512_loadu_ps(offsets + index * kBlock));
  return {_mm512_permutexvar_ps(first, scale), _mm512_permutexvar_ps(second, scale),
          _mm512_permutexvar_ps(first, zero), _mm512_permutexvar_ps(second, zero)};
}

// One step (8 inputs) of a block as the reference dequantizes it,
// bfloat16(q * scale - zero * scale) (both products exact in float32: an
// 8-bit scale times a 4-bit integer): pairs[j] holds in 32-bit word c
// channel c's inputs 2 j and 2 j + 1, one row of an AMX B tile.
O3_AVX512_BF16 inline void dequantize_step(const uint16_t* words_ptr, const LaneParams& p,
                                           __m512i pairs[4]) {
  const __m512i words = load_step(words_ptr);
  const __m512i low = _mm512_set1_epi16(0x000F);
  for (int j = 0; j < 4; ++j) {
    const __m512i q = _mm512_and_si512(_mm512_srli_epi16(words, 4 * j), low);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(q)));
    const __m512 hi =
        _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(q, 1)));
    pairs[j] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmsub_ps(hi, p.scale_hi, p.zero_hi),
                                             _mm512_fmsub_ps(lo, p.scale_lo, p.zero_lo));
  }
}

// One step of a block as 4-bit values minus 8 (exact in bfloat16), laid out
// as `dequantize_step` lays it out: the group's scale and offset apply to the
// tile products instead (`amx_scaled_block_pair`).
O3_AVX512_BF16 inline void expand_step(const uint16_t* words_ptr, __m512i table,
                                       __m512i pairs[4]) {
  const __m512i words = load_step(words_ptr);
  for (int j = 0; j < 4; ++j)
    pairs[j] = _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4 * j), table);
}

// Every step s of output block b, dequantized: store(s, pairs) with pairs as
// `dequantize_step` gives them.
template <typename Store>
O3_AVX512_BF16 inline void dequantize_steps(const uint16_t* weight, const float* scales,
                                            const float* offsets, int64_t b,
                                            int64_t steps, int64_t groups, Store&& store) {
  const int64_t steps_per_group = steps / groups;
  for (int64_t g = 0; g < groups; ++g) {
    const LaneParams params = lane_params(scales, offsets, b * groups + g);
    for (int64_t s = g * steps_per_group; s < (g + 1) * steps_per_group; ++s) {
      __m512i pairs[4];
      dequantize_step(weight + (b * steps + s) * 32, params, pairs);
      store(s, pairs);
    }
  }
}

// Output block b of the weight, dequantized, into rows of dense [n_out, k].
O3_AVX512_BF16 void dequantize_block(const uint16_t* weight, const float* scales,
                                     const float* offsets, int64_t b, int64_t steps,
                                     int64_t groups, int64_t n_out, uint16_t* dense) {
  const int64_t k = steps * kStep;
  // Transpose 4 x 16 words so that each 128-bit lane holds one channel's 8
  // inputs (lane l of rows[i] is channel 4 l + i), then copy them out.
  const auto to_rows = [&](int64_t s, const __m512i* pairs) O3_AVX512_BF16 {
    const __m512i t0 = _mm512_unpacklo_epi32(pairs[0], pairs[1]);
    const __m512i t1 = _mm512_unpackhi_epi32(pairs[0], pairs[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(pairs[2], pairs[3]);
    const __m512i t3 = _mm512_unpackhi_epi32(pairs[2], pairs[3]);
    alignas(64) uint16_t rows[4][32];
    _mm512_store_si512(rows[0], _mm512_unpacklo_epi64(t0, t2));
    _mm512_store_si512(rows[1], _mm512_unpackhi_epi64(t0, t2));
    _mm512_store_si512(rows[2], _mm512_unpacklo_epi64(t1, t3));
    _mm512_store_si512(rows[3], _mm512_unpackhi_epi64(t1, t3));
    for (int c = 0; c < kBlock && b * kBlock + c < n_out; ++c)
      std::memcpy(dense + (b * kBlock + c) * k + s * kStep,
                  &rows[c % 4][(c / 4) * kStep], 16);
  };
  dequantize_steps(weight, scales, offsets, b, steps, groups, to_rows);
}

// y = x @ dense^T for calls of thousands of rows (AVX2: hundreds): the
// whole weight dequantized block by block by `dequantize` into a buffer of
// `dtype` this thread keeps (the largest weight it has run so far; layers run
// one after another), then torch's GEMM in that dtype, whose blocking beats
// `amx_pairs` (AVX2: `int4_tile`) once the dequantization is spread over
// that many rows. bfloat16 on AMX; float32 on AVX2, where torch's bfloat16
// GEMM is a plain loop.
template <typename T, typename Dequantize>
at::Tensor dense_gemm(const at::Tensor& x, const at::Tensor& weight,
                      const at::Tensor& scales, const at::Tensor& offsets,
                      int64_t n_out, at::ScalarType dtype, Dequantize dequantize) {
  const int64_t k = x.size(1), steps = weight.size(1), groups = scales.size(1);
  thread_local at::Tensor buffer;  // one per T
  if (!buffer.defined() || buffer.numel() < n_out * k)
    buffer = at::empty({n_out * k}, x.options().dtype(dtype));
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  const float* sp = scales.data_ptr<float>();
  const float* op = offsets.numel() > 0 ? offsets.data_ptr<float>() : nullptr;
  auto* dp = reinterpret_cast<T*>(buffer.data_ptr());
  at::parallel_for(0, (n_out + kBlock - 1) / kBlock, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) dequantize(wp, sp, op, b, steps, groups, n_out, dp);
  });
  const at::Tensor dense = buffer.narrow(0, 0, n_out * k).view({n_out, k});
  return at::linear(x.to(dtype), dense).to(x.scalar_type());
}

// AMX: tiles 0-1 hold 32 rows of x (16 each, 32 inputs), 2-3 two blocks of
// the weight dequantized (16 input pairs x 16 channels), 4-7 the products.
constexpr int64_t kTileInputs = 32;
constexpr int64_t kTileRows = 16;
constexpr int64_t kTileValues = kTileRows * kTileInputs;
// From this many rows (on AMX CPUs) dequantizing the whole weight and running
// torch's GEMM (`dense_gemm`) is as fast as `amx_pairs` or faster on the
// 135m FFN shapes: `amx_pairs` was 1.41x / 1.16-1.57x / 1.02x of it at
// 1024 / 1280 / 1536 rows, 0.82-0.84x at 1792 and 0.72-0.88x at 8192 ...
constexpr int64_t kDenseMinRows = 1536;
// ... but not where the weight has this many values or more: its dequantized
// copy (32 MB) leaves the caches and comes back from memory for torch's GEMM,
// while `amx_pairs` dequantizes panels that stay in L2. `amx_pairs` was
// 1.05-1.54x of `dense_gemm` on the 1b gate_up (23 M values) at 1024-8192
// rows. (Measured on the two presets' shapes only: 0.9-1.8 M and 11.5-23 M
// values.)
constexpr int64_t kDenseMaxValues = 16 << 20;
// Below this many rows `amx_scaled_block_pair` runs, from it the dequantized
// weight (whose cheaper tile loop wins once the dequantization is spread over
// the rows): about even at 64 rows on the FFN shapes of both presets.
constexpr int64_t kScaledMaxRows = 64;
// From kScaledMaxRows rows, where x takes a core's whole L2 (2 MB on Sapphire
// and Emerald Rapids) or more, `amx_pairs` dequantizes block pairs into
// panels of kPanelBytes (two pairs at least), two panels at a time; smaller x
// was as fast or faster one pair at a time.
constexpr int64_t kPanelMinXBytes = 2 * 1024 * 1024;
constexpr int64_t kPanelBytes = 512 * 1024;
// Such x whose inputs fit kRowBlockBytes per kMinBlockRows rows or more
// (2048 inputs or fewer) instead goes in blocks of rows of about
// kRowBlockBytes, each through every block pair, the weight dequantized
// again per block: x then stays in L2 next to the pair. 1.10-1.19x on the 1b
// gate_up (2048 inputs) at 512-960 rows in four A/B runs; blocks of 256 rows
// of the 1b down (5632 inputs, 2.8 MB) were 0.87-0.95x, the dequantization
// repeated without x fitting (docs/bench_int4_kernel_ab.md).
constexpr int64_t kRowBlockBytes = 1024 * 1024;
constexpr int64_t kMinBlockRows = 256;
// Calls whose x cannot go in such blocks (over 2048 inputs) run `dense_gemm`
// from this many rows: 1.00-1.40x of `amx_pairs` (median 1.23x) on the 1b
// down at 640-960 rows in three A/B runs, 0.82x at 256 and 1.03x at 512.
constexpr int64_t kDenseMinRowsUnblocked = 640;
// From this many bytes of y, `amx_chunk_pair` writes y past the caches
// (non-temporal stores of whole lines), which y that size leaves before it
// is read again anyway: each 64-byte line is then written without first
// being read, and (presumably what else it saves) the rows of a pair's
// column of y, a multiple of 2 KB apart on three of the four FFN shapes, no
// longer crowd a few L1 sets. Prefetching y's lines for writing did not
// help. Whole FFNs (gate_up, vLLM's SiluAndMul, down; `int4_kernel_ab
// --ffn`): 1.09-1.11x on the 1b at 128-512 rows, 1.10-1.18x on the 135m at
// 128-768; streaming every y was 0.91x on the 135m FFN at 64 rows (0.4 MB
// of y, which stays in L2) and 0.99x at 128-192 (ad hoc).
constexpr int64_t kStreamMinYBytes = 1024 * 1024;
#define O3_AMX \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The CPU has AMX-BF16 and the kernel lets this process use its tiles.
bool amx_ready() {
  static const bool ready = [] {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool tile = edx & (1u << 24), bf16 = edx & (1u << 22);
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;  // asm/prctl.h
    return tile && bf16 && syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ready;
}

// Memory for tiles, 64-byte aligned: tile rows that straddle two cache
// lines (malloc aligns to 16 bytes) load 2-3x slower, and the tile loads
// are what the AMX loops wait on (an ad hoc loop on Emerald Rapids: ~17
// cycles per aligned 1 KB tile from L1, ~48 straddling, 16 per TDPBF16PS).
// ~10 % off a 512-row call of the 135m gate_up, hot caches. ATen's CPU
// allocator gives that alignment.
static_assert(c10::gAlignment >= 64, "tile buffers need 64-byte alignment");

at::Tensor tile_buffer(int64_t values) {
  return at::empty({values}, at::TensorOptions().dtype(at::kBFloat16));
}

uint16_t* tiles_of(const at::Tensor& buffer) {
  return static_cast<uint16_t*>(buffer.data_ptr());
}

// Step s of a block as four B-tile rows (`pairs`) into its tiles, tile t
// at `tiles` + t * 512 values.
O3_AVX512_BF16 inline void store_tile_rows(uint16_t* tiles, int64_t s, const __m512i* pairs) {
  uint16_t* tile = tiles + (s / 4) * kTileValues;
  for (int j = 0; j < 4; ++j) _mm512_storeu_si512(tile + ((s % 4) * 4 + j) * 32, pairs[j]);
}

// x as A tiles of `tile_rows` rows x 32 inputs, each in tile_rows * 64
// bytes of its own: tiles 2 t and 2 t + 1 of a chunk of 2 * tile_rows rows
// hold its inputs [32 t, 32 t + 32), the chunk at values + m0 * k; rows past
// the last are zeros. Loaded at x's own stride (2 k bytes, 4 KB for 2048
// inputs) a tile's rows fall into one set of the L1 cache; packed, they are
// consecutive cache lines. The threads pack the rows between them: 1.04-1.08x
// on the 135m gate_up and 1b down at 64-512 rows (ad hoc A/B; on one thread
// the copy was 7 % and 15 % of their 512-row calls).
struct ATiles {
  at::Tensor buffer;
  uint16_t* values;
  int64_t tile_rows;

  ATiles(const uint16_t* x, int64_t rows, int64_t k, int64_t tile_rows)
      : tile_rows(tile_rows) {
    const int64_t chunk_rows = 2 * tile_rows;
    const int64_t last = (rows - 1) / chunk_rows * chunk_rows;  // the last chunk's start
    buffer = tile_buffer((last + chunk_rows) * k);
    values = tiles_of(buffer);
    if (rows - last < chunk_rows)
      std::fill(values + last * k, values + (last + chunk_rows) * k, 0);
    at::parallel_for(0, rows, chunk_rows, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        const int64_t half = m / tile_rows;  // chunk * 2 + which of its tiles
        uint16_t* row = values + (half / 2) * chunk_rows * k +
                        ((half % 2) * tile_rows + m % tile_rows) * kTileInputs;
        for (int64_t t = 0; t < k / kTileInputs; ++t)
          std::memcpy(row + 2 * t * tile_rows * kTileInputs, x + m * k + t * kTileInputs,
                      kTileInputs * sizeof(uint16_t));
      }
    });
  }
  int64_t chunk_rows() const { return 2 * tile_rows; }
  int64_t tile_values() const { return tile_rows * kTileInputs; }
  const uint16_t* chunk(int64_t m0, int64_t k) const { return values + m0 * k; }
};

// Rows per A tile for a call of `rows`. From kScaledMaxRows rows the 32-row
// chunks are evened out, so that the last is not mostly padding, which a
// TDPBF16PS pays for like rows (70 rows: 3 chunks of 24 rather than 32, 32
// and 6 padded to 32). Below, 16: up to 32 rows the tiles are configured to
// the call's rows, and `amx_scaled_block_pair` skips a last chunk's empty
// second tile, which evened-out tiles measured slower than at 33-63 rows.
int64_t a_tile_rows(int64_t rows) {
  if (rows < kScaledMaxRows) return kTileRows;
  const int64_t chunks = (rows + 2 * kTileRows - 1) / (2 * kTileRows);
  return (rows + 2 * chunks - 1) / (2 * chunks);
}

// Block pairs [first, end) dequantized step by step into consecutive
// `amx_chunk_pair` B tiles (a pair's tile t of block i at
// ((pair - first) * 2 * k / 32 + i * k / 32 + t) * 512 values), so that the
// next panel's dequantization can run between the tile products of this
// one: the AVX-512 units work while the AMX unit goes through its queue.
struct PairDequantizer {
  const uint16_t* weight;
  const float* scales;
  const float* offsets;
  int64_t steps, groups;
  uint16_t* tiles = nullptr;
  int64_t left = 0;       // steps still to dequantize
  int64_t block = 0, s = 0;  // the next one
  int64_t group_left = 0;    // steps before the next group's parameters
  LaneParams params;

  void start(int64_t first, int64_t end, uint16_t* into) {
    tiles = into;
    left = (end - first) * 2 * steps;
    block = 2 * first;
    s = 0;
    group_left = 0;
  }

  O3_AVX512_BF16 void step() {
    const int64_t steps_per_group = steps / groups;
    if (group_left == 0) {
      params = lane_params(scales, offsets, block * groups + s / steps_per_group);
      group_left = steps_per_group;
    }
    --group_left;
    __m512i pairs[4];
    dequantize_step(weight + (block * steps + s) * 32, params, pairs);
    store_tile_rows(tiles, s, pairs);
    --left;
    if (++s == steps) {
      s = 0;
      ++block;
      tiles += steps / 4 * kTileValues;  // the block's k / 32 tiles
    }
  }
};

// Rows [m0, m0 + count) (the chunk of `x` there; past count zeros) of output
// blocks 2 p and 2 p + 1, from the pair's `PairDequantizer` tiles; `next`
// goes on `steps_per_tile` steps per 32 inputs.
O3_AMX void amx_chunk_pair(const ATiles& x, int64_t m0, int64_t count, int64_t k,
                           const uint16_t* b_tiles, int64_t p, uint16_t* y,
                           int64_t n_out, bool stream, PairDequantizer& next,
                           int64_t steps_per_tile) {
  const int64_t k_tiles = k / kTileInputs, a_rows = x.tile_rows;
  const int64_t a_values = x.tile_values();
  const uint16_t* a = x.chunk(m0, k);
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t t = 0; t < k_tiles; ++t) {
    _tile_loadd(0, a + 2 * t * a_values, 64);
    _tile_loadd(1, a + (2 * t + 1) * a_values, 64);
    _tile_loadd(2, b_tiles + t * kTileValues, 64);
    _tile_loadd(3, b_tiles + (k_tiles + t) * kTileValues, 64);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 0, 3);
    _tile_dpbf16ps(6, 1, 2);
    _tile_dpbf16ps(7, 1, 3);
    for (int64_t n = 0; n < steps_per_tile && next.left > 0; ++n) next.step();
  }
  alignas(64) float c[4][kTileRows][kBlock];
  _tile_stored(4, c[0], 64);
  _tile_stored(5, c[1], 64);
  _tile_stored(6, c[2], 64);
  _tile_stored(7, c[3], 64);
  for (int h = 0; h < 2; ++h) {
    for (int64_t r = 0; r < a_rows && h * a_rows + r < count; ++r) {
      uint16_t* y_row = y + (m0 + h * a_rows + r) * n_out;
      if (stream) {  // both blocks' outputs: one whole line
        _mm512_stream_si512(reinterpret_cast<__m512i*>(y_row + 2 * p * kBlock),
                            (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(c[h * 2 + 1][r]),
                                                         _mm512_load_ps(c[h * 2][r])));
        continue;
      }
      for (int i = 0; i < 2; ++i) {
        const int64_t n = (2 * p + i) * kBlock;
        if (n >= n_out) break;
        store_block(_mm512_load_ps(c[h * 2 + i][r]), n, n_out, y_row);
      }
    }
  }
}

// Output blocks 2 p and 2 p + 1 for calls of fewer than kScaledMaxRows rows,
// without dequantizing the weight: the tiles hold its 4-bit values minus 8
// (`expand_step`, a fifth of the dequantization's instructions) and each
// group's products are scaled into float32 sums `acc` (32 per row), as the
// AVX512-BF16 GEMM does; `x_sums` are the rows' group sums (asymmetric
// weights only). Group by group, so that a group's B tiles (`b_tiles`, 2 KB
// per 32 inputs) are expanded into L1 and serve every row from there. x is
// in `ATiles` of 16 rows (`a_tile_rows`): constant tile offsets, no divisions
// by a tile's rows in the loops over rows, which cost 10-20 % here.
O3_AMX void amx_scaled_block_pair(const uint16_t* a_tiles, int64_t rows, int64_t k,
                                  const uint16_t* weight, const float* scales,
                                  const float* offsets, const float* x_sums,
                                  int64_t steps, int64_t groups, int64_t p,
                                  uint16_t* b_tiles, float* acc, uint16_t* y,
                                  int64_t n_out) {
  const int64_t tiles_per_group = k / kTileInputs / groups;
  const int64_t steps_per_group = steps / groups;
  const __m512i table = nibble_table();
  std::fill(acc, acc + rows * 2 * kBlock, 0.0f);
  alignas(64) float c[4][kTileRows][kBlock];
  for (int64_t g = 0; g < groups; ++g) {
    for (int i = 0; i < 2; ++i) {
      for (int64_t s = 0; s < steps_per_group; ++s) {
        __m512i pairs[4];
        expand_step(weight + ((2 * p + i) * steps + g * steps_per_group + s) * 32, table,
                    pairs);
        store_tile_rows(b_tiles + i * tiles_per_group * kTileValues, s, pairs);
      }
    }
    for (int64_t m0 = 0; m0 < rows; m0 += 2 * kTileRows) {
      const int64_t count = std::min(2 * kTileRows, rows - m0);
      const bool both = count > kTileRows;  // rows in the second A tile
      const uint16_t* a = a_tiles + m0 * k + 2 * g * tiles_per_group * kTileValues;
      _tile_zero(4);
      _tile_zero(5);
      if (both) {
        _tile_zero(6);
        _tile_zero(7);
      }
      for (int64_t t = 0; t < tiles_per_group; ++t) {
        _tile_loadd(0, a + 2 * t * kTileValues, 64);
        _tile_loadd(2, b_tiles + t * kTileValues, 64);
        _tile_loadd(3, b_tiles + (tiles_per_group + t) * kTileValues, 64);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(5, 0, 3);
        if (both) {
          _tile_loadd(1, a + (2 * t + 1) * kTileValues, 64);
          _tile_dpbf16ps(6, 1, 2);
          _tile_dpbf16ps(7, 1, 3);
        }
      }
      _tile_stored(4, c[0], 64);
      _tile_stored(5, c[1], 64);
      if (both) {
        _tile_stored(6, c[2], 64);
        _tile_stored(7, c[3], 64);
      }
      for (int i = 0; i < 2; ++i) {
        const int64_t index = (2 * p + i) * groups + g;
        const __m512 scale = _mm512_loadu_ps(scales + index * kBlock);
        for (int64_t r = 0; r < count; ++r) {
          float* sums = acc + ((m0 + r) * 2 + i) * kBlock;
          __m512 sum = _mm512_fmadd_ps(
              _mm512_load_ps(c[(r / kTileRows) * 2 + i][r % kTileRows]), scale,
              _mm512_loadu_ps(sums));
          if (offsets != nullptr)
            sum = _mm512_fnmadd_ps(_mm512_loadu_ps(offsets + index * kBlock),
                                   _mm512_set1_ps(x_sums[(m0 + r) * groups + g]), sum);
          _mm512_storeu_ps(sums, sum);
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int i = 0; i < 2; ++i) {
      const int64_t n = (2 * p + i) * kBlock;
      if (n >= n_out) break;
      store_block(_mm512_loadu_ps(acc + (r * 2 + i) * kBlock), n, n_out, y + r * n_out);
    }
  }
}

// x of `k` inputs goes in blocks of rows (kRowBlockBytes).
bool blockable(int64_t k) { return kRowBlockBytes / (k * 2) >= kMinBlockRows; }

// The rows `amx_pairs` runs through every block pair at a time: all of them,
// or blocks of whole chunks (kRowBlockBytes).
int64_t row_block(int64_t rows, int64_t k, int64_t chunk_rows) {
  if (rows * k * 2 < kPanelMinXBytes || !blockable(k)) return rows;
  const int64_t block = kRowBlockBytes / (k * 2);
  const int64_t chunks = (rows + chunk_rows - 1) / chunk_rows, blocks = rows / block;
  return (chunks + blocks - 1) / blocks * chunk_rows;
}

// Block pairs [begin, end) on this thread (tile state is per thread).
O3_AMX void amx_pairs(int64_t begin, int64_t end, const ATiles& x, int64_t rows,
                      int64_t k, const uint16_t* weight, const float* scales,
                      const float* offsets, const float* x_sums, int64_t steps,
                      int64_t groups, uint16_t* y, int64_t n_out) {
  // A and C tiles of the rows they hold (`a_tile_rows`): tiles 0, 4, 5 the
  // first half of each chunk, 1, 6, 7 the second, 2 and 3 the weight.
  const int64_t first = rows < 2 * kTileRows ? std::min(rows, kTileRows) : x.tile_rows;
  const int64_t second = rows < 2 * kTileRows ? rows - first : x.tile_rows;
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    const int64_t tile_rows = t == 2 || t == 3 ? kTileRows
                              : t == 0 || t == 4 || t == 5 ? first
                                                           : second;
    config.rows[t] = static_cast<uint8_t>(tile_rows);
    config.colsb[t] = tile_rows > 0 ? 64 : 0;
  }
  _tile_loadconfig(&config);
  const int64_t pair_values = 2 * k * kBlock;
  if (rows < kScaledMaxRows) {
    const at::Tensor b_tiles = tile_buffer(pair_values);
    std::vector<float> acc(rows * 2 * kBlock);
    for (int64_t p = begin; p < end; ++p)
      amx_scaled_block_pair(x.values, rows, k, weight, scales, offsets, x_sums,
                            steps, groups, p, tiles_of(b_tiles), acc.data(), y, n_out);
  } else {
    // Per block of rows (`row_block`), pairs in panels (kPanelBytes; one
    // pair where the block is under kPanelMinXBytes), each chunk of rows
    // through a whole panel: a chunk of large x is then read from L2 once
    // per panel rather than from memory once per pair. The next panel is
    // dequantized between the tile products of this one.
    const int64_t block_rows = row_block(rows, k, x.chunk_rows());
    // Non-temporal stores (kStreamMinYBytes) where each pair's outputs are
    // whole, aligned lines of y.
    const bool stream = rows * n_out * 2 >= kStreamMinYBytes && n_out % (2 * kBlock) == 0 &&
                        reinterpret_cast<uintptr_t>(y) % 64 == 0;
    const int64_t panel = block_rows * k * 2 < kPanelMinXBytes
                              ? 1
                              : std::max<int64_t>(2, kPanelBytes / (pair_values * 2));
    // Uninitialised: every tile is dequantized into before it is read (a
    // zero fill would write up to 1 MB per thread per call).
    const int64_t buffer_values = std::min(panel, end - begin) * pair_values;
    const at::Tensor b_tiles = tile_buffer(2 * buffer_values);
    uint16_t* buffers[2] = {tiles_of(b_tiles), tiles_of(b_tiles) + buffer_values};
    PairDequantizer next{weight, scales, offsets, steps, groups};
    for (int64_t r0 = 0; r0 < rows; r0 += block_rows) {
      const int64_t r1 = std::min(rows, r0 + block_rows);
      next.start(begin, std::min(end, begin + panel), buffers[0]);
      while (next.left > 0) next.step();
      const int64_t chunks = (r1 - r0 + x.chunk_rows() - 1) / x.chunk_rows();
      for (int64_t p0 = begin, i = 0; p0 < end; p0 += panel, i ^= 1) {
        const int64_t p1 = std::min(end, p0 + panel);
        next.start(p1, std::min(end, p1 + panel), buffers[i ^ 1]);
        const int64_t calls = chunks * (p1 - p0), k_tiles = k / kTileInputs;
        const int64_t per_tile = (next.left + calls * k_tiles - 1) / (calls * k_tiles);
        for (int64_t m0 = r0; m0 < r1; m0 += x.chunk_rows())
          for (int64_t p = p0; p < p1; ++p)
            amx_chunk_pair(x, m0, std::min(x.chunk_rows(), r1 - m0), k,
                           buffers[i] + (p - p0) * pair_values, p, y, n_out, stream,
                           next, per_tile);
        while (next.left > 0) next.step();
      }
    }
    if (stream) _mm_sfence();  // the stores visible before the threads join
  }
  _tile_release();
}

// run(m0, tile_rows, unit) over `rows` rows of `row_bytes` each, in chunks
// of rows that stay in L2 (kChunkBytes), each chunk through every output
// unit in tiles of up to `max_tile_rows` rows. Work items (row chunk, output
// unit), chunk-major, split evenly between threads: a thread reads each
// unit's weight once per chunk it runs, as many bytes as splitting the units
// alone would, and an odd number of units (e.g. 9 tiles for 576 outputs) no
// longer leaves a thread idle for one.
template <typename Run>
void for_each_tile(int64_t rows, int64_t row_bytes, int64_t max_tile_rows, int64_t units,
                   const Run& run) {
  const int64_t chunk =
      std::max(max_tile_rows, kChunkBytes / row_bytes / max_tile_rows * max_tile_rows);
  const int64_t chunks = (rows + chunk - 1) / chunk;
  at::parallel_for(0, chunks * units, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t c0 = item / units * chunk, unit = item % units;
      const int64_t c1 = std::min(rows, c0 + chunk);
      for (int64_t m0 = c0; m0 < c1; m0 += max_tile_rows)
        run(m0, std::min(max_tile_rows, c1 - m0), unit);
    }
  });
}

// From these rows `int4_gemm_avx2` dequantizes the whole weight for torch's
// float32 GEMM: between 129 and 256 rows it overtook the first tiles (which
// dequantized in registers) on the FFN shapes of the 1b and 135m presets;
// the present ones run a row about as fast as it does from 129 to 512 rows
// (docs/bench_int4_linear.md).
constexpr int64_t kAvx2DenseMinRows = 192;

// `int4_gemm` on AVX2: x widened to float32 (with its group sums) once, then
// as on AVX-512, rows in chunks that stay in L2, threads splitting (chunk,
// output block) pairs.
at::Tensor int4_gemm_avx2(const at::Tensor& x, const at::Tensor& weight,
                          const at::Tensor& scales, const at::Tensor& offsets,
                          int64_t n_out, int64_t groups) {
  const int64_t rows = x.size(0), k = x.size(1);
  const int64_t steps = weight.size(1);
  if (rows >= kAvx2DenseMinRows)
    return dense_gemm<float>(x, weight, scales, offsets, n_out, at::kFloat,
                             avx2::dequantize_block);
  at::Tensor y = at::empty({rows, n_out}, x.options());
  if (rows == 0) return y;
  at::Tensor wide = at::empty({rows, k}, x.options().dtype(at::kFloat));
  at::Tensor sums = at::empty({rows, groups}, x.options().dtype(at::kFloat));
  const auto* x16 = reinterpret_cast<const uint16_t*>(x.data_ptr());
  float* xf = wide.data_ptr<float>();
  float* xs = sums.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / k), [&](int64_t begin, int64_t end) {
    avx2::widen_rows(x16, k, groups, begin, end, xf, xs);
  });
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  const float* sp = scales.data_ptr<float>();
  const float* op = offsets.numel() > 0 ? offsets.data_ptr<float>() : nullptr;
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t blocks = (n_out + kBlock - 1) / kBlock;  // the rest is padding
  for_each_tile(rows, k * 4, avx2::kInt4TileRows, blocks,
                [&](int64_t m0, int64_t tile_rows, int64_t b) {
                  avx2::int4_tile_of(static_cast<int>(tile_rows), xf + m0 * k,
                                     xs + m0 * groups, k, wp, sp, op, steps, groups, b,
                                     yp + m0 * n_out, n_out);
                });
  return y;
}

at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& weight,
                     const at::Tensor& scales, const at::Tensor& offsets,
                     int64_t n_out, int64_t amx_min_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "int4_gemm: x must be a contiguous 2-D bfloat16 tensor");
  const int64_t rows = x.size(0), k = x.size(1);
  const int64_t groups = check_weight("int4_gemm", weight, scales, offsets, n_out, k);
  switch (o3_cpu::active_isa()) {
    case o3_cpu::Isa::kAvx512Bf16: break;
    case o3_cpu::Isa::kAvx2: return int4_gemm_avx2(x, weight, scales, offsets, n_out, groups);
    default: TORCH_CHECK(false, "int4_gemm: this CPU has neither AVX512-BF16 nor AVX2 with FMA");
  }
  const int64_t blocks = weight.size(0), steps = weight.size(1);
  const bool has_offsets = offsets.numel() > 0;

  // The tiles take 32 inputs at a time, each group's in one tile row or more.
  const bool amx = amx_min_rows > 0 && rows >= amx_min_rows &&
                   (k / groups) % kTileInputs == 0 && amx_ready();
  const bool dense = blockable(k) ? rows >= kDenseMinRows && n_out * k < kDenseMaxValues
                                  : rows >= kDenseMinRowsUnblocked;
  if (amx && dense)
    return dense_gemm<uint16_t>(x, weight, scales, offsets, n_out, at::kBFloat16,
                                dequantize_block);
  at::Tensor y = at::empty({rows, n_out}, x.options());
  if (rows == 0) return y;
  const auto* x16 = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  const float* sp = scales.data_ptr<float>();
  const float* op = has_offsets ? offsets.data_ptr<float>() : nullptr;
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  // Each row's group sums: for the shift on the AVX-512 path, and below
  // kScaledMaxRows rows on AMX for the offsets of asymmetric weights, which
  // apply to products there; from it `amx_pairs` folds the offsets into the
  // dequantized weight.
  at::Tensor sums;
  if (!amx || (has_offsets && rows < kScaledMaxRows)) {
    sums = at::empty({rows, groups}, x.options().dtype(at::kFloat));
    group_sums(x16, rows, k, groups, sums.data_ptr<float>());
  }
  const float* xs = sums.defined() ? sums.data_ptr<float>() : nullptr;
  if (amx) {
    const ATiles a_tiles(x16, rows, k, a_tile_rows(rows));
    // Threads split pairs of output blocks.
    at::parallel_for(0, blocks / 2, 1, [&](int64_t begin, int64_t end) {
      amx_pairs(begin, end, a_tiles, rows, k, wp, sp, op, xs, steps, groups, yp, n_out);
    });
    return y;
  }
  // Pairs of bfloat16 inputs, as the dot products take them.
  const auto* xp = reinterpret_cast<const uint32_t*>(x16);
  for_each_tile(rows, k * 2, kMaxRowsPerTile, blocks / kBlocksPerTile,
                [&](int64_t m0, int64_t tile_rows, int64_t t) {
                  gemm_rows(tile_rows, xp, k / 2, m0, wp, sp, op, xs, steps, groups,
                            t * kBlocksPerTile, yp, n_out);
                });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(o3_cpu, m) {
  m.def("int4_gemm(Tensor x, Tensor weight, Tensor scales, Tensor offsets, int n_out, "
        "int amx_min_rows) -> Tensor");
  m.impl("int4_gemm", c10::DispatchKey::CPU, TORCH_FN(int4_gemm));
  m.def("amx_ready() -> bool");
  m.impl("amx_ready", c10::DispatchKey::CatchAll, TORCH_FN(amx_ready));
}
