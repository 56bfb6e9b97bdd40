// `routed_tiles.h` compiled for each ISA the kernels run on, in namespaces
// `avx512_bf16` and `avx2` with their own `Vec16`, and `tiles()`: the
// active ISA's. A region's target applies to its functions only: the rest
// of the library stays portable, and `cpu_features.cpp` asks the CPU before
// any of them runs.
#pragma once

#include <c10/util/Exception.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "avx512_bf16.h"
#include "isa.h"

namespace {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")
namespace avx512_bf16 {
#include "vec16_avx512_bf16.h"
#include "routed_tiles.h"
}  // namespace avx512_bf16
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include "vec16_avx2.h"
#include "routed_tiles.h"
}  // namespace avx2
#pragma GCC pop_options

using avx2::kLanes;
constexpr int kMaxPairTileRows = 4;  // pair_gemm_tile_of's

struct Tiles {
  int pair_rows, pair_blocks;
  decltype(&avx2::router_tile) router;
  decltype(&avx2::pair_gemm_tile_of) pair_gemm;
  decltype(&avx2::silu_and_mul_row) silu_and_mul;
  decltype(&avx2::rms_norm_row) rms_norm;
};

const Tiles& tiles() {
  static const Tiles avx512_bf16_tiles{
      avx512_bf16::kPairTileRows, avx512_bf16::kPairTileBlocks, avx512_bf16::router_tile,
      avx512_bf16::pair_gemm_tile_of, avx512_bf16::silu_and_mul_row,
      avx512_bf16::rms_norm_row};
  static const Tiles avx2_tiles{avx2::kPairTileRows, avx2::kPairTileBlocks, avx2::router_tile,
                                avx2::pair_gemm_tile_of, avx2::silu_and_mul_row,
                                avx2::rms_norm_row};
  switch (o3_cpu::active_isa()) {
    case o3_cpu::Isa::kAvx512Bf16: return avx512_bf16_tiles;
    case o3_cpu::Isa::kAvx2: return avx2_tiles;
    default: TORCH_CHECK(false, "o3_cpu kernels: this CPU has neither AVX512-BF16 nor AVX2 with FMA");
  }
}

}  // namespace
